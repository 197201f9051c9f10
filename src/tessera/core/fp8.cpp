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

int64_t fp8_scale_count(Fp8Scaling s, int64_t rows, int64_t K) {
  const int64_t kb = (K + kFp8BlockSize - 1) / kFp8BlockSize;
  switch (s) {
    case Fp8Scaling::Tensor:
      return 1;
    case Fp8Scaling::Tile1x128:
      return kb * rows;
    case Fp8Scaling::Block128x128:
      return (rows + kFp8BlockSize - 1) / kFp8BlockSize * ((kb + 3) / 4 * 4);
  }
  return 0;
}

int64_t fp8_scale_index(Fp8Scaling s, int64_t rows, int64_t K, int64_t r, int64_t k) {
  const int64_t kb = (K + kFp8BlockSize - 1) / kFp8BlockSize;
  switch (s) {
    case Fp8Scaling::Tensor:
      return 0;
    case Fp8Scaling::Tile1x128:
      return k / kFp8BlockSize * rows + r;
    case Fp8Scaling::Block128x128:
      return r / kFp8BlockSize * ((kb + 3) / 4 * 4) + k / kFp8BlockSize;
  }
  return 0;
}

float fp8_block_scale(float amax, float fp8_max) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  const float ratio = fp8_max / amax;
  if (!std::isfinite(ratio)) return 1.0f;
  int e = 0;
  std::frexp(ratio, &e);  // ratio = m * 2^e, m in [0.5, 1): floor(log2(ratio)) = e - 1
  return std::ldexp(1.0f, e - 1);
}

bool fp8_block_cast_reference(const float* x, int64_t R, int64_t C, Fp8Scaling scaling,
                              DType format, uint8_t* out, float* out_scale_inv, uint8_t* out_t,
                              float* out_t_scale_inv) {
  const float max = fp8_max(format);
  const int64_t B = kFp8BlockSize;
  bool nonfinite = false;
  for (int64_t i = 0; i < R * C; ++i) nonfinite = nonfinite || !std::isfinite(x[i]);
  // The amax of x over rows [r0, r1) and columns [c0, c1).
  auto amax = [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    float m = 0.0f;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c) m = std::max(m, std::fabs(x[r * C + c]));
    return m;
  };
  // Tiles or blocks of x: rows [r0, r0 + rows), columns [c0, c0 + cols).
  auto cast = [&](int64_t r0, int64_t rows, int64_t c0, int64_t cols, bool transposed) {
    const int64_t r1 = std::min(R, r0 + rows), c1 = std::min(C, c0 + cols);
    const float scale = fp8_block_scale(amax(r0, r1, c0, c1), max);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c) {
        const uint8_t q = float_to_fp8_bits(x[r * C + c] * scale, format);
        if (transposed) {
          out_t[c * R + r] = q;
        } else {
          out[r * C + c] = q;
        }
      }
    return 1.0f / scale;
  };
  if (scaling == Fp8Scaling::Tile1x128) {
    if (out)  // tiles of one row, K = C
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c0 = 0; c0 < C; c0 += B)
          out_scale_inv[fp8_scale_index(scaling, R, C, r, c0)] = cast(r, 1, c0, B, false);
    if (out_t)  // tiles of one column of x, K = R
      for (int64_t c = 0; c < C; ++c)
        for (int64_t r0 = 0; r0 < R; r0 += B)
          out_t_scale_inv[fp8_scale_index(scaling, C, R, c, r0)] = cast(r0, B, c, 1, true);
    return nonfinite;
  }
  for (int64_t r0 = 0; r0 < R; r0 += B)
    for (int64_t c0 = 0; c0 < C; c0 += B) {
      float inv = 1.0f;
      if (out) inv = cast(r0, B, c0, B, false);
      if (out_t) inv = cast(r0, B, c0, B, true);
      if (out) out_scale_inv[fp8_scale_index(scaling, R, C, r0, c0)] = inv;
      if (out_t) out_t_scale_inv[fp8_scale_index(scaling, C, R, c0, r0)] = inv;
    }
  return nonfinite;
}

}  // namespace tessera
