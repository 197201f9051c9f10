// GRPO's advantages, loss, gradients and clip/KL statistics against PyTorch
// (tests/train/grpo_reference.py, TRL's formulas with autograd): groups of completions with
// mixed, equal and single rewards; ratios inside and outside the clip range on both sides;
// symmetric and DAPO's asymmetric clip; with and without the KL penalty; each normalisation.
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/run_command.h"
#include "common/scratch_dir.h"
#include "tessera/core/error.h"
#include "tessera/core/random.h"
#include "tessera/train/grpo.h"

namespace tessera::testing {
namespace {

double uniform(uint64_t seed, uint64_t index) {  // in [0, 1)
  return random_below(seed, index, 1u << 24) / static_cast<double>(1u << 24);
}

struct Variant {
  GrpoLossType type;
  const char* name;
  double epsilon, epsilon_high, beta;
  bool scale_rewards;
};

TEST(Grpo, AdvantagesLossAndGradientsMatchPyTorch) {
  const std::vector<Variant> variants = {
      {GrpoLossType::Grpo, "grpo", 0.2, 0.2, 0.0, true},   {GrpoLossType::Grpo, "grpo", 0.2, 0.28, 0.04, true},
      {GrpoLossType::Bnpo, "bnpo", 0.2, 0.28, 0.0, true},  {GrpoLossType::Bnpo, "bnpo", 0.1, 0.1, 0.1, false},
      {GrpoLossType::DrGrpo, "dr_grpo", 0.2, 0.2, 0.0, false}, {GrpoLossType::DrGrpo, "dr_grpo", 0.2, 0.28, 0.04, false}};
  // Two groups of 4 completions: mixed rewards, then all equal (zero advantages).
  const std::vector<double> rewards = {1.0, 0.0, 0.5, 1.0, 0.3, 0.3, 0.3, 0.3};
  const int64_t G = 4, max_length = 9;
  std::vector<GrpoCompletion> batch;
  for (size_t i = 0; i < rewards.size(); ++i) {
    GrpoCompletion c;
    const size_t n = 1 + (i * 5) % max_length;  // lengths 1 .. 9
    for (size_t t = 0; t < n; ++t) {
      const double u = uniform(3, i * 100 + t), v = uniform(4, i * 100 + t);
      c.logp.push_back(-0.1 - 3 * u);
      // Ratios from exp(-0.6) to exp(0.6): inside and outside either clip bound.
      c.old_logp.push_back(c.logp.back() + 1.2 * (v - 0.5));
      c.ref_logp.push_back(c.logp.back() + 0.8 * (uniform(5, i * 100 + t) - 0.5));
    }
    batch.push_back(c);
  }
  nlohmann::json cases = nlohmann::json::array();
  for (const Variant& v : variants) {
    nlohmann::json c = {{"group_size", G}, {"rewards", rewards}, {"scale_rewards", v.scale_rewards},
                        {"epsilon", v.epsilon}, {"epsilon_high", v.epsilon_high}, {"beta", v.beta},
                        {"loss_type", v.name}, {"max_completion_length", max_length}};
    for (const char* field : {"logp", "old_logp", "ref_logp"}) c[field] = nlohmann::json::array();
    for (const GrpoCompletion& g : batch) c["logp"].push_back(g.logp), c["old_logp"].push_back(g.old_logp), c["ref_logp"].push_back(g.ref_logp);
    cases.push_back(c);
  }
  ScratchDir dir;
  std::ofstream(dir / "cases.json") << cases.dump();
  const RunResult r = run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_TESTS_DIR +
                                  "/train/grpo_reference.py " + (dir / "cases.json").string() + " 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json want = nlohmann::json::parse(r.output);
  ASSERT_EQ(want.size(), variants.size());
  const auto close = [](double got, double ref) { return std::abs(got - ref) <= 1e-12 * (1 + std::abs(ref)); };
  bool clipped_low = false, clipped_high = false;
  for (size_t k = 0; k < variants.size(); ++k) {
    const Variant& v = variants[k];
    SCOPED_TRACE(std::string(v.name) + " variant " + std::to_string(k));
    const std::vector<double> advantages = group_advantages(rewards, G, v.scale_rewards);
    for (size_t i = 0; i < rewards.size(); ++i) {
      EXPECT_TRUE(close(advantages[i], want[k]["advantages"][i])) << advantages[i] << " vs " << want[k]["advantages"][i];
      batch[i].advantage = advantages[i];
    }
    const GrpoBatchLoss l = grpo_loss({v.epsilon, v.epsilon_high, v.beta, v.type, max_length}, batch);
    EXPECT_TRUE(close(l.loss, want[k]["loss"])) << l.loss << " vs " << want[k]["loss"];
    for (size_t i = 0; i < batch.size(); ++i)
      for (size_t t = 0; t < batch[i].logp.size(); ++t)
        EXPECT_TRUE(close(l.dloss_dlogp[i][t], want[k]["grads"][i][t]))
            << "completion " << i << " token " << t << ": " << l.dloss_dlogp[i][t] << " vs " << want[k]["grads"][i][t];
    for (const auto& [got, name] : {std::pair{l.clip_low, "clip_low"}, std::pair{l.clip_high, "clip_high"},
                                    std::pair{l.clip_region, "clip_region"}, std::pair{l.kl, "kl"}})
      EXPECT_TRUE(close(got, want[k][name])) << name << " " << got << " vs " << want[k][name];
    clipped_low = clipped_low || l.clip_low > 0, clipped_high = clipped_high || l.clip_high > 0;
  }
  EXPECT_TRUE(clipped_low && clipped_high) << "the cases should clip on both sides";
}

TEST(Grpo, DynamicSamplingDropsGroupsOfEqualRewards) {
  EXPECT_EQ(informative_groups({1, 0, 1, 1, 0.5, 0.5, 0.5, 0.5, 0, 0, 0, 1e-9}, 4),
            (std::vector<bool>{true, false, true}));
  const std::vector<double> a = group_advantages({0.5, 0.5, 0.5, 0.5}, 4, true);
  for (double x : a) EXPECT_EQ(x, 0.0);
  EXPECT_THROW(group_advantages({1, 2, 3}, 2, true), Error);
}

}  // namespace
}  // namespace tessera::testing
