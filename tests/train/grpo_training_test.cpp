// objective grpo through the command: a tiny model from a checkpoint samples groups of
// completions of chat prompts, which an answer reward and a reward command score; the steps
// report TRL's statistics (the first compares the policy with its reference and its sampling
// self: KL 0, nothing clipped), a second step on one generation batch reuses it, held-out
// prompts are evaluated, and two data-parallel thread ranks (ZeRO-1) give one rank's run.
// A stop string ends a completion at the token that completes it, with the same tokens up to
// there. Bad prompts and a failing reward command stop the run with the file, line or command
// named.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/run_command.h"
#include "common/scratch_dir.h"
#include "common/tiny_run.h"
#include "tessera/config/tokenizer_model.h"
#include "tessera/data/chat.h"
#include "tessera/train/grpo_prompts.h"
#include "tessera/train/rewards.h"
#include "tokenizer/tokenizer_test_util.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

void write_prompts(const fs::path& file,
                   const std::vector<std::pair<std::string, std::string>>& qa) {
  std::ofstream out(file);
  for (const auto& [q, a] : qa)
    out << nlohmann::json{{"prompt", {{{"role", "user"}, {"content", q}}}}, {"answer", a}}.dump()
        << "\n";
}

class GrpoTraining : public ::testing::Test {
 protected:
  void SetUp() override {
    write_prompts(dir_ / "prompts.jsonl", {{"Is tennis a sport? #### yes", "yes"},
                                           {"Is a piano a sport? #### no", "no"},
                                           {"Is golf a sport?", "yes"},
                                           {"Is jazz a sport?", "no"},
                                           {"Is hockey a sport?", "yes"},
                                           {"Is a violin a sport?", "no"}});
    write_prompts(dir_ / "held_out.jsonl",
                  {{"Is rugby a sport?", "yes"}, {"Is opera a sport?", "no"}});
    // Rewards that differ between completions of one prompt: the length of its JSON line.
    std::ofstream(dir_ / "reward.sh") << "awk '{print length($0) % 5}'\n";
    const RunResult r =
        run_tessera(model_ + " --train_iters 1 --lr_warmup_iters 0 --mock_data true --save " +
                    (dir_ / "start").string() + " --exp_name start");
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  std::string grpo() const {
    return model_ + " --objective grpo --finetune --load " + (dir_ / "start").string() +
           " --data_path null --train_data_path " + (dir_ / "prompts.jsonl").string() +
           " --valid_data_path " + (dir_ / "held_out.jsonl").string() +
           " --micro_batch_size 2 --global_batch_size 8 --grpo_num_generations 4 "
           "--grpo_max_completion_length 6 "
           "--grpo_rewards answer,command:0.5 --grpo_reward_command 'sh " +
           (dir_ / "reward.sh").string() + "' --lr 3e-3 --lr_warmup_iters 0 --log_interval 1";
  }
  // got's steps are want's on other data-parallel ranks: the same completions (rewards and
  // lengths), losses within 1e-5, KL within 1e-6, gradient norms within 1e-4 relative (the
  // ranks' sums in another order).
  static void expect_same_steps(const std::vector<nlohmann::json>& got, const std::vector<nlohmann::json>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      SCOPED_TRACE("step " + std::to_string(i + 1));
      EXPECT_EQ(got[i]["reward"].get<double>(), want[i]["reward"].get<double>());
      EXPECT_EQ(got[i]["completions/mean_length"].get<double>(), want[i]["completions/mean_length"].get<double>());
      EXPECT_NEAR(got[i]["lm_loss"].get<double>(), want[i]["lm_loss"].get<double>(), 1e-5);
      EXPECT_NEAR(got[i]["kl"].get<double>(), want[i]["kl"].get<double>(), 1e-6);
      EXPECT_NEAR(got[i]["grad_norm"].get<double>(), want[i]["grad_norm"].get<double>(),
                  1e-4 * want[i]["grad_norm"].get<double>());
    }
  }
  // Two generation batches of two optimizer steps each, with a KL term, and an evaluation at the end.
  std::string two_batches() const {
    return grpo() + " --train_iters 4 --grpo_num_iterations 2 --grpo_beta 0.05 --eval_interval 4 --eval_iters 1";
  }
  // The held-out accuracy a run last logged (-1: none).
  double eval_accuracy(const std::string& run) const {
    double a = -1;
    for (const auto& j : metrics_lines(dir_ / "g" / "u" / run / "metrics.jsonl"))
      if (j.contains("eval_accuracy")) a = j["eval_accuracy"].get<double>();
    return a;
  }
  std::vector<nlohmann::json> steps(const std::string& run) const {
    std::vector<nlohmann::json> out;
    for (const auto& j : metrics_lines(dir_ / "g" / "u" / run / "metrics.jsonl"))
      if (j.contains("reward")) out.push_back(j);
    return out;
  }

