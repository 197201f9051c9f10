#pragma once
// A GPU vendor's runtime as the rest of Tessera sees it: its devices, a backend (the op API)
// on one of them, a communicator between processes that each drive one, a tracer of what
// the devices run, and the facts benchmarks and preflight report. Everything that names a
// vendor lives behind this interface in backend/<vendor>/ (backend/cuda/ today); a second
// vendor is a new folder implementing it plus one line in backend/backend_factory.cpp.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/ops/backend.h"

namespace tessera {
class Logger;
}
namespace tessera::dist {
class Communicator;
class Rendezvous;
}  // namespace tessera::dist
namespace tessera::profiler {
class GpuTracer;
}

namespace tessera {

// Choices a backend is made with beyond the device (the CPU backend ignores them).
struct BackendOptions {
  // Fused attention on GPUs: Tessera's kernels, the vendor library's (cuDNN's SDPA), or auto
  // (the library where it loads and takes the shape, else Tessera's); the CUDA rule is in
  // backend/cuda/cuda_backend.cuh.
  AttentionBackend attention = AttentionBackend::Auto;
  // Time the GEMM library's candidate algorithms per shape (backend/cuda/matmul.cuh).
  bool gemm_autotune = true;
  // Kernels whose results repeat bit for bit where the fast ones vary in summation order run
  // to run (the attention backward's dQ): deterministic_mode.
  bool deterministic = false;
};

// Options from an experiment's training config.
inline BackendOptions backend_options(const TrainingConfig& t) {
  BackendOptions o;
  o.attention = t.attention_backend;
  o.gemm_autotune = t.gemm_autotune;
  o.deterministic = t.deterministic_mode;
  return o;
}

// A library the platform opens at run time rather than links, so that machines without it
// still run: its version, or "not found (<why>)" when it could not be opened.
struct RuntimeLibrary {
  std::string name;          // "cuDNN"
  std::string version;       // "9.14.0" or "not found (...)"
  std::string used_for;      // "attention_backend cudnn/auto"
  std::string when_missing;  // "attention_backend auto falls back to Tessera's kernels"
  bool found() const { return !version.starts_with("not found"); }
};

struct DeviceInfo {
  std::string name;                // "NVIDIA H200"
  std::string compute_capability;  // "9.0"
  int multiprocessors = 0;
  size_t total_bytes = 0, free_bytes = 0, l2_bytes = 0;
  std::string driver, runtime;  // the driver's supported and the linked runtime's version
  std::string blas;             // "cuBLASLt 13.1.0"
};

// The ops of a training step that make a backend allocate buffers of its own (kernel scratch,
// the fused AdamW's chunk table, FP8 scale slots), with their sizes, so that the memory planner
// counts what a backend of the platform allocates for them from the backend's own size
// formulas (Platform::step_buffer_bytes).
struct StepBufferDemand {
  int64_t tokens = 0;             // rows of a micro batch (norm, bias, embedding backward)
  int64_t hidden = 0;             // width of the norms
  int64_t widest_bias = 0;        // widest bias gradient; 0: the model has no biases
  int64_t largest_reduction = 0;  // elements of the largest sum / sum_squares (gradient norm)
  AttentionShape attention;       // a layer's attention, forward and backward
  BackendOptions backend;  // attention's implementation and mode pick its scratch
  // The fused AdamW calls of one optimizer step, each with the lengths of its segments.
  std::vector<std::vector<int64_t>> adamw_segments;
  // FP8 expert stacks with per-tensor scales: the per-group GEMMs copy their weights' scales,
  // side by side in the scale state, into 16-byte slots (the dense FP8 linears' scales are
  // already 16 bytes apart; the grouped kernel reads the experts' in place).
  bool fp8_expert_gemms = false;
};

class Platform {
 public:
  virtual ~Platform() = default;
  virtual std::string_view name() const = 0;  // "CUDA"
  // Usable devices; 0 (never an abort) without a driver or a device.
  virtual int device_count() const = 0;
  // Why device_count() is 0; empty when a device is available.
  virtual std::string unavailable_reason() const = 0;
  // The backend on device `device` (0-based). Throws ConfigError for an index out of range
  // and for options the machine cannot honour (attention_backend cudnn without cuDNN).
  virtual std::unique_ptr<Backend> make_backend(int device,
                                                const BackendOptions& options) const = 0;
  // One rank's communicator over `backend`'s device: rank 0 creates the job's id, the
  // rendezvous hands it to every rank and keeps watching the peers so a dead rank is named.
  // timeout_s bounds every collective; `log` receives the version line and failures. Throws
  // ConfigError when the backend is not this platform's or the platform has no collectives
  // library.
  virtual std::unique_ptr<dist::Communicator> make_communicator(Backend& backend,
                                                                dist::Rendezvous& rendezvous,
                                                                double timeout_s,
                                                                Logger& log) const = 0;
  // A tracer of device `device`; null with the reason in *why_not when the platform has none.
  virtual std::unique_ptr<profiler::GpuTracer> make_tracer(int device,
                                                           std::string* why_not) const = 0;
  // Device `device` (below device_count()).
  virtual DeviceInfo device_info(int device) const = 0;
  virtual std::vector<RuntimeLibrary> runtime_libraries() const = 0;
  // Bytes a backend of this platform holds in buffers of its own once a training step with
  // these demands has run (its memory_stats() counts them besides the tensors its callers
  // allocate): the GEMM library's workspace and the largest scratch any op asked for.
  virtual size_t step_buffer_bytes(const StepBufferDemand& d) const {
    (void)d;
    return 0;
  }
  // What its backends' fp8_gemm_multiple() answers, for the memory planner, which makes none.
  virtual int64_t fp8_gemm_multiple() const = 0;
};

}  // namespace tessera
