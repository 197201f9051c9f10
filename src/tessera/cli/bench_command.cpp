// tessera bench <what>: benchmarks. Each subcommand checks its own kernels' results before
// timing them and prints a markdown table (and, with -o, writes it as CSV or JSON).
#include <fmt/format.h>

#include "tessera/bench/attention_bench.h"
#include "tessera/bench/comm_bench.h"
#include "tessera/bench/gemm_bench.h"
#include "tessera/bench/membw_bench.h"
#include "tessera/bench/model_bench.h"
#include "tessera/bench/tokenizer_bench.h"
#include "tessera/cli/commands.h"
#include "tessera/core/error.h"

namespace tessera::cli {

int bench_command(const Args& args) {
  struct Sub {
    const char* name;
    const char* summary;
    int (*run)(const std::vector<std::string>&);
  };
  static constexpr Sub kSubs[] = {
      {"model", "proxy-model training throughput, MFU and time breakdown", bench::model_bench_command},
      {"gemm", "matmul TFLOP/s: square sweeps or a config's GEMMs, layouts, epilogues",
       bench::gemm_bench_command},
      {"attention", "fused attention TFLOP/s: masks, GQA, head dims, 1k-32k tokens, fwd/bwd",
       bench::attention_bench_command},
      {"membw", "device-to-device copy bandwidth (read + write) vs the HBM datasheet",
       bench::membw_bench_command},
      {"comm", "NCCL collectives' algbw/busbw over 1 KiB..1 GiB (under `tessera launch`)",
       bench::comm_bench_command},
      {"tokenizer", "tokenizer MB/s on one and many threads, checked against @huggingface/tokenizers",
       bench::tokenizer_bench_command},
  };
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    fmt::print("usage: tessera bench <benchmark> [options]\n\nbenchmarks:\n");
    for (const auto& s : kSubs) fmt::print("  {:<10} {}\n", s.name, s.summary);
    return args.empty() ? kExitInvalidInput : 0;
  }
  for (const auto& s : kSubs)
    if (args[0] == s.name) return s.run(Args(args.begin() + 1, args.end()));
  throw ConfigError("command line", "bench", args[0], "one of the benchmarks `tessera bench --help` lists");
}

}  // namespace tessera::cli
