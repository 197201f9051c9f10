#pragma once
// AdamW over the model's flat parameter buffer: fp32 master weights (aliasing the
// parameters when they are fp32 already) and fp32 moments, one fused op per step.
#include <cstdint>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/model/llama_model.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {

class AdamWOptimizer {
 public:
  AdamWOptimizer(LlamaModel& model, const TrainingConfig& config);

  // Bytes of optimizer state for `params` elements when parameters are `compute` dtype.
  static size_t state_bytes(int64_t params, DType compute);

  Tensor master() const { return master_; }
  Tensor exp_avg() const { return exp_avg_; }        // (P) fp32 first moments
  Tensor exp_avg_sq() const { return exp_avg_sq_; }  // (P) fp32 second moments
  // Refreshes the model's compute-dtype parameters from the fp32 master weights.
  void sync_params_from_master();
  // One update at learning rate `lr`. grad_norm_sq is the device scalar of the squared
  // global gradient norm; a non-finite value leaves everything unchanged (skipped step).
  // `step` is the 1-based count of applied updates including this one.
  void step(double lr, const Tensor& grad_norm_sq, int64_t step);

 private:
  LlamaModel& model_;
  TrainingConfig config_;
  std::vector<ParamSegment> segments_;
  DeviceBuffer master_buffer_, moments_buffer_;
  Tensor master_, exp_avg_, exp_avg_sq_;
};

}  // namespace tessera
