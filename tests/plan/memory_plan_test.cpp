// The memory planner against hand calculations, against the real allocations of a training
// run on the CPU backend, and against peaks measured on a GPU.
#include <cstdio>
#include <filesystem>
#include <unistd.h>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/run_command.h"

#include "tessera/analysis/gpu_specs.h"
#include "tessera/backend/backend_factory.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/config/keys.h"
#include "tessera/data/tokenizer.h"
#include "tessera/distributed/local_communicator.h"
#include "tessera/model/decoder_model.h"
#include "tessera/obs/logger.h"
#include "tessera/plan/memory_plan.h"
#include "tessera/plan/memory_report.h"
#include "tessera/train/grpo_generation.h"
#include "tessera/train/trainer.h"

namespace tessera::plan {
namespace {

using testing::contains;
using testing::run_tessera;
using testing::RunResult;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

Experiment load(const std::string& config, std::vector<std::string> overrides, int gpus = 1) {
  LoadOptions o;
  o.config_path = config;
  o.cli_overrides = std::move(overrides);
  o.data_parallel_size = gpus;
  return load_experiment(o);
}

// The plan of the run the experiment's training keys set up on `gpus` GPUs.
PlanInput input_for(const Experiment& e, int64_t gpus = 1) {
  const RunSetup setup = make_run_setup(e, {static_cast<int>(gpus), DType::BF16},
                                        [&] { return make_tokenizer(e.data)->vocab_size(); });
  return plan_input(setup, /*gpu=*/true);
}

// Llama 3.1 8B by hand: embedding and output head 128256 x 4096 each; per layer qkv
// (4096 + 2*1024) x 4096, o_proj 4096^2, gate_up 2*14336 x 4096, down 14336 x 4096, two
// norms of 4096; one final norm. Every tensor is a multiple of 64 elements (no padding).
constexpr int64_t kLlama8BParams =
    2 * 128256LL * 4096 + 32 * (6144LL * 4096 + 4096LL * 4096 + 3 * 14336LL * 4096 + 2 * 4096) +
    4096;

TEST(MemoryPlan, Llama8BStateMatchesHandCalculation) {
  ASSERT_EQ(kLlama8BParams, 8'030'261'248);
  const PlanInput in = input_for(load("llama3.1_8B-pretrain", {"--attention_backend", "tessera"}));
  const MemoryPlan p = plan_memory(in);
  // The seed reports' table: 8B parameters x 2 bytes = 16 GB of bf16 weights.
  EXPECT_EQ(p.weights, kLlama8BParams * 2);
  EXPECT_NEAR(p.weights / 1e9, 16.06, 0.01);
  EXPECT_EQ(p.gradients, kLlama8BParams * 4);
  // Adam with fp32 master weights: 10 bytes per parameter, the master's 16 low bits (its high
  // halves are the bf16 weights, store_param_remainders) and two fp32 moments; 12 with a whole
  // fp32 copy.
  EXPECT_EQ(p.optimizer, kLlama8BParams * 10);
  PlanInput whole_master = in;
  whole_master.optimizer.split_master = false;
  EXPECT_EQ(plan_memory(whole_master).optimizer, kLlama8BParams * 12);
  EXPECT_EQ(p.optimizer_elements, kLlama8BParams);
  // The CUDA backend's own buffers: the 32 MiB cuBLASLt workspace, the largest kernel
  // scratch and the AdamW chunk table (16 bytes per 64K elements of each segment). At micro
  // batch 2 the largest scratch is Tessera's attention backward's: two (B, H, T) fp32
  // statistics and the (B, T, H, D) fp32 dQ accumulator its default mode adds into, 4 + 256
  // MiB. deterministic_mode computes dQ by a kernel of its own, without the accumulator; the
  // largest is then the RMSNorm backward's partial dweight rows (16384 / 16 rows of 4096
  // fp32, 16 MiB).
  if (gpu_platform()) {
    ASSERT_EQ(in.runtime.micro_batch, 2);
    size_t chunks = 0;
    for (const ParamSegment& s : make_param_layout(in.spec).decay_segments())
      chunks += static_cast<size_t>((s.count + 65535) / 65536);
    EXPECT_GT(chunks, static_cast<size_t>(kLlama8BParams / 65536));
    EXPECT_EQ(p.backend_buffers, (size_t{32} << 20) + (size_t{260} << 20) + chunks * 16);
    const MemoryPlan d = plan_memory(input_for(
        load("llama3.1_8B-pretrain", {"--attention_backend", "tessera", "--deterministic_mode", "true"})));
    EXPECT_EQ(d.backend_buffers, (size_t{32} << 20) + (size_t{16} << 20) + chunks * 16);
    // auto plans the larger of what it may run: cuDNN's workspace ((B, H, T) fp32 softmax
    // sums and the (B, H, T, D) fp32 dQ accumulator, 2 + 256 MiB) or Tessera's scratch (4 +
    // 256 MiB, above). cuDNN's deterministic algorithm holds only the sums, so there the
    // RMSNorm backward's 16 MiB is the largest again.
    const MemoryPlan a = plan_memory(input_for(load("llama3.1_8B-pretrain", {})));
    EXPECT_EQ(a.backend_buffers, (size_t{32} << 20) + (size_t{260} << 20) + chunks * 16);
    const MemoryPlan c = plan_memory(input_for(load("llama3.1_8B-pretrain", {"--attention_backend", "cudnn"})));
    EXPECT_EQ(c.backend_buffers, (size_t{32} << 20) + (size_t{258} << 20) + chunks * 16);
    const MemoryPlan ad = plan_memory(input_for(load("llama3.1_8B-pretrain", {"--deterministic_mode", "true"})));
    EXPECT_EQ(ad.backend_buffers, (size_t{32} << 20) + (size_t{16} << 20) + chunks * 16);
  } else {
    EXPECT_EQ(p.backend_buffers, kBackendBuffersBytes);
  }
  EXPECT_EQ(p.run_buffers, kTrainerScalarBytes);
  EXPECT_EQ(p.context, kContextBytes);
  EXPECT_EQ(p.total(), p.weights + p.gradients + p.optimizer + p.activations + p.backend_buffers +
                           kTrainerScalarBytes + kContextBytes);

  // The precision-aware optimizer: bf16 gradients and moments (the second moment starts at
  // the next 256 bytes: P x 2 is a multiple already), then no fp32 master's low halves either.
  PlanInput lean = in;
  lean.runtime.grad_dtype = DType::BF16;
  lean.optimizer = {DType::F32, DType::BF16, DType::BF16};
  const MemoryPlan l = plan_memory(lean);
  EXPECT_EQ(l.gradients, kLlama8BParams * 2);
  EXPECT_EQ(l.optimizer, kLlama8BParams * 6);
  lean.optimizer.main_params = DType::BF16;
  EXPECT_EQ(plan_memory(lean).optimizer, kLlama8BParams * 4);

  PlanInput fp32 = in;
  fp32.runtime.compute_dtype = DType::F32;
  const MemoryPlan q = plan_memory(fp32);
  EXPECT_EQ(q.weights, kLlama8BParams * 4);
  EXPECT_EQ(q.optimizer, kLlama8BParams * 8);  // the fp32 weights are the master copy
  EXPECT_GT(q.activations, p.activations);
}

TEST(MemoryPlan, ShardingSplitsTheRightParts) {
  auto plan_with = [](std::vector<std::string> keys) {
    keys.insert(keys.end(), {"--global_batch_size", "16"});
    const PlanInput in = input_for(load("llama3.1_8B-pretrain", keys, 8), 8);
    return plan_memory(in);
  };
  const Experiment e = load("llama3.1_8B-pretrain", {"--global_batch_size", "16"});
  const int64_t shard = (kLlama8BParams + 7) / 8;
  // The experiment turns the distributed optimizer on, as Primus's pre_trainer module does.
  const MemoryPlan none = plan_with({"--use_distributed_optimizer", "false"});
  const MemoryPlan zero1 = plan_with({});
  const MemoryPlan fsdp = plan_with({"--use_torch_fsdp2", "true"});
  EXPECT_EQ(none.optimizer, kLlama8BParams * 10);
  EXPECT_EQ(zero1.weights, none.weights);
  EXPECT_EQ(zero1.gradients, none.gradients);
  EXPECT_EQ(zero1.optimizer, shard * 10);
  // FSDP: each unit padded to a multiple of 64 x 8 elements and split 8 ways, plus two slots
  // (parameters, gradients) of the largest unit, the final norm with the untied output head.
  int64_t fsdp_shard = 0;
  for (const ParamRange& u : make_param_layout(input_for(e).spec).units)
    fsdp_shard += (u.count() + 511) / 512 * 64;
  EXPECT_GE(fsdp_shard, shard);
  EXPECT_LT(fsdp_shard, shard + 64 * 40);
  const int64_t unit = 4096 + 128256LL * 4096;  // a multiple of 512 already
  EXPECT_EQ(fsdp.weights, (fsdp_shard + 2 * unit) * 2);
  EXPECT_EQ(fsdp.gradients, (fsdp_shard + 2 * unit) * 4);
  EXPECT_EQ(fsdp.optimizer, fsdp_shard * 10);
  for (const MemoryPlan& p : {none, zero1, fsdp}) EXPECT_EQ(p.activations, none.activations);
}

TEST(MemoryPlan, RecomputeAndMicroBatchOrderActivations) {
  const Experiment e = load("llama3.1_8B-pretrain", {"--micro_batch_size", "1"});
  PlanInput in = input_for(e);
  auto acts = [&](RecomputeGranularity r, int64_t mbs) {
    PlanInput x = in;
    x.runtime.cross_entropy_chunk_tokens = 4096;
    x.runtime.recompute = r;
    x.runtime.micro_batch = mbs;
    return plan_memory(x).activations;
  };
  const size_t none = acts(RecomputeGranularity::None, 1);
  const size_t selective = acts(RecomputeGranularity::Selective, 1);
  const size_t full = acts(RecomputeGranularity::Full, 1);
  EXPECT_LT(full, selective);
  EXPECT_LT(selective, none);
  // Everything but the logits chunk (capped at 4096 tokens) and the rope table scales with
  // the micro batch.
  EXPECT_GT(acts(RecomputeGranularity::None, 2), 1.9 * none);
}

TEST(MemoryPlan, LargestMicroBatchIsTheLastThatFits) {
  const PlanInput in = input_for(load("llama3.1_8B-pretrain", {"--num_layers", "4"}));
  PlanInput at = in;
  for (size_t capacity_gib : {24, 40, 80, 141}) {
    const size_t capacity = capacity_gib * (size_t{1} << 30);
    const int64_t best = largest_micro_batch(in, capacity);
    at.runtime.micro_batch = best;
    if (best > 0) EXPECT_LE(plan_memory(at).total(), capacity) << capacity_gib;
    at.runtime.micro_batch = best + 1;
    EXPECT_GT(plan_memory(at).total(), capacity) << capacity_gib;
  }
  EXPECT_EQ(largest_micro_batch(in, size_t{1} << 30), 0);
  EXPECT_EQ(largest_micro_batch(in, size_t{1} << 50, 7), 7);  // the limit caps the search
}

// The issue's workload fits one H200: full Llama 3.1 8B and Qwen 2.5 7B at micro batch 1 and
// seq 8192, with selective or full recompute, in BF16 and FP8 hybrid (its weight cache
// included), once the precision-aware optimizer keeps gradients and moments in bf16 (what
// bench model --full runs). With fp32 gradients and moments, selective recompute does not.
TEST(MemoryPlan, FullSevenAndEightBModelsFitOneH200WithBf16State) {
  const size_t h200 = gpu_capacity_bytes(analysis::require_gpu_spec("H200"));
  const std::vector<std::string> lean = {"--use_precision_aware_optimizer",
                                         "true",
                                         "--use_distributed_optimizer",
                                         "true",
                                         "--main_grads_dtype",
                                         "bf16",
                                         "--exp_avg_dtype",
                                         "bf16",
                                         "--exp_avg_sq_dtype",
                                         "bf16"};
  for (const char* model : {"llama3.1_8B-pretrain", "qwen2.5_7B-pretrain"})
    for (const char* recompute : {"selective", "full"})
      for (const char* fp8 : {"null", "hybrid"}) {
        std::vector<std::string> keys = {"--micro_batch_size",
                                         "1",
                                         "--global_batch_size",
                                         "16",
                                         "--seq_length",
                                         "8192",
                                         "--recompute_granularity",
                                         recompute,
                                         "--fp8",
                                         fp8};
        const MemoryPlan fp32_state = plan_memory(input_for(load(model, keys)));
        keys.insert(keys.end(), lean.begin(), lean.end());
        const MemoryPlan p = plan_memory(input_for(load(model, keys)));
        std::printf("[ plan     ] %s %s fp8 %s: %.1f GiB with bf16 state, %.1f GiB with fp32\n",
                    model, recompute, fp8, p.total() / kGiB, fp32_state.total() / kGiB);
        EXPECT_LE(p.total(), h200) << model << " " << recompute << " fp8 " << fp8;
        EXPECT_LT(p.total(), fp32_state.total());
        if (std::string(recompute) == "selective")
          EXPECT_GT(fp32_state.total(), h200) << model << " fp8 " << fp8;
      }
}

// The planner's bytes are exactly what a training run on the CPU backend allocates (peak of
// the backend's own accounting), for every recompute mode and with bf16 gradients and
// moments (the precision-aware optimizer).
TEST(MemoryPlan, MatchesRealPeakOnCpuBackend) {
  const std::vector<std::string> bf16_state = {"--use_precision_aware_optimizer",
                                               "true",
                                               "--use_distributed_optimizer",
                                               "true",
                                               "--main_grads_dtype",
                                               "bf16",
                                               "--exp_avg_dtype",
                                               "bf16",
                                               "--exp_avg_sq_dtype",
                                               "bf16"};
  for (const char* recompute : {"null", "selective", "full", "bf16 state"}) {
    const bool lean = std::string(recompute) == "bf16 state";
    const Experiment e = load("", {"--mock_data",
                                   "true",
                                   "--num_layers",
                                   "3",
                                   "--hidden_size",
                                   "64",
                                   "--num_attention_heads",
                                   "4",
                                   "--num_query_groups",
                                   "2",
                                   "--seq_length",
                                   "32",
                                   "--micro_batch_size",
                                   "2",
                                   "--global_batch_size",
                                   "2",
                                   "--train_iters",
                                   "1",
                                   "--lr_warmup_iters",
                                   "0",
                                   "--eval_interval",
                                   "0",
                                   "--recompute_granularity",
                                   lean ? "selective" : recompute,
                                   "--cross_entropy_chunk_tokens",
                                   "24",
                                   "--device",
                                   "cpu"});
    Experiment x = e;
    if (lean)
      for (size_t k = 0; k < bf16_state.size(); k += 2)
        ASSERT_EQ(find_key(bf16_state[k].substr(2))->set(x, bf16_state[k + 1]), "");
    PlanInput in = input_for(x);
    in.runtime.compute_dtype = DType::F32;  // the CPU backend trains in fp32
    in.gpu = false;
    const MemoryPlan p = plan_memory(in);

    Logger log("", 0, false, false);
    Trainer trainer(x, make_cpu_backend(), log, nullptr);
    trainer.run_iteration(1);  // forward, backward and the optimizer step
    const MemoryStats s = trainer.backend().memory_stats();
    EXPECT_EQ(s.peak_bytes, p.allocated()) << recompute;
    if (lean) EXPECT_EQ(trainer.model().grads().dtype, DType::BF16);
  }
}

// The largest peak of `world` thread ranks' backends over one training iteration.
size_t largest_rank_peak(const Experiment& e, int world) {
  std::vector<size_t> peaks(world);
  dist::run_local_ranks(world, [&](int rank, dist::Communicator& comm) {
    Logger log("", rank, false, false);
    Trainer trainer(e, make_cpu_backend(), log, nullptr, &comm);
    trainer.run_iteration(1);
    peaks[rank] = trainer.backend().memory_stats().peak_bytes;
  });
  return *std::max_element(peaks.begin(), peaks.end());
}

// GRPO's split placement on `world` thread ranks, the last `generation` of them generating
// (wired as `tessera train` wires them), over one iteration: the largest training rank's peak
// and the largest generation rank's.
std::pair<size_t, size_t> split_rank_peaks(const Experiment& e, int world, int generation) {
  const int training_ranks = world - generation;
  std::vector<size_t> peaks(static_cast<size_t>(world));
  dist::run_local_ranks(world, [&](int rank, dist::Communicator& comm) {
    Logger log("", rank, false, false);
    const std::optional<GrpoSplitJob> split = split_grpo_job(comm, e.training);
    ASSERT_TRUE(split && split->link.training_ranks == training_ranks);
    if (split->generates(rank)) {
      const auto backend = make_cpu_backend();
      serve_grpo_generation(e, *backend, log, split->link, *make_tokenizer(e.data));
      peaks[static_cast<size_t>(rank)] = backend->memory_stats().peak_bytes;
      return;
    }
    Trainer trainer(e, make_cpu_backend(), log, nullptr, split->training.get(), "", nullptr, &split->link);
    trainer.run_iteration(1);
    peaks[static_cast<size_t>(rank)] = trainer.backend().memory_stats().peak_bytes;
  });
  return {*std::max_element(peaks.begin(), peaks.begin() + training_ranks),
          *std::max_element(peaks.begin() + training_ranks, peaks.end())};
}

// A 2-layer run of one iteration on `world` CPU thread ranks with `extra` keys: the planner's
// bytes for the rank holding the most, and that rank's measured peak.
std::pair<size_t, size_t> planned_and_peak(int world, int64_t global_batch,
                                           std::vector<std::string> extra) {
  std::vector<std::string> keys = {
      "--mock_data",        "true", "--num_layers",          "2",
      "--hidden_size",      "64",   "--num_attention_heads", "4",
      "--num_query_groups", "2",    "--seq_length",          "32",
      "--micro_batch_size", "1",    "--global_batch_size",   std::to_string(global_batch),
      "--train_iters",      "1",    "--lr_warmup_iters",     "0",
      "--eval_interval",    "0",    "--ddp_bucket_size",     "5000",
      "--device",           "cpu"};
  keys.insert(keys.end(), extra.begin(), extra.end());
  const Experiment e = load("", keys, world);
  const RunSetup setup =
      make_run_setup(e, {world, DType::F32}, [&] { return make_tokenizer(e.data)->vocab_size(); });
  return {plan_memory(plan_input(setup, /*gpu=*/false)).allocated(), largest_rank_peak(e, world)};
}

// ZeRO-1 and FSDP over thread ranks with bf16 state, and FSDP under tensor parallelism: the
// planner's bytes are the peak of the rank holding the most (its optimizer shard the largest),
// exactly.
TEST(MemoryPlan, MatchesTheLargestRankPeakOfShardedRuns) {
  for (const char* sharding : {"--use_distributed_optimizer", "--use_torch_fsdp2"}) {
    const auto [planned, peak] =
        planned_and_peak(3, 3,
                         {sharding, "true", "--use_precision_aware_optimizer", "true",
                          "--main_grads_dtype", "bf16", "--exp_avg_dtype", "bf16"});
    EXPECT_EQ(peak, planned) << sharding;
  }
  // FSDP over the data-parallel ranks of each tensor-parallel part (2 x 2 ranks).
  const auto [planned, peak] = planned_and_peak(
      4, 2,
      {"--use_torch_fsdp2", "true", "--tensor_model_parallel_size", "2", "--sequence_parallel",
       "true"});
  EXPECT_EQ(peak, planned) << "FSDP x TP";
  // And over data x context-parallel ranks (2 x 2).
  const auto [planned_cp, peak_cp] =
      planned_and_peak(4, 2, {"--use_torch_fsdp2", "true", "--context_parallel_size", "2"});
  EXPECT_EQ(peak_cp, planned_cp) << "FSDP x CP";
  // LoRA: the frozen base whole beside ZeRO-1's adapter shards, or sharded by FSDP (its
  // shards and gathered-unit slots), alone and over the data-parallel ranks of each
  // tensor-parallel part.
  for (const auto& [world, batch, keys] : std::vector<std::tuple<int, int64_t, std::vector<std::string>>>{
           {3, 3, {"--use_distributed_optimizer", "true"}},
           {3, 3, {"--use_torch_fsdp2", "true"}},
           {4, 2, {"--use_torch_fsdp2", "true", "--tensor_model_parallel_size", "2"}}}) {
    std::vector<std::string> lora = {"--lora_rank", "4"};
    lora.insert(lora.end(), keys.begin(), keys.end());
    const auto [planned_lora, peak_lora] = planned_and_peak(world, batch, lora);
    EXPECT_EQ(peak_lora, planned_lora) << "LoRA " << keys.front() << " on " << world << " ranks";
  }
}

// GRPO over 2 thread ranks with ZeRO-1 and a KL reference: the planner's bytes, its generator
// (a group's KV cache, states and scratch) and reference copy included, are the largest rank's
// peak after a step that generated, exactly.
TEST(MemoryPlan, MatchesTheLargestRankPeakOfGrpoRuns) {
  namespace fs = std::filesystem;
  const fs::path prompts = fs::temp_directory_path() / ("grpo_plan_prompts_" + std::to_string(::getpid()) + ".jsonl");
  {
    std::ofstream out(prompts);
    for (int i = 0; i < 4; ++i) out << R"({"prompt": "Is )" << 10 + i << R"( even?", "answer": "yes"})" << "\n";
  }
  const auto [planned, peak] = planned_and_peak(
      2, 8,
      {"--objective", "grpo", "--mock_data", "false", "--data_path", "null", "--train_data_path", prompts.string(),
       "--grpo_num_generations", "4", "--grpo_max_completion_length", "8", "--grpo_rewards", "answer,overlong",
       "--use_distributed_optimizer", "true", "--grpo_beta", "0.1"});
  EXPECT_EQ(peak, planned);
  // Under LoRA: the generator reads the frozen base, the reference is a copy of the adapters.
  const auto [planned_lora, peak_lora] = planned_and_peak(
      2, 8,
      {"--objective", "grpo", "--mock_data", "false", "--data_path", "null", "--train_data_path", prompts.string(),
       "--grpo_num_generations", "4", "--grpo_max_completion_length", "8", "--grpo_rewards", "answer,overlong",
       "--use_distributed_optimizer", "true", "--grpo_beta", "0.1", "--lora_rank", "4"});
  EXPECT_EQ(peak_lora, planned_lora);
  // The KV cache in the AdamW moments' memory: the peak falls by the cache, as planned.
  const std::vector<std::string> no_reference = {
      "--objective", "grpo", "--mock_data", "false", "--data_path", "null", "--train_data_path", prompts.string(),
      "--grpo_num_generations", "4", "--grpo_max_completion_length", "8", "--grpo_rewards", "answer,overlong",
      "--use_distributed_optimizer", "true"};
  std::vector<std::string> offload = no_reference;
  offload.insert(offload.end(), {"--grpo_offload_optimizer_state", "true"});
  const auto [planned_kept, peak_kept] = planned_and_peak(2, 8, no_reference);
  const auto [planned_offload, peak_offload] = planned_and_peak(2, 8, offload);
  // Split placement, two training ranks and one generating: the training ranks hold no
  // generator, only their link to it.
  std::vector<std::string> split_keys = {
      "--num_layers",          "2",  "--hidden_size", "64",
      "--num_attention_heads", "4",  "--num_query_groups",    "2",  "--seq_length",  "32",
      "--micro_batch_size", "1",     "--global_batch_size",   "8",  "--train_iters", "1",
      "--lr_warmup_iters",  "0",     "--eval_interval",       "0",  "--ddp_bucket_size", "5000",
      "--device",           "cpu",   "--grpo_generation_gpus", "1"};
  split_keys.insert(split_keys.end(), no_reference.begin(), no_reference.end());
  const Experiment split = load("", split_keys, 3);
  const RunSetup split_setup =
      make_run_setup(split, {2, DType::F32}, [&] { return make_tokenizer(split.data)->vocab_size(); });
  const size_t planned_split = plan_memory(plan_input(split_setup, /*gpu=*/false)).allocated();
  // The generation rank: a copy of the weights, a generator for both training ranks' completions
  // and its link.
  const size_t planned_generation =
      grpo_generation_rank_bytes(split_setup.spec, split_setup.runtime, grpo_generation_share(split, 2, 2));
  const auto [peak_split, peak_generation] = split_rank_peaks(split, 3, 1);
  fs::remove(prompts);
  EXPECT_EQ(peak_split, planned_split);
  EXPECT_LT(peak_split, peak_kept);
  EXPECT_EQ(peak_generation, planned_generation);
  EXPECT_EQ(peak_kept, planned_kept);
  EXPECT_EQ(peak_offload, planned_offload);
  EXPECT_LT(peak_offload, peak_kept);
}

// Expert parallelism: each rank holds its experts only (and, under ZeRO-1, a shard of the
// rest's state and of its experts' over their expert-data-parallel ranks); the planner's
// bytes are the largest rank's peak, exactly: plain, ZeRO-1, and ZeRO-1 with token dropping
// (the experts' rows planned at capacity). Half the experts' weights on each rank.
TEST(MemoryPlan, MatchesTheLargestRankPeakOfExpertParallelRuns) {
  const std::vector<std::string> moe = {
      "--model_family",        "mixtral", "--num_experts",    "4", "--moe_router_topk", "2",
      "--moe_ffn_hidden_size", "48",      "--moe_layer_freq", "1"};
  for (const auto& [zero1, capacity] :
       {std::pair{"false", "null"}, std::pair{"true", "null"}, std::pair{"true", "0.75"}}) {
    std::vector<std::string> keys = moe;
    keys.insert(keys.end(), {"--expert_model_parallel_size", "2", "--use_distributed_optimizer",
                             zero1, "--moe_expert_capacity_factor", capacity});
    const auto [planned, peak] = planned_and_peak(4, 4, keys);
    EXPECT_EQ(peak, planned) << "use_distributed_optimizer " << zero1 << ", capacity factor "
                             << capacity;
  }
  std::vector<std::string> keys = moe;
  keys.insert(keys.end(), {"--micro_batch_size", "1", "--global_batch_size", "2"});
  PlanInput split = input_for(load("", keys, 2), 2), whole = split;
  split.runtime.expert_parallel_size = 2;
  EXPECT_LT(plan_memory(split).weights, plan_memory(whole).weights);
}

// Peak memory_stats() of `tessera bench model` on one NVIDIA H200, measured 2026-11-22
// (docs/performance.md; at commit 8bdf54c with cuDNN attention and one output-head chunk;
// FP8 without the cache at ff5efdb with two chunks of 4096): proxies with 4 layers, seq 8192,
// micro batch 1. The planner's allocated bytes must be within 10% of each.
TEST(MemoryPlan, WithinTenPercentOfPeaksMeasuredOnH200) {
  struct Measured {
    const char* config;
    std::vector<std::string> extra;
    double peak_gib;
  };
  const Measured runs[] = {
      {"llama3.1_8B-pretrain", {}, 39.64},
      {"qwen2.5_7B-pretrain", {}, 42.41},
      {"mistral_7B-pretrain", {"--sliding_window", "4096"}, 24.96},
      {"llama3.1_8B-pretrain", {"--fp8", "hybrid"}, 41.82},
      {"llama3.1_8B-pretrain", {"--fp8", "hybrid", "--fp8_lm_head", "true"}, 44.31},
      {"llama3.1_8B-pretrain",
       {"--fp8", "hybrid", "--no_fp8_weight_transpose_cache", "--cross_entropy_chunk_tokens",
        "4096"},
       39.32},
  };
  for (const Measured& m : runs) {
    std::vector<std::string> o = {"--num_layers",       "4", "--seq_length",        "8192",
                                  "--micro_batch_size", "1", "--global_batch_size", "1"};
    o.insert(o.end(), m.extra.begin(), m.extra.end());
    const MemoryPlan p = plan_memory(input_for(load(m.config, o)));
    const double planned = p.allocated() / kGiB;
    std::printf("%-22s planned %.2f GiB, measured %.2f GiB (%+.1f%%)\n", m.config, planned,
                m.peak_gib, 100.0 * (planned - m.peak_gib) / m.peak_gib);
    EXPECT_NEAR(planned, m.peak_gib, 0.10 * m.peak_gib) << m.config;
  }
}

MemoryQuery gpu_query(const std::string& config, const std::vector<std::string>& keys, int64_t gpus,
                      const char* gpu) {
  MemoryQuery q;
  q.experiment = load(config, keys, static_cast<int>(gpus));
  q.num_gpus = gpus;
  q.gpu = *analysis::find_gpu_spec(gpu);
  return q;
}

const std::string& text(const analysis::Table& t, size_t row, const char* column) {
  return std::get<std::string>(t.rows[row][t.column(column)]);
}

double number(const analysis::Table& t, size_t row, const char* column) {
  return std::get<double>(t.rows[row][t.column(column)]);
}

// "--fp8 hybrid --recompute_granularity full" -> {"--fp8", "hybrid", ...}
std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// The README's 8-GPU recipe: --use_distributed_optimizer true is ZeRO-1 in the plan as in
// training. Llama 3.1 8B at micro batch 2 without recompute then needs 127.5 GiB per GPU: it
// fits an H200 (plain data parallel, 193 GiB, does not), and on an H100 the verdict names the
// key that makes it fit, which does.
TEST(MemoryCommand, ReadmeRecipePlansZero1FromTheTrainingKey) {
  // The numbers depend on the build's GPU platform (the scratch sizes it asks for): the
  // command must print the planner's verdicts, which are checked here.
  const auto verdict = [](std::vector<std::string> keys, const char* gpu) {
    return build_memory_report(gpu_query("llama3.1_8B-pretrain", std::move(keys), 8, gpu));
  };
  const std::string recipe =
      "memory --config llama3.1_8B-pretrain --num_gpus 8 --use_distributed_optimizer true";
  RunResult r = run_tessera(recipe + " --gpu H200");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "sharding zero1 (use_distributed_optimizer")) << r.output;
  EXPECT_TRUE(contains(r.output, "| optimizer | 10037826560 |")) << r.output;  // P/8 x 10 B
  const MemoryReport h200 = verdict({"--use_distributed_optimizer", "true"}, "H200");
  EXPECT_TRUE(h200.verdict.starts_with("FITS on H200: 127.")) << h200.verdict;
  EXPECT_TRUE(contains(r.output, "\n" + h200.verdict)) << r.output;

