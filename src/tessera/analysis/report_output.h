#pragma once
// How benchmark-style commands show their results: tables as markdown on stdout and as CSV
// (plus the markdown) in an output directory, and a status line on a terminal while they run.
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "tessera/analysis/table.h"

namespace tessera::analysis {

// A markdown table: title as a bold line, note below, every row.
std::string markdown_table(const analysis::Table& table);

// Writes <dir>/<table.name>.csv for each table and <dir>/<markdown_name> with `markdown`;
// creates dir. Returns the files written. Throws DataError when a file cannot be written.
std::vector<std::string> write_outputs(const std::filesystem::path& dir,
                                       const std::vector<analysis::Table>& tables,
                                       const std::string& markdown_name,
                                       const std::string& markdown);

// Prints `markdown` on stdout and, when output_dir is not empty, writes the tables and the
// markdown there (write_outputs) and lists the files written.
void print_and_write(const std::string& output_dir, const std::vector<analysis::Table>& tables,
                     const std::string& markdown_name, const std::string& markdown);

// "[3/30] gemm NT 8192x8192x8192 ..." redrawn in place on stderr when it is a terminal (and
// nothing otherwise, so logs stay clean); finish() clears it and returns seconds elapsed.
class StatusLine {
 public:
  explicit StatusLine(int total);
  ~StatusLine();
  StatusLine(const StatusLine&) = delete;
  StatusLine& operator=(const StatusLine&) = delete;
  void step(const std::string& what);  // advances the count and shows `what`
  double finish();

 private:
  int total_, done_ = 0;
  bool tty_, shown_ = false;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace tessera::analysis
