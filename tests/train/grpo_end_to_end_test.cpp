// GRPO end to end on the CPU, as configs/experiments/grpo_tiny.yaml says to run it: write the
// parity task (scripts/data/grpo_tasks.py), fine-tune the default experiment's tiny model on
// conversations that answer in the rewarded form ("#### odd") only 30% of the time, then run
// GRPO rewarded for right answers in that form. Its held-out accuracy (greedy, on 100 prompts
// in wordings training never shows) rises from at most 0.2 to at least 0.8, and the plots
// draw the completions' reward and accuracy. So does GRPO of LoRA adapters on the frozen
// fine-tuned model (configs/experiments/grpo_lora_tiny.yaml).
#include <cstdio>
#include <filesystem>
#include <regex>
#include <string>

#include <gtest/gtest.h>

#include "common/run_command.h"
#include "common/scratch_dir.h"
#include "common/tiny_run.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

// The accuracy of the last "grpo validation" line of a run's output.
double held_out_accuracy(const std::string& output) {
  const std::regex line("grpo validation: accuracy ([0-9.]+)");
  double last = -1;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line); it != std::sregex_iterator(); ++it)
    last = std::stod((*it)[1].str());
  return last;
}

TEST(GrpoEndToEnd, RewardedSamplingRaisesHeldOutAccuracy) {
  ScratchDir dir;
  const std::string bin = TESSERA_BINARY, ws = " --workspace " + (dir / "ws").string();
  const fs::path parity = dir / "parity";
  RunResult r = run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_TESTS_DIR +
                            "/../scripts/data/grpo_tasks.py --task parity --held-out 100 --sft-hash-share 0.3 " +
                            parity.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_command(bin + " preprocess --chat --input " + parity.string() + "_sft.jsonl --output-prefix " +
                  parity.string() + " --tokenizer-model llama3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 1. Fine-tuning from a fresh initialisation.
  r = run_command(bin + " train --config sft_tiny --finetune false --data_path " + parity.string() +
                  "_chat_document --train_iters 150 --log_progress false --save " + (dir / "sft").string() + ws);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string prompts = " --train_data_path " + parity.string() + "_prompts.jsonl --valid_data_path " +
                              parity.string() + "_held_out.jsonl --log_progress false" + ws;
  // 2. Its held-out accuracy under the answer reward.
  r = run_command(bin + " train --config grpo_tiny --load " + (dir / "sft").string() + " --skip_train true" +
                  prompts + " --exp_name before");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double before = held_out_accuracy(r.output);
  // 3. GRPO, 20 steps.
  r = run_command(bin + " train --config grpo_tiny --load " + (dir / "sft").string() + " --save " +
                  (dir / "grpo").string() + prompts);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double after = held_out_accuracy(r.output);
  std::printf("GRPO: held-out accuracy %.2f after fine-tuning, %.2f after 20 GRPO steps\n", before, after);
  EXPECT_GE(before, 0.0) << "no validation line";
  EXPECT_LE(before, 0.2);
  EXPECT_GE(after, 0.8) << r.output;
  // The sampled completions' reward rises too: the mean of the last 5 steps above the first 5's.
  std::vector<double> reward;
  fs::path run_dir;
  for (const auto& entry : fs::recursive_directory_iterator(dir / "ws"))
    if (entry.path().filename() == "metrics.jsonl" && entry.path().string().find("grpo_tiny") != std::string::npos)
      run_dir = entry.path().parent_path();
  ASSERT_FALSE(run_dir.empty());
  for (const auto& j : metrics_lines(run_dir / "metrics.jsonl"))
    if (j.contains("reward")) reward.push_back(j["reward"].get<double>());
  ASSERT_EQ(reward.size(), 4u);  // log_interval 5
  EXPECT_GT(reward.back(), reward.front());
  // 4. The same from the fine-tuned model frozen, with LoRA adapters (grpo_lora_tiny.yaml) over
  // 10 steps instead of its 20 (0.97 on 2 CPU cores; its 20 reach 1.00).
  r = run_command(bin + " train --config grpo_lora_tiny --pretrained_checkpoint " + (dir / "sft").string() +
                  " --train_iters 10" + prompts);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double lora = held_out_accuracy(r.output);
  std::printf("GRPO with LoRA: held-out accuracy %.2f after 10 steps\n", lora);
  EXPECT_GE(lora, 0.8) << r.output;
  r = run_command(bin + " plot " + run_dir.string() + " -o " + (dir / "plots").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  bool charted = false;
  for (const auto& entry : fs::recursive_directory_iterator(dir / "plots"))
    charted = charted || entry.path().filename().string().find("grpo_rewards") != std::string::npos;
  EXPECT_TRUE(charted) << "no GRPO chart among the plots";
}

}  // namespace
}  // namespace tessera::testing
