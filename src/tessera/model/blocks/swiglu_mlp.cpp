#include "tessera/model/blocks/swiglu_mlp.h"

namespace tessera {

void SwigluMlp::declare_params(ParamLayoutBuilder& b) {
  const int64_t C = s_.hidden, F = s_.ffn;
  gate_up_ = b.add("mlp.gate_up_proj.weight", {2 * F, C}, ParamInit::Normal, true,
                   TensorParallelStyle::Column, {F, F});
  down_ = b.add("mlp.down_proj.weight", {C, F}, ParamInit::ScaledNormal, true,
                TensorParallelStyle::Row);
}

void SwigluMlp::declare_activations(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t N = rt.tokens();
  const DType dt = rt.compute_dtype;
  plan.add(&gate_up_out_, dt, {N, 2 * s_.ffn});
  plan.add(&h_, dt, {N, s_.ffn}, Keep::Recomputable);
}

void SwigluMlp::declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t N = rt.tokens();
  plan.add(&dh_, rt.compute_dtype, {N, s_.ffn});
  plan.add(&dgate_up_, rt.compute_dtype, {N, 2 * s_.ffn});
}

// The codes are written here, where a full recompute also writes h (it skips the layer's
// last output projection), and read by the down projection next, before any other cast.
// Where its backward takes h's transposed codes, h itself is not written: the codes are kept
// in its place (or, under selective recompute, which keeps neither, recomputed there).
void SwigluMlp::forward_inner(LayerOps& ops, const LinearOperand& in) {
  ops.linear(gate_up_out_, in, gate_up_, -1);
  const int64_t N = h_.dim(0);
  Fp8CastArgs codes = ops.linear_input_cast(down_, N);
  if (!codes.out.defined()) return ops.backend().swiglu_forward(h_, gate_up_out_);
  if (!ops.linear_keeps_input_codes(down_, N))
    return ops.backend().swiglu_forward_cast(h_, gate_up_out_, codes);
  if (ops.runtime().recompute != RecomputeGranularity::Selective)
    codes.out_t = transposed_codes_in(h_);
  ops.backend().swiglu_forward_cast({}, gate_up_out_, codes);
}

void SwigluMlp::forward_output(LayerOps& ops, const Tensor& out, const Tensor& residual) {
  const bool cast = ops.linear_input_cast(down_, h_.dim(0)).out.defined();
  ops.linear(out, cast ? LinearOperand::with_codes(h_) : LinearOperand(h_), down_, -1, residual);
}

// h and (under selective recompute) the block's normed input share one buffer: h (or its
// codes) is used up before the input is recomputed.
void SwigluMlp::backward(LayerOps& ops, const LinearOperand& in, const Tensor& dout,
                         const Tensor& din, const std::function<void()>& recompute_in) {
  Backend& b = ops.backend();
  const int64_t N = h_.dim(0);
  const bool kept_codes = ops.linear_keeps_input_codes(down_, N);
  if (ops.runtime().recompute == RecomputeGranularity::Selective) {
    ScopedRange r(b, "recompute");  // a trace's step breakdown counts it as recompute
    if (kept_codes) {
      // The forward's scale, so the forward's codes; their amax was recorded then.
      Fp8CastArgs codes = ops.linear_input_cast(down_, N);
      codes.out = codes.amax = Tensor{};
      codes.out_t = transposed_codes_in(h_);
      b.swiglu_forward_cast({}, gate_up_out_, codes);
    } else {
      b.swiglu_forward(h_, gate_up_out_);
    }
  }
  ops.linear_backward(
      dh_, dout,
      kept_codes ? LinearOperand::transposed_codes(transposed_codes_in(h_)) : LinearOperand(h_),
      down_, -1);
  // Where the gate_up projection takes its output gradient's codes, the SwiGLU backward writes
  // them in both layouts and never d(gate_up) itself (recompute_in casts nothing in between).
  const Fp8CastArgs codes = ops.linear_output_grad_cast(gate_up_, dgate_up_.dim(0));
  if (codes.out.defined()) {
    b.swiglu_backward_cast(dgate_up_, dh_, gate_up_out_, codes);
  } else {
    b.swiglu_backward(dgate_up_, dh_, gate_up_out_);
  }
  recompute_in();
  ops.linear_backward(
      din, codes.out.defined() ? LinearOperand::with_codes(dgate_up_) : LinearOperand(dgate_up_),
      in, gate_up_, -1);
}

size_t SwigluMlp::cached_scratch_bytes(int64_t n, DType dtype) const {
  const size_t e = dtype_size(dtype);
  return ScratchArena::aligned(n * 2 * s_.ffn * e) + ScratchArena::aligned(n * s_.ffn * e);
}

void SwigluMlp::forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& in,
                               const Tensor& out, const Tensor& residual, const Tensor& /*cache*/,
                               const CachePosition& /*at*/) {
  const int64_t n = in.dim(0);
  const Tensor gate_up = scratch.take(in.dtype, {n, 2 * s_.ffn});
  const Tensor h = scratch.take(in.dtype, {n, s_.ffn});
  ops.linear(gate_up, in, gate_up_, -1);
  ops.backend().swiglu_forward(h, gate_up);
  ops.linear(out, h, down_, -1, residual);
}

}  // namespace tessera
