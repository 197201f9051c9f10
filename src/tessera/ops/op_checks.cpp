#include "tessera/ops/op_checks.h"

namespace tessera {

MatrixDims matrix_dims(const Tensor& t) {
  MatrixDims d;
  const int rank = t.shape.rank();
  if (rank == 0) return d;
  d.cols = t.shape[rank - 1];
  for (int i = 0; i < rank - 1; ++i) d.rows *= t.shape[i];
  return d;
}

void OpChecks::fail(const std::string& message) const {
  throw InternalError(format_message("{} {}: {}", backend_, op_, message));
}

void OpChecks::placed(const Tensor& t, const char* what) const {
  that(t.defined() || t.numel() == 0, "{} is undefined", what);
  that(t.device.kind == kind_, "{} lives on {}", what, device_name(t.device));
}

void OpChecks::count(const Tensor& t, int64_t n, const char* what) const {
  placed(t, what);
  that(t.numel() == n, "{} {} has {} elements, expected {}", what, t.shape.str(), t.numel(), n);
}

void OpChecks::dtype(const Tensor& t, DType d, const char* what) const {
  placed(t, what);
  that(t.dtype == d, "{} has dtype {}, expected {}", what, dtype_name(t.dtype), dtype_name(d));
}

void OpChecks::attention_shape(const AttentionShape& s) const {
  that(s.batch > 0 && s.seq > 0 && s.heads > 0 && s.kv_heads > 0 && s.head_dim > 0,
       "empty attention shape B={} T={} H={} KV={} D={}", s.batch, s.seq, s.heads, s.kv_heads,
       s.head_dim);
  that(s.heads % s.kv_heads == 0, "{} heads are not a multiple of {} kv heads", s.heads,
       s.kv_heads);
  that(s.window >= 0, "negative window {}", s.window);
}

void OpChecks::rope(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s) const {
  attention_shape(s);
  count(qkv, s.tokens() * s.qkv_width(), "qkv");
  placed(freqs, "freqs");
  that(s.head_dim % 2 == 0, "rotary embedding needs an even head_dim, got {}", s.head_dim);
  const MatrixDims f = matrix_dims(freqs);
  that(f.cols == s.head_dim && f.rows >= s.seq, "freqs {} must be (T >= {}, head_dim {})",
       freqs.shape.str(), s.seq, s.head_dim);
}

}  // namespace tessera
