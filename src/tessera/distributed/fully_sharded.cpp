#include "tessera/distributed/fully_sharded.h"

#include <algorithm>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera::dist {

FullyShardedDataParallel::Memory FullyShardedDataParallel::plan_memory(const ParamLayout& layout,
                                                                       int world, DType compute,
                                                                       DType grad) {
  Memory m;
  const ShardedUnits::Memory weights = ShardedUnits::plan_memory(layout, world, compute);
  m.weights = weights.bytes;
  m.gradients = ShardedUnits::plan_memory(layout, world, grad).bytes;  // the same shards and slots
  m.shard_elements = weights.shard_elements;
  return m;
}

FullyShardedDataParallel::FullyShardedDataParallel(Communicator& comm, Model& model)
    : DataParallelism(comm, model),
      params_(comm, model.backend(), model.layout(), model.runtime().compute_dtype) {
  TS_CHECK(model.runtime().sharded_params, "FSDP needs a model built with sharded_params");
  Backend& b = model.backend();
  const DType gt = model.runtime().grad_dtype;
  grad_slots_.resize(ShardedUnits::slot_count(model.layout()));
  reduce_marks_.assign(model.layout().units.size(), -1);
  from_copies_.assign(model.layout().units.size(), 0);
  grad_shard_buffer_ = DeviceBuffer(b, params_.shard_elements() * dtype_size(gt), "gradient shard");
  grad_slot_buffer_ = DeviceBuffer(
      b, static_cast<int64_t>(grad_slots_.size()) * params_.padded_unit() * dtype_size(gt), "unit gradients");
  grad_shards_ = grad_shard_buffer_.tensor(gt, {params_.shard_elements()});
  // Slice padding beyond a unit's end is reduced with the rest: keep it zero.
  b.fill(grad_shards_, 0.0f);
  model_.set_unit_observer(this);
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  model_.set_unit_observer(nullptr);
}

std::string FullyShardedDataParallel::description() const {
  int64_t largest = 0;
  for (const ParamRange& u : model_.layout().units) largest = std::max(largest, u.count());
  return fmt::format(
      "FSDP (ZeRO-3): parameters, gradients and optimizer state sharded; {} units gathered "
      "just in time on a communicator of their own (largest {:.1f} M parameters), gradients "
      "reduce-scattered during backward",
      model_.layout().units.size(), static_cast<double>(largest) / 1e6);
}

std::vector<OwnedParams> FullyShardedDataParallel::optimizer_shards() const {
  std::vector<OwnedParams> out;
  const std::vector<ParamRange>& units = model_.layout().units;
  for (int u = 0; u < static_cast<int>(units.size()); ++u) {
    const ParamRange r = ShardedUnits::held_range(units[u], comm_.size(), comm_.rank());
    if (r.begin >= r.end) continue;
    out.push_back({r, params_.shard(u).flat_range(0, r.count()), grad_shard(u).flat_range(0, r.count())});
  }
  return out;
}

Tensor FullyShardedDataParallel::grad_slot(const Slot& s, int unit) const {
  const auto index = static_cast<int64_t>(&s - grad_slots_.data());
  const Tensor all = grad_slot_buffer_.tensor(
      model_.runtime().grad_dtype, {static_cast<int64_t>(grad_slots_.size()) * params_.padded_unit()});
  return all.flat_range(index * params_.padded_unit(), params_.slice(unit) * comm_.size());
}

Tensor FullyShardedDataParallel::grad_shard(int unit) const {
  return grad_shards_.flat_range(params_.shard_at(unit), params_.slice(unit));
}

FullyShardedDataParallel::Slot& FullyShardedDataParallel::least_recently_used_free() {
  Slot* best = nullptr;
  for (Slot& s : grad_slots_)
    if (!s.in_use && (!best || s.last_use < best->last_use)) best = &s;
  TS_CHECK(best, "FSDP: every gradient slot is in use");
  return *best;
}

// A unit the model reads from its copies (FP8 weights cached for the step) is not gathered;
// neither is one it will, when it is next.
void FullyShardedDataParallel::params_needed(int unit, int next) {
  const int ahead = next >= 0 && !model_.unit_read_from_copies(next) ? next : -1;
  if (model_.unit_read_from_copies(unit)) {
    from_copies_[unit] = 1;
    if (ahead >= 0) params_.prefetch(ahead);
    return;
  }
  model_.bind_unit_params(unit, params_.unit_needed(unit, ahead));
}

void FullyShardedDataParallel::params_done(int unit) {
  if (from_copies_[unit]) {
    from_copies_[unit] = 0;
    return;
  }
  params_.unit_done(unit);
}