  r = run_tessera(recipe + " --gpu H100");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const MemoryReport h100 = verdict({"--use_distributed_optimizer", "true"}, "H100");
  EXPECT_TRUE(h100.verdict.starts_with("DOES NOT FIT on H100: 127.")) << h100.verdict;
  EXPECT_TRUE(contains(h100.verdict, "Fits with --recompute_granularity full (6")) << h100.verdict;
  EXPECT_TRUE(contains(r.output, "\n" + h100.verdict)) << r.output;
  r = run_tessera(recipe + " --gpu H100 --recompute_granularity full");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "\nFITS on H100: 6")) << r.output;

  // The experiment turns the distributed optimizer on (Primus's pre_trainer module); plain
  // data parallelism does not fit an H200.
  r = run_tessera(
      "memory --config llama3.1_8B-pretrain --num_gpus 8 --gpu H200 "
      "--use_distributed_optimizer false");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "sharding none (plain data parallel")) << r.output;
  EXPECT_TRUE(contains(r.output, "\nDOES NOT FIT on H200: 192.")) << r.output;

  const MemoryReport z = verdict({}, "H200");
  EXPECT_EQ(z.sharding, StateSharding::Zero1);
  EXPECT_TRUE(z.fits) << z.verdict;
  EXPECT_EQ(z.plan.optimizer, (kLlama8BParams + 7) / 8 * 10);
}

