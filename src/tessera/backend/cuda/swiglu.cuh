#pragma once
// SwiGLU over the fused [gate | up] projection.
#include <cstdint>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"

namespace tessera::cuda {

// gate_up (N, 2F) holds [gate | up]; out (N, F) = silu(gate) * up. All in dtype.
void swiglu_forward(void* out, const void* gate_up, int64_t N, int64_t F, DType dtype,
                    cudaStream_t stream);

// swiglu_forward, writing out, codes (N, F) and codes_t (F, N), each when non-null, with codes in
// `format` (e4m3 or e5m2) = satfinite_rn(out * *scale) of the stored out, and (amax non-null)
// amax = max(*amax, max |out|): the FP8 cast of out in the same pass (fp8_cast_transpose's codes
// and amax). Transposed codes without out take one tiled pass for bf16 with N % 128 == 0,
// F % 64 == 0 and 16-byte aligned pointers, and a slower one otherwise.
void swiglu_forward_cast(void* out, void* codes, void* codes_t, const void* gate_up, int64_t N,
                         int64_t F, DType dtype, DType format, const float* scale, float* amax,
                         cudaStream_t stream);

// dgate_up (N, 2F) overwritten: dgate = dout * up * silu'(gate), dup = dout * silu(gate).
void swiglu_backward(void* dgate_up, const void* dout, const void* gate_up, int64_t N, int64_t F,
                     DType dtype, cudaStream_t stream);

// swiglu_backward's d(gate_up) as FP8 codes in both layouts, never stored in `dtype`: codes
// (N, 2F) and codes_t (2F, N) in `format` (e4m3 or e5m2) = satfinite_rn(d * *scale) of the
// values swiglu_backward stores, and (amax non-null) amax = max(*amax, max |d|): the cast of
// the gradient folded into its producer. bf16 with N % 128 == 0, F % 64 == 0 and 16-byte
// aligned pointers only: otherwise it returns false having written nothing (the caller runs
// swiglu_backward and then the cast).
bool swiglu_backward_cast(const void* dout, const void* gate_up, int64_t N, int64_t F, DType dtype,
                          void* codes, void* codes_t, DType format, const float* scale, float* amax,
                          cudaStream_t stream);

}  // namespace tessera::cuda
