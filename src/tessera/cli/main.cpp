// tessera: pretrain, benchmark and profile Llama-family models.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <new>
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

// OpenMP's threads (the CPU backend's loops, and OpenBLAS's, which is built on OpenMP) spin
// while they wait for work by default, taking the cores that the threads with work need
// whenever another process runs beside them: a CPU training run on 2 shared cores ran 2.6-3.3x
// slower than with passive waiting (docs/performance-notes.md, note 29). They wait passively
// unless the user chose a policy. libgomp reads the policy once, when it is loaded, so the
// process starts again with it set (on failure it carries on as it is).
void wait_passively_for_openmp(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr) return;
  ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  ::execv("/proc/self/exe", argv);
}

}  // namespace

int main(int argc, char** argv) {
  wait_passively_for_openmp(argv);
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
    } catch (const tessera::InvalidDataError& e) {
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
    } catch (const std::bad_alloc&) {
      // Commands plan what they allocate and say what does not fit; an allocation that still
      // fails is a runtime failure with a message, never an abort.
      fmt::print(stderr, "error: out of host memory in tessera {}\n", name);
      return tessera::kExitRuntimeFailure;
    } catch (const std::exception& e) {
      // Every failure a user can cause has its own error type; anything else is a bug.
      fmt::print(stderr, "internal error in tessera {}: {}\n", name, e.what());
      return 70;
    }
  }
  fmt::print(stderr, "error: unknown command '{}'{}\n\n", name,
             tessera::cli::did_you_mean(name, tessera::cli::commands()));
  print_usage();
  return tessera::kExitInvalidInput;
}
