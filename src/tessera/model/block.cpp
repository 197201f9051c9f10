#include "tessera/model/block.h"

#include <string>

#include "tessera/core/error.h"

namespace tessera {

int64_t Mixer::matmul_params() const {
  int64_t n = 0;
  for (const LinearGemm& g : linear_gemms())
    n += g.count * g.share_num * g.out_features * g.in_features / g.share_den;
  return n;
}

Block::Block(NormSlots norms, std::unique_ptr<Mixer> mixer, int64_t hidden, float norm_eps)
    : norms_(norms), mixer_(std::move(mixer)), hidden_(hidden), eps_(norm_eps) {
  TS_CHECK(norms_.pre || norms_.post, "{}: a block without a norm", mixer_->range_name());
}

void Block::declare_params(ParamLayoutBuilder& b) {
  const std::string prefix = mixer_->param_prefix();
  if (norms_.pre) pre_norm_ = b.add(prefix + "norm.weight", {hidden_}, ParamInit::Ones, false);
  mixer_->declare_params(b);
  if (norms_.post)
    post_norm_ = b.add(prefix + "post_norm.weight", {hidden_}, ParamInit::Ones, false);
}

void Block::declare_activations(ActivationPlan& plan, const ModelRuntime& rt) {
  const int64_t Ns = rt.sequence_tokens();
  if (norms_.pre) {
    plan.add(&rstd_, DType::F32, {Ns});
    plan.add(&ln_, rt.compute_dtype, {Ns, hidden_}, Keep::Recomputable);
  }
  mixer_->declare_activations(plan, rt);
  if (norms_.post) {
    plan.add(&y_, rt.compute_dtype, {Ns, hidden_});
    plan.add(&post_rstd_, DType::F32, {Ns});
  }
}

void Block::declare_backward_scratch(ActivationPlan& plan, const ModelRuntime& rt) {
  mixer_->declare_backward_scratch(plan, rt);
  if (norms_.post) plan.add(&dy_, rt.compute_dtype, {rt.sequence_tokens(), hidden_});
}

// The pre-norm writes the FP8 codes of the mixer's first linear on the way where that linear
// reads them (delayed scaling, LayerOps::linear_input_cast): its cast does not read ln back.
// Where nothing else reads ln (no adapters), ln is not written at all: the backward writes the
// linear's transposed codes from x and the statistics instead (backward's recompute_in).
void Block::forward_inner(LayerOps& ops, const Tensor& x) {
  if (!norms_.pre) return mixer_->forward_inner(ops, x);
  const int first = mixer_->input_linear();
  const Fp8CastArgs codes = first >= 0 ? ops.linear_input_cast(first, x.dim(0)) : Fp8CastArgs{};
  if (!codes.out.defined()) {
    ops.backend().rmsnorm_forward(ln_, rstd_, x, ops.param(pre_norm_), eps_);
    return mixer_->forward_inner(ops, ln_);
  }
  ops.backend().rmsnorm_forward_cast(ln_kept_as_codes(ops, x) ? Tensor{} : ln_, rstd_, x,
                                     ops.param(pre_norm_), eps_, codes);
  mixer_->forward_inner(ops, LinearOperand::with_codes(ln_));
}

bool Block::ln_kept_as_codes(const LayerOps& ops, const Tensor& x) const {
  const int first = mixer_->input_linear();
  return norms_.pre && first >= 0 && ops.linear_keeps_input_codes(first, x.dim(0));
}

// Post-norm: out = x + norm(y), the norm written into out and x added in place.
void Block::forward_output(LayerOps& ops, const Tensor& x, const Tensor& out) {
  if (!norms_.post) return mixer_->forward_output(ops, out, x);
  Backend& b = ops.backend();
  mixer_->forward_output(ops, y_, {});
  b.rmsnorm_forward(out, post_rstd_, y_, ops.param(post_norm_), eps_);
  b.add(out, out, x);
}

void Block::backward(LayerOps& ops, const Tensor& x, const Tensor& dresid) {
  Backend& b = ops.backend();
  // d(mixer output): dresid itself, or through the post-norm (whose dx accumulates).
  Tensor dy = dresid;
  if (norms_.post) {
    b.fill(dy_, 0.0f);
    b.rmsnorm_backward(dy_, ops.grad(post_norm_), dresid, y_, ops.param(post_norm_), post_rstd_);
    dy = dy_;
  }
  const bool selective = ops.runtime().recompute == RecomputeGranularity::Selective;
  const bool ln_codes = ln_kept_as_codes(ops, x);
  const auto recompute_in = [&] {
    if (ln_codes) {
      // The first linear's transposed codes with its forward's scale, in ln's memory.
      Fp8CastArgs codes = ops.linear_input_cast(mixer_->input_linear(), x.dim(0));
      codes.out = codes.amax = Tensor{};
      codes.out_t = transposed_codes_in(ln_);
      return b.rmsnorm_transposed_codes(codes, x, rstd_, ops.param(pre_norm_), eps_);
    }
    if (!norms_.pre || !selective) return;
    ScopedRange r(b, "recompute");  // a trace's step breakdown counts it as recompute
    b.rmsnorm_forward(ln_, rstd_, x, ops.param(pre_norm_), eps_);
  };
  const Tensor& din = ops.norm_grad();
  mixer_->backward(ops,
                   ln_codes ? LinearOperand::transposed_codes(transposed_codes_in(ln_))
                            : LinearOperand(mixer_input(x)),
                   dy, din, recompute_in);
  // d(x): the residual path (already in dresid) plus the branch's.
  if (norms_.pre)
    b.rmsnorm_backward(dresid, ops.grad(pre_norm_), din, x, ops.param(pre_norm_), rstd_);
  else
    b.add(dresid, dresid, din);
}

size_t Block::cached_scratch_bytes(int64_t n, DType dtype) const {
  const size_t state = ScratchArena::aligned(n * hidden_ * dtype_size(dtype));
  const size_t stats = ScratchArena::aligned(n * 4);
  return mixer_->cached_scratch_bytes(n, dtype) + (norms_.pre ? state + stats : 0) +
         (norms_.post ? state + stats : 0);
}

void Block::forward_cached(ForwardOps& ops, ScratchArena& scratch, const Tensor& x,
                           const Tensor& out, const Tensor& cache, const CachePosition& at) {
  Backend& b = ops.backend();
  const int64_t n = x.dim(0);
  Tensor in = x;
  if (norms_.pre) {
    in = scratch.take(x.dtype, {n, hidden_});
    b.rmsnorm_forward(in, scratch.take(DType::F32, {n}), x, ops.param(pre_norm_), eps_);
  }
  if (!norms_.post) return mixer_->forward_cached(ops, scratch, in, out, x, cache, at);
  const Tensor y = scratch.take(x.dtype, {n, hidden_});
  mixer_->forward_cached(ops, scratch, in, y, {}, cache, at);
  b.rmsnorm_forward(out, scratch.take(DType::F32, {n}), y, ops.param(post_norm_), eps_);
  b.add(out, out, x);
}

std::unique_ptr<Block> make_block(const ModelSpec& spec, std::unique_ptr<Mixer> mixer,
                                  NormSlots norms) {
  return std::make_unique<Block>(norms, std::move(mixer), spec.hidden, spec.norm_eps);
}

}  // namespace tessera
