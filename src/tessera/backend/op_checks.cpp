#include "tessera/backend/op_checks.h"

#include "tessera/core/error.h"

namespace tessera {

MatrixDims matrix_dims(const Tensor& t) {
  MatrixDims d;
  const int rank = t.shape.rank();
  if (rank == 0) return d;
  d.cols = t.shape[rank - 1];
  for (int i = 0; i < rank - 1; ++i) d.rows *= t.shape[i];
  return d;
}

void expect_on(std::string_view backend, const Tensor& t, DeviceKind kind, const char* op,
               const char* what) {
  TS_CHECK(t.defined() || t.numel() == 0, "{} {}: {} is undefined", backend, op, what);
  TS_CHECK(t.device.kind == kind, "{} {}: {} lives on {}", backend, op, what,
           device_name(t.device));
}

void expect_count(std::string_view backend, const Tensor& t, int64_t n, const char* op,
                  const char* what) {
  TS_CHECK(t.numel() == n, "{} {}: {} {} has {} elements, expected {}", backend, op, what,
           t.shape.str(), t.numel(), n);
}

void check_attention_shape(std::string_view backend, const AttentionShape& s, const char* op) {
  TS_CHECK(s.batch > 0 && s.seq > 0 && s.heads > 0 && s.kv_heads > 0 && s.head_dim > 0,
           "{} {}: empty attention shape B={} T={} H={} KV={} D={}", backend, op, s.batch, s.seq,
           s.heads, s.kv_heads, s.head_dim);
  TS_CHECK(s.heads % s.kv_heads == 0, "{} {}: {} heads are not a multiple of {} kv heads",
           backend, op, s.heads, s.kv_heads);
  TS_CHECK(s.window >= 0, "{} {}: negative window {}", backend, op, s.window);
}

void check_rope_shapes(std::string_view backend, const Tensor& qkv, const Tensor& freqs,
                       const AttentionShape& s, const char* op) {
  check_attention_shape(backend, s, op);
  expect_count(backend, qkv, s.tokens() * s.qkv_width(), op, "qkv");
  TS_CHECK(s.head_dim % 2 == 0, "{} {}: rotary embedding needs an even head_dim, got {}",
           backend, op, s.head_dim);
  const MatrixDims f = matrix_dims(freqs);
  TS_CHECK(f.cols == s.head_dim && f.rows >= s.seq, "{} {}: freqs {} must be (T >= {}, head_dim {})",
           backend, op, freqs.shape.str(), s.seq, s.head_dim);
}

}  // namespace tessera
