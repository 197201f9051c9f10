#pragma once
// Fused flash attention for Hopper, bf16 in and out, fp32 softmax statistics and accumulation:
// the FlashAttention-2 algorithm on warp MMAs, and at head_dim 128 on sm_90a a forward and
// backward in FlashAttention-3's structure (warpgroup MMAs, TMA, producer warps). Causal,
// native sliding window (masked tiles are never visited), grouped-query attention reading the
// shared K/V heads in place, head_dim 64/128.
// Include from .cu files only (cudaStream_t).
//
// Layouts (op API, ops/backend.h): qkv (B, T, (H + 2*KV) * D) packs per token H query heads,
// then KV key heads, then KV value heads; out (B, T, H*D); lse (B, H, T) fp32 natural log.
#include <cstddef>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/ops/backend.h"

namespace tessera::cuda {

// qkv (B,T,(H+2KV)*D) bf16, out (B,T,H*D) bf16, lse (B,H,T) fp32.
void attention_forward(void* out, float* lse, const void* qkv, const AttentionShape& s,
                       cudaStream_t stream);
// attention_forward, also writing out's FP8 codes (B,T,H*D) in `format` (e4m3 or e5m2) =
// satfinite_rn(out * *scale) of the stored out, and (amax non-null) amax = max(*amax,
// max |out|): the output projection's forward cast folded in. Only the warpgroup forward
// writes codes: where another kernel would run it returns false having written nothing, and
// the caller runs attention_forward and then the cast.
bool attention_forward_cast(void* out, float* lse, const void* qkv, const AttentionShape& s,
                            void* codes, DType format, const float* scale, float* amax,
                            cudaStream_t stream);
// FP8 attention (AttentionShape::fp8; ops/op_table.inc's attention_forward states the
// numerics): qkv's heads cast per 128-token tile into `scratch` (attention_fp8_scratch_bytes(s)
// bytes), then the warpgroup forward over the codes; codes (null: none) as
// attention_forward_cast's. Returns false, having done nothing, where the warpgroup kernels do
// not run (not sm_90a, heads other than 128 wide, qkv or codes not 16-byte aligned).
bool attention_forward_fp8(void* out, float* lse, const void* qkv, const AttentionShape& s,
                           void* scratch, void* codes, DType format, const float* scale,
                           float* amax, cudaStream_t stream);
size_t attention_fp8_scratch_bytes(const AttentionShape& s);
// dqkv (B,T,(H+2KV)*D) bf16 overwritten; dout, out bf16; scratch:
// attention_backward_scratch_bytes(s) bytes of device memory.
void attention_backward(void* dqkv, const void* dout, const void* out, const float* lse,
                        const void* qkv, const AttentionShape& s, void* scratch,
                        cudaStream_t stream);
size_t attention_backward_scratch_bytes(const AttentionShape& s);

// Choices the entry points above make with the defaults; exposed so that dev/attention can
// time the alternatives on the device and the defaults can follow the measurement.
struct AttentionOptions {
  // The forward on warpgroup MMAs fed by TMA (attention_hopper.cu) where the build and the
  // device have them (sm_90a, head_dim 128, qkv 16-byte aligned); false, or elsewhere: the
  // warp-MMA forward below, shaped by forward_warps and forward_block_n.
  bool forward_warpgroup = true;
  // Forward CTA: 128 query rows. 4 warps own 32 rows each (half the shared-memory reads
  // per MMA, 255 registers, 2 CTAs = 8 warps per SM) or 8 warps own 16 rows each (128
  // registers, 16 warps per SM to hide latency).
  int forward_warps = 4;
  // Keys per forward tile (32 or 64): 64 halves the barriers and softmax bookkeeping per key,
  // 32 halves the S registers.
  int forward_block_n = 64;
  // true: dQ by its own kernel that loops over key tiles (bit-reproducible, recomputes P
  // and dP: 7 instead of 5 tile GEMMs; warp MMAs only). false: the dK/dV kernel adds dS K into
  // an fp32 buffer with atomics (FlashAttention's and cuDNN's default; summation order varies
  // run to run).
  bool deterministic = false;
  // With deterministic false: the backward on warpgroup MMAs (attention_hopper_backward.cu)
  // where the forward's warpgroup kernel runs; false: the warp-MMA kernels.
  bool backward_warpgroup = true;
};

void attention_forward(void* out, float* lse, const void* qkv, const AttentionShape& s,
                       cudaStream_t stream, const AttentionOptions& options);
// Whether this build runs the warpgroup kernels for `head_dim` on CUDA device `device`: sm_90
// devices with the kernels compiled for sm_90a, head_dim 128.
bool attention_hopper_available(int64_t head_dim, int device);
void attention_backward(void* dqkv, const void* dout, const void* out, const float* lse,
                        const void* qkv, const AttentionShape& s, void* scratch,
                        cudaStream_t stream, const AttentionOptions& options);
size_t attention_backward_scratch_bytes(const AttentionShape& s, const AttentionOptions& options);

// Context parallelism's gathered attention (Backend::attention_gathered_forward / _backward)
// on the warpgroup kernels: causal bf16 attention of head dim 128 in Megatron's balanced layout
// (positions as context_parallel_positions gives them, T a multiple of 256), every segment's
// keys read from kv_all by position, this segment's queries, outputs and gradients in place.
// False, having done nothing, where they do not apply (bf16 is the caller's to check): then
// attention_gathered.cuh's portable kernels run. The backward's scratch holds
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
