#include "tessera/model/blocks/mla_attention.h"

#include <algorithm>

#include "tessera/core/error.h"
#include "tessera/model/rope.h"

namespace tessera {

MlaAttention::MlaAttention(const ModelSpec& spec) : s_(spec) {
  const MlaSpec& m = spec.mla;
  TS_CHECK(m.enabled && m.kv_lora_rank > 0 && m.rope_dim > 0 && m.rope_dim % 2 == 0 &&
               m.qk_head_dim > 0 && m.v_head_dim > 0 && spec.head_dim == m.rope_dim,
           "multi-latent attention needs kv_lora_rank, an even rope dim (the spec's head_dim) and "
           "positive head dims, got kv_lora_rank {}, rope {}, head_dim {}, qk {}, v {}",
           m.kv_lora_rank, m.rope_dim, spec.head_dim, m.qk_head_dim, m.v_head_dim);
  lora_ = m.q_lora_rank > 0;
  H_ = spec.heads;
  Dn_ = m.qk_head_dim;
  Dr_ = m.rope_dim;
  D_ = m.qk_dim();
  Dv_ = m.v_head_dim;
  Qr_ = m.q_lora_rank;
  Kr_ = m.kv_lora_rank;
  Qa_ = lora_ ? Qr_ : H_ * D_;
}

void MlaAttention::declare_params(ParamLayoutBuilder& b) {
  const int64_t C = s_.hidden;
  // Hugging Face's q_a_proj (or q_proj) and kv_a_proj_with_mqa, stacked.
  a_proj_ = b.add("self_attn.q_kv_a_proj.weight", {fused_width(), C}, ParamInit::Normal, true,
                  TensorParallelStyle::Replicated, {Qa_, Kr_ + Dr_});
  if (lora_) {
    q_a_norm_ = b.add("self_attn.q_a_layernorm.weight", {Qr_}, ParamInit::Ones, false);
    q_b_proj_ = b.add("self_attn.q_b_proj.weight", {H_ * D_, Qr_}, ParamInit::Normal, true);
  }
  kv_a_norm_ = b.add("self_attn.kv_a_layernorm.weight", {Kr_}, ParamInit::Ones, false);
  kv_b_proj_ =
      b.add("self_attn.kv_b_proj.weight", {H_ * (Dn_ + Dv_), Kr_}, ParamInit::Normal, true);
  o_proj_ = b.add("self_attn.o_proj.weight", {C, H_ * Dv_}, ParamInit::ScaledNormal, true);
}

std::vector<int> MlaAttention::linear_weights() const {
  if (lora_) return {a_proj_, q_b_proj_, kv_b_proj_, o_proj_};
  return {a_proj_, kv_b_proj_, o_proj_};
}

void MlaAttention::declare_activations(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t N = rt.tokens();
  const DType dt = rt.compute_dtype;
  const AttentionShape a = shape(rt.micro_batch, rt.seq_length);
  if (lora_) {
    plan.add(&q_a_, dt, {N, Qr_});
    plan.add(&q_a_ln_, dt, {N, Qr_}, Keep::Recomputable);
    plan.add(&q_rstd_, DType::F32, {N});
  }
  plan.add(&c_kv_, dt, {N, Kr_});
  plan.add(&c_kv_ln_, dt, {N, Kr_}, Keep::Recomputable);
  plan.add(&kv_rstd_, DType::F32, {N});
  plan.add(&qkv_, dt, {N, a.qkv_width()});
  plan.add(&att_, dt, {N, a.out_width()});
  plan.add(&lse_, DType::F32, {rt.micro_batch, H_, rt.seq_length});
}

void MlaAttention::declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t N = rt.tokens();
  const DType dt = rt.compute_dtype;
  const AttentionShape a = shape(rt.micro_batch, rt.seq_length);
  plan.add(&datt_, dt, {N, a.out_width()});
  plan.add(&dqkv_, dt, {N, a.qkv_width()});
  plan.add(&dkv_, dt, {N, H_ * (Dn_ + Dv_)});
  plan.add(&da_, dt, {N, fused_width()});
  if (lora_) {
    plan.add(&dq_, dt, {N, H_ * D_});
    plan.add(&dq_a_ln_, dt, {N, Qr_});
    plan.add(&dq_a_, dt, {N, Qr_});
  }
  plan.add(&dc_kv_ln_, dt, {N, Kr_});
  plan.add(&dc_kv_, dt, {N, Kr_});
}

AttentionShape MlaAttention::shape(int64_t batch, int64_t seq) const {
  AttentionShape a;
  a.batch = batch;
  a.seq = seq;
  a.heads = a.kv_heads = H_;
  a.head_dim = D_;
  a.v_head_dim = Dv_;
  a.causal = true;
  a.window = s_.sliding_window;
  a.scale = static_cast<float>(mla_softmax_scale(s_));
  return a;
}

