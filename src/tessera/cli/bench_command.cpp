// tessera bench <what>: benchmarks. Each subcommand checks its own kernels' results before
// timing them and prints a markdown table (and JSON with -o).
#include <fmt/format.h>

#include "tessera/bench/model_bench.h"
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
