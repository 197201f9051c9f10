#pragma once
// What every kernel benchmark shares: the backend under test with the CPU reference beside it,
// timing on the host around synchronize() (no CUDA events, so any backend can be timed the
// same way), input sets rotated so that no call finds its inputs in L2, and moving values
// between backends for the correctness checks that come before any timing.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tessera/analysis/gpu_specs.h"
#include "tessera/bench/command_args.h"
#include "tessera/config/config.h"
#include "tessera/ops/backend.h"

namespace tessera::bench {

// The options every kernel benchmark takes (besides its own): --device, --gpu, --warmup,
// --iters, -o. make_context also reads --attention_backend, --gemm_autotune and
// --deterministic_mode where a benchmark declares them.
inline const std::set<std::string> kCommonOptions = {"device", "gpu", "warmup", "iters", "output"};

struct BenchContext {
  std::unique_ptr<Backend> device;        // the backend benchmarked
  std::unique_ptr<Backend> reference;     // the fp32 CPU backend results are checked against
  DType dtype = DType::F32;               // bf16 on GPUs, fp32 on the CPU backend
  std::optional<analysis::GpuSpec> spec;  // datasheet peaks for "% of peak"; none on the CPU
  size_t cache_bytes = 0;                 // last-level cache the inputs must not fit in (GPU L2)
  size_t budget_bytes = 0;                // device memory the rotated input sets may use
  int warmup = 5, iters = 20;
  std::string description;  // the device, for the report header
};

struct ContextOptions {
  DeviceChoice device = DeviceChoice::Auto;
  AttentionBackend attention = AttentionBackend::Auto;
  bool gemm_autotune = true;
  bool deterministic = false;  // --deterministic_mode
  std::string gpu;  // spec table name for "% of peak"; empty: the visible GPU's
  int warmup = 5, iters = 20;
};

// From --device, --attention_backend, --gemm_autotune, --deterministic_mode, --gpu, --warmup,
// --iters.
ContextOptions context_options(const CommandArgs& args);
BenchContext make_context(const ContextOptions& options);

struct Timing {
  double median_ms = 0, min_ms = 0, max_ms = 0;
  int samples = 0, calls_per_sample = 0;
};

// Times op(i), i = 0, 1, 2, ... (callers pick input set i % sets). After `warmup` calls, each
// of `samples` samples runs enough back-to-back calls to last >= 1 ms between two
// synchronize() calls (so launch latency and the host clock do not dominate short kernels)
// and yields elapsed / calls; the result is the median sample.
Timing measure(Backend& b, const std::function<void(int)>& op, int warmup, int samples);

// Input sets to cycle through: enough that they add up to twice `cache_bytes`, at most 64
// and within `budget_bytes` (at least 1).
int rotation_sets(size_t set_bytes, size_t cache_bytes, size_t budget_bytes);

// Host values of a float tensor of any dtype (bf16 widened exactly); waits for the device.
std::vector<float> download_floats(Backend& b, const Tensor& t);
// Uploads host values into a float tensor, rounding to its dtype.
void upload_floats(Backend& b, const Tensor& t, const std::vector<float>& v);

// ||a - ref|| / ||ref||; infinity when `a` holds a non-finite value or sizes differ.
double relative_error(const std::vector<float>& a, const std::vector<float>& ref);

// 100 * value / peak; NaN (an empty cell) without a peak.
double percent_of(double value, double peak);
// For table notes: "% of the H200 datasheet bf16 peak (989 TFLOP/s)", or why there is none.
std::string peak_note(const BenchContext& ctx, double peak, const std::string& what,
                      const char* unit);

}  // namespace tessera::bench
