#pragma once
// The hook through which a profiler sees every backend op and every model range
// (Backend::set_op_observer in ops/backend.h). The op facade (ops/backend.cpp) reports each
// op and range_push/range_pop; with no observer set (the normal case) the cost is one
// null-pointer test per op: the op's argument list is never built.
//
// Op arguments are a small fixed-capacity list (no allocation) whose keys follow
// docs/report.md ("Tessera trace args"): GEMMs carry M, N, K, dtype; attention carries B, H,
// KV, T, S, D, causal, window, dtype. Keys of one or two letters are reserved for those
// two shapes (the report reads them as such); every other op describes its sizes with
// longer lowercase keys (rows, cols, tokens, vocab, numel, nbytes, ...).
#include <array>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>

#include "tessera/core/dtype.h"
#include "tessera/ops/backend.h"

namespace tessera {

struct OpArg {
  enum class Kind : uint8_t { kInt, kBool, kDouble, kString };
  const char* key = "";  // a string literal
  Kind kind = Kind::kInt;
  int64_t i = 0;       // kInt, kBool (0/1)
  double d = 0;        // kDouble
  std::string_view s;  // kString: static storage only (literals, dtype_name)
};

class OpArgs {
 public:
  static constexpr int kCapacity = 14;

  OpArgs& add(const char* key, int64_t v) { return push({key, OpArg::Kind::kInt, v, 0, {}}); }
  OpArgs& add_bool(const char* key, bool v) {
    return push({key, OpArg::Kind::kBool, v ? 1 : 0, 0, {}});
  }
  OpArgs& add_double(const char* key, double v) {
    return push({key, OpArg::Kind::kDouble, 0, v, {}});
  }
  // `v` must have static storage duration (it is kept until the trace is written).
  OpArgs& add_string(const char* key, std::string_view v) {
    return push({key, OpArg::Kind::kString, 0, 0, v});
  }
  OpArgs& add_dtype(const char* key, DType t) { return add_string(key, dtype_name(t)); }

  std::span<const OpArg> items() const { return {items_.data(), static_cast<size_t>(size_)}; }
  bool empty() const { return size_ == 0; }

