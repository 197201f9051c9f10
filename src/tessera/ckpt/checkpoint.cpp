#include "tessera/ckpt/checkpoint.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <regex>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "tessera/ckpt/atomic_files.h"
#include "tessera/ckpt/json_fields.h"
#include "tessera/ckpt/model_spec_json.h"
#include "tessera/core/error.h"
#include "tessera/core/split_master.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

constexpr const char* kStateFile = "trainer_state.json";
// Data-parallel ranks a checkpoint may name: far more than any job has.
constexpr int64_t kMaxWorldSize = int64_t{1} << 20;
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
// Optimizer tensors are named "{kind}.{parameter name}", shard slices "{kind}.{begin}-{end}";
// indexed by FlatState.
constexpr const char* kOptimizerKinds[] = {"master", "exp_avg", "exp_avg_sq"};
constexpr FlatState kFlatStates[] = {FlatState::Master, FlatState::ExpAvg, FlatState::ExpAvgSq};

const char* kind_name(FlatState s) {
  return kOptimizerKinds[static_cast<int>(s)];
}

std::string shard_file_name(int rank, int world) {
  return fmt::format("optimizer.rank{:05d}-of-{:05d}.safetensors", rank, world);
}

std::string slice_name(const char* kind, const ParamRange& r) {
  return fmt::format("{}.{}-{}", kind, r.begin, r.end);
}

// The range of a slice named "{kind}.{begin}-{end}"; nullopt for any other name.
std::optional<ParamRange> slice_range(const char* kind, const std::string& name) {
  const std::string prefix = std::string(kind) + ".";
  if (!name.starts_with(prefix)) return std::nullopt;
  const char* p = name.data() + prefix.size();
  const char* end = name.data() + name.size();
  ParamRange r;
  auto [dash, e1] = std::from_chars(p, end, r.begin);
  if (e1 != std::errc() || dash == end || *dash != '-') return std::nullopt;
  auto [last, e2] = std::from_chars(dash + 1, end, r.end);
  if (e2 != std::errc() || last != end) return std::nullopt;
  return r;
}

std::string describe(const ParamRange& r) {
  return fmt::format("[{}, {})", r.begin, r.end);
}

// A model split over ranks (tensor or pipeline parallel) holds parts of the one-device layout
// (a stage lacks the embedding or the head): its state is written as runs of that layout
// (format 3).
bool placed(const ParamLayout& layout) {
  return layout.embedding < 0 || layout.lm_head < 0 ||
         std::any_of(layout.params.begin(), layout.params.end(),
                     [](const ParamInfo& p) { return !p.whole() || p.full_offset != p.offset; });
}

// Where a rank's local elements lie in the one-device layout: runs [begin, begin + count) of
// it, each starting at element `local` of the rank's packed owned ranges.
struct PlacedRun {
  int64_t begin, count, local;
};

// The runs of `owned` (ranges of `layout`, packed one after another), in packed order; those
// of whole parameters only with `whole_params`.
std::vector<PlacedRun> placed_runs(const ParamLayout& layout, const std::vector<ParamRange>& owned,
                                   bool whole_params = true) {
  std::vector<PlacedRun> runs;
  int64_t at = 0;
  for (const ParamRange& r : owned) {
    layout.for_each_param_in(r, [&](const ParamInfo& p, const ParamRange& part) {
      if (!whole_params && p.whole()) return;
      p.for_each_run(
          part.begin - p.offset, part.end - p.offset,
          [&](int64_t begin, int64_t count, int64_t full_begin) {
            runs.push_back({p.full_offset + full_begin, count, at + p.offset + begin - r.begin});
          });
    });
    at += r.count();
  }
  return runs;
}

// Runs as [begin, count, stride, repeat] groups: `repeat` runs of `count` elements, `stride`
// apart (a row-parallel part is one group of a run per row). The packed data holds them one
// after another.
nlohmann::json run_groups(const std::vector<PlacedRun>& runs) {
  struct Group {
    int64_t begin, count, stride, repeat;
  };
  std::vector<Group> groups;
  for (const PlacedRun& r : runs) {
    if (!groups.empty() && groups.back().count == r.count) {
      Group& g = groups.back();
      if (g.repeat == 1 && r.begin > g.begin) {
        g.stride = r.begin - g.begin;
        g.repeat = 2;
        continue;
      }
      if (r.begin == g.begin + g.repeat * g.stride) {
        ++g.repeat;
        continue;
      }
    }
    groups.push_back({r.begin, r.count, r.count, 1});
  }
  nlohmann::json out = nlohmann::json::array();
  for (const Group& g : groups) out.push_back({g.begin, g.count, g.stride, g.repeat});
  return out;
}

constexpr const char* kRunsMetadata = "tessera_runs";  // a shard's run groups, as JSON

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

// A checkpoint's iteration as a tracker or a directory name spells it: decimal digits of a
// number up to kMaxJsonCounter; nullopt otherwise (a number too large to be one is damage, not
// an iteration).
std::optional<int64_t> parse_iteration(const std::string& digits) {
  int64_t value = 0;
  const char* end = digits.data() + digits.size();
  const auto [last, ec] = std::from_chars(digits.data(), end, value);
  if (digits.empty() || digits[0] == '-' || ec != std::errc() || last != end ||
      value > kMaxJsonCounter)
    return std::nullopt;
  return value;
}

