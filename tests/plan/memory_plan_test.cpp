// The memory planner against hand calculations, against the real allocations of a training
// run on the CPU backend, and against peaks measured on a GPU.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/run_command.h"

#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/data/tokenizer.h"
#include "tessera/obs/logger.h"
#include "tessera/plan/memory_plan.h"
#include "tessera/plan/memory_report.h"
#include "tessera/train/trainer.h"

namespace tessera::plan {
namespace {

using testing::RunResult;
using testing::run_tessera;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

Experiment load(const std::string& config, std::vector<std::string> overrides) {
  LoadOptions o;
  o.config_path = config;
  o.cli_overrides = std::move(overrides);
  return load_experiment(o);
}

PlanInput input_for(const Experiment& e, int64_t gpus = 1,
                    StateSharding sharding = StateSharding::None) {
  RunSetup setup = make_run_setup(e, {static_cast<int>(gpus), DType::BF16},
                                  [&] { return make_tokenizer(e.data)->vocab_size(); });
  setup.sharding = sharding;
  setup.runtime.sharded_params = sharding == StateSharding::Fsdp;
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
  const PlanInput in = input_for(load("llama3.1_8B-pretrain", {}));
  const MemoryPlan p = plan_memory(in);
  // The seed reports' table: 8B parameters x 2 bytes = 16 GB of bf16 weights.
  EXPECT_EQ(p.weights, kLlama8BParams * 2);
  EXPECT_NEAR(p.weights / 1e9, 16.06, 0.01);
  EXPECT_EQ(p.gradients, kLlama8BParams * 4);
  // Adam with fp32 master weights: 12 bytes per parameter (master + two moments).
  EXPECT_EQ(p.optimizer, kLlama8BParams * 12);
  EXPECT_EQ(p.backend_buffers, kBackendBuffersBytes);
  EXPECT_EQ(p.context, kContextBytes);
  EXPECT_EQ(p.total(), p.weights + p.gradients + p.optimizer + p.activations +
                           kBackendBuffersBytes + kContextBytes);

  PlanInput fp32 = in;
  fp32.runtime.compute_dtype = DType::F32;
  const MemoryPlan q = plan_memory(fp32);
  EXPECT_EQ(q.weights, kLlama8BParams * 4);
  EXPECT_EQ(q.optimizer, kLlama8BParams * 8);  // the fp32 weights are the master copy
  EXPECT_GT(q.activations, p.activations);
}

TEST(MemoryPlan, ShardingSplitsTheRightParts) {
  const Experiment e = load("llama3.1_8B-pretrain", {"--global_batch_size", "16"});
  const int64_t shard = (kLlama8BParams + 7) / 8;
  const MemoryPlan none = plan_memory(input_for(e, 8, StateSharding::None));
  const MemoryPlan zero1 = plan_memory(input_for(e, 8, StateSharding::Zero1));
  const MemoryPlan fsdp = plan_memory(input_for(e, 8, StateSharding::Fsdp));
  EXPECT_EQ(none.optimizer, kLlama8BParams * 12);
  EXPECT_EQ(zero1.weights, none.weights);
  EXPECT_EQ(zero1.gradients, none.gradients);
  EXPECT_EQ(zero1.optimizer, shard * 12);
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
  EXPECT_EQ(fsdp.optimizer, fsdp_shard * 12);
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

// The planner's bytes are what a training run on the CPU backend really allocates (peak of
// the backend's own accounting), for every recompute mode. The trainer adds one 256-byte
// scalar for the gradient norm.
TEST(MemoryPlan, MatchesRealPeakOnCpuBackend) {
  for (const char* recompute : {"null", "selective", "full"}) {
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
                                   recompute,
                                   "--cross_entropy_chunk_tokens",
                                   "24",
                                   "--device",
                                   "cpu"});
    PlanInput in = input_for(e);
    in.runtime.compute_dtype = DType::F32;  // the CPU backend trains in fp32
    in.gpu = false;
    const MemoryPlan p = plan_memory(in);

    Logger log("", 0, false, false);
    Trainer trainer(e, make_cpu_backend(), log, nullptr);
    trainer.run_iteration(1);  // forward, backward and the optimizer step
    const MemoryStats s = trainer.backend().memory_stats();
    EXPECT_GE(s.peak_bytes, p.allocated()) << recompute;
    EXPECT_LE(s.peak_bytes, p.allocated() + 256) << recompute;
  }
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

TEST(MemoryReport, VerdictAndAlternatives) {
  MemoryQuery q;
  q.experiment = load("llama3.1_8B-pretrain", {"--global_batch_size", "16"});
  q.gpu = *analysis::find_gpu_spec("H100");
  q.num_gpus = 8;
  q.sharding = StateSharding::None;
  const MemoryReport r = build_memory_report(q);
  EXPECT_FALSE(r.fits);  // 16 B/param of state alone is 120 GiB
  EXPECT_NE(r.verdict.find("DOES NOT FIT"), std::string::npos);
  EXPECT_EQ(r.scenarios.rows.size(), 2u * 3 * 3);
  EXPECT_EQ(r.breakdown.rows.size(), 8u);

  q.sharding = StateSharding::Fsdp;
  q.experiment = load("llama3.1_8B-pretrain",
                      {"--global_batch_size", "16", "--recompute_granularity", "full"});
  const MemoryReport f = build_memory_report(q);
  EXPECT_TRUE(f.fits) << f.verdict;
  EXPECT_GT(f.largest_micro_batch, 1);
  EXPECT_EQ(gpu_capacity_bytes(q.gpu), size_t{80} << 30);
}

TEST(MemoryCommand, PrintsAndWritesTheTables) {
  namespace fs = std::filesystem;
  const fs::path out = fs::temp_directory_path() / ("tessera_memory_" + std::to_string(getpid()));
  const RunResult r = run_tessera(
      "memory --config llama3.1_8B-pretrain --num_layers 4 --micro_batch_size 1 "
      "--global_batch_size 8 --num_gpus 8 --sharding zero1 --gpu H200 -o " +
      out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("FITS on H200"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("| bf16 | full | fsdp |"), std::string::npos) << r.output;
  for (const char* f : {"memory_breakdown.csv", "memory_scenarios.csv", "memory.md"})
    EXPECT_TRUE(fs::exists(out / f)) << f;
  fs::remove_all(out);
  EXPECT_EQ(run_tessera("memory --sharding zero3").exit_code, 2);
  EXPECT_EQ(run_tessera("memory --gpu Z100").exit_code, 2);
  EXPECT_EQ(run_tessera("memory --config llama3.1_8B-pretrain --num_gpus 3").exit_code, 2);  // 256 % 6
}

}  // namespace
}  // namespace tessera::plan