 private:
  OpArgs& push(const OpArg& a) {
    if (size_ < kCapacity) items_[size_++] = a;  // extra arguments are dropped, never overflow
    return *this;
  }
  std::array<OpArg, kCapacity> items_{};
  int size_ = 0;
};

// Receives the ops and ranges of one backend, from the one host thread that drives it.
// Calls nest: every op_begin is matched by an op_end, every range_begin by a range_end.
class OpObserver {
 public:
  virtual ~OpObserver() = default;
  // `name` is a string literal (the op's name, e.g. "matmul").
  virtual void op_begin(const char* name, const OpArgs& args) = 0;
  virtual void op_end() = 0;
  // Model structure (Backend::range_push: "layer_forward", "attention_block", ...).
  virtual void range_begin(const char* name) = 0;
  virtual void range_end() = 0;
};

// ---- argument builders: how the facade describes each op ----
namespace op_args {

// Rows (product of leading dims) and columns (last dim) of a tensor seen as a matrix.
inline std::pair<int64_t, int64_t> matrix(const Tensor& t) {
  const int rank = t.shape.rank();
  if (rank == 0) return {1, 1};
  int64_t rows = 1;
  for (int i = 0; i < rank - 1; ++i) rows *= t.shape[i];
  return {rows, t.shape[rank - 1]};
}

// out (M, N) = op(a) (M, K) @ op(b) (K, N): the report's GEMM args.
inline OpArgs matmul(const MatmulArgs& m) {
  const auto [M, N] = matrix(m.out);
  const auto [a_rows, a_cols] = matrix(m.a);
  OpArgs r;
  r.add("M", M).add("N", N).add("K", m.trans_a ? a_rows : a_cols);
  r.add_dtype("dtype", m.a.dtype).add_dtype("out_dtype", m.out.dtype);
  r.add_bool("trans_a", m.trans_a).add_bool("trans_b", m.trans_b);
  if (m.beta != 0.0f) r.add_double("beta", m.beta);
  if (m.bias.defined()) r.add_bool("bias", true);
  return r;
}

// An FP8 GEMM out (M, N) = a (M, K) @ b (N, K)^T: the report's GEMM args.
inline OpArgs matmul_fp8(const Fp8MatmulArgs& m) {
  const auto [M, N] = matrix(m.out);
  OpArgs r;
  r.add("M", M).add("N", N).add("K", matrix(m.a).second);
  r.add_dtype("dtype", m.a.dtype).add_dtype("b_dtype", m.b.dtype).add_dtype("out_dtype", m.out.dtype);
  r.add_bool("trans_a", false).add_bool("trans_b", true);
  if (m.beta != 0.0f) r.add_double("beta", m.beta);
  if (m.bias.defined()) r.add_bool("bias", true);
  return r;
}

// The report's attention args; S = T (self-attention).
inline OpArgs attention(const AttentionShape& s, DType dtype) {
  OpArgs r;
  r.add("B", s.batch).add("H", s.heads).add("KV", s.kv_heads).add("T", s.seq).add("S", s.seq);
  r.add("D", s.head_dim).add_bool("causal", s.causal).add("window", s.window);
  if (s.v_dim() != s.head_dim) r.add("Dv", s.v_dim());
  r.add_dtype("dtype", dtype);
  return r;
}

// Rotary embedding: the attention shape under non-reserved keys (it is not attention).
inline OpArgs rope(const AttentionShape& s, DType dtype) {
  OpArgs r;
  r.add("tokens", s.tokens()).add("seq", s.seq).add("heads", s.heads).add("kv_heads", s.kv_heads);
  r.add("head_dim", s.head_dim).add_dtype("dtype", dtype);
  return r;
}

// A row-wise op over x (rows, cols): RMSNorm, SwiGLU (cols = the input width 2F), bias
// gradients, cross-entropy (cols = vocabulary).
// A block-scaled FP8 cast: its input and how many of its two outputs are written.
inline OpArgs fp8_block_cast(const Fp8BlockCastArgs& a) {
  const auto [rows, cols] = matrix(a.x);
  OpArgs r;
  r.add("rows", rows).add("cols", cols).add_dtype("dtype", a.x.dtype);
  r.add("outputs", int64_t{a.out.defined()} + int64_t{a.out_t.defined()});
  r.add_bool("blocks", a.scaling == Fp8Scaling::Block128x128);
  return r;
}

inline OpArgs rows_cols(const Tensor& x) {
  const auto [rows, cols] = matrix(x);
  OpArgs r;
  r.add("rows", rows).add("cols", cols).add_dtype("dtype", x.dtype);
  return r;
}

// Embedding lookup or its gradient: tokens (N) into a table (V, C).
inline OpArgs embedding(const Tensor& tokens, const Tensor& table, DType dtype) {
  const auto [vocab, hidden] = matrix(table);
  OpArgs r;
  r.add("tokens", tokens.numel()).add("hidden", hidden).add("vocab", vocab);
  r.add_dtype("dtype", dtype);
  return r;
}

// An op over a flat tensor (fill, convert, init_normal, sum, ...).
inline OpArgs elements(const Tensor& t) {
  OpArgs r;
  r.add("numel", t.numel()).add_dtype("dtype", t.dtype);
  return r;
}

// dst = src converted to dst's dtype.
inline OpArgs convert(const Tensor& dst, const Tensor& src) {
  OpArgs r = elements(dst);
  r.add_dtype("src_dtype", src.dtype);
  return r;
}

// sum / sum_squares of x.
inline OpArgs reduction(const Tensor& x, bool accumulate) {
  OpArgs r = elements(x);
  r.add_bool("accumulate", accumulate);
  return r;
}

// Cross-entropy over logits (rows, vocab), with or without the gradient.
inline OpArgs cross_entropy(const Tensor& logits, const Tensor& dlogits) {
  const auto [rows, vocab] = matrix(logits);
  OpArgs r;
  r.add("rows", rows).add("vocab", vocab).add_dtype("dtype", logits.dtype);
  r.add_bool("with_grad", dlogits.defined());
  return r;
}

// Memory movement (upload, download, copy).
inline OpArgs transfer(const Tensor& t) {
  OpArgs r;
  r.add("nbytes", static_cast<int64_t>(t.nbytes())).add_dtype("dtype", t.dtype);
  return r;
}

// A router or its losses over logits (tokens, experts).
inline OpArgs moe_routing(const Tensor& logits, const MoeRouting& r) {
  const auto [tokens, experts] = matrix(logits);
  OpArgs args;
  args.add("tokens", tokens).add("experts", experts).add("topk", r.topk);
  args.add_dtype("dtype", logits.dtype);
  return args;
}

// Token dispatch or combine: x (tokens, hidden), (tokens, topk) slots, the permuted rows.
inline OpArgs moe_permute(const Tensor& x, const Tensor& slots, const Tensor& permuted) {
  const auto [tokens, hidden] = matrix(x);
  OpArgs args;
  args.add("tokens", tokens).add("hidden", hidden).add("topk", matrix(slots).second);
  args.add("rows", matrix(permuted).first).add_dtype("dtype", x.dtype);
  return args;
}

// A grouped GEMM: M is the rows in groups (the useful ones, where the host knows them), so
// that 2 M N K is its FLOP count as for a GEMM.
inline OpArgs grouped_matmul(const GroupedMatmulArgs& g) {
  const int64_t G = g.b.shape.rank() == 3 ? g.b.shape[0] : 0;
  const int64_t N = g.trans_b ? g.b.shape[1] : g.b.shape[2];
  const int64_t K = g.trans_b ? g.b.shape[2] : g.b.shape[1];
  OpArgs r;
  r.add("M", g.host_offsets.empty() ? matrix(g.a).first : g.host_offsets.back());
  r.add("N", N).add("K", K).add("groups", G);
  r.add_dtype("dtype", g.a.dtype).add_dtype("out_dtype", g.out.dtype);
  r.add_bool("trans_a", false).add_bool("trans_b", g.trans_b);
  return r;
}

inline OpArgs grouped_matmul_wgrad(const GroupedMatmulWgradArgs& g) {
  const int64_t G = g.out.shape.rank() == 3 ? g.out.shape[0] : 0;
  OpArgs r;
  r.add("M", g.out.shape.rank() == 3 ? g.out.shape[1] : 0);
  r.add("N", g.out.shape.rank() == 3 ? g.out.shape[2] : 0);
  r.add("K", g.host_offsets.empty() ? matrix(g.a).first : g.host_offsets.back());
  r.add("groups", G).add_dtype("dtype", g.a.dtype).add_dtype("out_dtype", g.out.dtype);
  r.add_bool("trans_a", true).add_bool("trans_b", false);
  if (g.beta != 0.0f) r.add_double("beta", g.beta);
  return r;
}

// The FP8 grouped GEMMs, as the bf16 ones (b is K-major: trans_b).
inline OpArgs grouped_matmul_fp8(const GroupedFp8MatmulArgs& g) {
  const bool shaped = g.b.shape.rank() == 3;
  OpArgs r;
  r.add("M", g.host_offsets.empty() ? matrix(g.a).first : g.host_offsets.back());
  r.add("N", shaped ? g.b.shape[1] : 0).add("K", shaped ? g.b.shape[2] : 0);
  r.add("groups", shaped ? g.b.shape[0] : 0);
  r.add_dtype("dtype", g.a.dtype)
      .add_dtype("b_dtype", g.b.dtype)
      .add_dtype("out_dtype", g.out.dtype);
  r.add_bool("trans_a", false).add_bool("trans_b", true);
  return r;
}

inline OpArgs grouped_matmul_fp8_wgrad(const GroupedFp8MatmulWgradArgs& g) {
  const bool shaped = g.out.shape.rank() == 3;
  OpArgs r;
  r.add("M", shaped ? g.out.shape[1] : 0).add("N", shaped ? g.out.shape[2] : 0);
  r.add("K", g.host_offsets.empty() ? matrix(g.a_t).second : g.host_offsets.back());
  r.add("groups", shaped ? g.out.shape[0] : 0);
  r.add_dtype("dtype", g.a_t.dtype).add_dtype("b_dtype", g.b_t.dtype);
  r.add_dtype("out_dtype", g.out.dtype);
  r.add_bool("trans_a", false).add_bool("trans_b", true);
  if (g.beta != 0.0f) r.add_double("beta", g.beta);
  return r;
}

// The state dtypes (the precision-aware optimizer's) fix the bytes the step moves; without
// an fp32 master the parameters are updated in place.
inline OpArgs adamw(const AdamWArgs& a) {
  OpArgs r;
  r.add("numel", a.master.defined() ? a.master.numel() : a.params.numel())
      .add("segments", static_cast<int64_t>(a.segments.size()));
  r.add_dtype("dtype", a.params.defined() ? a.params.dtype : a.master.dtype);
  r.add_bool("master", a.master.defined());
  r.add_dtype("grad_dtype", a.grad.dtype)
      .add_dtype("exp_avg_dtype", a.exp_avg.dtype)
      .add_dtype("exp_avg_sq_dtype", a.exp_avg_sq.dtype);
  return r;
}

}  // namespace op_args
}  // namespace tessera
