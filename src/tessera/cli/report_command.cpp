// `tessera report`: performance reports from Chrome traces (Tessera's and PyTorch profiler's).
#include <algorithm>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tessera/analysis/compare.h"
#include "tessera/analysis/gpu_specs.h"
#include "tessera/analysis/json_stream.h"
#include "tessera/analysis/kernel_categories.h"
#include "tessera/analysis/progress.h"
#include "tessera/analysis/ranks.h"
#include "tessera/analysis/report.h"
#include "tessera/analysis/trace_data.h"
#include "tessera/analysis/writers.h"
#include "tessera/cli/commands.h"
#include "tessera/core/command_line.h"
#include "tessera/core/error.h"
#include "tessera/core/output_path.h"

namespace tessera::cli {
namespace {

namespace fs = std::filesystem;
namespace an = tessera::analysis;

constexpr const char* kUsage = R"(usage:
  tessera report TRACE [-o DIR] [--format xlsx,csv,md,html] [--gpu NAME] [--top K]
                 [--categories FILE]
  tessera report --compare A B [-o DIR] [--format ...] [--gpu NAME] [--top K] [--categories FILE]
  tessera report --ranks DIR [-o DIR] [--format ...]

Reads Chrome-trace JSON (Tessera traces, PyTorch profiler *.pt.trace.json, plain or .gz),
streaming, and writes report.xlsx (a sheet per table), <table>.csv, summary.md and
summary.html to DIR (default: <trace stem>_report/ in the current directory).

  --gpu NAME   peak figures for % of peak and roofline: H100, H200, B200, MI300X, MI325X,
               MI355X (configs/gpus.yaml); default: detected from the trace's device name
  --top K      rows in the top-kernels table (default 20)
  --categories FILE
               kernel categories of your own, tried before the built-in rules: YAML or
               JSON, rules: [{kernel: REGEX, category: NAME}, ...]
  --compare    the same tables for A and B side by side with _diff and _pct columns
  --ranks DIR  every per-rank trace in DIR: collective skew and stragglers (takes only
               -o and --format)
See docs/report.md for every table's definitions.
)";

struct Options {
  std::vector<std::string> traces;
  std::string out_dir, ranks_dir, gpu, categories;
  std::string formats = "xlsx,csv,md,html";
  std::optional<int> top_k;
  bool compare = false;
};

Options parse(const Args& args) {
  Options o;
  for (size_t i = 0; i < args.size(); ++i) {
    // Options in the shared conventions (core/command_line.h); `a` is "--name" from here on.
    std::string a = args[i];
    std::optional<std::string> inline_value;
    if (const auto option = parse_command_line_option(a)) {
      inline_value = option->value;
      a = "--" + option->name;
    }
    auto value = [&]() -> std::string {
      if (inline_value) return *inline_value;
      if (i + 1 >= args.size()) {
        throw ConfigError("command line", a, "", "a value after " + a);
      }
      return args[++i];
    };
    if (a == "-o" || a == "--output") {
      o.out_dir = value();
    } else if (a == "--format") {
      o.formats = value();
    } else if (a == "--gpu") {
      o.gpu = value();
    } else if (a == "--categories") {
      o.categories = value();
    } else if (a == "--top") {
      std::string v = value();
      try {
        size_t used = 0;
        o.top_k = std::stoi(v, &used);
        if (used != v.size() || *o.top_k <= 0) throw std::invalid_argument(v);
      } catch (const std::exception&) {
        throw ConfigError("command line", "top", v, "a positive integer");
      }
    } else if (a == "--compare") {
      if (inline_value)
        throw ConfigError("command line", "compare", *inline_value, "no value: --compare A B");
      o.compare = true;
    } else if (a == "--ranks") {
      o.ranks_dir = value();
    } else if (a.starts_with("-") && a != "-") {
      throw ConfigError("command line", a, "",
                        "one of -o, --format, --gpu, --top, --categories, --compare, "
                        "--ranks (see tessera report --help)");
    } else {
      o.traces.push_back(a);
    }
  }
  if (!o.ranks_dir.empty()) {
    if (o.compare || !o.traces.empty() || !o.gpu.empty() || o.top_k || !o.categories.empty()) {
      throw ConfigError("command line", "ranks", o.ranks_dir,
                        "--ranks DIR with only -o and --format (no traces, --compare, --gpu, "
                        "--top, --categories)");
    }
  } else if (o.compare) {
    if (o.traces.size() != 2) {
      throw ConfigError("command line", "compare", fmt::format("{} traces", o.traces.size()),
                        "exactly two traces: --compare A B");
    }
  } else if (o.traces.size() != 1) {
    throw ConfigError("command line", "TRACE", fmt::format("{} traces", o.traces.size()),
                      "exactly one trace (or --compare A B, or --ranks DIR)");
  }
  return o;
}

// "runs/ddp_rank-0.pt.trace.json.gz" -> "ddp_rank-0"
std::string trace_stem(const std::string& path) {
  std::string name = fs::path(path).filename().string();
  for (const char* suffix : {".gz", ".json", ".pt.trace", ".trace"}) {
    if (name.ends_with(suffix)) name.resize(name.size() - std::string_view(suffix).size());
  }
  return name;
}

// -o, or the default: <trace stem>_report, A_vs_B_report or DIR_ranks_report.
std::string output_dir(const Options& o) {
  if (!o.out_dir.empty()) return o.out_dir;
  if (!o.ranks_dir.empty())
    return fs::path(o.ranks_dir).lexically_normal().filename().string() + "_ranks_report";
  if (o.compare) return trace_stem(o.traces[0]) + "_vs_" + trace_stem(o.traces[1]) + "_report";
  return trace_stem(o.traces[0]) + "_report";
}

void print_read(const an::TraceInfo& info) {
  const an::ReadStats& s = info.read;
  fmt::print("{}: {}\n", info.path,
             an::read_summary(s.events, s.json_bytes, s.seconds, s.file_bytes));
}

an::TraceData load(const std::string& path, const std::vector<an::UserCategoryRule>& rules) {
  an::TraceData data = an::TraceData::load(path, /*progress=*/true, rules);
  print_read(data.info);
  return data;
}

// The headline, labels aligned; a repeated label (a list) is printed once.
void print_headline(const an::Report& report) {
  size_t width = 0;
  for (const auto& [label, text] : report.headline) width = std::max(width, label.size());
  std::string previous;
  for (const auto& [label, text] : report.headline) {
    fmt::print("{:<{}}  {}\n", label == previous ? "" : label, width, text);
    previous = label;
  }
}

}  // namespace

