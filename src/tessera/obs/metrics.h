#pragma once
// metrics.jsonl at the experiment root: one JSON object per logged iteration (and one per
// evaluation), flushed as it is written so a crashed run keeps every line it logged.
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

namespace tessera {

class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path);  // appends
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const nlohmann::json& record);

 private:
  FILE* file_ = nullptr;
  std::string path_;
};

}  // namespace tessera