// Iteration of a directory named iter_NNNNNNN; -1 for any other name (e.g. a .tmp dir).
int64_t iteration_of(const fs::path& dir) {
  static const std::regex kPattern("iter_([0-9]+)");
  std::smatch m;
  const std::string name = dir.filename().string();
  if (!std::regex_match(name, m, kPattern)) return -1;
  return parse_iteration(m[1].str()).value_or(-1);
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

void write_file(const fs::path& dir, const FileToWrite& f) {
  write_safetensors((dir / f.name).string(), f.tensors, {{"format", "pt"}}, f.fill);
}

fs::path tmp_dir(const std::string& save_dir, int64_t iteration) {
  return (fs::path(save_dir) / checkpoint_dir_name(iteration)).string() + ".tmp";
}

// An empty temp directory for checkpoint `iteration`, where its files are written.
fs::path begin_dir(const std::string& save_dir, int64_t iteration) {
  fs::create_directories(save_dir);
  const fs::path tmp = tmp_dir(save_dir, iteration);
  fs::remove_all(tmp);  // left by a save that was killed
  fs::create_directories(tmp);
  return tmp;
}

// Runs `steps`; if they fail, removes the unfinished `tmp` (the previous checkpoint stays the
// latest) and rethrows.
void removing_on_failure(const fs::path& tmp, const std::function<void()>& steps) {
  try {
    steps();
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
}

// Writes trainer_state.json (with the size of each of `files`, already in tmp) and publishes
// tmp under its final name; `shards` lists the optimizer shards (null: none).
std::string publish(const std::string& save_dir, const fs::path& tmp, const ModelSpec& spec,
                    DType weights_dtype, const TrainerState& s,
                    const std::vector<std::string>& files, const nlohmann::ordered_json& shards,
                    const nlohmann::ordered_json& state_dtypes = nullptr,
                    int version = kShardedCheckpointFormatVersion) {
  nlohmann::ordered_json sizes;
  for (const auto& f : files) sizes[f] = fs::file_size(tmp / f);
  nlohmann::ordered_json j;
  j["format"] = "tessera-checkpoint";
  j["format_version"] = shards.is_null() ? kUnshardedCheckpointFormatVersion : version;
  j["tessera_version"] = TESSERA_VERSION;
  j["iteration"] = s.iteration;
  j["consumed_samples"] = s.consumed_samples;
  j["applied_steps"] = s.applied_steps;
  j["skipped_iterations"] = s.skipped_iterations;
  j["consecutive_nan_iterations"] = s.consecutive_nan;
  j["seed"] = s.seed;
  j["world_size"] = s.world_size;
  if (!s.run_id.empty()) j["run_id"] = s.run_id;
  j["model"] = spec_to_json(spec);
  j["model_summary"] = spec.summary();
  if (s.lora)
    j["lora"] = {{"rank", s.lora->rank}, {"alpha", s.lora->alpha}, {"target_modules", s.lora->targets}};
  // A frozen copy's reference has no digest (its log-probabilities are not kept), only a name.
  if (!s.dpo_reference_weights.empty() || !s.dpo_reference_digest.empty())
    j["dpo_reference"] = {{"weights", s.dpo_reference_weights}, {"digest", s.dpo_reference_digest}};
  j["weights_dtype"] = dtype_name(weights_dtype);
  j["files"] = sizes;
  if (!shards.is_null()) j["optimizer_shards"] = shards;
  if (!state_dtypes.is_null()) j["optimizer_state_dtypes"] = state_dtypes;
  j["config_yaml"] = s.config_yaml;
  write_file_atomically((tmp / kStateFile).string(), j.dump(2) + "\n");
  const fs::path final_dir = fs::path(save_dir) / checkpoint_dir_name(s.iteration);
  publish_directory(tmp.string(), final_dir.string());
  return final_dir.string();
}

// Points the tracker at `iteration`, once its directory is published.
void update_tracker(const std::string& save_dir, int64_t iteration) {
  write_file_atomically((fs::path(save_dir) / kTrackerFileName).string(),
                        std::to_string(iteration) + "\n");
  fsync_directory(save_dir);
}

FileToWrite model_file(const TrainingTensors& t) {
  FileToWrite model{kModelFile, {}, [&t](size_t i, void* dst) {
                      t.backend->download(dst, t.param(static_cast<int>(i)));
                    }};
  for (const auto& p : t.layout->params)
    model.tensors.push_back({p.name, t.params_dtype, dims(p.shape)});
  return model;
}

// Appends t.extra_state to `f`, whose fill then serves indices from `first` on from it.
void add_extra_state(FileToWrite& f, const TrainingTensors& t) {
  const size_t first = f.tensors.size();
  for (const auto& [name, tensor] : t.extra_state) {
    TS_CHECK(tensor.dtype == DType::F32, "checkpoint state {} must be fp32", name);
    f.tensors.push_back({name, DType::F32, dims(tensor.shape)});
  }
  f.fill = [&t, first, fill = f.fill](size_t i, void* dst) {
    if (i >= first) return t.backend->download(dst, t.extra_state[i - first].second);
    fill(i, dst);
  };
}

// The device tensor of `state` for owned range i (packed at `packed_at`), or the unsharded
// tensor's elements [at, at + count).
Tensor state_tensor(const TrainingTensors& t, FlatState state, size_t i, int64_t at,
                    int64_t count) {
  if (state == FlatState::Master && !t.master_ranges.empty()) return t.master_ranges[i];
  const Tensor& all = state == FlatState::Master   ? t.master
                      : state == FlatState::ExpAvg ? t.exp_avg
                                                   : t.exp_avg_sq;
  return all.flat_range(at, count);
}

bool split_master(const TrainingTensors& t, FlatState state) {
  return state == FlatState::Master && !t.master_high.empty();
}

// A split master's halves of owned range i's elements [at, at + count) of the packed tensors.
std::pair<Tensor, Tensor> split_master_halves(const TrainingTensors& t, size_t i, int64_t at,
                                              int64_t count) {
  int64_t range_start = 0;
  for (size_t k = 0; k < i; ++k) range_start += t.owned[k].count();
  return {t.master_high[i].flat_range(at - range_start, count), t.master.flat_range(at, count)};
}

// state_tensor(t, state, i, at, count) into host memory in state_dtype_of(t, state).
void download_state(const TrainingTensors& t, FlatState state, size_t i, int64_t at,
                    int64_t count, void* dst) {
  if (!split_master(t, state)) return t.backend->download(dst, state_tensor(t, state, i, at, count));
  const auto [high, low] = split_master_halves(t, i, at, count);
  std::vector<uint16_t> h(static_cast<size_t>(count)), l(h.size());
  t.backend->download(h.data(), high);
  t.backend->download(l.data(), low);
  join_master_values(h.data(), l.data(), static_cast<float*>(dst), count);
}

// values into elements [offset, offset + size) of state_tensor(t, state, i, at, range_count).
void upload_state(const TrainingTensors& t, FlatState state, size_t i, int64_t at,
                  int64_t range_count, int64_t offset, const std::vector<float>& values) {
  const auto count = static_cast<int64_t>(values.size());
  if (!split_master(t, state))
    return upload_values(*t.backend,
                         state_tensor(t, state, i, at, range_count).flat_range(offset, count),
                         values.data());
  const auto [high, low] = split_master_halves(t, i, at + offset, count);
  std::vector<uint16_t> h(values.size()), l(values.size());
  split_master_values(values.data(), h.data(), l.data(), count);
  t.backend->upload(high, h.data());
  t.backend->upload(low, l.data());
}

DType state_dtype_of(const TrainingTensors& t, FlatState state) {
  if (split_master(t, state)) return DType::F32;
  if (state == FlatState::Master && !t.master_ranges.empty()) return t.master_ranges[0].dtype;
  return (state == FlatState::Master   ? t.master
          : state == FlatState::ExpAvg ? t.exp_avg
                                       : t.exp_avg_sq)
      .dtype;
}

// trainer_state.json's record of the dtype each kind of state is saved in.
nlohmann::ordered_json state_dtypes_json(const TrainingTensors& t) {
  nlohmann::ordered_json j;
  for (FlatState s : kFlatStates) j[kind_name(s)] = dtype_name(state_dtype_of(t, s));
  return j;
}

// Keeps the newest keep_last checkpoints of the run that wrote `keep_iteration`. Checkpoints
// of other runs are never deleted: a run is refused a save directory that holds another's
// (train/run_directories.h), and this rule holds even if one appears there.
void prune(const std::string& save_dir, int64_t keep_iteration, const std::string& run_id,
           int64_t keep_last) {
  if (keep_last <= 0) return;
  auto all = saved_checkpoints(save_dir);
  std::erase_if(all, [&](const SavedCheckpoint& c) {
    return c.iteration == keep_iteration || !c.belongs_to(run_id);
  });
  // The one just written counts towards keep_last even when an older run left newer ones.
  const int64_t remove = static_cast<int64_t>(all.size()) - (keep_last - 1);
  for (int64_t i = 0; i < remove; ++i) fs::remove_all(all[i].dir);
}

std::string describe(DType dtype, const Shape& shape) {
  return fmt::format("{} [{}]", safetensors_dtype_name(dtype), fmt::join(dims(shape), ", "));
}

// `why`: where the expectation comes from, e.g. "for the model in trainer_state.json (...)".
void check_tensor(const SafetensorsFile& f, const std::string& name, DType dtype,
                  const Shape& shape, const std::string& why) {
  const SafetensorsTensor* t = f.find(name);
  if (!t)
    throw DataError(fmt::format("{}: tensor '{}' is missing; expected {} {}", f.path(), name,
                                describe(dtype, shape), why));
  if (t->dtype != dtype || t->shape != dims(shape))
    throw DataError(fmt::format("{}: tensor '{}' is {} [{}]; expected {} {}", f.path(), name,
                                safetensors_dtype_name(t->dtype), fmt::join(t->shape, ", "),
                                describe(dtype, shape), why));
}

struct ShardRange {
  ParamRange range;
  const std::string* file;
};

// Shards must not overlap (one value per element) and must hold every parameter element;
// gaps between parameters (alignment) are not state.
void check_shard_coverage(std::vector<ShardRange> all, const ParamLayout& layout,
                          const std::string& state_file) {
  std::sort(all.begin(), all.end(),
            [](const auto& a, const auto& b) { return a.range.begin < b.range.begin; });
  for (size_t k = 1; k < all.size(); ++k)
    if (all[k].range.begin < all[k - 1].range.end)
      throw DataError(fmt::format(
          "{}: optimizer shards {} {} and {} {} overlap; expected disjoint ranges", state_file,
          *all[k - 1].file, describe(all[k - 1].range), *all[k].file, describe(all[k].range)));
  size_t k = 0;
  for (const ParamInfo& p : layout.params) {
    const int64_t end = p.offset + p.numel();
    for (int64_t at = p.offset; at < end; at = all[k].range.end) {
      while (k < all.size() && all[k].range.end <= at) ++k;
      if (k == all.size() || all[k].range.begin > at)
        throw DataError(fmt::format(
            "{}: no optimizer shard holds flat elements {} (of {}); expected the shards "
            "listed in optimizer_shards to cover every parameter in [0, {})",
            state_file, describe({at, k == all.size() ? end : std::min(end, all[k].range.begin)}),
            p.name, layout.total));
    }
  }
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
  TS_CHECK(t.owned.empty(),
           "{} owned ranges: sharded optimizer state is saved by every rank "
           "(begin_sharded_checkpoint)",
           t.owned.size());
  const auto& params = t.layout->params;
  FileToWrite optimizer{kOptimizerFile, {}, [&](size_t i, void* dst) {
                          const ParamInfo& p = params[i % params.size()];
                          download_state(t, kFlatStates[i / params.size()], 0, p.offset,
                                         p.numel(), dst);
                        }};
  for (FlatState s : kFlatStates)
    for (const auto& p : params)
      optimizer.tensors.push_back(
          {std::string(kind_name(s)) + "." + p.name, state_dtype_of(t, s), dims(p.shape)});
  add_extra_state(optimizer, t);
  const fs::path tmp = begin_dir(save_dir, state.iteration);
  std::string dir;
  removing_on_failure(tmp, [&] {
    write_file(tmp, model_file(t));
    write_file(tmp, optimizer);
    dir = publish(save_dir, tmp, *t.spec, t.params_dtype, state, {kModelFile, kOptimizerFile},
                  nullptr, state_dtypes_json(t));
  });
  update_tracker(save_dir, state.iteration);
  prune(save_dir, state.iteration, state.run_id, keep_last);
  return dir;
}

void begin_sharded_checkpoint(const std::string& save_dir, int64_t iteration) {
  begin_dir(save_dir, iteration);
}

void write_checkpoint_shard(const std::string& save_dir, const TrainingTensors& t,
                            int64_t iteration, int rank, int world, bool whole_params) {
  TS_CHECK(!t.owned.empty() && rank >= 0 && rank < world, "rank {} of {} with {} owned ranges",
           rank, world, t.owned.size());
  const fs::path tmp = tmp_dir(save_dir, iteration);
  TS_CHECK(fs::is_directory(tmp), "{} does not exist: rank 0 begins a sharded checkpoint",
           tmp.string());
  if (placed(*t.layout)) {
    // Each kind of state as one tensor of the rank's runs of the one-device layout, their
    // groups in the file's metadata (finish_sharded_checkpoint lists them).
    const std::vector<PlacedRun> runs = placed_runs(*t.layout, t.owned, whole_params);
    int64_t elements = 0;
    for (const PlacedRun& r : runs) elements += r.count;
    // Each kind of state in the dtype the run keeps it in: the owned ranges downloaded
    // packed, then the runs copied out of them in order.
    std::vector<std::byte> host;
    FileToWrite shard{shard_file_name(rank, world), {}, [&](size_t i, void* dst) {
                        const FlatState s = kFlatStates[i];
                        const size_t width = dtype_size(state_dtype_of(t, s));
                        int64_t at = 0;
                        for (size_t k = 0; k < t.owned.size(); ++k) {
                          const int64_t count = t.owned[k].count();
                          host.resize(static_cast<size_t>(at + count) * width);
                          download_state(t, s, k, at, count, host.data() + at * width);
                          at += count;
                        }
                        auto* out = static_cast<std::byte*>(dst);
                        for (const PlacedRun& r : runs)
                          out = std::copy_n(host.begin() + r.local * static_cast<int64_t>(width),
                                            r.count * static_cast<int64_t>(width), out);
                      }};
    for (FlatState s : kFlatStates)
      shard.tensors.push_back({kind_name(s), state_dtype_of(t, s), {elements}});
    if (rank == 0) add_extra_state(shard, t);
    write_safetensors((tmp / shard.name).string(), shard.tensors,
                      {{"format", "pt"}, {kRunsMetadata, run_groups(runs).dump()}}, shard.fill);
    return;
  }
  std::vector<int64_t> packed_at;  // where each owned range starts in the packed tensors
  int64_t held = 0;
  for (const ParamRange& r : t.owned) {
    packed_at.push_back(held);
    held += r.count();
  }
  const size_t n = t.owned.size();
  FileToWrite shard{shard_file_name(rank, world), {}, [&](size_t i, void* dst) {
                      download_state(t, kFlatStates[i / n], i % n, packed_at[i % n],
                                     t.owned[i % n].count(), dst);
                    }};
  for (FlatState s : kFlatStates)
    for (const ParamRange& r : t.owned)
      shard.tensors.push_back({slice_name(kind_name(s), r), state_dtype_of(t, s), {r.count()}});
  // Every rank holds the same extra state (FP8 scales are derived from max-reduced amaxes).
  if (rank == 0) {
    add_extra_state(shard, t);
    write_file(tmp, model_file(t));
  }
  write_file(tmp, shard);
}

std::string finish_sharded_checkpoint(const std::string& save_dir, const TrainingTensors& t,
                                      const TrainerState& state, int world, int64_t keep_last) {
  const fs::path tmp = tmp_dir(save_dir, state.iteration);
  std::string dir;
  removing_on_failure(tmp, [&] {
    // Each shard names its ranges (its master.{begin}-{end} tensors); trainer_state.json
    // gathers them so a loader knows which files it needs without opening every one.
    const bool runs = placed(*t.layout);
    // Split models write no whole-model weights (their master weights are the weights), and
    // only the ranks whose state no other rank holds write a shard.
    std::vector<std::string> files;
    if (!runs) files.push_back(kModelFile);
    nlohmann::ordered_json shards = nlohmann::ordered_json::array();
    for (int rank = 0; rank < world; ++rank) {
      const std::string name = shard_file_name(rank, world);
      if (runs && !fs::exists(tmp / name)) continue;
      files.push_back(name);
      const SafetensorsFile f((tmp / files.back()).string());
      if (runs) {
        const auto it = f.metadata().find(kRunsMetadata);
        TS_CHECK(it != f.metadata().end(), "{}: no {} metadata", name, kRunsMetadata);
        shards.push_back({{"file", name}, {"runs", nlohmann::ordered_json::parse(it->second)}});
        continue;
      }
      std::vector<ParamRange> ranges;
      for (const SafetensorsTensor& tensor : f.tensors())
        if (auto r = slice_range(kind_name(FlatState::Master), tensor.name)) ranges.push_back(*r);
      std::sort(ranges.begin(), ranges.end(),
                [](const auto& a, const auto& b) { return a.begin < b.begin; });
      nlohmann::ordered_json listed = nlohmann::ordered_json::array();
      for (const ParamRange& r : ranges) listed.push_back({r.begin, r.end});
      shards.push_back({{"file", files.back()}, {"ranges", listed}});
    }
    dir =
        publish(save_dir, tmp, *t.spec, t.params_dtype, state, files, shards, state_dtypes_json(t),
                runs ? kCheckpointFormatVersion : kShardedCheckpointFormatVersion);
  });
  update_tracker(save_dir, state.iteration);
  prune(save_dir, state.iteration, state.run_id, keep_last);
  return dir;
}

std::string save_weights_checkpoint(
    const std::string& save_dir, const ModelSpec& spec,
    const std::function<std::vector<float>(const ParamInfo&)>& weights,
    const std::vector<std::pair<std::string, std::vector<float>>>& model_state) {
  const ParamLayout layout = make_param_layout(spec);
  FileToWrite model{kModelFile, {}, [&](size_t i, void* dst) {
                      if (i >= layout.params.size()) {
                        const std::vector<float>& v = model_state[i - layout.params.size()].second;
                        std::memcpy(dst, v.data(), v.size() * sizeof(float));
                        return;
                      }
                      const std::vector<float> w = weights(layout.params[i]);
                      std::memcpy(dst, w.data(), w.size() * sizeof(float));
                    }};
  for (const auto& p : layout.params) model.tensors.push_back({p.name, DType::F32, dims(p.shape)});
  for (const auto& [name, values] : model_state)
    model.tensors.push_back({name, DType::F32, {static_cast<int64_t>(values.size())}});
  const TrainerState state;
  const fs::path tmp = begin_dir(save_dir, state.iteration);
  std::string dir;
  removing_on_failure(tmp, [&] {
    write_file(tmp, model);
    dir = publish(save_dir, tmp, spec, DType::F32, state, {kModelFile}, nullptr);
  });
  update_tracker(save_dir, state.iteration);
  return dir;
}

std::string find_latest_checkpoint(const std::string& path) {
  const fs::path root(path);
  std::error_code ec;
  if (fs::exists(root / kStateFile, ec)) return path;
  const fs::path tracker = root / kTrackerFileName;
  if (fs::exists(tracker, ec)) {
    std::string text = read_text(tracker);
    text.erase(text.find_last_not_of(" \n\r\t") + 1);
    const std::optional<int64_t> iteration = parse_iteration(text);
    if (!iteration) {
      const auto all = list_checkpoints(root);
      throw DataError(fmt::format(
          "{}: expected the iteration number of the latest checkpoint, found '{}' (an "
          "iteration is an integer from 0 to 2^53){}",
          tracker.string(), text.size() > 60 ? text.substr(0, 57) + "..." : text,
          all.empty() ? std::string()
                      : fmt::format(". The newest checkpoint directory is {}: resume from it "
                                    "with --load {} (or delete the damaged {})",
                                    all.back().second.string(), all.back().second.string(),
                                    tracker.string())));
    }
    return (root / checkpoint_dir_name(*iteration)).string();
  }
  // No tracker: the save was killed between publishing the directory and writing the
  // tracker, and directories are only published complete, so the newest one is good.
  const auto all = list_checkpoints(root);
  return all.empty() ? std::string() : all.back().second.string();
}

std::vector<SavedCheckpoint> saved_checkpoints(const std::string& save_dir) {
  std::vector<SavedCheckpoint> out;
  for (const auto& [iteration, dir] : list_checkpoints(save_dir)) {
    SavedCheckpoint c{iteration, dir.string(), std::nullopt};
    try {
      // Anything but an object without a run id (a run from before ids) or with a string one
      // is damage: it belongs to no run.
      const nlohmann::json j = nlohmann::json::parse(read_text(dir / kStateFile));
      if (j.is_object() && !j.contains("run_id")) c.run_id = "";
      if (j.is_object() && j.contains("run_id") && j["run_id"].is_string())
        c.run_id = j["run_id"].get<std::string>();
    } catch (const nlohmann::json::exception&) {
      // Unreadable: it belongs to no run, so no run ever deletes it.
    }
    out.push_back(std::move(c));
  }
  return out;
}

std::string checkpoint_to_resume(const CheckpointConfig& c) {
  if (c.load.empty()) return "";
  const std::string dir = find_latest_checkpoint(c.load);
  std::error_code ec;
  if (dir.empty() && normalized(c.load) != normalized(c.save))
    throw DataError(
        fmt::format("{}: no checkpoint here (load); expected a save directory with {} "
                    "or iter_* checkpoints, or one checkpoint directory{}",
                    c.load, kTrackerFileName,
                    fs::exists(fs::path(c.load) / "config.json", ec)
                        ? " (for Hugging Face weights use hf_init_path)"
                        : ""));
  return dir;
}

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  const fs::path d(dir);
  std::error_code ec;
  if (!fs::is_directory(d, ec))
    throw DataError(fmt::format("{}: checkpoint directory does not exist", dir));
  const fs::path state_path = d / kStateFile;
  const std::string state_file = state_path.string();
  if (!fs::is_regular_file(state_path, ec))
    throw DataError(
        fmt::format("{}: missing; expected every checkpoint directory to hold {}, {} and {} "
                    "(an interrupted copy?)",
                    state_file, kStateFile, kModelFile, kOptimizerFile));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text(state_path));
  } catch (const nlohmann::json::exception& e) {
    // The library's message ends with the token it stopped in ("; last read: '...'"): in a
    // file cut inside config_yaml, kilobytes of configuration. Keep its position and reason.
    // A number past a double's range (1e9999) is its out_of_range error, without a position.
    const std::string what = e.what();
    std::string reason = what.substr(0, what.find("; last read:"));
    if (const size_t at = reason.find("at line "); at != std::string::npos)
      reason.erase(0, at);
    else if (const size_t end = reason.find("] "); end != std::string::npos)
      reason = "(" + reason.substr(end + 2) + ")";
    throw DataError(
        fmt::format("{}: malformed JSON {} (damaged or partly copied?)", state_file, reason));
  }
  const JsonFields f(j, state_file);
  const nlohmann::json version = f.has("format_version") ? j["format_version"] : nlohmann::json();
  if (!version.is_number_integer() || version.get<int64_t>() < kUnshardedCheckpointFormatVersion ||
      version.get<int64_t>() > kCheckpointFormatVersion)
    throw DataError(fmt::format(
        "{}: unknown checkpoint format version {}; this Tessera reads versions {} "
        "to {} (written by another Tessera version?)",
        state_file, version.dump(), kUnshardedCheckpointFormatVersion, kCheckpointFormatVersion));
  // Every counter within what a run can reach: a negative iteration would resume before the
  // start (with a negative learning rate) and prune real checkpoints; one past 2^63 would wrap.
  state_.iteration = f.integer("iteration", 0, kMaxJsonCounter);
  state_.consumed_samples =
      static_cast<uint64_t>(f.integer("consumed_samples", 0, kMaxJsonCounter));
  state_.applied_steps = f.integer("applied_steps", 0, state_.iteration);
  state_.skipped_iterations = f.integer("skipped_iterations", 0, state_.iteration);
  state_.consecutive_nan = f.integer("consecutive_nan_iterations", 0, state_.skipped_iterations);
  state_.seed = f.integer("seed", 0, std::numeric_limits<int64_t>::max());
  state_.world_size = f.integer_or("world_size", 1, 1, kMaxWorldSize);  // absent before format 2
  state_.run_id = f.string_or("run_id", "");                            // likewise
  state_.config_yaml = f.string("config_yaml");
  const std::string dtype_text = f.string("weights_dtype");
  std::map<std::string, uint64_t> sizes;
  const JsonFields files = f.object("files");
  for (const auto& [name, bytes] : j["files"].items()) {
    if (!is_plain_file_name(name))
      files.fail("files", name, "names of files in the checkpoint directory itself");
    sizes[name] = static_cast<uint64_t>(
        files.integer_value(bytes, files.field(name.c_str()), 0, kMaxJsonCounter));
  }
  if (f.has("optimizer_state_dtypes")) {  // absent in older checkpoints: all fp32
    const JsonFields recorded = f.object("optimizer_state_dtypes");
    for (FlatState s : kFlatStates) {
      if (!recorded.has(kind_name(s))) continue;
      const std::string text = recorded.string(kind_name(s));
      DType d;
      if (!parse_dtype(text, &d) || (d != DType::F32 && d != DType::BF16))
        recorded.fail(recorded.field(kind_name(s)), text, "fp32 or bf16");
      state_dtypes_[static_cast<int>(s)] = d;
    }
  }
  std::vector<std::pair<std::string, std::vector<ParamRange>>> shard_list;
  // Format 3: each shard's run groups [begin, count, stride, repeat].
  std::vector<std::pair<std::string, std::vector<std::array<int64_t, 4>>>> run_list;
  if (f.has("optimizer_shards")) {
    const nlohmann::json& shards = f.array("optimizer_shards");
    for (size_t i = 0; i < shards.size(); ++i) {
      const JsonFields shard(shards[i], state_file, fmt::format("optimizer_shards[{}].", i));
      const std::string file = shard.string("file");
      if (!is_plain_file_name(file))
        shard.fail(shard.field("file"), file, "the name of a file in the checkpoint directory");
      // Each pair or group of integers: trainer_state.json's ranges and runs address flat
      // elements of the model, whose bounds are checked below against its layout.
      auto integers = [&](const char* key, size_t n) {
        std::vector<std::vector<int64_t>> out;
        const nlohmann::json& list = shard.array(key);
        for (size_t k = 0; k < list.size(); ++k) {
          const std::string where = fmt::format("{}[{}]", shard.field(key), k);
          if (!list[k].is_array() || list[k].size() != n)
            shard.fail(where, list[k], fmt::format("a list of {} integers", n));
          std::vector<int64_t> values;
          for (size_t v = 0; v < n; ++v)
            values.push_back(shard.integer_value(list[k][v], fmt::format("{}[{}]", where, v), 0,
                                                 kMaxJsonCounter));
          out.push_back(std::move(values));
        }
        return out;
      };
      if (shard.has("runs")) {
        std::vector<std::array<int64_t, 4>> groups;
        for (const auto& g : integers("runs", 4)) groups.push_back({g[0], g[1], g[2], g[3]});
        run_list.emplace_back(file, std::move(groups));
        continue;
      }
      std::vector<ParamRange> ranges;
      for (const auto& r : integers("ranges", 2)) ranges.push_back({r[0], r[1]});
      shard_list.emplace_back(file, std::move(ranges));
    }
  }
  spec_ = spec_from_json(j.contains("model") ? j["model"] : nlohmann::json::object(), state_file);
  layout_ = make_param_layout(spec_);
  if (f.has("lora")) {
    const JsonFields lora = f.object("lora");
    LoraOptions o;
    o.rank = lora.integer("rank", 1, 1 << 20);
    o.alpha = lora.number("alpha", 1e-30, 1e30);
    const nlohmann::json& targets = lora.array("target_modules");
    for (size_t k = 0; k < targets.size(); ++k) {
      if (!targets[k].is_string())
        throw DataError(fmt::format("{}: {}[{}] is {}, expected a projection name", state_file,
                                    lora.field("target_modules"), k, targets[k].dump()));
      o.targets.push_back(targets[k].get<std::string>());
    }
    try {
      layout_ = make_lora_layout(spec_, layout_, o).adapters;
    } catch (const ConfigError& e) {
      throw DataError(fmt::format("{}: {}: {}", state_file, lora.field("target_modules"), e.what()));
    }
    state_.lora = o;
  }
  if (f.has("dpo_reference")) {
    const JsonFields reference = f.object("dpo_reference");
    state_.dpo_reference_weights = reference.string("weights");
    state_.dpo_reference_digest = reference.string("digest");
  }
  DType weights_dtype;
  if (!parse_dtype(dtype_text, &weights_dtype))
    throw DataError(fmt::format("{}: weights_dtype '{}' is not a dtype", state_file, dtype_text));
  // A split model's checkpoint keeps its weights as the master weights in its shards.
  if (!sizes.count(kModelFile) && run_list.empty())
    throw DataError(
        fmt::format("{}: lists no {}; expected the model weights", state_file, kModelFile));
  for (const auto& [name, bytes] : sizes) {
    const fs::path f = d / name;
    std::error_code ec;
    if (!fs::exists(f, ec))
      throw DataError(
          fmt::format("{}: missing; {} lists it with {} bytes", f.string(), kStateFile, bytes));
    if (!fs::is_regular_file(f, ec))
      throw DataError(fmt::format("{}: not a regular file; {} lists it as a file of {} bytes",
                                  f.string(), kStateFile, bytes));
    const uint64_t size = fs::file_size(f, ec);
    if (ec || size != bytes)
      throw DataError(
          fmt::format("{}: {} bytes, expected {} as recorded in {} (truncated or partly "
                      "copied?)",
                      f.string(), size, bytes, kStateFile));
  }
  const std::string model = fmt::format("for the model in {} ({})", kStateFile, spec_.summary());
  if (sizes.count(kModelFile)) {
    model_ = std::make_unique<SafetensorsFile>((d / kModelFile).string());
    for (const auto& p : layout_.params)
      check_tensor(*model_, p.name, weights_dtype, p.shape, model);
  }
  if (sizes.count(kOptimizerFile)) {
    optimizer_ = std::make_unique<SafetensorsFile>((d / kOptimizerFile).string());
    for (FlatState s : kFlatStates)
      for (const auto& p : layout_.params)
        check_tensor(*optimizer_, std::string(kind_name(s)) + "." + p.name, state_dtype(s), p.shape,
                     model);
  }
  std::vector<ShardRange> all;
  for (const auto& [name, ranges] : shard_list) {
    if (!sizes.count(name))
      throw DataError(fmt::format(
          "{}: optimizer shard {} has no size in files; expected every shard listed there",
          state_file, name));
    Shard shard{std::make_unique<SafetensorsFile>((d / name).string()), ranges};
    for (const ParamRange& r : ranges) {
      if (r.begin < 0 || r.end <= r.begin || r.end > layout_.total)
        throw DataError(
            fmt::format("{}: optimizer shard {} lists range {}; expected a non-empty "
                        "range within the model's {} flat elements",
                        state_file, name, describe(r), layout_.total));
      for (FlatState s : kFlatStates)
        check_tensor(*shard.file, slice_name(kind_name(s), r), state_dtype(s), {r.count()},
                     fmt::format("for range {} as {} lists", describe(r), kStateFile));
      all.push_back({r, &name});
    }
    shards_.push_back(std::move(shard));
  }
  for (const auto& [name, groups] : run_list) {
    if (!sizes.count(name))
      throw DataError(fmt::format(
          "{}: optimizer shard {} has no size in files; expected every shard listed there",
          state_file, name));
    run_files_.push_back(std::make_unique<SafetensorsFile>((d / name).string()));
    run_file_names_.push_back(name);
    int64_t packed = 0;
    for (const auto& [begin, count, stride, repeat] : groups) {
      // The last run, begin + (repeat - 1) * stride + count, within the model; written so
      // that no product of two of the file's numbers can overflow.
      if (count < 1 || repeat < 1 || stride < count || begin < 0 || count > layout_.total - begin ||
          repeat - 1 > (layout_.total - begin - count) / stride)
        throw DataError(fmt::format(
            "{}: optimizer shard {} lists runs [{}, {}, {}, {}]; expected [begin, count, "
            "stride, repeat] of non-empty runs within the model's {} flat elements",
            state_file, name, begin, count, stride, repeat, layout_.total));
      for (int64_t k = 0; k < repeat; ++k) {
        runs_.push_back({begin + k * stride, count, run_files_.back().get(), packed});
        packed += count;
      }
    }
    for (FlatState s : kFlatStates)
      check_tensor(*run_files_.back(), kind_name(s), state_dtype(s), {packed},
                   fmt::format("for the runs {} lists", kStateFile));
  }
  std::sort(runs_.begin(), runs_.end(),
            [](const Run& a, const Run& b) { return a.begin < b.begin; });
  for (const Run& r : runs_) {
    const size_t file =
        static_cast<size_t>(std::find_if(run_files_.begin(), run_files_.end(),
                                         [&](const auto& f) { return f.get() == r.file; }) -
                            run_files_.begin());
    all.push_back({{r.begin, r.begin + r.count}, &run_file_names_[file]});
  }
  if (!shards_.empty() || !runs_.empty()) check_shard_coverage(std::move(all), layout_, state_file);
}

