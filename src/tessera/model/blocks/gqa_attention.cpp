#include "tessera/model/blocks/gqa_attention.h"

#include <algorithm>
#include <cmath>

#include "tessera/core/error.h"

namespace tessera {

void GqaAttentionBlock::declare_params(ParamLayoutBuilder& b) {
  const int64_t C = s_.hidden, q = s_.heads * s_.head_dim, kv = s_.kv_heads * s_.head_dim;
  norm_ = b.add("input_layernorm.weight", {C}, ParamInit::Ones, false);
  qkv_weight_ = b.add("self_attn.qkv_proj.weight", {s_.qkv_width(), C}, ParamInit::Normal, true,
                      TensorParallelStyle::Column, {q, kv, kv});
  if (s_.qkv_bias)
    qkv_bias_ = b.add("self_attn.qkv_proj.bias", {s_.qkv_width()}, ParamInit::Zeros, false,
                      TensorParallelStyle::Column, {q, kv, kv});
  o_proj_ = b.add("self_attn.o_proj.weight", {C, s_.attn_width()}, ParamInit::ScaledNormal, true,
                  TensorParallelStyle::Row);
  if (s_.qk_norm) {
    q_norm_ = b.add("self_attn.q_norm.weight", {s_.head_dim}, ParamInit::Ones, false);
    k_norm_ = b.add("self_attn.k_norm.weight", {s_.head_dim}, ParamInit::Ones, false);
  }
}

void GqaAttentionBlock::declare_activations(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t N = rt.tokens(), Ns = rt.sequence_tokens();
  const DType dt = rt.compute_dtype;
  plan.add(&ln_, dt, {Ns, s_.hidden}, Keep::Recomputable);
  plan.add(&rstd_, DType::F32, {Ns});
  plan.add(&qkv_, dt, {N, s_.qkv_width()});
  plan.add(&att_, dt, {N, s_.attn_width()});
  plan.add(&lse_, DType::F32, {rt.micro_batch, s_.heads, rt.seq_length});
  if (s_.qk_norm) {
    plan.add(&qkv_raw_, dt, {N, s_.qkv_width()});
    plan.add(&qk_rstd_, DType::F32, {N, s_.heads + s_.kv_heads});
  }
}

void GqaAttentionBlock::declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t N = rt.tokens();
  plan.add(&datt_, rt.compute_dtype, {N, s_.attn_width()});
  plan.add(&dqkv_, rt.compute_dtype, {N, s_.qkv_width()});
}

AttentionShape GqaAttentionBlock::shape(int64_t batch, int64_t seq) const {
  AttentionShape a;
  a.batch = batch;
  a.seq = seq;
  a.heads = s_.heads;
  a.kv_heads = s_.kv_heads;
  a.head_dim = s_.head_dim;
  a.causal = true;
  a.window = s_.sliding_window;
  a.scale = 1.0f / std::sqrt(static_cast<float>(s_.head_dim));
  return a;
}

void GqaAttentionBlock::forward_inner(LayerOps& ops, const Tensor& x) {
  Backend& b = ops.backend();
  const AttentionShape a = shape(ops.runtime().micro_batch, ops.runtime().seq_length);
  b.rmsnorm_forward(ln_, rstd_, x, ops.param(norm_), s_.norm_eps);
  if (s_.qk_norm) {
    ops.linear(qkv_raw_, ln_, qkv_weight_, qkv_bias_);
    b.qk_norm_forward(qkv_, qk_rstd_, qkv_raw_, ops.param(q_norm_), ops.param(k_norm_), a,
                      s_.norm_eps);
  } else {
    ops.linear(qkv_, ln_, qkv_weight_, qkv_bias_);
  }
  b.rope_forward(qkv_, ops.rope_table(), a);
  ops.attention_forward(att_, lse_, qkv_, a);
}

void GqaAttentionBlock::forward_output(LayerOps& ops, const Tensor& x, const Tensor& out) {
  ops.linear(out, att_, o_proj_, -1, x);
}

