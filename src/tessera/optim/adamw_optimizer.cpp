#include "tessera/optim/adamw_optimizer.h"

#include <algorithm>

#include "tessera/core/error.h"

namespace tessera {

namespace {

// segments (offsets from the buffer start) restricted to [r.begin, r.end), offsets from r.begin.
std::vector<ParamSegment> clip_segments(const std::vector<ParamSegment>& segments,
                                        const ParamRange& r) {
  std::vector<ParamSegment> out;
  for (const ParamSegment& s : segments) {
    const int64_t lo = std::max(s.offset, r.begin), hi = std::min(s.offset + s.count, r.end);
    if (lo < hi) out.push_back({lo - r.begin, hi - lo, s.decay});
  }
  return out;
}

}  // namespace

AdamWOptimizer::AdamWOptimizer(Model& model, const TrainingConfig& config,
                               std::vector<OwnedParams> owned)
    : model_(model),
      config_(config),
      segments_(model.layout().decay_segments()),
      owned_(std::move(owned)),
      sharded_(!owned_.empty()) {
  Backend& b = model.backend();
  const int64_t P = model.layout().total;
  if (!sharded_) owned_ = {{{0, P}, model.params(), model.grads()}};
  int64_t held = 0;
  for (const OwnedParams& o : owned_) {
    TS_CHECK(o.params.numel() == o.range.count() && o.grads.numel() == o.range.count(),
             "owned range [{}, {}) has {} parameters and {} gradients", o.range.begin, o.range.end,
             o.params.numel(), o.grads.numel());
    owned_segments_.push_back(clip_segments(segments_, o.range));
    held += o.range.count();
  }
  if (model.runtime().compute_dtype == DType::F32 && !sharded_) {
    master_ = model.params();
  } else {
    master_buffer_ = DeviceBuffer(b, held * sizeof(float), "fp32 master weights");
    master_ = master_buffer_.tensor(DType::F32, {held});
  }
  moments_buffer_ = DeviceBuffer(b, 2 * held * sizeof(float), "AdamW moments");
  exp_avg_ = moments_buffer_.tensor(DType::F32, {held});
  exp_avg_sq_ = moments_buffer_.tensor(DType::F32, {held}, held * sizeof(float));
  b.fill(exp_avg_, 0.0f);
  b.fill(exp_avg_sq_, 0.0f);
}

size_t AdamWOptimizer::state_bytes(int64_t params, DType compute) {
  const size_t p = static_cast<size_t>(params);
  return (compute == DType::F32 ? 2 : 3) * p * sizeof(float);
}

std::vector<ParamRange> AdamWOptimizer::owned() const {
  std::vector<ParamRange> ranges;
  for (const OwnedParams& o : owned_) ranges.push_back(o.range);
  return ranges;
}

void AdamWOptimizer::sync_params_from_master() {
  int64_t at = 0;  // master weights are packed in owned order
  for (const OwnedParams& o : owned_) {
    if (o.params.data != master_.data)
      model_.backend().convert(o.params, master_.flat_range(at, o.range.count()));
    at += o.range.count();
  }
  model_.params_updated();
}

std::vector<FlatSlice> AdamWOptimizer::master_slices() const {
  std::vector<FlatSlice> slices;
  int64_t at = 0;
  for (const OwnedParams& o : owned_) {
    slices.push_back({o.range, master_.flat_range(at, o.range.count())});
    at += o.range.count();
  }
  return slices;
}

void AdamWOptimizer::step(double lr, const Tensor& grad_norm_sq, int64_t step) {
  AdamWArgs a;
  a.grad_norm_sq = grad_norm_sq;
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(config_.adam_beta1);
  a.beta2 = static_cast<float>(config_.adam_beta2);
  a.eps = static_cast<float>(config_.adam_eps);
  a.weight_decay = static_cast<float>(config_.weight_decay);
  a.max_grad_norm = static_cast<float>(config_.clip_grad);
  a.step = step;
  int64_t at = 0;
  for (size_t i = 0; i < owned_.size(); ++i) {
    const OwnedParams& o = owned_[i];
    const int64_t n = o.range.count();
    a.master = master_.flat_range(at, n);
    a.grad = o.grads;
    a.exp_avg = exp_avg_.flat_range(at, n);
    a.exp_avg_sq = exp_avg_sq_.flat_range(at, n);
    a.params = o.params.data != master_.data ? o.params : Tensor{};
    a.segments = owned_segments_[i];
    at += n;
    if (!a.segments.empty()) model_.backend().adamw_step(a);
  }
  model_.params_updated();
}

}  // namespace tessera