// A mesh splits what each GPU holds: tensor parallelism the weights and (with sequence
// parallelism) every activation of the residual stream, a pipeline the layers (planned at its
// fullest stage, the first: it holds the embedding and the most micro-batches); ZeRO-1 shards
// over the data-parallel ranks that remain.
TEST(MemoryPlan, MeshesSplitTheModel) {
  const Experiment one = load("llama3.1_8B-pretrain", {});
  const MemoryPlan whole = plan_memory(input_for(one));
  const MemoryPlan tp = plan_memory(
      input_for(load("llama3.1_8B-pretrain",
                     {"--tensor_model_parallel_size", "2", "--sequence_parallel", "true"}, 2),
                2));
  // Every tensor of Llama 8B splits over 2 ranks but the norms (replicated): (P - norms) / 2.
  constexpr int64_t kNorms = 65 * 4096;
  EXPECT_EQ(tp.weights, ((kLlama8BParams - kNorms) / 2 + kNorms) * 2);
  EXPECT_LT(tp.activations, whole.activations * 0.55);
  const PlanInput pp = input_for(
      load("llama3.1_8B-pretrain",
           {"--pipeline_model_parallel_size", "4", "--use_distributed_optimizer", "true"}, 8),
      8);
  EXPECT_EQ(pp.data_parallel, 2);
  EXPECT_EQ(pp.runtime.pipeline_chunks.size(), 1u);
  EXPECT_EQ(pp.runtime.pipeline_chunks[0].count, 8);
  EXPECT_EQ(pp.runtime.pipeline_slots, 4);  // stage 0 of 4 holds 4 micro-batches (1F1B)
  // 8 layers and the embedding: a quarter of the layers' weights and one of the two tables.
  const MemoryPlan stage0 = plan_memory(pp);
  EXPECT_LT(stage0.weights, whole.weights * 0.33);
  EXPECT_EQ(stage0.optimizer, (DecoderModel::plan_layout(pp.spec, pp.runtime).total + 1) / 2 * 10);
}

