// Checkpoints and Hugging Face directories a careless or hostile user hands over, through the
// real binary: JSON of the wrong shape or type, counters out of range, a tracker beyond any
// iteration, overlapping tensor data, a config.json that does not describe its weights,
// non-finite weights. Each is refused by every command that reads it (train --load,
// convert --from, generate --from; convert --from-hf, hf_init_path) with exit 3 and a message
// naming the file, the field and what was expected, the previous good checkpoint offered where
// there is one, and nothing written: no experiment directory, no pruned checkpoint, no output.
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>

#include <nlohmann/json.hpp>

#include "ckpt/ckpt_test_util.h"
#include "common/tiny_run.h"

namespace tessera::testing {
namespace {

using Clock = std::chrono::steady_clock;

// A save directory of the tiny run with checkpoints at iterations 2 and 4 (the issue's
// ckpt_base), made once per test.
fs::path make_base(const ScratchDir& dir) {
  const fs::path base = dir / "base";
  const RunResult r = run_tessera(tiny_args(dir / "ws", "base") +
                                  " --train_iters 4 --save_interval 2 --save " + base.string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return base;
}

// A copy of `base` at `name` with iter_0000004/trainer_state.json edited.
fs::path with_state(const ScratchDir& dir, const fs::path& base, const std::string& name,
                    const std::function<void(nlohmann::json&)>& edit) {
  const fs::path copy = dir / name;
  fs::remove_all(copy);
  fs::copy(base, copy, fs::copy_options::recursive);
  const fs::path state = copy / "iter_0000004" / "trainer_state.json";
  nlohmann::json j = nlohmann::json::parse(read_file(state));
  edit(j);
  write_file(state, j.dump());
  return copy;
}

// Rewrites a safetensors file's header with `edit` and keeps its data bytes as they are.
void edit_header(const fs::path& file, const std::function<void(nlohmann::json&)>& edit) {
  const std::string bytes = read_file(file);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  nlohmann::ordered_json header = nlohmann::ordered_json::parse(bytes.substr(8, n));
  nlohmann::json plain = header;
  edit(plain);
  std::string text = plain.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t length = text.size();
  write_file(file,
             std::string(reinterpret_cast<const char*>(&length), 8) + text + bytes.substr(8 + n));
}

// What `train --load` (resuming into the same directory), `convert --from` and
// `generate --from` say of save directory `save`; each must exit 3 and write nothing.
struct Refusals {
  std::string train, convert, generate;
};
Refusals refusals(const ScratchDir& dir, const fs::path& save) {
  const auto before = listing(save);
  Refusals out;
  RunResult r = run_tessera(tiny_args(dir / "ws", "resume") + " --train_iters 6 --save " +
                            save.string() + " --load " + save.string() + " --ckpt_keep_last 1");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  out.train = r.output;
  r = run_tessera("convert --from " + save.string() + " --to-hf " + (dir / "hf_out").string());
  EXPECT_EQ(r.exit_code, 3) << r.output;
  out.convert = r.output;
  r = run_tessera("generate --from " + save.string() + " --prompt_ids '1 2' --max_new_tokens 1");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  out.generate = r.output;
  EXPECT_FALSE(fs::exists(dir / "ws" / "g" / "u" / "resume")) << "the refused run wrote";
  EXPECT_FALSE(fs::exists(dir / "hf_out"));
  EXPECT_EQ(listing(save), before) << "a checkpoint was written or pruned";
  return out;
}

TEST(HostileCheckpoints, TrainerStateOfTheWrongShapeIsRefusedByEveryReader) {
  ScratchDir dir;
  const fs::path base = make_base(dir);
  for (const std::string text : {"null", "[1,2,3]", "\"text\"", "42"}) {
    SCOPED_TRACE(text);
    const fs::path save = dir / "damaged";
    fs::remove_all(save);
    fs::copy(base, save, fs::copy_options::recursive);
    write_file(save / "iter_0000004" / "trainer_state.json", text);
    const std::string says = (save / "iter_0000004" / "trainer_state.json").string() +
                             ": the document is " + text + "; expected a JSON object";
    const Refusals r = refusals(dir, save);
    EXPECT_TRUE(contains(r.train, says)) << r.train;
    EXPECT_TRUE(contains(r.train, "The previous complete checkpoint is " +
                                      (save / "iter_0000002").string() +
                                      " (iteration 2): resume from it with --load"))
        << r.train;
    EXPECT_TRUE(contains(r.convert, says)) << r.convert;
    EXPECT_TRUE(contains(r.generate, says)) << r.generate;
  }
}

TEST(HostileCheckpoints, FieldsOfTheWrongTypeOrOutOfRangeAreNamedWithWhatWasExpected) {
  ScratchDir dir;
  const fs::path base = make_base(dir);
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    std::string says;
  } cases[] = {
      {[](auto& j) { j["applied_steps"] = 1e300; },
       "field 'applied_steps' is 1e+300; expected an integer in [0, 4]"},
      {[](auto& j) { j["iteration"] = -3; },
       "field 'iteration' is -3; expected an integer in [0, 2^53]"},
      {[](auto& j) { j["iteration"] = uint64_t{9223372036854775813ull}; },
       "field 'iteration' is 9223372036854775813; expected an integer in [0, 2^53]"},
      {[](auto& j) { j["skipped_iterations"] = 5; },
       "field 'skipped_iterations' is 5; expected an integer in [0, 4]"},
      {[](auto& j) { j["consumed_samples"] = "many"; },
       "field 'consumed_samples' is \"many\"; expected an integer in [0, 2^53]"},
      {[](auto& j) { j["seed"] = nullptr; }, "field 'seed' is null; expected an integer"},
      {[](auto& j) { j.erase("weights_dtype"); }, "field 'weights_dtype' is missing"},
      {[](auto& j) { j["files"]["../../escape.safetensors"] = 8; },
       "field 'files' is \"../../escape.safetensors\"; expected names of files in the "
       "checkpoint directory itself"},
      {[](auto& j) { j["model"]["hidden_size"] = "32"; },
       "field 'model.hidden_size' is \"32\"; expected an integer in [1, 1048576]"},
      {[](auto& j) { j["model"]["num_layers"] = 1000000000; },
       "field 'model.num_layers' is 1000000000; expected an integer in [1, 65536]"},
      {[](auto& j) { j["model"]["tied_embeddings"] = 1; },
       "field 'model.tied_embeddings' is 1; expected true or false"},
  };
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.says);
    const fs::path save = with_state(dir, base, "damaged" + std::to_string(n++), c.edit);
    const Refusals r = refusals(dir, save);
    const std::string file = (save / "iter_0000004" / "trainer_state.json").string();
    EXPECT_TRUE(contains(r.train, file + ": " + c.says)) << r.train;
    EXPECT_TRUE(contains(r.train, "The previous complete checkpoint is")) << r.train;
    EXPECT_TRUE(contains(r.convert, file + ": " + c.says)) << r.convert;
    EXPECT_TRUE(contains(r.generate, file + ": " + c.says)) << r.generate;
    fs::remove_all(save);
  }
}

