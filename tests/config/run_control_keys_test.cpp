// Validation of the run-control and TensorBoard keys: train_samples becomes train_iters while
// loading (a consistent train_iters may stay, a different one is an error naming both), and
// every bad value is a ConfigError naming its key.
#include <string>

#include <gtest/gtest.h>

#include "common/experiment_yaml.h"
#include "tessera/core/error.h"

namespace tessera {
namespace {

constexpr const char* kTiny =
    "model: tiny_llama\nmock_data: true\nmicro_batch_size: 2\nglobal_batch_size: 4\n";

Experiment load(const std::string& lines) {
  return testing::experiment_from_yaml(std::string(kTiny) + lines);
}

// The key a ConfigError names and its message; "" when the experiment loads.
std::pair<std::string, std::string> error_of(const std::string& lines) {
  try {
    load(lines);
  } catch (const ConfigError& e) {
    return {e.key(), e.what()};
  }
  return {"", ""};
}

TEST(TrainSamplesKey, BecomesTrainItersRoundedDown) {
  const Experiment e = load("train_samples: 22\n");  // train_iters left at its default
  EXPECT_EQ(e.training.train_iters, 5);
  EXPECT_EQ(e.origin.at("train_iters"), e.origin.at("train_samples"));
  EXPECT_EQ(load("train_iters: 0\ntrain_samples: 24\n").training.train_iters, 6);
  EXPECT_EQ(load("train_iters: 6\ntrain_samples: 24\n").training.train_iters, 6);  // agree
  EXPECT_EQ(load("train_iters: 7\n").training.train_iters, 7);  // no train_samples: unchanged
}

TEST(TrainSamplesKey, MistakesNameTrainSamples) {
  auto [key, message] = error_of("train_iters: 7\ntrain_samples: 24\n");
  EXPECT_EQ(key, "train_samples");
  EXPECT_NE(message.find("train_samples / global_batch_size = 6 iterations, but train_iters is 7"),
            std::string::npos)
      << message;
  std::tie(key, message) = error_of("train_samples: 3\n");
  EXPECT_EQ(key, "train_samples");
  EXPECT_NE(message.find("at least global_batch_size (4)"), std::string::npos) << message;
  std::tie(key, message) = error_of("train_samples: 8\nlr_warmup_iters: 3\n");
  EXPECT_EQ(key, "train_samples");
  EXPECT_NE(message.find("at least lr_warmup_iters x global_batch_size = 3 x 4 = 12"),
            std::string::npos)
      << message;
  EXPECT_EQ(error_of("train_samples: -4\n").first, "train_samples");
  // lr_decay_iters (iterations) may still set the end of the decay; the warm-up is checked
  // against it then.
  EXPECT_EQ(error_of("train_samples: 8\nlr_warmup_iters: 3\nlr_decay_iters: 5\n").first, "");
  std::tie(key, message) = error_of("train_iters: 0\n");
  EXPECT_EQ(key, "train_iters");
  EXPECT_NE(message.find("0 only with train_samples set"), std::string::npos) << message;
}

TEST(RunControlKeys, BadValuesNameTheirKey) {
  EXPECT_EQ(error_of("exit_interval: -1\n").first, "exit_interval");
  EXPECT_EQ(error_of("exit_duration_in_mins: -0.5\n").first, "exit_duration_in_mins");
  EXPECT_EQ(error_of("exit_interval: 3\nexit_duration_in_mins: 0.5\n").first, "");
  EXPECT_EQ(error_of("skip_train: true\neval_iters: 0\n").first, "eval_iters");
  EXPECT_EQ(error_of("skip_train: true\n").first, "");  // needs no eval_interval
  EXPECT_EQ(error_of("tensorboard_log_interval: 0\n").first, "tensorboard_log_interval");
  EXPECT_EQ(error_of("tensorboard_log_interval: 5\nlog_memory_to_tensorboard: true\n").first, "");
}

TEST(TensorboardDirKey, RelativeLiesUnderTheExperimentRoot) {
  Experiment e = load("workspace: /w\nwork_group: g\nuser_name: u\nexp_name: e\n");
  EXPECT_EQ(e.tensorboard_directory(), "");
  e.logging.tensorboard_dir = "tensorboard";
  EXPECT_EQ(e.tensorboard_directory(), "/w/g/u/e/tensorboard");
  e.logging.tensorboard_dir = "/runs/tb";
  EXPECT_EQ(e.tensorboard_directory(), "/runs/tb");
}

}  // namespace
}  // namespace tessera
