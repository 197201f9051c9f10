#include "common/reference_backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tessera/backend/cpu/reference.h"
#include "tessera/core/fp8.h"
#include "tessera/core/split_master.h"
#include "tessera/ops/op_checks.h"

namespace tessera::test {
namespace {

float read_float(const Tensor& t, int64_t i);
void write_float(const Tensor& t, int64_t i, float v);

// The values of an fp32 (or bf16: a gradient or optimizer state kept in bf16) tensor, exactly,
// in double.
std::vector<double> values(const Tensor& t) {
  if (t.dtype == DType::F32) {
    const float* p = t.as<float>();
    return std::vector<double>(p, p + t.numel());
  }
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = read_float(t, i);
  return v;
}

// v rounded to t's dtype into t (bf16: through fp32, as the backends round their fp32 sums).
void store(const Tensor& t, const std::vector<double>& v) {
  for (size_t i = 0; i < v.size(); ++i)
    write_float(t, static_cast<int64_t>(i), static_cast<float>(v[i]));
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

// A K-major FP8 operand's (rows, K) values times the dequantisation scale of each element's
// tensor, tile or block.
std::vector<double> dequantize(const Tensor& q, const Tensor& scale_inv, Fp8Scaling scaling) {
  const MatrixDims d = matrix_dims(q);
  const std::vector<double> s = values(scale_inv);
  const uint8_t* codes = q.as<uint8_t>();
  std::vector<double> v(static_cast<size_t>(q.numel()));
  for (int64_t r = 0; r < d.rows; ++r)
    for (int64_t k = 0; k < d.cols; ++k)
      v[r * d.cols + k] = fp8_bits_to_float(codes[r * d.cols + k], q.dtype) *
                          s[fp8_scale_index(scaling, d.rows, d.cols, r, k)];
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

void ReferenceBackend::do_split_master(const Tensor& high, const Tensor& low,
                                       const Tensor& master) {
  split_master_values(master.as<float>(), high.as<uint16_t>(), low.as<uint16_t>(), master.numel());
}

void ReferenceBackend::do_init_normal(const Tensor& dst, uint64_t seed, uint64_t first_index,
                                      float mean, float std) {
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

// As the model cast its experts before the grouped cast: one fp8_cast_transpose per group
// with rows, on the group's rows, into its row-major rows and its transposed block (with
// offsets, that block's columns of x's transpose).
void ReferenceBackend::do_fp8_grouped_cast(const Fp8GroupedCastArgs& args) {
  const MatrixDims d = matrix_dims(args.x);
  std::vector<int64_t> o;
  if (args.group_rows > 0) {
    for (int64_t r = 0; r <= d.rows; r += args.group_rows) o.push_back(r);
  } else {
    const int32_t* offsets = ids(args.offsets, d.rows + 1, /*allow_negative=*/false);
    o.assign(offsets, offsets + args.offsets.numel());
  }
  for (size_t g = 0; g + 1 < o.size(); ++g) {
    const int64_t begin = o[g], rows = o[g + 1] - begin, n = rows * d.cols;
    TS_CHECK(rows >= 0 && o[g + 1] <= d.rows, "reference backend: group {} rows [{}, {})", g, begin,
             o[g + 1]);
    if (rows == 0) continue;
    auto slot = [g](const Tensor& t) {
      return t.numel() == 1 ? t : t.flat_range(static_cast<int64_t>(g), 1);
    };
    const bool whole_t = args.group_rows == 0 && args.out_t.defined();
    std::vector<uint8_t> block_t(whole_t ? static_cast<size_t>(n) : 0);
    Fp8CastArgs c;
    c.x = args.x.flat_range(begin * d.cols, n).view({rows, d.cols});
    if (args.out.defined()) c.out = args.out.flat_range(begin * d.cols, n).view({rows, d.cols});
    if (whole_t) {
      c.out_t = args.out_t;  // its dtype and device
      c.out_t.data = block_t.data();
      c.out_t.shape = Shape{d.cols, rows};
    } else if (args.out_t.defined()) {
      c.out_t = args.out_t.flat_range(begin * d.cols, n).view({d.cols, rows});
    }
    if (c.out.defined() || c.out_t.defined()) c.scale = slot(args.scale);
    if (args.amax.defined()) c.amax = slot(args.amax);
    do_fp8_cast_transpose(c);
    for (int64_t col = 0; whole_t && col < d.cols; ++col)
      std::copy_n(block_t.data() + col * rows, rows,
                  args.out_t.as<uint8_t>() + col * d.rows + begin);
  }
}

void ReferenceBackend::do_matmul_fp8(const Fp8MatmulArgs& args) {
  const MatrixDims o = matrix_dims(args.out);
  const int64_t K = matrix_dims(args.a).cols;
  std::vector<double> out = gemm_start(args.out, args.c, args.beta);
  const std::vector<double> a = dequantize(args.a, args.a_scale_inv, args.a_scaling);
  const std::vector<double> b = dequantize(args.b, args.b_scale_inv, args.b_scaling);
  const std::vector<double> bias = args.bias.defined() ? values(args.bias) : std::vector<double>{};
  ref::matmul_forward<double>(out.data(), a.data(), b.data(), nullptr,
                              args.bias.defined() ? bias.data() : nullptr, o.rows, o.cols, K, false,
                              true, args.alpha, args.beta);
  store(args.out, out);
}

// The codes and scales are defined in fp32 (core/fp8.h's reference), as for fp8_cast_transpose.
void ReferenceBackend::do_fp8_block_cast(const Fp8BlockCastArgs& args) {
  const MatrixDims d = matrix_dims(args.x);
  const DType format = args.out.defined() ? args.out.dtype : args.out_t.dtype;
  const bool bad =
      fp8_block_cast_reference(args.x.as<float>(), d.rows, d.cols, args.scaling, format,
                               args.out.defined() ? args.out.as<uint8_t>() : nullptr,
                               args.out.defined() ? args.out_scale_inv.as<float>() : nullptr,
                               args.out_t.defined() ? args.out_t.as<uint8_t>() : nullptr,
                               args.out_t.defined() ? args.out_t_scale_inv.as<float>() : nullptr);
  if (bad && args.nonfinite.defined()) store(args.nonfinite, {NAN});
}

void ReferenceBackend::do_fp8_update_scales(const Fp8ScaleUpdateArgs& args) {
  const MatrixDims h = matrix_dims(args.amax_history);
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

void ReferenceBackend::do_attention_forward_cast(const Tensor& out, const Tensor& lse,
                                                 const Tensor& qkv, const AttentionShape& s,
                                                 const Fp8CastArgs& codes) {
  do_attention_forward(out, lse, qkv, s);
  cast_output(out, codes);
}

void ReferenceBackend::do_rmsnorm_forward_cast(const Tensor& out, const Tensor& rstd,
                                               const Tensor& x, const Tensor& weight, float eps,
                                               const Fp8CastArgs& codes) {
  host_rmsnorm_forward_cast(out, rstd, x, weight, eps, codes);
}

void ReferenceBackend::do_rmsnorm_transposed_codes(const Fp8CastArgs& codes, const Tensor& x,
                                                   const Tensor& /*rstd*/, const Tensor& weight,
                                                   float eps) {
  host_rmsnorm_transposed_codes(codes, x, weight, eps);
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
  if (s.fp8) {
    ref::attention_fp8_forward(o.data(), l.data(), values(qkv).data(), s);
  } else {
    ref::attention_forward(o.data(), l.data(), values(qkv).data(), s);
  }
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
                                                     const Tensor& qkv, const Tensor& kv_all,
                                                     const Tensor& positions, int64_t segment,
                                                     const AttentionShape& s) {
  std::vector<double> o(static_cast<size_t>(out.numel())), l(static_cast<size_t>(lse.numel()));
  ref::attention_gathered_forward(o.data(), l.data(), values(qkv).data(), values(kv_all).data(),
                                  ids(positions, INT32_MAX, false), positions.numel() / s.seq,
                                  segment, s);
  store(out, o);
  store(lse, l);
}

void ReferenceBackend::do_attention_gathered_backward(const Tensor& dqkv, const Tensor& dkv_all,
                                                      const Tensor& dout, const Tensor& out,
                                                      const Tensor& lse, const Tensor& qkv,
                                                      const Tensor& kv_all,
                                                      const Tensor& positions, int64_t segment,
                                                      const AttentionShape& s) {
  std::vector<double> dq = values(dqkv), dkv(static_cast<size_t>(dkv_all.numel()));
  ref::attention_gathered_backward(dq.data(), dkv.data(), values(dout).data(), values(out).data(),
                                   values(lse).data(), values(qkv).data(), values(kv_all).data(),
                                   ids(positions, INT32_MAX, false), positions.numel() / s.seq,
                                   segment, s);
  store(dqkv, dq);
  store(dkv_all, dkv);
}

void ReferenceBackend::do_attention_decode(const Tensor& out, const Tensor& q, const Tensor& kv,
                                           const Tensor& positions, int64_t pos,
                                           const AttentionShape& s) {
  std::vector<double> o(static_cast<size_t>(out.numel()));
  ref::attention_decode(o.data(), values(q).data(), values(kv).data(),
                        positions.defined() ? ids(positions, pos + 1, false) : nullptr, pos, s);
  store(out, o);
}

void ReferenceBackend::do_cache_write(const Tensor& cache, const Tensor& src, int64_t src_col,
                                      const Tensor& positions) {
  const int64_t B = cache.dim(0), S = cache.dim(1), W = cache.dim(2);
  const int64_t cols = matrix_dims(src).cols;
  const int32_t* at = ids(positions, S, false);
  std::vector<double> out = values(cache);
  const std::vector<double> in = values(src);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < W; ++j) out[(b * S + at[b]) * W + j] = in[b * cols + src_col + j];
  store(cache, out);
}

void ReferenceBackend::do_mla_qkv_forward(const MlaQkvArgs& a) {
  const int64_t q_stride = matrix_dims(a.q).cols, k_stride = matrix_dims(a.k_rope).cols;
  std::vector<double> o(static_cast<size_t>(a.qkv.numel()));
  ref::mla_qkv_forward(o.data(), values(a.q).data() + a.q_col, q_stride,
                       values(a.k_rope).data() + a.k_col, k_stride, values(a.kv).data(),
                       values(a.freqs).data(), a.s, a.rope_dim, 0, a.s.tokens());
  store(a.qkv, o);
}

// dq and dk_rope keep their other columns: they start from the tensors' own values.
void ReferenceBackend::do_mla_qkv_backward(const MlaQkvArgs& g) {
  const int64_t q_stride = matrix_dims(g.q).cols, k_stride = matrix_dims(g.k_rope).cols;
  std::vector<double> dq = values(g.q), dk = values(g.k_rope);
  std::vector<double> dkv(static_cast<size_t>(g.kv.numel()));
  ref::mla_qkv_backward(dq.data() + g.q_col, q_stride, dk.data() + g.k_col, k_stride, dkv.data(),
                        values(g.qkv).data(), values(g.freqs).data(), g.s, g.rope_dim, 0,
                        g.s.tokens());
  if (g.q.data == g.k_rope.data) {  // one tensor holds both windows: merge them
    for (int64_t n = 0; n < g.s.tokens(); ++n)
      for (int64_t i = 0; i < g.rope_dim; ++i)
        dq[n * k_stride + g.k_col + i] = dk[n * k_stride + g.k_col + i];
  } else {
    store(g.k_rope, dk);
  }
  store(g.q, dq);
  store(g.kv, dkv);
}

void ReferenceBackend::do_copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src,
                                       int64_t src_col, int64_t cols) {
  const MatrixDims d = matrix_dims(dst), r = matrix_dims(src);
  std::vector<double> out = values(dst);
  const std::vector<double> in = values(src);
  for (int64_t n = 0; n < d.rows; ++n)
    for (int64_t j = 0; j < cols; ++j) out[n * d.cols + dst_col + j] = in[n * r.cols + src_col + j];
  store(dst, out);
}

void ReferenceBackend::do_copy_rows(const Tensor& dst, const Tensor& dst_rows, const Tensor& src,
                                    const Tensor& src_rows) {
  const int64_t C = matrix_dims(dst).cols;
  const int64_t count = dst_rows.defined() ? dst_rows.numel() : src_rows.numel();
  std::vector<double> out = values(dst);
  const std::vector<double> in = values(src);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t to = dst_rows.defined() ? dst_rows.as<int32_t>()[i] : i;
    const int64_t from = src_rows.defined() ? src_rows.as<int32_t>()[i] : i;
    std::copy_n(in.begin() + from * C, C, out.begin() + to * C);
  }
  store(dst, out);
}

void ReferenceBackend::do_add(const Tensor& out, const Tensor& a, const Tensor& b) {
  std::vector<double> o(static_cast<size_t>(a.numel()));
  ref::add(o.data(), values(a).data(), values(b).data(), a.numel());
  store(out, o);
}

void ReferenceBackend::do_scale(const Tensor& out, const Tensor& x, float alpha) {
  std::vector<double> o(static_cast<size_t>(x.numel()));
  ref::scale<double>(o.data(), values(x).data(), alpha, x.numel());
  store(out, o);
}

void ReferenceBackend::do_softcap(const Tensor& out, const Tensor& x, float cap) {
  std::vector<double> o(static_cast<size_t>(x.numel()));
  ref::softcap<double>(o.data(), values(x).data(), cap, x.numel());
  store(out, o);
}

void ReferenceBackend::do_softcap_backward(const Tensor& dx, const Tensor& dy, const Tensor& y,
                                           float cap) {
  std::vector<double> d(static_cast<size_t>(y.numel()));
  ref::softcap_backward<double>(d.data(), values(dy).data(), values(y).data(), cap, y.numel());
  store(dx, d);
}

void ReferenceBackend::do_swiglu_forward(const Tensor& out, const Tensor& gate_up) {
  const MatrixDims d = matrix_dims(out);
  std::vector<double> o(static_cast<size_t>(out.numel()));
  ref::swiglu_forward(o.data(), values(gate_up).data(), d.rows, d.cols);
  store(out, o);
}

void ReferenceBackend::do_swiglu_forward_cast(const Tensor& out, const Tensor& gate_up,
                                              const Fp8CastArgs& codes) {
  host_swiglu_forward_cast(out, gate_up, codes);
}

void ReferenceBackend::do_swiglu_backward_cast(const Tensor& dgate_up, const Tensor& dout,
                                               const Tensor& gate_up, const Fp8CastArgs& codes) {
  do_swiglu_backward(dgate_up, dout, gate_up);
  cast_output(dgate_up, codes);
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

void ReferenceBackend::do_log_softmax_gather(const Tensor& logps, const Tensor& lse,
                                             const Tensor& logits, const Tensor& targets) {
  const MatrixDims d = matrix_dims(logits);
  std::vector<double> lp(static_cast<size_t>(d.rows)), l(static_cast<size_t>(d.rows));
  ref::log_softmax_gather<double>(lp.data(), l.data(), values(logits).data(),
                                  ids(targets, d.cols, true), d.rows, d.cols);
  store(logps, lp);
  store(lse, l);
}

void ReferenceBackend::do_sample_tokens(const Tensor& tokens, const Tensor& logps, const Tensor& entropy,
                                        const Tensor& logits, const Tensor& streams, const Tensor& steps,
                                        int64_t vocab, float temperature, float min_p, uint64_t seed) {
  const MatrixDims d = matrix_dims(logits);
  std::vector<double> lp(static_cast<size_t>(d.rows)), h(static_cast<size_t>(d.rows));
  ref::sample_tokens<double>(tokens.as<int32_t>(), lp.data(), h.data(), values(logits).data(),
                             ids(streams, std::numeric_limits<int32_t>::max(), true),
                             ids(steps, std::numeric_limits<int32_t>::max(), false), d.rows, d.cols, vocab,
                             temperature, min_p, seed);
  store(logps, lp);
  store(entropy, h);
}

void ReferenceBackend::do_log_softmax_gather_backward(const Tensor& dlogits, const Tensor& dlogps,
                                                      const Tensor& logits, const Tensor& lse,
                                                      const Tensor& targets) {
  const MatrixDims d = matrix_dims(logits);
  // Computed apart from the logits, which dlogits may alias.
  std::vector<double> dl(static_cast<size_t>(logits.numel()));
  ref::log_softmax_gather_backward<double>(dl.data(), values(dlogps).data(), values(logits).data(),
                                           values(lse).data(), ids(targets, d.cols, true), d.rows,
                                           d.cols);
  store(dlogits, dl);
}

// ---- QK norm and mixture of experts ----

void ReferenceBackend::do_qk_norm_forward(const Tensor& out, const Tensor& rstd, const Tensor& qkv,
                                          const Tensor& q_weight, const Tensor& k_weight,
                                          const AttentionShape& s, float eps) {
  std::vector<double> o(static_cast<size_t>(out.numel())), r(static_cast<size_t>(rstd.numel()));
  ref::qk_norm_forward<double>(o.data(), r.data(), values(qkv).data(), values(q_weight).data(),
                               values(k_weight).data(), s, eps);
  store(out, o);
  store(rstd, r);
}

void ReferenceBackend::do_qk_norm_backward(const Tensor& dqkv, const Tensor& dq_weight,
                                           const Tensor& dk_weight, const Tensor& dout,
                                           const Tensor& qkv, const Tensor& q_weight,
                                           const Tensor& k_weight, const Tensor& rstd,
                                           const AttentionShape& s) {
  std::vector<double> d(static_cast<size_t>(dqkv.numel())), dq = values(dq_weight),
                                                            dk = values(dk_weight);
  ref::qk_norm_backward(d.data(), dq.data(), dk.data(), values(dout).data(), values(qkv).data(),
                        values(q_weight).data(), values(k_weight).data(), values(rstd).data(), s);
  store(dqkv, d);
  store(dq_weight, dq);
  store(dk_weight, dk);
}

void ReferenceBackend::do_moe_router_forward(const Tensor& indices, const Tensor& weights,
                                             const Tensor& logits, const Tensor& bias,
                                             const MoeRouting& r) {
  const int64_t N = matrix_dims(logits).rows;
  std::vector<double> w(static_cast<size_t>(weights.numel()));
  const std::vector<double> b = bias.defined() ? values(bias) : std::vector<double>{};
  TS_CHECK(indices.dtype == DType::I32, "reference backend: indices must be int32");
  ref::moe_router_forward<double>(indices.as<int32_t>(), w.data(), values(logits).data(),
                                  bias.defined() ? b.data() : nullptr, N, r);
  store(weights, w);
}

void ReferenceBackend::do_moe_router_backward(const Tensor& dlogits, const Tensor& dweights,
                                              const Tensor& logits, const Tensor& indices,
                                              const MoeRouting& r) {
  const int64_t N = matrix_dims(logits).rows;
  std::vector<double> d(static_cast<size_t>(dlogits.numel()));
  ref::moe_router_backward<double>(d.data(), values(dweights).data(), values(logits).data(),
                                   ids(indices, r.experts, false), N, r);
  store(dlogits, d);
}

void ReferenceBackend::do_moe_aux_loss(const MoeAuxLossArgs& a) {
  std::vector<double> loss = a.loss.defined() ? values(a.loss) : std::vector<double>{};
  std::vector<double> d = a.dlogits.defined() ? values(a.dlogits) : std::vector<double>{};
  ref::moe_aux_loss<double>(a.loss.defined() ? loss.data() : nullptr,
                            a.dlogits.defined() ? d.data() : nullptr, values(a.logits).data(),
                            ids(a.indices, a.routing.experts, false), matrix_dims(a.logits).rows,
                            a.routing, a.seq, a.grad_scale);
  if (a.loss.defined()) store(a.loss, loss);
  if (a.dlogits.defined()) store(a.dlogits, d);
}

void ReferenceBackend::do_moe_z_loss(const Tensor& loss, const Tensor& dlogits,
                                     const Tensor& logits, float grad_scale) {
  const MatrixDims dims = matrix_dims(logits);
  std::vector<double> l = loss.defined() ? values(loss) : std::vector<double>{};
  std::vector<double> d = dlogits.defined() ? values(dlogits) : std::vector<double>{};
  ref::moe_z_loss<double>(loss.defined() ? l.data() : nullptr,
                          dlogits.defined() ? d.data() : nullptr, values(logits).data(), dims.rows,
                          dims.cols, grad_scale);
  if (loss.defined()) store(loss, l);
  if (dlogits.defined()) store(dlogits, d);
}

void ReferenceBackend::do_moe_expert_counts(const Tensor& counts, const Tensor& indices) {
  std::vector<double> c = values(counts);
  ref::moe_expert_counts(c.data(), ids(indices, counts.numel(), false), indices.numel(),
                         counts.numel());
  store(counts, c);
}

void ReferenceBackend::do_moe_expert_bias_update(const Tensor& bias, const Tensor& counts,
                                                 float rate) {
  std::vector<double> b = values(bias);
  ref::moe_expert_bias_update(b.data(), values(counts).data(), bias.numel(),
                              static_cast<double>(rate));
  store(bias, b);
}

void ReferenceBackend::do_moe_permute(const Tensor& xp, const Tensor& rows, const Tensor& offsets,
                                      const Tensor& x, const Tensor& indices, int64_t align,
                                      const MoeCapacity& capacity) {
  const int64_t E = offsets.numel() - 1;
  const MatrixDims xd = matrix_dims(x), pd = matrix_dims(xp);
  const int64_t K = matrix_dims(indices).cols;
  TS_CHECK(rows.dtype == DType::I32 && offsets.dtype == DType::I32,
           "reference backend: rows and offsets must be int32");
  const int32_t* experts = ids(indices, E, false);
  std::vector<char> keep;
  if (capacity.capacity > 0) {
    const std::vector<double> w =
        capacity.by_position ? std::vector<double>{} : values(capacity.weights);
    keep = ref::moe_capacity_keep(experts, w.data(), xd.rows, K, E, capacity.capacity,
                                  capacity.by_position);
    if (capacity.dropped.defined())
      store(capacity.dropped, {static_cast<double>(std::count(keep.begin(), keep.end(), 0))});
  }
  ref::moe_dispatch_plan(rows.as<int32_t>(), offsets.as<int32_t>(), experts, xd.rows, K, E, align,
                         keep.empty() ? nullptr : keep.data());
  std::vector<double> out(static_cast<size_t>(xp.numel()));
  ref::moe_permute(out.data(), pd.rows, values(x).data(), rows.as<int32_t>(), xd.rows, K, xd.cols);
  store(xp, out);
}

void ReferenceBackend::do_moe_permute_backward(const Tensor& dx, const Tensor& dxp,
                                               const Tensor& rows) {
  const MatrixDims xd = matrix_dims(dx);
  std::vector<double> d = values(dx);
  ref::moe_permute_backward(d.data(), values(dxp).data(), ids(rows, matrix_dims(dxp).rows, true),
                            xd.rows, matrix_dims(rows).cols, xd.cols);
  store(dx, d);
}

void ReferenceBackend::do_moe_unpermute(const Tensor& out, const Tensor& yp, const Tensor& rows,
                                        const Tensor& weights) {
  const MatrixDims od = matrix_dims(out);
  std::vector<double> o = values(out);
  ref::moe_unpermute(o.data(), values(yp).data(), ids(rows, matrix_dims(yp).rows, true),
                     values(weights).data(), od.rows, matrix_dims(rows).cols, od.cols);
  store(out, o);
}

void ReferenceBackend::do_moe_unpermute_backward(const Tensor& dyp, const Tensor& dweights,
                                                 const Tensor& dout, const Tensor& yp,
                                                 const Tensor& rows, const Tensor& weights) {
  const MatrixDims od = matrix_dims(dout), pd = matrix_dims(yp);
  std::vector<double> d(static_cast<size_t>(dyp.numel())),
      dw(static_cast<size_t>(dweights.numel()));
  ref::moe_unpermute_backward(d.data(), pd.rows, dw.data(), values(dout).data(), values(yp).data(),
                              ids(rows, pd.rows, true), values(weights).data(), od.rows,
                              matrix_dims(rows).cols, od.cols);
  store(dyp, d);
  store(dweights, dw);
}

void ReferenceBackend::do_grouped_matmul(const GroupedMatmulArgs& a) {
  const MatrixDims o = matrix_dims(a.out);
  const int64_t G = a.offsets.numel() - 1, K = matrix_dims(a.a).cols;
  std::vector<double> out(static_cast<size_t>(a.out.numel()));
  ref::grouped_matmul(out.data(), values(a.a).data(), values(a.b).data(),
                      ids(a.offsets, o.rows + 1, false), G, o.rows, o.cols, K, a.trans_b,
                      a.group_weights.empty() ? nullptr : a.group_weights.data());
  store(a.out, out);
}

void ReferenceBackend::do_grouped_matmul_wgrad(const GroupedMatmulWgradArgs& a) {
  std::vector<double> out =
      a.beta == 0.0f ? std::vector<double>(static_cast<size_t>(a.out.numel())) : values(a.out);
  ref::grouped_matmul_wgrad(out.data(), values(a.a).data(), values(a.b).data(),
                            ids(a.offsets, matrix_dims(a.a).rows + 1, false), a.offsets.numel() - 1,
                            a.out.dim(1), a.out.dim(2), static_cast<double>(a.beta), a.out.dim(0),
                            a.group_weights.empty() ? nullptr : a.group_weights.data());
  store(a.out, out);
}

// The FP8 grouped GEMMs: the bf16 ones' reference over the dequantised operands, each weight
// with its own scale; the wgrad's transposed operands are first put back as rows.
void ReferenceBackend::do_grouped_matmul_fp8(const GroupedFp8MatmulArgs& a) {
  const MatrixDims o = matrix_dims(a.out);
  const int64_t W = a.b.dim(0), N = a.b.dim(1), K = a.b.dim(2);
  const int64_t G = a.offsets.numel() - 1;
  const std::vector<double> x = dequantize(a.a, a.a_scale_inv, Fp8Scaling::Tensor);
  std::vector<double> w(static_cast<size_t>(W * N * K));
  for (int64_t e = 0; e < W; ++e) {
    const std::vector<double> we = dequantize(a.b.flat_range(e * N * K, N * K).view({N, K}),
                                              a.b_scale_inv.flat_range(e, 1), Fp8Scaling::Tensor);
    std::copy(we.begin(), we.end(), w.begin() + e * N * K);
  }
  std::vector<double> out(static_cast<size_t>(a.out.numel()));
  ref::grouped_matmul(out.data(), x.data(), w.data(), ids(a.offsets, o.rows + 1, false), G, o.rows,
                      N, K, /*trans_b=*/true,
                      a.group_weights.empty() ? nullptr : a.group_weights.data());
  store(a.out, out);
}

void ReferenceBackend::do_grouped_matmul_fp8_wgrad(const GroupedFp8MatmulWgradArgs& a) {
  const int64_t M = a.out.dim(1), N = a.out.dim(2), R = matrix_dims(a.a_t).cols;
  const int64_t G = a.offsets.numel() - 1;
  const int32_t* offsets = ids(a.offsets, R + 1, false);
  // The groups' rows; the rest stay zero (their codes are whatever the buffers held).
  auto rows_of = [&](const Tensor& t, const Tensor& scale_inv, int64_t cols) {
    const std::vector<double> v = dequantize(t, scale_inv, Fp8Scaling::Tensor);
    std::vector<double> rows(v.size(), 0.0);
    for (int64_t r = offsets[0]; r < offsets[G]; ++r)
      for (int64_t c = 0; c < cols; ++c) rows[r * cols + c] = v[c * R + r];
    return rows;
  };
  std::vector<double> out =
      a.beta == 0.0f ? std::vector<double>(static_cast<size_t>(a.out.numel())) : values(a.out);
  ref::grouped_matmul_wgrad(out.data(), rows_of(a.a_t, a.a_scale_inv, M).data(),
                            rows_of(a.b_t, a.b_scale_inv, N).data(), offsets, G, M, N,
                            static_cast<double>(a.beta), a.out.dim(0),
                            a.group_weights.empty() ? nullptr : a.group_weights.data());
  store(a.out, out);
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

// The state in double whatever its storage; each tensor is rounded once to its dtype (fp32 or
// bf16) at the end, as the op's contract says.
// A split master is joined into fp32 values first and its result split again after rounding
// to fp32.
void ReferenceBackend::do_adamw_step(const AdamWArgs& args) {
  const bool has_master = args.master.defined();
  const bool split = has_master && args.master.dtype == DType::U16;
  const Tensor& updated = has_master ? args.master : args.params;
  const bool copy =
      has_master && !split && args.params.defined() && args.params.data != args.master.data;
  std::vector<double> master;
  std::vector<float> joined(split ? static_cast<size_t>(updated.numel()) : 0);
  if (split) {
    join_master_values(args.params.as<uint16_t>(), args.master.as<uint16_t>(), joined.data(),
                       updated.numel());
    master.assign(joined.begin(), joined.end());
  } else {
    master = values(updated);
  }
  std::vector<double> m = values(args.exp_avg), v = values(args.exp_avg_sq);
  std::vector<double> params = copy ? values(args.params) : std::vector<double>{};
  ref::adamw_step(master.data(), copy ? params.data() : nullptr, m.data(), v.data(),
                  values(args.grad).data(), values(args.grad_norm_sq)[0], args.segments,
                  ref::AdamWSettings::from(args));
  if (split) {
    joined.assign(master.begin(), master.end());  // each rounded once to fp32
    split_master_values(joined.data(), args.params.as<uint16_t>(), args.master.as<uint16_t>(),
                        updated.numel());
  } else {
    store(updated, master);
  }
  store(args.exp_avg, m);
  store(args.exp_avg_sq, v);
  if (copy) store(args.params, params);
}

}  // namespace tessera::test
