// Data-parallel trainers on the CPU backend, their ranks as threads (thread_ranks.h): a
// ZeRO-1 run saves sharded checkpoints, and resuming from one continues it at 2 ranks bitwise
// and at 1 and 3 ranks up to the order of fp32 gradient sums; a whole (1-rank) checkpoint
// resumes a ZeRO-1 run the same way; plain data parallelism saves a whole checkpoint once;
// overlapping the ZeRO-1 parameter gather with the forward changes no bit.
#include <cmath>
#include <map>
#include <memory>

#include <nlohmann/json.hpp>

#include "ckpt_test_util.h"
#include "tessera/ckpt/checkpoint.h"
#include "tessera/obs/metrics.h"
#include "thread_ranks.h"

namespace tessera::testing {
namespace {

// At another world size gradients are summed in another order: measured, the weights after
// 3 more iterations differ by ~5e-9 (relative L2) and the losses by ~1e-7, while those 3
// iterations move the weights by ~3e-2, so a resume from wrong state cannot pass.
constexpr double kRelativeTolerance = 1e-6;

using Losses = std::map<int64_t, double>;

struct TrainingRun {
  Losses losses;              // rank 0's metrics, by iteration
  std::vector<float> params;  // rank 0's weights at the end (every rank's are the same)
};

const std::string kZero1 = "use_distributed_optimizer: true\n";

// One micro-batch per rank and step at 1, 2 and 3 ranks (6, 3 and 2 accumulation steps);
// small buckets, so each ZeRO-1 rank owns many interleaved ranges.
Experiment experiment(const fs::path& dir, int world, const std::string& extra) {
  return tiny_experiment(dir,
                         "micro_batch_size: 1\nglobal_batch_size: 6\ntrain_iters: 6\n"
                         "ddp_bucket_size: 1000\n" +
                             extra,
                         kMockData, world);
}

std::string saving(const fs::path& save) {
  return "save: " + save.string() + "\nsave_interval: 3\nckpt_keep_last: 0\n";
}

// train() on `world` ranks.
TrainingRun train(const Experiment& e, int world, const fs::path& metrics_path) {
  TrainingRun run;
  run_ranks(world, [&](int rank, dist::Communicator& comm) {
    Logger log("", rank, false, false);
    std::unique_ptr<MetricsWriter> metrics;
    if (rank == 0) metrics = std::make_unique<MetricsWriter>(metrics_path.string());
    Trainer trainer(e, make_cpu_backend(), log, metrics.get(), world > 1 ? &comm : nullptr);
    trainer.train();
    if (rank == 0) run.params = download(trainer.backend(), trainer.model().params());
  });
  std::ifstream in(metrics_path);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("lm_loss"))
      run.losses[j["iteration"].get<int64_t>()] = j["lm_loss"].get<double>();
  }
  return run;
}

double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

// `resumed` ran iterations 4..6 of `straight` from its checkpoint at iteration 3 and ended
// with the same losses and weights (bitwise for tolerance 0).
void expect_continues(const TrainingRun& resumed, const TrainingRun& straight, double tolerance,
                      const std::string& what) {
  ASSERT_EQ(resumed.losses.size(), 3u) << what;
  for (const auto& [it, loss] : resumed.losses) {
    ASSERT_TRUE(straight.losses.count(it)) << what << " iteration " << it;
    const double expected = straight.losses.at(it);
    EXPECT_LE(std::abs(loss - expected), tolerance * expected)
        << what << " iteration " << it << ": " << loss << " vs " << expected;
  }
  EXPECT_LE(relative_difference(resumed.params, straight.params), tolerance) << what;
}

TEST(DataParallelResume, ShardedCheckpointContinuesAtTwoRanksBitwiseAndAtOneAndThreeRanks) {
  ScratchDir dir;
  const fs::path save = dir / "zero";
  const TrainingRun straight =
      train(experiment(dir.path(), 2, kZero1 + saving(save)), 2, dir / "straight.jsonl");
  ASSERT_EQ(straight.losses.size(), 6u);
  const fs::path ckpt = save / "iter_0000003";
  for (const char* shard :
       {"optimizer.rank00000-of-00002.safetensors", "optimizer.rank00001-of-00002.safetensors"})
    EXPECT_TRUE(fs::exists(ckpt / shard)) << shard;
  EXPECT_FALSE(fs::exists(ckpt / "optimizer.safetensors"));
  EXPECT_EQ(read_file(save / "latest_checkpointed_iteration.txt"), "6\n");

  const std::string load = "load: " + ckpt.string() + "\n";
  expect_continues(train(experiment(dir.path(), 2, kZero1 + load), 2, dir / "two.jsonl"), straight,
                   0.0, "2 ranks");
  expect_continues(train(experiment(dir.path(), 1, load), 1, dir / "one.jsonl"), straight,
                   kRelativeTolerance, "1 rank");
  expect_continues(train(experiment(dir.path(), 3, kZero1 + load), 3, dir / "three.jsonl"),
                   straight, kRelativeTolerance, "3 ranks");
}

TEST(DataParallelResume, WholeCheckpointContinuesAtTwoZero1Ranks) {
  ScratchDir dir;
  const fs::path save = dir / "one";
  const TrainingRun straight =
      train(experiment(dir.path(), 1, saving(save)), 1, dir / "straight.jsonl");
  ASSERT_TRUE(fs::exists(save / "iter_0000003" / "optimizer.safetensors"));
  const std::string load = "load: " + (save / "iter_0000003").string() + "\n";
  expect_continues(train(experiment(dir.path(), 2, kZero1 + load), 2, dir / "two.jsonl"), straight,
                   kRelativeTolerance, "2 ZeRO-1 ranks");
}

TEST(DataParallelResume, PlainDataParallelSavesOneWholeCheckpoint) {
  ScratchDir dir;
  const fs::path save = dir / "dp";
  const TrainingRun straight =
      train(experiment(dir.path(), 2, saving(save)), 2, dir / "straight.jsonl");
  const fs::path ckpt = save / "iter_0000003";
  const Checkpoint c(ckpt.string());
  EXPECT_FALSE(c.sharded());
  EXPECT_EQ(c.state().world_size, 2);
  expect_continues(
      train(experiment(dir.path(), 2, "load: " + ckpt.string() + "\n"), 2, dir / "two.jsonl"),
      straight, 0.0, "2 ranks");
}

// overlap_param_gather changes when the ZeRO-1 parameter gather runs, not what it computes:
// with saving on (stop-signal agreement and barriers in the step) and without, the losses,
// the weights and the resumed run are bitwise those of the gather before the forward.
TEST(DataParallelResume, OverlappedParamGatherMatchesGatherBeforeTheForward) {
  ScratchDir dir;
  const std::string overlap = "overlap_param_gather: true\n";
  const TrainingRun plain = train(experiment(dir.path(), 2, kZero1), 2, dir / "plain.jsonl");
  const TrainingRun overlapped =
      train(experiment(dir.path(), 2, kZero1 + overlap + saving(dir / "save")), 2, dir / "overlap.jsonl");
  ASSERT_EQ(overlapped.losses, plain.losses);
  EXPECT_EQ(overlapped.params, plain.params);
  const std::string load = "load: " + (dir / "save" / "iter_0000003").string() + "\n";
  expect_continues(train(experiment(dir.path(), 2, kZero1 + overlap + load), 2, dir / "resumed.jsonl"),
                   plain, 0.0, "resumed with overlap");
}

}  // namespace
}  // namespace tessera::testing
