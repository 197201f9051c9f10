#pragma once
// Attention for any head dimensions up to 256, one warp per query row (forward, dQ) or key row
// (dK, dV), same op contract as attention.cuh (ops/backend.h): the CUDA path for the shapes
// Tessera's flash kernels do not take (head_dim other than 64 or 128, or value heads narrower
// than the query/key heads: multi-latent attention's 192 against 128) wherever cuDNN does not
// run them either (attention_backend tessera, no cuDNN, or a shape its engines refuse).
//
// Exact rather than fast: fp32 scores, softmax and accumulation without tensor cores, each
// row's keys (or a key's queries) visited in order, no atomics, so results repeat bit for bit.
// Lanes hold a row's dimensions (lane + 32 i), a score is one warp reduction per key, and keys
// and values are read from L2 by every row that sees them.
#include <cstddef>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"
#include "tessera/ops/backend.h"

namespace tessera::cuda {

// The widest head (query/key or value) the kernels take.
constexpr int64_t kRowwiseMaxHeadDim = 256;

// qkv (B, T, s.qkv_width()), out (B, T, H*Dv) in dtype (bf16 or fp32); lse (B, H, T) fp32.
void attention_rowwise_forward(void* out, float* lse, const void* qkv, const AttentionShape& s,
                               DType dtype, cudaStream_t stream);
// dqkv overwritten; scratch: attention_rowwise_backward_scratch_bytes(s) of device memory.
void attention_rowwise_backward(void* dqkv, const void* dout, const void* out, const float* lse,
                                const void* qkv, const AttentionShape& s, void* scratch,
                                DType dtype, cudaStream_t stream);
// Each query row's dout . out (B, H, T) fp32.
size_t attention_rowwise_backward_scratch_bytes(const AttentionShape& s);

}  // namespace tessera::cuda