// The latents are sliced out of a before their norms (the norm ops take whole rows); q_a's norm
// output is used up by q_b_proj before c_kv's is written, since under selective recompute the two
// (and the block's normed input) share one buffer.
void MlaAttention::pack_qkv(ForwardOps& ops, const Pass& t, const Tensor& freqs,
                            const AttentionShape& a) {
  Backend& b = ops.backend();
  ops.linear(t.a, t.ln, a_proj_, -1);
  b.copy_columns(t.c_kv, 0, t.a, Qa_, Kr_);
  if (lora_) {
    b.copy_columns(t.q_a, 0, t.a, 0, Qr_);
    b.rmsnorm_forward(t.q_a_ln, t.q_rstd, t.q_a, ops.param(q_a_norm_), s_.norm_eps);
    ops.linear(t.q, t.q_a_ln, q_b_proj_, -1);
  }
  b.rmsnorm_forward(t.c_kv_ln, t.kv_rstd, t.c_kv, ops.param(kv_a_norm_), s_.norm_eps);
  ops.linear(t.kv, t.c_kv_ln, kv_b_proj_, -1);
  MlaQkvArgs p;
  p.qkv = t.qkv;
  p.q = lora_ ? t.q : t.a;  // without q_lora_rank the queries are a's first columns
  p.k_rope = t.a;
  p.k_col = Qa_ + Kr_;
  p.kv = t.kv;
  p.freqs = freqs;
  p.s = a;
  p.rope_dim = Dr_;
  b.mla_qkv_forward(p);
}

void MlaAttention::forward_inner(LayerOps& ops, const LinearOperand& in) {
  const AttentionShape a = shape(ops.runtime().micro_batch, ops.runtime().seq_length);
  Pass t;
  t.ln = in.x, t.a = da_, t.q_a = q_a_, t.q_a_ln = q_a_ln_, t.q_rstd = q_rstd_, t.q = dq_;
  t.c_kv = c_kv_, t.c_kv_ln = c_kv_ln_, t.kv_rstd = kv_rstd_, t.kv = dkv_, t.qkv = qkv_;
  pack_qkv(ops, t, ops.rope_table(), a);
  ops.attention_forward(att_, lse_, qkv_, a, {});
}

void MlaAttention::forward_output(LayerOps& ops, const Tensor& out, const Tensor& residual) {
  ops.linear(out, att_, o_proj_, -1, residual);
}

void MlaAttention::backward(LayerOps& ops, const LinearOperand& in, const Tensor& dout,
                            const Tensor& din, const std::function<void()>& recompute_in) {
  Backend& b = ops.backend();
  const ModelRuntime& rt = ops.runtime();
  const bool selective = rt.recompute == RecomputeGranularity::Selective;
  const AttentionShape a = shape(rt.micro_batch, rt.seq_length);
  ops.linear_backward(datt_, dout, att_, o_proj_, -1);
  ops.attention_backward(dqkv_, datt_, att_, lse_, qkv_, a);
  // d(qkv) -> the queries' (in dq, or a's first columns), the rope key's (a's last columns) and
  // kv's gradients; c_kv's columns of da follow from its norm below.
  MlaQkvArgs g;
  g.qkv = dqkv_;
  g.q = lora_ ? dq_ : da_;
  g.k_rope = da_;
  g.k_col = Qa_ + Kr_;
  g.kv = dkv_;
  g.freqs = ops.rope_table();
  g.s = a;
  g.rope_dim = Dr_;
  b.mla_qkv_backward(g);
  // The key/value latent: its up-projection, then its norm (whose dx accumulates).
  if (selective) {
    ScopedRange r(b, "recompute");  // a trace's step breakdown counts it as recompute
    b.rmsnorm_forward(c_kv_ln_, kv_rstd_, c_kv_, ops.param(kv_a_norm_), s_.norm_eps);
  }
  ops.linear_backward(dc_kv_ln_, dkv_, c_kv_ln_, kv_b_proj_, -1);
  b.fill(dc_kv_, 0.0f);
  b.rmsnorm_backward(dc_kv_, ops.grad(kv_a_norm_), dc_kv_ln_, c_kv_, ops.param(kv_a_norm_),
                     kv_rstd_);
  b.copy_columns(da_, Qa_, dc_kv_, 0, Kr_);
  if (lora_) {  // the query latent likewise
    if (selective) {
      ScopedRange r(b, "recompute");
      b.rmsnorm_forward(q_a_ln_, q_rstd_, q_a_, ops.param(q_a_norm_), s_.norm_eps);
    }
    ops.linear_backward(dq_a_ln_, dq_, q_a_ln_, q_b_proj_, -1);
    b.fill(dq_a_, 0.0f);
    b.rmsnorm_backward(dq_a_, ops.grad(q_a_norm_), dq_a_ln_, q_a_, ops.param(q_a_norm_), q_rstd_);
    b.copy_columns(da_, 0, dq_a_, 0, Qr_);
  }
  recompute_in();
  ops.linear_backward(din, da_, in, a_proj_, -1);
}

