#pragma once
// The memory planner behind `tessera memory`: bytes per GPU of weights, gradients, optimizer
// state and activations for an experiment, before anything is allocated.
//
// The single-GPU numbers come from the same functions the model and the optimizer size their
// buffers with (DecoderModel::plan_memory, AdamWOptimizer::state_bytes), so the planner cannot
// drift from the real allocations. What the planner adds on top is stated here and in
// docs/memory.md: the sharding of data-parallel runs, the GPU backend's own buffers and an
// allowance for what the driver takes outside Tessera's allocations.
#include <cstddef>
#include <cstdint>
#include <string>

#include "tessera/config/config.h"
#include "tessera/core/dtype.h"
#include "tessera/model/model.h"
#include "tessera/model/model_spec.h"
#include "tessera/run/run_setup.h"

namespace tessera::plan {

// Bytes the CUDA backend allocates besides model and optimizer, counted in memory_stats():
// the cuBLASLt workspace (32 MiB) and an upper bound of the kernel scratch (reduction and
// attention-backward partials, a few MiB at 8k tokens).
inline constexpr size_t kBackendBuffersBytes = size_t{96} << 20;
// What a process on the GPU holds outside Tessera's allocations: the CUDA context, loaded
// kernels (cuBLASLt's included) and the gap between the datasheet capacity and what the
// driver lets processes allocate. Not in memory_stats(); only in the fit decision.
inline constexpr size_t kContextBytes = size_t{1} << 30;

struct MemoryPlan {
  // Per GPU.
  size_t weights = 0;          // compute-dtype parameters (FSDP: shard + gathered-unit slots)
  size_t gradients = 0;        // fp32 gradients (FSDP: shard + unit gradient slots)
  size_t optimizer = 0;        // fp32 master weights (unless the weights are fp32) + 2 moments
  size_t activations = 0;      // stored activations, recompute and backward scratch, logits chunk
  size_t fp8 = 0;              // with fp8: cast buffers, scaling state, cached FP8 weights
  size_t backend_buffers = 0;  // kBackendBuffersBytes on GPUs, 0 on the CPU backend
  size_t context = 0;          // kContextBytes on GPUs, 0 on the CPU backend

  // What the backend's memory_stats().peak_bytes reports after a training step.
  size_t allocated() const {
    return weights + gradients + optimizer + activations + fp8 + backend_buffers;
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
  bool gpu = true;  // add the GPU backend's buffers and context allowance
};

MemoryPlan plan_memory(const PlanInput& in);

// Largest micro batch (at most `limit`) whose plan().total() fits in `capacity_bytes`; 0 if
// not even one sequence fits. Memory grows with the micro batch, so this bisects.
int64_t largest_micro_batch(PlanInput in, size_t capacity_bytes, int64_t limit = 4096);

// The plan of a run set up by make_run_setup (run/run_setup.h), as it trains.
PlanInput plan_input(const RunSetup& setup, bool gpu);

}  // namespace tessera::plan
