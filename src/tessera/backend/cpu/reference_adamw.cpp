// AdamW of the reference backend, in its own file because it is compiled with
// -ffp-contract=off (CMakeLists.txt): GCC contracts a * b + c into one FMA under
// -march=x86-64-v3 even in ISO mode, and the update must round every operation as the CUDA
// kernel (backend/cuda/adamw.cu) does, so that both give the same bits.
#include <algorithm>
#include <cmath>

#include "tessera/backend/cpu/reference.h"

namespace tessera::ref {

std::optional<double> adamw_grad_scale(double grad_norm_sq, double max_grad_norm) {
  if (!std::isfinite(grad_norm_sq)) return std::nullopt;
  if (max_grad_norm <= 0) return 1.0;
  const double clip = max_grad_norm / (std::sqrt(grad_norm_sq) + 1e-6);
  return std::min(clip, 1.0);
}

template <class T>
void adamw_update(T* master, T* params, T* exp_avg, T* exp_avg_sq, const T* grad, int64_t n,
                  const AdamWSettings& s, bool decay, double grad_scale) {
  // Element math in T (fp32 for fp32 state, as torch's fused AdamW), in torch.optim.AdamW's
  // order: decoupled decay p *= 1 - lr wd, then p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps).
  // Every operation rounds once (no contraction; sqrt and divide are correctly rounded), the
  // order the CUDA kernel spells out with explicit intrinsics: both give the same bits.
  const AdamWScalarsOf<T> c = adamw_scalars<T>(s, decay, grad_scale);
  for (int64_t i = 0; i < n; ++i) {
    const T g = grad[i] * c.grad_scale;
    const T m = c.beta1 * exp_avg[i] + c.one_minus_beta1 * g;
    const T v = c.beta2 * exp_avg_sq[i] + c.one_minus_beta2 * g * g;
    const T p = master[i] * c.decay_factor -
                c.step_size * m / (std::sqrt(v) / c.sqrt_bias_correction2 + c.eps);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    master[i] = p;
    if (params != nullptr) params[i] = p;
  }
}

template <class T>
void adamw_step(T* master, T* params, T* exp_avg, T* exp_avg_sq, const T* grad, double grad_norm_sq,
                std::span<const ParamSegment> segments, const AdamWSettings& s) {
  const std::optional<double> scale = adamw_grad_scale(grad_norm_sq, s.max_grad_norm);
  if (!scale) return;
  for (const ParamSegment& seg : segments) {
    const int64_t o = seg.offset;
    adamw_update(master + o, params != nullptr ? params + o : nullptr, exp_avg + o, exp_avg_sq + o,
                 grad + o, seg.count, s, seg.decay, *scale);
  }
}

template void adamw_update<float>(float*, float*, float*, float*, const float*, int64_t,
                                  const AdamWSettings&, bool, double);
template void adamw_update<double>(double*, double*, double*, double*, const double*, int64_t,
                                   const AdamWSettings&, bool, double);
template void adamw_step<float>(float*, float*, float*, float*, const float*, double,
                                std::span<const ParamSegment>, const AdamWSettings&);
template void adamw_step<double>(double*, double*, double*, double*, const double*, double,
                                 std::span<const ParamSegment>, const AdamWSettings&);

}  // namespace tessera::ref
