#pragma once
// Softmax cross-entropy over rows of logits, forward and backward fused, and the per-token
// log-probabilities post-training takes from the same rows.
#include <cstdint>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"

namespace tessera::cuda {

// logits (N, V) in dtype; targets (N) int32, negative = ignored (loss 0, zero gradient row).
// losses (N) fp32 = logsumexp(logits[n]) - logits[n, target]. If dlogits is non-null (it may
// be logits itself) it receives grad_scale * (softmax(logits[n]) - onehot(target)) in dtype.
// A target >= V gives a NaN loss and a NaN gradient row (the CPU backend throws instead).
void cross_entropy(float* losses, void* dlogits, const void* logits, const int32_t* targets,
                   int64_t N, int64_t V, float grad_scale, DType dtype, cudaStream_t stream);

// Vocabulary-parallel cross-entropy (Backend::cross_entropy_shard_stats / cross_entropy_shard):
// logits (N, V) in dtype are the columns [first_id, first_id + V) of the whole vocabulary.
// stats (N, 2) fp32 = {logsumexp of the row, the target's logit if it lies in the shard, else 0}.
void cross_entropy_shard_stats(float* stats, const void* logits, const int32_t* targets, int64_t N,
                               int64_t V, int64_t first_id, DType dtype, cudaStream_t stream);
// all_stats (S, N, 2) fp32: every shard's stats in shard order. losses (N) fp32 = the
// logsumexp over the shards - the target's logit; dlogits (optional, may be logits) =
// grad_scale * (softmax - onehot) over this shard's columns, in dtype.
void cross_entropy_shard(float* losses, void* dlogits, const void* logits, const int32_t* targets,
                         const float* all_stats, int64_t S, int64_t N, int64_t V, int64_t first_id,
                         float grad_scale, DType dtype, cudaStream_t stream);

// Per-token log-probabilities (Backend::log_softmax_gather): logps (N) and lse (N) fp32 =
// logits[n, target] - logsumexp(logits[n]) and the logsumexp; 0 and 0 where target < 0, a
// NaN log-probability where target >= V.
void log_softmax_gather(float* logps, float* lse, const void* logits, const int32_t* targets,
                        int64_t N, int64_t V, DType dtype, cudaStream_t stream);
// dlogits (N, V) in dtype, may be logits: dlogps[n] * (onehot(target) - exp(logits[n] - lse[n])),
// a zero row where target < 0.
void log_softmax_gather_backward(void* dlogits, const float* dlogps, const void* logits,
                                 const float* lse, const int32_t* targets, int64_t N, int64_t V,
                                 DType dtype, cudaStream_t stream);

}  // namespace tessera::cuda