// The DeepSeek-V3 proxy (3 layers, all MoE: 36.4 B parameters, 33.8 B of them in 256 experts
// per layer) on 8 H200s, routed by its router at seq 8192: every GPU holding every expert
// cannot fit; with the experts split 8 ways (the experiment's layout) each holds 32 per layer
// and, with full recompute, it fits.
TEST(MemoryReport, DeepSeekV3ProxyFitsEightH200sWithItsExpertsSplit) {
  const std::vector<std::string> ep8 = {
      "--num_layers", "3",    "--moe_layer_freq",          "1",    "--micro_batch_size",  "1",
      "--seq_length", "8192", "--max_position_embeddings", "8192", "--moe_force_balance", "false"};
  std::vector<std::string> proxy = ep8;
  proxy.insert(proxy.end(), {"--expert_model_parallel_size", "1"});
  const MemoryReport all = build_memory_report(gpu_query("deepseek_v3-pretrain", proxy, 8, "H200"));
  const MemoryReport split = build_memory_report(gpu_query("deepseek_v3-pretrain", ep8, 8, "H200"));
  EXPECT_FALSE(all.fits);
  EXPECT_FALSE(contains(all.verdict, "Fits with --recompute_granularity full (")) << all.verdict;
  EXPECT_LT(split.plan.weights, all.plan.weights / 4);
  EXPECT_LT(split.plan.gradients, all.plan.gradients / 4);
  EXPECT_TRUE(contains(split.verdict, "Fits with --recompute_granularity full (")) << split.verdict;
  // Routed by the router, the experts' rows are planned for the worst case, and the report says
  // so, with what bounds them; a capacity factor and force-balanced routing are alternatives.
  EXPECT_TRUE(contains(split.summary, "expert rows planned at the dropless worst case"))
      << split.summary;
  EXPECT_TRUE(contains(split.summary, "experts split over 8 expert-parallel GPUs"))
      << split.summary;
  EXPECT_FALSE(contains(split.summary, "sharding none")) << split.summary;
  bool capacity = false;
  for (size_t i = 0; i < split.scenarios.rows.size(); ++i)
    capacity = capacity || text(split.scenarios, i, "flags") == "--moe_expert_capacity_factor 1.0";
  EXPECT_TRUE(capacity);
  // Every GPU holding every expert is told of expert parallelism among the alternatives.
  std::set<std::string> ep_rows;
  for (size_t i = 0; i < all.scenarios.rows.size(); ++i)
    if (contains(text(all.scenarios, i, "flags"), "--expert_model_parallel_size"))
      ep_rows.insert(text(all.scenarios, i, "flags"));
  for (const char* ep : {"--expert_model_parallel_size 2", "--expert_model_parallel_size 8",
                         "--recompute_granularity full --expert_model_parallel_size 8"})
    EXPECT_EQ(ep_rows.count(ep), 1u) << ep;  // the experiment has the distributed optimizer
}