  ScratchDir dir_;
  const std::string model_ =
      "train --device cpu --model tiny_llama --tokenizer_model qwen3 --num_layers 1 --hidden_size "
      "32 "
      "--ffn_hidden_size 64 --num_attention_heads 2 --num_query_groups 1 --seq_length 40 "
      "--log_progress false --train_data_path null --workspace " +
      dir_.path().string() + " --work_group g --user_name u";
};

TEST_F(GrpoTraining, ReportsTrlStatisticsReusesItsBatchAndTwoRanksMatchOne) {
  const std::string run = two_batches();
  RunResult r = run_tessera(run + " --exp_name one");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("grpo: 6 prompts"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("KL to a frozen copy of the starting weights"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("grpo validation: accuracy"), std::string::npos) << r.output;
  const std::vector<nlohmann::json> one = steps("one");
  ASSERT_EQ(one.size(), 4u);
  for (const char* key :
       {"reward_std", "rewards/answer/mean", "rewards/command/mean", "accuracy",
        "completions/mean_length", "completions/max_length", "completions/clipped_ratio", "entropy",
        "clip_ratio/region_mean", "frac_reward_zero_std", "time/generation_s"})
    EXPECT_TRUE(one[0].contains(key)) << key;
  // Step 1: the policy is its reference and the policy that sampled.
  EXPECT_EQ(one[0]["kl"].get<double>(), 0.0);
  EXPECT_EQ(one[0]["clip_ratio/region_mean"].get<double>(), 0.0);
  EXPECT_GT(one[0]["time/generation_s"].get<double>(), 0.0);
  EXPECT_GT(one[0]["reward_std"].get<double>(), 0.0) << "the rewards must differ for a gradient";
  EXPECT_GT(one[0]["grad_norm"].get<double>(), 0.0);
  // Step 2 trains on step 1's completions again, moved from both policies by one update.
  EXPECT_EQ(one[1]["time/generation_s"].get<double>(), 0.0);
  EXPECT_EQ(one[1]["reward"].get<double>(), one[0]["reward"].get<double>());
  EXPECT_GT(one[1]["kl"].get<double>(), 0.0);
  EXPECT_GT(one[2]["time/generation_s"].get<double>(), 0.0);
  EXPECT_GE(eval_accuracy("one"), 0.0) << "no evaluation logged";

  // Top-k and top-p sample on the host (the device draws temperature and min-p).
  r = run_tessera(grpo() + " --train_iters 1 --grpo_top_k 20 --grpo_top_p 0.9 --exp_name top_k");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(steps("top_k").size(), 1u);
  EXPECT_GT(steps("top_k")[0]["completions/mean_length"].get<double>(), 0.0);

  // Completions are seeded by their place in the global batch: two ranks sample the same
  // ones and step as one rank does (ZeRO-1 with its parameter gather overlapped: generation
  // waits for it).
  r = run_tessera(
      run +
      " --nproc_per_node 2 --use_distributed_optimizer true --overlap_param_gather true "
      "--exp_name two");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_steps(steps("two"), one);
}

// Split placement (grpo_generation_gpus): the last rank only generates, with the weights the
// first rank broadcasts to it before each generation batch and evaluation; the training ranks
// get the completions the colocated run samples and take its steps: one training rank the same
// completions and steps (within the rounding of BLAS calls that another thread's concurrent
// generation may give other thread counts: 1e-11 apart on some 2-core hosts), two (ZeRO-1) as
// two colocated ranks do. Too many generation ranks, or LoRA, stop the run by
// name; so does a verifier that breaks, the generation rank ending with the job. One batch ahead (grpo_async_generation), a batch is what the on-policy split run samples
// from the same weights.
TEST_F(GrpoTraining, SplitPlacementSamplesOnItsOwnRankWhatColocatedSamples) {
  const std::string run = two_batches();
  RunResult r = run_tessera(run + " --exp_name colocated");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera(run + " --nproc_per_node 2 --grpo_generation_gpus 1 --exp_name split");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("split: decoded on generation rank 1 of the job"), std::string::npos) << r.output;
  const std::vector<nlohmann::json> colocated = steps("colocated"), split = steps("split");
  ASSERT_EQ(split.size(), 4u);
  expect_same_steps(split, colocated);
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    EXPECT_NEAR(split[i]["entropy"].get<double>(), colocated[i]["entropy"].get<double>(),
                1e-6 * std::abs(colocated[i]["entropy"].get<double>()));
    EXPECT_FALSE(colocated[i].contains("time/weight_sync_s"));
    ASSERT_TRUE(split[i].contains("time/weight_sync_s"));
    if (i % 2 == 0)
      EXPECT_GT(split[i]["time/weight_sync_s"].get<double>(), 0.0);
    else
      EXPECT_EQ(split[i]["time/weight_sync_s"].get<double>(), 0.0) << "a reused batch syncs nothing";
  }
  EXPECT_GE(eval_accuracy("split"), 0.0);
  EXPECT_EQ(eval_accuracy("split"), eval_accuracy("colocated"));

  // Two training ranks and one generation rank: the completions seeded by their place in the
  // global batch, decoded together on the generation rank.
  r = run_tessera(run + " --nproc_per_node 3 --grpo_generation_gpus 1 --use_distributed_optimizer true --exp_name split3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_steps(steps("split3"), colocated);

  // One batch ahead (grpo_async_generation): with the weights held still (lr 0) each batch is
  // the one the on-policy split run samples, and the generator's log-probabilities, the old
  // policy's here, are the training pass's to fp32 rounding (nothing clipped).
  const std::string still = run + " --lr 0 --min_lr 0 --nproc_per_node 2 --grpo_generation_gpus 1";
  r = run_tessera(still + " --exp_name still");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera(still + " --grpo_async_generation true --exp_name still_ahead");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<nlohmann::json> on_policy = steps("still"), ahead = steps("still_ahead");
  ASSERT_EQ(ahead.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    EXPECT_EQ(ahead[i]["reward"].get<double>(), on_policy[i]["reward"].get<double>());
    EXPECT_EQ(ahead[i]["completions/mean_length"].get<double>(), on_policy[i]["completions/mean_length"].get<double>());
    EXPECT_NEAR(ahead[i]["lm_loss"].get<double>(), on_policy[i]["lm_loss"].get<double>(),
                1e-5 * std::abs(on_policy[i]["lm_loss"].get<double>()) + 1e-7);
    EXPECT_EQ(ahead[i]["clip_ratio/region_mean"].get<double>(), 0.0);
  }
  EXPECT_EQ(eval_accuracy("still_ahead"), eval_accuracy("still"));
  // Learning, the second batch comes from the weights before the first batch's updates: the
  // run goes on (its first batch is the on-policy run's).
  r = run_tessera(run + " --nproc_per_node 2 --grpo_generation_gpus 1 --grpo_async_generation true --exp_name ahead");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<nlohmann::json> learning_ahead = steps("ahead");
  ASSERT_EQ(learning_ahead.size(), 4u);
  EXPECT_EQ(learning_ahead[0]["lm_loss"].get<double>(), split[0]["lm_loss"].get<double>());
  EXPECT_EQ(learning_ahead[1]["lm_loss"].get<double>(), split[1]["lm_loss"].get<double>());
  for (const auto& step : learning_ahead) EXPECT_TRUE(std::isfinite(step["lm_loss"].get<double>()));
  // Its generation rate is the generation rank's decoding's, not the tokens over the wait.
  EXPECT_GT(learning_ahead[2]["generation_tokens_per_s"].get<double>(), 0.0);
  EXPECT_GT(learning_ahead[2]["time/generation_s"].get<double>(), 0.0);
  r = run_tessera(grpo() + " --train_iters 1 --grpo_async_generation true --exp_name colocated_ahead");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("grpo_async_generation"), std::string::npos) << r.output;

  r = run_tessera(grpo() + " --train_iters 1 --nproc_per_node 2 --grpo_generation_gpus 2 --exp_name all_generate");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("grpo_generation_gpus"), std::string::npos) << r.output;
  r = run_tessera(grpo() + " --train_iters 1 --nproc_per_node 2 --grpo_generation_gpus 1 --lora_rank 2 "
                           "--finetune false --pretrained_checkpoint " + (dir_ / "start").string() + " --exp_name lora");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("'lora_rank'"), std::string::npos) << r.output;
  // A verifier that breaks on a training rank ends the job, the generation rank too (it waits
  // in a collective the failure aborts), with the command named and no step recorded.
  std::ofstream(dir_ / "crash.sh") << "echo 'verifier broke' >&2; exit 3\n";
  r = run_tessera(grpo() + " --train_iters 1 --nproc_per_node 3 --grpo_generation_gpus 1 --use_distributed_optimizer true "
                           "--grpo_rewards command --grpo_reward_command 'sh " + (dir_ / "crash.sh").string() +
                  "' --exp_name split_crash");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("verifier broke"), std::string::npos) << r.output;
  EXPECT_TRUE(steps("split_crash").empty());
}

