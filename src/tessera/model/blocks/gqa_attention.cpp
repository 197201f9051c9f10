#include "tessera/model/blocks/gqa_attention.h"

#include <algorithm>
#include <cmath>

#include "tessera/core/error.h"

namespace tessera {

AttentionOptions default_attention(const ModelSpec& spec) {
  AttentionOptions o;
  o.window = spec.sliding_window;
  o.qk_norm = spec.qk_norm ? QkNorm::PerHead : QkNorm::None;
  return o;
}

GqaAttention::GqaAttention(const ModelSpec& spec, AttentionOptions options)
    : s_(spec), o_(options) {}

void GqaAttention::declare_params(ParamLayoutBuilder& b) {
  const int64_t C = s_.hidden, q = s_.heads * s_.head_dim, kv = s_.kv_heads * s_.head_dim;
  qkv_weight_ = b.add("self_attn.qkv_proj.weight", {s_.qkv_width(), C}, ParamInit::Normal, true,
                      TensorParallelStyle::Column, {q, kv, kv});
  if (s_.qkv_bias)
    qkv_bias_ = b.add("self_attn.qkv_proj.bias", {s_.qkv_width()}, ParamInit::Zeros, false,
                      TensorParallelStyle::Column, {q, kv, kv});
  o_proj_ = b.add("self_attn.o_proj.weight", {C, s_.attn_width()}, ParamInit::ScaledNormal, true,
                  TensorParallelStyle::Row);
  const bool whole = o_.qk_norm == QkNorm::Whole;
  if (o_.qk_norm != QkNorm::None) {
    q_norm_ = b.add("self_attn.q_norm.weight", {whole ? q : s_.head_dim}, ParamInit::Ones, false);
    k_norm_ = b.add("self_attn.k_norm.weight", {whole ? kv : s_.head_dim}, ParamInit::Ones, false);
  }
}

void GqaAttention::declare_activations(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t N = rt.tokens();
  const DType dt = rt.compute_dtype;
  plan.add(&qkv_, dt, {N, s_.qkv_width()});
  plan.add(&att_, dt, {N, s_.attn_width()});
  plan.add(&lse_, DType::F32, {rt.attention_batch(), s_.heads, rt.attention_seq()});
  if (o_.qk_norm == QkNorm::None) return;
  plan.add(&qk_.raw, dt, {N, s_.qkv_width()});
  if (o_.qk_norm == QkNorm::PerHead) {
    plan.add(&qk_.rstd, DType::F32, {N, s_.heads + s_.kv_heads});
    return;
  }
  plan.add(&qk_.q, dt, {N, s_.attn_width()});
  plan.add(&qk_.k, dt, {N, s_.kv_heads * s_.head_dim});
  plan.add(&qk_.q_rstd, DType::F32, {N});
  plan.add(&qk_.k_rstd, DType::F32, {N});
  plan.add(&qk_.normed, dt, {N, s_.attn_width()}, Keep::Shared);
}

void GqaAttention::declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t N = rt.tokens();
  plan.add(&datt_, rt.compute_dtype, {N, s_.attn_width()});
  plan.add(&dqkv_, rt.compute_dtype, {N, s_.qkv_width()});
  if (o_.qk_norm != QkNorm::Whole) return;
  plan.add(&dq_, rt.compute_dtype, {N, s_.attn_width()});
  plan.add(&dk_, rt.compute_dtype, {N, s_.kv_heads * s_.head_dim});
  plan.add(&dnormed_, rt.compute_dtype, {N, s_.attn_width()});
}

AttentionShape GqaAttention::shape(int64_t batch, int64_t seq) const {
  AttentionShape a;
  a.batch = batch;
  a.seq = seq;
  a.heads = s_.heads;
  a.kv_heads = s_.kv_heads;
  a.head_dim = s_.head_dim;
  a.causal = true;
  a.window = o_.window;
  a.scale = 1.0f / std::sqrt(static_cast<float>(s_.head_dim));
  return a;
}

std::vector<double> GqaAttention::rope_bases() const {
  if (!o_.rope) return {};
  return {o_.rope_base};
}

