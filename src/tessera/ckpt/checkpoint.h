#pragma once
// Training checkpoints in Megatron's directory layout (docs/checkpoints.md is the spec):
//   {save}/latest_checkpointed_iteration.txt   iteration of the newest complete checkpoint
//   {save}/iter_0000100/model.safetensors       weights in the compute dtype, Tessera names
//                       optimizer.safetensors   master weights and AdamW moments (fp32, or bf16
//                                               as the precision-aware optimizer keeps them)
//                       trainer_state.json      counters, seed, config, model, format version
// Under ZeRO-1 each rank writes optimizer.rank{r}-of-{world}.safetensors instead: its slices
// of the flat fp32 buffers, named by their [begin, end) in ParamLayout offsets, which depend
// only on the model, so any world size (or a single device) loads them by intersecting ranges.
// A checkpoint is written into iter_0000100.tmp and renamed when complete; the tracker is
// replaced atomically afterwards, so a kill at any moment leaves the last complete one.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/ckpt/safetensors.h"
#include "tessera/config/config.h"
#include "tessera/model/lora_layout.h"
#include "tessera/model/model_spec.h"
#include "tessera/model/param_layout.h"
#include "tessera/ops/backend.h"

namespace tessera {

// Version 2 added optimizer shards, version 3 shards of a model split over ranks (tensor or
// pipeline parallel): each holds a rank's runs of the one-device layout, grouped as
// [begin, count, stride, repeat] in trainer_state.json, and there is no model.safetensors (the
// master weights are the weights). Checkpoints are written with the lowest version that holds
// them; earlier Tessera versions refuse a newer one rather than misread it.
inline constexpr int kCheckpointFormatVersion = 3;
inline constexpr int kShardedCheckpointFormatVersion = 2;
inline constexpr int kUnshardedCheckpointFormatVersion = 1;
inline constexpr const char* kTrackerFileName = "latest_checkpointed_iteration.txt";

// The trainer's counters. With the seed they fix the data position (a batch is a pure
// function of seed and consumed samples) and the learning rate, so restoring them and the
// tensors continues a run exactly.
struct TrainerState {
  int64_t iteration = 0;  // completed iterations
  uint64_t consumed_samples = 0;
  int64_t applied_steps = 0;  // AdamW updates applied: its bias-correction step count
  int64_t skipped_iterations = 0;
  int64_t consecutive_nan = 0;
  int64_t seed = 0;
  int64_t world_size = 1;  // data-parallel ranks of the run that wrote it
  // The run it belongs to (train/run_directories.h): a resumed run keeps it. Empty in
  // checkpoints written before runs had ids.
  std::string run_id;
  std::string config_yaml;            // the effective configuration, for the record
  // A LoRA run's: its checkpoints hold the adapters (model/lora_layout.h) of the model,
  // not the model's weights.
  std::optional<LoraOptions> lora;
  // A DPO run's reference: where its weights came from and their digest, which key the
  // reference log-probabilities stored beside the dataset (train/dpo_reference.h); empty
  // for other runs.
  std::string dpo_reference_weights, dpo_reference_digest;
  bool extra_state_restored = false;  // load_checkpoint found every TrainingTensors::extra_state
};

// Device tensors a checkpoint is written from and loaded into.
struct TrainingTensors {
  Backend* backend = nullptr;
  const ModelSpec* spec = nullptr;
  const ParamLayout* layout = nullptr;
  // The compute-dtype weights of parameter `index` of layout->params, read in layout order
  // while model.safetensors is written (under FSDP each call may gather from every rank).
  std::function<Tensor(int index)> param;
  DType params_dtype = DType::F32;
  // (P), or the owned ranges packed; fp32, or bf16 where the precision-aware optimizer keeps
  // them so (written in their dtype, which trainer_state.json records; loading converts).
  Tensor master, exp_avg, exp_avg_sq;
  // Master weights that are not packed: with bf16 main parameters under ZeRO-1 or FSDP they
  // are this rank's parameters, owned range i in master_ranges[i]. Empty: `master` holds them.
  std::vector<Tensor> master_ranges;
  // Split master weights (core/split_master.h): per owned range (one when unsharded) the bf16
  // parameters that are the master's high halves; `master` then holds the packed uint16 low
  // halves. Saved and loaded as the fp32 values they hold. Empty: no split.
  std::vector<Tensor> master_high;
  // Further fp32 state by name (the FP8 scaling state, "fp8.*"), kept in
  // optimizer.safetensors (sharded: rank 0's shard). Loading a checkpoint without them (or
  // with other shapes) leaves these tensors as they are, so checkpoints of runs without that
  // feature still load.
  std::vector<std::pair<std::string, Tensor>> extra_state;
  // The ranges of [0, P) that master and the moments hold, packed one after another in
  // increasing order (ZeRO-1, FSDP: AdamWOptimizer::owned()); empty: they are full (P) tensors.
  std::vector<ParamRange> owned;
};

std::string checkpoint_dir_name(int64_t iteration);  // "iter_0000100"

// Writes {save_dir}/iter_{state.iteration}/ (replacing one of the same iteration), updates
// the tracker and deletes all but the newest keep_last checkpoints (0 keeps all). Returns
// the checkpoint's directory. t must hold the full optimizer state (t.owned empty).
std::string save_checkpoint(const std::string& save_dir, const TrainingTensors& t,
                            const TrainerState& state, int64_t keep_last);

// The same from `world` ranks that each hold a shard of the optimizer state (t.owned): every
// rank takes these steps in order, with a barrier across the ranks between consecutive
// steps, so the directory exists before anyone writes into it and is published only once
// every shard is on disk. A rank that dies on the way leaves only iter_N.tmp.
//   rank 0        begin_sharded_checkpoint    a fresh iter_N.tmp (a killed save's removed)
//   every rank    write_checkpoint_shard      its optimizer.rank{r}-of-{world}.safetensors;
//                                             rank 0 also model.safetensors and extra_state
//   rank 0        finish_sharded_checkpoint   trainer_state.json (listing every shard and its
//                                             ranges), rename, tracker, keep_last; returns
//                                             the checkpoint's directory
void begin_sharded_checkpoint(const std::string& save_dir, int64_t iteration);
// A model split over ranks (format 3) writes each run once: `whole_params` says whether this
// rank writes the runs of its parameters that are whole (norms, and with expert parallelism
// everything but the experts), which other ranks hold too.
void write_checkpoint_shard(const std::string& save_dir, const TrainingTensors& t,
                            int64_t iteration, int rank, int world, bool whole_params = true);
std::string finish_sharded_checkpoint(const std::string& save_dir, const TrainingTensors& t,
                                      const TrainerState& state, int world, int64_t keep_last);

// A weights-only checkpoint at iteration 0 (fp32 weights, no optimizer state), e.g.
// converted from Hugging Face: loading it starts training from these weights. `model_state` is
// model state outside the parameters by name (a trained expert bias, TrainingTensors::
// extra_state's names), kept in model.safetensors beside the weights.
std::string save_weights_checkpoint(
    const std::string& save_dir, const ModelSpec& spec,
    const std::function<std::vector<float>(const ParamInfo&)>& weights,
    const std::vector<std::pair<std::string, std::vector<float>>>& model_state = {});

// The checkpoint `path` names: `path` itself when it holds trainer_state.json, else the
// latest in the save directory `path` (its tracker file; without one, its newest iter_*
// directory). Empty when `path` holds no checkpoint.
std::string find_latest_checkpoint(const std::string& path);

// The complete checkpoints in a save directory, oldest first, with the run that wrote each.
struct SavedCheckpoint {
  int64_t iteration = 0;
  std::string dir;
  // Empty for checkpoints written before runs had ids; nullopt when trainer_state.json
  // cannot be read (then it belongs to no run).
  std::optional<std::string> run_id;
  // Whether run `id` may treat it as its own: written by it, or by a run without an id.
  bool belongs_to(const std::string& id) const {
    return run_id && (run_id->empty() || *run_id == id);
  }
};
std::vector<SavedCheckpoint> saved_checkpoints(const std::string& save_dir);

// The checkpoint a run resumes from: the latest under c.load; empty when `load` is unset, or
// when it is the save directory and holds none yet (the first run of a requeued job). Any
// other `load` without a checkpoint is a DataError.
std::string checkpoint_to_resume(const CheckpointConfig& c);

// The state a checkpoint holds for every parameter, as flat buffers in ParamLayout offsets
// (read as fp32 whatever dtype it was saved in). Master weights without optimizer state are
// the model weights.
enum class FlatState { Master, ExpAvg, ExpAvgSq };

// A checkpoint directory, checked when opened: trainer_state.json parses and has a known
// format version, every file it lists exists with the recorded size, every tensor of the
// model it describes is present with the right dtype and shape, and optimizer shards hold
// the ranges (or runs) trainer_state.json lists, which together cover every parameter. All
// reads are in the one-device layout's offsets, whatever mesh wrote the checkpoint. Tensor data is
// mapped, not read, until asked for. Each problem is a DataError naming the file and what
// was expected.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir);
  ~Checkpoint();