// When no alternative fits on the GPUs asked about, the verdict names the fewest GPUs (doubling)
// on which the run fits, with the keys it then needs.
TEST(MemoryReport, ARunThatFitsNoAlternativeIsToldHowManyGpusItNeeds) {
  const MemoryReport r = build_memory_report(gpu_query("llama3.1_70B-pretrain", {}, 2, "H100"));
  EXPECT_FALSE(r.fits);
  EXPECT_FALSE(contains(r.verdict, "Fits with")) << r.verdict;
  EXPECT_TRUE(contains(r.verdict, "It fits on 64 GPUs, 8 nodes of 8 (")) << r.verdict;
  EXPECT_TRUE(contains(r.verdict, "--num_gpus 64 --global_batch_size 192.")) << r.verdict;
  // Those keys do fit there.
  const MemoryReport there = build_memory_report(
      gpu_query("llama3.1_70B-pretrain", {"--global_batch_size", "192"}, 64, "H100"));
  EXPECT_TRUE(there.fits) << there.verdict;
}

// 70B on 16 H100s fits only split: the verdict names the mesh keys to change. Primus's layout
// for one node (FSDP, full recompute, sequence parallelism) keeps FSDP under tensor
// parallelism 4 (torchtitan's 2D); the mesh of 8 x 2 stages without FSDP fits too.
TEST(MemoryReport, ANonFittingRunIsToldTheMeshThatFits) {
  const MemoryReport r = build_memory_report(
      gpu_query("llama3.1_70B-pretrain", {"--global_batch_size", "48"}, 16, "H100"));
  EXPECT_FALSE(r.fits);
  EXPECT_TRUE(contains(r.verdict, "Fits with --tensor_model_parallel_size 4 (")) << r.verdict;
  bool staged = false;
  for (const auto& row : r.scenarios.rows)
    staged = staged || std::get<std::string>(row[0]) ==
                           "--tensor_model_parallel_size 8 --pipeline_model_parallel_size 2 "
                           "--use_torch_fsdp2 false";
  EXPECT_TRUE(staged);
}