int report_command(const Args& args) {
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      fmt::print("{}", kUsage);
      return 0;
    }
  }
  const Options o = parse(args);
  const an::OutputFormats formats = an::parse_formats(o.formats);
  // Every option is checked before a trace is read: a typo must fail at once, not after minutes
  // of parsing.
  if (!o.gpu.empty()) an::require_gpu_spec(o.gpu);
  std::vector<an::UserCategoryRule> rules;
  if (!o.categories.empty()) rules = an::load_category_rules(o.categories);
  const std::string out_dir = output_dir(o);
  require_output_directory(out_dir, "command line", o.out_dir.empty() ? "o (default)" : "o");
  // Every trace is opened before any is parsed: a missing B must not cost the minutes of A.
  for (const std::string& trace : o.traces) an::open_byte_source(trace);
  an::ReportOptions ro;
  ro.gpu = o.gpu;
  ro.top_k = o.top_k.value_or(ro.top_k);
  an::Report report;
  if (!o.ranks_dir.empty()) {
    report = an::ranks_report(o.ranks_dir, /*progress=*/true, print_read);
  } else if (o.compare) {
    an::Report a = an::build_report(load(o.traces[0], rules), ro);
    an::Report b = an::build_report(load(o.traces[1], rules), ro);
    report = an::compare_reports(a, b);
  } else {
    report = an::build_report(load(o.traces[0], rules), ro);
  }
  for (const std::string& w : report.warnings) fmt::print(stderr, "warning: {}\n", w);
  print_headline(report);
  const auto files = an::write_report(report, out_dir, formats);
  fmt::print("wrote {} files to {}/\n", files.size(), out_dir);
  return 0;
}

}  // namespace tessera::cli
