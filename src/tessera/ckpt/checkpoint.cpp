#include "tessera/ckpt/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "tessera/ckpt/atomic_files.h"
#include "tessera/ckpt/model_spec_json.h"
#include "tessera/core/error.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

constexpr const char* kStateFile = "trainer_state.json";
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
// Optimizer tensors are named "{kind}.{parameter name}".
constexpr const char* kOptimizerKinds[] = {"master", "exp_avg", "exp_avg_sq"};

std::vector<int64_t> dims(const Shape& s) {
  std::vector<int64_t> d;
  for (int i = 0; i < s.rank(); ++i) d.push_back(s[i]);
  return d;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Iteration of a directory named iter_NNNNNNN; -1 for any other name (e.g. a .tmp dir).
int64_t iteration_of(const fs::path& dir) {
  static const std::regex kPattern("iter_([0-9]+)");
  std::smatch m;
  const std::string name = dir.filename().string();
  return std::regex_match(name, m, kPattern) ? std::stoll(m[1].str()) : -1;
}

// Complete checkpoint directories in `save_dir`, oldest first.
std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& save_dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(save_dir, ec)) {
    const int64_t it = iteration_of(e.path());
    if (it >= 0 && e.is_directory()) out.emplace_back(it, e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

fs::path normalized(const std::string& dir) {
  fs::path p = fs::path(dir).lexically_normal();
  return p.has_filename() ? p : p.parent_path();
}

struct FileToWrite {
  std::string name;
  std::vector<SafetensorsTensor> tensors;
  std::function<void(size_t, void*)> fill;
};

// Writes the files and trainer_state.json into a temp directory, publishes it under its
// final name, then points the tracker at it.
std::string write_checkpoint(const std::string& save_dir, const ModelSpec& spec,
                             DType weights_dtype, const TrainerState& s,
                             const std::vector<FileToWrite>& files) {
  fs::create_directories(save_dir);
  const fs::path final_dir = fs::path(save_dir) / checkpoint_dir_name(s.iteration);
  const fs::path tmp = final_dir.string() + ".tmp";
  fs::remove_all(tmp);  // left by a save that was killed
  fs::create_directories(tmp);
  try {
    nlohmann::ordered_json sizes;
    for (const auto& f : files) {
      write_safetensors((tmp / f.name).string(), f.tensors, {{"format", "pt"}}, f.fill);
      sizes[f.name] = fs::file_size(tmp / f.name);
    }
    nlohmann::ordered_json j;
    j["format"] = "tessera-checkpoint";
    j["format_version"] = kCheckpointFormatVersion;
    j["tessera_version"] = TESSERA_VERSION;
    j["iteration"] = s.iteration;
    j["consumed_samples"] = s.consumed_samples;
    j["applied_steps"] = s.applied_steps;
    j["skipped_iterations"] = s.skipped_iterations;
    j["consecutive_nan_iterations"] = s.consecutive_nan;
    j["seed"] = s.seed;
    j["model"] = spec_to_json(spec);
    j["model_summary"] = spec.summary();
    j["weights_dtype"] = dtype_name(weights_dtype);
    j["files"] = sizes;
    j["config_yaml"] = s.config_yaml;
    write_file_atomically((tmp / kStateFile).string(), j.dump(2) + "\n");
    publish_directory(tmp.string(), final_dir.string());
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
  write_file_atomically((fs::path(save_dir) / kTrackerFileName).string(),
                        std::to_string(s.iteration) + "\n");
  fsync_directory(save_dir);
  return final_dir.string();
}

void prune(const std::string& save_dir, int64_t keep_iteration, int64_t keep_last) {
  if (keep_last <= 0) return;
  auto all = list_checkpoints(save_dir);
  std::erase_if(all, [&](const auto& c) { return c.first == keep_iteration; });
  // The one just written counts towards keep_last even when an older run left newer ones.
  const int64_t remove = static_cast<int64_t>(all.size()) - (keep_last - 1);
  for (int64_t i = 0; i < remove; ++i) fs::remove_all(all[i].second);
}

std::string describe(DType dtype, const Shape& shape) {
  return fmt::format("{} [{}]", safetensors_dtype_name(dtype), fmt::join(dims(shape), ", "));
}

void check_tensor(const SafetensorsFile& f, const std::string& name, DType dtype,
                  const Shape& shape, const std::string& model) {
  const SafetensorsTensor* t = f.find(name);
  if (!t)
    throw DataError(fmt::format("{}: tensor '{}' is missing; expected {} for the model in {} ({})",
                                f.path(), name, describe(dtype, shape), kStateFile, model));
  if (t->dtype != dtype || t->shape != dims(shape))
    throw DataError(fmt::format("{}: tensor '{}' is {} [{}]; expected {} for the model in {} ({})",
                                f.path(), name, safetensors_dtype_name(t->dtype),
                                fmt::join(t->shape, ", "), describe(dtype, shape), kStateFile,
                                model));
}

// ". The previous complete checkpoint is ..." for the newest checkpoint older than `dir`
// beside it that opens cleanly and holds the configured model.
std::string previous_good_hint(const std::string& dir, const ModelSpec& configured) {
  const fs::path d = normalized(dir);
  const int64_t failed = iteration_of(d);
  auto all = list_checkpoints(d.parent_path());
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (failed >= 0 && it->first >= failed) continue;
    try {
      Checkpoint c(it->second.string());
      c.require_model(configured);
    } catch (const DataError&) {
      continue;
    }
    return fmt::format(
        ". The previous complete checkpoint is {} (iteration {}): resume from it "
        "with --load {} (or delete {})",
        it->second.string(), it->first, it->second.string(), d.string());
  }
  return fmt::format(". There is no earlier complete checkpoint of the configured model in {}",
                     d.parent_path().string());
}

}  // namespace

std::string checkpoint_dir_name(int64_t iteration) {
  return fmt::format("iter_{:07d}", iteration);
}

std::string save_checkpoint(const std::string& save_dir, const TrainingTensors& t,
                            const TrainerState& state, int64_t keep_last) {
  const auto& params = t.layout->params;
  FileToWrite model{kModelFile, {}, [&](size_t i, void* dst) {
                      t.backend->download(dst,
                                          t.params.flat_range(params[i].offset, params[i].numel()));
                    }};
  FileToWrite optimizer{kOptimizerFile, {}, [&](size_t i, void* dst) {
                          if (i >= 3 * params.size())
                            return t.backend->download(dst, t.extra_state[i - 3 * params.size()].second);
                          const Tensor& src = i < params.size()       ? t.master
                                              : i < 2 * params.size() ? t.exp_avg
                                                                      : t.exp_avg_sq;
                          const ParamInfo& p = params[i % params.size()];
                          t.backend->download(dst, src.flat_range(p.offset, p.numel()));
                        }};
  for (const auto& p : params) model.tensors.push_back({p.name, t.params.dtype, dims(p.shape)});
  for (const char* kind : kOptimizerKinds)
    for (const auto& p : params)
      optimizer.tensors.push_back({std::string(kind) + "." + p.name, DType::F32, dims(p.shape)});
  for (const auto& [name, tensor] : t.extra_state) {
    TS_CHECK(tensor.dtype == DType::F32, "checkpoint state {} must be fp32", name);
    optimizer.tensors.push_back({name, DType::F32, dims(tensor.shape)});
  }
  const std::string dir =
      write_checkpoint(save_dir, *t.spec, t.params.dtype, state, {model, optimizer});
  prune(save_dir, state.iteration, keep_last);
  return dir;
}

std::string save_weights_checkpoint(
    const std::string& save_dir, const ModelSpec& spec,
    const std::function<std::vector<float>(const ParamInfo&)>& weights) {
  const ParamLayout layout = make_param_layout(spec);
  FileToWrite model{kModelFile, {}, [&](size_t i, void* dst) {
                      const std::vector<float> w = weights(layout.params[i]);
                      std::memcpy(dst, w.data(), w.size() * sizeof(float));
                    }};
  for (const auto& p : layout.params) model.tensors.push_back({p.name, DType::F32, dims(p.shape)});
  TrainerState state;
  return write_checkpoint(save_dir, spec, DType::F32, state, {model});
}

std::string find_latest_checkpoint(const std::string& path) {
  const fs::path root(path);
  if (fs::exists(root / kStateFile)) return path;
  const fs::path tracker = root / kTrackerFileName;
  if (fs::exists(tracker)) {
    std::string text = read_text(tracker);
    text.erase(text.find_last_not_of(" \n\r\t") + 1);
    if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos)
      throw DataError(
          fmt::format("{}: expected the iteration number of the latest checkpoint, found '{}'",
                      tracker.string(), text));
    return (root / checkpoint_dir_name(std::stoll(text))).string();
  }
  // No tracker: the save was killed between publishing the directory and writing the
  // tracker, and directories are only published complete, so the newest one is good.
  const auto all = list_checkpoints(root);
  return all.empty() ? std::string() : all.back().second.string();
}