// The reward command sees each completion's text: a run's completions, then the same run with
// a stop string taken from inside one of them.
TEST_F(GrpoTraining, AStopStringEndsACompletionWhereItsTextHoldsIt) {
  std::ofstream(dir_ / "tee.sh") << "tee -a \"$1\" | awk '{print length($0) % 5}'\n";
  const auto run = [&](const std::string& name, const std::string& extra) {
    const fs::path seen = dir_ / (name + ".jsonl");
    const RunResult r = run_tessera(
        grpo() + " --train_iters 1 --grpo_rewards command --grpo_reward_command 'sh " +
        (dir_ / "tee.sh").string() + " " + seen.string() + "' --exp_name " + name + extra);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    std::vector<std::string> texts;
    std::ifstream in(seen);
    for (std::string line; std::getline(in, line);)
      texts.push_back(nlohmann::json::parse(line)["completion"].get<std::string>());
    return texts;
  };
  const std::vector<std::string> free = run("free", "");
  ASSERT_GE(free.size(), 8u);  // the batch, then the held-out prompts' evaluation
  // A stop string from inside a completion: its second and third characters, from one whose
  // first four are ASCII (the random policy's tokens mix scripts).
  size_t pick = free.size();
  for (size_t i = 0; i < free.size() && pick == free.size(); ++i)
    if (free[i].size() >= 4 &&
        std::all_of(free[i].begin(), free[i].begin() + 4, [](char c) { return c > 32 && c < 127; }))
      pick = i;
  ASSERT_LT(pick, free.size()) << "no completion starting with 4 ASCII characters to cut";
  const std::string stop = free[pick].substr(1, 2);
  const std::vector<std::string> stopped =
      run("stopped", " --grpo_stop_strings '[\"" + stop + "\", \"@@@\"]'");
  ASSERT_EQ(stopped.size(), free.size());
  for (size_t i = 0; i < free.size(); ++i) {
    SCOPED_TRACE(free[i] + " | " + stopped[i]);
    // The same tokens up to the stop: a prefix of the free completion.
    EXPECT_EQ(free[i].compare(0, stopped[i].size(), stopped[i]), 0);
    const size_t at = free[i].find(stop);
    if (at == std::string::npos) {
      EXPECT_EQ(stopped[i], free[i]);
    } else {  // ends with the token that completed the stop string
      EXPECT_NE(stopped[i].find(stop), std::string::npos);
      EXPECT_LE(stopped[i].size(), free[i].size());
    }
  }
  // The picked completion had tokens after the one that completed the stop string.
  EXPECT_LT(stopped[pick].size(), free[pick].size());
  EXPECT_NE(stopped[pick].find(stop), std::string::npos);

  const RunResult r =
      run_tessera(grpo() + " --train_iters 1 --grpo_stop_strings '[\"\"]' --exp_name empty");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("grpo_stop_strings"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("an empty stop string"), std::string::npos) << r.output;
}

