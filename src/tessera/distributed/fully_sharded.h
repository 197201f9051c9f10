#pragma once
// FSDP (ZeRO-3, use_torch_fsdp2): every rank keeps only its shard of each parameter unit
// (ParamLayout::units: the embedding, each decoder layer, the final norm with the output
// head): its compute-dtype parameters (ShardedUnits: gathered per unit just in time) and
// gradients (fp32, or bf16 with main_grads_dtype) here, its master weights and AdamW moments
// in the optimizer.
// Before the backward writes a unit's gradients they get a zeroed gradient slot; once final,
// the slot is reduce-scattered into the rank's gradient shard on the communication stream,
// overlapping the backward of the units below. From a step's second micro-batch on, a unit's
// slot starts from the rank's own shard in its slice, so the reduce-scatter accumulates.
// As many gradient slots as parameter slots. With FP8 weights cached for the step (and
// ModelRuntime::fp8_unit_copies), a unit is gathered only until its FP8 codes are cached: from
// the first micro-batch's backward on, its passes read those and the model's copies of its
// norms and biases (on the full Llama 3.1 8B, 32 of the 34 units need no gather after that).
//
// A model with frozen weights apart from its parameters (LoRA: Model::frozen_layout) shards
// those instead (FrozenShardedDataParallel): they are what is large, and never change; its
// few trained parameters are reduced as by ZeRO-1.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/distributed/data_parallel.h"
#include "tessera/distributed/sharded_units.h"

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
  struct Slot {
    int unit = -1;        // whose gradients it holds (-1: none)
    int mark = -1;        // the group's mark after the last reduce-scatter from it (-1: done)
    bool in_use = false;  // between grads_needed and grads_ready
    uint64_t last_use = 0;
  };

  void params_needed(int unit, int next) override;
  void params_done(int unit) override;
  void grads_needed(int unit) override;
  void grads_ready(int unit) override;
  void settle() override;

  Tensor grad_slot(const Slot& s, int unit) const;
  Tensor grad_shard(int unit) const;
  Slot& least_recently_used_free();

  ShardedUnits params_;
  DeviceBuffer grad_shard_buffer_, grad_slot_buffer_;
  Tensor grad_shards_;
  std::vector<Slot> grad_slots_;
  std::vector<int> reduce_marks_;  // per unit: the group's mark after its last reduce-scatter
  std::vector<char> from_copies_;  // per unit: read from the model's copies, not gathered
  uint64_t uses_ = 0;
  bool comm_pending_ = false;  // reduce-scatters compute has not waited for
  bool step_started_ = false;  // a micro-batch of the current step ran
  bool accumulate_ = false;    // this micro-batch adds to the shards' gradients
};

// FSDP of a model with frozen weights (Model::frozen_layout: LoRA's base): the frozen units
// are sharded and gathered just in time (ShardedUnits, the model's FrozenUnitSource), the
// trained parameters kept whole on every rank with their gradients reduce-scattered and their
// optimizer state sharded (ZeRO-1). The model must have been built with
// runtime.sharded_params and runtime.flat_buffer_multiple = flat_buffer_multiple(comm.size()).
class FrozenShardedDataParallel final : public DataParallel {
 public:
  FrozenShardedDataParallel(Communicator& comm, Model& model, const DataParallelOptions& options);
  ~FrozenShardedDataParallel() override;
  std::string description() const override;

 private:
  void settle() override;
  ShardedUnits frozen_;
};

}  // namespace tessera::dist