// Whole-q/k norms take contiguous rows: q's and k's columns are copied out of the projection,
// normed, and the outputs copied into qkv (v's columns are copied as they are).
void GqaAttention::qk_norm_forward(ForwardOps& ops, const QkTensors& t, const Tensor& qkv,
                                   const AttentionShape& a) const {
  Backend& b = ops.backend();
  if (o_.qk_norm == QkNorm::PerHead) {
    b.qk_norm_forward(qkv, t.rstd, t.raw, ops.param(q_norm_), ops.param(k_norm_), a, s_.norm_eps);
    return;
  }
  const int64_t q = s_.attn_width(), kv = s_.kv_heads * s_.head_dim;
  const Tensor k_normed = t.normed.flat_range(0, t.k.numel()).view(t.k.shape);
  b.copy_columns(t.q, 0, t.raw, 0, q);
  b.copy_columns(t.k, 0, t.raw, q, kv);
  b.copy_columns(qkv, q + kv, t.raw, q + kv, kv);
  b.rmsnorm_forward(t.normed, t.q_rstd, t.q, ops.param(q_norm_), s_.norm_eps);
  b.copy_columns(qkv, 0, t.normed, 0, q);
  b.rmsnorm_forward(k_normed, t.k_rstd, t.k, ops.param(k_norm_), s_.norm_eps);
  b.copy_columns(qkv, q, k_normed, 0, kv);
}

void GqaAttention::forward_inner(LayerOps& ops, const LinearOperand& in) {
  Backend& b = ops.backend();
  AttentionShape a = shape(ops.runtime().micro_batch, ops.runtime().seq_length);
  a.rope_per_token = ops.runtime().reset_position_ids;
  if (o_.qk_norm != QkNorm::None) {
    ops.linear(qk_.raw, in, qkv_weight_, qkv_bias_);
    qk_norm_forward(ops, qk_, qkv_, a);
  } else {
    ops.linear(qkv_, in, qkv_weight_, qkv_bias_);
  }
  if (o_.rope) b.rope_forward(qkv_, ops.rope_table(o_.rope_base), a);
  ops.attention_forward(att_, lse_, qkv_, a, ops.linear_input_cast(o_proj_, att_.dim(0)));
}

// The output projection reads the codes attention wrote, next, before any other FP8 cast.
void GqaAttention::forward_output(LayerOps& ops, const Tensor& out, const Tensor& residual) {
  const bool cast = ops.linear_input_cast(o_proj_, att_.dim(0)).out.defined();
  ops.linear(out, cast ? LinearOperand::with_codes(att_) : LinearOperand(att_), o_proj_, -1,
             residual);
}

void GqaAttention::backward(LayerOps& ops, const LinearOperand& in, const Tensor& dout,
                            const Tensor& din, const std::function<void()>& recompute_in) {
  Backend& b = ops.backend();
  AttentionShape a = shape(ops.runtime().micro_batch, ops.runtime().seq_length);
  a.rope_per_token = ops.runtime().reset_position_ids;
  ops.linear_backward(datt_, dout, att_, o_proj_, -1);
  ops.attention_backward(dqkv_, datt_, att_, lse_, qkv_, a);
  if (o_.rope) b.rope_backward(dqkv_, ops.rope_table(o_.rope_base), a);
  if (o_.qk_norm == QkNorm::PerHead) {
    b.qk_norm_backward(dqkv_, ops.grad(q_norm_), ops.grad(k_norm_), dqkv_, qk_.raw,
                       ops.param(q_norm_), ops.param(k_norm_), qk_.rstd, a);
  } else if (o_.qk_norm == QkNorm::Whole) {
    // d(normed q) out of dqkv, through the norm, back in; likewise k (v's part stays).
    const int64_t q = s_.attn_width(), kv = s_.kv_heads * s_.head_dim;
    const Tensor dk_normed = dnormed_.flat_range(0, dk_.numel()).view(dk_.shape);
    b.copy_columns(dnormed_, 0, dqkv_, 0, q);
    b.fill(dq_, 0.0f);
    b.rmsnorm_backward(dq_, ops.grad(q_norm_), dnormed_, qk_.q, ops.param(q_norm_), qk_.q_rstd);
    b.copy_columns(dqkv_, 0, dq_, 0, q);
    b.copy_columns(dk_normed, 0, dqkv_, q, kv);
    b.fill(dk_, 0.0f);
    b.rmsnorm_backward(dk_, ops.grad(k_norm_), dk_normed, qk_.k, ops.param(k_norm_), qk_.k_rstd);
    b.copy_columns(dqkv_, q, dk_, 0, kv);
  }
  recompute_in();
  ops.linear_backward(din, dqkv_, in, qkv_weight_, qkv_bias_);
}

GqaAttention::QkTensors GqaAttention::qk_scratch(ScratchArena& scratch, int64_t n,
                                                 DType dtype) const {
  QkTensors t;
  t.raw = scratch.take(dtype, {n, s_.qkv_width()});
  if (o_.qk_norm == QkNorm::PerHead) {
    t.rstd = scratch.take(DType::F32, {n, s_.heads + s_.kv_heads});
    return t;
  }
  t.q = scratch.take(dtype, {n, s_.attn_width()});
  t.k = scratch.take(dtype, {n, s_.kv_heads * s_.head_dim});
  t.q_rstd = scratch.take(DType::F32, {n});
  t.k_rstd = scratch.take(DType::F32, {n});
  t.normed = scratch.take(dtype, {n, s_.attn_width()});
  return t;
}

