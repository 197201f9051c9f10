#include "tessera/distributed/fully_sharded.h"

#include <algorithm>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera::dist {
namespace {

// n_u: a unit's elements per rank, a multiple of 64 so every slice stays 256-byte aligned.
int64_t slice_elements(const ParamRange& unit, int world) {
  const int64_t g = flat_buffer_multiple(world);
  return (unit.count() + g - 1) / g * g / world;
}

int slot_count(const ParamLayout& layout) {
  return layout.lm_head == layout.embedding ? 3 : 2;
}

}  // namespace

FullyShardedDataParallel::Memory FullyShardedDataParallel::plan_memory(const ParamLayout& layout,
                                                                       int world, DType compute,
                                                                       DType grad) {
  Memory m;
  int64_t padded = 0;
  for (const ParamRange& u : layout.units) {
    const int64_t n = slice_elements(u, world);
    m.shard_elements += n;
    padded = std::max(padded, n * world);
  }
  const auto slots = static_cast<size_t>(slot_count(layout) * padded);
  const auto shard = static_cast<size_t>(m.shard_elements);
  m.weights = (shard + slots) * dtype_size(compute);
  m.gradients = (shard + slots) * dtype_size(grad);
  return m;
}

FullyShardedDataParallel::FullyShardedDataParallel(Communicator& comm, Model& model)
    : DataParallelism(comm, model),
      gather_comm_(comm.split(0, comm.rank(), "fsdp_gather")),
      gathers_(*gather_comm_) {
  TS_CHECK(model.runtime().sharded_params, "FSDP needs a model built with sharded_params");
  const ParamLayout& layout = model.layout();
  const int world = comm.size();
  int64_t at = 0;
  for (const ParamRange& r : layout.units) {
    Unit u;
    u.range = r;
    u.slice = slice_elements(r, world);
    u.shard_at = at;
    at += u.slice;
    padded_unit_ = std::max(padded_unit_, u.slice * world);
    units_.push_back(u);
  }
  Backend& b = model.backend();
  const DType dt = model.runtime().compute_dtype, gt = model.runtime().grad_dtype;
  const int slots = slot_count(layout);
  // The gathers read and write collective buffers (communicator.h), so that they can leave
  // the SMs to the layers they overlap.
  shard_buffer_ = gathers_.collective_buffer(b, at * dtype_size(dt), "parameter shard");
  grad_shard_buffer_ = DeviceBuffer(b, at * dtype_size(gt), "gradient shard");
  slot_buffer_ =
      gathers_.collective_buffer(b, slots * padded_unit_ * dtype_size(dt), "gathered parameters");
  grad_slot_buffer_ = DeviceBuffer(b, slots * padded_unit_ * dtype_size(gt), "unit gradients");
  param_shards_ = shard_buffer_.tensor(dt, {at});
  grad_shards_ = grad_shard_buffer_.tensor(gt, {at});
  // Slice padding beyond a unit's end is gathered and reduced with the rest: keep it zero.
  b.fill(param_shards_, 0.0f);
  b.fill(grad_shards_, 0.0f);
  param_slots_.resize(slots);
  grad_slots_.resize(slots);
  model_.set_unit_observer(this);
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  model_.set_unit_observer(nullptr);
}

std::string FullyShardedDataParallel::description() const {
  int64_t largest = 0;
  for (const Unit& u : units_) largest = std::max(largest, u.range.count());
  return fmt::format(
      "FSDP (ZeRO-3): parameters, gradients and optimizer state sharded; {} units gathered "
      "just in time on a communicator of their own (largest {:.1f} M parameters), gradients "
      "reduce-scattered during backward",
      units_.size(), static_cast<double>(largest) / 1e6);
}

std::vector<ParamRange> FullyShardedDataParallel::owned_ranges(const ParamLayout& layout, int world,
                                                               int rank) {
  std::vector<ParamRange> out;
  for (const ParamRange& unit : layout.units) {
    const int64_t slice = slice_elements(unit, world);
    const int64_t begin = unit.begin + rank * slice;
    const int64_t end = std::min(begin + slice, unit.end);
    if (begin < end) out.push_back({begin, end});
  }
  return out;
}