// --use_torch_fsdp2 true on 8 GPUs: the breakdown is FullyShardedDataParallel's (shards plus
// unit slots); fitting it on an H100 takes selective recompute.
TEST(MemoryCommand, Fsdp2OnEightGpusShowsTheFsdpBreakdown) {
  const MemoryPlan fsdp =
      plan_memory(input_for(load("llama3.1_8B-pretrain", {"--use_torch_fsdp2", "true"}, 8), 8));
  const RunResult r = run_tessera(
      "memory --config llama3.1_8B-pretrain --num_gpus 8 --use_torch_fsdp2 true --gpu H100");
  const MemoryReport report = build_memory_report(
      gpu_query("llama3.1_8B-pretrain", {"--use_torch_fsdp2", "true"}, 8, "H100"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "sharding fsdp (use_torch_fsdp2: weights, gradients")) << r.output;
  EXPECT_TRUE(contains(r.output, "| weights | " + std::to_string(fsdp.weights) + " |")) << r.output;
  EXPECT_TRUE(contains(r.output, "+ gathered-unit slots (current, prefetched)")) << r.output;
  EXPECT_TRUE(contains(r.output, "| gradients | " + std::to_string(fsdp.gradients) + " |"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "+ unit gradient slots")) << r.output;
  // Said in the user's terms: no class or function of Tessera's code.
  EXPECT_FALSE(contains(r.output, "::")) << r.output;
  EXPECT_FALSE(contains(r.output, "FullyShardedDataParallel")) << r.output;
  // The command prints the report the planner makes (its numbers depend on the build's GPU
  // platform, whose scratch sizes it asks for).
  EXPECT_FALSE(report.fits);
  EXPECT_TRUE(contains(r.output, "\n" + report.verdict)) << r.output;
  EXPECT_TRUE(contains(report.verdict, "Fits with --recompute_granularity selective ("))
      << report.verdict;
}

