// DPO's losses, rewards and gradients against PyTorch (tests/train/dpo_reference.py, TRL's
// formulas with autograd) for every loss type, over pairs the policy prefers, disprefers and
// ties, with and without label smoothing, length normalisation, a reference and RPO's term.
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/run_command.h"
#include "common/scratch_dir.h"
#include "tessera/train/dpo.h"

namespace tessera::testing {
namespace {

TEST(Dpo, LossesRewardsAndGradientsMatchPyTorch) {
  struct Case {
    DpoLossType type;
    const char* name;
    double beta, smoothing;
    bool length_normalize = false, reference_free = false;
    double rpo_alpha = 0;
  };
  const std::vector<Case> variants = {{DpoLossType::Sigmoid, "sigmoid", 0.1, 0.0},
                                      {DpoLossType::Sigmoid, "sigmoid", 0.5, 0.2},
                                      {DpoLossType::Ipo, "ipo", 0.1, 0.0},
                                      {DpoLossType::Hinge, "hinge", 0.1, 0.0},
                                      {DpoLossType::Hinge, "hinge", 2.0, 0.0},
                                      {DpoLossType::Sigmoid, "sigmoid", 0.1, 0.0, false, false, 1.0},
                                      {DpoLossType::Ipo, "ipo", 0.1, 0.0, true},
                                      {DpoLossType::Sigmoid, "sigmoid", 2.0, 0.0, true, true},
                                      {DpoLossType::Hinge, "hinge", 0.5, 0.1, true, false, 0.3}};
  const int64_t chosen_tokens = 7, rejected_tokens = 13;
  // (pc, pr, rc, rr): the policy prefers, disprefers, ties; large margins for overflow.
  const std::vector<std::vector<double>> logps = {{-12.5, -20.0, -15.0, -18.0},
                                                  {-30.0, -10.0, -25.0, -12.0},
                                                  {-8.0, -9.0, -8.0, -9.0},
                                                  {-5.0, -900.0, -400.0, -6.0},
                                                  {-900.0, -5.0, -6.0, -400.0}};
  nlohmann::json cases = nlohmann::json::array();
  for (const Case& v : variants)
    for (const auto& l : logps)
      cases.push_back({{"loss_type", v.name}, {"beta", v.beta}, {"label_smoothing", v.smoothing},
                       {"pc", l[0]}, {"pr", l[1]}, {"rc", l[2]}, {"rr", l[3]},
                       {"length_normalize", v.length_normalize}, {"reference_free", v.reference_free},
                       {"rpo_alpha", v.rpo_alpha}, {"nc", chosen_tokens}, {"nr", rejected_tokens}});
  ScratchDir dir;
  const auto file = dir / "cases.json";
  std::ofstream(file) << cases.dump();
  const RunResult r = run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_TESTS_DIR +
                                  "/train/dpo_reference.py " + file.string() + " 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json want = nlohmann::json::parse(r.output);
  ASSERT_EQ(want.size(), cases.size());
  size_t k = 0;
  for (const Case& v : variants)
    for (const auto& l : logps) {
      SCOPED_TRACE(std::string(v.name) + " case " + std::to_string(k));
      const DpoPair p = dpo_pair({v.type, v.beta, v.smoothing, v.length_normalize, v.reference_free, v.rpo_alpha},
                                 l[0], l[1], l[2], l[3], chosen_tokens, rejected_tokens);
      const nlohmann::json& w = want[k++];
      const auto close = [](double got, double ref) { return std::abs(got - ref) <= 1e-12 * (1 + std::abs(ref)); };
      EXPECT_TRUE(close(p.loss, w["loss"])) << p.loss << " vs " << w["loss"];
      EXPECT_TRUE(close(p.dloss_dchosen, w["dchosen"])) << p.dloss_dchosen << " vs " << w["dchosen"];
      EXPECT_TRUE(close(p.dloss_drejected, w["drejected"])) << p.dloss_drejected << " vs " << w["drejected"];
      EXPECT_TRUE(close(p.chosen_reward, w["chosen_reward"]));
      EXPECT_TRUE(close(p.rejected_reward, w["rejected_reward"]));
    }
}

}  // namespace
}  // namespace tessera::testing
