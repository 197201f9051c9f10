#pragma once
// The report's unit: a named table of typed cells. Every analysis produces Tables; every
// writer (xlsx, csv, markdown, html) and the compare step consume them, so a new sheet needs
// no writer changes.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace tessera::analysis {

using Cell = std::variant<std::monostate, std::string, int64_t, double>;

struct Column {
  std::string name;  // snake_case with a unit suffix where it has one (total_ms, mean_us)
  bool key = false;  // identifies a row; compare joins tables on the key columns
};

struct Table {
  std::string name;   // sheet and file name: gpu_timeline, categories, gemm, ...
  std::string title;  // heading in the markdown/html summary
  std::string note;   // one or two sentences on what the numbers mean
  std::vector<Column> columns;
  std::vector<std::vector<Cell>> rows;
  // Rows shown in the markdown/html summary (0: only in xlsx/csv); the files have all rows.
  size_t summary_rows = 25;

  int column(std::string_view column_name) const {
    for (size_t i = 0; i < columns.size(); ++i) {
      if (columns[i].name == column_name) return static_cast<int>(i);
    }
    return -1;
  }
  // A numeric cell, or nullopt when empty (or no such column).
  std::optional<double> number(size_t row, std::string_view column_name) const {
    const int c = column(column_name);
    if (c < 0) return std::nullopt;
    const Cell& cell = rows[row][c];
    if (auto* i = std::get_if<int64_t>(&cell)) return static_cast<double>(*i);
    if (auto* d = std::get_if<double>(&cell)) return *d;
    return std::nullopt;
  }
  // A text cell, or "" when it holds none (or no such column).
  std::string text(size_t row, std::string_view column_name) const {
    const int c = column(column_name);
    const auto* s = c < 0 ? nullptr : std::get_if<std::string>(&rows[row][c]);
    return s ? *s : std::string();
  }
};

struct Report {
  std::string title;
  // The numbers to read first (step time, GPU busy, top categories, GEMM TFLOP/s, bandwidth),
  // as (label, text); printed on the console and at the top of the summaries. A label may
  // repeat for a list (the worst bandwidth rows).
  std::vector<std::pair<std::string, std::string>> headline;
  std::vector<std::pair<std::string, std::string>> info;  // shown first, and as the info sheet
  std::vector<Table> tables;
  std::vector<std::string> warnings;

  const Table* find(std::string_view name) const {
    for (const Table& t : tables) {
      if (t.name == name) return &t;
    }
    return nullptr;
  }
};

// Cell helpers: missing numbers (negative sizes, NaN) become empty cells.
inline Cell cell_or_empty(int64_t v) {
  return v < 0 ? Cell{} : Cell{v};
}
inline Cell cell_or_empty(double v) {
  return v != v ? Cell{} : Cell{v};
}

}  // namespace tessera::analysis
