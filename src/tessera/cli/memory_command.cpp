// tessera memory: will this configuration fit, and with what micro batch? Plans per-GPU
// memory without touching a GPU (see plan/memory_plan.h for what is counted).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessera/analysis/report_output.h"
#include "tessera/backend/backend_factory.h"
#include "tessera/bench/command_args.h"
#include "tessera/bench/gpu_info.h"
#include "tessera/cli/commands.h"
#include "tessera/core/error.h"
#include "tessera/plan/memory_report.h"

namespace tessera::cli {
namespace {

// `--sharding` came before the planner read the training keys, and scripts still pass it:
// it stays as a deprecated spelling of those keys (docs/memory.md says why).
Args sharding_keys(const std::string& sharding) {
  const auto keys = [](const char* distributed_optimizer, const char* fsdp) {
    return Args{"--use_distributed_optimizer", distributed_optimizer, "--use_torch_fsdp2", fsdp};
  };
  if (sharding == "none") return keys("false", "false");
  if (sharding == "zero1") return keys("true", "false");
  if (sharding == "fsdp") return keys("false", "true");
  throw ConfigError("command line", "sharding", sharding,
                    "none, zero1 or fsdp (deprecated: use --use_distributed_optimizer true or "
                    "--use_torch_fsdp2 true)");
}

}  // namespace

int memory_command(const Args& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    fmt::print(
        "usage: tessera memory [--config EXPERIMENT] [--num_gpus N] [--gpu NAME] [-o DIR]\n"
        "                      [--key value ...]\n\n"
        "Per-GPU weights, gradients, optimizer state, activations and FP8 buffers of an\n"
        "experiment (the shipped default without --config), whether they fit in the GPU's HBM,\n"
        "the largest micro batch that fits, and the same totals for every precision (bf16,\n"
        "--fp8 hybrid, fp32) x recompute (x sharding with N > 1) alternative, and for meshes of\n"
        "tensor and pipeline parallel ranks, each named by the training keys to paste. Other\n"
        "--key value pairs are training keys, as in tessera train; they decide the sharding and\n"
        "the mesh (a pipeline is planned at its fullest stage), e.g.\n"
        "  tessera memory --config llama3.1_8B-pretrain --num_gpus 8 --use_distributed_optimizer "
        "true\n\n"
        "  --gpu       H100, H200, B200, MI300X, MI325X, MI355X (configs/gpus.yaml); default:\n"
        "              the visible GPU, else H100. With --device cpu the plan is for this\n"
        "              host's memory instead.\n"
        "  --num_gpus  GPUs of the job (default 1), the data-parallel ones what the tensor,\n"
        "              pipeline and context parallel sizes leave; with --device cpu, ranks as\n"
        "              threads of one process (tessera train --nproc_per_node N) sharing the\n"
        "              host's memory\n"
        "  -o DIR      also write memory_breakdown.csv, memory_scenarios.csv and memory.md\n"
        "  --sharding  deprecated: use --use_distributed_optimizer true (zero1) or\n"
        "              --use_torch_fsdp2 true (fsdp)\n"
        "Dashed names (--num-gpus) work too. Details and the measured check: docs/memory.md.\n");
    return 0;
  }
  const bench::CommandArgs a(args, {"config", "num_gpus", "gpu", "sharding", "output"}, {}, true);
  plan::MemoryQuery q;
  q.num_gpus = a.get_int("num_gpus", 1);

  LoadOptions lo;
  lo.config_path = a.get("config", "");
  if (a.has("sharding")) {
    // First, so that training keys given as well take precedence, as later keys do.
    lo.cli_overrides = sharding_keys(a.get("sharding", ""));
    fmt::print(stderr,
               "warning: --sharding is deprecated; the training keys decide the sharding: {}\n",
               fmt::join(lo.cli_overrides, " "));
  }
  lo.cli_overrides.insert(lo.cli_overrides.end(), a.unknown().begin(), a.unknown().end());
  lo.data_parallel_size = static_cast<int>(q.num_gpus);
  q.experiment = load_experiment(lo);

  if (q.experiment.training.device == DeviceChoice::Cpu) {
    if (a.has("gpu"))
      throw ConfigError("command line", "gpu", a.get("gpu", ""),
                        "no --gpu with device cpu (the plan is for this host's memory)");
    const auto cpu = make_backend(DeviceChoice::Cpu, 0);
    const MemoryStats s = cpu->memory_stats();
    q.host =
        plan::HostMemory{s.device_total_bytes, s.device_free_bytes, cpu->default_compute_dtype()};
  } else {
    const auto spec = bench::resolve_gpu_spec(a.get("gpu", ""));
    q.gpu = spec ? *spec : *analysis::find_gpu_spec("H100");
  }

  const plan::MemoryReport r = plan::build_memory_report(q);
  const std::string md = plan::memory_report_markdown(r);
  analysis::print_and_write(a.get("output", ""), {r.breakdown, r.scenarios}, "memory.md", md);
  return 0;
}

}  // namespace tessera::cli
