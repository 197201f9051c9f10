#pragma once
// Deterministic reductions: whole-tensor sums, column sums (bias gradients) and the final
// pass that adds per-block partial column sums into a gradient. No float atomics anywhere:
// work is cut into pieces whose size does not depend on the GPU, and pieces combine in a
// fixed order, so results are identical run to run.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "tessera/core/dtype.h"

namespace tessera::cuda {

// dst (cols) fp32 += the sums over rows of partial (rows, cols) fp32, in row order.
void column_sums_accumulate(float* dst, const float* partial, int64_t rows, int64_t cols,
                            cudaStream_t stream);

// Device scratch bytes sum / sum_squares need for n elements (per-block partial sums).
size_t sum_scratch_bytes(int64_t n);

// out (1) fp32 = sum(x) (accumulate: out += sum(x)); x (n) fp32.
void sum(float* out, const float* x, int64_t n, bool accumulate, void* scratch,
         size_t scratch_bytes, cudaStream_t stream);

// out (1) fp32 = sum(x^2) (accumulate: out += sum(x^2)); x (n) fp32.
void sum_squares(float* out, const float* x, int64_t n, bool accumulate, void* scratch,
                 size_t scratch_bytes, cudaStream_t stream);

// Device scratch bytes bias_backward needs for dout (M, N).
size_t bias_backward_scratch_bytes(int64_t M, int64_t N);

// dbias (N) fp32 accumulates the column sums of dout (M, N) in dtype.
void bias_backward(float* dbias, const void* dout, int64_t M, int64_t N, DType dtype, void* scratch,
                   size_t scratch_bytes, cudaStream_t stream);

}  // namespace tessera::cuda
