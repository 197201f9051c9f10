// tessera: pretrain, benchmark and profile Llama-family models.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tessera/cli/commands.h"
#include "tessera/core/data_root.h"
#include "tessera/core/error.h"

namespace {

void print_usage() {
  fmt::print("{}", tessera::cli::usage());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h" ||
      std::string(argv[1]) == "help") {
    print_usage();
    return argc < 2 ? tessera::kExitInvalidInput : 0;
  }
  if (std::string(argv[1]) == "--version") {
    // With the version, where this binary reads its shipped tokenizers and datasets: the first
    // thing to know about a binary that was installed, moved or copied to another machine.
    const tessera::DataRoot root = tessera::data_root();
    fmt::print("tessera {}\ndata root: {} ({})\n", TESSERA_VERSION, root.dir, root.origin);
    return 0;
  }
  const std::string name = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  for (const auto& c : tessera::cli::commands()) {
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
