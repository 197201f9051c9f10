#pragma once
// RMSNorm forward and backward over rows of (N, C).
#include <cstddef>
#include <cstdint>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"

namespace tessera::cuda {

// out (N, C) = x * rstd * weight; rstd (N) fp32 = 1 / sqrt(mean(x^2) + eps).
// x, out and weight (C) in dtype.
void rmsnorm_forward(void* out, float* rstd, const void* x, const void* weight, int64_t N,
                     int64_t C, float eps, DType dtype, cudaStream_t stream);

// rmsnorm_forward (out written when non-null), also writing codes (N, C) in `format` (e4m3 or e5m2)
// = satfinite_rn(out * *scale) of the stored out, and (amax non-null) amax = max(*amax, max |out|):
// the FP8 cast of out in the same pass (fp8_cast_transpose's codes and amax).
void rmsnorm_forward_cast(void* out, float* rstd, void* codes, const void* x, const void* weight,
                          int64_t N, int64_t C, float eps, DType dtype, DType format,
                          const float* scale, float* amax, cudaStream_t stream);

// codes_t (C, N) in `format` (e4m3 or e5m2) = satfinite_rn(out * *scale) transposed, of the
// out (N, C) rmsnorm_forward stores from x and the rstd it wrote, without storing out.
void rmsnorm_transposed_codes(void* codes_t, const void* x, const float* rstd, const void* weight,
                              int64_t N, int64_t C, DType dtype, DType format, const float* scale,
                              cudaStream_t stream);

// Device scratch bytes rmsnorm_backward needs (per-block dweight partial sums).
size_t rmsnorm_backward_scratch_bytes(int64_t N, int64_t C);

// dx (N, C) accumulates (read-add-write in dtype); dweight (C) accumulates, fp32 or bf16
// (dweight_dtype). dout, x (N, C) and weight (C) in dtype; rstd (N) fp32.
void rmsnorm_backward(void* dx, void* dweight, DType dweight_dtype, const void* dout, const void* x,
                      const void* weight, const float* rstd, int64_t N, int64_t C, DType dtype,
                      void* scratch, size_t scratch_bytes, cudaStream_t stream);

}  // namespace tessera::cuda