Checkpoint::~Checkpoint() = default;

void Checkpoint::read_flat(
    FlatState state, const ParamRange& r,
    const std::function<void(int64_t offset, const std::vector<float>& values)>& fill) const {
  TS_CHECK(state == FlatState::Master || has_optimizer_state(), "{}: no optimizer state", dir_);
  const char* kind = kind_name(state);
  if (!runs_.empty()) {
    // Runs are disjoint and sorted: the first that ends after r.begin, then on.
    auto it = std::partition_point(runs_.begin(), runs_.end(),
                                   [&](const Run& x) { return x.begin + x.count <= r.begin; });
    for (; it != runs_.end() && it->begin < r.end; ++it) {
      const int64_t lo = std::max(it->begin, r.begin), hi = std::min(it->begin + it->count, r.end);
      fill(lo, it->file->to_float(kind, it->packed + lo - it->begin, hi - lo));
    }
    return;
  }
  for (const Shard& s : shards_)
    for (const ParamRange& have : s.ranges) {
      const int64_t lo = std::max(have.begin, r.begin), hi = std::min(have.end, r.end);
      if (lo < hi) fill(lo, s.file->to_float(slice_name(kind, have), lo - have.begin, hi - lo));
    }
  if (!shards_.empty()) return;
  for (const ParamInfo& p : layout_.params) {
    const int64_t lo = std::max(p.offset, r.begin), hi = std::min(p.offset + p.numel(), r.end);
    if (lo >= hi) continue;
    fill(lo, optimizer_
                 ? optimizer_->to_float(std::string(kind) + "." + p.name, lo - p.offset, hi - lo)
                 : model_->to_float(p.name, lo - p.offset, hi - lo));
  }
}

