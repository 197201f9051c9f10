#pragma once
// Entry points of `tessera <subcommand>`. Each takes the arguments after the subcommand
// and returns the process exit code; user errors are thrown as tessera::Error subclasses
// and turned into messages and exit codes by main().
#include <span>
#include <string>
#include <vector>

namespace tessera::cli {

using Args = std::vector<std::string>;

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const Args& args);
  // The commands it dispatches to by its first argument (`tessera bench gemm`), if any.
  std::span<const Command> (*subcommands)() = nullptr;
};

// Every `tessera <command>`: main() dispatches through this table and the usage lists it, so
// the two cannot disagree.
std::span<const Command> commands();
// Every `tessera bench <benchmark>`, for bench_command and the usage alike.
std::span<const Command> bench_commands();
// `tessera --help`: the commands above, with their subcommands.
std::string usage();
// "; did you mean train?" for a mistyped name among `table`'s, or "".
std::string did_you_mean(const std::string& name, std::span<const Command> table);

int train_command(const Args& args);
int preprocess_command(const Args& args);
int bench_command(const Args& args);
int report_command(const Args& args);
int trace_command(const Args& args);
int convert_command(const Args& args);
int generate_command(const Args& args);
int memory_command(const Args& args);
int plot_command(const Args& args);
int preflight_command(const Args& args);
int launch_command(const Args& args);

}  // namespace tessera::cli
