// tessera bench <what>: benchmarks. Each subcommand checks its own kernels' results before
// timing them and prints a markdown table (and, with -o, writes it as CSV or JSON).
#include <fmt/format.h>

#include "tessera/cli/commands.h"
#include "tessera/core/error.h"

namespace tessera::cli {

int bench_command(const Args& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    fmt::print("usage: tessera bench <benchmark> [options]\n\nbenchmarks:\n");
    for (const auto& s : bench_commands()) fmt::print("  {:<10} {}\n", s.name, s.summary);
    return args.empty() ? kExitInvalidInput : 0;
  }
  for (const auto& s : bench_commands())
    if (args[0] == s.name) return s.run(Args(args.begin() + 1, args.end()));
  throw ConfigError("command line", "bench", args[0],
                    "one of the benchmarks `tessera bench --help` lists" +
                        did_you_mean(args[0], bench_commands()));
}

}  // namespace tessera::cli
