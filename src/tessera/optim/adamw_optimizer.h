#pragma once
// AdamW over the model's flat parameter buffer, one fused op per step. Its state is stored
// in the dtypes of Megatron's precision-aware optimizer (OptimizerDtypes): fp32 master weights
// (aliasing the parameters when they are fp32 already) or none (the bf16 parameters are the
// master), and fp32 or bf16 moments; the update's arithmetic is fp32 in every case. Under
// ZeRO-1 and FSDP (dist/data_parallel.h) it holds only this rank's ranges of the flat layout:
// their master weights and moments are packed one after another, and a step updates this
// rank's copies of those ranges' parameters, which data parallelism then gathers from every
// rank.
#include <cstdint>
#include <functional>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/model/model.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {

// The dtypes AdamW keeps its state in (the gradients' dtype is the model's,
// ModelRuntime::grad_dtype).
struct OptimizerDtypes {
  DType main_params = DType::F32;  // F32: an fp32 master copy; BF16: none (bf16 parameters)
  DType exp_avg = DType::F32;
  DType exp_avg_sq = DType::F32;
  // An fp32 master beside bf16 parameters kept as its low halves only, the parameters being
  // its high halves (store_param_remainders, core/split_master.h).
  bool split_master = true;
  static OptimizerDtypes from(const TrainingConfig& t);
};

class AdamWOptimizer {
 public:
  // owned: what this optimizer updates, ranges in increasing order (empty: everything, in the
  // model's flat buffers).
  AdamWOptimizer(Model& model, const TrainingConfig& config, std::vector<OwnedParams> owned = {});

  // Device bytes the constructor allocates for `params` elements (the sum of the owned
  // ranges) when parameters are `compute` dtype: master weights unless they alias the
  // parameters (fp32 parameters of an unsharded run) or are the parameters (bf16 main
  // parameters), and the two moments.
  static size_t state_bytes(int64_t params, DType compute, const OptimizerDtypes& dtypes,
                            bool sharded);

  // The segments of each fused AdamW call of a step, relative to its owned range: the
  // layout's decay segments clipped to each range of `owned` (a call per range).
  static std::vector<std::vector<ParamSegment>> step_segments(const ParamLayout& layout,
                                                              const std::vector<ParamRange>& owned);

  // Whether fp32 master weights are allocated apart from the compute-dtype parameters: not
  // when the parameters are the master (bf16 main parameters) or already are fp32 master
  // weights of the whole layout (fp32 parameters of an unsharded run).
  static bool keeps_master_copy(DType compute, const OptimizerDtypes& dtypes, bool sharded);
  bool keeps_master_copy() const { return keeps_master_copy(model_.runtime().compute_dtype, dtypes_, sharded_); }
  // Whether that copy is split (core/split_master.h): 2 bytes a parameter, its other half the
  // bf16 parameters, so that writing the parameters writes the master too.
  static bool splits_master(DType compute, const OptimizerDtypes& dtypes, bool sharded);
  bool splits_master() const { return splits_master(model_.runtime().compute_dtype, dtypes_, sharded_); }
  // Whether sync_params_from_master() can bring the parameters back after others overwrote
  // them (a frozen reference's weights): an fp32 copy that is whole.
  static bool restores_params(DType compute, const OptimizerDtypes& dtypes, bool sharded) {
    return keeps_master_copy(compute, dtypes, sharded) && !splits_master(compute, dtypes, sharded);
  }
  bool restores_params() const { return restores_params(model_.runtime().compute_dtype, dtypes_, sharded_); }

  bool sharded() const { return sharded_; }
  std::vector<ParamRange> owned() const;
  // The compute-dtype parameters it updates, by owned range (unsharded: all of them).
  const std::vector<OwnedParams>& owned_params() const { return owned_; }
  const OptimizerDtypes& dtypes() const { return dtypes_; }
  // bf16 main parameters: no master copy; master_slices() are the parameters.
  bool params_are_master() const { return params_are_master_; }
  // (P) master weights, fp32 (sharded: the owned counts packed), or split: their uint16 low
  // halves so packed, the owned params their high halves; with bf16 main parameters the
  // parameters themselves (bf16), packed views only when unsharded.
  Tensor master() const { return master_; }
  Tensor exp_avg() const { return exp_avg_; }        // (P) first moments, dtypes().exp_avg
  Tensor exp_avg_sq() const { return exp_avg_sq_; }  // (P) second moments
  // The moments' device memory as bytes (U8), which others may fill between stash_moments()
  // (the moments copied to host memory) and restore_moments() (copied back): GRPO's KV cache
  // while a batch generates (grpo_offload_optimizer_state).
  Tensor moments_region() const;
  // Allocates the host copy (page-locked: seconds for tens of GB), else done by the first stash.
  void reserve_moments_stash();
  void stash_moments();
  // Returns once the moments are back on the device.
  void restore_moments();
  // Refreshes the model's compute-dtype parameters from the fp32 master weights.
  void sync_params_from_master();
  // One update at learning rate `lr`. grad_norm_sq is the device scalar of the squared
  // global gradient norm; a non-finite value leaves everything unchanged (skipped step).
  // `step` is the 1-based count of applied updates including this one.
  void step(double lr, const Tensor& grad_norm_sq, int64_t step);
  // The master weights by owned range (fp32, or the bf16 parameters with bf16 main
  // parameters); not of a split master, which write_master() fills.
  std::vector<FlatSlice> master_slices() const;
  // Calls `write` with fp32 (or, bf16 main parameters, bf16) slices by owned range to
  // initialise or load the master weights into; sync_params_from_master() then brings the
  // parameters. A split master's slices are fp32 scratch in the moments' memory, split into
  // both halves after `write` (the moments are zeroed then: only a fresh or weights-only start
  // writes so).
  void write_master(const std::function<void(const std::vector<FlatSlice>&)>& write);

 private:
  Model& model_;
  TrainingConfig config_;
  OptimizerDtypes dtypes_;
  std::vector<OwnedParams> owned_;
  std::vector<std::vector<ParamSegment>> owned_segments_;  // segments_ clipped to each range
  bool sharded_ = false;
  bool params_are_master_ = false;  // bf16 main parameters: no master copy
  DeviceBuffer master_buffer_, moments_buffer_;
  HostBuffer moments_stash_;  // allocated at the first stash_moments, kept for the next
  bool stashed_ = false;      // between stash_moments and restore_moments
  Tensor master_, exp_avg_, exp_avg_sq_;
};

}  // namespace tessera
