// End-to-end tests of the `tessera` binary: experiment layout, metrics, exit codes,
// validation leaving the disk untouched, and clean stops on SIGTERM.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/run_command.h"

namespace {

namespace fs = std::filesystem;

using tessera::testing::RunResult;

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    ws_ = fs::temp_directory_path() / ("tessera_cli_" + std::to_string(::getpid()) + "_" +
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(ws_);
    fs::create_directories(ws_);
  }
  void TearDown() override { fs::remove_all(ws_); }

  RunResult run(const std::string& args) { return tessera::testing::run_tessera(args); }

  std::string tiny_args() const {
    return "train --model tiny_llama --mock_data true --num_layers 2 --hidden_size 32 "
           "--ffn_hidden_size 48 --vocab_size 64 --seq_length 16 --micro_batch_size 2 "
           "--global_batch_size 4 --lr_warmup_iters 1 --workspace " + ws_.string() +
           " --work_group g --user_name u --exp_name e";
  }

  static std::string read(const fs::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  fs::path ws_;
};

TEST_F(Cli, TrainWritesThePrimusLayoutAndMetrics) {
  const RunResult r = run(tiny_args() + " --train_iters 4 --log_interval 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path root = ws_ / "g" / "u" / "e";
  const fs::path logs = root / "logs" / "pre_trainer" / "rank-0";
  for (const char* f : {"debug.log", "info.log", "warning.log", "error.log"})
    EXPECT_TRUE(fs::exists(logs / f)) << f;
  EXPECT_TRUE(fs::exists(root / "config.yaml"));
  const std::string info = read(logs / "info.log"), debug = read(logs / "debug.log");
  EXPECT_NE(info.find("iteration        4/       4"), std::string::npos) << info;
  // A CPU run's rank is a thread group of this process, as the plots and report say.
  EXPECT_NE(info.find("throughput per rank (TFLOP/s/rank)"), std::string::npos) << info;
  EXPECT_EQ(info.find("/GPU"), std::string::npos) << info;
  EXPECT_GT(debug.size(), info.size());  // debug holds everything info has, and more
  EXPECT_NE(debug.find("effective configuration"), std::string::npos);
  EXPECT_EQ(read(logs / "error.log"), "");

  std::ifstream metrics(root / "metrics.jsonl");
  std::string line;
  std::vector<nlohmann::json> records;
  bool evaluated = false;
  while (std::getline(metrics, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("eval_lm_loss")) evaluated = true;  // the default experiment evaluates at the end
    else records.push_back(j);
  }
  EXPECT_TRUE(evaluated);
  ASSERT_EQ(records.size(), 2u);  // iterations 2 and 4
  for (const char* key : {"iteration", "lm_loss", "lr", "grad_norm", "elapsed_ms", "tflops_per_gpu",
                          "tflops_per_gpu_causal", "tokens_per_s_per_gpu", "consumed_samples", "mem_allocated_gib", "mem_peak_gib"})
    EXPECT_TRUE(records[1].contains(key)) << key;
  EXPECT_EQ(records[1]["iteration"], 4);
  EXPECT_EQ(records[1]["consumed_samples"], 16);
  EXPECT_GT(records[1]["tokens_per_s_per_gpu"].get<double>(), 0);
  EXPECT_LT(records[1]["tflops_per_gpu_causal"].get<double>(),
            records[1]["tflops_per_gpu"].get<double>());
  EXPECT_GT(records[1]["mem_peak_gib"].get<double>(), 0);

  // The logged loss is the mean over the interval (Megatron's): the same run logging every
  // iteration gives the losses it averages.
  const RunResult each = run(tiny_args() + " --train_iters 4 --log_interval 1 --exp_name every");
  ASSERT_EQ(each.exit_code, 0) << each.output;
  std::ifstream every_metrics(ws_ / "g" / "u" / "every" / "metrics.jsonl");
  std::vector<double> losses;
  while (std::getline(every_metrics, line)) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("eval_lm_loss")) losses.push_back(j["lm_loss"].get<double>());
  }
  ASSERT_EQ(losses.size(), 4u);
  EXPECT_NE(losses[0], losses[1]);
  EXPECT_DOUBLE_EQ(records[0]["lm_loss"].get<double>(), (losses[0] + losses[1]) / 2);
  EXPECT_DOUBLE_EQ(records[1]["lm_loss"].get<double>(), (losses[2] + losses[3]) / 2);
}

TEST_F(Cli, InvalidConfigExitsTwoAndCreatesNothing) {
  for (const std::string& bad : {std::string(" --lr_warmup_iter 3"), std::string(" --global_batch_size 3"),
                                 std::string(" --num_query_groups 3"), std::string(" --lr fast"),
                                 std::string(" --tokenizer_type HuggingFaceTokenizer --tokenizer_model llama9")}) {
    const RunResult r = run(tiny_args() + " --train_iters 2" + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << "\n" << r.output;
    EXPECT_NE(r.output.find("command line: key '"), std::string::npos) << r.output;
    EXPECT_TRUE(fs::is_empty(ws_)) << bad << " created files";
  }
  const RunResult r = run("train --config /no/such/experiment.yaml --workspace " + ws_.string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("/no/such/experiment.yaml"), std::string::npos);
  EXPECT_TRUE(fs::is_empty(ws_));
}

TEST_F(Cli, UnknownCommandAndHelp) {
  EXPECT_EQ(run("frobnicate").exit_code, 2);
  // A mistyped command or benchmark gets the nearest one.
  const RunResult typo = run("trian");
  EXPECT_EQ(typo.exit_code, 2);
  EXPECT_NE(typo.output.find("unknown command 'trian'; did you mean train?"), std::string::npos)
      << typo.output;
  const RunResult bench = run("bench gemn");
  EXPECT_EQ(bench.exit_code, 2);
  EXPECT_NE(bench.output.find("did you mean gemm?"), std::string::npos) << bench.output;
  const RunResult help = run("train --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("--global_batch_size"), std::string::npos);
}

TEST_F(Cli, SigtermStopsCleanlyWithFlushedLogs) {
  const std::string out = (ws_ / "out.txt").string();
  const std::string cmd = std::string(TESSERA_BINARY) + " " + tiny_args() +
                          " --train_iters 100000 --log_interval 1 > " + out + " 2>&1";
  const pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), nullptr);
    _exit(127);
  }
  const fs::path metrics = ws_ / "g" / "u" / "e" / "metrics.jsonl";
  for (int i = 0; i < 600 && (!fs::exists(metrics) || fs::file_size(metrics) == 0); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(fs::exists(metrics)) << read(out);
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  const std::string output = read(out);
  EXPECT_NE(output.find("received SIGTERM"), std::string::npos) << output;
  const std::string warnings = read(ws_ / "g" / "u" / "e" / "logs" / "pre_trainer" / "rank-0" / "warning.log");
  EXPECT_NE(warnings.find("received SIGTERM"), std::string::npos);
  // Every metrics line is complete JSON.
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) EXPECT_NO_THROW(nlohmann::json::parse(line)) << line;
}

}  // namespace
