#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include "common/experiment_yaml.h"

#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/core/error.h"
#include "tessera/train/lr_schedule.h"
#include "tessera/train/trainer.h"

namespace tessera {
namespace {


Experiment tiny_experiment(const std::string& extra = "") {
  return testing::experiment_from_yaml(
      "model: tiny_llama\nmock_data: true\nnum_layers: 2\nhidden_size: 32\n"
      "ffn_hidden_size: 48\nnum_attention_heads: 4\nnum_query_groups: 2\n"
      "vocab_size: 50\nseq_length: 16\nmicro_batch_size: 2\nglobal_batch_size: 4\n"
      "train_iters: 6\nlr: 0.01\nlr_warmup_iters: 2\n" +
      testing::overrides_yaml(extra));
}

TEST(LrSchedule, WarmupThenDecayToMin) {
  TrainingConfig t;
  t.lr = 1.0;
  t.min_lr = 0.1;
  t.lr_warmup_iters = 10;
  t.train_iters = 110;
  t.lr_decay_style = LrDecayStyle::Cosine;
  EXPECT_DOUBLE_EQ(learning_rate(t, 1), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(t, 10), 1.0);
  EXPECT_NEAR(learning_rate(t, 60), 0.55, 1e-12);  // halfway: (1 + 0.1) / 2
  EXPECT_NEAR(learning_rate(t, 110), 0.1, 1e-12);
  EXPECT_DOUBLE_EQ(learning_rate(t, 500), 0.1);
  t.lr_decay_style = LrDecayStyle::Linear;
  EXPECT_NEAR(learning_rate(t, 35), 1.0 - 0.25 * 0.9, 1e-12);
  t.lr_decay_style = LrDecayStyle::Constant;
  EXPECT_DOUBLE_EQ(learning_rate(t, 80), 1.0);
  t.lr_decay_iters = 60;  // decay ends before training does
  t.lr_decay_style = LrDecayStyle::Cosine;
  EXPECT_NEAR(learning_rate(t, 60), 0.1, 1e-12);
  EXPECT_DOUBLE_EQ(learning_rate(t, 61), 0.1);
}

std::vector<double> losses(const Experiment& e, int iters) {
  Logger log("", 0, false, false);
  Trainer trainer(e, make_cpu_backend(), log, nullptr);
  std::vector<double> out;
  for (int i = 1; i <= iters; ++i) out.push_back(trainer.run_iteration(i).loss);
  return out;
}

TEST(Trainer, SameSeedSameRunBitwise) {
  const Experiment e = tiny_experiment();
  const std::vector<double> a = losses(e, 4), b = losses(e, 4);
  EXPECT_EQ(a, b);
  const std::vector<double> c = losses(tiny_experiment("seed: 99\n"), 4);
  EXPECT_NE(a, c);
}

TEST(Trainer, NonFiniteIterationsAreSkippedThenTheRunStops) {
  const Experiment e = tiny_experiment("max_consecutive_nan_iters: 3\n");
  Logger log("", 0, false, false);
  Trainer trainer(e, make_cpu_backend(), log, nullptr);
  Backend& b = trainer.backend();
  const Tensor w = trainer.model().param(trainer.model().layout().final_norm);
  std::vector<float> good(w.numel());
  b.download(good.data(), w);
  std::vector<float> poisoned = good;
  poisoned[3] = std::numeric_limits<float>::quiet_NaN();
  b.upload(w, poisoned.data());
  std::vector<float> master_before(trainer.optimizer().master().numel());
  b.download(master_before.data(), trainer.optimizer().master());

  IterationStats s = trainer.run_iteration(1);
  EXPECT_TRUE(s.skipped);
  EXPECT_FALSE(std::isfinite(s.loss));
  // A skipped step leaves the weights (NaN included) exactly as they were.
  std::vector<float> master_after(master_before.size());
  b.download(master_after.data(), trainer.optimizer().master());
  EXPECT_EQ(0, std::memcmp(master_before.data(), master_after.data(), master_before.size() * 4));

  b.upload(w, good.data());  // the problem goes away: training resumes, the streak resets
  s = trainer.run_iteration(2);
  EXPECT_FALSE(s.skipped);
  EXPECT_TRUE(std::isfinite(s.loss));

  b.upload(w, poisoned.data());
  EXPECT_TRUE(trainer.run_iteration(3).skipped);
  EXPECT_TRUE(trainer.run_iteration(4).skipped);
  try {
    trainer.run_iteration(5);
    FAIL() << "expected the run to stop after 3 non-finite iterations in a row";
  } catch (const TrainingAborted& err) {
    EXPECT_NE(std::string(err.what()).find("3 iterations in a row"), std::string::npos) << err.what();
    EXPECT_EQ(err.exit_code(), kExitRuntimeFailure);
  }
}

TEST(Trainer, GradientAccumulationMatchesOneLargeMicroBatch) {
  // global batch 4 as 2 micro-batches of 2, or 1 micro-batch of 4: same samples, same mean.
  const std::vector<double> accumulated = losses(tiny_experiment(), 3);
  const std::vector<double> single = losses(tiny_experiment("micro_batch_size: 4\n"), 3);
  for (size_t i = 0; i < accumulated.size(); ++i)
    EXPECT_NEAR(accumulated[i], single[i], 1e-5 * std::abs(single[i])) << "iteration " << i + 1;
}

TEST(Trainer, OutOfMemoryNamesTheBreakdownAndTheFix) {
  // 2048 layers of width 4096 need far more than this machine's memory.
  const Experiment e = tiny_experiment("num_layers: 2048\nhidden_size: 4096\nffn_hidden_size: 14336\n"
                                       "num_attention_heads: 32\nnum_query_groups: 8\n");
  Logger log("", 0, false, false);
  try {
    Trainer trainer(e, make_cpu_backend(), log, nullptr);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& err) {
    const std::string m = err.what();
    for (const char* part : {"needs", "free", "weights", "gradients", "optimizer state", "activations",
                             "To fit"})
      EXPECT_NE(m.find(part), std::string::npos) << part << " missing from: " << m;
  }
}

}  // namespace
}  // namespace tessera
