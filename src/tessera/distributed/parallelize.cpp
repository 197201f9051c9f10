#include "tessera/distributed/parallelize.h"

#include "tessera/core/error.h"
#include "tessera/distributed/mesh_parallelism.h"

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
  if (mesh.size(MeshDim::TP) == 1 && mesh.size(MeshDim::PP) == 1 && mesh.size(MeshDim::CP) == 1 &&
      mesh.size(MeshDim::EP) == 1)
    return make_data_parallelism(*world, model, data_parallel);
  // TP/SP, CP, PP stages and EP: the model holds its part, its share of the sequences, its
  // stage's layers and its experts already (its runtime); the mesh layout gives it the groups'
  // collectives and the expert exchange, runs the pipeline's schedule and composes data
  // parallelism over the data (x context) parallel ranks.
  TS_CHECK(mesh.size(MeshDim::EP) == 1 || !data_parallel.fully_shard,
           "parallelize: expert parallelism with FSDP");
  return std::make_unique<MeshParallelism>(*world, mesh, model, data_parallel);
}

}  // namespace tessera::dist