// reference_load: the KL term's reference is another checkpoint's weights, so the first step
// already measures a distance, and a run with it resumes.
TEST_F(GrpoTraining, AReferenceFromAnotherCheckpoint) {
  RunResult r = run_tessera(
      model_ + " --train_iters 2 --lr_warmup_iters 0 --mock_data true --seed 7 --save " +
      (dir_ / "other").string() + " --exp_name other");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string run = grpo() +
                          " --train_iters 2 --grpo_beta 0.05 --eval_interval 0 --reference_load " +
                          (dir_ / "other").string();
  r = run_tessera(run + " --exp_name kl --save " + (dir_ / "kl").string() + " --exit_interval 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("KL to a frozen copy of the checkpoint " + (dir_ / "other").string()),
            std::string::npos)
      << r.output;
  std::vector<nlohmann::json> s = steps("kl");
  ASSERT_EQ(s.size(), 1u);
  EXPECT_GT(s[0]["kl"].get<double>(), 0.0) << "the policy starts away from this reference";
  r = run_tessera(
      model_ + " --objective grpo --load " + (dir_ / "kl").string() +
      " --data_path null --train_data_path " + (dir_ / "prompts.jsonl").string() +
      " --micro_batch_size 2 --global_batch_size 8 --grpo_num_generations 4 "
      "--grpo_max_completion_length 6 "
      "--grpo_rewards answer --lr 3e-3 --lr_warmup_iters 0 --log_interval 1 --train_iters 2 "
      "--grpo_beta 0.05 --eval_interval 0 --exp_name kl --reference_load " +
      (dir_ / "other").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(steps("kl").size(), 2u);
}

// grpo_offload_optimizer_state: while each batch generates, the AdamW moments wait on the host
// and the KV cache fills their memory; the run is the one without it, bit for bit, through a
// generation that follows optimizer steps (steps 1-2 on the first batch, 3-4 on the second).
TEST_F(GrpoTraining, OffloadedMomentsLendTheirMemoryToTheKvCache) {
  const std::string run = grpo() + " --train_iters 4 --grpo_num_iterations 2 --grpo_beta 0.05";
  RunResult r = run_tessera(run + " --exp_name kept");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera(run + " --grpo_offload_optimizer_state true --exp_name offloaded");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<nlohmann::json> kept = steps("kept"), offloaded = steps("offloaded");
  ASSERT_EQ(kept.size(), 4u);
  ASSERT_EQ(offloaded.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    for (const char* key : {"lm_loss", "grad_norm", "reward", "kl", "completions/mean_length"})
      EXPECT_EQ(offloaded[i][key].get<double>(), kept[i][key].get<double>()) << key;
    EXPECT_FALSE(kept[i].contains("time/optimizer_offload_s"));
  }
  EXPECT_GT(offloaded[0]["time/optimizer_offload_s"].get<double>(), 0.0);
  EXPECT_GT(offloaded[2]["time/optimizer_offload_s"].get<double>(), 0.0);
  // Moments too small for the cache (LoRA rank 1 on q_proj alone: a few hundred bytes) stop the
  // run before it trains, naming the key and both sizes.
  r = run_tessera(grpo() + " --train_iters 1 --lora_rank 1 --lora_target_modules q_proj --finetune false "
                           "--load null --pretrained_checkpoint " + (dir_ / "start").string() +
                  " --grpo_offload_optimizer_state true --exp_name too_small");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("key 'grpo_offload_optimizer_state' has value 'true': expected false, or a KV cache "
                          "that fits in the"),
            std::string::npos)
      << r.output;
  EXPECT_TRUE(steps("too_small").empty());
}

