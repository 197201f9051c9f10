// Data-parallel trainers on the CPU backend, their ranks as threads (LocalCommunicator): a
// ZeRO-1 run saves sharded checkpoints, and resuming from one continues it at 2 ranks bitwise
// and at 1 and 3 ranks up to the order of fp32 gradient sums; a whole (1-rank) checkpoint
// resumes a ZeRO-1 run the same way; plain data parallelism saves a whole checkpoint once;
// overlapping the ZeRO-1 parameter gather with the forward changes no bit; FSDP trains like
// one rank, with a tied or untied head, and its checkpoints hold the whole model and resume on
// any world size.
#include <cmath>
#include <map>
#include <memory>
#include <mutex>

#include <nlohmann/json.hpp>

#include "ckpt_test_util.h"
#include "tessera/ckpt/checkpoint.h"
#include "tessera/distributed/local_communicator.h"
#include "tessera/obs/metrics.h"

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
const std::string kFsdp = "use_torch_fsdp2: true\n";

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
  std::mutex params_mutex;
  dist::run_local_ranks(world, [&](int rank, dist::Communicator& comm) {
    Logger log("", rank, false, false);
    std::unique_ptr<MetricsWriter> metrics;
    if (rank == 0) metrics = std::make_unique<MetricsWriter>(metrics_path.string());
    Trainer trainer(e, make_cpu_backend(), log, metrics.get(), world > 1 ? &comm : nullptr);
    trainer.train();
    // The ranks' master weights (fp32 on the CPU, so the weights), each at its offsets.
    AdamWOptimizer& opt = trainer.optimizer();
    const int64_t total = trainer.model().layout().total;
    const std::vector<ParamRange> owned =
        opt.sharded() ? opt.owned() : std::vector<ParamRange>{{0, total}};
    const std::vector<float> master = download(trainer.backend(), opt.master());
    std::lock_guard lock(params_mutex);
    run.params.resize(total);
    int64_t at = 0;
    for (const ParamRange& r : owned) {
      std::copy_n(master.begin() + at, r.count(), run.params.begin() + r.begin);
      at += r.count();
    }
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

// Every loss `run` logged and its final weights match `reference` (bitwise for tolerance 0).
void expect_same_run(const TrainingRun& run, const TrainingRun& reference, double tolerance,
                     const std::string& what) {
  for (const auto& [it, loss] : run.losses) {
    ASSERT_TRUE(reference.losses.count(it)) << what << " iteration " << it;
    const double expected = reference.losses.at(it);
    EXPECT_LE(std::abs(loss - expected), tolerance * expected)
        << what << " iteration " << it << ": " << loss << " vs " << expected;
  }
  ASSERT_EQ(run.params.size(), reference.params.size()) << what;
  EXPECT_LE(relative_difference(run.params, reference.params), tolerance) << what;
}

// `resumed` ran iterations 4..6 of `straight` from its checkpoint at iteration 3 and ended
// with the same losses and weights (bitwise for tolerance 0).
void expect_continues(const TrainingRun& resumed, const TrainingRun& straight, double tolerance,
                      const std::string& what) {
  ASSERT_EQ(resumed.losses.size(), 3u) << what;
  expect_same_run(resumed, straight, tolerance, what);
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
  const TrainingRun overlapped = train(
      experiment(dir.path(), 2, kZero1 + overlap + saving(dir / "save")), 2, dir / "overlap.jsonl");
  ASSERT_EQ(overlapped.losses, plain.losses);
  EXPECT_EQ(overlapped.params, plain.params);
  const std::string load = "load: " + (dir / "save" / "iter_0000003").string() + "\n";
  expect_continues(
      train(experiment(dir.path(), 2, kZero1 + overlap + load), 2, dir / "resumed.jsonl"), plain,
      0.0, "resumed with overlap");
}

// FSDP gathers parameters and reduce-scatters gradients unit by unit and adds each
// micro-batch's gradients to its shards (3 and 2 accumulation steps here): it trains like one
// rank up to the order of fp32 sums, also when the head shares the embedding's unit.
TEST(DataParallelResume, FsdpTrainsLikeOneRankWithTiedAndUntiedHeads) {
  ScratchDir dir;
  for (const std::string head : {"", "untie_embeddings_and_output_weights: false\n"}) {
    const std::string what = head.empty() ? "untied" : "tied";
    const TrainingRun one = train(experiment(dir.path(), 1, head), 1, dir / (what + "1.jsonl"));
    ASSERT_EQ(one.losses.size(), 6u);
    for (int world : {2, 3}) {
      const TrainingRun fsdp = train(experiment(dir.path(), world, kFsdp + head), world,
                                     dir / (what + std::to_string(world) + ".jsonl"));
      ASSERT_EQ(fsdp.losses.size(), 6u);
      expect_same_run(fsdp, one, kRelativeTolerance,
                      what + " head, FSDP at " + std::to_string(world));
    }
  }
}

// Rank 0 writes model.safetensors from units gathered from every rank, each rank its optimizer
// shard; the checkpoint resumes FSDP at 2 ranks bitwise, and 1 rank, ZeRO-1 and FSDP at 3.
TEST(DataParallelResume, FsdpCheckpointHoldsTheWholeModelAndResumesOnAnyWorldSize) {
  ScratchDir dir;
  const fs::path save = dir / "fsdp";
  const TrainingRun straight =
      train(experiment(dir.path(), 2, kFsdp + saving(save)), 2, dir / "straight.jsonl");
  ASSERT_EQ(straight.losses.size(), 6u);
  const SafetensorsFile model((save / "iter_0000006" / "model.safetensors").string());
  const Checkpoint last((save / "iter_0000006").string());
  EXPECT_TRUE(last.sharded());
  for (const ParamInfo& p : last.layout().params) {
    const std::vector<float> stored = model.to_float(p.name);
    ASSERT_EQ(static_cast<int64_t>(stored.size()), p.numel()) << p.name;
    EXPECT_TRUE(std::equal(stored.begin(), stored.end(), straight.params.begin() + p.offset))
        << p.name << " in model.safetensors differs from the final weights";
  }

  const std::string load = "load: " + (save / "iter_0000003").string() + "\n";
  expect_continues(train(experiment(dir.path(), 2, kFsdp + load), 2, dir / "two.jsonl"), straight,
                   0.0, "2 FSDP ranks");
  expect_continues(train(experiment(dir.path(), 1, load), 1, dir / "one.jsonl"), straight,
                   kRelativeTolerance, "1 rank");
  expect_continues(train(experiment(dir.path(), 3, kZero1 + load), 3, dir / "zero.jsonl"), straight,
                   kRelativeTolerance, "3 ZeRO-1 ranks");
  expect_continues(train(experiment(dir.path(), 3, kFsdp + load), 3, dir / "three.jsonl"), straight,
                   kRelativeTolerance, "3 FSDP ranks");
}

}  // namespace
}  // namespace tessera::testing
