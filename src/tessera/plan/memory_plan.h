#pragma once
// The memory planner behind `tessera memory`: bytes per GPU of weights, gradients, optimizer
// state and activations for an experiment, before anything is allocated.
//
// Every number comes from the functions the allocating code sizes its buffers with
// (DecoderModel::plan_memory, AdamWOptimizer::state_bytes, the data-parallel shards of
// BucketPlan and FullyShardedDataParallel, Fp8Linears::plan_bytes, and the GPU platform's
// step_buffer_bytes for the backend's own workspace and scratch), so the planner cannot drift
// from the real allocations; docs/memory.md lists them. On top it adds only an allowance for
// what the driver takes outside Tessera's allocations (the CUDA context).
#include <cstddef>
#include <cstdint>
#include <string>

#include "tessera/config/config.h"
#include "tessera/config/validate.h"
#include "tessera/core/dtype.h"
#include "tessera/model/model.h"
#include "tessera/model/model_spec.h"
#include "tessera/run/run_setup.h"

namespace tessera::plan {

// The GPU backend's own buffers when this build has no GPU platform to ask
// (Platform::step_buffer_bytes): the 32 MiB cuBLASLt workspace and a bound of the kernel
// scratch.
inline constexpr size_t kBackendBuffersBytes = size_t{96} << 20;
// The trainer's device scalars (gradient norm, stop signal, out-of-time flag).
inline constexpr size_t kTrainerScalarBytes = 256;
// What a process on the GPU holds outside Tessera's allocations: the CUDA context, loaded
// kernels (cuBLASLt's included) and the gap between the datasheet capacity and what the
// driver lets processes allocate. Not in memory_stats(); only in the fit decision.
inline constexpr size_t kContextBytes = size_t{1} << 30;

struct MemoryPlan {
  // Per GPU.
  size_t weights = 0;          // compute-dtype parameters (FSDP: shard + gathered-unit slots)
  size_t gradients = 0;        // gradients in their dtype (FSDP: shard + unit gradient slots)
  size_t optimizer = 0;        // master weights (unless fp32 weights or bf16 main parameters)
                               // + 2 moments, in their dtypes
  size_t activations = 0;      // stored activations, recompute and backward scratch, logits chunk
  size_t fp8 = 0;              // with fp8: cast buffers, scaling state, cached FP8 weights
  size_t backend_buffers = 0;  // the GPU backend's workspace and scratch; 0 on the CPU backend
  size_t run_buffers = 0;      // the trainer's scalars, data parallelism's barrier flag and the
                               // MoE layers' statistics and expert bias
  size_t reference = 0;        // the frozen reference weights (DPO, GRPO's KL): the optimizer's shard
  size_t generation = 0;       // GRPO: the generator's KV cache, states and scratch, and its exchange
  size_t context = 0;          // kContextBytes on GPUs, 0 on the CPU backend
  int64_t optimizer_elements = 0;  // parameters this GPU's optimizer updates (its largest shard)

  // What the backend's memory_stats().peak_bytes reports after a training step.
  size_t allocated() const {
    return weights + gradients + optimizer + activations + fp8 + backend_buffers + run_buffers +
           reference + generation;
  }
  size_t total() const { return allocated() + context; }
};

struct PlanInput {
  ModelSpec spec;
  ModelRuntime runtime;
  int64_t num_gpus = 1;
  // The ranks state sharding splits over: data x context parallel (num_gpus / (tp x pp)).
  int64_t data_parallel = 1;
  StateSharding sharding = StateSharding::None;
  OptimizerDtypes optimizer;  // the precision-aware optimizer's state dtypes
  int64_t bucket_elements = 40000000;  // ddp_bucket_size: ZeRO-1's shards are bucket slices
  BackendOptions backend;  // the attention kernels' choice sizes their scratch
  bool gpu = true;  // add the GPU backend's buffers and context allowance
  // LoRA: the optimizer and gradients cover the adapters; the base is frozen (LoraModel).
  std::optional<LoraOptions> lora;
  bool reference_copy = false;  // RunSetup's
  // GRPO (RunSetup's): the sequences its generator decodes together (0: no generation), the
  // global batch and the reward terms its exchange buffer holds.
  int64_t generation_batch = 0, global_batch = 0;
  size_t reward_terms = 0;
  int64_t link_completions = 0;  // GRPO split placement: its link to a generation rank
  bool offload_optimizer_state = false;  // the KV cache in the AdamW moments' memory
};

// GRPO's exchange buffer: every completion's reward terms, length and clip flag (and the batch's
// entropy), or a micro-batch's per-token weights, whichever is larger; fp32.
size_t grpo_exchange_bytes(int64_t micro_batch_tokens, int64_t global_batch, size_t reward_terms);
// GRPO's split placement: the device bytes of a link to a generation rank for messages of up to
// `completions` continuations of prompts that fit in seq_length positions
// (train/grpo_generation.h): each prompt's length, ids and streams, or each continuation's four
// words, ids and log-probabilities, int32; the sampling options; the command.
size_t grpo_link_bytes(int64_t completions, int64_t seq_length);
// GRPO's split placement: what a generation rank allocates: a copy of the weights of a training
// rank's model (`spec`, `runtime`: the training ranks'), its generator and its link.
size_t grpo_generation_rank_bytes(const ModelSpec& spec, const ModelRuntime& runtime, const GrpoGenerationShare& share);

MemoryPlan plan_memory(const PlanInput& in);

// Largest micro batch (at most `limit`) whose plan().total() fits in `capacity_bytes`; 0 if
// not even one sequence fits. Memory grows with the micro batch, so this bisects.
int64_t largest_micro_batch(PlanInput in, size_t capacity_bytes, int64_t limit = 4096);

// The plan of a run set up by make_run_setup (run/run_setup.h), as it trains.
PlanInput plan_input(const RunSetup& setup, bool gpu);

}  // namespace tessera::plan