std::string checkpoint_to_resume(const CheckpointConfig& c) {
  if (c.load.empty()) return "";
  const std::string dir = find_latest_checkpoint(c.load);
  if (dir.empty() && normalized(c.load) != normalized(c.save))
    throw DataError(
        fmt::format("{}: no checkpoint here (load); expected a save directory with {} "
                    "or iter_* checkpoints, or one checkpoint directory{}",
                    c.load, kTrackerFileName,
                    fs::exists(fs::path(c.load) / "config.json")
                        ? " (for Hugging Face weights use hf_init_path)"
                        : ""));
  return dir;
}

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  const fs::path d(dir);
  if (!fs::is_directory(d))
    throw DataError(fmt::format("{}: checkpoint directory does not exist", dir));
  const fs::path state_path = d / kStateFile;
  const std::string state_file = state_path.string();
  if (!fs::exists(state_path))
    throw DataError(
        fmt::format("{}: missing; expected every checkpoint directory to hold {}, {} and {} "
                    "(an interrupted copy?)",
                    state_file, kStateFile, kModelFile, kOptimizerFile));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text(state_path));
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("{}: malformed JSON ({}); expected Tessera's trainer state",
                                state_file, e.what()));
  }
  const nlohmann::json version = j.value("format_version", nlohmann::json());
  if (!version.is_number_integer() || version.get<int>() != kCheckpointFormatVersion)
    throw DataError(
        fmt::format("{}: unknown checkpoint format version {}; this Tessera reads version {} "
                    "(written by another Tessera version?)",
                    state_file, version.dump(), kCheckpointFormatVersion));
  std::string dtype_text;
  std::map<std::string, uint64_t> sizes;
  try {
    state_.iteration = j.at("iteration").get<int64_t>();
    state_.consumed_samples = j.at("consumed_samples").get<uint64_t>();
    state_.applied_steps = j.at("applied_steps").get<int64_t>();
    state_.skipped_iterations = j.at("skipped_iterations").get<int64_t>();
    state_.consecutive_nan = j.at("consecutive_nan_iterations").get<int64_t>();
    state_.seed = j.at("seed").get<int64_t>();
    state_.config_yaml = j.at("config_yaml").get<std::string>();
    dtype_text = j.at("weights_dtype").get<std::string>();
    sizes = j.at("files").get<std::map<std::string, uint64_t>>();
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("{}: incomplete trainer state: {}", state_file, e.what()));
  }
  spec_ = spec_from_json(j.value("model", nlohmann::json::object()), state_file);
  layout_ = make_param_layout(spec_);
  DType weights_dtype;
  if (!parse_dtype(dtype_text, &weights_dtype))
    throw DataError(fmt::format("{}: weights_dtype '{}' is not a dtype", state_file, dtype_text));
  if (!sizes.count(kModelFile))
    throw DataError(
        fmt::format("{}: lists no {}; expected the model weights", state_file, kModelFile));
  for (const auto& [name, bytes] : sizes) {
    const fs::path f = d / name;
    if (!fs::exists(f))
      throw DataError(
          fmt::format("{}: missing; {} lists it with {} bytes", f.string(), kStateFile, bytes));
    if (fs::file_size(f) != bytes)
      throw DataError(
          fmt::format("{}: {} bytes, expected {} as recorded in {} (truncated or partly "
                      "copied?)",
                      f.string(), fs::file_size(f), bytes, kStateFile));
  }
  const std::string model = spec_.summary();
  model_ = std::make_unique<SafetensorsFile>((d / kModelFile).string());
  for (const auto& p : layout_.params) check_tensor(*model_, p.name, weights_dtype, p.shape, model);
  if (sizes.count(kOptimizerFile)) {
    optimizer_ = std::make_unique<SafetensorsFile>((d / kOptimizerFile).string());
    for (const char* kind : kOptimizerKinds)
      for (const auto& p : layout_.params)
        check_tensor(*optimizer_, std::string(kind) + "." + p.name, DType::F32, p.shape, model);
  }
}

