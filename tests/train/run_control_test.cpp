// Megatron's run-control keys through the real binary: exit_interval and exit_duration_in_mins
// stop after an iteration with a checkpoint and exit 0 (and the same command resumes),
// train_samples sets the length (and the learning-rate decay) in samples, and skip_train
// evaluates the loaded weights without training, saving or writing TensorBoard.
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

// The iterations a metrics file logged training lines for, in order.
std::vector<int64_t> trained_iterations(const fs::path& file) {
  std::vector<int64_t> out;
  for (const auto& j : metrics_lines(file))
    if (j.contains("lm_loss")) out.push_back(j["iteration"]);
  return out;
}

std::vector<std::string> checkpoints(const fs::path& save) {
  std::vector<std::string> out;
  if (fs::is_directory(save))
    for (const auto& e : fs::directory_iterator(save))
      if (e.path().filename().string().starts_with("iter_")) out.push_back(e.path().filename());
  std::sort(out.begin(), out.end());
  return out;
}

// Megatron's exit_interval counts iterations from the start of training, not of this process:
// the same command stops at 4, resumes to 8, then runs to the end.
TEST(ExitInterval, StopsAfterEachMultipleWithACheckpointAndTheSameCommandResumes) {
  ScratchDir dir;
  const fs::path save = dir / "ckpt", root = dir / "g" / "u" / "e";
  const std::string args = tiny_args(dir.path(), "e") + " --train_iters 10 --exit_interval 4 " +
                           "--ckpt_keep_last 0 --save " + save.string() + " --load " +
                           save.string();
  RunResult r = run_tessera(args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(
      contains(r.output, "stopping after iteration 4: it is a multiple of exit_interval (4)"))
      << r.output;
  EXPECT_EQ(trained_iterations(root / "metrics.jsonl"), (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(checkpoints(save), (std::vector<std::string>{"iter_0000004"}));

  r = run_tessera(args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "stopping after iteration 8")) << r.output;
  EXPECT_EQ(checkpoints(save), (std::vector<std::string>{"iter_0000004", "iter_0000008"}));

  r = run_tessera(args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(contains(r.output, "stopping after")) << r.output;  // the end is no early exit
  EXPECT_EQ(trained_iterations(root / "metrics.jsonl"),
            (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}));
  EXPECT_EQ(checkpoints(save),
            (std::vector<std::string>{"iter_0000004", "iter_0000008", "iter_0000010"}));
}

TEST(ExitInterval, WithoutSaveItStopsAndSavesNothing) {
  ScratchDir dir;
  const RunResult r =
      run_tessera(tiny_args(dir.path(), "e") + " --train_iters 6 --exit_interval 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(trained_iterations(dir / "g" / "u" / "e" / "metrics.jsonl"),
            (std::vector<int64_t>{1, 2, 3}));
  EXPECT_FALSE(contains(r.output, "saved checkpoint")) << r.output;
}

// A duration shorter than any set-up has passed by the first iteration: two ranks (threads),
// each reading its own clock, agree to stop after it, and the checkpoint is saved.
TEST(ExitDuration, StopsAfterTheIterationDuringWhichTimeRanOutWithACheckpoint) {
  ScratchDir dir;
  const fs::path save = dir / "ckpt";
  const RunResult r = run_tessera(tiny_args(dir.path(), "e") +
                                  " --nproc_per_node 2 --train_iters 20 "
                                  "--exit_duration_in_mins 0.0001 --save " +
                                  save.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "stopping after iteration 1: the process has run")) << r.output;
  EXPECT_TRUE(contains(r.output, "(exit_duration_in_mins 0.0001)")) << r.output;
  EXPECT_EQ(trained_iterations(dir / "g" / "u" / "e" / "metrics.jsonl"), (std::vector<int64_t>{1}));
  EXPECT_EQ(checkpoints(save), (std::vector<std::string>{"iter_0000001"}));
}

TEST(ExitDuration, ALongDurationChangesNothing) {
  ScratchDir dir;
  const RunResult r =
      run_tessera(tiny_args(dir.path(), "e") + " --train_iters 3 --exit_duration_in_mins 60");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(trained_iterations(dir / "g" / "u" / "e" / "metrics.jsonl"),
            (std::vector<int64_t>{1, 2, 3}));
}

// 22 samples of 4 per batch: 5 iterations (Megatron rounds down), and the decay (lr_decay_iters
// 0) ends with the run, at min_lr.
TEST(TrainSamples, SetsTheRunLengthAndTheDecayInSamples) {
  ScratchDir dir;
  const fs::path root = dir / "g" / "u" / "e";
  const RunResult r = run_tessera(tiny_args(dir.path(), "e") +
                                  " --train_iters 0 --train_samples 22 --lr 0.01 --min_lr 0.001 "
                                  "--lr_decay_style linear");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "training for 5 iterations")) << r.output;
  const auto lines = metrics_lines(root / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 5u);
  EXPECT_EQ(lines.back()["iteration"], 5);
  EXPECT_EQ(lines.back()["consumed_samples"], 20);
  EXPECT_DOUBLE_EQ(lines.back()["lr"].get<double>(), 0.001);
  EXPECT_DOUBLE_EQ(lines[2]["lr"].get<double>(), 0.01 - 0.009 * 2 / 4);  // (3 - 1) / (5 - 1)

  // The effective configuration records both, and runs again as it is.
  std::ifstream in(root / "config.yaml");
  const std::string yaml((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(contains(yaml, "\ntrain_iters: 5\n")) << yaml;
  EXPECT_TRUE(contains(yaml, "\ntrain_samples: 22\n")) << yaml;
  const RunResult again =
      run_tessera("train --config " + (root / "config.yaml").string() + " --exp_name again");
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_TRUE(contains(again.output, "training for 5 iterations")) << again.output;
}

// A Megatron launch line's --train_samples replaces the experiment's train_iters (the default
// experiment sets 150); both on one command line are two run lengths, refused naming both.
TEST(TrainSamples, TheCommandLineReplacesTheExperimentsTrainItersButNotItsOwn) {
  ScratchDir dir;
  RunResult r = run_tessera(tiny_args(dir.path(), "e") + " --train_samples 40");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "training for 10 iterations")) << r.output;

  r = run_tessera(tiny_args(dir.path(), "f") + " --train_samples 40 --train_iters 7");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "key 'train_samples' has value '40'")) << r.output;
  EXPECT_TRUE(contains(r.output, "train_iters is 7, set on the command line")) << r.output;
  EXPECT_FALSE(fs::exists(dir / "g" / "u" / "f")) << "the experiment directory was made";
}