// LoRA: generation reads the frozen base in place with the adapters added
// (LoraModel.GeneratorOnItsBaseWithItsAdaptersGivesItsLogits), the KL reference is the base
// (the adapters as they started, B at zero: a copy of the adapters alone), and two ranks step
// as one.
TEST_F(GrpoTraining, LoraSamplesThroughItsAdaptersAgainstItsBase) {
  const std::string lora = model_ + " --objective grpo --lora_rank 4 --lora_alpha 8 --pretrained_checkpoint " +
                           (dir_ / "start").string() + " --data_path null --train_data_path " +
                           (dir_ / "prompts.jsonl").string() +
                           " --micro_batch_size 2 --global_batch_size 8 --grpo_num_generations 4 "
                           "--grpo_max_completion_length 6 --grpo_rewards answer,command:0.5 --grpo_reward_command 'sh " +
                           (dir_ / "reward.sh").string() +
                           "' --lr 3e-2 --lr_warmup_iters 0 --log_interval 1 --train_iters 3 --grpo_beta 0.05";
  RunResult r = run_tessera(lora + " --exp_name lora_one");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("LoRA: rank 4"), std::string::npos) << r.output;
  const std::vector<nlohmann::json> one = steps("lora_one");
  ASSERT_EQ(one.size(), 3u);
  EXPECT_EQ(one[0]["kl"].get<double>(), 0.0);  // the adapters add nothing yet: the base
  EXPECT_GT(one[0]["grad_norm"].get<double>(), 0.0);
  EXPECT_GT(one[2]["kl"].get<double>(), 0.0);  // trained adapters move the policy off its base
  r = run_tessera(lora + " --nproc_per_node 2 --use_distributed_optimizer true --exp_name lora_two");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_steps(steps("lora_two"), one);
}

