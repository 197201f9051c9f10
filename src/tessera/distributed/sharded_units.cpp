#include "tessera/distributed/sharded_units.h"

#include <algorithm>

#include "tessera/core/error.h"
#include "tessera/distributed/data_parallel.h"

namespace tessera::dist {

int64_t ShardedUnits::slice_elements(const ParamRange& unit, int world) {
  const int64_t g = flat_buffer_multiple(world);
  return (unit.count() + g - 1) / g * g / world;
}

int ShardedUnits::slot_count(const ParamLayout& layout) {
  return layout.lm_head == layout.embedding ? 3 : 2;
}

ShardedUnits::Memory ShardedUnits::plan_memory(const ParamLayout& layout, int world, DType dtype) {
  Memory m;
  int64_t padded = 0;
  for (const ParamRange& u : layout.units) {
    const int64_t n = slice_elements(u, world);
    m.shard_elements += n;
    padded = std::max(padded, n * world);
  }
  m.bytes = static_cast<size_t>(m.shard_elements + slot_count(layout) * padded) * dtype_size(dtype);
  return m;
}

ParamRange ShardedUnits::held_range(const ParamRange& unit, int world, int rank) {
  const int64_t slice = slice_elements(unit, world);
  const int64_t begin = unit.begin + rank * slice;
  return {begin, std::min(begin + slice, unit.end)};
}

std::vector<ParamRange> ShardedUnits::owned_ranges(const ParamLayout& layout, int world, int rank) {
  std::vector<ParamRange> out;
  for (const ParamRange& unit : layout.units) {
    const ParamRange r = held_range(unit, world, rank);
    if (r.begin < r.end) out.push_back(r);
  }
  return out;
}

ShardedUnits::ShardedUnits(Communicator& group, Backend& backend, const ParamLayout& layout, DType dtype)
    : dtype_(dtype),
      rank_(group.rank()),
      world_(group.size()),
      gather_comm_(group.split(0, group.rank(), "fsdp_gather")),
      gathers_(*gather_comm_) {
  for (const ParamRange& r : layout.units) {
    Unit u;
    u.range = r;
    u.slice = slice_elements(r, world_);
    u.shard_at = shard_elements_;
    shard_elements_ += u.slice;
    padded_unit_ = std::max(padded_unit_, u.slice * world_);
    units_.push_back(u);
  }
  slots_.resize(slot_count(layout));
  // The gathers read and write collective buffers (communicator.h), so that they can leave
  // the SMs to the layers they overlap.
  shard_buffer_ = gathers_.collective_buffer(backend, shard_elements_ * dtype_size(dtype), "parameter shard");
  slot_buffer_ = gathers_.collective_buffer(
      backend, static_cast<int64_t>(slots_.size()) * padded_unit_ * dtype_size(dtype), "gathered parameters");
  shards_ = shard_buffer_.tensor(dtype, {shard_elements_});
  // Slice padding beyond a unit's end is gathered with the rest: keep it zero.
  backend.fill(shards_, 0.0f);
}

ShardedUnits::~ShardedUnits() = default;

Tensor ShardedUnits::shard(int unit) const {
  return shards_.flat_range(units_[unit].shard_at, units_[unit].slice);
}

std::vector<FlatSlice> ShardedUnits::held() const {
  std::vector<FlatSlice> out;
  for (const Unit& u : units_) {
    const ParamRange r = held_range(u.range, world_, rank_);
    if (r.begin < r.end) out.push_back({r, shards_.flat_range(u.shard_at, r.count())});
  }
  return out;
}

Tensor ShardedUnits::slot_tensor(const Slot& s, int unit) const {
  const auto index = static_cast<int64_t>(&s - slots_.data());
  const Tensor all = slot_buffer_.tensor(dtype_, {static_cast<int64_t>(slots_.size()) * padded_unit_});
  return all.flat_range(index * padded_unit_, units_[unit].slice * world_);
}

ShardedUnits::Slot* ShardedUnits::holding(int unit) {
  for (Slot& s : slots_)
    if (s.unit == unit) return &s;
  return nullptr;
}

ShardedUnits::Slot& ShardedUnits::least_recently_used_free() {
  Slot* best = nullptr;
  for (Slot& s : slots_)
    if (!s.in_use && (!best || s.last_use < best->last_use)) best = &s;
  TS_CHECK(best, "FSDP: every parameter slot is in use");
  return *best;
}

// Queued on `lane` after the compute queued so far, so the slot's previous unit has been read.
void ShardedUnits::gather(int unit, Slot& slot, Lane lane) {
  for (Slot& other : slots_)
    if (other.unit == unit && !other.in_use) other.unit = -1;  // one slot per unit
  gathers_.all_gather(slot_tensor(slot, unit), shard(unit), lane);
  slot.unit = unit;
  slot.last_use = ++uses_;
  slot.mark = -1;
  if (lane == Lane::Comm) {
    pending_ = true;
    slot.mark = gathers_.comm_mark();
  }
}

Tensor ShardedUnits::unit_needed(int unit, int next) {
  gathered_now_ = -1;
  Slot* slot = holding(unit);
  if (!slot) {
    slot = &least_recently_used_free();
    gather(unit, *slot, Lane::Comm);
  }
  if (slot->mark >= 0) gathers_.wait_comm_mark(slot->mark);
  slot->mark = -1;
  slot->in_use = true;
  slot->last_use = ++uses_;
  const Tensor whole = slot_tensor(*slot, unit);
  if (next >= 0) prefetch(next);
  return whole;
}

// Into a free slot; without one the unit is gathered when needed.
void ShardedUnits::prefetch(int unit) {
  const bool slot_free = std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) { return !s.in_use; });
  if (slot_free && !holding(unit)) gather(unit, least_recently_used_free(), Lane::Comm);
}

void ShardedUnits::unit_done(int unit) {
  Slot* slot = holding(unit);
  TS_CHECK(slot && slot->in_use, "FSDP: unit {} was not gathered", unit);
  slot->in_use = false;
}

void ShardedUnits::shards_updated() {
  for (Slot& s : slots_) s.unit = -1;  // stale
  gathered_now_ = -1;
}

Tensor ShardedUnits::gather_now(int unit) {
  Slot& slot = slots_.front();
  if (gathered_now_ != unit) {
    settle();
    gather(unit, slot, Lane::Compute);
    gathered_now_ = unit;
  }
  return slot_tensor(slot, unit);
}

void ShardedUnits::follow_all() {
  settle();
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) gather(u, slots_.front(), Lane::Compute);
}

// Marks are valid only until the next wait_comm(), after which nothing is pending.
void ShardedUnits::settle() {
  if (!pending_) return;
  gathers_.wait_comm();
  pending_ = false;
  for (Slot& s : slots_) s.mark = -1;
}

}  // namespace tessera::dist