Checkpoint::~Checkpoint() = default;

std::vector<float> Checkpoint::master(const ParamInfo& p) const {
  return optimizer_ ? optimizer_->to_float("master." + p.name) : model_->to_float(p.name);
}

std::vector<float> Checkpoint::exp_avg(const ParamInfo& p) const {
  return optimizer_->to_float("exp_avg." + p.name);
}

std::vector<float> Checkpoint::exp_avg_sq(const ParamInfo& p) const {
  return optimizer_->to_float("exp_avg_sq." + p.name);
}

const SafetensorsTensor* Checkpoint::optimizer_tensor(const std::string& name) const {
  return optimizer_ ? optimizer_->find(name) : nullptr;
}

std::vector<float> Checkpoint::optimizer_values(const std::string& name) const {
  return optimizer_->to_float(name);
}

std::vector<std::string> Checkpoint::require_model(const ModelSpec& configured) const {
  const SpecDifferences d = compare_specs(spec_, configured, "the checkpoint");
  if (!d.shape.empty())
    throw DataError(fmt::format(
        "{}: the checkpoint holds a different model: {}; expected a checkpoint "
        "of the configured model ({})",
        (fs::path(dir_) / kStateFile).string(), join_lines(d.shape), configured.summary()));
  return d.behaviour;
}