// Multi-latent attention (beside DeepSeek's MoE layers) decodes a group's completions together,
// each at its own position, and the step runs.
TEST_F(GrpoTraining, MultiLatentAttentionDecodesItsGroupTogether) {
  const std::string mla =
      "train --device cpu --model tiny_mla --tokenizer_model qwen3 --seq_length 40 "
      "--log_progress false --train_data_path null --lr_warmup_iters 0 --workspace " +
      dir_.path().string() + " --work_group g --user_name u";
  RunResult r = run_tessera(mla + " --mock_data true --train_iters 1 --save " +
                            (dir_ / "mla").string() + " --exp_name mla_start");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera(mla + " --objective grpo --finetune --load " + (dir_ / "mla").string() +
                  " --data_path null --train_data_path " + (dir_ / "prompts.jsonl").string() +
                  " --micro_batch_size 2 --global_batch_size 4 --grpo_num_generations 4 "
                  "--grpo_max_completion_length 5 --train_iters 1 --exp_name mla_grpo");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<nlohmann::json> s = steps("mla_grpo");
  ASSERT_EQ(s.size(), 1u);
  EXPECT_GT(s[0]["completions/mean_length"].get<double>(), 0.0);
}

TEST_F(GrpoTraining, BadPromptsAndAFailingRewardCommandStopTheRunByName) {
  {
    std::ofstream out(dir_ / "bad.jsonl");
    out << R"({"prompt": "Is golf a sport?", "answer": "yes"})"
        << "\n";
    out << R"({"question": "How many? Two and two. #### not this", "answer": "They add up. #### 4"})"
        << "\n";
    out << R"({"completion": "no prompt"})"
        << "\n";
  }
  RunResult r = run_tessera(grpo() + " --train_iters 1 --train_data_path " +
                            (dir_ / "bad.jsonl").string() + " --exp_name bad");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("bad.jsonl:3: no 'prompt' (or GSM8K's 'question')"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "g" / "u" / "bad" / "metrics.jsonl"));

  std::ofstream(dir_ / "crash.sh") << "echo 'verifier broke' >&2; exit 3\n";
  r = run_tessera(grpo() + " --train_iters 1 --grpo_rewards command --grpo_reward_command 'sh " +
                  (dir_ / "crash.sh").string() + "' --exp_name crash");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("crash.sh"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("verifier broke"), std::string::npos) << r.output;

  r = run_tessera(grpo() + " --train_iters 1 --grpo_max_completion_length 30 --exp_name long");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("prompts.jsonl:1: the prompt has"), std::string::npos) << r.output;
}

