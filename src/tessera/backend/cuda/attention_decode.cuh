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
// Sequence b's new token is at position `pos`, or at positions[b] <= pos when positions is not
// null; it sees the cached positions s allows (causal, window).
// scratch: attention_decode_scratch_bytes(s) bytes (the splits of each head's keys).
size_t attention_decode_scratch_bytes(const AttentionShape& s);
void attention_decode(void* out, const void* q, const void* kv, const int32_t* positions,
                      int64_t pos, const AttentionShape& s, DType dtype, void* scratch,
                      size_t scratch_bytes, cudaStream_t stream);

// cache (B, S, W) with elements of `element_bytes`: row positions[b] of sequence b = columns
// [src_col, src_col + W) of row b of src (B, src_cols).
void cache_write(void* cache, int64_t B, int64_t S, int64_t W, const void* src, int64_t src_cols,
                 int64_t src_col, const int32_t* positions, size_t element_bytes,
                 cudaStream_t stream);

}  // namespace tessera::cuda
