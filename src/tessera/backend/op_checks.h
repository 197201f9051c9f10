#pragma once
// Argument checks both backends run before an op, so that a wrong call fails with the same
// rule and the same message on either; `backend` ("cpu", "cuda") starts the message. Dtype
// rules stay with each backend (the CPU computes in fp32, CUDA in bf16 or fp32).
#include <cstdint>
#include <string_view>

#include "tessera/core/tensor.h"
#include "tessera/ops/backend.h"

namespace tessera {

// A tensor seen as a matrix: the last dimension is the columns, all leading ones the rows.
struct MatrixDims {
  int64_t rows = 1, cols = 1;
};
MatrixDims matrix_dims(const Tensor& t);

// t is defined (or empty: empty tensors may have no memory at all) and lives on `kind`.
void expect_on(std::string_view backend, const Tensor& t, DeviceKind kind, const char* op,
               const char* what);

void expect_count(std::string_view backend, const Tensor& t, int64_t n, const char* op,
                  const char* what);

// Non-empty, heads a multiple of kv_heads, a non-negative window.
void check_attention_shape(std::string_view backend, const AttentionShape& s, const char* op);

// qkv holds s's tokens x qkv width, head_dim is even, freqs is (>= T, head_dim).
void check_rope_shapes(std::string_view backend, const Tensor& qkv, const Tensor& freqs,
                       const AttentionShape& s, const char* op);

}  // namespace tessera