  const std::string& dir() const { return dir_; }
  const TrainerState& state() const { return state_; }
  const ModelSpec& spec() const { return spec_; }
  const ParamLayout& layout() const { return layout_; }
  bool has_optimizer_state() const { return optimizer_ || !shards_.empty() || !runs_.empty(); }
  bool sharded() const { return !shards_.empty() || !runs_.empty(); }

  // The dtype each kind of optimizer state was saved in (fp32 in checkpoints that record none).
  DType state_dtype(FlatState state) const { return state_dtypes_[static_cast<int>(state)]; }
  // fp32 master weights of `p` (the model weights when there is no optimizer state).
  std::vector<float> master(const ParamInfo& p) const;
  std::vector<float> exp_avg(const ParamInfo& p) const;     // needs optimizer state
  std::vector<float> exp_avg_sq(const ParamInfo& p) const;  // needs optimizer state
  // Calls fill(offset, values) for pieces of `state` in `r`, wherever the checkpoint keeps
  // them (one tensor per parameter, or shards' slices); together they hold every parameter
  // element of r (gaps between parameters may be absent). ExpAvg/ExpAvgSq need optimizer state.
  void read_flat(
      FlatState state, const ParamRange& r,
      const std::function<void(int64_t offset, const std::vector<float>& values)>& fill) const;
  // Any other tensor of the optimizer state (TrainingTensors::extra_state; a weights-only
  // checkpoint's in model.safetensors): null when absent.
  const SafetensorsTensor* optimizer_tensor(const std::string& name) const;
  std::vector<float> optimizer_values(const std::string& name) const;  // must exist

