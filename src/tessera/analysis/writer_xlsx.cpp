#include <xlsxwriter.h>

#include <algorithm>

#include <fmt/format.h>

#include "tessera/analysis/writers.h"
#include "tessera/core/error.h"

namespace tessera::analysis {
namespace {

// Excel caps a cell's text at 32767 characters and a sheet name at 31.
std::string clip(const std::string& s, size_t n) {
  return s.size() <= n ? s : s.substr(0, n);
}

void check(lxw_error rc, const std::filesystem::path& file) {
  if (rc != LXW_NO_ERROR) {
    throw DataError(fmt::format("{}: cannot write workbook: {}", file.string(), lxw_strerror(rc)));
  }
}

}  // namespace

void write_xlsx(const Report& report, const std::filesystem::path& file) {
  lxw_workbook* wb = workbook_new(file.c_str());
  if (!wb) throw DataError(fmt::format("{}: cannot create workbook", file.string()));
  lxw_format* bold = workbook_add_format(wb);
  format_set_bold(bold);
  lxw_format* number = workbook_add_format(wb);
  format_set_num_format(number, "0.000");

  lxw_worksheet* info = workbook_add_worksheet(wb, "info");
  worksheet_set_column(info, 0, 0, 20, nullptr);
  worksheet_set_column(info, 1, 1, 100, nullptr);
  lxw_row_t r = 0;
  worksheet_write_string(info, r++, 0, clip(report.title, 32767).c_str(), bold);
  for (const auto& [k, v] : report.headline) {
    worksheet_write_string(info, r, 0, k.c_str(), bold);
    worksheet_write_string(info, r++, 1, clip(v, 32767).c_str(), nullptr);
  }
  for (const auto& [k, v] : report.info) {
    worksheet_write_string(info, r, 0, k.c_str(), bold);
    worksheet_write_string(info, r++, 1, clip(v, 32767).c_str(), nullptr);
  }
  for (const std::string& w : report.warnings) {
    worksheet_write_string(info, r, 0, "warning", bold);
    worksheet_write_string(info, r++, 1, clip(w, 32767).c_str(), nullptr);
  }
  for (const Table& t : report.tables) {
    lxw_worksheet* ws = workbook_add_worksheet(wb, clip(t.name, 31).c_str());
    for (size_t c = 0; c < t.columns.size(); ++c) {
      worksheet_write_string(ws, 0, static_cast<lxw_col_t>(c), t.columns[c].name.c_str(), bold);
      // Text columns (kernel names) get wide, numbers narrow.
      bool text = !t.rows.empty() && std::holds_alternative<std::string>(t.rows[0][c]);
      worksheet_set_column(ws, static_cast<lxw_col_t>(c), static_cast<lxw_col_t>(c), text ? 40 : 14,
                           nullptr);
    }
    worksheet_freeze_panes(ws, 1, 0);
    for (size_t i = 0; i < t.rows.size(); ++i) {
      const auto row = static_cast<lxw_row_t>(i + 1);
      for (size_t c = 0; c < t.rows[i].size(); ++c) {
        const Cell& cell = t.rows[i][c];
        const auto col = static_cast<lxw_col_t>(c);
        if (auto* s = std::get_if<std::string>(&cell)) {
          worksheet_write_string(ws, row, col, clip(*s, 32767).c_str(), nullptr);
        } else if (auto* n = std::get_if<int64_t>(&cell)) {
          worksheet_write_number(ws, row, col, static_cast<double>(*n), nullptr);
        } else if (auto* d = std::get_if<double>(&cell)) {
          worksheet_write_number(ws, row, col, *d, number);
        }
      }
    }
  }
  check(workbook_close(wb), file);
}

}  // namespace tessera::analysis
