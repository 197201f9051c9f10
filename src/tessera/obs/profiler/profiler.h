#pragma once
// The trace recorder. While recording, it is the backend's OpObserver: every op becomes a
// `cpu_op` span carrying the op's shape args and an "External id", every model range
// (layer_forward, attention_block, ...) and trainer phase a `user_annotation` span; on a
// GPU a GpuTracer (CUPTI) collects kernels, copies, fills and CUDA API calls, each API call
// tagged with the External id of the op that made it. write() joins the two halves and
// emits a Chrome trace in Kineto's conventions (docs/report.md, "Recording traces"):
//
//   kernel / gpu_memcpy / gpu_memset   pid = device index, tid = stream, args: External id,
//                                      correlation, and the launching op's shape args
//   cuda_runtime / cuda_driver         pid = process id, tid = thread, args: correlation,
//                                      cbid, External id
//   cpu_op / user_annotation           pid = process id, tid = thread
//   ac2g flows                         launch -> kernel, id = correlation
//
// Timestamps are µs with three decimals relative to baseTimeNanoseconds (written in the
// header). With a GPU tracer every host timestamp is read from the tracer's clock
// (cuptiGetTimestamp), so host and device events share one clock by construction; without
// one, CLOCK_REALTIME, which is CUPTI's own clock on Linux.
//
// One host thread records (the trainer's, which drives the backend); calls nest.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tessera/ops/gpu_tracer.h"
#include "tessera/ops/op_observer.h"

namespace tessera::profiler {

// Written as baseTimeNanoseconds: every "ts" is (clock - base) / 1000. A fixed base
// (2025-06-15T15:06:40Z) keeps timestamps small enough for exact doubles in viewers and
// identical across ranks and hosts, so per-rank traces line up when merged.
inline constexpr int64_t kTraceBaseTimeNs = 1750000000000000000;

struct ProfilerOptions {
  int rank = 0;
  int world_size = 1;
  Device device;          // the backend's device; GPU tracing is tried for CUDA devices
  bool trace_gpu = true;  // false: host spans only, even on a GPU
  std::string process_name = "tessera";
  std::string metadata_json;  // extra header member "tessera": a JSON object, or empty
};

struct TraceSummary {
  std::string path;
  uint64_t file_bytes = 0;
  double write_seconds = 0;
  uint64_t ops = 0, annotations = 0;
  uint64_t kernels = 0, memcpys = 0, memsets = 0, api_calls = 0, flows = 0;
  uint64_t kernels_with_op = 0;  // kernels linked to a launching op (External id)
};

class Profiler final : public OpObserver {
 public:
  // `gpu`: a tracer to use instead of the device platform's (tests); null means
  // make one when options.trace_gpu and the device is a GPU.
  explicit Profiler(ProfilerOptions options, std::unique_ptr<GpuTracer> gpu = nullptr);
  ~Profiler() override;
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  // Starts recording; earlier recordings are dropped. GPU tracing that cannot start leaves a
  // warning (warnings()) and a host-only recording, never an error.
  void start();
  // Ends recording: closes spans still open, stops the GPU tracer (which waits for the
  // device) and keeps everything for write().
  void stop();
  bool recording() const { return recording_; }
  // Writes what the last start()/stop() recorded to `path` (.json, or .json.gz compressed),
  // atomically. Throws tessera::Error when the file cannot be written.
  TraceSummary write(const std::string& path) const;

  // "CUPTI (...)" while GPU activity is traced, else "off: <reason>".
  std::string gpu_tracing() const;
  const std::vector<std::string>& warnings() const { return warnings_; }

  // A user_annotation span (trainer phases, ProfilerStep#N). `name` is copied.
  void begin_annotation(std::string_view name, const OpArgs& args = {});
  void end_annotation();

  // OpObserver: backend ops (cpu_op) and model ranges (user_annotation).
  void op_begin(const char* name, const OpArgs& args) override;
  void op_end() override;
  void range_begin(const char* name) override;
  void range_end() override;

  // The clock of every timestamp in the trace, in ns.
  int64_t now_ns();

 private:
  enum class SpanKind : uint8_t { kOp, kAnnotation };
  struct Span {
    int64_t begin_ns = 0, end_ns = -1;
    uint64_t external_id = 0;  // ops: > 0
    uint32_t name = 0;         // index into names_
    uint32_t args_begin = 0;   // into args_
    uint16_t args_count = 0;
    uint16_t op_depth = 0;  // ops open around this one when it began
    int32_t tid = 0;
    SpanKind kind = SpanKind::kOp;
  };

  uint32_t intern_literal(const char* name);
  uint32_t intern(std::string_view name);
  void begin(SpanKind kind, uint32_t name, const OpArgs& args);
  void end(SpanKind kind);

  // write() in sections, over the recording (profiler.cpp).
  friend class TraceWriter;

  ProfilerOptions options_;
  std::unique_ptr<GpuTracer> gpu_;
  std::string gpu_off_reason_;
  bool gpu_active_ = false;
  bool recording_ = false;
  int64_t start_ns_ = 0, stop_ns_ = 0;

  std::vector<std::string> names_;
  std::unordered_map<const char*, uint32_t> literal_ids_;
  std::unordered_map<std::string, uint32_t> name_ids_;
  std::vector<Span> spans_;  // in begin order
  std::vector<OpArg> args_;
  std::vector<uint32_t> open_;  // indices of open spans, innermost last
  uint16_t open_ops_ = 0;
  uint64_t next_external_id_ = 1;
  uint64_t unbalanced_ends_ = 0;
  uint64_t closed_at_stop_ = 0;
  GpuTrace gpu_trace_;
  std::vector<std::string> warnings_;
};

}  // namespace tessera::profiler
