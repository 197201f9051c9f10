#include "tessera/obs/metrics.h"

#include <fstream>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {

namespace {

// Whether the file ends inside a line: a run killed while writing one (a write to a file can
// stop at a page boundary when the process is killed).
bool ends_inside_a_line(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in || in.tellg() <= 0) return false;
  in.seekg(-1, std::ios::end);
  return in.get() != '\n';
}

}  // namespace

MetricsWriter::MetricsWriter(const std::string& path, std::string run_id)
    : path_(path), run_id_(std::move(run_id)) {
  const bool torn = ends_inside_a_line(path);
  file_ = std::fopen(path.c_str(), "a");
  if (!file_) throw Error(fmt::format("{}: cannot open metrics file for writing", path));
  // The torn line stays, on a line of its own (readers skip it), so that this run's first record
  // is not glued to it and lost.
  if (torn && (std::fputs("\n", file_) < 0 || std::fflush(file_) != 0))
    throw Error(fmt::format("{}: write failed (disk full?)", path_));
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const nlohmann::json& record) {
  nlohmann::json stamped = record;
  if (!run_id_.empty()) stamped["run_id"] = run_id_;
  const std::string line = stamped.dump() + "\n";
  if (std::fputs(line.c_str(), file_) < 0 || std::fflush(file_) != 0)
    throw Error(fmt::format("{}: write failed (disk full?)", path_));
}

}  // namespace tessera
