// tessera plot: curves of one or more runs overlaid (SVG or PNG) and a self-contained HTML
// run report, from the experiment directories `tessera train` writes.
#include <algorithm>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "tessera/analysis/report_output.h"
#include "tessera/analysis/writers.h"
#include "tessera/bench/command_args.h"
#include "tessera/cli/commands.h"
#include "tessera/core/error.h"
#include "tessera/core/output_path.h"
#include "tessera/viz/png.h"
#include "tessera/viz/run_report.h"
#include "tessera/viz/svg.h"

namespace tessera::cli {
namespace {

namespace fs = std::filesystem;

// Without -o the charts go to plots/ in the working directory, where `tessera report` puts
// its default output too.
constexpr const char* kDefaultOutput = "plots";

constexpr const char* kUsage =
    R"(usage: tessera plot RUN_OR_WORKSPACE_DIR... [-o OUT] [--format svg|png|svg,png]

Each directory is a run (an experiment directory holding metrics.jsonl) or a workspace: every
run below it is plotted ({workspace}/{work_group}/{user_name}/{exp_name}; not a run's
previous_runs/, which can be named explicitly). Reads metrics.jsonl and config.yaml of each
run and writes to OUT (default: ./plots):
  loss, iteration_time, tokens_per_s, memory   .svg (default) and/or .png (2x resolution):
                                   every run overlaid, legend = exp_name (or the directory);
                                   moe_balance too when a run is an MoE model
  report.html                      one self-contained page: throughput table, the curves
                                   (inline SVG), configuration (differences marked) and the
                                   tables of a `tessera report` output found in a run directory
  throughput.csv, config.csv       the tables, one row per run / per configuration key
No network access is needed to view anything. See docs/plots.md.
)";

void write_text(const fs::path& file, const std::string& text) {
  std::ofstream out(file, std::ios::binary);
  out << text;
  if (!out) throw DataError(fmt::format("{}: cannot write", file.string()));
}

}  // namespace

int plot_command(const Args& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    fmt::print("{}", kUsage);
    return 0;
  }
  const bench::CommandArgs a(args, {"output", "format"}, {}, false);
  if (a.positional().empty())
    throw ConfigError("command line", "RUN_DIR", "",
                      "at least one run directory or workspace (tessera plot --help)");
  bool svg = false, png = false;
  for (const std::string& f : a.get_list("format", {"svg"})) {
    if (f == "svg")
      svg = true;
    else if (f == "png")
      png = true;
    else
      throw ConfigError("command line", "format", f, "svg, png or svg,png");
  }
  const fs::path out = a.get("output", kDefaultOutput);
  require_output_directory(out, "command line", a.has("output") ? "output" : "output (default)");

  // Every run the arguments name, each once (a workspace and a run inside it name it twice).
  std::vector<fs::path> run_dirs;
  for (const std::string& dir : a.positional()) {
    if (!fs::is_directory(dir))
      throw ConfigError("command line", "RUN_DIR", dir,
                        "a run directory or a workspace (a directory)");
    const std::vector<fs::path> found = viz::find_runs(dir);
    if (found.empty())
      throw ConfigError("command line", "RUN_DIR", dir,
                        "a run directory (holding metrics.jsonl, as tessera train writes it) or a "
                        "workspace with runs below it, but there is none");
    if (found.size() > 1 || found[0] != fs::path(dir))
      fmt::print("{}: {} run(s)\n", dir, found.size());
    for (const fs::path& run : found) {
      const fs::path key = fs::weakly_canonical(run);
      if (std::none_of(run_dirs.begin(), run_dirs.end(),
                       [&](const fs::path& r) { return fs::weakly_canonical(r) == key; }))
        run_dirs.push_back(run);
    }
  }

  analysis::StatusLine status(static_cast<int>(run_dirs.size()) + 1);
  std::vector<viz::RunData> runs;
  for (const fs::path& dir : run_dirs) {
    status.step("reading " + dir.string());
    runs.push_back(viz::load_run(dir));
  }
  viz::disambiguate_labels(runs);
  status.step("drawing");
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec)
    throw DataError(fmt::format("{}: cannot create directory: {}", out.string(), ec.message()));

  const std::vector<viz::NamedChart> charts = viz::run_charts(runs);
  std::vector<std::string> written;
  for (const viz::NamedChart& c : charts) {
    if (svg) {
      write_text(out / (c.file_stem + ".svg"), viz::render_svg(c.chart));
      written.push_back((out / (c.file_stem + ".svg")).string());
    }
    if (png) {
      viz::write_png(viz::render_raster(c.chart, 800, 450, 2), out / (c.file_stem + ".png"));
      written.push_back((out / (c.file_stem + ".png")).string());
    }
  }
  const analysis::Table throughput = viz::throughput_table(runs);
  const analysis::Table config = viz::config_table(runs);
  for (const analysis::Table* t : {&throughput, &config}) {
    analysis::write_csv(*t, out / (t->name + ".csv"));
    written.push_back((out / (t->name + ".csv")).string());
  }
  write_text(out / "report.html", viz::run_report_html(runs, charts, throughput, config));
  written.push_back((out / "report.html").string());
  const double seconds = status.finish();

  fmt::print("{}\n", analysis::markdown_table(throughput));
  for (const viz::RunData& r : runs) {
    if (r.skipped_lines > 0)
      fmt::print(stderr,
                 "warning: {}: skipped {} metrics.jsonl line(s) that were not JSON records\n",
                 r.dir.string(), r.skipped_lines);
    if (r.earlier_runs_left_out)
      fmt::print(stderr,
                 "note: {}: metrics.jsonl also holds earlier runs; plotted the latest{}\n",
                 r.dir.string(), r.run_id.empty() ? "" : " (run " + r.run_id + ")");
  }
  for (const std::string& f : written) fmt::print("wrote {}\n", f);
  size_t records = 0;
  for (const viz::RunData& r : runs) records += r.iterations.size();
  fmt::print("plotted {} run(s), {} iteration records, in {:.2f} s\n", runs.size(), records,
             seconds);
  return 0;
}

}  // namespace tessera::cli
