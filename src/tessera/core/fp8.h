#pragma once
// FP8 formats and per-tensor scaling, as readable fp32 host code: the reference that the CPU
// backend emulates FP8 training with and that the GPU kernels are tested against.
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

// ---- block scaling (fp8_recipe blockwise; DeepSeek-V3's recipe) ----
// How an FP8 operand's codes are scaled back (x ~= code * scale_inv): one fp32 for the tensor,
// one per 1x128 tile along its K dimension (activations and gradients), or one per 128x128
// block (weights). Scales are never kept across steps: each tile's comes from its own amax.
enum class Fp8Scaling { Tensor, Tile1x128, Block128x128 };
inline constexpr int64_t kFp8BlockSize = 128;

// The scale_inv tensor of a K-major FP8 operand (rows, K), in cuBLASLt's layouts:
//   Tensor        1 value
//   Tile1x128     (ceil(K / 128), rows) row-major: the tile of row r covering k-block kb at
//                 kb * rows + r
//   Block128x128  (ceil(rows / 128), ld) row-major with ld = round_up(ceil(K / 128), 4) (16-byte
//                 aligned rows): block (rb, kb) at rb * ld + kb; the ld - ceil(K/128) pad
//                 entries are never read
int64_t fp8_scale_count(Fp8Scaling s, int64_t rows, int64_t K);
// Where the scale_inv of element (r, k) of such an operand is.
int64_t fp8_scale_index(Fp8Scaling s, int64_t rows, int64_t K, int64_t r, int64_t k);

// The scale of a tile or block whose largest |x| is amax: the largest power of two with
// amax * scale <= fp8_max, 2^floor(log2(fp8_max / amax)), so that x * scale and code *
// scale_inv are exact; 1 when amax is 0 or not finite (or the ratio overflows fp32), where
// nothing better exists. fp8_max / amax is one correctly rounded fp32 division, as on GPUs.
float fp8_block_scale(float amax, float fp8_max);

// The block-scaled cast of x (R, C) (Backend::fp8_block_cast states it): the codes of out (R, C)
// and out_t (C, R), either may be null, and their scale_inv in the layouts above. Returns
// whether x holds a NaN or Inf.
bool fp8_block_cast_reference(const float* x, int64_t R, int64_t C, Fp8Scaling scaling,
                              DType format, uint8_t* out, float* out_scale_inv, uint8_t* out_t,
                              float* out_t_scale_inv);

}  // namespace tessera