// Every alternative's flags are training keys: appended to the command line they load (so
// they can be pasted), and the run they set up plans to the row's numbers; the row's
// largest_micro_batch flag loads too, and fits.
TEST(MemoryReport, AlternativesAreCommandLineFlags) {
  const std::vector<std::string> base = {"--use_distributed_optimizer", "true"};
  const MemoryQuery q = gpu_query("llama3.1_8B-pretrain", base, 8, "H100");
  const MemoryReport r = build_memory_report(q);
  const analysis::Table& t = r.scenarios;
  // bf16, fp8 hybrid, fp32 x recompute x sharding; the precision-aware optimizer's bf16 state
  // as configured and with full recompute; then the 9 meshes of tp x pp <= 8 ranks (but 1 x
  // 1), as configured and with full recompute.
  ASSERT_EQ(t.rows.size(), 3u * 3 * 3 + 2 + 9 * 2);
  EXPECT_EQ(t.summary_rows, t.rows.size());
  EXPECT_EQ(r.breakdown.rows.size(), 9u);
  const size_t capacity = gpu_capacity_bytes(q.gpu);
  EXPECT_EQ(capacity, size_t{80} << 30);
  int as_configured = 0;
  for (size_t i = 0; i < t.rows.size(); ++i) {
    const std::string& flags = text(t, i, "flags");
    std::vector<std::string> keys = base;
    if (flags == "(as configured)") {
      ++as_configured;
    } else {
      for (const std::string& w : words(flags)) keys.push_back(w);
    }
    const Experiment alt = load("llama3.1_8B-pretrain", keys, 8);
    const MemoryPlan p = plan_memory(input_for(alt, 8));
    EXPECT_DOUBLE_EQ(number(t, i, "total_gib"), p.total() / kGiB) << flags;
    EXPECT_DOUBLE_EQ(number(t, i, "fp8_gib"), p.fp8 / kGiB) << flags;
    EXPECT_EQ(text(t, i, "fits"), p.total() <= capacity ? "yes" : "no") << flags;
    const std::string& mbs = text(t, i, "largest_micro_batch");
    if (mbs == "none") continue;
    for (const std::string& w : words(mbs)) keys.push_back(w);
    EXPECT_LE(plan_memory(input_for(load("llama3.1_8B-pretrain", keys, 8), 8)).total(), capacity)
        << flags << " " << mbs;
  }
  EXPECT_EQ(as_configured, 1);
  // The configuration first, then from the least memory to the most.
  EXPECT_EQ(text(t, 0, "flags"), "(as configured)");  // bf16, no recompute, ZeRO-1
  for (size_t i = 2; i < t.rows.size(); ++i)
    EXPECT_LE(number(t, i - 1, "total_gib"), number(t, i, "total_gib")) << text(t, i, "flags");
}

// FP8 is in the header (mode, recipe and its buffers) and an axis of the alternatives: bf16
// rows have no FP8 buffers, `--fp8 hybrid` rows the planner's.
TEST(MemoryReport, Fp8IsInTheHeaderAndAnAxisOfTheAlternatives) {
  const std::vector<std::string> proxy = {"--num_layers",        "4", "--micro_batch_size", "1",
                                          "--global_batch_size", "1"};
  // Rows whose flags contain `flag`; the rows with FP8 buffers are exactly those when
  // `flag_turns_fp8_on`, else exactly the others.
  auto rows_with = [](const analysis::Table& t, const std::string& flag, bool flag_turns_fp8_on) {
    int n = 0;
    for (size_t i = 0; i < t.rows.size(); ++i) {
      const bool has = contains(text(t, i, "flags"), flag);
      n += has;
      EXPECT_EQ(number(t, i, "fp8_gib") > 0, has == flag_turns_fp8_on) << text(t, i, "flags");
    }
    return n;
  };
  const MemoryReport bf16 =
      build_memory_report(gpu_query("llama3.1_8B-pretrain", proxy, 1, "H200"));
  EXPECT_TRUE(contains(bf16.summary, "\nfp8: null (bf16 GEMMs)\n")) << bf16.summary;
  // Precision x recompute, and the precision-aware optimizer's bf16 state (as configured and
  // with full recompute).
  EXPECT_EQ(bf16.scenarios.rows.size(), 3u * 3 + 2);
  EXPECT_EQ(rows_with(bf16.scenarios, "--fp8 hybrid", true), 3);
  EXPECT_EQ(bf16.plan.fp8, 0u);

  std::vector<std::string> keys = proxy;
  keys.insert(keys.end(), {"--fp8", "hybrid"});
  const MemoryReport fp8 = build_memory_report(gpu_query("llama3.1_8B-pretrain", keys, 1, "H200"));
  ASSERT_GT(fp8.plan.fp8, 0u);
  char buffers[64];
  std::snprintf(buffers, sizeof buffers, "FP8 buffers %.2f GiB\n", fp8.plan.fp8 / kGiB);
  EXPECT_TRUE(contains(fp8.summary, "\nfp8: hybrid (delayed scaling), output head in bf16"))
      << fp8.summary;
  EXPECT_TRUE(contains(fp8.summary, buffers)) << fp8.summary;
  EXPECT_EQ(rows_with(fp8.scenarios, "--fp8 null", false), 6);  // bf16 and fp32
  EXPECT_EQ(fp8.breakdown.rows.size(), 10u);                    // with the fp8 line

  const RunResult r = run_tessera(
      "memory --config llama3.1_8B-pretrain --num_layers 4 --micro_batch_size 1 "
      "--global_batch_size 1 --gpu H200 --fp8 hybrid");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "\nfp8: hybrid (delayed scaling)")) << r.output;
  EXPECT_TRUE(contains(r.output, "\n| fp8 | ")) << r.output;
  EXPECT_TRUE(contains(r.output, "\n| --fp8 null --recompute_granularity full | ")) << r.output;
}

