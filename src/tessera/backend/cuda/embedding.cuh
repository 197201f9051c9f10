#pragma once
// Token embedding lookup and its deterministic backward.
#include <cstddef>
#include <cstdint>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"

namespace tessera::cuda {

// out (N, C) = table[tokens]; tokens (N) int32; table (V, C); out and table in dtype.
// A token outside [0, V) gets a NaN row, so that bad data shows up as a non-finite loss
// (the CPU backend throws instead; a kernel cannot).
void embedding_forward(void* out, const int32_t* tokens, const void* table, int64_t N, int64_t C,
                       int64_t V, DType dtype, cudaStream_t stream);

// Device scratch bytes embedding_backward needs for N tokens.
size_t embedding_backward_scratch_bytes(int64_t N);

// dtable (V, C) accumulates the rows of dout (N, C) (in dout_dtype) at tokens (N), each row's
// additions in token order in fp32: the same bits on every run and as the fp32 CPU reference.
// dtable fp32, or bf16 (table_dtype): the row's fp32 sum rounded once. Tokens outside [0, V)
// are skipped.
void embedding_backward(void* dtable, DType table_dtype, const void* dout, const int32_t* tokens,
                        int64_t N, int64_t C, int64_t V, DType dout_dtype, void* scratch,
                        size_t scratch_bytes, cudaStream_t stream);

// Vocabulary-parallel lookup (Backend::embedding_shard_forward): table (V, C) holds the rows
// of ids [first_id, first_id + V); a token outside them gets a zero row.
void embedding_shard_forward(void* out, const int32_t* tokens, const void* table, int64_t N,
                             int64_t C, int64_t V, int64_t first_id, DType dtype,
                             cudaStream_t stream);

// Its backward: dtable (V, C) (fp32, or bf16: table_dtype) accumulates the rows of dout whose
// tokens lie in the shard, deterministically as embedding_backward. Scratch:
// embedding_backward_scratch_bytes(N).
void embedding_shard_backward(void* dtable, DType table_dtype, const void* dout,
                              const int32_t* tokens, int64_t N, int64_t C, int64_t V,
                              int64_t first_id, DType dout_dtype, void* scratch,
                              size_t scratch_bytes, cudaStream_t stream);

}  // namespace tessera::cuda
