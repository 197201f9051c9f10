#pragma once
// What the trainer asks of a run's parallel layout, whatever it is, in the order of a step.
// parallelize() (distributed/parallelize.h) returns one; on a single device it is the
// single-device step, so the trainer never branches on the world size.
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/core/tensor.h"
#include "tessera/model/param_layout.h"
#include "tessera/model/step_hook.h"
#include "tessera/ops/backend.h"

namespace tessera::dist {

// The step hooks (model/step_hook.h) reduce with it as their StepCollectives.
class Parallelism : public StepCollectives {
 public:
  Parallelism() = default;
  virtual ~Parallelism() = default;
  Parallelism(const Parallelism&) = delete;
  Parallelism& operator=(const Parallelism&) = delete;

  // This rank in the job (logs, checkpoints) and in the data-parallel group (which samples
  // it reads: Megatron's sampler order over data-parallel ranks).
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual int data_parallel_rank() const = 0;
  virtual int data_parallel_size() const = 0;
  // For the log: "ZeRO-1 optimizer shards, 7 gradient buckets, ...".
  virtual std::string description() const = 0;

  // What this rank's optimizer updates (empty: everything, in the model's buffers).
  virtual std::vector<OwnedParams> optimizer_shards() const = 0;
  // Runs a step's `count` micro-batches: load(m) puts micro-batch m's samples into the model,
  // run(m) runs its forward and backward (the trainer's: begin_micro_batch, then
  // Model::forward_backward). One after another here; a pipeline runs its schedule of the
  // stages' passes instead, loading each micro-batch where its stage needs it.
  virtual void run_micro_batches(int64_t count, float grad_scale,
                                 const std::function<void(int64_t)>& load,
                                 const std::function<void(int64_t)>& run) {
    (void)grad_scale;
    for (int64_t m = 0; m < count; ++m) load(m), run(m);
  }
  // A pipeline's step whose micro-batches learn their loss scales from their own forward (DPO's
  // pairs, a micro-batch of both answers): the head keeps its logit gradients
  // (keep_logit_grads), and before its backward head_scales(m) gives micro-batch m's scale per
  // sequence (Model::kept_head_backward); the other chunks' passes take grad_scale. Only
  // pipelines schedule these passes; without one the trainer runs them itself.
  virtual void run_scaled_micro_batches(
      int64_t count, float grad_scale, const std::function<void(int64_t)>& load,
      const std::function<std::vector<float>(int64_t)>& head_scales) {
    (void)count, (void)grad_scale, (void)load, (void)head_scales;
    throw InternalError("run_scaled_micro_batches without pipeline stages");
  }
  // The same for forward passes only (evaluation): run(m) is Model::forward_loss.
  virtual void run_forward_passes(int64_t count, const std::function<void(int64_t)>& load,
                                  const std::function<void(int64_t)>& run) {
    for (int64_t m = 0; m < count; ++m) load(m), run(m);
  }
  // Before each micro-batch's forward/backward; `last` marks the step's last one.
  virtual void begin_micro_batch(bool last) = 0;
  // After the last micro-batch: makes the compute stream wait for every gradient reduction.
  virtual void finish_gradient_reduction() = 0;
  // out (1) fp32 = squared norm of the (mean) gradient of the global batch.
  virtual void grad_norm_sq(const Tensor& out) = 0;
  // After the optimizer step: brings every rank's updated parameters where the next forward
  // reads them (or lets it gather them as it goes).
  virtual void params_updated() = 0;
  // Waits until what params_updated brings is in place, for a reader outside the model's
  // passes (generation from the policy's weights); the passes themselves wait as they go.
  virtual void params_complete() {}

  // Checkpoints. When parameters are sharded (FSDP), a parameter is read by gathering it: rank
  // 0 calls gathered_param for every parameter in layout order while each other rank calls
  // follow_gathers() once; the tensor is valid until the next call.
  virtual bool params_sharded() const { return false; }
  virtual Tensor gathered_param(int index) = 0;
  virtual void follow_gathers() {}

  // In place: the sum over the ranks that hold other samples' losses (data parallel), once
  // each: the ranks that split one model (tensor parallel) hold the same loss.
  void sum(const Tensor& t) override = 0;
  // In place: the sum over the ranks that hold parts of the same sequences (context
  // parallel), such as a sequence's summed token losses; nothing where a rank holds them whole.
  virtual void sum_over_sequence(const Tensor& t) { (void)t; }
  // In place: the maximum over every rank of the job (stop signals, time limits).
  virtual void max(const Tensor& t) = 0;
  // In place: the maximum over the ranks that hold the same parameters (data parallel, and the
  // parts of tensor-parallel ones), so that every rank derives the same from it (FP8 amaxes).
  void max_over_replicas(const Tensor& t) override { max(t); }
  // In place: the sum over every rank of the job (a step hook's status: a NaN on one rank
  // skips the step on all of them).
  void sum_over_job(const Tensor& t) override { sum(t); }
  // Returns on each rank once every rank has called it (steps of a sharded checkpoint save).
  virtual void barrier() = 0;
};

// Host values summed over the ranks as Parallelism::sum sums a tensor: through `scratch`, fp32
// on `backend`'s device with room for all of them.
inline void sum_host_values(Parallelism& parallel, Backend& backend, const Tensor& scratch, std::span<float> values) {
  const Tensor t = scratch.flat_range(0, static_cast<int64_t>(values.size()));
  backend.upload(t, values.data());
  parallel.sum(t);
  backend.download(values.data(), t);
}

}  // namespace tessera::dist
