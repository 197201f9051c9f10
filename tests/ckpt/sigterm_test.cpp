// SIGTERM through the real binary: the trainer stops at a clean point, saves a checkpoint
// before exiting, and a second run with the same command line resumes from it.
#include <signal.h>

#include <chrono>
#include <thread>

#include "ckpt_test_util.h"
#include "tessera/ckpt/checkpoint.h"

namespace tessera::testing {
namespace {

TEST(Sigterm, SavesALoadableCheckpointBeforeExiting) {
  ScratchDir dir;
  const fs::path save = dir / "ckpt", out = dir / "out.txt";
  const std::string args =
      "train --model tiny_llama --mock_data true --num_layers 2 --hidden_size 32 --ffn_hidden_size "
      "48 "
      "--vocab_size 64 --seq_length 16 --micro_batch_size 2 --global_batch_size 4 "
      "--lr_warmup_iters 1 "
      "--eval_interval 0 --log_interval 1 --workspace " +
      dir.path().string() + " --work_group g --user_name u --exp_name e --save " + save.string() +
      " --load " + save.string();
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string cmd = "exec " + std::string(TESSERA_BINARY) + " " + args +
                            " --train_iters 100000 > " + out.string() + " 2>&1";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
    _exit(127);
  }
  const fs::path metrics = dir / "g" / "u" / "e" / "metrics.jsonl";
  for (int i = 0; i < 600 && (!fs::exists(metrics) || fs::file_size(metrics) == 0); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(fs::exists(metrics)) << read_file(out);
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << read_file(out);
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << read_file(out);
  const std::string output = read_file(out);
  EXPECT_TRUE(contains(output, "received SIGTERM")) << output;
  EXPECT_TRUE(contains(output, "saved checkpoint")) << output;

  const std::string latest = find_latest_checkpoint(save.string());
  ASSERT_FALSE(latest.empty()) << output;
  const Checkpoint c(latest);  // opens and checks every file and tensor
  const int64_t saved = c.state().iteration;
  EXPECT_GE(saved, 1);
  EXPECT_EQ(c.state().consumed_samples, static_cast<uint64_t>(4 * saved));
  for (const auto& e : fs::directory_iterator(save))
    EXPECT_FALSE(e.path().string().ends_with(".tmp")) << e.path();

  // The same command line resumes where the stopped run left off.
  const RunResult again = run_tessera(args + " --train_iters " + std::to_string(saved + 2));
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_TRUE(
      contains(again.output, "resumed from " + latest + " at iteration " + std::to_string(saved)))
      << again.output;
  EXPECT_EQ(read_file(save / "latest_checkpointed_iteration.txt"),
            std::to_string(saved + 2) + "\n");
}

}  // namespace
}  // namespace tessera::testing
