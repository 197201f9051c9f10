#include "tessera/viz/run_report.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>
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

constexpr const char* kCss =
    R"(body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1700px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.8em}h3{font-size:1em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
table.data{display:block;overflow-x:auto;max-width:100%}
td,th{border:1px solid #ccc;padding:2px 6px}th{background:#f0f0f0;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}tr.differs td{background:#fff6e0}
p.note{color:#555;font-size:.85em;max-width:70em}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:1em}
figure{margin:0}svg.chart{width:100%;height:auto;border:1px solid #ddd}
)";

bool looks_numeric(const std::string& s) {
  if (s.empty()) return false;
  char* end = nullptr;
  std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size();
}

std::string html_table(const analysis::Table& t, const std::string& differs_column = "") {
  const int differs = differs_column.empty() ? -1 : t.column(differs_column);
  std::string out = "<table class=\"data\" id=\"table-" + html_escape(t.name) + "\"><tr>";
  for (const auto& c : t.columns) out += "<th>" + html_escape(c.name) + "</th>";
  out += "</tr>\n";
  for (const auto& row : t.rows) {
    const bool marked = differs >= 0 && analysis::cell_text(row[differs]) == "yes";
    out += marked ? "<tr class=\"differs\">" : "<tr>";
    for (const auto& cell : row) {
      const bool numeric = !std::holds_alternative<std::string>(cell);
      out += (numeric ? "<td class=\"n\">" : "<td>") + html_escape(analysis::cell_display(cell)) +
             "</td>";
    }
    out += "</tr>\n";
  }
  return out + "</table>\n";
}

std::string html_table(const CsvTable& t) {
  std::string out = "<h3>" + html_escape(t.name) + "</h3>\n<table class=\"data\"><tr>";
  for (const auto& c : t.columns) out += "<th>" + html_escape(c) + "</th>";
  out += "</tr>\n";
  for (size_t r = 0; r < std::min(t.rows.size(), kReportRows); ++r) {
    out += "<tr>";
    for (const auto& cell : t.rows[r]) {
      const std::string shown = cell.size() > 100 ? cell.substr(0, 97) + "..." : cell;
      out += (looks_numeric(cell) ? "<td class=\"n\">" : "<td>") + html_escape(shown) + "</td>";
    }
    out += "</tr>\n";
  }
  out += "</table>\n";
  if (t.rows.size() > kReportRows)
    out += fmt::format("<p class=\"note\">{} more rows in {}.csv</p>\n",
                       t.rows.size() - kReportRows, html_escape(t.name));
  return out;
}

}  // namespace

std::vector<NamedChart> run_charts(const std::vector<RunData>& runs) {
  std::vector<NamedChart> charts(4);
  charts[0] = {"loss", {"Training loss", "iteration", "lm loss", {}, false}};
  charts[1] = {"iteration_time", {"Time per iteration", "iteration", "ms per iteration", {}, true}};
  charts[2] = {"tokens_per_s", {"Throughput", "iteration", "tokens/s per GPU", {}, true}};
  charts[3] = {"memory", {"GPU memory", "iteration", "GiB", {}, true}};
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
  NamedChart balance{"moe_balance",
                     {"MoE load balance", "iteration", "aux loss / expert-load CV", {}, false}};
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunData& r = runs[i];
    const int c = static_cast<int>(i);
    Series aux = series_of(r, c, &IterationRecord::moe_aux_loss, r.label + " aux loss", false);
    if (aux.points.empty()) continue;
    balance.chart.series.push_back(std::move(aux));
    balance.chart.series.push_back(
        series_of(r, c, &IterationRecord::moe_expert_tokens_cv, r.label + " expert-load CV", true));
  }
  if (!balance.chart.series.empty()) charts.push_back(std::move(balance));
  return charts;
}

analysis::Table throughput_table(const std::vector<RunData>& runs) {
  analysis::Table t;
  t.name = "throughput";
  t.title = "Throughput";
  t.note =
      "medians over the logged iterations, leaving out the first record (warm-up) when "
      "there are more; TFLOP/s by the Megatron FLOPs convention (docs/performance.md).";
  t.columns = {{"run", true},
               {"device"},
               {"records"},
               {"last_iteration"},
               {"step_ms"},
               {"tokens_per_s_per_gpu"},
               {"tflops_per_gpu"},
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
        {r.label, r.device.empty() ? std::string("-") : r.device,
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
    if (runs[i].label.find(dir) == std::string::npos)
      h += " (<code>" + html_escape(dir) + "</code>)";
  }
  h += "</p>\n";

  h += "<h2 id=\"throughput\">" + html_escape(throughput.title) + "</h2>\n<p class=\"note\">" +
       html_escape(throughput.note) + "</p>\n" + html_table(throughput);

  h += "<h2 id=\"curves\">Curves</h2>\n<div class=\"charts\">\n";
  for (const NamedChart& c : charts)
    h += "<figure id=\"chart-" + c.file_stem + "\">\n" + render_svg(c.chart) + "</figure>\n";
  h += "</div>\n";

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
  h += "<h2 id=\"config\">" + html_escape(config.title) + "</h2>\n<p class=\"note\">" +
       html_escape(config.note) + "</p>\n" + html_table(summary, "differs") +
       "<details><summary>every key</summary>\n" + html_table(config, "differs") + "</details>\n";

  h += "<h2 id=\"perf\">Performance report</h2>\n";
  for (const RunData& r : runs) {
    h += "<h3>" + html_escape(r.label) + "</h3>\n";
    if (r.report_tables.empty()) {
      h += "<p class=\"note\">No trace report in <code>" + html_escape(r.dir.string()) +
           "</code>. Write one with <code>tessera report TRACE -o " + html_escape(r.dir.string()) +
           "/trace_report</code> and plot again to include its tables here.</p>\n";
      continue;
    }
    h += "<p class=\"note\">From <code>" + html_escape(r.report_dir.string()) +
         "</code> (tessera report; definitions in docs/report.md).</p>\n";
    for (const CsvTable& t : r.report_tables) h += html_table(t);
  }
  return h + "</body></html>\n";
}

}  // namespace tessera::viz
