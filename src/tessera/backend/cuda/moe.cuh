#pragma once
// Mixture-of-experts kernels: the router (top-k over softmax or sigmoid scores, group-limited,
// expert bias) and its backward, the load-balancing and z losses, per-expert token counts,
// and the dropless dispatch (permute) and combine (unpermute) with their backwards. The math
// is that of backend/cpu/reference_moe.cpp; ops/backend.h states it.
//
// Determinism: no float atomics. Counts use integer atomics (exact in any order), the losses
// add per-token partials with the fixed-order sum of reduce.cuh, and every permuted row is
// written by exactly one thread block. Router choices are made on double-precision scores, so
// that near-ties resolve as on the CPU reference.
#include <cstddef>
#include <cstdint>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"
#include "tessera/ops/backend.h"

namespace tessera::cuda {

// The largest routing the router kernels take (their per-token state lives in shared memory).
inline constexpr int64_t kMaxRouterExperts = 4096;
inline constexpr int64_t kMaxRouterTopk = 64;

// indices, weights (N, K) overwritten; logits (N, E) in dtype; bias (E) fp32 or null.
void moe_router_forward(int32_t* indices, float* weights, const void* logits, DType dtype,
                        const float* bias, int64_t N, const MoeRouting& r, cudaStream_t stream);

// dlogits (N, E) fp32 overwritten from dweights (N, K) fp32.
void moe_router_backward(float* dlogits, const float* dweights, const void* logits, DType dtype,
                         const int32_t* indices, int64_t N, const MoeRouting& r,
                         cudaStream_t stream);

// Scratch bytes of moe_aux_loss and moe_z_loss for N tokens, E experts, B sequences.
size_t moe_loss_scratch_bytes(int64_t N, int64_t E, int64_t B);

// loss (1) += L, dlogits (N, E) += grad_scale * dL/dlogits, each unless null. seq 0: aux_loss.
void moe_aux_loss(float* loss, float* dlogits, const void* logits, DType dtype,
                  const int32_t* indices, int64_t N, const MoeRouting& r, int64_t seq,
                  float grad_scale, void* scratch, size_t scratch_bytes, cudaStream_t stream);

// loss (1) += mean_n lse_n^2, dlogits (N, E) += grad_scale * its gradient, each unless null.
void moe_z_loss(float* loss, float* dlogits, const void* logits, DType dtype, int64_t N, int64_t E,
                float grad_scale, void* scratch, size_t scratch_bytes, cudaStream_t stream);

// counts (E) fp32 += tokens per expert over the n entries of indices.
void moe_expert_counts(float* counts, const int32_t* indices, int64_t n, cudaStream_t stream);

// bias (E) fp32 += rate * sign(mean(counts) - counts[e]).
void moe_expert_bias_update(float* bias, const float* counts, int64_t E, float rate,
                            cudaStream_t stream);

size_t moe_permute_scratch_bytes(int64_t R, int64_t E, int64_t slots, int64_t capacity);

// xp (R, C), rows (N, K), offsets (E + 1) overwritten from x (N, C) and indices (N, K); with a
// capacity (> 0) each expert keeps at most that many pairs (the largest weights (N, K), or the
// earliest by_position; MoeCapacity), the others get row -1 (and `dropped`, when not null, their
// number).
void moe_permute(void* xp, int32_t* rows, int32_t* offsets, const void* x, const int32_t* indices,
                 int64_t N, int64_t K, int64_t C, int64_t E, int64_t R, int64_t align,
                 int64_t capacity, bool by_position, const float* weights, float* dropped,
                 DType dtype, void* scratch, size_t scratch_bytes, cudaStream_t stream);

// dx (N, C) += sum_k dxp[rows[n, k]].
void moe_permute_backward(void* dx, const void* dxp, const int32_t* rows, int64_t N, int64_t K,
                          int64_t C, DType dtype, cudaStream_t stream);

// out (N, C) += sum_k weights[n, k] * yp[rows[n, k]].
void moe_unpermute(void* out, const void* yp, const int32_t* rows, const float* weights, int64_t N,
                   int64_t K, int64_t C, DType dtype, cudaStream_t stream);

size_t moe_unpermute_backward_scratch_bytes(int64_t R);

// dyp (R, C) and dweights (N, K) overwritten.
void moe_unpermute_backward(void* dyp, float* dweights, const void* dout, const void* yp,
                            const int32_t* rows, const float* weights, int64_t N, int64_t K,
                            int64_t C, int64_t R, DType dtype, void* scratch, size_t scratch_bytes,
                            cudaStream_t stream);

// x (n) fp32 *= factor.
void scale_floats(float* x, int64_t n, float factor, cudaStream_t stream);

// ---- QK norm (Qwen3) ----

// out (N, W), rstd (N, H + KV) from qkv (N, W) and the (D) weights, all but rstd in dtype.
void qk_norm_forward(void* out, float* rstd, const void* qkv, const void* q_weight,
                     const void* k_weight, const AttentionShape& s, float eps, DType dtype,
                     cudaStream_t stream);

size_t qk_norm_backward_scratch_bytes(const AttentionShape& s);

// dqkv (N, W) overwritten (may be dout); dq_weight, dk_weight (D, of the gradients' dtype
// grad_dtype) accumulate.
void qk_norm_backward(void* dqkv, void* dq_weight, void* dk_weight, DType grad_dtype,
                      const void* dout,
                      const void* qkv, const void* q_weight, const void* k_weight,
                      const float* rstd, const AttentionShape& s, DType dtype, void* scratch,
                      size_t scratch_bytes, cudaStream_t stream);

}  // namespace tessera::cuda