std::vector<float> Checkpoint::read_param(FlatState state, const ParamInfo& p) const {
  std::vector<float> out(p.numel());
  read_flat(state, {p.offset, p.offset + p.numel()},
            [&](int64_t offset, const std::vector<float>& v) {
              std::copy(v.begin(), v.end(), out.begin() + (offset - p.offset));
            });
  return out;
}

std::vector<float> Checkpoint::master(const ParamInfo& p) const {
  return read_param(FlatState::Master, p);
}

std::vector<float> Checkpoint::exp_avg(const ParamInfo& p) const {
  return read_param(FlatState::ExpAvg, p);
}

std::vector<float> Checkpoint::exp_avg_sq(const ParamInfo& p) const {
  return read_param(FlatState::ExpAvgSq, p);
}

const SafetensorsFile* Checkpoint::optimizer_file_with(const std::string& name) const {
  if (optimizer_ && optimizer_->find(name)) return optimizer_.get();
  if (!has_optimizer_state() && model_ && model_->find(name)) return model_.get();  // weights only
  for (const Shard& s : shards_)
    if (s.file->find(name)) return s.file.get();
  for (const auto& f : run_files_)
    if (f->find(name)) return f.get();
  return nullptr;
}

const SafetensorsTensor* Checkpoint::optimizer_tensor(const std::string& name) const {
  const SafetensorsFile* f = optimizer_file_with(name);
  return f ? f->find(name) : nullptr;
}

