#include "tessera/obs/profiler/training_profiler.h"

#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tessera/config/profile_ranks.h"
#include "tessera/core/error.h"

namespace tessera::profiler {
namespace {

using Clock = std::chrono::steady_clock;

std::string megabytes(uint64_t bytes) {
  return fmt::format("{:.1f} MB", static_cast<double>(bytes) / 1e6);
}

ProfilerOptions options_for(const Experiment& e, int64_t rank, int64_t world_size,
                            const Backend& backend) {
  ProfilerOptions o;
  o.rank = static_cast<int>(rank);
  o.world_size = static_cast<int>(world_size);
  o.device = backend.device();
  o.process_name = fmt::format("tessera rank {}", rank);
  const TrainingConfig& t = e.training;
  nlohmann::json run = {
      {"experiment", e.experiment_root()},
      {"model", e.model},
      {"backend", backend.description()},
      {"seq_length", t.seq_length},
      {"micro_batch_size", t.micro_batch_size},
      {"global_batch_size", t.global_batch_size},
      {"profile_step_start", e.logging.profile_step_start},
      {"profile_step_end", e.logging.profile_step_end},
  };
  o.metadata_json = run.dump();
  return o;
}

}  // namespace

std::unique_ptr<TrainingProfiler> TrainingProfiler::create(const Experiment& e, int64_t rank,
                                                           int64_t world_size, Backend& backend,
                                                           Logger& log) {
  if (!e.logging.profile) return nullptr;
  const auto ranks = parse_profile_ranks(e.logging.profile_ranks);
  if (!ranks) {  // validation rejects this; be safe for experiments built in code
    throw ConfigError("configuration", "profile_ranks", e.logging.profile_ranks,
                      "\"all\" or comma-separated rank ids");
  }
  if (!ranks->contains(rank)) return nullptr;
  auto p = std::make_unique<TrainingProfiler>(e, rank, world_size, backend, log);
  log.info("profiling: iterations [{}, {}) will be recorded to {}", p->start_, p->end_, p->path_);
  return p;
}

TrainingProfiler::TrainingProfiler(const Experiment& e, int64_t rank, int64_t world_size,
                                   Backend& backend, Logger& log)
    : backend_(backend),
      log_(log),
      start_(e.logging.profile_step_start),
      end_(e.logging.profile_step_end),
      path_((std::filesystem::path(e.experiment_root()) / "traces" /
             fmt::format("rank-{}.pt.trace.json.gz", rank))
                .string()),
      profiler_(options_for(e, rank, world_size, backend)) {}

TrainingProfiler::~TrainingProfiler() {
  if (backend_.op_observer() == &profiler_) backend_.set_op_observer(nullptr);
  // ~Profiler stops a recording still running.
}

bool TrainingProfiler::covers(int64_t first, int64_t last) const {
  return first < end_ && last >= start_;
}

TrainingProfiler::Duration TrainingProfiler::before_iteration(int64_t it) {
  if (recording_ || done_ || it < start_ || it >= end_) return {};
  const auto t0 = Clock::now();
  profiler_.start();
  backend_.set_op_observer(&profiler_);
  recording_ = true;
  first_recorded_ = last_recorded_ = it;
  log_.info("profiling: recording from iteration {} (GPU activity: {})", it,
            profiler_.gpu_tracing());
  for (const std::string& w : profiler_.warnings()) log_.warning("profiling: {}", w);
  return Clock::now() - t0;
}

TrainingProfiler::Duration TrainingProfiler::after_iteration(int64_t it, int64_t last_iteration) {
  if (!recording_) return {};
  last_recorded_ = it;
  if (it < end_ - 1 && it < last_iteration) return {};
  const auto t0 = Clock::now();
  finish();
  return Clock::now() - t0;
}

void TrainingProfiler::finish() {
  backend_.set_op_observer(nullptr);
  recording_ = false;
  done_ = true;
  const size_t known_warnings = profiler_.warnings().size();
  backend_.synchronize();  // a device error here is the run's, not the profiler's: it throws
  profiler_.stop();
  for (size_t i = known_warnings; i < profiler_.warnings().size(); ++i)
    log_.warning("profiling: {}", profiler_.warnings()[i]);
  try {
    const TraceSummary s = profiler_.write(path_);
    const std::string iterations =
        first_recorded_ == last_recorded_
            ? fmt::format("iteration {}", first_recorded_)
            : fmt::format("iterations {}-{}", first_recorded_, last_recorded_);
    log_.info(
        "profiling: wrote the trace of {} to {} ({} ops, {} annotations, {} kernels ({} with "
        "op args), {} memcpy, {} memset, {} CUDA API calls; {} in {:.2f} s)",
        iterations, path_, s.ops, s.annotations, s.kernels, s.kernels_with_op, s.memcpys, s.memsets,
        s.api_calls, megabytes(s.file_bytes), s.write_seconds);
  } catch (const Error& e) {  // disk full, unwritable directory: training goes on
    log_.error("profiling: no trace written: {}", e.what());
  }
}

}  // namespace tessera::profiler
