// Sharded (ZeRO-1) checkpoints on the CPU backend: the optimizers of 2 ranks, over the
// ranges of a BucketPlan, write their shards, which load exactly into 1, 2 and 3 ranks; a
// whole checkpoint loads into sharded ranks; missing shard files and ranges no shard holds
// are refused by name; a save killed before it was published is ignored.
#include <cstring>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ckpt_test_util.h"
#include "tessera/ckpt/checkpoint.h"
#include "tessera/core/error.h"
#include "tessera/distributed/data_parallel.h"
#include "tessera/model/decoder_model.h"
#include "tessera/ops/device_buffer.h"

namespace tessera::testing {
namespace {

// Small buckets, so each rank owns many ranges that interleave with the other ranks'.
constexpr int64_t kBucketElements = 1000;

// One rank's fp32 state in flat-buffer coordinates (the whole (P) buffers).
struct FlatStates {
  std::vector<float> master, exp_avg, exp_avg_sq;
  const std::vector<float>& operator[](FlatState s) const {
    return s == FlatState::Master ? master : s == FlatState::ExpAvg ? exp_avg : exp_avg_sq;
  }
};

constexpr FlatState kStates[] = {FlatState::Master, FlatState::ExpAvg, FlatState::ExpAvgSq};
const char* name(FlatState s) {
  return s == FlatState::Master ? "master" : s == FlatState::ExpAvg ? "exp_avg" : "exp_avg_sq";
}

// Rank `rank` of `world`, built as the trainer builds it: a model whose flat buffers are padded
// for the world size and an optimizer over the rank's owned ranges (all of them for world 1),
// plus one extra-state tensor standing in for the FP8 scaling state.
struct Rank {
  Rank(const ModelSpec& spec, const TrainingConfig& config, int rank, int world)
      : backend(make_cpu_backend()), spec(spec) {
    ModelRuntime rt;
    rt.seq_length = 16;
    rt.flat_buffer_multiple = dist::flat_buffer_multiple(world);
    model = std::make_unique<DecoderModel>(*backend, spec, rt);
    plan = dist::plan_buckets(model->layout().total, kBucketElements, world);
    std::vector<OwnedParams> owned;
    if (world > 1)
      for (const ParamRange& r : plan.owned(rank))
        owned.push_back({r, model->params().flat_range(r.begin, r.count()),
                         model->grads().flat_range(r.begin, r.count())});
    optimizer = std::make_unique<AdamWOptimizer>(*model, config, owned);
    extra_buffer = DeviceBuffer(*backend, 4 * sizeof(float), "extra state");
  }

  TrainingTensors tensors() const {
    TrainingTensors t;
    t.backend = backend.get();
    t.spec = &spec;
    t.layout = &model->layout();
    t.param = [m = model.get()](int index) { return m->param(index); };
    t.master = optimizer->master();
    t.exp_avg = optimizer->exp_avg();
    t.exp_avg_sq = optimizer->exp_avg_sq();
    t.extra_state = {{"fp8.test.scale", extra()}};
    if (optimizer->sharded()) t.owned = optimizer->owned();
    return t;
  }
  Tensor extra() const { return extra_buffer.tensor(DType::F32, {4}); }
  Tensor packed(FlatState s) const {
    return s == FlatState::Master   ? optimizer->master()
           : s == FlatState::ExpAvg ? optimizer->exp_avg()
                                    : optimizer->exp_avg_sq();
  }

  // Sets this rank's slices of the state from the whole buffers.
  void fill_from(const FlatStates& whole, const std::vector<float>& extra_values) {
    for (FlatState s : kStates) {
      int64_t at = 0;
      for (const ParamRange& r : optimizer->owned()) {
        backend->upload(packed(s).flat_range(at, r.count()), whole[s].data() + r.begin);
        at += r.count();
      }
    }
    backend->upload(extra(), extra_values.data());
  }

