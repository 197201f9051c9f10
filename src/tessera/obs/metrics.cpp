#include "tessera/obs/metrics.h"

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {

MetricsWriter::MetricsWriter(const std::string& path, std::string run_id)
    : path_(path), run_id_(std::move(run_id)) {
  file_ = std::fopen(path.c_str(), "a");
  if (!file_) throw Error(fmt::format("{}: cannot open metrics file for writing", path));
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
