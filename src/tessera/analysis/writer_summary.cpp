// The human-readable outputs: summary.md and summary.html show the info block, warnings and
// the first Table::summary_rows rows of each table.
#include <algorithm>
#include <fstream>

#include <fmt/format.h>

#include "tessera/analysis/writers.h"
#include "tessera/core/error.h"

namespace tessera::analysis {
namespace {

constexpr size_t kMaxTextInSummary = 100;  // kernel names can run to thousands of characters

std::string shorten(const std::string& s) {
  return s.size() <= kMaxTextInSummary ? s : s.substr(0, kMaxTextInSummary - 3) + "...";
}

std::string md_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|')
      out += "\\|";
    else if (c == '\n')
      out += ' ';
    else
      out += c;
  }
  return out;
}

std::ofstream open_or_throw(const std::filesystem::path& file) {
  std::ofstream out(file);
  if (!out) throw DataError(fmt::format("{}: cannot write", file.string()));
  return out;
}

constexpr const char* kCss = R"(body{font-family:system-ui,sans-serif;margin:2em;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ccc;padding:2px 6px}
th{background:#f0f0f0;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
p.note{color:#555;font-size:.85em;max-width:60em}.warn{color:#a40}
.bar{display:inline-block;height:.8em;background:#4a7bd0;vertical-align:middle}
)";

}  // namespace

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

void write_markdown(const Report& report, const std::filesystem::path& file) {
  std::ofstream out = open_or_throw(file);
  out << "# " << report.title << "\n\n";
  for (const auto& [k, v] : report.headline) out << "- **" << k << "**: " << v << "\n";
  if (!report.headline.empty()) out << "\n";
  for (const auto& [k, v] : report.info) out << "- **" << k << "**: " << v << "\n";
  for (const std::string& w : report.warnings) out << "- **warning**: " << w << "\n";
  for (const Table& t : report.tables) {
    if (t.summary_rows == 0) continue;
    out << "\n## " << t.title << "\n\n";
    if (!t.note.empty()) out << t.note << "\n\n";
    if (t.rows.empty()) {
      out << "(no rows)\n";
      continue;
    }
    for (const Column& c : t.columns) out << "| " << c.name << " ";
    out << "|\n";
    for (size_t i = 0; i < t.columns.size(); ++i) out << "|---";
    out << "|\n";
    const size_t n = std::min(t.rows.size(), t.summary_rows);
    for (size_t r = 0; r < n; ++r) {
      for (const Cell& c : t.rows[r]) out << "| " << md_escape(shorten(cell_display(c))) << " ";
      out << "|\n";
    }
    if (n < t.rows.size()) {
      out << "\n(" << t.rows.size() - n << " more rows in " << t.name << ".csv / report.xlsx)\n";
    }
  }
  out << "\nAll tables, all rows: report.xlsx and <table>.csv in this directory.\n";
}

void write_html(const Report& report, const std::filesystem::path& file) {
  std::ofstream out = open_or_throw(file);
  out << "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" << html_escape(report.title)
      << "</title><style>" << kCss << "</style></head><body>\n";
  out << "<h1>" << html_escape(report.title) << "</h1>\n";
  if (!report.headline.empty()) {
    out << "<ul>\n";
    for (const auto& [k, v] : report.headline) {
      out << "<li><b>" << html_escape(k) << "</b>: " << html_escape(v) << "</li>\n";
    }
    out << "</ul>\n";
  }
  out << "<table>\n";
  for (const auto& [k, v] : report.info) {
    out << "<tr><th>" << html_escape(k) << "</th><td>" << html_escape(v) << "</td></tr>\n";
  }
  out << "</table>\n";
  for (const std::string& w : report.warnings) {
    out << "<p class=\"warn\">warning: " << html_escape(w) << "</p>\n";
  }
  for (const Table& t : report.tables) {
    if (t.summary_rows == 0) continue;
    out << "<h2>" << html_escape(t.title) << "</h2>\n";
    if (!t.note.empty()) out << "<p class=\"note\">" << html_escape(t.note) << "</p>\n";
    if (t.rows.empty()) {
      out << "<p>(no rows)</p>\n";
      continue;
    }
    // A bar next to share/percent columns makes the dominant rows visible at a glance.
    const int bar = t.column("share_pct") >= 0 ? t.column("share_pct") : t.column("percent");
    out << "<table><tr>";
    for (const Column& c : t.columns) out << "<th>" << html_escape(c.name) << "</th>";
    out << "</tr>\n";
    const size_t n = std::min(t.rows.size(), t.summary_rows);
    for (size_t r = 0; r < n; ++r) {
      out << "<tr>";
      for (size_t c = 0; c < t.rows[r].size(); ++c) {
        const Cell& cell = t.rows[r][c];
        const bool numeric = !std::holds_alternative<std::string>(cell);
        const std::string text = cell_display(cell);
        out << (numeric ? "<td class=\"n\">" : "<td>");
        if (!numeric && text.size() > kMaxTextInSummary) {
          out << "<span title=\"" << html_escape(text) << "\">" << html_escape(shorten(text))
              << "</span>";
        } else {
          out << html_escape(text);
        }
        if (static_cast<int>(c) == bar && std::holds_alternative<double>(cell)) {
          const double w = std::clamp(std::get<double>(cell), 0.0, 100.0);
          out << " <span class=\"bar\" style=\"width:" << fmt::format("{:.1f}", w)
              << "px\"></span>";
        }
        out << "</td>";
      }
      out << "</tr>\n";
    }
    out << "</table>\n";
    if (n < t.rows.size()) {
      out << "<p class=\"note\">" << t.rows.size() - n << " more rows in " << t.name
          << ".csv / report.xlsx</p>\n";
    }
  }
  out << "</body></html>\n";
}

}  // namespace tessera::analysis
