#pragma once
// SwiGLU over the fused [gate | up] projection.
#include <cstdint>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"

namespace tessera::cuda {

// gate_up (N, 2F) holds [gate | up]; out (N, F) = silu(gate) * up. All in dtype.
void swiglu_forward(void* out, const void* gate_up, int64_t N, int64_t F, DType dtype,
                    cudaStream_t stream);

// swiglu_forward, also writing codes (N, F) in `format` (e4m3 or e5m2) = satfinite_rn(out *
// *scale) of the stored out, and (amax non-null) amax = max(*amax, max |out|): the FP8 cast of
// out in the same pass (fp8_cast_transpose's codes and amax).
void swiglu_forward_cast(void* out, void* codes, const void* gate_up, int64_t N, int64_t F,
                         DType dtype, DType format, const float* scale, float* amax,
                         cudaStream_t stream);

// dgate_up (N, 2F) overwritten: dgate = dout * up * silu'(gate), dup = dout * silu(gate).
void swiglu_backward(void* dgate_up, const void* dout, const void* gate_up, int64_t N, int64_t F,
                     DType dtype, cudaStream_t stream);

}  // namespace tessera::cuda
