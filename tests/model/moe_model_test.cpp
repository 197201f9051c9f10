// MoE models: the families' specs and checks, the published presets' parameter counts (total
// and active), model FLOPs on active parameters, the layout of MoE and dense layers, recompute
// (full and selective) reproducing gradients and balance statistics bit for bit, force-balanced
// routing, and the checkpoint description of an MoE model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "model/tiny_decoder.h"
#include "common/model_step.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/ckpt/model_spec_json.h"
#include "tessera/config/config.h"
#include "tessera/core/error.h"
#include "tessera/core/random.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/init.h"
#include "tessera/model/model_family.h"

namespace tessera {
namespace {

// A tiny Mixtral-family model: MoE in layers 0 and 2 of 3, a shared expert, both losses.
ModelSpec tiny_moe_spec() {
  ModelSpec s = tiny_decoder_spec(3);
  s.family = "mixtral";
  s.moe.experts = 4;
  s.moe.topk = 2;
  s.moe.ffn = 24;
  s.moe.shared_ffn = 16;
  s.moe.layers = {true, false, true};
  s.moe.aux_loss_coeff = 0.01;
  s.moe.z_loss_coeff = 0.001;
  return s;
}

using Result = testing::ModelStep;
using testing::one_model_step;

ModelRuntime runtime() {
  ModelRuntime rt;
  rt.micro_batch = 2;
  rt.seq_length = 12;
  return rt;
}

// The shipped MoE experiments spread their experts over a node's 8 GPUs (Primus's layout), so
// they are loaded for 8 ranks.
Experiment load(const std::string& name, std::vector<std::string> cli = {}) {
  LoadOptions o;
  o.config_path = name;
  o.cli_overrides = std::move(cli);
  o.data_parallel_size = name.ends_with("-pretrain") ? 8 : 1;
  return load_experiment(o);
}

TEST(MoeModel, PresetsHaveThePublishedParameterCounts) {
  // Hugging Face's counts of Mixtral-8x7B-v0.1 and Qwen3-30B-A3B; active: all but the experts
  // a token does not use.
  const ModelSpec mixtral = make_model_spec(load("mixtral_8x7B-pretrain"), 32000);
  EXPECT_EQ(mixtral.family, "mixtral");
  EXPECT_EQ(mixtral.total_params(), 46702792704);
  EXPECT_EQ(mixtral.active_params(), 12879925248);
  const ModelSpec qwen = make_model_spec(load("qwen3_30B_A3B-pretrain"), 151936);
  EXPECT_EQ(qwen.family, "qwen3_moe");
  EXPECT_TRUE(qwen.qk_norm);
  EXPECT_EQ(qwen.total_params(), 30532122624);
  EXPECT_EQ(qwen.active_params(), 3353032704);
  EXPECT_NE(qwen.summary().find("128 experts top-8"), std::string::npos) << qwen.summary();
  EXPECT_NE(qwen.summary().find("3.353B active"), std::string::npos) << qwen.summary();
}

TEST(MoeModel, FlopsCountActiveParameters) {
  // 6 x (head + per layer: attention, router, top-2 experts) + attention's 12 s d per layer.
  const ModelSpec s = make_model_spec(load("mixtral_8x7B-pretrain"), 32000);
  const double C = 4096, F = 14336, V = 32000, L = 32, seq = 4096;
  const double per_layer = C * (4096 + 2 * 1024) + 4096 * C + 8 * C + 2 * 3 * C * F;
  EXPECT_EQ(s.matmul_params(), static_cast<int64_t>(V * C + L * per_layer));
  EXPECT_DOUBLE_EQ(s.flops_per_token(4096), 6 * (V * C + L * per_layer) + L * 12 * seq * 4096);
}

TEST(MoeModel, FamiliesCheckTheirKeys) {
  struct Bad {
    std::vector<std::string> cli;
    const char* key;
  };
  for (const Bad& b : std::vector<Bad>{
           {{"--num_experts", "0"}, "num_experts"},
           {{"--qk_layernorm", "true"}, "qk_layernorm"},
           {{"--model_family", "qwen3_moe"}, "qk_layernorm"},
           {{"--model_family", "llama"}, "num_experts"},
           {{"--model_family", "llama", "--num_experts", "0", "--qk_layernorm", "true"},
            "qk_layernorm"}}) {
    SCOPED_TRACE(b.key);
    // Experts on one rank: a model that is not an MoE one has no experts to spread.
    std::vector<std::string> cli = {"--model",
                                    "mixtral_8x7B",
                                    "--mock_data",
                                    "true",
                                    "--num_layers",
                                    "2",
                                    "--expert_model_parallel_size",
                                    "1"};
    cli.insert(cli.end(), b.cli.begin(), b.cli.end());
    try {
      make_model_spec(load("mixtral_8x7B-pretrain", cli), 32000);
      ADD_FAILURE() << "accepted";
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.key(), b.key) << e.what();
    }
  }
}

TEST(MoeModel, LayoutHasExpertsInTheMoeLayersOnly) {
  const ModelSpec s = tiny_moe_spec();
  const ParamLayout l = make_param_layout(s);
  auto has = [&](const std::string& name) { return l.find(name) != nullptr; };
  EXPECT_TRUE(has("model.layers.0.mlp.router.weight"));
  EXPECT_TRUE(has("model.layers.0.mlp.experts.gate_up_proj.weight"));
  EXPECT_TRUE(has("model.layers.2.mlp.shared_expert.down_proj.weight"));
  EXPECT_FALSE(has("model.layers.1.mlp.router.weight"));
  EXPECT_TRUE(has("model.layers.1.mlp.gate_up_proj.weight"));  // dense SwiGLU
  const ParamInfo* up = l.find("model.layers.2.mlp.experts.gate_up_proj.weight");
  ASSERT_NE(up, nullptr);
  EXPECT_EQ(up->shape, Shape({4, 48, 32}));
  EXPECT_TRUE(up->decay);
  EXPECT_EQ(l.find("model.layers.2.mlp.experts.down_proj.weight")->shape, Shape({4, 32, 24}));
}

TEST(MoeModel, RecomputeGivesIdenticalGradientsAndStatistics) {
  const ModelSpec spec = tiny_moe_spec();
  const Result plain = one_model_step(spec, runtime());
  ASSERT_TRUE(std::isfinite(plain.loss_sum));
  ASSERT_EQ(plain.moe_stats.size(), 2u * 7u);
  for (int row = 0; row < 2; ++row) {
    double routed = 0;
    for (int e = 0; e < 4; ++e) routed += plain.moe_stats[row * 7 + e];
    EXPECT_EQ(routed, 24.0 * 2) << "every token's two slots, counted once";
    EXPECT_GT(plain.moe_stats[row * 7 + 4], 0.5) << "aux loss";
    EXPECT_GT(plain.moe_stats[row * 7 + 5], 0.0) << "z-loss";
    EXPECT_EQ(plain.moe_stats[row * 7 + 6], 0.0) << "dropless: nothing dropped";
  }
  for (auto [mode, layers] : {std::pair{RecomputeGranularity::Full, int64_t{0}},
                              std::pair{RecomputeGranularity::Full, int64_t{1}},
                              std::pair{RecomputeGranularity::Selective, int64_t{0}}}) {
    ModelRuntime rt = runtime();
    rt.recompute = mode;
    rt.recompute_num_layers = layers;
    const Result r = one_model_step(spec, rt);
    EXPECT_EQ(r.loss_sum, plain.loss_sum);
    EXPECT_EQ(0, std::memcmp(r.grads.data(), plain.grads.data(), r.grads.size() * 4))
        << "recompute mode " << static_cast<int>(mode) << " layers " << layers;
    EXPECT_EQ(r.moe_stats, plain.moe_stats) << "statistics counted once per forward pass";
  }
}

TEST(MoeModel, ForceBalanceRoutesEvenlyAndStillTrainsTheRouter) {
  ModelRuntime rt = runtime();
  rt.moe_force_balance = true;
  const ModelSpec spec = tiny_moe_spec();
  const Result r = one_model_step(spec, rt);
  for (int row = 0; row < 2; ++row)
    for (int e = 0; e < 4; ++e) EXPECT_EQ(r.moe_stats[row * 7 + e], 12.0f) << "expert " << e;
  const ParamInfo* router = make_param_layout(spec).find("model.layers.0.mlp.router.weight");
  double norm = 0;
  for (int64_t i = 0; i < router->numel(); ++i) norm += std::abs(r.grads[router->offset + i]);
  EXPECT_GT(norm, 0.0) << "the router gets gradients through the weights";
  const Result routed = one_model_step(spec, runtime());
  EXPECT_NE(routed.moe_stats, r.moe_stats);
}

// Token dropping: a capacity no expert reaches computes exactly the dropless step; a tight one
// changes the loss (dropped pairs contribute nothing), still trains the router, and shrinks the
// planned activations; recompute repeats the same drops.
TEST(MoeModel, CapacityDropsPairsBeyondItAndNothingBelowIt) {
  const ModelSpec dropless = tiny_moe_spec();
  const Result plain = one_model_step(dropless, runtime());
  ModelSpec roomy = dropless;
  roomy.moe.capacity_factor = 4.0;  // capacity 24 x 2 x 4 / 4 = every pair of the batch
  const Result same = one_model_step(roomy, runtime());
  EXPECT_EQ(same.loss_sum, plain.loss_sum);
  EXPECT_EQ(0, std::memcmp(same.grads.data(), plain.grads.data(), same.grads.size() * 4));
  for (bool by_position : {false, true}) {
    SCOPED_TRACE(by_position ? "by position" : "by weight");
    ModelSpec tight = dropless;
    tight.moe.capacity_factor = 0.5;  // 6 of an expert's pairs (12 for balance)
    tight.moe.drop_by_position = by_position;
    EXPECT_EQ(tight.moe.capacity(24), 6);
    const Result dropped = one_model_step(tight, runtime());
    ASSERT_TRUE(std::isfinite(dropped.loss_sum));
    EXPECT_NE(dropped.loss_sum, plain.loss_sum);
    // Layer 0 sees the same input: its statistics count the routed pairs, dropped or not, and
    // how many pairs went beyond the capacity of 6 (at least one per expert over it).
    EXPECT_TRUE(std::equal(plain.moe_stats.begin(), plain.moe_stats.begin() + 6,
                           dropped.moe_stats.begin()));
    double beyond = 0;
    for (int e = 0; e < 4; ++e) beyond += std::max(0.0f, plain.moe_stats[e] - 6.0f);
    EXPECT_EQ(dropped.moe_stats[6], beyond);
    EXPECT_GT(beyond, 0.0);
    const ParamInfo* router = make_param_layout(tight).find("model.layers.0.mlp.router.weight");
    double norm = 0;
    for (int64_t i = 0; i < router->numel(); ++i)
      norm += std::abs(dropped.grads[router->offset + i]);
    EXPECT_GT(norm, 0.0);
    ModelRuntime full = runtime();
    full.recompute = RecomputeGranularity::Full;
    const Result again = one_model_step(tight, full);
    EXPECT_EQ(again.loss_sum, dropped.loss_sum);
    EXPECT_EQ(0, std::memcmp(again.grads.data(), dropped.grads.data(), again.grads.size() * 4));
    EXPECT_LT(DecoderModel::plan_memory(tight, runtime()).activations,
              DecoderModel::plan_memory(dropless, runtime()).activations);
  }
}

TEST(MoeModel, CheckpointDescriptionKeepsTheMoeSpec) {
  ModelSpec s = tiny_moe_spec();
  s.qk_norm = true;
  s.moe.sigmoid = true;
  s.moe.num_groups = 2, s.moe.group_topk = 1;
  s.moe.load_balancing = MoeLoadBalancing::SeqAuxLoss;
  s.moe.topk_scaling = 2.5;
  const ModelSpec back = spec_from_json(spec_to_json(s), "test");
  EXPECT_TRUE(back.qk_norm);
  EXPECT_EQ(back.moe.experts, 4);
  EXPECT_EQ(back.moe.layers, s.moe.layers);
  EXPECT_EQ(back.moe.shared_ffn, 16);
  EXPECT_TRUE(back.moe.sigmoid);
  EXPECT_EQ(back.moe.num_groups, 2);
  EXPECT_EQ(back.moe.load_balancing, MoeLoadBalancing::SeqAuxLoss);
  EXPECT_DOUBLE_EQ(back.moe.topk_scaling, 2.5);
  s.moe.capacity_factor = 1.25, s.moe.drop_by_position = true;
  const ModelSpec dropping = spec_from_json(spec_to_json(s), "test");
  EXPECT_DOUBLE_EQ(dropping.moe.capacity_factor, 1.25);
  EXPECT_TRUE(dropping.moe.drop_by_position);
  const SpecDifferences none = compare_specs(back, s, "checkpoint");
  EXPECT_TRUE(none.shape.empty() && none.behaviour.empty()) << join_lines(none.shape);
  ModelSpec other = s;
  other.moe.layers = {false, true, true};
  EXPECT_FALSE(compare_specs(other, s, "checkpoint").shape.empty());
  // A dense model's description has no MoE part (older readers see nothing new).
  EXPECT_FALSE(spec_to_json(ModelSpec{}).contains("moe"));
}

// Two passes' activations kept at once (DPO's two answers, a pipeline stage's micro-batches):
// both forwards, then both backwards, give the gradients of each pass run alone, so each
// backward reads its own forward's routing (the experts' row groups on the host), not the
// last forward's.
TEST(MoeModel, EachActivationSlotBackwardReadsItsOwnRouting) {
  const ModelSpec s = tiny_moe_spec();
  ModelRuntime rt = runtime();
  rt.keep_logit_grads = true;  // as DPO runs: the backward does not run the head again
  const int64_t N = rt.micro_batch * rt.seq_length;
  std::vector<std::vector<int32_t>> tokens(2, std::vector<int32_t>(N)), targets = tokens;
  for (int pass = 0; pass < 2; ++pass)
    for (int64_t i = 0; i < N; ++i) {
      tokens[pass][i] = static_cast<int32_t>(random_below(10 + pass, i, 64));
      targets[pass][i] = static_cast<int32_t>(random_below(20 + pass, i, 64));
    }
  std::vector<std::vector<float>> grads;
  for (const bool interleaved : {false, true}) {
    auto backend = make_cpu_backend();
    ModelRuntime r = rt;
    r.pipeline_slots = interleaved ? 2 : 1;
    DecoderModel model(*backend, s, r);
    testing::init_test_model(*backend, s, model);
    model.zero_grads();
    const auto forward = [&](int pass) {
      model.use_slot(interleaved ? pass : 0);
      model.set_batch(tokens[pass].data(), targets[pass].data());
      model.zero_loss_sum();
      model.forward_loss();
    };
    const auto backward = [&](int pass) {
      model.use_slot(interleaved ? pass : 0);
      const float scale = 1.0f / static_cast<float>(N);
      model.loss_backward({&scale, 1}, scale);
    };
    if (interleaved) {
      forward(0), forward(1), backward(0), backward(1);
    } else {
      forward(0), backward(0), forward(1), backward(1);
    }
    grads.emplace_back(model.layout().total);
    backend->download(grads.back().data(), model.grads());
  }
  double worst = 0;
  for (size_t i = 0; i < grads[0].size(); ++i)
    worst = std::max(worst, static_cast<double>(std::abs(grads[1][i] - grads[0][i])));
  EXPECT_LT(worst, 1e-6) << "interleaved passes' gradients differ from each pass's alone";
}

}  // namespace
}  // namespace tessera
