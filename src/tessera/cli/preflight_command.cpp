// tessera preflight: versions, GPU memory and two quick measurements against the datasheet,
// as one markdown report with a verdict per line (bench/preflight.h has the thresholds).
#include <fmt/format.h>

#include "tessera/analysis/report_output.h"
#include "tessera/bench/command_args.h"
#include "tessera/bench/preflight.h"
#include "tessera/cli/commands.h"

namespace tessera::cli {

int preflight_command(const Args& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    fmt::print(
        "usage: tessera preflight [--gpu NAME] [--gemm_size 8192] [--copy_mib 1024] [-o DIR]\n\n"
        "Reports the GPUs, CUDA driver and runtime, cuBLASLt, cuDNN and NCCL versions (the last\n"
        "two loaded at run time if present), GPU memory, and checks a bf16 GEMM (>= 70% of the\n"
        "datasheet peak) and device-to-device copy bandwidth (>= 70% of the HBM datasheet\n"
        "bandwidth) against configs/gpus.yaml (--gpu picks the entry; default: the device name),\n"
        "and with two or more GPUs a checked 256 MiB NCCL all-reduce (bus bandwidth).\n"
        "Each line is pass, warn or info; without a GPU the report says so in warn lines.\n"
        "Exit code 0 whenever the report was made, warnings or not. -o DIR writes preflight.csv\n"
        "and preflight.md. See docs/cli.md.\n");
    return 0;
  }
  const bench::CommandArgs a(args, {"gpu", "gemm_size", "copy_mib", "output"}, {}, false);
  bench::PreflightOptions o;
  o.gpu = a.get("gpu", "");
  o.gemm_size = a.get_int("gemm_size", 8192, 64);
  o.copy_mib = a.get_int("copy_mib", 1024, 1);
  const bench::PreflightReport r = bench::run_preflight(o);
  analysis::print_and_write(a.get("output", ""), {r.checks}, "preflight.md", r.markdown);
  return 0;
}

}  // namespace tessera::cli
