#pragma once
// FP8 formats and per-tensor scaling, as readable fp32 host code: the reference that the CPU
// backend emulates FP8 training with and that the CUDA kernels are tested against.
//
// Formats (OCP FP8, the ones Hopper tensor cores multiply):
//   E4M3 ("fn"): bias 7, no infinities, NaN = S.1111.111, max 448, min normal 2^-6,
//                min subnormal 2^-9.
//   E5M2:        bias 15, IEEE-like: +-Inf = S.11111.00, NaN = S.11111.{01,10,11}, max 57344,
//                min normal 2^-14, min subnormal 2^-16.
// Casts round to nearest, ties to even, and saturate: finite values beyond the range and
// +-Inf become +-max (the hardware's "satfinite" conversion). NaN stays NaN. Saturation would
// hide an Inf, so scaling reports it instead: the amax of a tensor holding NaN or Inf is
// non-finite, and fp8_update_scales_reference counts it (the trainer then skips the step).
#include <cstdint>

#include "tessera/core/dtype.h"

namespace tessera {

inline bool is_fp8(DType t) { return t == DType::E4M3 || t == DType::E5M2; }

// Largest finite value: 448 (E4M3) or 57344 (E5M2).
float fp8_max(DType format);

// The code of `x` (round to nearest even, saturating; NaN -> 0x7F, sign of zero kept).
uint8_t float_to_fp8_bits(float x, DType format);
// The value of a code (exact in fp32); E5M2's +-Inf codes decode to +-Inf, NaN codes to NaN.
float fp8_bits_to_float(uint8_t bits, DType format);
inline float round_to_fp8(float x, DType format) {
  return fp8_bits_to_float(float_to_fp8_bits(x, format), format);
}

// Scaling of one group of tensors that share an FP8 format (Transformer Engine's delayed
// scaling, transformer_engine/pytorch/fp8.py and common/recipe):
//   q = cast(x * scale), x ~= q * scale_inv.
struct Fp8ScalingParams {
  float fp8_max = 448.0f;  // of the group's format
  int margin = 0;          // scale = (fp8_max / amax) / 2^margin
  bool most_recent = false;  // amax = history row 0; false: max over all rows
  bool roll = true;          // roll the history afterwards (false: a just-in-time rescale)
};

// history: (H, S) row-major, row 0 holding the amaxes recorded since the last update (one
// column per tensor). For every column s:
//   a0 = history[0][s]. If a0 is NaN or Inf: the tensor held a non-finite value; it is
//   counted, the previous scale is kept and a0 is replaced by 0 so that one bad step does not
//   freeze the scale for H steps (Transformer Engine would keep it in the history).
//   Otherwise amax = most_recent ? a0 : max over rows; scale = (fp8_max / amax) / 2^margin
//   when amax > 0 (else the previous scale), FLT_MAX if that overflows; scale_inv = 1/scale.
//   With roll, the column is rotated up by one row (row h takes row h+1, the last row takes
//   row 0) and row 0 is cleared, which is torch.roll(history, -1, 0); history[0] = 0 in TE.
// Returns the number of non-finite a0.
int64_t fp8_update_scales_reference(float* history, int64_t H, int64_t S, float* scale,
                                    float* scale_inv, const Fp8ScalingParams& params);

}  // namespace tessera
