#pragma once
// Small hand-built Chrome traces with known answers, written to a per-test temp directory.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace tessera::analysis::testing {

using nlohmann::json;

// A fresh directory per test, under GoogleTest's temp dir.
inline std::filesystem::path test_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  // The process id keeps test runs of several checkouts at once apart.
  auto dir = std::filesystem::path(::testing::TempDir()) / "tessera_analysis" /
             (std::string(info->test_suite_name()) + "." + info->name() + "." +
              std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline std::string write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

class TraceBuilder {
 public:
  // Times in µs, as in the files.
  TraceBuilder& kernel(const std::string& name, double ts, double dur, json args = json::object(),
                       int device = 0, int stream = 7) {
    return add({{"ph", "X"},
                {"cat", "kernel"},
                {"name", name},
                {"pid", device},
                {"tid", stream},
                {"ts", ts},
                {"dur", dur},
                {"args", args}});
  }
  TraceBuilder& memcpy(double ts, double dur, int device = 0,
                       const std::string& name = "Memcpy HtoD (Pageable -> Device)",
                       json args = {{"bytes", 1 << 20}}) {
    return add({{"ph", "X"},
                {"cat", "gpu_memcpy"},
                {"name", name},
                {"pid", device},
                {"tid", 7},
                {"ts", ts},
                {"dur", dur},
                {"args", args}});
  }
  TraceBuilder& memset(double ts, double dur, int device = 0, json args = json::object()) {
    return add({{"ph", "X"},
                {"cat", "gpu_memset"},
                {"name", "Memset (Device)"},
                {"pid", device},
                {"tid", 7},
                {"ts", ts},
                {"dur", dur},
                {"args", args}});
  }
  TraceBuilder& cpu_op(const std::string& name, double ts, double dur, json args = json::object(),
                       int tid = 100) {
    return add({{"ph", "X"},
                {"cat", "cpu_op"},
                {"name", name},
                {"pid", 100},
                {"tid", tid},
                {"ts", ts},
                {"dur", dur},
                {"args", args}});
  }
  // Kineto's thread_name metadata event.
  TraceBuilder& thread_name(int tid, const std::string& name) {
    return add({{"ph", "M"},
                {"name", "thread_name"},
                {"pid", 100},
                {"tid", tid},
                {"ts", 0},
                {"args", {{"name", name}}}});
  }
  // A ProfilerStep#N range, as torch.profiler and Tessera's recorder write one per iteration.
  TraceBuilder& step(int n, double ts, double dur) {
    return add({{"ph", "X"},
                {"cat", "user_annotation"},
                {"name", "ProfilerStep#" + std::to_string(n)},
                {"pid", 100},
                {"tid", 100},
                {"ts", ts},
                {"dur", dur}});
  }
  TraceBuilder& runtime(double ts, int64_t correlation, int64_t external_id) {
    return add({{"ph", "X"},
                {"cat", "cuda_runtime"},
                {"name", "cudaLaunchKernel"},
                {"pid", 100},
                {"tid", 100},
                {"ts", ts},
                {"dur", 2},
                {"args", {{"correlation", correlation}, {"External id", external_id}}}});
  }
  TraceBuilder& add(json event) {
    events_.push_back(std::move(event));
    return *this;
  }
  TraceBuilder& member(const std::string& key, json value) {
    members_[key] = std::move(value);
    return *this;
  }
  std::string text() const {
    json j = members_;
    j["traceEvents"] = events_;
    return j.dump();
  }
  std::string write(const std::string& file_name) const {
    return write_file(test_dir_ / file_name, text());
  }
  explicit TraceBuilder(std::filesystem::path dir) : test_dir_(std::move(dir)) {}

 private:
  std::filesystem::path test_dir_;
  json members_ = json::object();
  json events_ = json::array();
};

}  // namespace tessera::analysis::testing
