#include "tessera/core/fp8.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "tessera/core/error.h"

namespace tessera {
namespace {

struct Fp8Layout {
  int mantissa_bits;
  int bias;
  float max;
  uint8_t max_code;  // positive largest finite value
};

Fp8Layout layout_of(DType format) {
  switch (format) {
    case DType::E4M3: return {3, 7, 448.0f, 0x7E};
    case DType::E5M2: return {2, 15, 57344.0f, 0x7B};
    default: break;
  }
  throw InternalError(std::string("not an fp8 format: ") + std::string(dtype_name(format)));
}

}  // namespace

float fp8_max(DType format) { return layout_of(format).max; }

uint8_t float_to_fp8_bits(float x, DType format) {
  const Fp8Layout f = layout_of(format);
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  if (a >= f.max) return sign | f.max_code;  // saturate (Inf included)
  if (a == 0.0f) return sign;
  // Round a to a multiple of the spacing of its binade; below the smallest normal the spacing
  // is that of the subnormals. a / quantum is exact (a power-of-two scaling), so nearbyint
  // (round to nearest even under the default rounding mode) is the only rounding step.
  const int min_normal_exp = 1 - f.bias;
  int e = 0;
  std::frexp(a, &e);  // a = m * 2^e with m in [0.5, 1): the binade's exponent is e - 1
  const int exp = std::max(e - 1, min_normal_exp);
  const float quantum = std::ldexp(1.0f, exp - f.mantissa_bits);
  const float q = std::nearbyint(a / quantum) * quantum;  // <= max since a < max
  if (q == 0.0f) return sign;  // below half the smallest subnormal
  std::frexp(q, &e);
  const int q_exp = e - 1;  // rounding may have carried into the next binade
  if (q_exp < min_normal_exp) {
    const int mantissa = static_cast<int>(q / std::ldexp(1.0f, min_normal_exp - f.mantissa_bits));
    return sign | static_cast<uint8_t>(mantissa);
  }
  const int mantissa =
      static_cast<int>(q / std::ldexp(1.0f, q_exp - f.mantissa_bits)) - (1 << f.mantissa_bits);
  return sign | static_cast<uint8_t>(((q_exp + f.bias) << f.mantissa_bits) | mantissa);
}

float fp8_bits_to_float(uint8_t bits, DType format) {
  const Fp8Layout f = layout_of(format);
  const int exp_bits = 7 - f.mantissa_bits;
  const int e = (bits >> f.mantissa_bits) & ((1 << exp_bits) - 1);
  const int m = bits & ((1 << f.mantissa_bits) - 1);
  const int e_all_ones = (1 << exp_bits) - 1;
  float v = 0.0f;
  if (format == DType::E4M3 && e == e_all_ones && m == (1 << f.mantissa_bits) - 1) {
    v = NAN;
  } else if (format == DType::E5M2 && e == e_all_ones) {
    v = m == 0 ? INFINITY : NAN;
  } else if (e == 0) {  // subnormal: m * 2^(1 - bias - mantissa_bits)
    v = std::ldexp(static_cast<float>(m), 1 - f.bias - f.mantissa_bits);
  } else {
    v = std::ldexp(static_cast<float>((1 << f.mantissa_bits) + m), e - f.bias - f.mantissa_bits);
  }
  return (bits & 0x80) ? -v : v;
}

int64_t fp8_update_scales_reference(float* history, int64_t H, int64_t S, float* scale,
                                    float* scale_inv, const Fp8ScalingParams& p) {
  int64_t nonfinite = 0;
  for (int64_t s = 0; s < S; ++s) {
    float& a0 = history[s];
    float new_scale = scale[s];
    if (!std::isfinite(a0)) {
      ++nonfinite;
      a0 = 0.0f;
    } else {
      float amax = a0;
      if (!p.most_recent)
        for (int64_t h = 1; h < H; ++h) amax = std::max(amax, history[h * S + s]);
      if (amax > 0.0f && std::isfinite(amax)) new_scale = std::ldexp(p.fp8_max / amax, -p.margin);
      if (std::isinf(new_scale)) new_scale = FLT_MAX;
    }
    scale[s] = new_scale;
    scale_inv[s] = 1.0f / new_scale;
    if (!p.roll) continue;
    const float first = history[s];
    for (int64_t h = 0; h + 1 < H; ++h) history[h * S + s] = history[(h + 1) * S + s];
    history[(H - 1) * S + s] = first;
    history[s] = 0.0f;
  }
  return nonfinite;
}

}  // namespace tessera