void GqaAttentionBlock::backward(LayerOps& ops, const Tensor& x, const Tensor& dresid) {
  Backend& b = ops.backend();
  const AttentionShape a = shape(ops.runtime().micro_batch, ops.runtime().seq_length);
  ops.linear_backward(datt_, dresid, att_, o_proj_, -1);
  ops.attention_backward(dqkv_, datt_, att_, lse_, qkv_, a);
  b.rope_backward(dqkv_, ops.rope_table(), a);
  if (s_.qk_norm)
    b.qk_norm_backward(dqkv_, ops.grad(q_norm_), ops.grad(k_norm_), dqkv_, qkv_raw_,
                       ops.param(q_norm_), ops.param(k_norm_), qk_rstd_, a);
  if (ops.runtime().recompute == RecomputeGranularity::Selective) {
    ScopedRange r(b, "recompute");  // a trace's step breakdown counts it as recompute
    b.rmsnorm_forward(ln_, rstd_, x, ops.param(norm_), s_.norm_eps);
  }
  ops.linear_backward(ops.norm_grad(), dqkv_, ln_, qkv_weight_, qkv_bias_);
  b.rmsnorm_backward(dresid, ops.grad(norm_), ops.norm_grad(), x, ops.param(norm_), rstd_);
}

size_t GqaAttentionBlock::cached_scratch_bytes(int64_t n, DType dtype) const {
  const size_t e = dtype_size(dtype);
  const size_t qk_norm = s_.qk_norm ? ScratchArena::aligned(n * s_.qkv_width() * e) +
                                          ScratchArena::aligned(n * (s_.heads + s_.kv_heads) * 4)
                                    : 0;
  return ScratchArena::aligned(n * s_.hidden * e) + ScratchArena::aligned(n * 4) +
         ScratchArena::aligned(n * s_.qkv_width() * e) +
         ScratchArena::aligned(n * s_.attn_width() * e) + ScratchArena::aligned(s_.heads * n * 4) +
         qk_norm;
}

// A prompt attends within itself (attention_forward over its own q, k and v); one new token
// attends to the cache. Both write every position's keys and values into the cache first.
void GqaAttentionBlock::forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& x,
                                       const Tensor& out, const Tensor& cache, int64_t pos) {
  Backend& b = ops.backend();
  const int64_t n = x.dim(0), width = s_.qkv_width(), q_width = s_.attn_width();
  const int64_t S = cache.dim(0), row = cache_width();
  const DType dt = x.dtype;
  TS_CHECK(pos == 0 || n == 1, "generation: {} tokens at position {} (a prompt, or one token)", n,
           pos);
  TS_CHECK(pos + n <= S, "generation: positions up to {} in a cache of {}", pos + n, S);
  const Tensor ln = scratch.take(dt, {n, s_.hidden});
  const Tensor rstd = scratch.take(DType::F32, {n});
  const Tensor qkv = scratch.take(dt, {n, width});
  const Tensor att = scratch.take(dt, {n, q_width});
  b.rmsnorm_forward(ln, rstd, x, ops.param(norm_), s_.norm_eps);
  if (s_.qk_norm) {
    const Tensor raw = scratch.take(dt, {n, width});
    const Tensor qk_rstd = scratch.take(DType::F32, {n, s_.heads + s_.kv_heads});
    ops.linear(raw, ln, qkv_weight_, qkv_bias_);
    b.qk_norm_forward(qkv, qk_rstd, raw, ops.param(q_norm_), ops.param(k_norm_), shape(1, n),
                      s_.norm_eps);
  } else {
    ops.linear(qkv, ln, qkv_weight_, qkv_bias_);
  }
  // Row t of the table slice is position pos + t.
  b.rope_forward(qkv, ops.rope_table().rows(pos, pos + n), shape(1, n));
  for (int64_t t = 0; t < n; ++t)
    b.copy(cache.flat_range((pos + t) * row, row), qkv.flat_range(t * width + q_width, row));
  if (pos == 0) {
    const Tensor lse = scratch.take(DType::F32, {1, s_.heads, n});
    b.attention_forward(att, lse, qkv, shape(1, n));
  } else {
    b.attention_decode(att, qkv.flat_range(0, q_width).view({1, q_width}),
                       cache.view({1, S, row}), pos, shape(1, S));
  }
  ops.linear(out, att, o_proj_, -1, x);
}

int64_t GqaAttentionBlock::matmul_params() const {
  return s_.hidden * s_.qkv_width() + s_.attn_width() * s_.hidden;
}

double GqaAttentionBlock::attention_flops_per_token(int64_t seq_length) const {
  const int64_t s_eff =
      s_.sliding_window > 0 ? std::min(seq_length, s_.sliding_window) : seq_length;
  return 12.0 * static_cast<double>(s_eff) * static_cast<double>(s_.attn_width());
}

}  // namespace tessera
