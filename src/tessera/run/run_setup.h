#pragma once
// What an experiment's run is, derived in one place: the model (spec), how it runs on each
// device (runtime: micro batch, sequence, dtypes, recompute, FP8, flat-buffer padding and
// sharded parameters), the device mesh, how data parallelism shares the training state, and
// the gradient accumulation that makes up the global batch. The trainer, the memory planner
// and the benchmarks all start from make_run_setup, so they cannot disagree.
#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

#include "tessera/config/config.h"
#include "tessera/distributed/device_mesh.h"
#include "tessera/model/lora_layout.h"
#include "tessera/model/model.h"
#include "tessera/ops/platform.h"
#include "tessera/optim/adamw_optimizer.h"

namespace tessera {

// How data-parallel ranks share the training state.
enum class StateSharding {
  None,   // plain data parallel: every rank holds everything
  Zero1,  // ZeRO-1 / Megatron distributed optimizer: optimizer state split over the ranks
  Fsdp,   // FSDP / ZeRO-3 (distributed/fully_sharded.h): parameters and gradients split too
};

struct RunSetup {
  ModelSpec spec;
  ModelRuntime runtime;
  dist::DeviceMesh mesh{1, {}};
  StateSharding sharding = StateSharding::None;
  OptimizerDtypes optimizer;       // the dtypes AdamW keeps its state in
  int64_t ddp_bucket_size = 40000000;  // elements per gradient bucket (ZeRO-1's shards)
  BackendOptions backend;  // attention_backend, gemm_autotune, deterministic_mode
  int64_t data_vocab = 0;          // token ids the training data can contain
  int64_t accumulation_steps = 1;  // micro-batches per rank per optimizer step
  std::optional<LoraOptions> lora;  // LoRA adapters train (model/lora_model.h), the rest frozen
  // A frozen copy of the reference weights on the device (train/frozen_reference.h): DPO
  // without precomputed reference log-probabilities, GRPO with a KL term.
  bool reference_copy = false;
  // reference_load: its frozen copy is on the device from the start, at least until DPO's
  // precomputed log-probabilities are computed with it (the memory planner counts it).
  bool reference_loaded = false;
  // objective grpo: the sequences its generator decodes together (a group's completions on a
  // rank), the global batch and the reward terms (plan/memory_plan.h's generation row); 0: none.
  int64_t generation_batch = 0, global_batch = 0;
  size_t reward_terms = 0;
  int64_t link_completions = 0;  // GRPO split placement: a training rank's link (grpo_link_bytes)
  bool offload_optimizer_state = false;  // grpo_offload_optimizer_state: the KV cache in the moments' memory
};

// The devices a run is set up for.
struct RunDevices {
  int world_size = 1;
  // What precision auto means there (Backend::default_compute_dtype): bf16 on GPUs.
  DType auto_compute_dtype = DType::BF16;
  // The rank being set up: which tensor-parallel shard its model holds. The memory planner
  // plans rank 0 (every tensor-parallel rank holds as much).
  int rank = 0;
};

// `tokenizer_vocab` gives the tokenizer's vocabulary when asked (loading a tokenizer is only
// needed when the model's vocabulary is not set, or the data is real text). Throws ConfigError
// for a model family, vocabulary or mesh the experiment cannot have.
RunSetup make_run_setup(const Experiment& e, const RunDevices& devices,
                        const std::function<int64_t()>& tokenizer_vocab);

// Throws ConfigError when, with fp8, the tokens per micro batch (the K of the weight
// gradients' GEMMs) or, with fp8_lm_head, the output head's chunk (the M of its GEMMs) are not
// multiples of `multiple`, what the device's FP8 GEMMs need in every dimension
// (Backend::fp8_gemm_multiple); `device` names it. The FP8 linears check the model's widths.
void check_fp8_gemm_multiple(const Experiment& e, int64_t multiple, std::string_view device);

// The sharding the training keys ask for (use_torch_fsdp2, use_distributed_optimizer); None
// with one data-parallel rank, where there is nothing to shard over.
StateSharding state_sharding(const TrainingConfig& t, int data_parallel_size);

// The experiment's device mesh over `world_size` ranks (Megatron's sizes).
dist::DeviceMesh device_mesh(const TrainingConfig& t, int world_size);

}  // namespace tessera
