#include "tessera/plan/memory_plan.h"

#include <algorithm>

#include "tessera/distributed/fully_sharded.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/fp8_linears.h"
#include "tessera/model/param_layout.h"
#include "tessera/optim/adamw_optimizer.h"

namespace tessera::plan {
namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace

MemoryPlan plan_memory(const PlanInput& in) {
  const ModelMemory model = DecoderModel::plan_memory(in.spec, in.runtime);
  // What one rank's model holds: its tensor-parallel part of the parameters.
  const ParamLayout layout = DecoderModel::plan_layout(in.spec, in.runtime);
  const int64_t params = layout.total;
  const DType dt = in.runtime.compute_dtype;
  const int64_t n = std::max<int64_t>(1, in.data_parallel);
  const int64_t shard = ceil_div(params, n);

  MemoryPlan p;
  p.activations = model.activations;  // per micro batch on each GPU, whatever the sharding
  p.fp8 = model.fp8;
  switch (in.sharding) {
    case StateSharding::None:
      p.weights = model.weights;
      p.gradients = model.gradients;
      p.optimizer = AdamWOptimizer::state_bytes(params, dt);
      break;
    case StateSharding::Zero1:
      p.weights = model.weights;
      p.gradients = model.gradients;
      p.optimizer = AdamWOptimizer::state_bytes(shard, dt);
      break;
    case StateSharding::Fsdp: {
      // What FullyShardedDataParallel allocates: the shards and the gathered-unit slots.
      const auto f = dist::FullyShardedDataParallel::plan_memory(layout, static_cast<int>(n), dt);
      p.weights = f.weights;
      p.gradients = f.gradients;
      p.optimizer = AdamWOptimizer::state_bytes(f.shard_elements, dt);
      break;
    }
  }
  if (in.gpu) {
    p.backend_buffers = kBackendBuffersBytes;
    p.context = kContextBytes;
  }
  return p;
}

int64_t largest_micro_batch(PlanInput in, size_t capacity_bytes, int64_t limit) {
  auto fits = [&](int64_t mbs) {
    in.runtime.micro_batch = mbs;
    return plan_memory(in).total() <= capacity_bytes;
  };
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = 2;  // fits(lo) holds; grow hi until it fails or passes the limit
  while (hi <= limit && fits(hi)) lo = hi, hi *= 2;
  hi = std::min(hi, limit + 1);
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

PlanInput plan_input(const RunSetup& setup, bool gpu) {
  PlanInput in;
  in.spec = setup.spec;
  in.runtime = setup.runtime;
  in.num_gpus = setup.mesh.world_size();
  in.data_parallel = setup.mesh.size(dist::MeshDim::DP) * setup.mesh.size(dist::MeshDim::CP);
  in.sharding = setup.sharding;
  in.gpu = gpu;
  return in;
}

}  // namespace tessera::plan
