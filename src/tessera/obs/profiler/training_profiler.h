#pragma once
// Profiling of a training run as the logging keys ask (profile, profile_step_start,
// profile_step_end, profile_ranks): on the listed ranks, iterations [start, end) are
// recorded (a resumed run starts at the first of them it reaches) and written, when the
// last of them ends or the run does, to {experiment}/traces/rank-{r}.pt.trace.json.gz.
//
// The trainer calls before_iteration / after_iteration around each iteration and opens
// PhaseSpans for its phases; outside the window nothing is attached to the backend, so an
// op costs one null-pointer test.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "tessera/config/config.h"
#include "tessera/obs/logger.h"
#include "tessera/obs/profiler/profiler.h"
#include "tessera/ops/backend.h"

namespace tessera::profiler {

class TrainingProfiler {
 public:
  using Duration = std::chrono::steady_clock::duration;

  // Null when profiling is off or `rank` is not in profile_ranks. Logs where the trace
  // will go.
  static std::unique_ptr<TrainingProfiler> create(const Experiment& e, int64_t rank,
                                                  int64_t world_size, Backend& backend,
                                                  Logger& log);
  TrainingProfiler(const Experiment& e, int64_t rank, int64_t world_size, Backend& backend,
                   Logger& log);
  // Detaches from the backend. A recording still running (the run stopped early) is
  // dropped without a file.
  ~TrainingProfiler();
  TrainingProfiler(const TrainingProfiler&) = delete;
  TrainingProfiler& operator=(const TrainingProfiler&) = delete;

  // Whether any iteration in [first, last] is (or was) recorded.
  bool covers(int64_t first, int64_t last) const;
  // Before iteration `it`: starts recording at the first iteration of the window. Returns
  // the time this took, for the caller to keep out of its iteration timings.
  Duration before_iteration(int64_t it);
  // After iteration `it` and its logging: once the window's last iteration (or the run's,
  // `last_iteration`) is done, stops, writes the trace and logs where it went. A trace
  // that cannot be written is logged as an error; training goes on. Returns the time taken.
  Duration after_iteration(int64_t it, int64_t last_iteration);

  Profiler* recording() { return recording_ ? &profiler_ : nullptr; }
  const std::string& trace_path() const { return path_; }

 private:
  void finish();

  Backend& backend_;
  Logger& log_;
  int64_t start_, end_;  // [start_, end_)
  std::string path_;
  Profiler profiler_;
  bool recording_ = false;
  bool done_ = false;
  int64_t first_recorded_ = 0, last_recorded_ = 0;
};

// A user_annotation span for a trainer phase ("data_loading", "optimizer", ...); does
// nothing unless `tp` is recording.
class PhaseSpan {
 public:
  PhaseSpan(TrainingProfiler* tp, std::string_view name)
      : p_(tp != nullptr ? tp->recording() : nullptr) {
    if (p_) p_->begin_annotation(name);
  }
  // The span carries one integer arg, e.g. ("forward_backward", "micro_batch", 2).
  PhaseSpan(TrainingProfiler* tp, std::string_view name, const char* key, int64_t value)
      : p_(tp != nullptr ? tp->recording() : nullptr) {
    if (p_) p_->begin_annotation(name, OpArgs().add(key, value));
  }
  // Named `prefix` + `number`, e.g. "ProfilerStep#12" (Kineto's step name).
  PhaseSpan(TrainingProfiler* tp, const char* prefix, int64_t number)
      : p_(tp != nullptr ? tp->recording() : nullptr) {
    if (p_) p_->begin_annotation(std::string(prefix) + std::to_string(number));
  }
  ~PhaseSpan() {
    if (p_ && p_->recording()) p_->end_annotation();
  }
  PhaseSpan(const PhaseSpan&) = delete;
  PhaseSpan& operator=(const PhaseSpan&) = delete;

 private:
  Profiler* p_;
};

}  // namespace tessera::profiler