  // Every parameter element this rank holds equals the whole buffers' value, bit for bit.
  void expect_holds(const FlatStates& whole, const std::string& what) const {
    for (FlatState s : kStates) {
      const std::vector<float> got = download(*backend, packed(s));
      int64_t at = 0, mismatches = 0, checked = 0;
      for (const ParamRange& r : optimizer->owned()) {
        for (const ParamInfo& p : model->layout().params) {
          const int64_t lo = std::max(p.offset, r.begin),
                        hi = std::min(p.offset + p.numel(), r.end);
          for (int64_t i = lo; i < hi; ++i, ++checked)
            mismatches += std::memcmp(&got[at + i - r.begin], &whole[s][i], sizeof(float)) != 0;
        }
        at += r.count();
      }
      EXPECT_EQ(mismatches, 0) << what << " " << name(s) << ": " << mismatches << " of " << checked;
      EXPECT_GT(checked, 0) << what;
    }
  }

  std::unique_ptr<Backend> backend;
  const ModelSpec& spec;
  std::unique_ptr<Model> model;
  dist::BucketPlan plan;
  std::unique_ptr<AdamWOptimizer> optimizer;
  DeviceBuffer extra_buffer;
};

std::vector<std::unique_ptr<Rank>> make_ranks(const Trainer& reference, const Experiment& e,
                                              int world) {
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < world; ++r)
    ranks.push_back(std::make_unique<Rank>(reference.spec(), e.training, r, world));
  return ranks;
}

// What the trainer does on every rank: rank 0 begins, all write, rank 0 finishes (the
// barriers between the steps are the order of these calls).
std::string save_sharded(const std::vector<std::unique_ptr<Rank>>& ranks, const fs::path& save,
                         int64_t iteration) {
  const int world = static_cast<int>(ranks.size());
  TrainerState s;
  s.iteration = iteration;
  s.consumed_samples = 4 * static_cast<uint64_t>(iteration);
  s.applied_steps = iteration;
  s.seed = 1234;
  s.world_size = world;
  begin_sharded_checkpoint(save.string(), iteration);
  for (int r = 0; r < world; ++r)
    write_checkpoint_shard(save.string(), ranks[r]->tensors(), iteration, r, world);
  return finish_sharded_checkpoint(save.string(), ranks[0]->tensors(), s, world, 0);
}

TrainerState load_into(const std::vector<std::unique_ptr<Rank>>& ranks, const std::string& dir) {
  TrainerState s;
  for (const auto& rank : ranks) {
    std::vector<std::string> warnings;
    s = load_checkpoint(dir, rank->tensors(), &warnings);
    EXPECT_TRUE(warnings.empty()) << warnings.front();
  }
  return s;
}

class ShardedCheckpoint : public ::testing::Test {
 protected:
  // A trained state (2 AdamW steps: moments and master weights all non-trivial) as whole
  // buffers: what an unsharded run holds.
  void SetUp() override {
    experiment_ = tiny_experiment(dir_.path());
    reference_ = make_trainer(experiment_, log_);
    for (int i = 1; i <= 2; ++i) reference_->run_iteration(i);
    Backend& b = reference_->backend();
    whole_ = {download(b, reference_->optimizer().master()),
              download(b, reference_->optimizer().exp_avg()),
              download(b, reference_->optimizer().exp_avg_sq())};
    ASSERT_EQ(static_cast<int64_t>(whole_.master.size()), reference_->model().layout().total);
  }

  std::vector<std::unique_ptr<Rank>> ranks(int world) const {
    return make_ranks(*reference_, experiment_, world);
  }
  // The reference state saved by `world` ranks at `iteration`.
  std::string save_from_ranks(const fs::path& save, int world, int64_t iteration) const {
    const auto writers = ranks(world);
    for (const auto& w : writers) w->fill_from(whole_, extra_values_);
    return save_sharded(writers, save, iteration);
  }
  std::string load_error(const std::string& dir) const {
    try {
      load_into(ranks(3), dir);
    } catch (const DataError& e) {
      return e.what();
    }
    return "(no error)";
  }

