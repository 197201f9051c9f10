#include "tessera/optim/adamw_optimizer.h"

#include <algorithm>

#include "tessera/core/error.h"

namespace tessera {

namespace {

// Each state tensor starts on a 256-byte boundary of its buffer, so that the vector loads of
// the fused op stay aligned whatever the element counts and dtypes before it.
constexpr size_t kStateAlign = 256;

size_t aligned(size_t bytes) {
  return (bytes + kStateAlign - 1) / kStateAlign * kStateAlign;
}

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

bool AdamWOptimizer::keeps_master_copy(DType compute, const OptimizerDtypes& d, bool sharded) {
  if (d.main_params != DType::F32) return false;
  return compute != DType::F32 || sharded;
}

bool AdamWOptimizer::splits_master(DType compute, const OptimizerDtypes& d, bool sharded) {
  return keeps_master_copy(compute, d, sharded) && compute == DType::BF16 && d.split_master;
}

std::vector<std::vector<ParamSegment>> AdamWOptimizer::step_segments(
    const ParamLayout& layout, const std::vector<ParamRange>& owned) {
  const std::vector<ParamSegment> all = layout.decay_segments();
  std::vector<std::vector<ParamSegment>> out;
  for (const ParamRange& r : owned) out.push_back(clip_segments(all, r));
  return out;
}

OptimizerDtypes OptimizerDtypes::from(const TrainingConfig& t) {
  return {t.main_params_dtype, t.exp_avg_dtype, t.exp_avg_sq_dtype, t.store_param_remainders};
}

AdamWOptimizer::AdamWOptimizer(Model& model, const TrainingConfig& config,
                               std::vector<OwnedParams> owned)
    : model_(model),
      config_(config),
      dtypes_(OptimizerDtypes::from(config)),

