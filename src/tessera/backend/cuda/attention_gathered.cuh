#pragma once
// Context parallelism's attention (Backend::attention_gathered_forward / _backward): the
// queries of one segment (this rank's tokens) against the keys and values of every segment
// (all ranks' tokens, all-gathered), masked by each token's position in the whole sequence.
// On Hopper, causal bf16 attention of head dim 128 in Megatron's balanced layout (positions as
// context_parallel_positions gives them, T a multiple of 256) runs on the warpgroup flash
// kernels (attention_hopper*.cu), which read every segment's keys from kv_all by position
// and this segment's queries, outputs and gradients in place; the deterministic backward and
// every other case take straightforward kernels: one block per query row (forward, query
// gradients) or key row (key and value gradients), keys or queries streamed in tiles through
// shared memory, fp32 accumulation in a fixed order (deterministic, no atomics), without
// tensor cores. Both agree with the CPU reference within the op registry's tolerances.
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
// Backend::attention_gathered_backward states. deterministic: the straightforward kernels (the
// warpgroup backward adds dQ atomically).
void attention_gathered_backward(void* dqkv, void* dkv_all, const void* dout, const void* out,
                                 const float* lse, const void* qkv, const void* kv_all,
                                 const int32_t* positions, int64_t segments, int64_t segment,
                                 const AttentionShape& s, DType dtype, bool deterministic,
                                 void* scratch, size_t scratch_bytes, cudaStream_t stream);

// The warpgroup kernels' part (attention.cu): false, having done nothing, where they do not
// apply (bf16 is the caller's to check). The backward's scratch holds
// attention_backward_scratch_bytes(s).
bool attention_gathered_forward_warpgroup(void* out, float* lse, const void* qkv,
                                          const void* kv_all, int64_t segments, int64_t segment,
                                          const AttentionShape& s, cudaStream_t stream);
bool attention_gathered_backward_warpgroup(void* dqkv, void* dkv_all, const void* dout,
                                           const void* out, const float* lse, const void* qkv,
                                           const void* kv_all, int64_t segments, int64_t segment,
                                           const AttentionShape& s, void* scratch,
                                           cudaStream_t stream);

}  // namespace tessera::cuda