// With --device cpu the plan is for this host's memory, as the CPU backend reports it: no GPU
// verdict, no CUDA context or backend buffers, fp32 (precision auto there), and only the
// alternatives the CPU backend can run. N ranks are threads of one process
// (tessera train --nproc_per_node N): together they must fit.
TEST(MemoryCommand, DeviceCpuPlansHostMemory) {
  const std::string tiny =
      "memory --device cpu --mock_data true --num_layers 2 --micro_batch_size 2 "
      "--global_batch_size 4";
  const RunResult r = run_tessera(tiny);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  char host[64];
  std::snprintf(host, sizeof host, "this host's memory: %.2f GiB",
                make_cpu_backend()->memory_stats().device_total_bytes / kGiB);
  EXPECT_TRUE(contains(r.output, host)) << r.output;
  EXPECT_TRUE(contains(r.output, "as the CPU backend reports it; no GPU")) << r.output;
  EXPECT_TRUE(contains(r.output, "\nFITS in host memory: ")) << r.output;
  EXPECT_TRUE(contains(r.output, "fp32 weights and activations")) << r.output;
  EXPECT_TRUE(contains(r.output, "\nfp8: null (fp32 GEMMs)\n")) << r.output;
  for (const char* gpu_only :
       {"H100", "cuda_context", "backend_buffers", "--precision bf16", "--fp8 hybrid", "per GPU"})
    EXPECT_FALSE(contains(r.output, gpu_only)) << gpu_only << "\n" << r.output;
  EXPECT_EQ(run_tessera(tiny + " --gpu H100").exit_code, 2);
  const RunResult ranks = run_tessera(tiny + " --num_gpus 2 --use_distributed_optimizer true");
  ASSERT_EQ(ranks.exit_code, 0) << ranks.output;
  EXPECT_TRUE(contains(ranks.output, "2 ranks as threads of one process, sharding zero1"))
      << ranks.output;
  EXPECT_TRUE(contains(ranks.output, "\nFITS in host memory: 2 ranks x ")) << ranks.output;

  // Against a host of a given size: the whole plan (nothing added for a GPU) must fit in it.
  MemoryQuery q;
  q.experiment = load("", words(tiny.substr(7)));
  q.host = HostMemory{size_t{64} << 30, size_t{32} << 30, DType::F32};
  const MemoryReport fits = build_memory_report(q);
  EXPECT_TRUE(fits.fits) << fits.verdict;
  EXPECT_EQ(fits.plan.total(), fits.plan.weights + fits.plan.gradients + fits.plan.optimizer +
                                   fits.plan.activations + fits.plan.run_buffers);
  // Recompute only (fp32, no FP8, one process), and the precision-aware optimizer's bf16 state
  // as configured and with full recompute.
  EXPECT_EQ(fits.scenarios.rows.size(), 5u);
  EXPECT_EQ(fits.breakdown.rows.size(), 7u);
  q.host->total_bytes = fits.plan.total() - 1;
  const MemoryReport tight = build_memory_report(q);
  EXPECT_FALSE(tight.fits);
  EXPECT_TRUE(tight.verdict.starts_with("DOES NOT FIT in host memory")) << tight.verdict;

  q.experiment = load("", words(tiny.substr(7)), 2);
  q.num_gpus = 2;
  const size_t per_rank = build_memory_report(q).plan.total();  // + data parallelism's flag
  EXPECT_EQ(per_rank, fits.plan.total() + sizeof(float));
  q.host->total_bytes = 2 * per_rank;  // two such ranks: exactly full
  EXPECT_TRUE(build_memory_report(q).fits);
  q.host->total_bytes -= 2;
  EXPECT_FALSE(build_memory_report(q).fits);
}

// Megatron spells options with dashes: `--num-gpus 8` is `--num_gpus 8`, for memory's own
// options and the training keys alike.
TEST(MemoryCommand, DashedNamesAreAccepted) {
  const RunResult dashed = run_tessera(
      "memory --config llama3.1_8B-pretrain --num-gpus 8 --use-distributed-optimizer true "
      "--micro-batch-size 1 --gpu H200");
  const RunResult underscored = run_tessera(
      "memory --config llama3.1_8B-pretrain --num_gpus 8 --use_distributed_optimizer true "
      "--micro_batch_size 1 --gpu H200");
  ASSERT_EQ(dashed.exit_code, 0) << dashed.output;
  EXPECT_EQ(dashed.output, underscored.output);
  EXPECT_TRUE(contains(dashed.output,
                       "GPUs: 8 x H200 (141 GB HBM, configs/gpus.yaml), sharding "
                       "zero1"))
      << dashed.output;
}

TEST(MemoryCommand, PrintsAndWritesTheTables) {
  namespace fs = std::filesystem;
  const fs::path out = fs::temp_directory_path() / ("tessera_memory_" + std::to_string(getpid()));
  const RunResult r = run_tessera(
      "memory --config llama3.1_8B-pretrain --num_layers 4 --micro_batch_size 1 "
      "--global_batch_size 8 --num_gpus 8 --use_distributed_optimizer true --gpu H200 -o " +
      out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "\nFITS on H200")) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "\n| --recompute_granularity full --use_distributed_optimizer false "
                       "--use_torch_fsdp2 true | "))
      << r.output;
  for (const char* f : {"memory_breakdown.csv", "memory_scenarios.csv", "memory.md"})
    EXPECT_TRUE(fs::exists(out / f)) << f;
  fs::remove_all(out);
  EXPECT_EQ(run_tessera("memory --gpu Z100").exit_code, 2);
  EXPECT_EQ(run_tessera("memory --config llama3.1_8B-pretrain --num_gpus 3").exit_code,
            2);  // 256 % 6
}

// `--sharding` is a deprecated spelling of the training keys: it plans the same and says which
// key to use; training keys given as well take precedence.
TEST(MemoryCommand, ShardingIsADeprecatedAliasOfTheTrainingKeys) {
  const std::string proxy =
      "memory --config llama3.1_8B-pretrain --num_layers 4 --micro_batch_size 1 "
      "--global_batch_size 8 --num_gpus 8 --gpu H200";
  const RunResult alias = run_tessera(proxy + " --sharding zero1");
  ASSERT_EQ(alias.exit_code, 0) << alias.output;
  EXPECT_TRUE(contains(alias.output,
                       "warning: --sharding is deprecated; the training keys decide the sharding: "
                       "--use_distributed_optimizer true --use_torch_fsdp2 false\n"))
      << alias.output;
  const RunResult key = run_tessera(proxy + " --use_distributed_optimizer true");
  EXPECT_EQ(alias.output.substr(alias.output.find("model:")), key.output);
  EXPECT_TRUE(contains(run_tessera(proxy + " --sharding none --use_torch_fsdp2 true").output,
                       "sharding fsdp"));
  EXPECT_EQ(run_tessera(proxy + " --sharding zero3").exit_code, 2);
}

}  // namespace
}  // namespace tessera::plan
