#pragma once
// Report outputs: one xlsx workbook (a sheet per table), one CSV per table, a markdown
// summary and a self-contained HTML summary (inline CSS, no network resources).
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/analysis/table.h"

namespace tessera::analysis {

struct OutputFormats {
  bool xlsx = true, csv = true, md = true, html = true;
};

// "xlsx,csv,md,html" (any subset). Throws ConfigError naming the flag.
OutputFormats parse_formats(std::string_view list);

// Text safe in HTML (and SVG/XML) content and attribute values: & < > " escaped.
std::string html_escape(const std::string& s);

// Full precision for machine-read files (CSV).
std::string cell_text(const Cell& c);
// Rounded for people (markdown, HTML).
std::string cell_display(const Cell& c);

void write_csv(const Table& table, const std::filesystem::path& file);
void write_xlsx(const Report& report, const std::filesystem::path& file);
void write_markdown(const Report& report, const std::filesystem::path& file);
void write_html(const Report& report, const std::filesystem::path& file);

// Writes the chosen formats into `dir` (created if needed); returns the files written. Files
// appear only when all are complete (temporary names, then renames). Throws DataError when a file
// cannot be written.
std::vector<std::string> write_report(const Report& report, const std::filesystem::path& dir,
                                      const OutputFormats& formats);

}  // namespace tessera::analysis
