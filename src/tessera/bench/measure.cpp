#include "tessera/bench/measure.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include <fmt/format.h>

#include "tessera/backend/backend_factory.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/bench/gpu_info.h"
#include "tessera/config/keys.h"
#include "tessera/core/error.h"

namespace tessera::bench {
namespace {

constexpr double kMinSampleMs = 1.0;
constexpr int kMaxCallsPerSample = 1000;
constexpr int kMaxSets = 64;
constexpr size_t kMaxBudget = size_t{8} << 30;

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

ContextOptions context_options(const CommandArgs& args) {
  ContextOptions o;
  o.device = parse_device_choice(args.get("device", "auto"));
  o.attention = parse_attention_backend(args.get("attention_backend", "auto"));
  auto flag = [&](const char* key, const char* fallback) {
    const std::string v = args.get(key, fallback);
    if (v != "true" && v != "false") throw ConfigError("command line", key, v, "true or false");
    return v == "true";
  };
  o.gemm_autotune = flag("gemm_autotune", "true");
  o.deterministic = flag("deterministic_mode", "false");
  o.gpu = args.get("gpu", "");
  o.warmup = static_cast<int>(args.get_int("warmup", 5, 0));
  o.iters = static_cast<int>(args.get_int("iters", 20, 1));
  return o;
}

BenchContext make_context(const ContextOptions& o) {
  BenchContext c;
  BackendOptions backend;
  backend.attention = o.attention;
  backend.gemm_autotune = o.gemm_autotune;
  backend.deterministic = o.deterministic;
  c.device = make_backend(o.device, 0, backend);
  c.reference = make_cpu_backend();
  c.warmup = o.warmup;
  c.iters = o.iters;
  c.description = c.device->description();
  const MemoryStats m = c.device->memory_stats();
  c.budget_bytes = std::min(kMaxBudget, m.device_free_bytes / 4);
  c.dtype = c.device->default_compute_dtype();
  if (c.device->device().kind == DeviceKind::GPU) {
    c.spec = resolve_gpu_spec(o.gpu);
    if (auto g = gpu_info(0)) c.cache_bytes = g->l2_bytes;
  } else if (!o.gpu.empty()) {
    throw ConfigError("command line", "gpu", o.gpu,
                      "no --gpu with the CPU backend (there is no GPU peak to compare with)");
  }
  return c;
}

Timing measure(Backend& b, const std::function<void(int)>& op, int warmup, int samples) {
  int call = 0;
  for (int i = 0; i < warmup; ++i) op(call++);
  b.synchronize();
  auto t0 = std::chrono::steady_clock::now();
  op(call++);
  b.synchronize();
  const double one = std::max(ms_since(t0), 1e-4);
  Timing t;
  t.calls_per_sample =
      std::clamp(static_cast<int>(std::ceil(kMinSampleMs / one)), 1, kMaxCallsPerSample);
  std::vector<double> ms;
  for (int s = 0; s < samples; ++s) {
    t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < t.calls_per_sample; ++k) op(call++);
    b.synchronize();
    ms.push_back(ms_since(t0) / t.calls_per_sample);
  }
  std::sort(ms.begin(), ms.end());
  t.samples = samples;
  t.median_ms = ms[ms.size() / 2];
  t.min_ms = ms.front();
  t.max_ms = ms.back();
  return t;
}

int rotation_sets(size_t set_bytes, size_t cache_bytes, size_t budget_bytes) {
  if (set_bytes == 0) return 1;
  const size_t wanted = (2 * cache_bytes + set_bytes - 1) / set_bytes;
  const size_t affordable = budget_bytes / set_bytes;
  return static_cast<int>(std::max<size_t>(1, std::min({wanted, affordable, size_t{kMaxSets}})));
}

std::vector<float> download_floats(Backend& b, const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::F32) {
    b.download(out.data(), t);
    return out;
  }
  TS_CHECK(t.dtype == DType::BF16, "download_floats: dtype {}", dtype_name(t.dtype));
  std::vector<uint16_t> bits(out.size());
  b.download(bits.data(), t);
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bf16_bits_to_float(bits[i]);
  return out;
}

void upload_floats(Backend& b, const Tensor& t, const std::vector<float>& v) {
  TS_CHECK(static_cast<int64_t>(v.size()) == t.numel(), "upload_floats: {} values for {}", v.size(),
           t.shape.str());
  if (t.dtype == DType::F32) return b.upload(t, v.data());
  TS_CHECK(t.dtype == DType::BF16, "upload_floats: dtype {}", dtype_name(t.dtype));
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = float_to_bf16_bits(v[i]);
  b.upload(t, bits.data());
}

double relative_error(const std::vector<float>& a, const std::vector<float>& ref) {
  if (a.size() != ref.size()) return INFINITY;
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    const double d = static_cast<double>(a[i]) - ref[i];
    diff += d * d;
    norm += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

double percent_of(double value, double peak) {
  return peak > 0 ? 100.0 * value / peak : NAN;
}

std::string peak_note(const BenchContext& ctx, double peak, const std::string& what,
                      const char* unit) {
  if (!ctx.spec) return "no % of peak (no GPU datasheet for this device)";
  return fmt::format("% of the {} datasheet {} ({:.0f} {})", ctx.spec->name, what, peak, unit);
}

}  // namespace tessera::bench