TrainerState load_checkpoint(const std::string& dir, const TrainingTensors& t,
                             std::vector<std::string>* warnings) {
  try {
    const Checkpoint c(dir);
    for (auto& w : c.require_model(*t.spec)) warnings->push_back(std::move(w));
    for (const auto& p : t.layout->params) {
      t.backend->upload(t.master.flat_range(p.offset, p.numel()), c.master(p).data());
      if (!c.has_optimizer_state()) continue;
      t.backend->upload(t.exp_avg.flat_range(p.offset, p.numel()), c.exp_avg(p).data());
      t.backend->upload(t.exp_avg_sq.flat_range(p.offset, p.numel()), c.exp_avg_sq(p).data());
    }
    if (!c.has_optimizer_state()) {
      t.backend->fill(t.exp_avg, 0.0f);
      t.backend->fill(t.exp_avg_sq, 0.0f);
    }
    TrainerState state = c.state();
    state.extra_state_restored = true;
    for (const auto& [name, tensor] : t.extra_state) {
      const SafetensorsTensor* found = c.optimizer_tensor(name);
      if (!found || found->dtype != DType::F32 || found->shape != dims(tensor.shape)) {
        warnings->push_back(fmt::format(
            "{}: {} is {}; expected {}: it starts fresh", dir, name,
            found ? fmt::format("{} [{}]", safetensors_dtype_name(found->dtype), fmt::join(found->shape, ", "))
                  : std::string("not in the checkpoint"),
            describe(DType::F32, tensor.shape)));
        state.extra_state_restored = false;
        continue;
      }
      t.backend->upload(tensor, c.optimizer_values(name).data());
    }
    return state;
  } catch (const DataError& e) {
    throw DataError(e.what() + previous_good_hint(dir, *t.spec));
  }
}

}  // namespace tessera
