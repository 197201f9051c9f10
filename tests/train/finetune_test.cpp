// Megatron's --finetune and --no-load-optim through the real binary: a fine-tuning run takes
// a pretraining checkpoint's weights and starts at iteration 1 with fresh optimizer state;
// no_load_optim resumes the counters without the moments; what cannot work is refused.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/run_command.h"
#include "common/scratch_dir.h"
#include "common/tiny_run.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

// (iteration, loss) of each training line.
std::vector<std::pair<int64_t, double>> losses(const fs::path& metrics) {
  std::vector<std::pair<int64_t, double>> out;
  for (const auto& j : metrics_lines(metrics))
    if (j.contains("lm_loss")) out.emplace_back(j["iteration"], j["lm_loss"]);
  return out;
}

TEST(Finetune, StartsFromTheCheckpointsWeightsAtIterationOneWithFreshOptimizerState) {
  ScratchDir dir;
  {
    std::ofstream text(dir / "text.txt");
    for (int i = 0; i < 400; ++i) text << "abcabcabd ";
  }
  // A byte-level model that learns the repeated text quickly.
  const auto args = [&](const std::string& name) {
    return tiny_args(dir.path(), name) + " --mock_data false --train_data_path " +
           (dir / "text.txt").string() + " --data_path null --split 100,0,0 --vocab_size 257 --tokenizer_type ByteLevel --lr 0.01";
  };
  const fs::path pretrained = dir / "pretrained", tuned = dir / "tuned", runs = dir / "g" / "u";
  RunResult r = run_tessera(args("pre") + " --train_iters 40 --save " + pretrained.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto pre = losses(runs / "pre" / "metrics.jsonl");
  r = run_tessera(args("fresh") + " --train_iters 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double fresh_loss = losses(runs / "fresh" / "metrics.jsonl").at(0).second;
  ASSERT_LT(pre.back().second, fresh_loss - 1.0) << "the pretraining run did not learn";

  r = run_tessera(args("ft") + " --train_iters 3 --finetune --load " + pretrained.string() +
                  " --save " + tuned.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "finetune: the weights of " + (pretrained / "iter_0000040").string() +
                                     " (its iteration 40)"))
      << r.output;
  const auto ft = losses(runs / "ft" / "metrics.jsonl");
  ASSERT_EQ(ft.size(), 3u);
  EXPECT_EQ(ft[0].first, 1);  // the counters start from zero
  EXPECT_NEAR(ft[0].second, pre.back().second, 0.5);  // the pretrained weights
  EXPECT_TRUE(fs::exists(tuned / "iter_0000003")) << r.output;

  // no_load_optim: the counters resume, the moments do not.
  r = run_tessera(args("resumed") + " --train_iters 42 --no_load_optim --load " + pretrained.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "no_load_optim: the optimizer state starts from zero")) << r.output;
  const auto resumed = losses(runs / "resumed" / "metrics.jsonl");
  ASSERT_FALSE(resumed.empty());
  EXPECT_EQ(resumed.front().first, 41);

  // Refused before anything is written: finetune without a checkpoint to take weights from,
  // and saving over the checkpoint it fine-tunes.
  r = run_tessera(args("no_load") + " --train_iters 3 --finetune");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "key 'finetune'")) << r.output;
  r = run_tessera(args("same") + " --train_iters 3 --finetune --load " + pretrained.string() +
                  " --save " + pretrained.string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "save in another directory than load")) << r.output;
  EXPECT_FALSE(fs::exists(runs / "same"));
}

}  // namespace
}  // namespace tessera::testing