size_t MlaAttention::cached_scratch_bytes(int64_t n, DType dtype) const {
  const size_t e = dtype_size(dtype);
  const AttentionShape a = shape(1, n);
  auto act = [&](int64_t cols) { return ScratchArena::aligned(n * cols * e); };
  const size_t stats = ScratchArena::aligned(n * 4);
  // The last act(H D): a batch's queries, gathered for attention_decode.
  size_t bytes = act(fused_width()) + act(Kr_) * 2 + stats + act(H_ * (Dn_ + Dv_)) +
                 act(a.qkv_width()) + act(a.out_width()) + ScratchArena::aligned(H_ * n * 4) + act(H_ * D_);
  if (lora_) bytes += act(Qr_) * 2 + stats + act(H_ * D_);
  return bytes;
}

// A prompt attends within itself (attention_forward over its own qkv); one new token attends to
// the cache. Both write every position's key and value heads into the cache first: they are
// qkv's columns after the queries, in the cache's layout. A batch's tokens (one per sequence,
// each at its own position) are packed as one run of tokens, row b of the rotary rows being
// token b's position, then each attends to its own sequence's cache.
void MlaAttention::forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& in,
                                  const Tensor& out, const Tensor& residual, const Tensor& cache,
                                  const CachePosition& at) {
  Backend& b = ops.backend();
  const int64_t pos = at.pos;
  const bool batch = cache.shape.rank() == 3;
  const int64_t n = in.dim(0), B = batch ? cache.dim(0) : 1, S = cache.dim(batch ? 1 : 0), row = cache_width();
  const DType dt = in.dtype;
  TS_CHECK(batch ? n == B && at.positions.defined() && at.rope : pos == 0 || n == 1,
           "generation: {} tokens at position {} (a prompt, one token, or one per sequence of a batch)", n, pos);
  TS_CHECK(pos + (batch ? 1 : n) <= S, "generation: positions up to {} in a cache of {}", pos + (batch ? 1 : n), S);
  const AttentionShape a = shape(1, n);
  Pass t;
  t.ln = in;
  t.a = scratch.take(dt, {n, fused_width()});
  if (lora_) {
    t.q_a = scratch.take(dt, {n, Qr_});
    t.q_a_ln = scratch.take(dt, {n, Qr_});
    t.q_rstd = scratch.take(DType::F32, {n});
    t.q = scratch.take(dt, {n, H_ * D_});
  }
  t.c_kv = scratch.take(dt, {n, Kr_});
  t.c_kv_ln = scratch.take(dt, {n, Kr_});
  t.kv_rstd = scratch.take(DType::F32, {n});
  t.kv = scratch.take(dt, {n, H_ * (Dn_ + Dv_)});
  t.qkv = scratch.take(dt, {n, a.qkv_width()});
  const Tensor att = scratch.take(dt, {n, a.out_width()});
  if (batch) {
    pack_qkv(ops, t, at.rope->at(0).rows(0, B), a);
    b.cache_write(cache, t.qkv, H_ * D_, at.positions);
    const Tensor q = scratch.take(dt, {B, H_ * D_});
    b.copy_columns(q, 0, t.qkv, 0, H_ * D_);
    b.attention_decode(att, q, cache, at.positions, pos, shape(B, S));
    ops.linear(out, att, o_proj_, -1, residual);
    return;
  }
  // Row t of the table slice is position pos + t.
  pack_qkv(ops, t, ops.rope_table().rows(pos, pos + n), a);
  b.copy_columns(cache.rows(pos, pos + n), 0, t.qkv, H_ * D_, row);
  if (pos == 0) {
    const Tensor lse = scratch.take(DType::F32, {1, H_, n});
    b.attention_forward(att, lse, t.qkv, a);
  } else {
    b.attention_decode(att, t.qkv.flat_range(0, H_ * D_).view({1, H_ * D_}),
                       cache.view({1, S, row}), {}, pos, shape(1, S));
  }
  ops.linear(out, att, o_proj_, -1, residual);
}

// The fused down-projection, the query and key/value up-projections, o_proj.
std::vector<LinearGemm> MlaAttention::linear_gemms() const {
  const int64_t C = s_.hidden;
  std::vector<LinearGemm> g{{.name = "q_kv_a", .out_features = fused_width(), .in_features = C}};
  if (lora_) g.push_back({.name = "q_b", .out_features = H_ * D_, .in_features = Qr_});
  g.push_back({.name = "kv_b", .out_features = H_ * (Dn_ + Dv_), .in_features = Kr_});
  g.push_back({.name = "o_proj", .out_features = C, .in_features = H_ * Dv_, .residual = true});
  return g;
}

// The GQA convention (12 s d per layer: 2 s d for the scores and 2 s d for the values per
// token, forward and backward) with the scores over D and the values over Dv.
double MlaAttention::attention_flops_per_token(int64_t seq_length) const {
  const int64_t s_eff =
      s_.sliding_window > 0 ? std::min(seq_length, s_.sliding_window) : seq_length;
  return 6.0 * static_cast<double>(s_eff) * static_cast<double>(H_ * (D_ + Dv_));
}

}  // namespace tessera