// A resumed run names the iterations it runs, not the run's length as if it ran them all.
TEST(Resume, TheLogNamesTheIterationsThisRunTrains) {
  ScratchDir dir;
  const fs::path save = dir / "ckpt";
  const std::string args =
      tiny_args(dir.path(), "e") + " --save " + save.string() + " --load " + save.string();
  RunResult r = run_tessera(args + " --train_iters 10");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "training for 10 iterations")) << r.output;
  EXPECT_TRUE(contains(r.output, "done: 10 iterations in")) << r.output;
  r = run_tessera(args + " --train_iters 13");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(
      r.output, "training iterations 11 to 13 (3 of the run's 13; resumed after iteration 10)"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "done: 3 iterations, 11 to 13 in")) << r.output;
  EXPECT_FALSE(contains(r.output, "training for 13 iterations")) << r.output;
}

// Primus's disable_last_saving: no checkpoint at the end, said when the run starts and ends;
// the Primus example with --save runs, and --disable_last_saving false saves the last one.
TEST(DisableLastSaving, SkipsTheEndOfRunCheckpointAndSaysSo) {
  ScratchDir dir;
  const fs::path save = dir / "ckpt";
  RunResult r = run_tessera(tiny_args(dir.path(), "e") + " --train_iters 5 --save_interval 2 " +
                            "--ckpt_keep_last 0 --disable_last_saving --save " + save.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "disable_last_saving is true: no checkpoint at the end"))
      << r.output;
  EXPECT_TRUE(contains(r.output,
                       "no checkpoint of iteration 5: disable_last_saving is true "
                       "(the last one, of iteration 4,"))
      << r.output;
  EXPECT_EQ(checkpoints(save), (std::vector<std::string>{"iter_0000002", "iter_0000004"}));

  // Primus's own example file (disable_last_saving: true, save_interval 20000) with --save.
  const fs::path primus_save = dir / "primus_ckpt";
  const std::string primus =
      std::string("train --config primus/llama3.1_8B-pretrain --device cpu --num_layers 2 ") +
      "--hidden_size 32 --ffn_hidden_size 48 --num_attention_heads 4 --num_query_groups 2 " +
      "--vocab_size 64 --seq_length 16 --micro_batch_size 2 --global_batch_size 4 " +
      "--train_iters 2 --log_progress false --workspace " + dir.path().string() + " --save " +
      primus_save.string();
  r = run_tessera(primus);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "so this run saves none")) << r.output;
  EXPECT_TRUE(checkpoints(primus_save).empty());
  r = run_tessera(primus + " --disable_last_saving false --exp_name again");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(checkpoints(primus_save), (std::vector<std::string>{"iter_0000002"}));
}

// Megatron's skip_train: the weights of the checkpoint evaluated as the training run evaluated
// them at that iteration, bit for bit; no iteration, no checkpoint, no TensorBoard file.
TEST(SkipTrain, EvaluatesTheLoadedWeightsOnlyAndExits) {
  ScratchDir dir;
  const fs::path save = dir / "ckpt";
  RunResult r =
      run_tessera(tiny_args(dir.path(), "train") +
                  " --train_iters 3 --eval_interval 3 --eval_iters 2 --save " + save.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  double trained_eval = -1;
  for (const auto& j : metrics_lines(dir / "g" / "u" / "train" / "metrics.jsonl"))
    if (j.contains("eval_lm_loss")) trained_eval = j["eval_lm_loss"];
  ASSERT_GT(trained_eval, 0);

  r = run_tessera(tiny_args(dir.path(), "eval") + " --train_iters 3 --skip_train --eval_iters 2 " +
                  "--load " + save.string() + " --tensorboard_dir tb");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "skip_train: evaluating the weights of iteration 3")) << r.output;
  const auto lines = metrics_lines(dir / "g" / "u" / "eval" / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0]["iteration"], 3);
  EXPECT_EQ(lines[0]["eval_lm_loss"].get<double>(), trained_eval);
  EXPECT_FALSE(contains(r.output, "iteration        1/")) << r.output;
  EXPECT_EQ(checkpoints(save), (std::vector<std::string>{"iter_0000003"}));
  EXPECT_FALSE(fs::exists(dir / "g" / "u" / "eval" / "tb"));
}

}  // namespace
}  // namespace tessera::testing
