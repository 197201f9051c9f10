#pragma once
// AdamW over the model's flat parameter buffer: fp32 master weights (aliasing the
// parameters when they are fp32 already) and fp32 moments, one fused op per step. Under
// ZeRO-1 and FSDP (dist/data_parallel.h) it holds only this rank's ranges of the flat layout:
// their master weights and moments are packed one after another, and a step updates this
// rank's copies of those ranges' parameters, which data parallelism then gathers from every
// rank.
#include <cstdint>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/model/model.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {

class AdamWOptimizer {
 public:
  // owned: what this optimizer updates, ranges in increasing order (empty: everything, in the
  // model's flat buffers).
  AdamWOptimizer(Model& model, const TrainingConfig& config, std::vector<OwnedParams> owned = {});

  // Bytes of optimizer state for `params` elements when parameters are `compute` dtype.
  static size_t state_bytes(int64_t params, DType compute);

  bool sharded() const { return sharded_; }
  std::vector<ParamRange> owned() const;
  // (P) fp32 master weights; sharded: (sum of owned counts) packed.
  Tensor master() const { return master_; }
  Tensor exp_avg() const { return exp_avg_; }        // (P) fp32 first moments
  Tensor exp_avg_sq() const { return exp_avg_sq_; }  // (P) fp32 second moments
  // Refreshes the model's compute-dtype parameters from the fp32 master weights.
  void sync_params_from_master();
  // One update at learning rate `lr`. grad_norm_sq is the device scalar of the squared
  // global gradient norm; a non-finite value leaves everything unchanged (skipped step).
  // `step` is the 1-based count of applied updates including this one.
  void step(double lr, const Tensor& grad_norm_sq, int64_t step);
  // The master weights by owned range, to initialise or load them into (then
  // sync_params_from_master()).
  std::vector<FlatSlice> master_slices() const;

 private:
  Model& model_;
  TrainingConfig config_;
  std::vector<ParamSegment> segments_;
  std::vector<OwnedParams> owned_;
  std::vector<std::vector<ParamSegment>> owned_segments_;  // segments_ clipped to each range
  bool sharded_ = false;
  DeviceBuffer master_buffer_, moments_buffer_;
  Tensor master_, exp_avg_, exp_avg_sq_;
};

}  // namespace tessera
