#pragma once
// A model split over a device mesh's tensor-parallel ranks, pipeline stages and (its experts)
// expert-parallel ranks, composed with data parallelism over its data-parallel ranks (plain
// or ZeRO-1, distributed/data_parallel.h), driven as one Parallelism. The model was built
// holding this rank's part of every split parameter (ModelRuntime::tensor_parallel_size/rank)
// and its stage's layers
// (ModelRuntime::pipeline_chunks); this layout gives it the tensor-parallel group's collectives
// (ParallelGroup, on a communicator split from the world), runs the pipeline's schedule
// (distributed/pipeline_schedule.h) over the step's micro-batches with point-to-point
// transfers between the stages, and keeps the step exact across the mesh:
//   - context-parallel ranks each hold a share of every sequence (the model's runtime) and
//     gather each other's keys and values in attention; their gradients are partial sums over
//     their tokens, reduced with the data-parallel ranks' (Megatron's dp-cp group: plain or
//     ZeRO-1 over data x context parallel ranks);
//   - with sequence parallelism each rank's gradients of replicated parameters (the norms) are
//     sums over its own tokens: they are summed over the tensor-parallel group once per step,
//     after the data-parallel reduction (the two sums commute);
//   - the gradient norm counts every element of the whole model once: split parameters on
//     every tensor-parallel rank, replicated ones and expert stacks (the same on every
//     tensor-parallel rank) on rank 0 only (Megatron's param_is_not_tensor_parallel_duplicate),
//     summed over the tensor-parallel ranks and the pipeline stages;
//   - with pipeline parallelism the data-parallel gradient reduction runs after the step's
//     last pass (a stage's backward passes of different micro-batches interleave with its
//     forwards, so no bucket is final earlier);
//   - with expert parallelism (beside tensor-parallel ranks and pipeline stages) each
//     tensor-parallel part's and stage's data-parallel ranks are
//     re-split into expert x expert-data-parallel ranks (Megatron's expert layout): the MoE
//     layers send their rows to the experts' ranks of the stage (the model's expert exchange
//     over the expert-parallel group), the experts' gradients are reduced over the
//     expert-data-parallel ranks and the rest over the stage's data-parallel ranks, and the
//     gradient norm sums the experts' squares over the expert-parallel ranks;
//   - losses are summed over the data and context-parallel ranks and the pipeline stages (the
//     last one holds them; tensor-parallel ranks each hold the whole loss), FP8 amaxes maxed
//     over the tensor, data and context-parallel ranks (a stage's own linears), the FP8 status
//     summed and stop signals maxed over the whole job.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/distributed/communicator.h"
#include "tessera/distributed/data_parallel.h"
#include "tessera/distributed/device_mesh.h"
#include "tessera/distributed/expert_exchange.h"
#include "tessera/distributed/parallelism.h"
#include "tessera/distributed/pipeline_schedule.h"
#include "tessera/model/model.h"
#include "tessera/ops/device_buffer.h"

namespace tessera::dist {

// A model's group collectives (ParallelGroup) on a communicator's compute stream.
class CommunicatorGroup final : public ParallelGroup {
 public:
  explicit CommunicatorGroup(Communicator& comm) : comm_(comm) {}
  void all_reduce(const Tensor& t) override { comm_.all_reduce(t, ReduceOp::Sum, Lane::Compute); }
  void all_gather(const Tensor& out, const Tensor& in) override {
    comm_.all_gather(out, in, Lane::Compute);
  }
  void reduce_scatter(const Tensor& out, const Tensor& in) override {
    comm_.reduce_scatter(out, in, Lane::Compute);
  }

 private:
  Communicator& comm_;
};

class MeshParallelism final : public Parallelism {
 public:
  // Collective over `world` (it splits the mesh's groups from it). The model must have been
  // built for this rank's place in `mesh` (make_run_setup).
  MeshParallelism(Communicator& world, const DeviceMesh& mesh, Model& model,
                  const DataParallelOptions& data_parallel);
  ~MeshParallelism() override;

  int rank() const override { return world_.rank(); }
  int world_size() const override { return world_.size(); }
  int data_parallel_rank() const override;
  int data_parallel_size() const override;
  std::string description() const override;

  std::vector<OwnedParams> optimizer_shards() const override;
  void run_micro_batches(int64_t count, float grad_scale, const std::function<void(int64_t)>& load,
                         const std::function<void(int64_t)>& run) override;
  void run_forward_passes(int64_t count, const std::function<void(int64_t)>& load,
                          const std::function<void(int64_t)>& run) override;
  void run_scaled_micro_batches(int64_t count, float grad_scale,
                                const std::function<void(int64_t)>& load,
                                const std::function<std::vector<float>(int64_t)>& head_scales) override;
  void begin_micro_batch(bool last) override;
  void finish_gradient_reduction() override;
  void grad_norm_sq(const Tensor& out) override;
  void params_updated() override;
  void params_complete() override {
    if (data_) data_->params_complete();
  }
  bool params_sharded() const override { return data_ && data_->params_sharded(); }
  Tensor gathered_param(int index) override {
    return data_ ? data_->gathered_param(index) : model_.param(index);
  }
  void follow_gathers() override {
    if (data_) data_->follow_gathers();
  }

  void sum(const Tensor& t) override;
  void sum_over_sequence(const Tensor& t) override;
  void max(const Tensor& t) override;
  void max_over_replicas(const Tensor& t) override;
  void sum_over_job(const Tensor& t) override;
  void barrier() override;

 private:
  // Waits for the data-parallel collectives still in flight (before any on compute).
  void settle();
  // The pipeline's schedule for `count` micro-batches, made once.
  const PipelineSchedule& schedule(int64_t count, bool with_backward);
  // Runs this stage's steps of `schedule`: its passes, each stage's transfers after each step.
  // With head_scales, the head's forward keeps its logit gradients and its backward takes
  // head_scales(m) (run_scaled_micro_batches).
  void run_schedule(const PipelineSchedule& schedule, bool with_backward, float grad_scale,
                    const std::function<void(int64_t)>& load,
                    const std::function<std::vector<float>(int64_t)>& head_scales = {});

  Communicator& world_;
  DeviceMesh mesh_;
  Model& model_;
  // Groups: tensor-parallel, context-parallel, the ranks that reduce gradients together (dp x
  // cp), FP8 amaxes (tp x dp x cp), pipeline stages, and the model's parts (tp x pp: the
  // gradient norm).
  std::unique_ptr<Communicator> tp_comm_, cp_comm_, data_comm_, amax_comm_, pp_comm_, model_comm_;
  std::unique_ptr<CommunicatorGroup> tp_group_, cp_group_;
  // Expert parallelism: the stage's expert-parallel and expert-data-parallel groups (the
  // latter null when alone) and the model's exchange over the former.
  std::unique_ptr<Communicator> ep_comm_, expert_data_comm_;
  std::unique_ptr<CommExpertExchange> exchange_;
  std::map<std::pair<int64_t, bool>, std::unique_ptr<PipelineSchedule>> schedules_;
  std::unique_ptr<DataParallelism> data_;  // null with one data x context-parallel rank
  // Replicated parameters whose gradients are partial sums over the tensor-parallel ranks:
  // over sequence shards (norms under sequence parallelism), or over a split layer's slices
  // (TensorParallelStyle::ReplicatedPartialGrads).
  std::vector<int> partial_grads_;
  // What of the flat gradient buffer this rank counts in the norm (before ZeRO-1's shards).
  std::vector<ParamRange> counted_;
  DeviceBuffer barrier_buffer_;
};

}  // namespace tessera::dist