TEST(HostileCheckpoints, ATrackerBeyondAnyIterationNamesTheNewestCheckpoint) {
  ScratchDir dir;
  const fs::path save = dir / "save";
  fs::copy(make_base(dir), save, fs::copy_options::recursive);
  write_file(save / "latest_checkpointed_iteration.txt", "99999999999999999999999\n");
  const Refusals r = refusals(dir, save);
  const std::string says = (save / "latest_checkpointed_iteration.txt").string() +
                           ": expected the iteration number of the latest checkpoint, found "
                           "'99999999999999999999999' (an iteration is an integer from 0 to 2^53)";
  EXPECT_TRUE(contains(r.train, says)) << r.train;
  EXPECT_TRUE(
      contains(r.train, "The newest checkpoint directory is " + (save / "iter_0000004").string()))
      << r.train;
  EXPECT_TRUE(contains(r.convert, says)) << r.convert;
  EXPECT_TRUE(contains(r.generate, says)) << r.generate;

  // A directory named beyond any iteration is no checkpoint, and nothing stumbles on it.
  write_file(save / "latest_checkpointed_iteration.txt", "4\n");
  fs::create_directories(save / "iter_99999999999999999999999");
  const RunResult resumed = run_tessera(tiny_args(dir / "ws", "base") + " --train_iters 6 --save " +
                                        save.string() + " --load " + save.string());
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(fs::exists(save / "iter_0000006"));
}