      owned_(std::move(owned)),
      sharded_(!owned_.empty()) {
  Backend& b = model.backend();
  const int64_t P = model.layout().total;
  const DType compute = model.runtime().compute_dtype;
  if (!sharded_) owned_ = {{{0, P}, model.params(), model.grads()}};
  int64_t held = 0;
  for (const OwnedParams& o : owned_) {
    TS_CHECK(o.params.numel() == o.range.count() && o.grads.numel() == o.range.count(),
             "owned range [{}, {}) has {} parameters and {} gradients", o.range.begin, o.range.end,
             o.params.numel(), o.grads.numel());
    held += o.range.count();
  }
  owned_segments_ = step_segments(model.layout(), this->owned());
  if (dtypes_.main_params != DType::F32) {
    TS_CHECK(dtypes_.main_params == compute,
             "{} main parameters need {} parameters; the model's are {}",
             dtype_name(dtypes_.main_params), dtype_name(dtypes_.main_params), dtype_name(compute));
    params_are_master_ = true;
    if (!sharded_) master_ = model.params();
  } else if (!keeps_master_copy(compute, dtypes_, sharded_)) {
    master_ = model.params();
  } else if (splits_master(compute, dtypes_, sharded_)) {
    master_buffer_ = DeviceBuffer(b, held * sizeof(uint16_t), "fp32 master weights' low halves");
    master_ = master_buffer_.tensor(DType::U16, {held});
  } else {
    master_buffer_ = DeviceBuffer(b, held * sizeof(float), "fp32 master weights");
    master_ = master_buffer_.tensor(DType::F32, {held});
  }
  const size_t m_bytes = aligned(static_cast<size_t>(held) * dtype_size(dtypes_.exp_avg));
  moments_buffer_ = DeviceBuffer(
      b, m_bytes + static_cast<size_t>(held) * dtype_size(dtypes_.exp_avg_sq), "AdamW moments");
  exp_avg_ = moments_buffer_.tensor(dtypes_.exp_avg, {held});
  exp_avg_sq_ = moments_buffer_.tensor(dtypes_.exp_avg_sq, {held}, m_bytes);
  b.fill(exp_avg_, 0.0f);
  b.fill(exp_avg_sq_, 0.0f);
}

Tensor AdamWOptimizer::moments_region() const {
  return moments_buffer_.tensor(DType::U8, {static_cast<int64_t>(moments_buffer_.bytes())});
}

void AdamWOptimizer::reserve_moments_stash() {
  if (moments_stash_.bytes() != moments_buffer_.bytes())
    moments_stash_ = HostBuffer(model_.backend(), moments_buffer_.bytes(), "AdamW moments on the host");
}

void AdamWOptimizer::stash_moments() {
  TS_CHECK(!stashed_, "AdamW: the moments are on the host already");
  reserve_moments_stash();
  model_.backend().download(moments_stash_.data(), moments_region());
  stashed_ = true;
}

void AdamWOptimizer::restore_moments() {
  TS_CHECK(stashed_, "AdamW: no moments on the host to restore");
  model_.backend().upload(moments_region(), moments_stash_.data());
  model_.backend().synchronize();  // the trip's time is the copy's, not the next wait's
  stashed_ = false;
}

size_t AdamWOptimizer::state_bytes(int64_t params, DType compute, const OptimizerDtypes& dtypes,
                                   bool sharded) {
  const auto p = static_cast<size_t>(params);
  const size_t master = !keeps_master_copy(compute, dtypes, sharded) ? 0
                        : splits_master(compute, dtypes, sharded) ? p * sizeof(uint16_t)
                                                                  : p * sizeof(float);
  return master + aligned(p * dtype_size(dtypes.exp_avg)) + p * dtype_size(dtypes.exp_avg_sq);
}

std::vector<ParamRange> AdamWOptimizer::owned() const {
  std::vector<ParamRange> ranges;
  for (const OwnedParams& o : owned_) ranges.push_back(o.range);
  return ranges;
}

void AdamWOptimizer::sync_params_from_master() {
  if (!params_are_master_ && !splits_master()) {
    int64_t at = 0;  // master weights are packed in owned order
    for (const OwnedParams& o : owned_) {
      if (o.params.data != master_.data)
        model_.backend().convert(o.params, master_.flat_range(at, o.range.count()));
      at += o.range.count();
    }
  }
  model_.params_updated();
}

std::vector<FlatSlice> AdamWOptimizer::master_slices() const {
  TS_CHECK(!splits_master(), "a split master has no fp32 slices (write_master)");
  std::vector<FlatSlice> slices;
  int64_t at = 0;
  for (const OwnedParams& o : owned_) {
    slices.push_back(
        {o.range, params_are_master_ ? o.params : master_.flat_range(at, o.range.count())});
    at += o.range.count();
  }
  return slices;
}

void AdamWOptimizer::write_master(const std::function<void(const std::vector<FlatSlice>&)>& write) {
  if (!splits_master()) return write(master_slices());
  // The moments hold at least 4 bytes a parameter (two of 2 or 4): room for the fp32 values.
  Backend& b = model_.backend();
  const Tensor scratch = moments_buffer_.tensor(DType::F32, {master_.numel()});
  std::vector<FlatSlice> slices;
  int64_t at = 0;
  for (const OwnedParams& o : owned_) {
    slices.push_back({o.range, scratch.flat_range(at, o.range.count())});
    at += o.range.count();
  }
  write(slices);
  at = 0;
  for (const OwnedParams& o : owned_) {
    const int64_t n = o.range.count();
    b.split_master(o.params, master_.flat_range(at, n), scratch.flat_range(at, n));
    at += n;
  }
  b.fill(exp_avg_, 0.0f);
  b.fill(exp_avg_sq_, 0.0f);
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
    if (params_are_master_) {
      a.master = Tensor{};
      a.params = o.params;
    } else {
      a.master = master_.flat_range(at, n);
      a.params = o.params.data != master_.data ? o.params : Tensor{};  // split: the high halves
    }
    a.grad = o.grads;
    a.exp_avg = exp_avg_.flat_range(at, n);
    a.exp_avg_sq = exp_avg_sq_.flat_range(at, n);
    a.segments = owned_segments_[i];
    at += n;
    if (!a.segments.empty()) model_.backend().adamw_step(a);
  }
  model_.params_updated();
}

}  // namespace tessera
