// `tessera trace merge`: per-rank Chrome traces joined into one Perfetto-ready file.
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tessera/analysis/progress.h"
#include "tessera/analysis/trace_merge.h"
#include "tessera/cli/commands.h"
#include "tessera/core/command_line.h"
#include "tessera/core/error.h"

namespace tessera::cli {
namespace {

constexpr const char* kUsage = R"(usage:
  tessera trace merge DIR_OR_FILES... -o OUT.json[.gz]

Joins per-rank traces (a directory's *.json / *.json.gz files, or the files given) into one
Chrome trace for Perfetto: each rank's processes get their own pids and a process name
"rank N ...". Ranks come from the file names (rank-N, rank_N, rankN) or distributedInfo.
)";

}  // namespace

int trace_command(const Args& args) {
  if (args.empty()) {
    throw ConfigError("command line", "trace", "",
                      "a subcommand: merge (see tessera trace --help)");
  }
  if (args[0] == "--help" || args[0] == "-h") {
    fmt::print("{}", kUsage);
    return 0;
  }
  if (args[0] != "merge") {
    throw ConfigError("command line", "trace", args[0], "the subcommand 'merge'");
  }
  std::vector<std::string> inputs;
  std::string output;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      fmt::print("{}", kUsage);
      return 0;
    }
    const auto option = parse_command_line_option(a);
    if (a == "-o" || (option && option->name == "output")) {
      if (option && option->value) {
        output = *option->value;
      } else {
        if (i + 1 >= args.size()) throw ConfigError("command line", a, "", "an output file");
        output = args[++i];
      }
    } else if (a.starts_with("-")) {
      throw ConfigError("command line", a, "", "-o OUT.json[.gz] or input traces");
    } else {
      inputs.push_back(a);
    }
  }
  if (output.empty()) throw ConfigError("command line", "-o", "", "-o OUT.json[.gz]");
  if (!output.ends_with(".json") && !output.ends_with(".json.gz")) {
    throw ConfigError("command line", "-o", output, "a file name ending in .json or .json.gz");
  }
  if (inputs.empty()) {
    throw ConfigError("command line", "inputs", "", "at least one trace file or directory");
  }
  const auto resolved = analysis::resolve_merge_inputs(inputs);
  const auto stats = analysis::merge_traces(resolved, output, /*progress=*/true);
  fmt::print(
      "merged {} ranks into {}: {}\n", resolved.size(), output,
      analysis::read_summary(stats.events, stats.json_bytes, stats.seconds, stats.file_bytes));
  return 0;
}

}  // namespace tessera::cli
