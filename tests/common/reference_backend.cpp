#include "common/reference_backend.h"

#include <cmath>
#include <vector>

#include "tessera/backend/cpu/reference.h"
#include "tessera/core/fp8.h"
#include "tessera/ops/op_checks.h"

namespace tessera::test {
namespace {

void expect_f32(const Tensor& t) {
  TS_CHECK(t.dtype == DType::F32, "reference backend: a {} tensor where fp32 is expected",
           dtype_name(t.dtype));
}

// The values of an fp32 tensor, exactly, in double.
std::vector<double> values(const Tensor& t) {
  expect_f32(t);
  const float* p = t.as<float>();
  return std::vector<double>(p, p + t.numel());
}

// v rounded to fp32 into t.
void store(const Tensor& t, const std::vector<double>& v) {
  float* p = t.as<float>();
  for (size_t i = 0; i < v.size(); ++i) p[i] = static_cast<float>(v[i]);
}

// Ids that index rows of a (limit, C) tensor; negative ones only where ignored ids are allowed.
const int32_t* ids(const Tensor& t, int64_t limit, bool allow_negative) {
  TS_CHECK(t.dtype == DType::I32, "reference backend: {} ids, expected int32", dtype_name(t.dtype));
  const int32_t* p = t.as<int32_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    TS_CHECK(p[i] < limit && (allow_negative || p[i] >= 0), "reference backend: id {} of {}", p[i],
             limit);
  return p;
}

float read_float(const Tensor& t, int64_t i) {
  if (t.dtype == DType::F32) return t.as<float>()[i];
  TS_CHECK(t.dtype == DType::BF16, "reference backend: {} is not a float dtype",
           dtype_name(t.dtype));
  return bf16_bits_to_float(t.as<uint16_t>()[i]);
}

// Rounds to nearest even where t is bf16.
void write_float(const Tensor& t, int64_t i, float v) {
  if (t.dtype == DType::F32) {
    t.as<float>()[i] = v;
    return;
  }
  TS_CHECK(t.dtype == DType::BF16, "reference backend: {} is not a float dtype",
           dtype_name(t.dtype));
  t.as<uint16_t>()[i] = float_to_bf16_bits(v);
}

// An FP8 tensor's values times its dequantisation scale.
std::vector<double> dequantize(const Tensor& q, const Tensor& scale_inv) {
  const double s = values(scale_inv)[0];
  const uint8_t* codes = q.as<uint8_t>();
  std::vector<double> v(static_cast<size_t>(q.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = fp8_bits_to_float(codes[i], q.dtype) * s;
  return v;
}

// out as alpha * (...) + beta * c starts it: c's values, or out's own when c is undefined;
// nothing is read with beta = 0 (c may hold NaN).
std::vector<double> gemm_start(const Tensor& out, const Tensor& c, float beta) {
  if (beta == 0.0f) return std::vector<double>(static_cast<size_t>(out.numel()));
  return values(c.defined() ? c : out);
}

}  // namespace

void ReferenceBackend::do_fill(const Tensor& dst, float value) {
  for (int64_t i = 0; i < dst.numel(); ++i) write_float(dst, i, value);
}

void ReferenceBackend::do_convert(const Tensor& dst, const Tensor& src) {
  for (int64_t i = 0; i < dst.numel(); ++i) write_float(dst, i, read_float(src, i));
}

void ReferenceBackend::do_init_normal(const Tensor& dst, uint64_t seed, uint64_t first_index,
                                      float mean, float std) {
  expect_f32(dst);
  ref::init_normal(dst.as<float>(), dst.numel(), seed, first_index, mean, std);
}

// ---- linear algebra ----

void ReferenceBackend::do_matmul(const MatmulArgs& args) {
  const MatrixDims o = matrix_dims(args.out), a = matrix_dims(args.a);
  const int64_t M = o.rows, N = o.cols, K = args.trans_a ? a.rows : a.cols;
  std::vector<double> out = gemm_start(args.out, args.c, args.beta);
  const std::vector<double> va = values(args.a), vb = values(args.b);
  const std::vector<double> bias = args.bias.defined() ? values(args.bias) : std::vector<double>{};
  ref::matmul_forward<double>(out.data(), va.data(), vb.data(), nullptr,
                              args.bias.defined() ? bias.data() : nullptr, M, N, K, args.trans_a,
                              args.trans_b, args.alpha, args.beta);
  store(args.out, out);
}

void ReferenceBackend::do_bias_backward(const Tensor& dbias, const Tensor& dout) {
  const MatrixDims d = matrix_dims(dout);
  std::vector<double> db = values(dbias);
  ref::bias_backward(db.data(), values(dout).data(), d.rows, d.cols);
  store(dbias, db);
}

void ReferenceBackend::do_fp8_cast_transpose(const Fp8CastArgs& args) {
  const MatrixDims d = matrix_dims(args.x);
  expect_f32(args.x);
  const float* x = args.x.as<float>();
  if (args.amax.defined()) {
    float amax = static_cast<float>(values(args.amax)[0]);
    for (int64_t i = 0; i < args.x.numel(); ++i) {  // NaN compares false: it sticks once seen
      const float a = std::fabs(x[i]);
      if (std::isnan(a) || a > amax) amax = a;
    }
    store(args.amax, {amax});
  }
  if (!args.out.defined() && !args.out_t.defined()) return;
  const float scale = static_cast<float>(values(args.scale)[0]);
  const DType format = args.out.defined() ? args.out.dtype : args.out_t.dtype;
  for (int64_t r = 0; r < d.rows; ++r) {
    for (int64_t c = 0; c < d.cols; ++c) {
      const uint8_t q = float_to_fp8_bits(x[r * d.cols + c] * scale, format);
      if (args.out.defined()) args.out.as<uint8_t>()[r * d.cols + c] = q;
      if (args.out_t.defined()) args.out_t.as<uint8_t>()[c * d.rows + r] = q;
    }
  }
}

void ReferenceBackend::do_matmul_fp8(const Fp8MatmulArgs& args) {
  const MatrixDims o = matrix_dims(args.out);
  const int64_t K = matrix_dims(args.a).cols;
  std::vector<double> out = gemm_start(args.out, args.c, args.beta);
  const std::vector<double> a = dequantize(args.a, args.a_scale_inv);
  const std::vector<double> b = dequantize(args.b, args.b_scale_inv);
  const std::vector<double> bias = args.bias.defined() ? values(args.bias) : std::vector<double>{};
  ref::matmul_forward<double>(out.data(), a.data(), b.data(), nullptr,
                              args.bias.defined() ? bias.data() : nullptr, o.rows, o.cols, K, false,
                              true, args.alpha, args.beta);
  store(args.out, out);
}

void ReferenceBackend::do_fp8_update_scales(const Fp8ScaleUpdateArgs& args) {
  const MatrixDims h = matrix_dims(args.amax_history);
  expect_f32(args.amax_history);
  expect_f32(args.scale);
  expect_f32(args.scale_inv);
  Fp8ScalingParams p;
  p.fp8_max = args.fp8_max;
  p.margin = args.margin;
  p.most_recent = args.most_recent;
  p.roll = args.roll;
  const int64_t bad =
      fp8_update_scales_reference(args.amax_history.as<float>(), h.rows, h.cols,
                                  args.scale.as<float>(), args.scale_inv.as<float>(), p);
  if (bad > 0 && args.nonfinite.defined()) store(args.nonfinite, {NAN});
}

// ---- model ops ----

void ReferenceBackend::do_embedding_forward(const Tensor& out, const Tensor& tokens,
                                            const Tensor& table) {
  const MatrixDims t = matrix_dims(table);
  std::vector<double> o(static_cast<size_t>(out.numel()));
  ref::embedding_forward(o.data(), ids(tokens, t.rows, false), values(table).data(), tokens.numel(),
                         t.cols);
  store(out, o);
}

void ReferenceBackend::do_embedding_backward(const Tensor& dtable, const Tensor& dout,
                                             const Tensor& tokens) {
  const MatrixDims t = matrix_dims(dtable);
  std::vector<double> dt = values(dtable);
  ref::embedding_backward(dt.data(), values(dout).data(), ids(tokens, t.rows, false),
                          tokens.numel(), t.cols);
  store(dtable, dt);
}

void ReferenceBackend::do_embedding_shard_forward(const Tensor& out, const Tensor& tokens,
                                                  const Tensor& table, int64_t first_id) {
  const MatrixDims t = matrix_dims(table);
  std::vector<double> o(static_cast<size_t>(out.numel()));
  ref::embedding_shard_forward(o.data(), ids(tokens, INT32_MAX, false), values(table).data(),
                               tokens.numel(), t.cols, t.rows, first_id);
  store(out, o);
}

void ReferenceBackend::do_embedding_shard_backward(const Tensor& dtable, const Tensor& dout,
                                                   const Tensor& tokens, int64_t first_id) {
  const MatrixDims t = matrix_dims(dtable);
  std::vector<double> dt = values(dtable);
  ref::embedding_shard_backward(dt.data(), values(dout).data(), ids(tokens, INT32_MAX, false),
                                tokens.numel(), t.cols, t.rows, first_id);
  store(dtable, dt);
}

void ReferenceBackend::do_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x,
                                          const Tensor& weight, float eps) {
  const MatrixDims d = matrix_dims(x);
  std::vector<double> o(static_cast<size_t>(out.numel())), r(static_cast<size_t>(d.rows));
  ref::rmsnorm_forward<double>(o.data(), r.data(), values(x).data(), values(weight).data(), d.rows,
                               d.cols, eps);
  store(out, o);
  store(rstd, r);
}

void ReferenceBackend::do_rmsnorm_backward(const Tensor& dx, const Tensor& dweight,
                                           const Tensor& dout, const Tensor& x,
                                           const Tensor& weight, const Tensor& rstd) {
  const MatrixDims d = matrix_dims(x);
  std::vector<double> vdx = values(dx), vdw = values(dweight);
  ref::rmsnorm_backward(vdx.data(), vdw.data(), values(dout).data(), values(x).data(),
                        values(weight).data(), values(rstd).data(), d.rows, d.cols);
  store(dx, vdx);
  store(dweight, vdw);
}

void ReferenceBackend::do_rope_forward(const Tensor& qkv, const Tensor& freqs,
                                       const AttentionShape& s) {
  std::vector<double> v = values(qkv);
  ref::rope_forward(v.data(), values(freqs).data(), s);
  store(qkv, v);
}

void ReferenceBackend::do_rope_backward(const Tensor& dqkv, const Tensor& freqs,
                                        const AttentionShape& s) {
  std::vector<double> v = values(dqkv);
  ref::rope_backward(v.data(), values(freqs).data(), s);
  store(dqkv, v);
}

void ReferenceBackend::do_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                            const AttentionShape& s) {
  std::vector<double> o(static_cast<size_t>(out.numel())), l(static_cast<size_t>(lse.numel()));
  ref::attention_forward(o.data(), l.data(), values(qkv).data(), s);
  store(out, o);
  store(lse, l);
}

void ReferenceBackend::do_attention_backward(const Tensor& dqkv, const Tensor& dout,
                                             const Tensor& out, const Tensor& lse,
                                             const Tensor& qkv, const AttentionShape& s) {
  std::vector<double> d(static_cast<size_t>(dqkv.numel()));
  ref::attention_backward(d.data(), values(dout).data(), values(out).data(), values(lse).data(),
                          values(qkv).data(), s);
  store(dqkv, d);
}

void ReferenceBackend::do_attention_gathered_forward(const Tensor& out, const Tensor& lse,
                                                     const Tensor& qkv_all, const Tensor& positions,
                                                     int64_t segment, const AttentionShape& s) {
  std::vector<double> o(static_cast<size_t>(out.numel())), l(static_cast<size_t>(lse.numel()));
  ref::attention_gathered_forward(o.data(), l.data(), values(qkv_all).data(),
                                  ids(positions, INT32_MAX, false), positions.numel() / s.seq,
                                  segment, s);
  store(out, o);
  store(lse, l);
}

void ReferenceBackend::do_attention_gathered_backward(const Tensor& dqkv_all, const Tensor& dout,
                                                      const Tensor& out, const Tensor& lse,
                                                      const Tensor& qkv_all,
                                                      const Tensor& positions, int64_t segment,
                                                      const AttentionShape& s) {
  std::vector<double> d(static_cast<size_t>(dqkv_all.numel()));
  ref::attention_gathered_backward(
      d.data(), values(dout).data(), values(out).data(), values(lse).data(), values(qkv_all).data(),
      ids(positions, INT32_MAX, false), positions.numel() / s.seq, segment, s);
  store(dqkv_all, d);
}

void ReferenceBackend::do_attention_decode(const Tensor& out, const Tensor& q, const Tensor& kv,
                                           int64_t pos, const AttentionShape& s) {
  std::vector<double> o(static_cast<size_t>(out.numel()));
  ref::attention_decode(o.data(), values(q).data(), values(kv).data(), pos, s);
  store(out, o);
}

void ReferenceBackend::do_swiglu_forward(const Tensor& out, const Tensor& gate_up) {
  const MatrixDims d = matrix_dims(out);
  std::vector<double> o(static_cast<size_t>(out.numel()));
  ref::swiglu_forward(o.data(), values(gate_up).data(), d.rows, d.cols);
  store(out, o);
}

void ReferenceBackend::do_swiglu_backward(const Tensor& dgate_up, const Tensor& dout,
                                          const Tensor& gate_up) {
  const MatrixDims d = matrix_dims(dout);
  std::vector<double> dgu(static_cast<size_t>(dgate_up.numel()));
  ref::swiglu_backward(dgu.data(), values(dout).data(), values(gate_up).data(), d.rows, d.cols);
  store(dgate_up, dgu);
}

void ReferenceBackend::do_cross_entropy(const Tensor& losses, const Tensor& logits,
                                        const Tensor& targets, const Tensor& dlogits,
                                        float grad_scale) {
  const MatrixDims d = matrix_dims(logits);
  std::vector<double> l(static_cast<size_t>(d.rows));
  // Computed apart from the logits, which dlogits may alias.
  std::vector<double> dl(dlogits.defined() ? static_cast<size_t>(logits.numel()) : 0);
  ref::cross_entropy<double>(l.data(), dlogits.defined() ? dl.data() : nullptr,
                             values(logits).data(), ids(targets, d.cols, true), d.rows, d.cols,
                             grad_scale);
  store(losses, l);
  if (dlogits.defined()) store(dlogits, dl);
}

void ReferenceBackend::do_cross_entropy_shard_stats(const Tensor& stats, const Tensor& logits,
                                                    const Tensor& targets, int64_t first_id) {
  const MatrixDims d = matrix_dims(logits);
  std::vector<double> st(static_cast<size_t>(2 * d.rows));
  ref::cross_entropy_shard_stats<double>(st.data(), values(logits).data(),
                                         ids(targets, INT32_MAX, true), d.rows, d.cols, first_id);
  store(stats, st);
}

void ReferenceBackend::do_cross_entropy_shard(const Tensor& losses, const Tensor& logits,
                                              const Tensor& targets, const Tensor& all_stats,
                                              int64_t first_id, const Tensor& dlogits,
                                              float grad_scale) {
  const MatrixDims d = matrix_dims(logits);
  std::vector<double> l(static_cast<size_t>(d.rows));
  std::vector<double> dl(dlogits.defined() ? static_cast<size_t>(logits.numel()) : 0);
  ref::cross_entropy_shard<double>(l.data(), dlogits.defined() ? dl.data() : nullptr,
                                   values(logits).data(), ids(targets, INT32_MAX, true),
                                   values(all_stats).data(), all_stats.numel() / (2 * d.rows),
                                   d.rows, d.cols, first_id, grad_scale);
  store(losses, l);
  if (dlogits.defined()) store(dlogits, dl);
}

// ---- reductions and optimizer ----

void ReferenceBackend::do_sum(const Tensor& out, const Tensor& x, bool accumulate) {
  std::vector<double> o = values(out);
  ref::sum(o.data(), values(x).data(), x.numel(), accumulate);
  store(out, o);
}

void ReferenceBackend::do_sum_squares(const Tensor& out, const Tensor& x, bool accumulate) {
  std::vector<double> o = values(out);
  ref::sum_squares(o.data(), values(x).data(), x.numel(), accumulate);
  store(out, o);
}

void ReferenceBackend::do_adamw_step(const AdamWArgs& args) {
  std::vector<double> master = values(args.master), m = values(args.exp_avg),
                      v = values(args.exp_avg_sq);
  std::vector<double> params = args.params.defined() ? values(args.params) : std::vector<double>{};
  ref::adamw_step(master.data(), args.params.defined() ? params.data() : nullptr, m.data(),
                  v.data(), values(args.grad).data(), values(args.grad_norm_sq)[0], args.segments,
                  ref::AdamWSettings::from(args));
  store(args.master, master);
  store(args.exp_avg, m);
  store(args.exp_avg_sq, v);
  if (args.params.defined()) store(args.params, params);
}

}  // namespace tessera::test
