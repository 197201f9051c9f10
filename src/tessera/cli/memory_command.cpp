// tessera memory: will this configuration fit, and with what micro batch? Plans per-GPU
// memory without touching a GPU (see plan/memory_plan.h for what is counted).
#include <fmt/format.h>

#include "tessera/analysis/report_output.h"
#include "tessera/bench/command_args.h"
#include "tessera/bench/gpu_info.h"
#include "tessera/cli/commands.h"
#include "tessera/core/error.h"
#include "tessera/plan/memory_report.h"

namespace tessera::cli {

int memory_command(const Args& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    fmt::print(
        "usage: tessera memory [--config EXPERIMENT] [--num_gpus N] [--gpu NAME]\n"
        "                      [--sharding none|zero1|fsdp] [-o DIR] [--key value ...]\n\n"
        "Per-GPU weights, gradients, optimizer state and activations of an experiment (the\n"
        "shipped default without --config), whether they fit in the GPU's HBM, the largest\n"
        "micro batch that fits, and the same totals for every precision x recompute (x sharding\n"
        "with N > 1) alternative. Other --key value pairs override the experiment, e.g.\n"
        "  tessera memory --config llama3.1_8B-pretrain --num_layers 4 --micro_batch_size 1\n\n"
        "  --gpu       H100, H200, B200, MI300X, MI325X, MI355X (configs/gpus.yaml); default:\n"
        "              the visible GPU, else H100\n"
        "  --num_gpus  data-parallel GPUs (default 1)\n"
        "  --sharding  none: every GPU holds everything; zero1: optimizer state split N ways\n"
        "              (Megatron distributed optimizer); fsdp: weights, gradients and\n"
        "              optimizer state split N ways, one layer gathered at a time\n"
        "  -o DIR      also write memory_breakdown.csv, memory_scenarios.csv and memory.md\n"
        "precision auto plans bf16. Details and the measured check: docs/memory.md.\n");
    return 0;
  }
  const bench::CommandArgs a(args, {"config", "num_gpus", "gpu", "sharding", "output"}, {}, true);
  plan::MemoryQuery q;
  q.num_gpus = a.get_int("num_gpus", 1);
  const std::string sharding = a.get("sharding", "none");
  if (!plan::parse_sharding(sharding, &q.sharding))
    throw ConfigError("command line", "sharding", sharding, "none, zero1 or fsdp");
  const auto spec = bench::resolve_gpu_spec(a.get("gpu", ""));
  q.gpu = spec ? *spec : *analysis::find_gpu_spec("H100");

  LoadOptions lo;
  lo.config_path = a.get("config", "");
  lo.cli_overrides = a.unknown();
  lo.data_parallel_size = static_cast<int>(q.num_gpus);
  q.experiment = load_experiment(lo);

  const plan::MemoryReport r = plan::build_memory_report(q);
  const std::string md = plan::memory_report_markdown(r);
  analysis::print_and_write(a.get("output", ""), {r.breakdown, r.scenarios}, "memory.md", md);
  return 0;
}

}  // namespace tessera::cli
