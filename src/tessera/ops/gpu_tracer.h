#pragma once
// The device half of the profiler: a GpuTracer collects what the GPU did (kernels, memory
// copies and fills) and the CUDA API calls that asked for it, with correlation ids linking
// each call to its GPU activity and external ids linking each call to the op that made it.
//
// Plain C++: a platform (ops/platform.h) makes one; the CUPTI implementation lives in
// backend/cuda/cupti_tracer.cpp, so that this header and the host-side profiler build
// without CUDA. A ROCm port adds a rocprofiler-sdk implementation behind the same interface.
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::profiler {

enum class GpuActivityKind : uint8_t { kKernel, kMemcpy, kMemset };

// One kernel, copy or fill as the device executed it. Times are on the tracer's clock
// (GpuTracer::timestamp_ns), in nanoseconds.
struct GpuActivityRecord {
  GpuActivityKind kind = GpuActivityKind::kKernel;
  uint32_t name = 0;  // index into GpuTrace::names (demangled kernel name, "Memcpy HtoD ...")
  int64_t start_ns = 0, end_ns = 0;
  uint32_t device = 0, context = 0, stream = 0;
  uint32_t correlation = 0;  // of the API call that launched it
  // Kernels.
  int32_t grid[3] = {0, 0, 0}, block[3] = {0, 0, 0};
  int32_t registers_per_thread = 0;
  int32_t shared_memory = 0;  // static + dynamic bytes per block
  // Copies and fills.
  uint64_t bytes = 0;
};

// One CUDA runtime or driver API call on a host thread.
struct ApiCallRecord {
  bool driver = false;
  uint32_t cbid = 0;  // CUPTI callback id
  uint32_t name = 0;  // index into GpuTrace::names ("cudaLaunchKernel")
  int64_t start_ns = 0, end_ns = 0;
  uint32_t process = 0, thread = 0;  // system pid and tid
  uint32_t correlation = 0;
};

struct GpuDeviceInfo {
  int id = 0;
  std::string name;
  uint64_t total_memory = 0;
  int compute_major = 0, compute_minor = 0;
  int sms = 0;
  int max_threads_per_block = 0, max_threads_per_sm = 0, regs_per_block = 0, regs_per_sm = 0;
  int warp_size = 0;
  uint64_t shared_memory_per_block = 0, shared_memory_per_block_optin = 0, shared_memory_per_sm = 0;
};

// Everything collected between GpuTracer::start() and stop().
struct GpuTrace {
  std::vector<std::string> names;
  std::vector<GpuActivityRecord> activities;
  std::vector<ApiCallRecord> api_calls;
  std::unordered_map<uint32_t, uint64_t> external_ids;  // correlation -> pushed external id
  uint64_t dropped_records = 0;
  uint64_t records_without_timestamps = 0;  // kernels the device could not time (skipped)
  std::vector<std::string> warnings;
};

class GpuTracer {
 public:
  virtual ~GpuTracer() = default;
  // "CUPTI 13.0 (API version 130001)".
  virtual std::string description() const = 0;
  // The visible GPUs, for the trace's deviceProperties.
  virtual std::vector<GpuDeviceInfo> devices() const = 0;
  // Starts collecting. Returns false with the reason in *error (insufficient privileges,
  // another profiler attached, ...) and leaves nothing enabled.
  virtual bool start(std::string* error) = 0;
  // The clock of every record, in nanoseconds; host spans read it too so that host and
  // device events share one time line.
  virtual int64_t timestamp_ns() = 0;
  // Tags the API calls this thread makes until the matching pop with `id`.
  virtual void push_external_id(uint64_t id) = 0;
  virtual void pop_external_id() = 0;
  // Waits for the device, stops collecting and hands over everything since start().
  virtual GpuTrace stop() = 0;
};

}  // namespace tessera::profiler