size_t GqaAttention::cached_scratch_bytes(int64_t n, DType dtype) const {
  const size_t e = dtype_size(dtype);
  auto act = [&](int64_t cols) { return ScratchArena::aligned(n * cols * e); };
  const size_t stats = ScratchArena::aligned(n * 4);
  size_t qk = 0;
  if (o_.qk_norm == QkNorm::PerHead)
    qk = act(s_.qkv_width()) + ScratchArena::aligned(n * (s_.heads + s_.kv_heads) * 4);
  if (o_.qk_norm == QkNorm::Whole)
    qk =
        act(s_.qkv_width()) + 2 * act(s_.attn_width()) + act(s_.kv_heads * s_.head_dim) + 2 * stats;
  // Another attn_width per row: a batch's queries, gathered for attention_decode.
  return act(s_.qkv_width()) + 2 * act(s_.attn_width()) + ScratchArena::aligned(s_.heads * n * 4) + qk;
}

// A prompt attends within itself (attention_forward over its own q, k and v); one new token
// attends to the cache. Both write every position's keys and values into the cache first.
void GqaAttention::forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& in,
                                  const Tensor& out, const Tensor& residual, const Tensor& cache,
                                  const CachePosition& at) {
  Backend& b = ops.backend();
  const int64_t n = in.dim(0), width = s_.qkv_width(), q_width = s_.attn_width(), pos = at.pos;
  const bool batch = cache.shape.rank() == 3;  // a batch of sequences, one token each
  const int64_t B = batch ? cache.dim(0) : 1, S = cache.dim(batch ? 1 : 0), row = cache_width();
  const DType dt = in.dtype;
  TS_CHECK(batch ? n == B && at.positions.defined() && at.rope : pos == 0 || n == 1,
           "generation: {} tokens at position {} (a prompt, one token, or one per sequence of a batch)", n, pos);
  const int64_t positions = batch ? 1 : n;  // a batch's tokens are one position of each sequence
  TS_CHECK(pos + positions <= S, "generation: positions up to {} in a cache of {}", pos + positions, S);
  const Tensor qkv = scratch.take(dt, {n, width});
  const Tensor att = scratch.take(dt, {n, q_width});
  if (o_.qk_norm != QkNorm::None) {
    const QkTensors t = qk_scratch(scratch, n, dt);
    ops.linear(t.raw, in, qkv_weight_, qkv_bias_);
    qk_norm_forward(ops, t, qkv, shape(1, n));
  } else {
    ops.linear(qkv, in, qkv_weight_, qkv_bias_);
  }
  if (batch) {
    // Every sequence's token at its own position: its key and value heads into its cache
    // there, its query heads gathered into rows of their own.
    if (o_.rope) {
      AttentionShape each = shape(B, 1);
      each.rope_per_token = true;
      b.rope_forward(qkv, at.rope->at(o_.rope_base).rows(0, B), each);
    }
    b.cache_write(cache, qkv, q_width, at.positions);
    const Tensor q = scratch.take(dt, {B, q_width});
    b.copy_columns(q, 0, qkv, 0, q_width);
    b.attention_decode(att, q, cache, at.positions, pos, shape(B, S));
    ops.linear(out, att, o_proj_, -1, residual);
    return;
  }
  // Row t of the table slice is position pos + t.
  if (o_.rope) b.rope_forward(qkv, ops.rope_table(o_.rope_base).rows(pos, pos + n), shape(1, n));
  b.copy_columns(cache.rows(pos, pos + n), 0, qkv, q_width, row);
  if (pos == 0) {
    const Tensor lse = scratch.take(DType::F32, {1, s_.heads, n});
    b.attention_forward(att, lse, qkv, shape(1, n));
  } else {
    b.attention_decode(att, qkv.flat_range(0, q_width).view({1, q_width}),
                       cache.view({1, S, row}), {}, pos, shape(1, S));
  }
  ops.linear(out, att, o_proj_, -1, residual);
}

std::vector<LinearGemm> GqaAttention::linear_gemms() const {
  return {{.name = "qkv", .out_features = s_.qkv_width(), .in_features = s_.hidden,
           .bias = s_.qkv_bias},
          {.name = "o_proj", .out_features = s_.hidden, .in_features = s_.attn_width(),
           .residual = true}};
}

double GqaAttention::attention_flops_per_token(int64_t seq_length) const {
  const int64_t s_eff = o_.window > 0 ? std::min(seq_length, o_.window) : seq_length;
  return 12.0 * static_cast<double>(s_eff) * static_cast<double>(s_.attn_width());
}

}  // namespace tessera
