#include "tessera/model/blocks/gqa_attention.h"

#include <algorithm>
#include <cmath>

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
}

void GqaAttentionBlock::declare_activations(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t N = rt.tokens();
  const DType dt = rt.compute_dtype;
  plan.add(&ln_, dt, {N, s_.hidden}, Keep::Recomputable);
  plan.add(&rstd_, DType::F32, {N});
  plan.add(&qkv_, dt, {N, s_.qkv_width()});
  plan.add(&att_, dt, {N, s_.attn_width()});
  plan.add(&lse_, DType::F32, {rt.micro_batch, s_.heads, rt.seq_length});
}

void GqaAttentionBlock::declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t N = rt.tokens();
  plan.add(&datt_, rt.compute_dtype, {N, s_.attn_width()});
  plan.add(&dqkv_, rt.compute_dtype, {N, s_.qkv_width()});
}

AttentionShape GqaAttentionBlock::shape(const ModelRuntime& rt) const {
  AttentionShape a;
  a.batch = rt.micro_batch;
  a.seq = rt.seq_length;
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
  const AttentionShape a = shape(ops.runtime());
  b.rmsnorm_forward(ln_, rstd_, x, ops.param(norm_), s_.norm_eps);
  ops.linear(qkv_, ln_, qkv_weight_, qkv_bias_);
  b.rope_forward(qkv_, ops.rope_table(), a);
  b.attention_forward(att_, lse_, qkv_, a);
}

void GqaAttentionBlock::forward_output(LayerOps& ops, const Tensor& x, const Tensor& out) {
  ops.linear(out, att_, o_proj_, -1, x);
}

void GqaAttentionBlock::backward(LayerOps& ops, const Tensor& x, const Tensor& dresid) {
  Backend& b = ops.backend();
  const AttentionShape a = shape(ops.runtime());
  ops.linear_backward(datt_, dresid, att_, o_proj_, -1);
  b.attention_backward(dqkv_, datt_, att_, lse_, qkv_, a);
  b.rope_backward(dqkv_, ops.rope_table(), a);
  if (ops.runtime().recompute == RecomputeGranularity::Selective)
    b.rmsnorm_forward(ln_, rstd_, x, ops.param(norm_), s_.norm_eps);
  ops.linear_backward(ops.norm_grad(), dqkv_, ln_, qkv_weight_, qkv_bias_);
  b.rmsnorm_backward(dresid, ops.grad(norm_), ops.norm_grad(), x, ops.param(norm_), rstd_);
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
