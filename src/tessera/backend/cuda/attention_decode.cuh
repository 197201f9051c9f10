#pragma once
// Attention of one new token per sequence during generation, over a KV cache (op API:
// Backend::attention_decode). Include from .cu files only (cudaStream_t).
#include <cstdint>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"
#include "tessera/ops/backend.h"

namespace tessera::cuda {

// q (B, H*D), out (B, H*Dv), kv (B, S, KV*(D + Dv)) with S = s.seq and Dv = s.v_dim(): all in
// dtype (bf16 or fp32).
// The new token is at position `pos`; it sees the cached positions s allows (causal, window).
void attention_decode(void* out, const void* q, const void* kv, int64_t pos,
                      const AttentionShape& s, DType dtype, cudaStream_t stream);

}  // namespace tessera::cuda