std::vector<float> Checkpoint::optimizer_values(const std::string& name) const {
  const SafetensorsFile* f = optimizer_file_with(name);
  TS_CHECK(f, "{}: no optimizer tensor {}", dir_, name);
  return f->to_float(name);
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

TrainerState check_checkpoint_to_resume(const std::string& dir, const ModelSpec& configured) {
  try {
    const Checkpoint c(dir);
    c.require_model(configured);
    return c.state();
  } catch (const DataError& e) {
    throw DataError(e.what() + previous_good_hint(dir, configured));
  }
}

TrainerState load_checkpoint(const std::string& dir, const TrainingTensors& t,
                             std::vector<std::string>* warnings, bool optimizer_state) {
  try {
    const Checkpoint c(dir);
    const bool moments = optimizer_state && c.has_optimizer_state();
    for (auto& w : c.require_model(*t.spec)) warnings->push_back(std::move(w));
    // Offsets mean the same only in the same kind of layout: a model's weights, or LoRA
    // adapters of the same targets.
    for (const ParamInfo& p : t.layout->params)
      if (!c.layout().find(p.name))
        throw DataError(fmt::format(
            "{}: holds {} without {}, which this run loads (a model's weights and LoRA adapters "
            "do not load into each other: pretrained_checkpoint names the base of a LoRA run, "
            "load its adapters)",
            dir, c.state().lora ? "LoRA adapters" : "a model's weights", p.name));
    // The flat layout depends only on the model, so ranges mean the same in the checkpoint
    // as here whatever the world sizes (tail padding beyond P is never owned or stored).
    const std::vector<ParamRange> owned =
        t.owned.empty() ? std::vector<ParamRange>{{0, t.layout->total}} : t.owned;
    // A rank of a split model reads its parts run by run, wherever the checkpoint keeps them;
    // an unsplit one reads its owned ranges whole.
    const bool split = placed(*t.layout);
    int64_t at = 0;  // where the range starts in the packed tensors
    for (size_t i = 0; i < owned.size(); ++i) {
      const ParamRange& r = owned[i];
      TS_CHECK(r.begin >= 0 && r.begin < r.end && r.end <= t.layout->total,
               "owned range [{}, {}) outside the {} parameters", r.begin, r.end, t.layout->total);
      const std::vector<PlacedRun> runs =
          split ? placed_runs(*t.layout, {r}) : std::vector<PlacedRun>{{r.begin, r.count(), 0}};
      for (FlatState s : kFlatStates) {
        if (s != FlatState::Master && !moments) break;
        // Whatever dtype the checkpoint holds it in, the state arrives as the run keeps it
        // (bf16 moments resume fp32 ones and the other way round).
        for (const PlacedRun& run : runs)
          c.read_flat(s, {run.begin, run.begin + run.count},
                      [&](int64_t offset, const std::vector<float>& v) {
                        upload_state(t, s, i, at, r.count(), run.local + offset - run.begin, v);
                      });
      }
      at += r.count();
    }
    if (!moments && t.exp_avg.defined()) {
      t.backend->fill(t.exp_avg, 0.0f);
      t.backend->fill(t.exp_avg_sq, 0.0f);
    }
    TrainerState state = c.state();
    state.extra_state_restored = true;
    for (const auto& [name, tensor] : t.extra_state) {
      const SafetensorsTensor* found = c.optimizer_tensor(name);
      if (!found || found->dtype != DType::F32 || found->shape != dims(tensor.shape)) {
        warnings->push_back(
            fmt::format("{}: {} is {}; expected {}: it starts fresh", dir, name,
                        found ? fmt::format("{} [{}]", safetensors_dtype_name(found->dtype),
                                            fmt::join(found->shape, ", "))
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