TEST(HostileCheckpoints, ATruncatedFileOffersThePreviousCompleteCheckpoint) {
  ScratchDir dir;
  const fs::path save = dir / "save";
  fs::copy(make_base(dir), save, fs::copy_options::recursive);
  const fs::path optimizer = save / "iter_0000004" / "optimizer.safetensors";
  fs::resize_file(optimizer, fs::file_size(optimizer) / 2);
  const auto before = listing(save);
  const std::string previous = (save / "iter_0000002").string();
  RunResult r = run_tessera(tiny_args(dir / "ws", "base") + " --train_iters 6 --save " +
                            save.string() + " --load " + save.string());
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(contains(r.output, optimizer.string() + ": " +
                                     std::to_string(fs::file_size(optimizer)) + " bytes, expected"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "The previous complete checkpoint is " + previous +
                                     " (iteration 2): resume from it with --load " + previous))
      << r.output;
  EXPECT_EQ(listing(save), before);
  // The offered checkpoint resumes.
  r = run_tessera(tiny_args(dir / "ws", "base") + " --train_iters 3 --load " + previous);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from " + previous + " at iteration 2")) << r.output;
}

// The format forbids tensors that share bytes: layer 1's master weights read from layer 0's
// bytes used to load, and training went on with wrong weights.
TEST(HostileCheckpoints, OverlappingTensorDataIsRefused) {
  ScratchDir dir;
  const fs::path save = dir / "save";
  fs::copy(make_base(dir), save, fs::copy_options::recursive);
  const fs::path optimizer = save / "iter_0000004" / "optimizer.safetensors";
  edit_header(optimizer, [](nlohmann::json& h) {
    h["master.model.layers.1.mlp.down_proj.weight"]["data_offsets"] =
        h["master.model.layers.0.mlp.down_proj.weight"]["data_offsets"];
  });
  nlohmann::json state =
      nlohmann::json::parse(read_file(save / "iter_0000004" / "trainer_state.json"));
  state["files"]["optimizer.safetensors"] = fs::file_size(optimizer);
  write_file(save / "iter_0000004" / "trainer_state.json", state.dump());
  const Refusals r = refusals(dir, save);
  for (const std::string& out : {r.train, r.convert, r.generate}) {
    EXPECT_TRUE(contains(out, optimizer.string() + ": tensor '")) << out;
    EXPECT_TRUE(contains(out,
                         "expected the tensors' data_offsets to tile the data region "
                         "exactly"))
        << out;
  }
  EXPECT_TRUE(contains(r.train, "The previous complete checkpoint is")) << r.train;
}

// A Hugging Face directory: `convert --from-hf` and hf_init_path check config.json against
// the weights before building anything from it.
class HostileHfModels : public ::testing::Test {
 protected:
  void SetUp() override {
    const fs::path base = make_base(dir_);
    const RunResult r = run_tessera("convert --from " + base.string() + " --to-hf " + hf_.string() +
                                    " --dtype fp32");
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  // A copy of the exported model with config.json edited.
  fs::path with_config(const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    const fs::path copy = dir_ / name;
    fs::copy(hf_, copy, fs::copy_options::recursive);
    nlohmann::json j = nlohmann::json::parse(read_file(copy / "config.json"));
    edit(j);
    write_file(copy / "config.json", j.dump());
    return copy;
  }
  // convert --from-hf: exit 3, `says`, no output; quickly, allocating nothing large.
  void expect_refused(const fs::path& model, const std::string& says) {
    const auto start = Clock::now();
    const RunResult r =
        run_tessera("convert --from-hf " + model.string() + " --to " + (dir_ / "out").string());
    EXPECT_EQ(r.exit_code, 3) << r.output;
    EXPECT_TRUE(contains(r.output, says)) << r.output;
    EXPECT_FALSE(fs::exists(dir_ / "out"));
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 10.0);
  }
  ScratchDir dir_;
  fs::path hf_ = dir_ / "hf";
};

