#include "tessera/plan/memory_plan.h"

#include "tessera/model/generator.h"

#include <algorithm>

#include "tessera/backend/backend_factory.h"
#include "tessera/distributed/data_parallel.h"
#include "tessera/distributed/expert_exchange.h"
#include "tessera/model/lora_model.h"
#include "tessera/distributed/fully_sharded.h"
#include "tessera/model/decoder_layer.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/fp8_linears.h"
#include "tessera/model/param_layout.h"
#include "tessera/optim/adamw_optimizer.h"

namespace tessera::plan {
namespace {

int64_t count(const std::vector<ParamRange>& ranges) {
  int64_t n = 0;
  for (const ParamRange& r : ranges) n += r.count();
  return n;
}

// The ranges each rank's optimizer updates; one entry, [0, P), without sharding.
std::vector<std::vector<ParamRange>> owned_by_rank(const PlanInput& in, const ParamLayout& layout) {
  const int world = static_cast<int>(std::max<int64_t>(1, in.data_parallel));
  std::vector<std::vector<ParamRange>> out;
  switch (in.sharding) {
    case StateSharding::None:
      out.push_back({{0, layout.total}});
      break;
    case StateSharding::Fsdp:
      if (!in.lora) {
        for (int r = 0; r < world; ++r) out.push_back(dist::ShardedUnits::owned_ranges(layout, world, r));
        break;
      }
      [[fallthrough]];  // LoRA's adapters are sharded as by ZeRO-1 (its frozen base by FSDP)
    case StateSharding::Zero1: {
      // With expert parallelism (no tensor or context parallelism beside it) data-parallel
      // rank r (of a pipeline stage) is expert-data-parallel rank r / ep; every
      // expert-parallel rank's layout has the same shape as this one.
      const int ep = in.runtime.expert_parallel_size;
      const dist::ReductionPlan plan = dist::plan_reduction(layout, in.bucket_elements, world, ep);
      for (int r = 0; r < world; ++r) out.push_back(plan.owned(r, r / ep));
      break;
    }
  }
  return out;
}

// What the GPU backend's own buffers are asked for in a step of this run (StepBufferDemand).
StepBufferDemand step_demand(const PlanInput& in, const ModelMemory& model,
                             const ParamLayout& layout, const std::vector<ParamRange>& owned) {
  const ModelSpec& s = in.spec;
  const ModelRuntime& rt = in.runtime;
  StepBufferDemand d;
  d.tokens = rt.tokens();
  for (const ParamInfo& p : layout.params) {
    if (p.init == ParamInit::Ones) d.hidden = std::max(d.hidden, p.numel());  // norms
    if (p.init == ParamInit::Zeros) d.widest_bias = std::max(d.widest_bias, p.numel());
  }
  // The gradient norm: over every gradient (plain data parallelism and one GPU) or one owned
  // range at a time (sharded); and the loss sum over the micro batch's tokens.
  d.largest_reduction = d.tokens;
  if (in.sharding == StateSharding::None) {
    d.largest_reduction = std::max(d.largest_reduction, layout.total);
  } else {
    for (const ParamRange& r : owned)
      d.largest_reduction = std::max(d.largest_reduction, r.count());
  }
  // A layer's attention as its mixer runs it (the first layer that has one).
  for (int64_t l = 0; l < s.num_layers; ++l)
    if (auto a = make_decoder_layer(s, l)->attention_shape(rt.micro_batch, rt.seq_length)) {
      d.attention = *a;
      d.attention.fp8 = rt.fp8_attention;
      break;
    }
  d.backend = in.backend;
  for (const auto& call : AdamWOptimizer::step_segments(layout, owned)) {
    std::vector<int64_t> lengths;
    for (const ParamSegment& seg : call) lengths.push_back(seg.count);
    if (!lengths.empty()) d.adamw_segments.push_back(std::move(lengths));
  }
  // Planned whether or not the grouped kernel will take the stacks' shapes on the machine that
  // runs the plan.
  d.fp8_expert_gemms = model.fp8_expert_stacks;
  return d;
}

}  // namespace

MemoryPlan plan_memory(const PlanInput& in) {
  const ModelMemory model = in.lora ? LoraModel::plan_memory(in.spec, in.runtime, *in.lora)
                                    : DecoderModel::plan_memory(in.spec, in.runtime);
  // What one rank's model holds: its tensor-parallel part of the parameters (under LoRA, what
  // the optimizer updates: the adapters).
  const ParamLayout layout =
      in.lora ? make_lora_layout(in.spec, DecoderModel::plan_layout(in.spec, in.runtime), *in.lora).adapters
              : DecoderModel::plan_layout(in.spec, in.runtime);
  const DType dt = in.runtime.compute_dtype;
  const OptimizerDtypes& od = in.optimizer;
  // State sharding splits over the data-parallel ranks.
  const int64_t n = std::max<int64_t>(1, in.data_parallel);

  MemoryPlan p;
  p.activations = model.activations;  // per micro batch on each GPU, whatever the sharding
  p.fp8 = model.fp8;
  // The GPU with the largest optimizer shard holds the most.
  const auto owned = owned_by_rank(in, layout);
  size_t largest = 0;
  for (size_t r = 0; r < owned.size(); ++r) {
    if (count(owned[r]) > p.optimizer_elements) largest = r;
    p.optimizer_elements = std::max(p.optimizer_elements, count(owned[r]));
  }
  const bool sharded = in.sharding != StateSharding::None;
  p.optimizer = AdamWOptimizer::state_bytes(p.optimizer_elements, dt, od, sharded);
  // The frozen reference weights, and where the optimizer keeps no master copy to restore the
  // policy's from, theirs beside them while the reference runs.
  // Offloading the moments, the KV cache lives in their memory (checked to fit at start). GRPO's
  // exchange buffer is there whether the rank generates or not (split placement).
  if (in.generation_batch > 0)
    p.generation = Generator::buffer_bytes(in.spec, dt, in.runtime.seq_length, in.generation_batch) -
                   (in.offload_optimizer_state
                        ? Generator::cache_bytes(in.spec, dt, in.runtime.seq_length, in.generation_batch)
                        : 0);
  if (in.reward_terms > 0) p.generation += grpo_exchange_bytes(in.runtime.tokens(), in.global_batch, in.reward_terms);
  if (in.link_completions > 0) p.generation += grpo_link_bytes(in.link_completions, in.runtime.seq_length);
  if (in.reference_copy)
    p.reference = static_cast<size_t>(p.optimizer_elements) * dtype_size(dt) *
                  (AdamWOptimizer::restores_params(dt, od, sharded) ? 1 : 2);
  if (in.sharding == StateSharding::Fsdp && in.lora) {
    // FrozenShardedDataParallel: the frozen base's shards and slots beside the adapters.
    p.weights = model.weights + dist::ShardedUnits::plan_memory(DecoderModel::plan_layout(in.spec, in.runtime),
                                                                static_cast<int>(n), dt)
                                    .bytes;
    p.gradients = model.gradients;
  } else if (in.sharding == StateSharding::Fsdp) {
    // What FullyShardedDataParallel allocates: the shards and the gathered-unit slots.
    const auto f = dist::FullyShardedDataParallel::plan_memory(layout, static_cast<int>(n), dt,
                                                               in.runtime.grad_dtype);
    p.weights = f.weights;
    p.gradients = f.gradients;
  } else {
    p.weights = model.weights;
    p.gradients = model.gradients;
  }
  // Barrier flags: data parallelism's, and the tensor/pipeline/context/expert layout's
  // (MeshParallelism).
  const bool mesh_layout = in.runtime.tensor_parallel_size > 1 ||
                           !in.runtime.pipeline_chunks.empty() ||
                           in.runtime.context_parallel_size > 1 ||
                           in.runtime.expert_parallel_size > 1;
  // With them the model's own small buffers (the MoE layers' statistics and expert bias) and
  // the expert exchange's counts under expert parallelism.
  p.run_buffers = kTrainerScalarBytes + (n > 1 ? sizeof(float) : 0) +
                  (mesh_layout ? sizeof(float) : 0) + model.block_state +
                  (in.runtime.expert_parallel_size > 1
                       ? dist::CommExpertExchange::counts_bytes(in.spec.moe.experts)
                       : 0);
  if (in.gpu) {
    const Platform* platform = gpu_platform();
    p.backend_buffers =
        platform ? platform->step_buffer_bytes(step_demand(in, model, layout, owned[largest]))
                 : kBackendBuffersBytes;
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

size_t grpo_generation_rank_bytes(const ModelSpec& spec, const ModelRuntime& runtime, const GrpoGenerationShare& share) {
  const DType dt = runtime.compute_dtype;
  return static_cast<size_t>(DecoderModel::plan_layout(spec, runtime).total) * dtype_size(dt) +
         Generator::buffer_bytes(spec, dt, runtime.seq_length, share.slots) +
         grpo_link_bytes(share.link_completions, runtime.seq_length);
}

size_t grpo_link_bytes(int64_t completions, int64_t seq_length) {
  return static_cast<size_t>(completions * (2 * seq_length + 6) + 16) * sizeof(int32_t);
}

size_t grpo_exchange_bytes(int64_t micro_batch_tokens, int64_t global_batch, size_t reward_terms) {
  const int64_t exchanged = (static_cast<int64_t>(reward_terms) + 2) * global_batch + 2;
  return static_cast<size_t>(std::max(micro_batch_tokens, exchanged)) * sizeof(float);
}

PlanInput plan_input(const RunSetup& setup, bool gpu) {
  PlanInput in;
  in.spec = setup.spec;
  in.runtime = setup.runtime;
  in.num_gpus = setup.mesh.world_size();
  in.data_parallel = setup.mesh.size(dist::MeshDim::DP) * setup.mesh.size(dist::MeshDim::CP);
  in.sharding = setup.sharding;
  in.optimizer = setup.optimizer;
  in.bucket_elements = setup.ddp_bucket_size;
  in.backend = setup.backend;
  in.gpu = gpu;
  in.lora = setup.lora;
  in.reference_copy = setup.reference_copy || setup.reference_loaded;
  in.generation_batch = setup.generation_batch;
  in.link_completions = setup.link_completions;
  in.global_batch = setup.global_batch;
  in.reward_terms = setup.reward_terms;
  in.offload_optimizer_state = setup.offload_optimizer_state;
  return in;
}

}  // namespace tessera::plan