// The shipped GRPO experiments' prompts (scripts/data/gsm8k_prompts.py): GSM8K's lines become
// chat prompts, a system message asking for \boxed{} then the question, which GRPO reads
// through Qwen3's chat template, with the number after the last #### as the answer (its
// thousands separator dropped) that the boxed answer of a completion matches. A line without
// an answer stops the script naming file and line, and writes nothing.
TEST(GrpoPrompts, Gsm8kLinesBecomeChatPromptsWhoseBoxedAnswerTheRewardChecks) {
  ScratchDir dir;
  const fs::path in = dir / "gsm8k.jsonl", out = dir / "prompts.jsonl";
  std::ofstream(in) << R"({"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"})"
                    << "\n"
                    << R"({"question": "A shop sells 40 pens a day. How many in 30 days?", "answer": "40*30 = 1200\n#### 1,200"})"
                    << "\n";
  const std::string script = std::string(TESSERA_PYTHON) + " " + TESSERA_TESTS_DIR + "/../scripts/data/gsm8k_prompts.py ";
  RunResult r = run_command(script + in.string() + " " + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const BpeTokenizer& qwen3 = shipped("qwen3");
  const ChatFormat chat(tokenizer_json_path("qwen3"), qwen3);
  const std::vector<GrpoPrompt> prompts = read_grpo_prompts(out.string(), qwen3, &chat, /*need_answer=*/true, 512);
  ASSERT_EQ(prompts.size(), 2u);
  const nlohmann::ordered_json messages = nlohmann::ordered_json::array(
      {{{"role", "system"}, {"content", "Please reason step by step, and put your final answer within \\boxed{}."}},
       {{"role", "user"}, {"content", "A shop sells 40 pens a day. How many in 30 days?"}}});
  EXPECT_EQ(prompts[1].ids, chat.encode_prompt(messages, "expected"));
  EXPECT_EQ(prompts[0].answer, "7");
  EXPECT_EQ(prompts[1].answer, "1200");
  const auto given = extract_answer("40 x 30 pens: \\boxed{1,200}", AnswerFormat::Boxed);
  ASSERT_TRUE(given.has_value());
  EXPECT_TRUE(answers_match(*given, prompts[1].answer));

  std::ofstream(in, std::ios::app) << R"({"question": "No answer here?", "answer": "none"})" << "\n";
  const fs::path refused = dir / "refused.jsonl";
  r = run_command(script + in.string() + " " + refused.string());
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("gsm8k.jsonl:3"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(refused));
}

}  // namespace
}  // namespace tessera::testing
