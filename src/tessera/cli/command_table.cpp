// The tables of `tessera <command>` and `tessera bench <benchmark>`, and the usage made from
// them.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessera/bench/attention_bench.h"
#include "tessera/bench/comm_bench.h"
#include "tessera/bench/gemm_bench.h"
#include "tessera/bench/generate_bench.h"
#include "tessera/bench/membw_bench.h"
#include "tessera/bench/model_bench.h"
#include "tessera/bench/tokenizer_bench.h"
#include "tessera/cli/commands.h"
#include "tessera/config/keys.h"

namespace tessera::cli {

std::span<const Command> bench_commands() {
  static constexpr Command kBench[] = {
      {"model", "proxy-model training throughput, MFU and time breakdown",
       bench::model_bench_command},
      {"gemm", "matmul TFLOP/s: square sweeps or a config's GEMMs, layouts, epilogues",
       bench::gemm_bench_command},
      {"attention", "fused attention TFLOP/s: masks, GQA, head dims, 1k-32k tokens, fwd/bwd",
       bench::attention_bench_command},
      {"membw", "device-to-device copy bandwidth (read + write) vs the HBM datasheet",
       bench::membw_bench_command},
      {"comm", "NCCL collectives' algbw/busbw over 1 KiB..1 GiB (under `tessera launch`)",
       bench::comm_bench_command},
      {"tokenizer", "tokenizer MB/s, 1 and N threads, ids checked against @huggingface/tokenizers",
       bench::tokenizer_bench_command},
      {"generate", "batched generation tokens/s: continuous batching, captured decode steps",
       bench::generate_bench_command},
  };
  return kBench;
}

std::span<const Command> commands() {
  static constexpr Command kCommands[] = {
      {"train", "train a model from an experiment YAML (default: the shipped Brown corpus job)",
       train_command},
      {"launch", "start N ranks of a command on this node for multi-GPU training (torchrun-style)",
       launch_command},
      {"preprocess", "tokenize .jsonl or text files into a Megatron indexed dataset (.bin/.idx)",
       preprocess_command},
      {"bench", "benchmarks, each result checked before it is timed:", bench_command,
       bench_commands},
      {"memory", "per-GPU memory plan of an experiment: fits or not, largest micro batch",
       memory_command},
      {"preflight", "GPU, driver and library versions, GEMM and bandwidth sanity checks",
       preflight_command},
      {"plot", "loss / iteration-time / throughput / memory curves of runs, and an HTML report",
       plot_command},
      {"report",
       "performance report from a Chrome/PyTorch profiler trace (also --compare, --ranks)",
       report_command},
      {"trace", "trace tools: `trace merge` joins per-rank traces for Perfetto", trace_command},
      {"convert", "checkpoints <-> Hugging Face model directories; logits dump for numerics checks",
       convert_command},
      {"generate", "sample text from a checkpoint or a Hugging Face directory (KV cache, tokens/s)",
       generate_command},
  };
  return kCommands;
}

std::string did_you_mean(const std::string& name, std::span<const Command> table) {
  std::vector<std::string> names;
  for (const Command& c : table) names.emplace_back(c.name);
  const std::vector<std::string> near = nearest_names(name, names);
  return near.empty() ? "" : fmt::format("; did you mean {}?", fmt::join(near, " or "));
}

std::string usage() {
  std::string out = "usage: tessera <command> [options]\n\ncommands:\n";
  for (const Command& c : commands()) {
    out += fmt::format("  {:<12} {}\n", c.name, c.summary);
    if (c.subcommands)
      for (const Command& s : c.subcommands())
        out += fmt::format("  {:<12}   {:<10} {}\n", "", s.name, s.summary);
  }
  out +=
      "\n`tessera <command> --help` describes a command's options; options are spelled\n"
      "--key value or --key=value, with underscores or dashes (--num-gpus is --num_gpus).\n"
      "`tessera --version` prints the version and the data root, where the shipped tokenizers\n"
      "and datasets are read from (README.md, Install).\n";
  return out;
}

}  // namespace tessera::cli
