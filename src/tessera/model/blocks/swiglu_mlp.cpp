#include "tessera/model/blocks/swiglu_mlp.h"

namespace tessera {

void SwigluMlpBlock::declare_params(ParamLayoutBuilder& b) {
  const int64_t C = s_.hidden, F = s_.ffn;
  norm_ = b.add("post_attention_layernorm.weight", {C}, ParamInit::Ones, false);
  gate_up_ = b.add("mlp.gate_up_proj.weight", {2 * F, C}, ParamInit::Normal, true,
                   TensorParallelStyle::Column, {F, F});
  down_ = b.add("mlp.down_proj.weight", {C, F}, ParamInit::ScaledNormal, true,
                TensorParallelStyle::Row);
}

void SwigluMlpBlock::declare_activations(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t N = rt.tokens(), Ns = rt.sequence_tokens();
  const DType dt = rt.compute_dtype;
  plan.add(&rstd_, DType::F32, {Ns});
  plan.add(&gate_up_out_, dt, {N, 2 * s_.ffn});
  plan.add(&ln_, dt, {Ns, s_.hidden}, Keep::Recomputable);
  plan.add(&h_, dt, {N, s_.ffn}, Keep::Recomputable);
}

void SwigluMlpBlock::declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t N = rt.tokens();
  plan.add(&dh_, rt.compute_dtype, {N, s_.ffn});
  plan.add(&dgate_up_, rt.compute_dtype, {N, 2 * s_.ffn});
}

void SwigluMlpBlock::forward_inner(LayerOps& ops, const Tensor& x) {
  Backend& b = ops.backend();
  b.rmsnorm_forward(ln_, rstd_, x, ops.param(norm_), s_.norm_eps);
  ops.linear(gate_up_out_, ln_, gate_up_, -1);
  b.swiglu_forward(h_, gate_up_out_);
}

void SwigluMlpBlock::forward_output(LayerOps& ops, const Tensor& x, const Tensor& out) {
  ops.linear(out, h_, down_, -1, x);
}

void SwigluMlpBlock::backward(LayerOps& ops, const Tensor& x, const Tensor& dresid) {
  Backend& b = ops.backend();
  const bool selective = ops.runtime().recompute == RecomputeGranularity::Selective;
  if (selective) {
    ScopedRange r(b, "recompute");  // a trace's step breakdown counts it as recompute
    b.swiglu_forward(h_, gate_up_out_);
  }
  ops.linear_backward(dh_, dresid, h_, down_, -1);
  b.swiglu_backward(dgate_up_, dh_, gate_up_out_);
  if (selective) {
    ScopedRange r(b, "recompute");
    b.rmsnorm_forward(ln_, rstd_, x, ops.param(norm_), s_.norm_eps);
  }
  ops.linear_backward(ops.norm_grad(), dgate_up_, ln_, gate_up_, -1);
  b.rmsnorm_backward(dresid, ops.grad(norm_), ops.norm_grad(), x, ops.param(norm_), rstd_);
}

size_t SwigluMlpBlock::cached_scratch_bytes(int64_t n, DType dtype) const {
  const size_t e = dtype_size(dtype);
  return ScratchArena::aligned(n * s_.hidden * e) + ScratchArena::aligned(n * 4) +
         ScratchArena::aligned(n * 2 * s_.ffn * e) + ScratchArena::aligned(n * s_.ffn * e);
}

void SwigluMlpBlock::forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& x,
                                    const Tensor& out, const Tensor& /*cache*/,
                                    int64_t /*pos*/) {
  Backend& b = ops.backend();
  const int64_t n = x.dim(0);
  const Tensor ln = scratch.take(x.dtype, {n, s_.hidden});
  const Tensor rstd = scratch.take(DType::F32, {n});
  const Tensor gate_up = scratch.take(x.dtype, {n, 2 * s_.ffn});
  const Tensor h = scratch.take(x.dtype, {n, s_.ffn});
  b.rmsnorm_forward(ln, rstd, x, ops.param(norm_), s_.norm_eps);
  ops.linear(gate_up, ln, gate_up_, -1);
  b.swiglu_forward(h, gate_up);
  ops.linear(out, h, down_, -1, x);
}

}  // namespace tessera
