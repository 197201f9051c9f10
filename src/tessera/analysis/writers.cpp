#include "tessera/analysis/writers.h"

#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>
#include <utility>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera::analysis {

OutputFormats parse_formats(std::string_view list) {
  OutputFormats f{false, false, false, false};
  std::stringstream ss{std::string(list)};
  std::string item;
  bool any = false;
  while (std::getline(ss, item, ',')) {
    if (item == "xlsx")
      f.xlsx = true;
    else if (item == "csv")
      f.csv = true;
    else if (item == "md")
      f.md = true;
    else if (item == "html")
      f.html = true;
    else
      throw ConfigError("command line", "format", std::string(list),
                        "a comma-separated subset of xlsx,csv,md,html");
    any = true;
  }
  if (!any) {
    throw ConfigError("command line", "format", std::string(list),
                      "a comma-separated subset of xlsx,csv,md,html");
  }
  return f;
}

std::string cell_text(const Cell& c) {
  if (auto* s = std::get_if<std::string>(&c)) return *s;
  if (auto* i = std::get_if<int64_t>(&c)) return std::to_string(*i);
  if (auto* d = std::get_if<double>(&c)) return fmt::format("{:.9g}", *d);
  return "";
}

std::string cell_display(const Cell& c) {
  if (auto* d = std::get_if<double>(&c)) {
    const double a = std::fabs(*d);
    if (a == 0) return "0";
    if (a >= 100) return fmt::format("{:.1f}", *d);
    if (a >= 1) return fmt::format("{:.2f}", *d);
    return fmt::format("{:.3g}", *d);
  }
  return cell_text(c);
}

void write_csv(const Table& table, const std::filesystem::path& file) {
  std::ofstream out(file);
  if (!out) throw DataError(fmt::format("{}: cannot write", file.string()));
  auto field = [&](const std::string& s) {
    if (s.find_first_of(",\"\n\r") == std::string::npos) {
      out << s;
      return;
    }
    out << '"';
    for (char ch : s) out << (ch == '"' ? "\"\"" : std::string(1, ch));
    out << '"';
  };
  for (size_t i = 0; i < table.columns.size(); ++i) {
    if (i) out << ',';
    field(table.columns[i].name);
  }
  out << '\n';
  for (const auto& row : table.rows) {
    for (size_t i = 0; i < row.size(); ++i) {
      if (i) out << ',';
      field(cell_text(row[i]));
    }
    out << '\n';
  }
  if (!out) throw DataError(fmt::format("{}: write failed", file.string()));
}

std::vector<std::string> write_report(const Report& report, const std::filesystem::path& dir,
                                      const OutputFormats& formats) {
  namespace fs = std::filesystem;
  std::vector<std::pair<std::string, std::function<void(const fs::path&)>>> outputs;
  if (formats.xlsx)
    outputs.emplace_back("report.xlsx", [&](const fs::path& f) { write_xlsx(report, f); });
  if (formats.csv) {
    for (const Table& t : report.tables)
      outputs.emplace_back(t.name + ".csv", [&](const fs::path& f) { write_csv(t, f); });
  }
  if (formats.md)
    outputs.emplace_back("summary.md", [&](const fs::path& f) { write_markdown(report, f); });
  if (formats.html)
    outputs.emplace_back("summary.html", [&](const fs::path& f) { write_html(report, f); });

  std::error_code ec;
  const bool existed = fs::is_directory(dir, ec);
  fs::create_directories(dir, ec);
  if (ec) {
    throw DataError(
        fmt::format("{}: cannot create output directory: {}", dir.string(), ec.message()));
  }
  // Every file is written under a temporary name and renamed once all are complete, so a failure
  // leaves neither half a file nor half a report (nor a directory it created).
  std::vector<fs::path> temps;
  try {
    for (const auto& [name, write] : outputs) {
      temps.push_back(dir / (name + ".tmp"));
      write(temps.back());
    }
  } catch (...) {
    for (const fs::path& t : temps) fs::remove(t, ec);
    if (!existed) fs::remove(dir, ec);
    throw;
  }
  std::vector<std::string> written;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const fs::path file = dir / outputs[i].first;
    fs::rename(temps[i], file, ec);
    if (ec)
      throw DataError(fmt::format("{}: cannot rename into place: {}", file.string(), ec.message()));
    written.push_back(file.string());
  }
  return written;
}

}  // namespace tessera::analysis