std::vector<OwnedParams> FullyShardedDataParallel::optimizer_shards() const {
  std::vector<OwnedParams> out;
  const int64_t r = comm_.rank();
  for (const Unit& u : units_) {
    const int64_t begin = u.range.begin + r * u.slice;
    const int64_t end = std::min(begin + u.slice, u.range.end);
    if (begin >= end) continue;
    out.push_back({{begin, end},
                   param_shards_.flat_range(u.shard_at, end - begin),
                   grad_shards_.flat_range(u.shard_at, end - begin)});
  }
  return out;
}

Tensor FullyShardedDataParallel::param_slot(const Slot& s, int unit) const {
  const auto index = static_cast<size_t>(&s - param_slots_.data());
  const Tensor all = slot_buffer_.tensor(
      model_.runtime().compute_dtype, {static_cast<int64_t>(param_slots_.size()) * padded_unit_});
  return all.flat_range(static_cast<int64_t>(index) * padded_unit_,
                        units_[unit].slice * comm_.size());
}

Tensor FullyShardedDataParallel::grad_slot(const Slot& s, int unit) const {
  const auto index = static_cast<size_t>(&s - grad_slots_.data());
  const Tensor all = grad_slot_buffer_.tensor(
      model_.runtime().grad_dtype, {static_cast<int64_t>(grad_slots_.size()) * padded_unit_});
  return all.flat_range(static_cast<int64_t>(index) * padded_unit_,
                        units_[unit].slice * comm_.size());
}

Tensor FullyShardedDataParallel::param_shard(int unit) const {
  return param_shards_.flat_range(units_[unit].shard_at, units_[unit].slice);
}

Tensor FullyShardedDataParallel::grad_shard(int unit) const {
  return grad_shards_.flat_range(units_[unit].shard_at, units_[unit].slice);
}

FullyShardedDataParallel::Slot* FullyShardedDataParallel::holding(std::vector<Slot>& slots,
                                                                  int unit) {
  for (Slot& s : slots)
    if (s.unit == unit) return &s;
  return nullptr;
}

FullyShardedDataParallel::Slot& FullyShardedDataParallel::least_recently_used_free(
    std::vector<Slot>& slots, const char* what) {
  Slot* best = nullptr;
  for (Slot& s : slots)
    if (!s.in_use && (!best || s.last_use < best->last_use)) best = &s;
  TS_CHECK(best, "FSDP: every {} slot is in use", what);
  return *best;
}

void FullyShardedDataParallel::wait_for(Communicator& comm, int mark) {
  if (mark >= 0) comm.wait_comm_mark(mark);
}

// Queued on `lane` after the compute queued so far, so the slot's previous unit has been read.
void FullyShardedDataParallel::gather(int unit, Slot& slot, Lane lane) {
  for (Slot& other : param_slots_)
    if (other.unit == unit && !other.in_use) other.unit = -1;  // one slot per unit
  gathers_.all_gather(param_slot(slot, unit), param_shard(unit), lane);
  slot.unit = unit;
  slot.last_use = ++uses_;
  slot.mark = -1;
  if (lane == Lane::Comm) {
    comm_pending_ = true;
    slot.mark = gathers_.comm_mark();
  }
}

void FullyShardedDataParallel::params_needed(int unit, int next) {
  checkpoint_unit_ = -1;
  Slot* slot = holding(param_slots_, unit);
  if (!slot) {
    slot = &least_recently_used_free(param_slots_, "parameter");
    gather(unit, *slot, Lane::Comm);
  }
  wait_for(gathers_, slot->mark);
  slot->mark = -1;
  slot->in_use = true;
  slot->last_use = ++uses_;
  model_.bind_unit_params(unit, param_slot(*slot, unit));
  // Prefetch into a free slot; without one the next unit is gathered when needed.
  const bool slot_free = std::any_of(param_slots_.begin(), param_slots_.end(),
                                     [](const Slot& s) { return !s.in_use; });
  if (next >= 0 && slot_free && !holding(param_slots_, next))
    gather(next, least_recently_used_free(param_slots_, "parameter"), Lane::Comm);
}

