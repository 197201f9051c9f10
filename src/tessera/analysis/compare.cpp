#include "tessera/analysis/compare.h"

#include <unordered_map>

#include "tessera/analysis/writers.h"

namespace tessera::analysis {
namespace {

bool is_number(const Cell& c) {
  return std::holds_alternative<int64_t>(c) || std::holds_alternative<double>(c);
}

double as_double(const Cell& c) {
  if (auto* i = std::get_if<int64_t>(&c)) return static_cast<double>(*i);
  return std::get<double>(c);
}

// A column is numeric when any row of either table holds a number there.
bool numeric_column(const Table& t, int col) {
  if (col < 0) return false;
  for (const auto& row : t.rows) {
    if (is_number(row[col])) return true;
  }
  return false;
}

std::string row_key(const Table& t, const std::vector<Cell>& row) {
  std::string key;
  for (size_t c = 0; c < t.columns.size(); ++c) {
    if (t.columns[c].key) key += cell_text(row[c]) + '\x1f';
  }
  return key;
}

}  // namespace

Table compare_tables(const Table& a, const Table& b) {
  Table out;
  out.name = a.name;
  out.title = a.title + " (A vs B)";
  out.note = a.note;
  out.summary_rows = a.summary_rows;
  // Columns of A, then any column only B has.
  std::vector<std::string> names;
  for (const Column& c : a.columns) names.push_back(c.name);
  for (const Column& c : b.columns) {
    if (a.column(c.name) < 0) names.push_back(c.name);
  }
  struct Source {
    int a, b;
    bool key, numeric;
  };
  std::vector<Source> sources;
  for (const std::string& n : names) {
    int ia = a.column(n), ib = b.column(n);
    bool key = (ia >= 0 && a.columns[ia].key) || (ib >= 0 && b.columns[ib].key);
    bool numeric = !key && (numeric_column(a, ia) || numeric_column(b, ib));
    sources.push_back({ia, ib, key, numeric});
    if (numeric) {
      for (const char* suffix : {"_a", "_b", "_diff", "_pct"}) out.columns.push_back({n + suffix});
    } else {
      out.columns.push_back({n, key});
    }
  }
  // Row order: A's rows, then rows only B has.
  std::unordered_map<std::string, size_t> b_rows;
  for (size_t r = 0; r < b.rows.size(); ++r) b_rows.emplace(row_key(b, b.rows[r]), r);
  std::vector<std::pair<const std::vector<Cell>*, const std::vector<Cell>*>> pairs;
  std::unordered_map<std::string, bool> seen;
  for (const auto& row : a.rows) {
    std::string key = row_key(a, row);
    auto it = b_rows.find(key);
    pairs.emplace_back(&row, it == b_rows.end() ? nullptr : &b.rows[it->second]);
    seen[key] = true;
  }
  for (const auto& row : b.rows) {
    if (!seen.count(row_key(b, row))) pairs.emplace_back(nullptr, &row);
  }
  for (const auto& [ra, rb] : pairs) {
    std::vector<Cell> row;
    for (const Source& s : sources) {
      Cell ca, cb;
      if (ra && s.a >= 0) ca = (*ra)[s.a];
      if (rb && s.b >= 0) cb = (*rb)[s.b];
      if (!s.numeric) {
        row.push_back(std::holds_alternative<std::monostate>(ca) ? cb : ca);
        continue;
      }
      row.push_back(ca);
      row.push_back(cb);
      if (is_number(ca) && is_number(cb)) {
        const double x = as_double(ca), y = as_double(cb);
        row.push_back(y - x);
        row.push_back(x != 0 ? Cell{100.0 * (y - x) / x} : Cell{});
      } else {
        row.push_back(Cell{});
        row.push_back(Cell{});
      }
    }
    out.rows.push_back(std::move(row));
  }
  return out;
}

Report compare_reports(const Report& a, const Report& b) {
  Report out;
  out.title = "Comparison: A = " + a.title.substr(a.title.find(':') + 2) +
              ", B = " + b.title.substr(b.title.find(':') + 2);
  for (const auto& [k, v] : a.headline) out.headline.push_back({"A " + k, v});
  for (const auto& [k, v] : b.headline) out.headline.push_back({"B " + k, v});
  for (const auto& [k, v] : a.info) out.info.push_back({"A " + k, v});
  for (const auto& [k, v] : b.info) out.info.push_back({"B " + k, v});
  for (const std::string& w : a.warnings) out.warnings.push_back("A: " + w);
  for (const std::string& w : b.warnings) out.warnings.push_back("B: " + w);
  for (const Table& ta : a.tables) {
    const Table* tb = b.find(ta.name);
    out.tables.push_back(compare_tables(ta, tb ? *tb : Table{ta.name, "", "", ta.columns, {}}));
  }
  return out;
}

}  // namespace tessera::analysis
