#include "tessera/viz/run_report.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <set>
#include <string_view>
#include <variant>

#include <fmt/format.h>

#include "tessera/analysis/writers.h"
#include "tessera/viz/svg.h"

namespace tessera::viz {

using analysis::html_escape;
namespace {

constexpr size_t kMaxPointsPerSeries = 2000;
constexpr size_t kReportRows = 15;  // rows of each trace-report table shown in the page

// Keys shown in the configuration summary even when all runs agree.
constexpr const char* kSummaryKeys[] = {"model",
                                        "num_layers",
                                        "hidden_size",
                                        "num_attention_heads",
                                        "num_query_groups",
                                        "seq_length",
                                        "micro_batch_size",
                                        "global_batch_size",
                                        "precision",
                                        "recompute_granularity",
                                        "lr",
                                        "train_iters"};

using Field = double IterationRecord::*;

Series series_of(const RunData& run, int color, Field field, const std::string& name, bool dashed) {
  Series s;
  s.name = name;
  s.color = color;
  s.dashed = dashed;
  std::vector<Point> points;
  for (const IterationRecord& r : run.iterations) {
    const double v = r.*field;
    if (std::isfinite(v)) points.push_back({static_cast<double>(r.iteration), v});
  }
  s.points = decimate(points, kMaxPointsPerSeries);
  return s;
}

double median(std::vector<double> v) {
  std::erase_if(v, [](double x) { return !std::isfinite(x); });
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// Tables wrap rather than scroll: cells break at the <wbr>s `wrappable` inserts and numbers
// never break. A table that still cannot fit (many runs side by side) scrolls inside its own
// box, never the page.
constexpr const char* kCss =
    R"(body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1700px;overflow-wrap:break-word}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.8em}h3{font-size:1.05em;margin-top:1.4em}h4{font-size:.95em}
div.table{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 6px;vertical-align:top}th{background:#f0f0f0;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}tr.differs td{background:#fff6e0}
td[title]{cursor:help}code{overflow-wrap:anywhere}
p.note,ul.note{color:#555;font-size:.85em;max-width:70em}p.empty{color:#555;font-size:.85em;font-style:italic}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:1em}
figure{margin:0}svg.chart{width:100%;height:auto;border:1px solid #ddd}
)";

// Longer cells show their start, the full text is the cell's tooltip: kernel names of
// templated libraries run to thousands of characters and their start names them; a
// configuration value (a path, a data blend) is shown whole unless it is very long.
constexpr size_t kKernelCellChars = 160;
constexpr size_t kConfigCellChars = 400;
// The longest stretch of a cell without a place to wrap, so one long name cannot widen its
// column past the window.
constexpr size_t kUnbrokenChars = 24;

bool looks_numeric(const std::string& s) {
  if (s.empty()) return false;
  char* end = nullptr;
  std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size();
}

// HTML text whose long words may wrap after the separators of paths, names and C++ types
// ("/lustre/fsw/...", "tokens_per_s_per_gpu", "cutlass::gemm<...>") and, failing those, every
// kUnbrokenChars characters (never inside a UTF-8 character). Words of up to kWholeWord
// characters stay whole, so short names and headers ("last_iteration") do not break.
std::string wrappable(const std::string& text) {
  constexpr size_t kWholeWord = 16;
  std::string out;
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t space = text.find(' ', begin);
    const size_t end = space == std::string::npos ? text.size() : space + 1;
    const std::string word = text.substr(begin, end - begin);
    begin = end;
    if (word.size() <= kWholeWord) {
      out += html_escape(word);
      continue;
    }
    std::string piece;
    size_t unbroken = 0;
    for (size_t i = 0; i < word.size(); ++i) {
      const char c = word[i];
      piece += c;
      ++unbroken;
      if (i + 1 == word.size()) break;
      const char next = word[i + 1];
      const bool separator = std::string_view("/_,<:=|").find(c) != std::string_view::npos;
      const bool starts_character = (static_cast<unsigned char>(next) & 0xC0) != 0x80;
      if (next != ' ' && starts_character && (separator || unbroken >= kUnbrokenChars)) {
        out += html_escape(piece) + "<wbr>";
        piece.clear();
        unbroken = 0;
      }
    }
    out += html_escape(piece);
  }
  return out;
}

std::string text_cell(const std::string& text, size_t max_chars) {
  if (text.size() <= max_chars) return "<td>" + wrappable(text) + "</td>";
  size_t cut = max_chars;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return "<td title=\"" + html_escape(text) + "\">" + wrappable(text.substr(0, cut)) +
         "\u2026</td>";
}

std::string code(const std::string& path) {
  return "<code>" + wrappable(path) + "</code>";
}

std::string html_table(const analysis::Table& t, const std::string& differs_column = "") {
  const int differs = differs_column.empty() ? -1 : t.column(differs_column);
  std::string out =
      "<div class=\"table\"><table class=\"data\" id=\"table-" + html_escape(t.name) + "\"><tr>";
  for (const auto& c : t.columns) out += "<th>" + wrappable(c.name) + "</th>";
  out += "</tr>\n";
  for (const auto& row : t.rows) {
    const bool marked = differs >= 0 && analysis::cell_text(row[differs]) == "yes";
    out += marked ? "<tr class=\"differs\">" : "<tr>";
    for (const auto& cell : row) {
      if (std::holds_alternative<std::string>(cell))
        out += text_cell(std::get<std::string>(cell), kConfigCellChars);
      else
        out += "<td class=\"n\">" + html_escape(analysis::cell_display(cell)) + "</td>";
    }
    out += "</tr>\n";
  }
  return out + "</table></div>\n";
}

// Why a table of `tessera report` has no rows.
std::string why_empty(const std::string& table) {
  if (table == "gemm") return "no kernel classified as GEMM in the trace";
  if (table == "attention") return "no kernel classified as attention in the trace";
  if (table == "collectives")
    return "no communication kernels in the trace (one rank, or its collectives were not traced)";
  return "no GPU activity in the trace";
}

std::string html_table(const CsvTable& t) {
  std::string out = "<h4>" + html_escape(t.name) + "</h4>\n";
  if (t.rows.empty())
    return out + "<p class=\"empty\">Empty: " + html_escape(why_empty(t.name)) + ".</p>\n";
  out += "<div class=\"table\"><table class=\"data\"><tr>";
  for (const auto& c : t.columns) out += "<th>" + wrappable(c) + "</th>";
  out += "</tr>\n";
  for (size_t r = 0; r < std::min(t.rows.size(), kReportRows); ++r) {
    out += "<tr>";
    for (const auto& cell : t.rows[r])
      out += looks_numeric(cell) ? "<td class=\"n\">" + html_escape(cell) + "</td>"
                                 : text_cell(cell, kKernelCellChars);
    out += "</tr>\n";
  }
  out += "</table></div>\n";
  if (t.rows.size() > kReportRows)
    out += fmt::format("<p class=\"note\">{} more rows in {}.csv</p>\n",
                       t.rows.size() - kReportRows, html_escape(t.name));
  return out;
}

// How the page names devices. A CPU run trains in host memory, its ranks are threads of one
// process: "GPU memory" or "per GPU" would be false there, so pages with a CPU run say "rank".
struct Wording {
  std::string per;     // "GPU" | "rank": throughput is per ...
  std::string suffix;  // of the throughput columns: "gpu" | "rank"
  std::string memory;  // the memory chart's title
  std::string note;    // added to the throughput table's note
};

Wording wording(const std::vector<RunData>& runs) {
  const auto cpu =
      std::count_if(runs.begin(), runs.end(), [](const RunData& r) { return r.on_cpu; });
  if (cpu == 0) return {"GPU", "gpu", "GPU memory", ""};
  const std::string note =
      " Per rank: a GPU run's rank is one GPU, a CPU run's a thread group of one process; a CPU "
      "run's memory is the host memory its tensors take.";
  if (cpu == static_cast<std::ptrdiff_t>(runs.size()))
    return {"rank", "rank", "Memory (host)", note};
  return {"rank", "rank", "Memory (GPU; host for CPU runs)", note};
}

std::optional<int64_t> config_int(const RunData& r, const std::string& key) {
  const std::string v = r.config_value(key);
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || end != v.c_str() + v.size()) return std::nullopt;
  return n;
}

// Why a run has no validation loss, from its config.yaml and rank 0's warnings.
std::string why_no_evaluation(const RunData& r) {
  if (!r.eval_warning.empty()) return r.eval_warning;
  if (!r.has_config) return "no config.yaml to say whether it evaluates";
  const std::optional<int64_t> interval = config_int(r, "eval_interval");
  if (!interval) return "config.yaml sets no eval_interval";
  if (*interval <= 0) return fmt::format("eval_interval is {} (evaluation off)", *interval);
  const int64_t last = r.iterations.empty() ? 0 : r.iterations.back().iteration;
  const std::optional<int64_t> train_iters = config_int(r, "train_iters");
  if (last < *interval && (!train_iters || last < *train_iters)) {
    if (last == 0)
      return fmt::format("eval_interval is {} and the run stopped before its first record",
                         *interval);
    return fmt::format(
        "eval_interval is {} and the run stopped at iteration {}, before the first evaluation",
        *interval, last);
  }
  return fmt::format(
      "eval_interval is {}, yet metrics.jsonl holds no evaluation record (see "
      "logs/pre_trainer/rank-0/warning.log)",
      *interval);
}

// Why a run has no `tessera report` output, and how to make one.
std::string why_no_trace_report(const RunData& r) {
  const std::string dir = r.dir.string();
  if (!r.trace_files.empty()) {
    std::string traces;
    for (size_t i = 0; i < r.trace_files.size() && i < 4; ++i)
      traces += (i ? ", " : "") + code(r.trace_files[i]);
    if (r.trace_files.size() > 4) traces += fmt::format(" and {} more", r.trace_files.size() - 4);
    return "A trace was recorded (" + traces + ") but no <code>tessera report</code> of it is in " +
           code(dir) + ". Write one with " +
           code("tessera report " + (r.dir / r.trace_files.front()).string() + " -o " +
                (r.dir / "trace_report").string()) +
           " and plot again to include its tables here.";
  }
  const std::string how =
      "Record a trace with <code>--profile true</code> (iterations " + code("profile_step_start") +
      " to " + code("profile_step_end") + "), then " +
      code("tessera report TRACE -o " + (r.dir / "trace_report").string()) + " and plot again.";
  std::string profile = r.config_value("profile");
  std::transform(profile.begin(), profile.end(), profile.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (profile == "false") return "This run was not profiled (profile is false). " + how;
  if (profile == "true") {
    std::string why =
        "profile is true, but " + code((r.dir / "traces").string()) + " holds no trace";
    const std::optional<int64_t> start = config_int(r, "profile_step_start");
    const int64_t last = r.iterations.empty() ? 0 : r.iterations.back().iteration;
    if (start && last < *start)
      why += fmt::format(": the run stopped at iteration {}, before profile_step_start {}", last,
                         *start);
    return why + ". " + how;
  }
  return "No trace report in " + code(dir) + ", and no trace in " +
         code((r.dir / "traces").string()) + ". " + how;
}

// A statistic of the iteration records and its name in a chart's legend.
struct Statistic {
  Field field;
  const char* name;
};

// A chart of two statistics only some runs record (MoE balance, DPO rewards): for each run
// that has the first, it solid and the second dashed; no chart when no run has them.
void add_statistics_chart(std::vector<NamedChart>* charts, const std::vector<RunData>& runs,
                          NamedChart chart, const Statistic& first, const Statistic& second) {
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunData& r = runs[i];
    const int c = static_cast<int>(i);
    Series head = series_of(r, c, first.field, r.label + " " + first.name, false);
    if (head.points.empty()) continue;
    chart.chart.series.push_back(std::move(head));
    chart.chart.series.push_back(series_of(r, c, second.field, r.label + " " + second.name, true));
  }
  if (!chart.chart.series.empty()) charts->push_back(std::move(chart));
}

}  // namespace

std::vector<NamedChart> run_charts(const std::vector<RunData>& runs) {
  const Wording w = wording(runs);
  std::vector<NamedChart> charts(4);
  charts[0] = {"loss", {"Training loss", "iteration", "lm loss", {}, false, true}};
  charts[1] = {"iteration_time",
               {"Time per iteration", "iteration", "ms per iteration", {}, true, true}};
  charts[2] = {"tokens_per_s",
               {"Throughput", "iteration", "tokens/s per " + w.per, {}, true, true}};
  charts[3] = {"memory", {w.memory, "iteration", "GiB", {}, true, true}};
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunData& r = runs[i];
    const int c = static_cast<int>(i);
    charts[0].chart.series.push_back(series_of(r, c, &IterationRecord::lm_loss, r.label, false));
    if (!r.eval_loss.empty()) {
      Series eval;
      eval.name = r.label + " (validation)";
      eval.color = c;
      eval.dashed = true;
      for (const auto& [it, loss] : r.eval_loss) eval.points.push_back({double(it), loss});
      charts[0].chart.series.push_back(std::move(eval));
    }
    charts[1].chart.series.push_back(series_of(r, c, &IterationRecord::elapsed_ms, r.label, false));
    charts[2].chart.series.push_back(
        series_of(r, c, &IterationRecord::tokens_per_s_per_gpu, r.label, false));
    charts[3].chart.series.push_back(
        series_of(r, c, &IterationRecord::mem_peak_gib, r.label + " peak", false));
    charts[3].chart.series.push_back(
        series_of(r, c, &IterationRecord::mem_allocated_gib, r.label + " allocated", true));
  }
  // MoE runs add their load balance: the aux loss (1 when balanced) and the expert-load CV of
  // the worst layer (0 when balanced).
  add_statistics_chart(&charts, runs,
                       {"moe_balance", {"MoE load balance", "iteration", "aux loss / expert-load CV", {}, false}},
                       {&IterationRecord::moe_aux_loss, "aux loss"},
                       {&IterationRecord::moe_expert_tokens_cv, "expert-load CV"});
  // DPO runs add how often the chosen answer wins (TRL's rewards/accuracies, 0 at the start,
  // when both rewards are 0) and by how much (rewards/margins, 0 at the start).
  add_statistics_chart(&charts, runs,
                       {"dpo_rewards",
                        {"Preference training (DPO)", "iteration", "rewards/accuracies, rewards/margins", {}, false}},
                       {&IterationRecord::dpo_accuracy, "rewards/accuracies"},
                       {&IterationRecord::dpo_margin, "rewards/margins"});
  // GRPO runs add their completions' mean reward and share of right answers (sampled).
  add_statistics_chart(&charts, runs,
                       {"grpo_rewards", {"Reinforcement learning (GRPO)", "iteration", "reward, accuracy", {}, false}},
                       {&IterationRecord::grpo_reward, "reward"},
                       {&IterationRecord::grpo_accuracy, "accuracy"});
  return charts;
}

analysis::Table throughput_table(const std::vector<RunData>& runs) {
  analysis::Table t;
  t.name = "throughput";
  t.title = "Throughput";
  const Wording w = wording(runs);
  t.note =
      "medians over the logged iterations, leaving out the first record (warm-up) when "
      "there are more; TFLOP/s by the Megatron FLOPs convention (docs/performance.md)." +
      w.note;
  t.columns = {{"run", true},
               {"device"},
               {"records"},
               {"last_iteration"},
               {"step_ms"},
               {"tokens_per_s_per_" + w.suffix},
               {"tflops_per_" + w.suffix},
               {"peak_memory_gib"},
               {"final_lm_loss"},
               {"final_eval_loss"},
               {"tokens_per_s_vs_first"}};
  double first_tps = NAN;
  for (const RunData& r : runs) {
    std::vector<double> ms, tps, tflops;
    double peak = NAN, final_loss = NAN;
    for (size_t i = 0; i < r.iterations.size(); ++i) {
      const IterationRecord& rec = r.iterations[i];
      if (std::isfinite(rec.mem_peak_gib))
        peak = std::isfinite(peak) ? std::max(peak, rec.mem_peak_gib) : rec.mem_peak_gib;
      if (std::isfinite(rec.lm_loss)) final_loss = rec.lm_loss;
      if (i == 0 && r.iterations.size() > 1) continue;
      ms.push_back(rec.elapsed_ms);
      tps.push_back(rec.tokens_per_s_per_gpu);
      tflops.push_back(rec.tflops_per_gpu);
    }
    const double median_tps = median(tps);
    if (&r == &runs.front()) first_tps = median_tps;
    t.rows.push_back(
        {r.label,
         !r.device.empty() ? r.device
         : r.on_cpu        ? std::string("cpu (config.yaml)")
                           : "-",
         static_cast<int64_t>(r.iterations.size()),
         r.iterations.empty() ? analysis::Cell{} : analysis::Cell{r.iterations.back().iteration},
         analysis::cell_or_empty(median(ms)), analysis::cell_or_empty(median_tps),
         analysis::cell_or_empty(median(tflops)), analysis::cell_or_empty(peak),
         analysis::cell_or_empty(final_loss),
         r.eval_loss.empty() ? analysis::Cell{} : analysis::Cell{r.eval_loss.back().second},
         analysis::cell_or_empty(median_tps / first_tps)});
  }
  return t;
}

analysis::Table config_table(const std::vector<RunData>& runs) {
  analysis::Table t;
  t.name = "config";
  t.title = "Configuration";
  t.note =
      "config.yaml of each run (the effective configuration); rows where runs differ are "
      "marked.";
  t.columns = {{"key", true}, {"differs"}};
  for (const RunData& r : runs) t.columns.push_back({r.label});
  std::vector<std::string> keys;
  std::set<std::string> seen;
  for (const RunData& r : runs)
    for (const auto& [k, v] : r.config)
      if (seen.insert(k).second) keys.push_back(k);
  for (const std::string& k : keys) {
    std::vector<analysis::Cell> row = {k, std::string()};
    std::set<std::string> values;
    for (const RunData& r : runs) {
      const std::string v = r.config_value(k);
      values.insert(v);
      row.push_back(v);
    }
    row[1] = std::string(values.size() > 1 ? "yes" : "");
    t.rows.push_back(std::move(row));
  }
  return t;
}

std::string run_report_html(const std::vector<RunData>& runs, const std::vector<NamedChart>& charts,
                            const analysis::Table& throughput, const analysis::Table& config) {
  std::string h = std::string("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">") +
                  "<title>Tessera run report</title><style>" + kCss + "</style></head><body>\n" +
                  "<h1>Tessera run report</h1>\n<p class=\"note\">" + std::to_string(runs.size()) +
                  " run(s): ";
  for (size_t i = 0; i < runs.size(); ++i) {
    const std::string dir = runs[i].dir.string();
    h += (i ? ", " : "") + html_escape(runs[i].label);
    if (runs[i].label.find(dir) == std::string::npos) h += " (" + code(dir) + ")";
  }
  h += "</p>\n";

  h += "<h2 id=\"throughput\">" + html_escape(throughput.title) + "</h2>\n<p class=\"note\">" +
       html_escape(throughput.note) + "</p>\n" + html_table(throughput);
  std::string no_eval;
  for (const RunData& r : runs)
    if (r.eval_loss.empty())
      no_eval +=
          "<li>" + html_escape(r.label) + ": " + html_escape(why_no_evaluation(r)) + "</li>\n";
  if (!no_eval.empty())
    h += "<p class=\"note\" id=\"no-evaluation\">No validation loss (final_eval_loss, the dashed "
         "loss curve):</p>\n<ul class=\"note\">\n" +
         no_eval + "</ul>\n";

  h += "<h2 id=\"curves\">Curves</h2>\n<div class=\"charts\">\n";
  for (const NamedChart& c : charts)
    h += "<figure id=\"chart-" + c.file_stem + "\">\n" + render_svg(c.chart) + "</figure>\n";
  h += "</div>\n";

  h += "<h2 id=\"config\">" + html_escape(config.title) + "</h2>\n<p class=\"note\">" +
       html_escape(config.note) + "</p>\n";
  std::string missing;
  for (const RunData& r : runs)
    if (!r.has_config) missing += (missing.empty() ? "" : ", ") + html_escape(r.label);
  if (!missing.empty())
    h += "<p class=\"note\" id=\"no-config\">" + missing +
         (missing.find(", ") == std::string::npos ? " has" : " have") +
         " no config.yaml (written by <code>tessera train</code> at the start of a run)" +
         (config.rows.empty() ? ": no configuration to show.</p>\n" : "; empty cells.</p>\n");
  if (config.rows.empty()) {
    if (missing.empty()) h += "<p class=\"empty\">Empty: config.yaml holds no keys.</p>\n";
  } else {
    // The summary keeps the usual suspects and every key the runs differ in.
    analysis::Table summary = config;
    summary.name = "config_summary";
    std::erase_if(summary.rows, [](const std::vector<analysis::Cell>& row) {
      const std::string key = analysis::cell_text(row[0]);
      const bool usual =
          std::find_if(std::begin(kSummaryKeys), std::end(kSummaryKeys),
                       [&](const char* k) { return key == k; }) != std::end(kSummaryKeys);
      return !usual && analysis::cell_text(row[1]) != "yes";
    });
    h += summary.rows.empty()
             ? "<p class=\"empty\">The runs agree on every key and set none of the usual ones "
               "(model, sizes, batch, precision, lr): every key is below.</p>\n"
             : html_table(summary, "differs");
    h += "<details><summary>every key</summary>\n" + html_table(config, "differs") + "</details>\n";
  }

  h += "<h2 id=\"perf\">Performance report</h2>\n";
  for (const RunData& r : runs) {
    h += "<h3>" + html_escape(r.label) + "</h3>\n";
    if (r.report_tables.empty()) {
      h += "<p class=\"note\">" + why_no_trace_report(r) + "</p>\n";
      continue;
    }
    h += "<p class=\"note\">From " + code(r.report_dir.string()) +
         " (tessera report; definitions in docs/report.md).</p>\n";
    for (const CsvTable& t : r.report_tables) h += html_table(t);
  }
  return h + "</body></html>\n";
}

}  // namespace tessera::viz
