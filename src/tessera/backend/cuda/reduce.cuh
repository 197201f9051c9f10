#pragma once
// Deterministic reductions: whole-tensor sums, column sums (bias gradients) and the final
// pass that adds per-block partial column sums into a gradient. No float atomics anywhere:
// work is cut into pieces whose size does not depend on the GPU, and pieces combine in a
// fixed order, so results are identical run to run.
#include <cstddef>
#include <cstdint>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"

namespace tessera::cuda {

// dst (cols) += the sums over rows of partial (rows, cols) fp32, in row order; dst fp32, or
// bf16 (a gradient kept in bf16: the fp32 sum added to its value, rounded once).
void column_sums_accumulate(void* dst, DType dst_dtype, const float* partial, int64_t rows,
                            int64_t cols, cudaStream_t stream);

// Device scratch bytes sum / sum_squares need for n elements (per-block partial sums).
size_t sum_scratch_bytes(int64_t n);

// out (1) fp32 = sum(x) (accumulate: out += sum(x)); x (n) fp32.
void sum(float* out, const float* x, int64_t n, bool accumulate, void* scratch,
         size_t scratch_bytes, cudaStream_t stream);

// out (1) fp32 = sum(x^2) (accumulate: out += sum(x^2)); x (n) fp32 or bf16 (the norm of bf16
// gradients).
void sum_squares(float* out, const void* x, DType x_dtype, int64_t n, bool accumulate,
                 void* scratch, size_t scratch_bytes, cudaStream_t stream);

// Device scratch bytes bias_backward needs for dout (M, N).
size_t bias_backward_scratch_bytes(int64_t M, int64_t N);

// dbias (N) accumulates the column sums of dout (M, N) in dtype; dbias fp32 or bf16.
void bias_backward(void* dbias, DType dbias_dtype, const void* dout, int64_t M, int64_t N,
                   DType dtype, void* scratch, size_t scratch_bytes, cudaStream_t stream);

}  // namespace tessera::cuda
