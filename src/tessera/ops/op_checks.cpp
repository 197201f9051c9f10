#include "tessera/ops/op_checks.h"

#include <algorithm>
#include <string>

#include "tessera/core/fp8.h"

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
  if (s.document_starts.defined()) {
    that(s.causal, "document starts with full (non-causal) attention");
    count(s.document_starts, s.tokens(), "document_starts");
    dtype(s.document_starts, DType::I32, "document_starts");
  }
}

void OpChecks::rope(const Tensor& qkv, const Tensor& freqs, const AttentionShape& s) const {
  attention_shape(s);
  count(qkv, s.tokens() * s.qkv_width(), "qkv");
  placed(freqs, "freqs");
  that(s.head_dim % 2 == 0, "rotary embedding needs an even head_dim, got {}", s.head_dim);
  const MatrixDims f = matrix_dims(freqs);
  if (s.rope_per_token)
    that(f.cols == s.head_dim && f.rows == s.tokens(), "freqs {} must be (B*T = {}, head_dim {})",
         freqs.shape.str(), s.tokens(), s.head_dim);
  else
    that(f.cols == s.head_dim && f.rows >= s.seq, "freqs {} must be (T >= {}, head_dim {})",
         freqs.shape.str(), s.seq, s.head_dim);
}

namespace {

// "args.out" -> "out": the table names struct members by their path.
std::string_view argument_name(const char* written) {
  std::string_view n(written);
  if (n.starts_with("args.")) n.remove_prefix(5);
  return n;
}

std::string dtype_list(std::span<const DType> dtypes) {
  std::string s;
  for (DType d : dtypes) s += std::string(s.empty() ? "" : " or ") + std::string(dtype_name(d));
  return s;
}

}  // namespace

void OpChecks::dtypes(std::initializer_list<TensorDtype> rules,
                      std::span<const DType> compute) const {
  for (const TensorDtype& r : rules) {
    const Tensor& t = *r.tensor;
    if (!t.defined()) continue;
    const DType d = t.dtype;
    const bool in_compute = std::find(compute.begin(), compute.end(), d) != compute.end();
    switch (r.rule) {
      case DtypeRule::Compute:
        that(in_compute, "{} has dtype {}, expected {} (this backend's compute dtypes)",
             argument_name(r.name), dtype_name(d), dtype_list(compute));
        break;
      case DtypeRule::ComputeOrF32: {
        const bool has_f32 = std::find(compute.begin(), compute.end(), DType::F32) != compute.end();
        that(in_compute || d == DType::F32, "{} has dtype {}, expected {}{}", argument_name(r.name),
             dtype_name(d), dtype_list(compute), has_f32 ? "" : " or fp32");
        break;
      }
      case DtypeRule::Float:
        that(d == DType::F32 || d == DType::BF16, "{} has dtype {}, expected fp32 or bf16",
             argument_name(r.name), dtype_name(d));
        break;
      case DtypeRule::F32:
        that(d == DType::F32, "{} has dtype {}, expected fp32", argument_name(r.name),
             dtype_name(d));
        break;
      case DtypeRule::I32:
        that(d == DType::I32, "{} has dtype {}, expected int32", argument_name(r.name),
             dtype_name(d));
        break;
      case DtypeRule::Fp8:
        that(is_fp8(d), "{} has dtype {}, expected e4m3 or e5m2", argument_name(r.name),
             dtype_name(d));
        break;
      case DtypeRule::Like:
        if (r.like->defined())
          that(d == r.like->dtype, "{} has dtype {}, expected {}'s, {}", argument_name(r.name),
               dtype_name(d), argument_name(r.like_name), dtype_name(r.like->dtype));
        break;
    }
  }
}

}  // namespace tessera
