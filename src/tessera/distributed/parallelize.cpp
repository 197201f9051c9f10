#include "tessera/distributed/parallelize.h"

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/distributed/expert_exchange.h"
#include "tessera/distributed/mesh_parallelism.h"
#include "tessera/ops/device_buffer.h"

namespace tessera::dist {
namespace {

// One device: the step's collectives are the identity, the gradient norm a reduction of the
// model's own gradients.
class SingleDevice final : public Parallelism {
 public:
  explicit SingleDevice(Model& model) : model_(model) {}

  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  int data_parallel_rank() const override { return 0; }
  int data_parallel_size() const override { return 1; }
  std::string description() const override { return "one device"; }
  std::vector<OwnedParams> optimizer_shards() const override { return {}; }
  void begin_micro_batch(bool) override {}
  void finish_gradient_reduction() override {}
  void grad_norm_sq(const Tensor& out) override {
    model_.backend().sum_squares(out, model_.grads(), /*accumulate=*/false);
  }
  void params_updated() override {}
  Tensor gathered_param(int index) override { return model_.param(index); }
  void sum(const Tensor&) override {}
  void max(const Tensor&) override {}
  void barrier() override {}

 private:
  Model& model_;
};

// Expert parallelism around the data parallelism of every rank: owns the expert-parallel
// group's communicator, the model's expert exchange over it and the expert-data-parallel
// group's; everything a step asks is the data parallelism's, which reduces the experts'
// gradients over the expert-data-parallel group and the rest over every rank.
class ExpertParallel final : public Parallelism {
 public:
  ExpertParallel(Communicator& world, const DeviceMesh& mesh, Model& model,
                 const DataParallelOptions& data_parallel)
      : model_(model),
        group_(split_mesh_group(world, mesh, {MeshDim::EP})),
        expert_data_(mesh.size(MeshDim::ExpertDP) > 1
                         ? split_mesh_group(world, mesh, {MeshDim::ExpertDP})
                         : nullptr),
        exchange_(model.backend(), *group_),
        inner_(make_data_parallelism(world, model, data_parallel,
                                     {group_.get(), expert_data_.get()})) {
    model_.set_expert_exchange(&exchange_);
  }
  ~ExpertParallel() override { model_.set_expert_exchange(nullptr); }

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  int data_parallel_rank() const override { return inner_->data_parallel_rank(); }
  int data_parallel_size() const override { return inner_->data_parallel_size(); }
  std::string description() const override {
    int64_t held = 0, experts = 0;
    for (const ParamInfo& p : model_.layout().params) {
      held += p.numel();
      if (p.tp == TensorParallelStyle::Expert) experts = p.full_shape[0];
    }
    const int ep = group_->size();
    return fmt::format(
        "{}, experts spread over {} expert-parallel ranks (each holds {} of every MoE layer's {} "
        "experts: {:.3f}B of the model's {:.3f}B parameters on this rank)",
        inner_->description(), ep, experts / ep, experts, held / 1e9,
        model_.spec().total_params() / 1e9);
  }
  std::vector<OwnedParams> optimizer_shards() const override { return inner_->optimizer_shards(); }
  void run_micro_batches(int64_t count, float grad_scale, const std::function<void(int64_t)>& load,
                         const std::function<void(int64_t)>& run) override {
    inner_->run_micro_batches(count, grad_scale, load, run);
  }
  void run_forward_passes(int64_t count, const std::function<void(int64_t)>& load,
                          const std::function<void(int64_t)>& run) override {
    inner_->run_forward_passes(count, load, run);
  }
  void begin_micro_batch(bool last) override { inner_->begin_micro_batch(last); }
  void finish_gradient_reduction() override { inner_->finish_gradient_reduction(); }
  void grad_norm_sq(const Tensor& out) override { inner_->grad_norm_sq(out); }
  void params_updated() override { inner_->params_updated(); }
  void params_complete() override { inner_->params_complete(); }
  bool params_sharded() const override { return inner_->params_sharded(); }
  Tensor gathered_param(int index) override { return inner_->gathered_param(index); }
  void follow_gathers() override { inner_->follow_gathers(); }
  void sum(const Tensor& t) override { inner_->sum(t); }
  void max(const Tensor& t) override { inner_->max(t); }
  void max_over_replicas(const Tensor& t) override { inner_->max_over_replicas(t); }
  void sum_over_job(const Tensor& t) override { inner_->sum_over_job(t); }
  void barrier() override { inner_->barrier(); }

 private:
  Model& model_;
  std::unique_ptr<Communicator> group_, expert_data_;
  CommExpertExchange exchange_;
  std::unique_ptr<Parallelism> inner_;
};

}  // namespace

std::unique_ptr<Parallelism> parallelize(Model& model, const DeviceMesh& mesh, Communicator* world,
                                         const DataParallelOptions& data_parallel) {
  // Validation refuses these meshes with the keys named (expert_model_parallel_size with
  // context parallelism); this guards other callers.
  TS_CHECK(mesh.size(MeshDim::EP) == 1 || mesh.size(MeshDim::CP) == 1,
           "parallelize: expert parallelism (ep {}) with context parallelism (cp {}) is not laid "
           "out yet",
           mesh.size(MeshDim::EP), mesh.size(MeshDim::CP));
  if (mesh.world_size() == 1) return std::make_unique<SingleDevice>(model);
  TS_CHECK(world != nullptr && world->size() == mesh.world_size(),
           "parallelize: a mesh of {} ranks needs a communicator over them", mesh.world_size());
  // TP/SP, CP and PP stages: the model holds its part, its share of the sequences and its
  // stage's layers already (its runtime); the mesh layout gives it the groups' collectives,
  // runs the pipeline's schedule and composes data parallelism over the data (x context)
  // parallel ranks, and expert parallelism over a stage's data-parallel ranks.
  if (mesh.size(MeshDim::TP) > 1 || mesh.size(MeshDim::PP) > 1 || mesh.size(MeshDim::CP) > 1)
    return std::make_unique<MeshParallelism>(*world, mesh, model, data_parallel);
  if (mesh.size(MeshDim::EP) == 1) return make_data_parallelism(*world, model, data_parallel);
  TS_CHECK(!data_parallel.fully_shard, "parallelize: expert parallelism with FSDP");
  return std::make_unique<ExpertParallel>(*world, mesh, model, data_parallel);
}

}  // namespace tessera::dist