void FullyShardedDataParallel::grads_needed(int unit) {
  Slot& slot = least_recently_used_free();
  // The slot's last reduce-scatter must have read it; accumulating, this unit's last one
  // must have written the shard copied in below.
  const int mark = std::max(slot.mark, accumulate_ ? reduce_marks_[unit] : -1);
  if (mark >= 0) comm_.wait_comm_mark(mark);
  const Tensor g = grad_slot(slot, unit);
  Backend& b = model_.backend();
  if (accumulate_) {  // the own slice starts from the shard, the others from zero
    const int64_t n = params_.slice(unit), own = comm_.rank() * n;
    if (own > 0) b.fill(g.flat_range(0, own), 0.0f);
    b.copy(g.flat_range(own, n), grad_shard(unit));
    if (own + n < g.numel()) b.fill(g.flat_range(own + n, g.numel() - own - n), 0.0f);
  }
  slot.unit = unit;
  slot.in_use = true;
  slot.last_use = ++uses_;
  model_.bind_unit_grads(unit, g);
  if (accumulate_) return;
  // The step's first micro-batch: the weight-gradient GEMMs write their gradients (no zeroed
  // unit for them to read and add to) and the model zeroes the rest of the unit; the padding
  // beyond it is reduced with it.
  const int64_t count = model_.layout().units[unit].count();
  if (count < g.numel()) b.fill(g.flat_range(count, g.numel() - count), 0.0f);
  model_.start_unit_grads(unit);
}

void FullyShardedDataParallel::grads_ready(int unit) {
  auto slot = std::find_if(grad_slots_.begin(), grad_slots_.end(), [&](const Slot& s) { return s.unit == unit; });
  TS_CHECK(slot != grad_slots_.end() && slot->in_use, "FSDP: unit {} has no gradient slot", unit);
  comm_.reduce_scatter(grad_shard(unit), grad_slot(*slot, unit), Lane::Comm);
  comm_pending_ = true;
  slot->mark = reduce_marks_[unit] = comm_.comm_mark();
  slot->in_use = false;
  slot->unit = -1;
}

void FullyShardedDataParallel::begin_micro_batch(bool /*last*/) {
  accumulate_ = step_started_;
  step_started_ = true;
}

// Marks are valid only until the next wait_comm(), after which nothing is pending.
void FullyShardedDataParallel::settle() {
  params_.settle();
  if (!comm_pending_) return;
  comm_.wait_comm();
  comm_pending_ = false;
  for (Slot& s : grad_slots_) s.mark = -1;
  std::fill(reduce_marks_.begin(), reduce_marks_.end(), -1);
}

void FullyShardedDataParallel::finish_gradient_reduction() {
  settle();
}

void FullyShardedDataParallel::grad_norm_sq(const Tensor& out) {
  // The shards hold every gradient element once over the ranks (padding is zero).
  model_.backend().sum_squares(out, grad_shards_, /*accumulate=*/false);
  sum(out);
}

std::vector<Tensor> FullyShardedDataParallel::grad_pieces(const ParamRange& range) const {
  std::vector<Tensor> pieces;
  const std::vector<ParamRange>& units = model_.layout().units;
  for (int u = 0; u < static_cast<int>(units.size()); ++u) {
    const ParamRange own = ShardedUnits::held_range(units[u], comm_.size(), comm_.rank());
    const int64_t lo = std::max(range.begin, own.begin), hi = std::min(range.end, own.end);
    if (hi > lo) pieces.push_back(grad_shards_.flat_range(params_.shard_at(u) + (lo - own.begin), hi - lo));
  }
  return pieces;
}

void FullyShardedDataParallel::params_updated() {
  params_.shards_updated();
  step_started_ = false;
}

// Every rank gathers each unit once, in order, on the compute lane; rank 0 reads from it.
Tensor FullyShardedDataParallel::gathered_param(int index) {
  const ParamInfo& p = model_.layout().params[index];
  settle();
  return params_.gather_now(p.unit)
      .flat_range(p.offset - model_.layout().units[p.unit].begin, p.numel())
      .view(p.shape);
}

void FullyShardedDataParallel::follow_gathers() {
  settle();
  params_.follow_all();
}

FrozenShardedDataParallel::FrozenShardedDataParallel(Communicator& comm, Model& model,
                                                     const DataParallelOptions& options)
    : DataParallel(comm, model, [&] {
        DataParallelOptions o = options;
        o.fully_shard = false;
        o.shard_optimizer = true;
        return o;
      }()),
      frozen_(comm, model.backend(), *model.frozen_layout(), model.runtime().compute_dtype) {
  TS_CHECK(model.runtime().sharded_params, "FSDP needs a model built with sharded_params");
  model_.set_frozen_units(&frozen_);
}

FrozenShardedDataParallel::~FrozenShardedDataParallel() {
  model_.set_frozen_units(nullptr);
}

std::string FrozenShardedDataParallel::description() const {
  const ParamLayout& frozen = *model_.frozen_layout();
  int64_t largest = 0;
  for (const ParamRange& u : frozen.units) largest = std::max(largest, u.count());
  return fmt::format(
      "FSDP of the frozen weights: {} units sharded and gathered just in time on a communicator of "
      "their own (largest {:.1f} M parameters); {}",
      frozen.units.size(), static_cast<double>(largest) / 1e6, DataParallel::description());
}

void FrozenShardedDataParallel::settle() {
  DataParallel::settle();
  frozen_.settle();
}

}  // namespace tessera::dist
