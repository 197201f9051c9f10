// DeepSeek models (model_family deepseek): the family's checks, the presets' parameter counts
// (total and active) against the published configurations' shapes, model FLOPs, the layout of
// multi-latent attention's parameters (with and without a query latent), recompute (full and
// selective) reproducing gradients bit for bit, the memory plan matching what the model
// allocates, and the checkpoint description of an MLA model.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/model_step.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/ckpt/model_spec_json.h"
#include "tessera/config/config.h"
#include "tessera/core/error.h"
#include "tessera/core/random.h"
#include "tessera/data/tokenizer.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/init.h"
#include "tessera/model/model_family.h"
#include "tessera/model/rope.h"
#include "tessera/obs/logger.h"
#include "tessera/plan/memory_plan.h"
#include "tessera/run/run_setup.h"
#include "tessera/train/trainer.h"

namespace tessera {
namespace {

// The shipped MoE experiments spread their experts over a node's 8 GPUs (Primus's layout), so
// they are loaded for 8 ranks.
Experiment load(const std::string& name, std::vector<std::string> cli = {}) {
  LoadOptions o;
  o.config_path = name;
  o.cli_overrides = std::move(cli);
  o.data_parallel_size = name.ends_with("-pretrain") ? 8 : 1;
  return load_experiment(o);
}

// The tiny_mla preset on mock data with `cli` (through an experiment file of its own: the
// default experiment's overrides are another model's).
Experiment load_tiny_mla(std::vector<std::string> cli = {}) {
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() /
      ("tessera_mla_model_tiny_mla_" + std::to_string(::getpid()) + ".yaml");
  std::ofstream(path) << "model: tiny_mla\nmock_data: true\n";
  const Experiment e = load(path.string(), std::move(cli));
  std::filesystem::remove(path);
  return e;
}

// A tiny DeepSeek model: MLA (q_lora_rank 0: queries projected directly), YaRN, a dense first
// layer and two MoE layers with sigmoid group-limited routing, a shared expert, both losses.
ModelSpec tiny_mla_spec(int64_t q_lora_rank) {
  ModelSpec s;
  s.family = "deepseek";
  s.vocab_size = s.tokenizer_vocab = 64;
  s.num_layers = 3;
  s.hidden = 32;
  s.ffn = 40;
  s.heads = s.kv_heads = 4;
  s.mla = {true, q_lora_rank, 12, 6, 4, 10};
  s.head_dim = s.mla.rope_dim;
  s.yarn = {true, 4.0, 16, 32.0, 1.0, 0.9, 1.0};
  s.max_position_embeddings = 64;
  s.init_std = 0.1f;
  s.moe.experts = 8;
  s.moe.topk = 4;
  s.moe.ffn = 16;
  s.moe.shared_ffn = 16;
  s.moe.layers = {false, true, true};
  s.moe.sigmoid = true;
  s.moe.num_groups = 4, s.moe.group_topk = 2;
  s.moe.topk_scaling = 2.5;
  s.moe.load_balancing = MoeLoadBalancing::SeqAuxLoss;
  s.moe.aux_loss_coeff = 0.01;
  s.moe.z_loss_coeff = 0.001;
  return s;
}

// The published shapes written out as Hugging Face's modules hold them, per layer.
int64_t mla_attention_params(int64_t C, int64_t H, int64_t q_lora, int64_t kv_lora, int64_t Dn,
                             int64_t Dr, int64_t Dv) {
  const int64_t q = q_lora ? C * q_lora + q_lora + q_lora * H * (Dn + Dr) : C * H * (Dn + Dr);
  return C + q + C * (kv_lora + Dr) + kv_lora + kv_lora * H * (Dn + Dv) + H * Dv * C;
}

TEST(MlaModel, PresetsHaveThePublishedShapes) {
  struct Published {
    const char* experiment;
    int64_t vocab, C, L, F, H, q_lora, E, K, F_e, shared, dense;
  };
  for (const Published& p :
       {Published{"deepseek_v3-pretrain", 129280, 7168, 61, 18432, 128, 1536, 256, 8, 2048, 1, 3},
        Published{"deepseek_v2_lite-pretrain", 102400, 2048, 27, 10944, 16, 0, 64, 6, 1408, 2,
                  1}}) {
    SCOPED_TRACE(p.experiment);
    const ModelSpec s = make_model_spec(load(p.experiment), p.vocab);
    EXPECT_EQ(s.family, "deepseek");
    const int64_t attn = mla_attention_params(p.C, p.H, p.q_lora, 512, 128, 64, 128);
    const int64_t dense_mlp = p.C + 3 * p.C * p.F;
    const int64_t routed = 3 * p.C * p.F_e;
    const int64_t moe_mlp = p.C + p.E * p.C + p.E * routed + p.shared * routed;
    const int64_t total =
        2 * p.vocab * p.C + p.C + p.L * attn + p.dense * dense_mlp + (p.L - p.dense) * moe_mlp;
    EXPECT_EQ(s.total_params(), total);
    EXPECT_EQ(s.active_params(), total - (p.L - p.dense) * (p.E - p.K) * routed);
  }
  // DeepSeek-V3: 671B parameters, 37B active; V2-Lite: 15.7B.
  const ModelSpec v3 = make_model_spec(load("deepseek_v3-pretrain"), 129280);
  EXPECT_NEAR(v3.total_params() / 1e9, 671.0, 0.1);
  EXPECT_NEAR(v3.active_params() / 1e9, 37.5, 0.1);
  EXPECT_NE(v3.summary().find("multi-latent attention (q latent 1536, kv latent 512"),
            std::string::npos)
      << v3.summary();
  EXPECT_TRUE(v3.yarn.enabled);
  EXPECT_DOUBLE_EQ(v3.yarn.factor, 40.0);
  EXPECT_TRUE(v3.moe.expert_bias);
  const ModelSpec lite = make_model_spec(load("deepseek_v2_lite-pretrain"), 102400);
  EXPECT_NEAR(lite.total_params() / 1e9, 15.7, 0.05);
  EXPECT_TRUE(lite.moe.pre_softmax);
  EXPECT_EQ(lite.mla.q_lora_rank, 0);
  // The seed's proxy: 3 layers, all MoE.
  const ModelSpec proxy = make_model_spec(
      load("deepseek_v3-pretrain", {"--num_layers", "3", "--moe_layer_freq", "1"}), 129280);
  EXPECT_EQ(proxy.moe.moe_layers(), 3);
  // tiny_mla is a few hundred thousand parameters at a byte vocabulary.
  const ModelSpec tiny = make_model_spec(load_tiny_mla(), 257);
  EXPECT_GT(tiny.total_params(), 100'000);
  EXPECT_LT(tiny.total_params(), 1'000'000);
}

TEST(MlaModel, FlopsCountActiveParametersAndBothHeadSizes) {
  const ModelSpec s = make_model_spec(load("deepseek_v3-pretrain"), 129280);
  const double C = 7168, H = 128, V = 129280, L = 61, seq = 4096;
  const double attn = C * (1536 + 512 + 64) + 1536 * H * 192 + 512 * H * 256 + H * 128 * C;
  const double dense = 3 * C * 18432, moe = C * 256 + 8 * 3 * C * 2048 + 3 * C * 2048;
  const double matmul = V * C + L * attn + 3 * dense + 58 * moe;
  EXPECT_EQ(s.matmul_params(), static_cast<int64_t>(matmul));
  // Attention: 6 s H (D + Dv) per layer, the GQA convention's 12 s d with the two head sizes.
  EXPECT_DOUBLE_EQ(s.flops_per_token(4096), 6 * matmul + L * 6 * seq * H * (192 + 128));
}

TEST(MlaModel, FamiliesCheckTheirKeys) {
  struct Bad {
    std::vector<std::string> cli;
    const char* key;
  };
  for (const Bad& b : std::vector<Bad>{
           {{"--multi_latent_attention", "false", "--rope_type", "rope"}, "multi_latent_attention"},
           {{"--model_family", "llama", "--num_experts", "0"}, "multi_latent_attention"},
           {{"--model_family", "mixtral"}, "multi_latent_attention"}}) {
    SCOPED_TRACE(b.key);
    // Experts on one rank: a model that is not an MoE one has no experts to spread.
    std::vector<std::string> cli = {
        "--num_layers", "2", "--moe_layer_freq", "1", "--expert_model_parallel_size", "1"};
    cli.insert(cli.end(), b.cli.begin(), b.cli.end());
    try {
      make_model_spec(load("deepseek_v2_lite-pretrain", cli), 102400);
      ADD_FAILURE() << "accepted";
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.key(), b.key) << e.what();
    }
  }
  // rope_type rope turns YaRN off; kv_channels plays no part.
  const ModelSpec rope = make_model_spec(
      load("deepseek_v2_lite-pretrain", {"--rope_type", "rope", "--kv_channels", "96"}), 102400);
  EXPECT_FALSE(rope.yarn.enabled);
  EXPECT_EQ(rope.head_dim, 64);
  EXPECT_EQ(rope.kv_heads, 16);
}

TEST(MlaModel, LayoutFusesTheDownProjections) {
  for (int64_t q_lora : {int64_t{0}, int64_t{20}}) {
    SCOPED_TRACE(q_lora);
    const ModelSpec s = tiny_mla_spec(q_lora);
    const ParamLayout l = make_param_layout(s);
    std::vector<std::string> names;
    for (const ParamInfo& p : l.params)
      if (p.name.starts_with("model.layers.0.")) names.push_back(p.name.substr(15));
    std::vector<std::string> want = {"self_attn.norm.weight", "self_attn.q_kv_a_proj.weight"};
    if (q_lora)
      want.insert(want.end(), {"self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight"});
    want.insert(want.end(), {"self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
                             "self_attn.o_proj.weight", "mlp.norm.weight",
                             "mlp.gate_up_proj.weight", "mlp.down_proj.weight"});
    EXPECT_EQ(names, want);
    const ParamInfo* a = l.find("model.layers.1.self_attn.q_kv_a_proj.weight");
    ASSERT_NE(a, nullptr);
    const int64_t q_rows = q_lora ? q_lora : 4 * 10;
    EXPECT_EQ(a->shape, Shape({q_rows + 12 + 4, 32}));
    EXPECT_EQ(a->fused_rows, (std::vector<int64_t>{q_rows, 16}));
    EXPECT_EQ(l.find("model.layers.1.self_attn.kv_b_proj.weight")->shape, Shape({4 * 16, 12}));
    EXPECT_EQ(l.find("model.layers.1.self_attn.o_proj.weight")->shape, Shape({32, 40}));
    EXPECT_FALSE(l.find("model.layers.1.self_attn.kv_a_layernorm.weight")->decay);
  }
}

using Result = testing::ModelStep;
using testing::one_model_step;

TEST(MlaModel, RecomputeGivesIdenticalGradients) {
  for (int64_t q_lora : {int64_t{0}, int64_t{20}}) {
    SCOPED_TRACE(q_lora);
    const ModelSpec spec = tiny_mla_spec(q_lora);
    ModelRuntime rt;
    rt.micro_batch = 2;
    rt.seq_length = 12;
    const Result plain = one_model_step(spec, rt);
    ASSERT_TRUE(std::isfinite(plain.loss_sum));
    double norm = 0;
    for (const ParamInfo& p : make_param_layout(spec).params) {
      double g = 0;
      for (int64_t i = 0; i < p.numel(); ++i) g += std::abs(plain.grads[p.offset + i]);
      // Every parameter reaches the loss (each expert of 8 at 24 tokens x 4 slots too).
      EXPECT_GT(g, 0.0) << p.name;
      norm += g;
    }
    for (auto [mode, layers] : {std::pair{RecomputeGranularity::Full, int64_t{0}},
                                std::pair{RecomputeGranularity::Full, int64_t{2}},
                                std::pair{RecomputeGranularity::Selective, int64_t{0}}}) {
      ModelRuntime r2 = rt;
      r2.recompute = mode;
      r2.recompute_num_layers = layers;
      const Result r = one_model_step(spec, r2);
      EXPECT_EQ(r.loss_sum, plain.loss_sum);
      EXPECT_EQ(0, std::memcmp(r.grads.data(), plain.grads.data(), r.grads.size() * 4))
          << "recompute mode " << static_cast<int>(mode) << " layers " << layers;
    }
  }
}

// The memory planner counts what a run allocates, exactly: the planner and the model both work
// from the blocks' declarations (MLA's forward-only tensors live in its backward scratch), and
// the CPU backend's peak over a training step (forward, backward, optimizer) is the plan's.
TEST(MlaModel, PlannedMemoryIsTheTrainingPeak) {
  for (const char* recompute : {"null", "selective", "full"}) {
    SCOPED_TRACE(recompute);
    const Experiment e =
        load_tiny_mla({"--seq_length", "32", "--micro_batch_size", "2", "--global_batch_size", "2",
                       "--train_iters", "1", "--lr_warmup_iters", "0", "--eval_interval", "0",
                       "--recompute_granularity", recompute, "--device", "cpu"});
    const RunSetup setup =
        make_run_setup(e, {1, DType::F32}, [&] { return make_tokenizer(e.data)->vocab_size(); });
    const plan::MemoryPlan p = plan::plan_memory(plan::plan_input(setup, /*gpu=*/false));
    Logger log("", 0, false, false);
    Trainer trainer(e, make_cpu_backend(), log, nullptr);
    trainer.run_iteration(1);
    EXPECT_EQ(trainer.backend().memory_stats().peak_bytes, p.allocated());
  }
  // The stored activations grow with the latents and the packed qkv of every layer.
  ModelRuntime rt;
  rt.micro_batch = 2;
  rt.seq_length = 16;
  const ModelSpec spec = tiny_mla_spec(20);
  ModelSpec wider = spec;
  wider.mla.kv_lora_rank *= 4;
  EXPECT_GT(DecoderModel::plan_memory(wider, rt).activations,
            DecoderModel::plan_memory(spec, rt).activations);
}

TEST(MlaModel, CheckpointDescriptionKeepsTheMlaSpec) {
  const ModelSpec s = tiny_mla_spec(20);
  const ModelSpec back = spec_from_json(spec_to_json(s), "test");
  EXPECT_TRUE(back.mla.enabled);
  EXPECT_EQ(back.mla.q_lora_rank, 20);
  EXPECT_EQ(back.mla.kv_lora_rank, 12);
  EXPECT_EQ(back.mla.qk_head_dim, 6);
  EXPECT_EQ(back.mla.rope_dim, 4);
  EXPECT_EQ(back.mla.v_head_dim, 10);
  EXPECT_TRUE(back.yarn.enabled);
  EXPECT_DOUBLE_EQ(back.yarn.mscale, 0.9);
  EXPECT_EQ(back.yarn.original_max_position_embeddings, 16);
  const SpecDifferences none = compare_specs(back, s, "checkpoint");
  EXPECT_TRUE(none.shape.empty() && none.behaviour.empty()) << join_lines(none.shape);
  ModelSpec other = s;
  other.mla.v_head_dim = 12;
  EXPECT_FALSE(compare_specs(other, s, "checkpoint").shape.empty());
  other = s;
  other.yarn.factor = 8;
  EXPECT_FALSE(compare_specs(other, s, "checkpoint").behaviour.empty());
  EXPECT_FALSE(spec_to_json(ModelSpec{}).contains("multi_latent_attention"));
}

}  // namespace
}  // namespace tessera
