#pragma once
// Multi-latent attention's packing (op API: Backend::mla_qkv_forward/backward, MlaQkvArgs)
// and the column copy fused projections are sliced with (Backend::copy_columns). Include from
// .cu files only (cudaStream_t).
#include <cstdint>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"
#include "tessera/ops/backend.h"

namespace tessera::cuda {

// Raw views of MlaQkvArgs: q and k_rope point at their first column (q_col, k_col) of row 0,
// their rows q_stride and k_stride elements apart; everything in dtype but freqs (fp32).
struct MlaQkvView {
  void* qkv = nullptr;
  void* q = nullptr;
  int64_t q_stride = 0;
  void* k_rope = nullptr;
  int64_t k_stride = 0;
  void* kv = nullptr;
  const float* freqs = nullptr;
  AttentionShape s;
  int64_t rope_dim = 0;
};

// qkv overwritten from q, k_rope, kv.
void mla_qkv_forward(const MlaQkvView& a, DType dtype, cudaStream_t stream);
// With every view the gradient of the forward's: qkv read; q's H*D and k_rope's rope_dim
// columns per row and all of kv overwritten.
void mla_qkv_backward(const MlaQkvView& g, DType dtype, cudaStream_t stream);

// dst[r, dst_col + j] = src[r, src_col + j], j < cols, for rows r < rows; rows dst_width and
// src_width elements of `element_bytes` apart.
void copy_columns(void* dst, int64_t dst_width, int64_t dst_col, const void* src, int64_t src_width,
                  int64_t src_col, int64_t rows, int64_t cols, size_t element_bytes,
                  cudaStream_t stream);

}  // namespace tessera::cuda
