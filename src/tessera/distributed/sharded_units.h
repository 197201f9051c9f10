#pragma once
// The parameter side of FSDP (ZeRO-3): the units of a layout (ParamLayout::units) sharded over
// a group's ranks and gathered whole just before a pass reads them. Unit u, padded to W x n_u
// elements (n_u a multiple of 64), is cut into W equal slices; rank r holds slice r.
//
// Just before the model reads a unit, the slices are all-gathered into a slot (a buffer the
// size of the largest padded unit), while the unit the model reads next is gathered into
// another slot on the communication stream. A slot is reused once the model is done with its
// unit; a unit still in a slot (the last layer between forward and backward) is not gathered
// again until the weights change. Two slots; three when the head is tied to the embedding
// table, whose unit is then needed during the head as well.
// The gathers have a communicator of their own (split from the group's, with its own stream):
// on the group's, a gather would queue behind the reduce-scatters of the units before it, and
// the layer it prefetches for would wait (on the full Llama 3.1 8B on two H200s, 200 ms of a
// 4.4 s step). Their shards and slots are collective buffers (communicator.h): under NCCL on
// one node the gathers run on the copy engines, beside the layers' kernels.
//
// FullyShardedDataParallel shards a model's parameters with it; under LoRA it shards the
// frozen base (FrozenUnitSource), whose units never change.
#include <cstdint>
#include <memory>
#include <vector>

#include "tessera/distributed/communicator.h"
#include "tessera/model/model.h"

namespace tessera::dist {

class ShardedUnits final : public FrozenUnitSource {
 public:
  // Collective: every rank of `group` constructs it at the same point (it splits the group).
  ShardedUnits(Communicator& group, Backend& backend, const ParamLayout& layout, DType dtype);
  ~ShardedUnits() override;

  // n_u: a unit's elements per rank, a multiple of 64 so every slice stays 256-byte aligned.
  static int64_t slice_elements(const ParamRange& unit, int world);
  // Device bytes a rank holds for `layout` on `world` ranks (its shards and the slots), and
  // the elements of its shards.
  struct Memory {
    size_t bytes = 0;
    int64_t shard_elements = 0;
  };
  static Memory plan_memory(const ParamLayout& layout, int world, DType dtype);
  // The number of slots; a gradient side of the same units needs as many.
  static int slot_count(const ParamLayout& layout);
  // Rank `rank`'s slice of `unit`, clipped to the unit's end (the rest is padding); empty
  // (begin >= end) where the slice is all padding.
  static ParamRange held_range(const ParamRange& unit, int world, int rank);
  // held_range of each unit that is not empty, in increasing order.
  static std::vector<ParamRange> owned_ranges(const ParamLayout& layout, int world, int rank);

  int64_t slice(int unit) const { return units_[unit].slice; }
  int64_t shard_at(int unit) const { return units_[unit].shard_at; }  // in the shard buffer
  int64_t shard_elements() const { return shard_elements_; }
  int64_t padded_unit() const { return padded_unit_; }  // a slot's elements
  // This rank's slice of unit u (n_u elements; padding beyond the unit is zero).
  Tensor shard(int unit) const;
  // This rank's slices clipped to their units (owned_ranges) with their shard memory: what
  // its weights are loaded into and its optimizer updates.
  std::vector<FlatSlice> held() const override;

  // Unit u whole (units[u].count() elements from its slot's start), ready for compute queued
  // from now on until unit_done(u); `next` (-1: none) is gathered ahead when a slot is free.
  Tensor unit_needed(int unit, int next) override;
  void unit_done(int unit) override;
  // Unit u gathered ahead on the communication lane, as unit_needed does for its `next`.
  void prefetch(int unit);
  // The shards changed (an optimizer step, loading): no slot holds a current unit.
  void shards_updated();
  // Unit u gathered on the compute lane into the first slot, for a reader outside the passes
  // (checkpoint writing); it stays there until the next unit_needed or shards_updated.
  Tensor gather_now(int unit);
  // Every unit gathered in order on the compute lane (a rank that must join the others'
  // gathers without reading them).
  void follow_all();
  // Compute waits for every gather in flight.
  void settle();

 private:
  struct Unit {
    ParamRange range;      // in the flat layout
    int64_t slice = 0;     // n_u
    int64_t shard_at = 0;  // where this rank's slice starts in the shard buffer
  };
  struct Slot {
    int unit = -1;         // whose weights it holds (-1: none)
    int mark = -1;         // gathers_' mark after its gather (-1: done)
    bool in_use = false;   // between unit_needed and unit_done
    uint64_t last_use = 0;
  };
  Tensor slot_tensor(const Slot& s, int unit) const;
  Slot* holding(int unit);
  Slot& least_recently_used_free();
  void gather(int unit, Slot& slot, Lane lane);

  DType dtype_;
  int rank_ = 0, world_ = 1;
  std::vector<Unit> units_;
  int64_t shard_elements_ = 0, padded_unit_ = 0;
  std::unique_ptr<Communicator> gather_comm_;
  Communicator& gathers_;  // *gather_comm_
  CollectiveBuffer shard_buffer_, slot_buffer_;
  Tensor shards_;
  std::vector<Slot> slots_;
  uint64_t uses_ = 0;
  bool pending_ = false;       // Lane::Comm gathers compute has not waited for
  int gathered_now_ = -1;      // the unit gather_now last put in the first slot
};

}  // namespace tessera::dist
