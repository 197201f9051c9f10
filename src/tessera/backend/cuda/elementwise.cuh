#pragma once
// Elementwise launchers over flat buffers: fill, dtype conversion, random init, and the
// maps of the decoder's slots (residual add, scale, logit soft-cap).
#include <cstdint>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"

namespace tessera::cuda {

// dst (n) = value converted to dtype (fp32, bf16 round-to-nearest-even, or int32).
void fill(void* dst, int64_t n, float value, DType dtype, cudaStream_t stream);

// dst (n) = src (n) converted, fp32 <-> bf16 (round to nearest even). Same dtypes: a copy.
void convert(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n,
             cudaStream_t stream);

// dst[i] = fmaf(std, random_normal(seed, first_index + i), mean), then rounded to dtype:
// the float values of ref::init_normal, bit for bit (see random.h for the one caveat).
void init_normal(void* dst, int64_t n, uint64_t seed, uint64_t first_index, float mean, float std,
                 DType dtype, cudaStream_t stream);

// Elementwise maps in fp32 over n elements of dtype (fp32 or bf16); the output may alias an
// input. out = a + b; out = alpha x; out = cap tanh(x / cap); dx = dy (1 - (y / cap)^2).
void add(void* out, const void* a, const void* b, int64_t n, DType dtype, cudaStream_t stream);
void scale(void* out, const void* x, float alpha, int64_t n, DType dtype, cudaStream_t stream);
void softcap(void* out, const void* x, float cap, int64_t n, DType dtype, cudaStream_t stream);
void softcap_backward(void* dx, const void* dy, const void* y, float cap, int64_t n, DType dtype,
                      cudaStream_t stream);

// dst[dst_rows[i]] = src[src_rows[i]] for i < count, rows of row_bytes bytes; a null index is
// the identity (Backend::copy_rows).
void copy_rows(void* dst, const int32_t* dst_rows, const void* src, const int32_t* src_rows,
               int64_t count, size_t row_bytes, cudaStream_t stream);

}  // namespace tessera::cuda
