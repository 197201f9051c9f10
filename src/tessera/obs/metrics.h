#pragma once
// metrics.jsonl at the experiment root: one JSON object per logged iteration (and one per
// evaluation), flushed as it is written so a crashed run keeps every line it logged.
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

namespace tessera {

class MetricsWriter {
 public:
  // Appends (after a line break, if a killed run left its last line unfinished). With a run id
  // (train/run_directories.h), every record carries it as "run_id", so readers can tell runs
  // apart in one file.
  explicit MetricsWriter(const std::string& path, std::string run_id = "");
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const nlohmann::json& record);

 private:
  FILE* file_ = nullptr;
  std::string path_;
  std::string run_id_;
};

}  // namespace tessera
