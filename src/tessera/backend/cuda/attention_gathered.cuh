#pragma once
// Context parallelism's attention (Backend::attention_gathered_forward / _backward): the
// queries of one segment (this rank's tokens) against the keys and values of every segment
// (all ranks' tokens, all-gathered), masked by each token's position in the whole sequence.
// Straightforward kernels, portable to AMD GPUs: one block per query row (forward, query
// gradients) or key row (key and value gradients), keys or queries streamed in tiles through
// shared memory, fp32 accumulation in a fixed order (deterministic, no atomics), without
// tensor cores. On Hopper the CUDA backend takes the warpgroup flash kernels first where they
// apply (attention.cuh, attention_gathered_*_warpgroup). Both agree with the CPU reference
// within the op registry's tolerances.
#include <cstddef>
#include <cstdint>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"
#include "tessera/ops/backend.h"

namespace tessera::cuda {

// qkv (B, T, width): this segment's; kv_all (S, B, T, 2 KV D); positions (S, T) int32;
// out (B, T, H*D), lse (B, H, T) fp32.
void attention_gathered_forward(void* out, float* lse, const void* qkv, const void* kv_all,
                                const int32_t* positions, int64_t segments, int64_t segment,
                                const AttentionShape& s, DType dtype, cudaStream_t stream);

// Device scratch bytes attention_gathered_backward needs.
size_t attention_gathered_backward_scratch_bytes(const AttentionShape& s);

// dqkv's query columns and dkv_all (S, B, T, 2 KV D) written, as
// Backend::attention_gathered_backward states.
void attention_gathered_backward(void* dqkv, void* dkv_all, const void* dout, const void* out,
                                 const float* lse, const void* qkv, const void* kv_all,
                                 const int32_t* positions, int64_t segments, int64_t segment,
                                 const AttentionShape& s, DType dtype, void* scratch,
                                 size_t scratch_bytes, cudaStream_t stream);

}  // namespace tessera::cuda
