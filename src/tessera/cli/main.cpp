// tessera: pretrain, benchmark and profile Llama-family models.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tessera/cli/commands.h"
#include "tessera/core/error.h"

namespace {

using tessera::cli::Command;

constexpr Command kCommands[] = {
    {"train", "train a model from an experiment YAML (default: the shipped Brown corpus job)",
     tessera::cli::train_command},
    {"launch", "start N ranks of a command on this node for multi-GPU training (torchrun-style)",
     tessera::cli::launch_command},
    {"preprocess", "tokenize .jsonl or text files into a Megatron indexed dataset (.bin/.idx)",
     tessera::cli::preprocess_command},
    {"bench", "benchmarks: `bench model|gemm|attention|membw|comm` (verified, timed, CSV)",
     tessera::cli::bench_command},
    {"memory", "per-GPU memory plan of an experiment: fits or not, largest micro batch",
     tessera::cli::memory_command},
    {"preflight", "GPU, driver and library versions, GEMM and bandwidth sanity checks",
     tessera::cli::preflight_command},
    {"plot", "loss / iteration-time / throughput / memory curves of runs, and an HTML report",
     tessera::cli::plot_command},
    {"report", "performance report from a Chrome/PyTorch profiler trace (also --compare, --ranks)",
     tessera::cli::report_command},
    {"trace", "trace tools: `trace merge` joins per-rank traces for Perfetto",
     tessera::cli::trace_command},
    {"convert", "checkpoints <-> Hugging Face model directories; logits dump for numerics checks",
     tessera::cli::convert_command},
    {"generate", "sample text from a checkpoint or a Hugging Face directory (KV cache, tokens/s)",
     tessera::cli::generate_command},
};

void print_usage() {
  fmt::print("usage: tessera <command> [options]\n\ncommands:\n");
  for (const auto& c : kCommands) fmt::print("  {:<12} {}\n", c.name, c.summary);
  fmt::print("\n`tessera <command> --help` describes a command's options.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h" ||
      std::string(argv[1]) == "help") {
    print_usage();
    return argc < 2 ? tessera::kExitInvalidInput : 0;
  }
  if (std::string(argv[1]) == "--version") {
    fmt::print("tessera {}\n", TESSERA_VERSION);
    return 0;
  }
  const std::string name = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  for (const auto& c : kCommands) {
    if (name != c.name) continue;
    try {
      return c.run(args);
    } catch (const tessera::ConfigError& e) {
      fmt::print(stderr, "error: {}\n", e.what());
      return tessera::kExitInvalidInput;
    } catch (const tessera::TrainingAborted& e) {
      fmt::print(stderr, "error: {}\n", e.what());
      return e.exit_code();
    } catch (const tessera::InternalError& e) {
      fmt::print(stderr, "{}\n", e.what());
      return 70;
    } catch (const tessera::Error& e) {
      fmt::print(stderr, "error: {}\n", e.what());
      return tessera::kExitRuntimeFailure;
    } catch (const std::filesystem::filesystem_error& e) {
      // Commands check their outputs before they start (core/output_path.h); what still fails
      // (a disk that fills up, a directory removed under a run) is a runtime failure, not a crash.
      fmt::print(stderr, "error: {}\n", e.what());
      return tessera::kExitRuntimeFailure;
    }
  }
  fmt::print(stderr, "error: unknown command '{}'\n\n", name);
  print_usage();
  return tessera::kExitInvalidInput;
}