TEST_F(HostileHfModels, ConfigJsonIsCheckedAgainstTheWeightsBeforeAnythingIsBuilt) {
  expect_refused(with_config("huge", [](auto& j) { j["num_hidden_layers"] = 1000000000; }),
                 "config.json: field 'num_hidden_layers' is 1000000000; expected an integer in "
                 "[1, 65536]");
  expect_refused(with_config("more", [](auto& j) { j["num_hidden_layers"] = 60000; }),
                 "config.json: num_hidden_layers is 60000, but the weights hold layers 0 to 1 "
                 "(model.layers.N.*)");
  expect_refused(with_config("string", [](auto& j) { j["hidden_size"] = "32"; }),
                 "config.json: field 'hidden_size' is \"32\"; expected an integer in [1, "
                 "1048576]");
  expect_refused(with_config("rope",
                             [](auto& j) {
                               j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", "eight"}};
                             }),
                 "config.json: field 'rope_scaling.factor' is \"eight\"; expected a finite number");
  expect_refused(with_config("bias", [](auto& j) { j["attention_bias"] = "no"; }),
                 "config.json: field 'attention_bias' is \"no\"; expected true or false");

  // Tensors that share bytes, as in a checkpoint.
  const fs::path overlap = with_config("overlap", [](auto&) {});
  edit_header(overlap / "model.safetensors", [](nlohmann::json& h) {
    h["model.layers.1.mlp.down_proj.weight"]["data_offsets"] =
        h["model.layers.0.mlp.down_proj.weight"]["data_offsets"];
  });
  expect_refused(overlap, "expected the tensors' data_offsets to tile the data region exactly");
}

TEST_F(HostileHfModels, NonFiniteWeightsAreBlamedOnTheWeights) {
  // A NaN in one tensor: refused when it is read, naming the tensor.
  const fs::path nan = with_config("nan", [](auto&) {});
  std::string bytes = read_file(nan / "model.safetensors");
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
  ASSERT_EQ(header["model.layers.0.self_attn.q_proj.weight"]["dtype"], "F32");
  const size_t offset =
      8 + n + header["model.layers.0.self_attn.q_proj.weight"]["data_offsets"][0].get<size_t>();
  const float not_a_number = std::numeric_limits<float>::quiet_NaN();
  bytes.replace(offset + 3 * sizeof(float), sizeof(float),
                reinterpret_cast<const char*>(&not_a_number), sizeof(float));
  write_file(nan / "model.safetensors", bytes);
  RunResult r = run_tessera(tiny_args(dir_ / "ws", "nan") + " --train_iters 2 --hf_init_path " +
                            nan.string());
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "tensor 'model.layers.0.self_attn.q_proj.weight' holds 1 "
                       "non-finite values (the first, nan, at element 3); expected "
                       "finite weights"))
      << r.output;
  EXPECT_FALSE(contains(r.output, "Lower lr")) << r.output;

  // Finite weights so large that the first forward pass overflows: no update was applied, so
  // the hint names the weights, not the learning rate.
  const fs::path huge = with_config("huge", [](auto&) {});
  bytes = read_file(huge / "model.safetensors");
  const float big = 3e38f;
  for (const auto& [name, t] : header.items()) {
    if (name == "__metadata__") continue;
    for (size_t b = t["data_offsets"][0].get<size_t>(); b < t["data_offsets"][1].get<size_t>();
         b += sizeof(float))
      bytes.replace(8 + n + b, sizeof(float), reinterpret_cast<const char*>(&big), sizeof(float));
  }
  write_file(huge / "model.safetensors", bytes);
  r = run_tessera(tiny_args(dir_ / "ws", "huge") +
                  " --train_iters 4 --max_consecutive_nan_iters 2 --hf_init_path " + huge.string());
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "No update was applied yet, so the learning rate is not the "
                       "cause: the starting weights (the Hugging Face model at "
                       "hf_init_path " +
                           huge.string() + ") give a non-finite loss or gradient"))
      << r.output;
}

}  // namespace
}  // namespace tessera::testing