  // Throws DataError naming trainer_state.json and every differing key when the checkpoint
  // holds a model of other tensor shapes than `configured`; returns the differences that
  // only change what the weights compute (RoPE, norm epsilon, window), for a warning.
  std::vector<std::string> require_model(const ModelSpec& configured) const;

 private:
  struct Shard {
    std::unique_ptr<SafetensorsFile> file;
    std::vector<ParamRange> ranges;  // as trainer_state.json lists them
  };
  std::vector<float> read_param(FlatState state, const ParamInfo& p) const;
  const SafetensorsFile* optimizer_file_with(const std::string& name) const;

  std::string dir_;
  TrainerState state_;
  ModelSpec spec_;
  ParamLayout layout_;
  std::unique_ptr<SafetensorsFile> model_, optimizer_;  // model_ null in format 3
  std::vector<Shard> shards_;  // by rank; empty unless the optimizer state is sharded
  DType state_dtypes_[3] = {DType::F32, DType::F32, DType::F32};  // by FlatState
  // Format 3: the shards' runs of the one-device layout, sorted by their first element, each
  // at `packed` in its file's master, exp_avg and exp_avg_sq tensors.
  struct Run {
    int64_t begin, count;
    const SafetensorsFile* file;
    int64_t packed;
  };
  std::vector<std::unique_ptr<SafetensorsFile>> run_files_;
  std::vector<std::string> run_file_names_;
  std::vector<Run> runs_;
};

// Opens checkpoint `dir` and checks that it holds `configured`, as loading it would, without
// reading any tensor data: what a run checks before it writes anything. On any problem throws
// DataError with the cause and the newest earlier checkpoint beside it that opens cleanly.
TrainerState check_checkpoint_to_resume(const std::string& dir, const ModelSpec& configured);

// Loads checkpoint `dir` into t.master and the moments, the ranges t.owned names (all when
// empty) from whichever files hold them, so a checkpoint of any world size, sharded or not,
// loads into a run of any other. The compute-dtype weights are left for the caller to refresh from
// the master weights. Returns the checkpoint's state. On any problem throws DataError with the
// cause and the newest earlier checkpoint beside it that opens cleanly, by name. `warnings`
// receives behaviour differences between the checkpoint's model and t.spec. Without
// `optimizer_state` (finetune, no_load_optim) the moments start from zero whatever the
// checkpoint holds.
TrainerState load_checkpoint(const std::string& dir, const TrainingTensors& t,
                             std::vector<std::string>* warnings, bool optimizer_state = true);

}  // namespace tessera
