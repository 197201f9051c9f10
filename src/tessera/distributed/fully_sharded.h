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
// Before the backward writes a unit's gradients they get a zeroed gradient slot. Once final,
// the slot goes through an all-to-all on the communication stream (rank r receives slice r
// from every rank) into one of two staging buffers, overlapping the backward of the units
// below; compute then sums the received slices into the rank's gradient shard (the first
// micro-batch of a step writes it, later ones add), one unit behind, when the staging buffer is
// needed again or the step's reduction finishes, so it never waits for the transfer. This is a
// reduce-scatter whose transfer takes no SM (see below) and whose sum is a short kernel: NCCL's
// reduce-scatter kernel holds SMs for the whole transfer, and a GEMM that needs every SM waits
// for them, which cost the full Llama 3.1 8B on two H200s 6% of its step.
// Two parameter and two gradient slots; three each when the head is tied to the embedding
// table, whose unit is then needed during the head as well.
// Shards, slots and staging buffers are collective buffers (communicator.h): under NCCL on one
// node the gathers and all-to-alls run on the copy engines.
#include <cstdint>
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
  void begin_micro_batch(bool /*last*/) override {}
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
    bool summed = false;   // its gradient shard holds this step's sum so far
  };
  // A unit's gradients received into staging buffer `staging`, not yet summed.
  struct Received {
    int unit = -1, staging = 0;
    int mark = -1;  // comm mark after its all-to-all (-1: done)
  };
  static constexpr int kStagingBuffers = 2;
  struct Slot {
    int unit = -1;        // whose parameters or gradients it holds (-1: none)
    int mark = -1;        // comm mark after the last collective on it (-1: done)
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
  Tensor staging(int index, int unit) const;
  // Sums the slices of `r` into its unit's gradient shard (queued on compute).
  void sum_received(const Received& r);
  Slot* holding(std::vector<Slot>& slots, int unit);
  Slot& least_recently_used_free(std::vector<Slot>& slots, const char* what);
  void gather(int unit, Slot& slot, Lane lane);
  void wait_for(int mark);
  void forget_marks();

  std::vector<Unit> units_;
  int64_t padded_unit_ = 0;  // the largest W x n_u: a slot's elements
  CollectiveBuffer shard_buffer_, grad_shard_buffer_, slot_buffer_, grad_slot_buffer_,
      staging_buffer_;
  Tensor param_shards_, grad_shards_;
  std::vector<Slot> param_slots_, grad_slots_;
  std::vector<Received> received_;  // oldest first, at most kStagingBuffers
  int next_staging_ = 0;
  uint64_t uses_ = 0;
  bool comm_pending_ = false;  // Lane::Comm work compute has not waited for
  int checkpoint_unit_ = -1;   // the unit gathered_param last gathered
};

}  // namespace tessera::dist
