#pragma once
// FSDP (ZeRO-3, use_torch_fsdp2): every rank keeps only its shard of each parameter unit
// (ParamLayout::units: the embedding, each decoder layer, the final norm with the output
// head): its compute-dtype parameters and gradients (fp32, or bf16 with main_grads_dtype) here,
// its master weights and AdamW moments in the optimizer. Unit u, padded to W x n_u elements (n_u a
// multiple of 64), is cut into W equal slices; rank r holds slice r.
//
// Just before the model reads a unit, the slices are all-gathered into a parameter slot (a
// buffer the size of the largest padded unit), while the unit the model reads next is
// gathered into another slot on the communication stream. A slot is reused once the model is
// done with its unit; a unit still in a slot (the last layer between forward and backward) is
// not gathered again until the parameters change.
// Before the backward writes a unit's gradients they get a zeroed gradient slot; once final,
// the slot is reduce-scattered into the rank's gradient shard on the communication stream,
// overlapping the backward of the units below. From a step's second micro-batch on, a unit's
// slot starts from the rank's own shard in its slice, so the reduce-scatter accumulates.
// Two parameter and two gradient slots; three each when the head is tied to the embedding
// table, whose unit is then needed during the head as well.
// The gathers have a communicator of their own (split from the group's, with its own stream):
// on the group's, a gather would queue behind the reduce-scatters of the units before it, and
// the layer it prefetches for would wait (on the full Llama 3.1 8B on two H200s, 200 ms of a
// 4.4 s step). Their shards and slots are collective buffers (communicator.h): under NCCL on
// one node the gathers run on the copy engines, beside the reduce-scatters' kernels.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/distributed/data_parallel.h"

namespace tessera::dist {

class FullyShardedDataParallel : public DataParallelism, private ParamUnitObserver {
 public:
  // The model must have been built with runtime.sharded_params.
  FullyShardedDataParallel(Communicator& comm, Model& model);
  ~FullyShardedDataParallel() override;

  // Device bytes a rank holds for `layout` on `world` ranks (shards and slots), and the
  // elements of its shards (an upper bound of what its optimizer holds).
  struct Memory {
    size_t weights = 0, gradients = 0;
    int64_t shard_elements = 0;
  };
  static Memory plan_memory(const ParamLayout& layout, int world, DType compute, DType grad);
  // Rank `rank`'s slice of each unit, clipped to the unit's end (the rest is padding): what
  // its optimizer updates, in increasing order.
  static std::vector<ParamRange> owned_ranges(const ParamLayout& layout, int world, int rank);

  std::string description() const override;
  std::vector<OwnedParams> optimizer_shards() const override;
  void begin_micro_batch(bool last) override;
  void finish_gradient_reduction() override;
  void grad_norm_sq(const Tensor& out) override;
  void params_updated() override;
  bool params_sharded() const override { return true; }
  // This rank's pieces of the gradient shards that lie in `range`, in order.
  std::vector<Tensor> grad_pieces(const ParamRange& range) const override;
  Tensor gathered_param(int index) override;
  void follow_gathers() override;

 private:
  struct Unit {
    ParamRange range;      // in the flat layout
    int64_t slice = 0;     // n_u: elements per rank
    int64_t shard_at = 0;  // where this rank's slice starts in the shard buffers
    int reduce_mark = -1;  // comm mark after the last reduce-scatter into the shard (-1: done)
  };
  struct Slot {
    int unit = -1;        // whose parameters or gradients it holds (-1: none)
    int mark = -1;        // mark after the last collective on it (-1: done), of gathers_ for
                          // parameter slots, of the group's communicator for gradient slots
    bool in_use = false;  // between params_needed and params_done (grads_needed, grads_ready)
    uint64_t last_use = 0;
  };

  void params_needed(int unit, int next) override;
  void params_done(int unit) override;
  void grads_needed(int unit) override;
  void grads_ready(int unit) override;
  void settle() override;

  Tensor param_slot(const Slot& s, int unit) const;
  Tensor grad_slot(const Slot& s, int unit) const;
  Tensor param_shard(int unit) const;
  Tensor grad_shard(int unit) const;
  Slot* holding(std::vector<Slot>& slots, int unit);
  Slot& least_recently_used_free(std::vector<Slot>& slots, const char* what);
  void gather(int unit, Slot& slot, Lane lane);
  // Compute waits for comm's collectives queued before mark (-1: nothing to wait for).
  static void wait_for(Communicator& comm, int mark);
  void forget_marks();

  std::vector<Unit> units_;
  int64_t padded_unit_ = 0;  // the largest W x n_u: a slot's elements
  std::unique_ptr<Communicator> gather_comm_;
  Communicator& gathers_;  // *gather_comm_
  CollectiveBuffer shard_buffer_, slot_buffer_;
  DeviceBuffer grad_shard_buffer_, grad_slot_buffer_;
  Tensor param_shards_, grad_shards_;
  std::vector<Slot> param_slots_, grad_slots_;
  uint64_t uses_ = 0;
  bool comm_pending_ = false;  // Lane::Comm work compute has not waited for
  bool step_started_ = false;  // a micro-batch of the current step ran
  bool accumulate_ = false;    // this micro-batch adds to the shards' gradients
  int checkpoint_unit_ = -1;   // the unit gathered_param last gathered
};

}  // namespace tessera::dist