  ScratchDir dir_;
  Logger log_{"", 0, false, false};
  Experiment experiment_;
  std::unique_ptr<Trainer> reference_;
  FlatStates whole_;
  const std::vector<float> extra_values_ = {0.5f, 2.0f, -3.25f, 1e-3f};
};

TEST_F(ShardedCheckpoint, TwoRanksShardsLoadExactlyIntoOneTwoAndThreeRanks) {
  const fs::path save = dir_ / "ckpt";
  const std::string path = save_from_ranks(save, 2, 7);
  EXPECT_EQ(path, (save / "iter_0000007").string());
  EXPECT_EQ(read_file(save / "latest_checkpointed_iteration.txt"), "7\n");
  EXPECT_FALSE(fs::exists(save / "iter_0000007.tmp"));
  EXPECT_FALSE(fs::exists(fs::path(path) / "optimizer.safetensors"));

  // trainer_state.json lists each rank's file with exactly the ranges the plan gave it.
  const auto j = nlohmann::json::parse(read_file(fs::path(path) / "trainer_state.json"));
  EXPECT_EQ(j["format_version"], 2);
  EXPECT_EQ(j["world_size"], 2);
  const auto writers = ranks(2);
  ASSERT_EQ(j["optimizer_shards"].size(), 2u);
  for (int r = 0; r < 2; ++r) {
    const auto& shard = j["optimizer_shards"][r];
    const std::string file = "optimizer.rank0000" + std::to_string(r) + "-of-00002.safetensors";
    EXPECT_EQ(shard["file"], file);
    EXPECT_EQ(j["files"][file], fs::file_size(fs::path(path) / file));
    const std::vector<ParamRange> owned = writers[r]->optimizer->owned();
    ASSERT_EQ(shard["ranges"].size(), owned.size()) << file;
    EXPECT_GT(owned.size(), 3u) << "expected several buckets";
    for (size_t k = 0; k < owned.size(); ++k) {
      EXPECT_EQ(shard["ranges"][k][0], owned[k].begin) << file << " range " << k;
      EXPECT_EQ(shard["ranges"][k][1], owned[k].end) << file << " range " << k;
    }
  }

  for (int world : {1, 2, 3}) {
    SCOPED_TRACE("loaded by " + std::to_string(world) + " ranks");
    const auto loaded = ranks(world);
    const TrainerState s = load_into(loaded, path);
    EXPECT_EQ(s.iteration, 7);
    EXPECT_EQ(s.consumed_samples, 28u);
    EXPECT_EQ(s.applied_steps, 7);
    EXPECT_EQ(s.world_size, 2);
    EXPECT_TRUE(s.extra_state_restored);
    for (int r = 0; r < world; ++r) {
      loaded[r]->expect_holds(whole_, "rank " + std::to_string(r));
      // Written once, by rank 0, and restored on every rank.
      EXPECT_EQ(download(*loaded[r]->backend, loaded[r]->extra()), extra_values_) << "rank " << r;
    }
  }

  // Readers of whole parameters (tessera convert) assemble them from the shards.
  const Checkpoint c(path);
  EXPECT_TRUE(c.sharded());
  for (const ParamInfo& p : reference_->model().layout().params) {
    const std::vector<float> expected(whole_.exp_avg_sq.begin() + p.offset,
                                      whole_.exp_avg_sq.begin() + p.offset + p.numel());
    EXPECT_EQ(c.exp_avg_sq(p), expected) << p.name;
  }
}

TEST_F(ShardedCheckpoint, WholeCheckpointLoadsIntoShardedRanks) {
  const fs::path save = dir_ / "ckpt";
  TrainerState s;
  s.iteration = 2;
  Rank whole(reference_->spec(), experiment_.training, 0, 1);
  whole.fill_from(whole_, extra_values_);
  const std::string path = save_checkpoint(save.string(), whole.tensors(), s, 0);
  const auto j = nlohmann::json::parse(read_file(fs::path(path) / "trainer_state.json"));
  EXPECT_EQ(j["format_version"], 1);  // earlier Tessera versions read unsharded checkpoints
  EXPECT_FALSE(j.contains("optimizer_shards"));
  for (int world : {2, 3}) {
    SCOPED_TRACE("loaded by " + std::to_string(world) + " ranks");
    const auto loaded = ranks(world);
    load_into(loaded, path);
    for (int r = 0; r < world; ++r) loaded[r]->expect_holds(whole_, "rank " + std::to_string(r));
  }
}

TEST_F(ShardedCheckpoint, MissingShardFileIsNamed) {
  const fs::path save = dir_ / "ckpt";
  save_from_ranks(save, 2, 2);
  const fs::path shard = save / "iter_0000002" / "optimizer.rank00001-of-00002.safetensors";
  const std::string bytes = std::to_string(fs::file_size(shard));
  fs::remove(shard);
  const std::string message = load_error((save / "iter_0000002").string());
  EXPECT_TRUE(contains(
      message, shard.string() + ": missing; trainer_state.json lists it with " + bytes + " bytes"))
      << message;
}

TEST_F(ShardedCheckpoint, RangesNoShardHoldsAreNamed) {
  const fs::path save = dir_ / "ckpt";
  const std::string path = save_from_ranks(save, 2, 2);
  const fs::path state = fs::path(path) / "trainer_state.json";
  nlohmann::json j = nlohmann::json::parse(read_file(state));
  auto& ranges = j["optimizer_shards"][1]["ranges"];
  const ParamRange dropped{ranges[1][0].get<int64_t>(), ranges[1][1].get<int64_t>()};
  ranges.erase(1);
  write_file(state, j.dump());
  // Named: the first parameter elements of the dropped range (it may start in the alignment
  // gap after a parameter, which holds no state).
  std::string missing;
  for (const ParamInfo& p : reference_->model().layout().params) {
    const int64_t lo = std::max(p.offset, dropped.begin);
    const int64_t hi = std::min(p.offset + p.numel(), dropped.end);
    if (lo >= hi) continue;
    missing = fmt::format("[{}, {}) (of {})", lo, hi, p.name);
    break;
  }
  const std::string message = load_error(path);
  EXPECT_TRUE(
      contains(message, state.string() + ": no optimizer shard holds flat elements " + missing +
                            "; expected the shards listed in optimizer_shards to cover every "
                            "parameter"))
      << message;
}

TEST_F(ShardedCheckpoint, SaveKilledBeforeItWasPublishedIsIgnoredAndReplaced) {
  const fs::path save = dir_ / "ckpt";
  save_from_ranks(save, 2, 1);
  // Iteration 2: rank 1 dies after rank 0 wrote its files; rank 0 never publishes.
  const auto writers = ranks(2);
  for (const auto& w : writers) w->fill_from(whole_, extra_values_);
  begin_sharded_checkpoint(save.string(), 2);
  write_checkpoint_shard(save.string(), writers[0]->tensors(), 2, 0, 2);
  ASSERT_TRUE(fs::exists(save / "iter_0000002.tmp" / "optimizer.rank00000-of-00002.safetensors"));
  EXPECT_EQ(find_latest_checkpoint(save.string()), (save / "iter_0000001").string());
  fs::remove(save / "latest_checkpointed_iteration.txt");  // and without the tracker
  EXPECT_EQ(find_latest_checkpoint(save.string()), (save / "iter_0000001").string());
  EXPECT_EQ(load_into(ranks(3), find_latest_checkpoint(save.string())).iteration, 1);

  // The next save of iteration 2, by 3 ranks, starts from an empty directory.
  write_file(save / "iter_0000002.tmp" / "optimizer.rank00002-of-00002.safetensors", "stale");
  const std::string path = save_from_ranks(save, 3, 2);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(path)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{
                       "model.safetensors", "optimizer.rank00000-of-00003.safetensors",
                       "optimizer.rank00001-of-00003.safetensors",
                       "optimizer.rank00002-of-00003.safetensors", "trainer_state.json"}));
  const auto loaded = ranks(2);
  EXPECT_EQ(load_into(loaded, path).iteration, 2);
  for (int r = 0; r < 2; ++r) loaded[r]->expect_holds(whole_, "rank " + std::to_string(r));
}

}  // namespace
}  // namespace tessera::testing
