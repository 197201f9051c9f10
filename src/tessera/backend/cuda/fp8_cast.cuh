#pragma once
// FP8 casts and delayed-scaling updates (ops/backend.h: fp8_cast_transpose,
// fp8_update_scales; the arithmetic is core/fp8.h's reference). Include from GPU sources only.
#include <cstdint>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"
#include "tessera/core/fp8.h"

namespace tessera::cuda {

// x (R, C) in x_dtype (bf16 or fp32) -> out (R, C) and/or out_t (C, R) in `format` (e4m3 or
// e5m2), q = satfinite_rn(x * *scale); amax (when non-null) = max(*amax, max |x|), NaN or Inf
// when x holds one. Either output may be null; with both null only the amax is computed.
void fp8_cast_transpose(const void* x, DType x_dtype, int64_t R, int64_t C, const float* scale,
                        void* out, void* out_t, DType format, float* amax, cudaStream_t stream);

// Grouped cast (ops/backend.h: fp8_grouped_cast): x (R, C) in G row groups, either equal
// groups of group_rows rows (group_rows > 0) or offsets (G + 1 int32 on the device; rows from
// offsets[G] on are neither read nor written). Group g's codes, satfinite_rn(x * scale_g), go
// to out (R, C) row-major and/or to out_t: with offsets x's transpose (C, R) (the group's
// columns), with group_rows each group's transposed block ((C, rows_g) at element begin_g * C);
// amax (may be null) = max(amax_g, max |x| of the group's rows).
// scale_g / amax_g: scale[g] / amax[g] when per_group_scale / per_group_amax, else scale[0]
// / amax[0].
void fp8_grouped_cast(const void* x, DType x_dtype, int64_t R, int64_t C, int64_t group_rows,
                      const int32_t* offsets, int64_t G, const float* scale, bool per_group_scale,
                      void* out, void* out_t, DType format, float* amax, bool per_group_amax,
                      cudaStream_t stream);

// history (H, S), scale and scale_inv (S): one thread per column, as
// fp8_update_scales_reference. nonfinite (may be null) is set to NaN when an amax of row 0
// is non-finite.
void fp8_update_scales(float* history, int64_t H, int64_t S, float* scale, float* scale_inv,
                       float* nonfinite, float fp8_max, int margin, bool most_recent, bool roll,
                       cudaStream_t stream);

// Block-scaled cast (ops/backend.h: fp8_block_cast; fp8_block_cast_reference's arithmetic):
// x (R, C) -> out (R, C) with out_scale_inv and/or out_t (C, R) with out_t_scale_inv in
// `format`, each 1x128 tile (Tile1x128: along C for out, along R for out_t) or 128x128 block
// scaled by its own power-of-two scale; nonfinite (may be null) is set to NaN when x holds a
// NaN or Inf.
void fp8_block_cast(const void* x, DType x_dtype, int64_t R, int64_t C, Fp8Scaling scaling,
                    void* out, float* out_scale_inv, void* out_t, float* out_t_scale_inv,
                    DType format, float* nonfinite, cudaStream_t stream);

// core/fp8.h's fp8_block_scale on the device: one correctly rounded division, then the power
// of two below.
__device__ __forceinline__ float fp8_block_scale_on_device(float amax, float fp8_max) {
  if (!(amax > 0.0f) || !isfinite(amax)) return 1.0f;
  const float ratio = __fdiv_rn(fp8_max, amax);
  if (!isfinite(ratio)) return 1.0f;
  int e = 0;
  frexpf(ratio, &e);
  return ldexpf(1.0f, e - 1);
}

}  // namespace tessera::cuda