void FullyShardedDataParallel::params_done(int unit) {
  Slot* slot = holding(param_slots_, unit);
  TS_CHECK(slot && slot->in_use, "FSDP: unit {} was not gathered", unit);
  slot->in_use = false;
}

void FullyShardedDataParallel::grads_needed(int unit) {
  Slot& slot = least_recently_used_free(grad_slots_, "gradient");
  // The slot's last reduce-scatter must have read it; accumulating, this unit's last one
  // must have written the shard copied in below.
  wait_for(comm_, std::max(slot.mark, accumulate_ ? units_[unit].reduce_mark : -1));
  const Tensor g = grad_slot(slot, unit);
  Backend& b = model_.backend();
  if (accumulate_) {  // the own slice starts from the shard, the others from zero
    const int64_t n = units_[unit].slice, own = comm_.rank() * n;
    if (own > 0) b.fill(g.flat_range(0, own), 0.0f);
    b.copy(g.flat_range(own, n), grad_shard(unit));
    if (own + n < g.numel()) b.fill(g.flat_range(own + n, g.numel() - own - n), 0.0f);
  } else {
    b.fill(g, 0.0f);
  }
  slot.unit = unit;
  slot.in_use = true;
  slot.last_use = ++uses_;
  model_.bind_unit_grads(unit, g);
}

void FullyShardedDataParallel::grads_ready(int unit) {
  Slot* slot = holding(grad_slots_, unit);
  TS_CHECK(slot && slot->in_use, "FSDP: unit {} has no gradient slot", unit);
  comm_.reduce_scatter(grad_shard(unit), grad_slot(*slot, unit), Lane::Comm);
  comm_pending_ = true;
  slot->mark = units_[unit].reduce_mark = comm_.comm_mark();
  slot->in_use = false;
  slot->unit = -1;
}

void FullyShardedDataParallel::begin_micro_batch(bool /*last*/) {
  accumulate_ = step_started_;
  step_started_ = true;
}

// Marks are valid only until the next wait_comm(), after which nothing is pending.
void FullyShardedDataParallel::forget_marks() {
  for (Slot& s : param_slots_) s.mark = -1;
  for (Slot& s : grad_slots_) s.mark = -1;
  for (Unit& u : units_) u.reduce_mark = -1;
}

void FullyShardedDataParallel::settle() {
  if (!comm_pending_) return;
  comm_.wait_comm();
  gathers_.wait_comm();
  comm_pending_ = false;
  forget_marks();
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
  const int64_t rank = comm_.rank();
  for (const Unit& u : units_) {
    const int64_t own = u.range.begin + rank * u.slice;
    const int64_t lo = std::max({range.begin, own, u.range.begin});
    const int64_t hi = std::min({range.end, own + u.slice, u.range.end});
    if (hi > lo) pieces.push_back(grad_shards_.flat_range(u.shard_at + (lo - own), hi - lo));
  }
  return pieces;
}

void FullyShardedDataParallel::params_updated() {
  for (Slot& s : param_slots_) s.unit = -1;  // stale
  step_started_ = false;
  checkpoint_unit_ = -1;
}

// Every rank gathers each unit once, in order, on the compute lane; rank 0 reads from it.
Tensor FullyShardedDataParallel::gathered_param(int index) {
  const ParamInfo& p = model_.layout().params[index];
  Slot& slot = param_slots_.front();
  if (checkpoint_unit_ != p.unit) {
    settle();
    gather(p.unit, slot, Lane::Compute);
    checkpoint_unit_ = p.unit;
  }
  return param_slot(slot, p.unit)
      .flat_range(p.offset - units_[p.unit].range.begin, p.numel())
      .view(p.shape);
}

void FullyShardedDataParallel::follow_gathers() {
  settle();
  for (int u = 0; u < static_cast<int>(units_.size()); ++u)
    gather(u, param_slots_.front(), Lane::Compute);
}

}  // namespace tessera::dist
