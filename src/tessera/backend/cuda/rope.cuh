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

}  // namespace tessera::cuda
