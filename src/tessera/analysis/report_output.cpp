#include "tessera/analysis/report_output.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include <fmt/format.h>

#include "tessera/analysis/writers.h"
#include "tessera/core/error.h"

namespace tessera::analysis {

std::string markdown_table(const analysis::Table& t) {
  std::string out = fmt::format("**{}**\n\n", t.title);
  if (!t.note.empty()) out += t.note + "\n\n";
  for (const auto& c : t.columns) out += "| " + c.name + " ";
  out += "|\n";
  for (size_t i = 0; i < t.columns.size(); ++i) out += "|---";
  out += "|\n";
  for (const auto& row : t.rows) {
    for (const auto& cell : row) {
      std::string text = analysis::cell_display(cell);
      for (size_t p = text.find('|'); p != std::string::npos; p = text.find('|', p + 2))
        text.replace(p, 1, "\\|");
      out += "| " + text + " ";
    }
    out += "|\n";
  }
  return out;
}

std::vector<std::string> write_outputs(const std::filesystem::path& dir,
                                       const std::vector<analysis::Table>& tables,
                                       const std::string& markdown_name,
                                       const std::string& markdown) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw DataError(fmt::format("{}: cannot create directory: {}", dir.string(), ec.message()));
  std::vector<std::string> written;
  for (const auto& t : tables) {
    analysis::write_csv(t, dir / (t.name + ".csv"));
    written.push_back((dir / (t.name + ".csv")).string());
  }
  const std::filesystem::path md = dir / markdown_name;
  std::ofstream out(md);
  out << markdown;
  if (!out) throw DataError(fmt::format("{}: cannot write", md.string()));
  written.push_back(md.string());
  return written;
}

StatusLine::StatusLine(int total)
    : total_(total), tty_(isatty(fileno(stderr)) != 0), start_(std::chrono::steady_clock::now()) {}

StatusLine::~StatusLine() {
  if (shown_) std::fputs("\r\033[K", stderr);
}

void StatusLine::step(const std::string& what) {
  ++done_;
  if (!tty_) return;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::string line = fmt::format("[{}/{}] {} ({:.0f} s)", done_, total_, what, s);
  if (line.size() > 120) line.resize(120);
  std::fputs(("\r\033[K" + line).c_str(), stderr);
  std::fflush(stderr);
  shown_ = true;
}

double StatusLine::finish() {
  if (shown_) std::fputs("\r\033[K", stderr);
  shown_ = false;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void print_and_write(const std::string& output_dir, const std::vector<analysis::Table>& tables,
                     const std::string& markdown_name, const std::string& markdown) {
  fmt::print("{}", markdown);
  if (output_dir.empty()) return;
  for (const auto& f : write_outputs(output_dir, tables, markdown_name, markdown))
    fmt::print("wrote {}\n", f);
}

}  // namespace tessera::analysis
