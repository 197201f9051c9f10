#pragma once
// Rotary position embedding (rotate-half convention), in place on the query and key heads of
// the packed qkv activation.
#include <cstdint>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"

namespace tessera::cuda {

// The layout of one rope call: qkv (batch, seq, (heads + 2 * kv_heads) * head_dim); the first
// heads + kv_heads heads of every token rotate, the value heads do not.
struct RopeShape {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t width = 0;  // elements per token row of qkv: the value heads may be narrower
};

// Rotates by +angle (forward) in place; freqs (>= seq, head_dim) fp32 holds per position t
// cos(t * inv_freq[0..D/2)) then sin(t * inv_freq[0..D/2)).
void rope_forward(void* qkv, const float* freqs, const RopeShape& s, DType dtype,
                  cudaStream_t stream);

// The inverse rotation (by -angle), applied to the query/key gradient heads of dqkv.
void rope_backward(void* dqkv, const float* freqs, const RopeShape& s, DType dtype,
                   cudaStream_t stream);

// rope_backward's dqkv as FP8 codes in both layouts, never stored in `dtype`: codes (N, width)
// and codes_t (width, N) in `format` (e4m3 or e5m2) = satfinite_rn(d * *scale) of the values
// rope_backward stores, and (amax non-null) amax = max(*amax, max |d|): the cast of the
// gradient folded into its producer. bf16 with head_dim 128, N = batch x seq a multiple of
// 128 and 16-byte aligned pointers only: otherwise it returns false having written nothing (the
// caller runs rope_backward and then the cast).
bool rope_backward_cast(const void* dqkv, const float* freqs, const RopeShape& s, DType dtype,
                        void* codes, void* codes_t, DType format, const float* scale, float* amax,
                        cudaStream_t stream);

}  // namespace tessera::cuda
