#include "tessera/train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <set>
#include <csignal>
#include <filesystem>
#include <optional>

#include <fmt/format.h>

#include "tessera/ckpt/hf_model.h"
#include "tessera/ckpt/model_spec_json.h"
#include "tessera/ckpt/peft_adapter.h"
#include "tessera/config/keys.h"
#include "tessera/core/content_digest.h"
#include "tessera/core/error.h"
#include "tessera/distributed/parallelize.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/init.h"
#include "tessera/obs/profiler/training_profiler.h"
#include "tessera/obs/tensorboard.h"
#include "tessera/plan/memory_plan.h"
#include "tessera/train/dpo_reference.h"
#include "tessera/train/frozen_reference.h"
#include "tessera/train/lr_schedule.h"
#include "tessera/train/run_directories.h"
#include "tessera/train/stop_signal.h"

namespace tessera {

namespace fs = std::filesystem;
namespace {

// What the precision line says of an MoE model's experts under FP8 (docs/fp8.md).
std::string fp8_experts_note(const ModelSpec& spec, const Fp8Options& fp8) {
  if (!spec.moe.enabled()) return "";
  return fp8.recipe == Fp8Recipe::Blockwise
             ? ", MoE experts bf16 (blockwise scaling covers the dense linears only)"
             : ", MoE experts fp8 (grouped GEMMs, a weight scale per expert)";
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

using Clock = std::chrono::steady_clock;

// exit_duration_in_mins counts from here, as Megatron's from its first statement: set-up
// (data, model, a checkpoint to load) spends the job's time as training does.
const Clock::time_point kProcessStart = Clock::now();

double minutes_since_process_start() {
  return std::chrono::duration<double, std::ratio<60>>(Clock::now() - kProcessStart).count();
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

std::string format_duration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}h{:02d}m", s / 3600, (s % 3600) / 60)
                   : fmt::format("{}m{:02d}s", s / 60, s % 60);
}

[[noreturn]] void stop_on_signal(Logger& log, int sig, const std::string& where) {
  const char* name = sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal";
  const std::string msg = fmt::format("received {}: stopped {}", name, where);
  log.clear_progress();
  log.warning("{}", msg);
  log.flush();
  throw TrainingAborted(msg, 128 + sig);
}

// Time to target, the seeds' time-to-convergence metric: wall time of the training loop
// (evaluations included) and the tokens consumed until the validation loss reached it.
void report_target_reached(Logger& log, MetricsWriter* metrics, double target, int64_t iteration,
                           double eval_loss, double seconds, uint64_t tokens) {
  log.clear_progress();
  log.info(
      "target loss {} reached at iteration {} after {:.1f} s ({} tokens): validation loss "
      "{:.4f}; stopping",
      target, iteration, seconds, tokens, eval_loss);
  if (!metrics) return;
  nlohmann::json j;
  j["iteration"] = iteration;
  j["target_loss"] = target;
  j["target_reached"] = true;
  j["eval_lm_loss"] = eval_loss;
  j["time_to_target_s"] = seconds;
  j["tokens_to_target"] = tokens;
  metrics->write(j);
}

std::string origin_of(const Experiment& e, const char* key) {
  const auto it = e.origin.find(key);
  return it == e.origin.end() ? "default" : it->second;
}

// The batch the trainer stages on the host: each micro-batch's tokens and targets (int32).
double host_batch_bytes(const TrainingConfig& t) {
  return 2.0 * sizeof(int32_t) * static_cast<double>(t.micro_batch_size) *
         static_cast<double>(t.seq_length);
}

// Tokens per micro-batch beyond which the planner's byte counts could overflow; no device
// holds even the input of such a micro-batch.
constexpr double kMaxPlannedTokens = 1e12;

}  // namespace

void check_device_runs(const Experiment& e, const RunSetup& setup, Backend& backend) {
  const ModelRuntime& rt = setup.runtime;
  if (rt.compute_dtype == DType::BF16 && !backend.supports(Capability::Bf16Compute))
    throw ConfigError(origin_of(e, "precision"), "precision", find_key("precision")->get(e),
                      "fp32 or auto on " + backend.description() +
                          ": bf16 training runs on GPUs (the CPU backend is the fp32 reference; "
                          "without a GPU, auto means fp32)");
  if (rt.fp8.enabled() && !backend.supports(Capability::Fp8TensorCores))
    throw ConfigError(origin_of(e, "fp8"), "fp8", find_key("fp8")->get(e),
                      "null on " + backend.description() +
                          ": FP8 GEMMs need a GPU with FP8 tensor cores (Hopper or newer)");
  if (rt.fp8.enabled() && rt.fp8.recipe == Fp8Recipe::Blockwise &&
      !backend.supports(Capability::Fp8BlockScaling))
    throw ConfigError(origin_of(e, "fp8_recipe"), "fp8_recipe", "blockwise",
                      "delayed or tensorwise on " + backend.description() +
                          ": its FP8 GEMMs take no 1x128 / 128x128 block scales (on CUDA: a "
                          "Hopper GPU, and cuBLASLt 12.9 or newer loaded at run time)");
  if (e.training.fp8_dot_product_attention && !backend.supports(Capability::Fp8Attention))
    throw ConfigError(origin_of(e, "fp8_dot_product_attention"), "fp8_dot_product_attention",
                      "true",
                      "false on " + backend.description() +
                          ": FP8 attention runs on the warpgroup kernels of Hopper GPUs (builds "
                          "for sm_90a)");
  check_fp8_gemm_multiple(e, backend.fp8_gemm_multiple(), backend.description());
  for (const char* key : {"reset_position_ids", "reset_attention_mask"})
    if (find_key(key)->get(e) == "true" && !backend.supports(Capability::PackedSequences))
      throw ConfigError(origin_of(e, key), key, "true",
                        "false on " + backend.description() +
                            ": it has no kernels for packed documents (positions and attention "
                            "per document)");
}

// Compares what the run needs with what the device has and, if it cannot fit, says how much
// each part takes and what to change. On the CPU backend the device is the host, so the
// trainer's host batch counts too.
void check_memory_fits(const Experiment& e, const RunSetup& setup, Backend& backend) {
  const TrainingConfig& t = e.training;
  const MemoryStats s = backend.memory_stats();
  if (s.device_free_bytes == 0) return;  // a device that does not say
  const double available = static_cast<double>(s.device_free_bytes + s.allocated_bytes);
  const double tokens = static_cast<double>(t.micro_batch_size) * static_cast<double>(t.seq_length);
  const bool host_device = backend.device().kind == DeviceKind::CPU;
  const double batch = host_device ? host_batch_bytes(t) : 0.0;
  std::optional<plan::MemoryPlan> m;
  if (tokens <= kMaxPlannedTokens) m = plan::plan_memory(plan::plan_input(setup, /*gpu=*/false));
  const double needed = m ? static_cast<double>(m->allocated()) + batch
                          // The embedding's output alone, a lower bound of the activations.
                          : tokens * static_cast<double>(setup.spec.hidden *
                                                         dtype_size(setup.runtime.compute_dtype)) +
                                batch;
  if (needed <= available) return;
  std::string advice;
  if (!m || m->activations > m->allocated() / 3 || batch > needed / 3) {
    advice = t.micro_batch_size > 1
                 ? "lower micro_batch_size (global_batch_size is kept by more accumulation steps)"
                 : "lower seq_length";
    if (t.recompute_granularity != RecomputeGranularity::Full)
      advice += ", or set recompute_granularity: full (or selective)";
  } else {
    advice =
        "use a smaller model (e.g. --num_layers) or more GPUs with a sharded optimizer "
        "(use_distributed_optimizer) or FSDP (use_torch_fsdp2)";
  }
  const std::string parts =
      m ? fmt::format(
              "weights {:.2f} GiB, gradients {:.2f} GiB, optimizer state {:.2f} GiB, "
              "activations {:.2f} GiB",
              m->weights / kGiB, m->gradients / kGiB, m->optimizer / kGiB, m->activations / kGiB)
        : fmt::format("activations at least {:.4g} GiB", (needed - batch) / kGiB);
  throw OutOfMemoryError(fmt::format(
      "not enough memory on {}: the run needs {:.2f} GiB but {:.2f} GiB is free. Breakdown: "
      "{} (micro_batch_size {}, seq_length {}, recompute {}){}{}. To fit: {}.",
      device_name(backend.device()), needed / kGiB, available / kGiB, parts, t.micro_batch_size,
      t.seq_length, t.recompute_granularity == RecomputeGranularity::None ? "off" : "on",
      m && m->fp8 > 0 ? fmt::format(", FP8 buffers {:.2f} GiB", m->fp8 / kGiB) : std::string(),
      batch > 0 ? fmt::format(", the host batch {:.2f} GiB", batch / kGiB) : std::string(),
      advice));
}

RunStart check_run_can_start(const Experiment& e, Backend& backend, int world_size, int rank) {
  RunStart start;
  // Loaded only when the model's vocabulary needs it.
  const RunSetup setup =
      make_run_setup(e, {world_size, backend.default_compute_dtype(), rank}, [&] {
        if (!start.tokenizer) start.tokenizer = make_tokenizer(e.data);
        return start.tokenizer->vocab_size();
      });
  check_device_runs(e, setup, backend);
  check_memory_fits(e, setup, backend);
  const CheckpointConfig& c = e.checkpoint;
  start.resume_dir = checkpoint_to_resume(c);
  const std::optional<LoraOptions> lora = lora_options(e.training);
  auto lora_text = [](const std::optional<LoraOptions>& o) {
    return o ? fmt::format("LoRA adapters of rank {}, alpha {} on {}", o->rank, o->alpha, fmt::join(o->targets, ","))
             : std::string("a model's weights");
  };
  if (!start.resume_dir.empty()) {
    const TrainerState s = check_checkpoint_to_resume(start.resume_dir, setup.spec);
    // finetune takes a model's weights (validation refuses it with LoRA).
    if (s.lora != lora && !(c.finetune && !s.lora))
      throw DataError(fmt::format("{}: holds {}; this run trains {} (lora_rank, lora_alpha, "
                                  "lora_target_modules): resume with the same, or save elsewhere",
                                  start.resume_dir, lora_text(s.lora), lora_text(lora)));
  }
  // pretrained_checkpoint and reference_load name a model's weights (not LoRA adapters).
  const auto check_weights = [&](const std::string& path, const char* key, const char* names) {
    const std::string dir = find_latest_checkpoint(path);
    if (dir.empty()) throw DataError(fmt::format("{}: no checkpoint in it ({})", path, key));
    if (check_checkpoint_to_resume(dir, setup.spec).lora)
      throw DataError(fmt::format("{}: holds LoRA adapters; {} names {} (a pretraining or full "
                                  "fine-tuning checkpoint)", dir, key, names));
  };
  if (lora && !c.pretrained_checkpoint.empty())
    check_weights(c.pretrained_checkpoint, "pretrained_checkpoint", "the weights they adapt");
  if (!c.reference_load.empty()) check_weights(c.reference_load, "reference_load", "a model's weights");
  if ((start.resume_dir.empty() || lora) && !c.hf_init_path.empty() && c.pretrained_checkpoint.empty())
    check_hf_weights(c.hf_init_path, setup.spec);
  if (e.training.objective == Objective::Grpo)
    check_grpo_prompts(e, start.tokenizer ? *start.tokenizer : *make_tokenizer(e.data, e.model_config.vocab_size));
  return start;
}

// objective dpo: the pairs; the reference (the starting weights, or what a resumed run's
// checkpoint records of them) and its log-probabilities of the dataset's pairs.
struct Trainer::DpoState {
  DpoOptions options;
  PreferenceSources pairs;
  std::string reference_weights, reference_digest;
  std::optional<DpoReferenceLogps> reference;  // once prepared; none when reference-free
  bool prepared = false;
  // dpo_precompute_ref_log_probs false: the reference weights, piece by piece as the optimizer
  // owns the policy's; `saved` keeps the policy's where the optimizer keeps no master copy
  // (fp32 weights of an unsharded run, bf16 main parameters); and the copy's log-probabilities
  // of the pairs read next.
  std::optional<FrozenReference> frozen;
  std::map<uint64_t, std::array<double, 2>> copy_logps;  // by dataset pair
  Tensor stats;  // (6) fp32 in the trainer's scalars: a batch's pair statistics, summed over the data-parallel ranks
};

Trainer::Trainer(const Experiment& experiment, std::unique_ptr<Backend> backend, Logger& logger,
                 MetricsWriter* metrics, dist::Communicator* comm, std::string run_id,
                 std::unique_ptr<Tokenizer> tokenizer, const GrpoGenerationLink* generation)
    : exp_(experiment),
      backend_(std::move(backend)),
      log_(logger),
      metrics_(metrics),
      comm_(comm),
      generation_(generation),
      tokenizer_(tokenizer ? std::move(tokenizer)
                           : make_tokenizer(exp_.data, exp_.model_config.vocab_size)),
      setup_(make_run_setup(
          exp_,
          {comm ? comm->size() : 1, backend_->default_compute_dtype(), comm ? comm->rank() : 0},
          [this] { return tokenizer_->vocab_size(); })),
      flops_per_token_(setup_.spec.flops_per_token(exp_.training.seq_length)),
      flops_per_token_causal_(setup_.spec.flops_per_token(
          exp_.training.seq_length, ModelSpec::AttentionCount::CausalHalf)),
      run_id_(std::move(run_id)) {
  install_stop_signal_handlers();
  check_device_can_run();
  // Before the host batch and the model are allocated: a micro-batch too large is refused
  // with the breakdown instead of failing inside an allocation.
  check_memory_fits();
  log_run();
  open_data();
  stop_if_signalled("while opening the data");
  build_model();
  stop_if_signalled("while building the model");
  start_state();
  stop_if_signalled("while loading the initial weights");
  profiler_ = profiler::TrainingProfiler::create(exp_, parallel_->rank(), parallel_->world_size(),
                                                 *backend_, log_);
  if (exp_.training.objective == Objective::Grpo) {
    if (completed_iterations_ > 0 && exp_.training.grpo_beta > 0 && !reference_)
      throw ConfigError(origin_of(exp_, "grpo_beta"), "grpo_beta", find_key("grpo_beta")->get(exp_),
                        "0 to resume a GRPO run: its KL reference, a frozen copy of the starting "
                        "weights, is not in its checkpoints (or name the reference's checkpoint "
                        "with reference_load)");
    std::unique_ptr<FrozenReference> reference;
    if (reference_) {
      reference = std::make_unique<FrozenReference>(std::move(*reference_));
      reference_.reset();
    }
    grpo_ = std::make_unique<GrpoRun>(
        GrpoRun::Parts{exp_, *model_, *optimizer_, *parallel_, *tokenizer_, log_, profiler_.get(), lora_,
                       generation_},
        std::move(reference), reference_weights_);
    log_.info("grpo: {}", grpo_->describe());
    if (!grpo_->has_validation() && exp_.data.eval_interval > 0)
      log_.warning("grpo: no valid_data_path: no held-out accuracy is measured");
  }
  // Megatron writes no TensorBoard values for skip_train's evaluation either.
  if (parallel_->rank() == 0 && !exp_.logging.tensorboard_dir.empty() && !exp_.data.skip_train) {
    tensorboard_ =
        std::make_unique<TrainingTensorBoard>(exp_.logging, exp_.tensorboard_directory());
    log_.info("tensorboard: {}", tensorboard_->path());
  }
}

void Trainer::stop_if_signalled(const char* doing) {
  if (int sig = pending_stop_signal())
    stop_on_signal(log_, sig, std::string("before training, ") + doing);
}

void Trainer::check_device_can_run() const {
  check_device_runs(exp_, setup_, *backend_);
}

void Trainer::log_run() const {
  const TrainingConfig& t = exp_.training;
  const ModelRuntime& rt = setup_.runtime;
  log_.info("backend: {}", backend_->description());
  log_.info("model: {}", setup_.spec.summary());
  const OptimizerDtypes& od = setup_.optimizer;
  log_.info(
      "precision: {} weights/activations, {} master weights, {} gradients, {}/{} AdamW "
      "moments{}",
      dtype_name(rt.compute_dtype),
      od.main_params == DType::F32 ? "fp32" : "no (bf16 parameters updated in place)",
      dtype_name(rt.grad_dtype), dtype_name(od.exp_avg), dtype_name(od.exp_avg_sq),
      rt.fp8.enabled()
          ? fmt::format("; FP8 {} linear layers ({} scaling, amax history {}, margin {}, "
                        "weight transpose cache {}, output head {}, fast accumulation: {}{})",
                        find_key("fp8")->get(exp_), find_key("fp8_recipe")->get(exp_),
                        t.fp8_amax_history_len, t.fp8_margin,
                        t.fp8_weight_transpose_cache ? "on" : "off", t.fp8_lm_head ? "fp8" : "bf16",
                        fast_accumulation_kinds(rt.fp8), fp8_experts_note(setup_.spec, rt.fp8))
          : "");
  if (const MoeSpec& moe = setup_.spec.moe; moe.enabled())
    log_.info(
        "moe: {} of {} layers with {} experts, top-{}, {}; routing {}; model FLOPs "
        "count the active parameters ({:.3f}B of {:.3f}B)",
        moe.moe_layers(), setup_.spec.num_layers, moe.experts, moe.topk,
        moe.capacity_factor > 0
            ? fmt::format("capacity factor {} ({} of a micro-batch's {} pairs per expert, beyond "
                          "that the {} dropped)",
                          moe.capacity_factor, moe.capacity(rt.tokens()), rt.tokens() * moe.topk,
                          moe.drop_by_position ? "latest tokens" : "lowest weights")
            : std::string("dropless"),
        rt.moe_force_balance ? "force-balanced (round-robin, benchmark mode)" : "by the router",
        setup_.spec.active_params() / 1e9, setup_.spec.total_params() / 1e9);
  if (!comm_ && (t.use_distributed_optimizer || t.use_torch_fsdp2))
    log_.warning(
        "{} shards state over data-parallel ranks; this run has one (start it with "
        "tessera launch --nproc_per_node N to shard)",
        t.use_torch_fsdp2 ? "use_torch_fsdp2" : "use_distributed_optimizer");
}

void Trainer::open_data() {
  // Validation samples are made for runs that evaluate; skip_train's does whatever
  // eval_interval says.
  // GRPO's prompts are read with the model that generates from them (train/grpo_run.h).
  if (exp_.training.objective == Objective::Grpo) return open_host_batch();
  Experiment data_exp = exp_;
  if (exp_.data.skip_train) data_exp.data.eval_interval = 1;
  data_ = make_data_sources(data_exp, *tokenizer_, setup_.data_vocab);
  log_.info("data: {}", data_.description);
  if (exp_.training.objective == Objective::Dpo) {
    dpo_ = std::make_unique<DpoState>();
    const TrainingConfig& t = exp_.training;
    dpo_->options = {t.dpo_loss_type,        t.dpo_beta,           t.dpo_label_smoothing,
                     t.dpo_length_normalize, t.dpo_reference_free, t.dpo_rpo_alpha};
    dpo_->pairs = make_preference_sources(exp_, setup_.data_vocab, tokenizer_->name(),
                                          tokenizer_->eod_id());
    log_.info("dpo: {}{}", dpo_->pairs.train->describe(),
              dpo_->pairs.valid ? "; validation " + dpo_->pairs.valid->describe() : "");
    choose_dpo_layout();
  }
  if (!data_.valid &&
      (exp_.data.eval_interval > 0 || exp_.data.target_loss > 0 || exp_.data.skip_train)) {
    const std::string why = fmt::format(
        "no validation data (split '{}' leaves none, or set valid_data_path)", exp_.data.split);
    if (exp_.data.target_loss > 0) throw DataError(why + ": target_loss cannot be checked");
    if (exp_.data.skip_train) throw DataError(why + ": skip_train has nothing to evaluate");
    log_.warning("{}: evaluation is disabled", why);
  }
  open_host_batch();
}

// The prompt once saves the GEMMs, norms and MLPs of its rows in the rejected side: rows of
// the longest pair so laid out (every pair is read for it), rounded up so that sequence
// parallelism and FP8 GEMMs (16 rows, blockwise scaling's blocks) divide them. Attention
// still runs over both sides apart.
void Trainer::choose_dpo_layout() {
  const TrainingConfig& t = exp_.training;
  ModelRuntime& rt = setup_.runtime;
  if (!t.dpo_shared_prompt) return;
  const char* batched = nullptr;
  if (rt.context_parallel_size > 1) batched = "context parallelism splits each side over its ranks";
  if (setup_.spec.mla.enabled) batched = "multi-head latent attention";
  if (batched) {
    log_.info("dpo: each side its own sequence (dpo_shared_prompt: not with {})", batched);
    return;
  }
  PreferenceSource::SharedExtent longest = dpo_->pairs.train->shared_extent();
  if (dpo_->pairs.valid) {
    const PreferenceSource::SharedExtent valid = dpo_->pairs.valid->shared_extent();
    longest = {std::max(longest.row, valid.row), std::max(longest.side, valid.side)};
  }
  const bool blockwise = rt.fp8.enabled() && rt.fp8.recipe == Fp8Recipe::Blockwise;
  const int64_t multiple = std::lcm<int64_t>(blockwise ? kFp8BlockSize : 16, rt.tensor_parallel_size);
  const auto round_up = [&](int64_t n) { return (n + multiple - 1) / multiple * multiple; };
  const int64_t row = round_up(longest.row);
  if (row >= 2 * t.seq_length) {
    log_.info("dpo: each side its own sequence (with their prompt once the longest pair takes "
              "{} rows, no fewer than two sides of {})", longest.row, t.seq_length);
    return;
  }
  // Attention's sides need be no longer than the longest side: what lies beyond is padding,
  // which no answer's row sees.
  rt.shared_prompt_side = std::min(round_up(longest.side), t.seq_length);
  rt.seq_length = row;
  rt.micro_batch = 1;
  rt.reset_position_ids = true;
  if (!pipelined()) rt.pipeline_slots = 1;
  log_.info("dpo: each pair in one sequence of {} tokens with its prompt once (the longest pair "
            "takes {}, two sides {}); attention over each side apart, as sequences of {}", row,
            longest.row, 2 * t.seq_length, rt.shared_prompt_side);
}

void Trainer::open_host_batch() {
  // Whole sequences: under context parallelism the model takes its share of them.
  const int64_t N = setup_.runtime.micro_batch *
                    (shared_prompts() ? setup_.runtime.seq_length : exp_.training.seq_length);
  host_tokens_.resize(N);
  host_targets_.resize(N);
  host_positions_.resize(N);
}

// The model, its parallel layout and optimizer, and the step's device scalars; an
// out-of-memory error on the way gets the planner's breakdown when the plan says it cannot
// fit.
void Trainer::build_model() {
  const TrainingConfig& t = exp_.training;
  try {
    if (const std::optional<LoraOptions> lora = lora_options(t)) {
      auto model = std::make_unique<LoraModel>(*backend_, setup_.spec, setup_.runtime, *lora);
      lora_ = model.get();
      model_ = std::move(model);
    } else {
      model_ = std::make_unique<DecoderModel>(*backend_, setup_.spec, setup_.runtime);
    }
    parallel_ =
        dist::parallelize(*model_, setup_.mesh, comm_,
                          dist::DataParallelOptions{t.use_distributed_optimizer, t.use_torch_fsdp2,
                                                    t.overlap_grad_reduce, t.overlap_param_gather,
                                                    t.ddp_bucket_size});
    optimizer_ = std::make_unique<AdamWOptimizer>(*model_, t, parallel_->optimizer_shards());
    step_hooks_ = model_->step_hooks();
    // kTrainerScalarBytes, as the memory plan counts them.
    scalar_buffer_ = DeviceBuffer(*backend_, plan::kTrainerScalarBytes, "trainer scalars");
  } catch (const OutOfMemoryError& e) {
    check_memory_fits();  // reports the breakdown if the estimate now says it cannot fit
    throw;
  }
  grad_norm_sq_ = scalar_buffer_.tensor(DType::F32, {1});
  stop_signal_ = scalar_buffer_.tensor(DType::F32, {1}, sizeof(float));
  out_of_time_flag_ = scalar_buffer_.tensor(DType::F32, {1}, 2 * sizeof(float));
  if (dpo_) dpo_->stats = scalar_buffer_.tensor(DType::F32, {6}, 4 * sizeof(float));
}

// Initial weights (fresh, a checkpoint or Hugging Face) on every rank, and the rules that
// keep ranks alike from here on.
void Trainer::start_state() {
  ranks_stop_together_ = parallel_->world_size() > 1 && !exp_.checkpoint.save.empty();
  optimizer_->write_master([&](const std::vector<FlatSlice>& slices) {
    init_parameters(*backend_, setup_.spec, model_->layout(), slices,
                    static_cast<uint64_t>(exp_.training.seed));
  });
  if (lora_) load_lora_base();
  if (!exp_.checkpoint.reference_load.empty()) load_reference();
  restore_start_state();
  if (dpo_) identify_dpo_reference();
  optimizer_->sync_params_from_master();
  for (StepHook* hook : step_hooks_) hook->attach(*parallel_);
  parallel_->params_updated();
  if (comm_)
    log_.info("parallel: {} ranks ({}), {}", parallel_->world_size(), comm_->description(),
              parallel_->description());
  const MemoryStats mem = backend_->memory_stats();
  log_.info("memory: {:.3f} GiB allocated on {} ({:.3f} GiB free)", mem.allocated_bytes / kGiB,
            device_name(backend_->device()), mem.device_free_bytes / kGiB);
}

Trainer::~Trainer() = default;

TrainingTensors Trainer::training_tensors() const {
  TrainingTensors t;
  t.backend = backend_.get();
  t.spec = &setup_.spec;
  t.layout = &model_->layout();
  t.params_dtype = setup_.runtime.compute_dtype;
  t.param = [parallel = parallel_.get()](int index) { return parallel->gathered_param(index); };
  t.master = optimizer_->master();
  // Sharded bf16 main parameters are this rank's parameter slices, wherever they lie.
  if (optimizer_->sharded() && optimizer_->params_are_master())
    for (const FlatSlice& s : optimizer_->master_slices()) t.master_ranges.push_back(s.values);
  if (optimizer_->splits_master())
    for (const OwnedParams& o : optimizer_->owned_params()) t.master_high.push_back(o.params);
  t.exp_avg = optimizer_->exp_avg();
  t.exp_avg_sq = optimizer_->exp_avg_sq();
  for (const StepHook* hook : step_hooks_)
    for (const auto& state : hook->state()) t.extra_state.push_back(state);
  for (const auto& state : model_->persistent_state()) t.extra_state.push_back(state);
  if (optimizer_->sharded()) t.owned = optimizer_->owned();
  return t;
}

void Trainer::state_restored() {
  for (StepHook* hook : step_hooks_) hook->state_restored();
}

// What made a step's gradient norm non-finite: a hook's finding, else the gradient itself.
std::string Trainer::non_finite_cause() const {
  for (const StepHook* hook : step_hooks_)
    if (std::string cause = hook->non_finite_cause(); !cause.empty()) return cause;
  return "gradient";
}

// reference_load: its weights go into the policy's place and are kept in a frozen copy; the
// starting weights are then loaded over them (validation requires the run to have some).
void Trainer::load_reference() {
  const std::string dir = find_latest_checkpoint(exp_.checkpoint.reference_load);
  if (dir.empty())
    throw DataError(fmt::format("{}: no checkpoint in it (reference_load)", exp_.checkpoint.reference_load));
  TrainingTensors t = training_tensors();
  t.extra_state.clear();  // the weights alone: FP8 scales and expert biases are the policy's
  std::vector<std::string> differences;
  load_checkpoint(dir, t, &differences, /*optimizer_state=*/false);
  optimizer_->sync_params_from_master();
  reference_.emplace(*backend_, *optimizer_, *model_, *parallel_);
  reference_weights_ = "the checkpoint " + dir + " (reference_load)";
  reference_files_ = {(fs::path(dir) / "model.safetensors").string()};
  log_.info("reference: the weights of {}, a frozen copy of {:.3f} GiB on the device", dir,
            static_cast<double>(reference_->bytes()) / kGiB);
}

// Where the run starts: the latest checkpoint under `load` (its counters too), else the
// Hugging Face weights at hf_init_path, else the fresh initialisation already in place.
void Trainer::restore_start_state() {
  const CheckpointConfig& c = exp_.checkpoint;
  const std::string dir = checkpoint_to_resume(c);
  std::vector<std::string> differences;
  if (!dir.empty() && c.finetune) {
    const TrainerState s =
        load_checkpoint(dir, training_tensors(), &differences, /*optimizer_state=*/false);
    if (s.extra_state_restored) state_restored();
    initial_weights_ = "the checkpoint " + dir + " (finetune: its weights only)";
    initial_weight_files_ = {(fs::path(dir) / "model.safetensors").string()};
    log_.info(
        "finetune: the weights of {} (its iteration {}); iteration, data position, learning "
        "rate schedule and optimizer state start from zero{}",
        dir, s.iteration, c.hf_init_path.empty() ? "" : "; hf_init_path is not used");
  } else if (!dir.empty()) {
    const TrainerState s = load_checkpoint(dir, training_tensors(), &differences,
                                           /*optimizer_state=*/!c.no_load_optim);
    if (c.no_load_optim) log_.info("no_load_optim: the optimizer state starts from zero");
    completed_iterations_ = s.iteration;
    consumed_samples_ = s.consumed_samples;
    applied_steps_ = s.applied_steps;
    skipped_iterations_ = s.skipped_iterations;
    consecutive_nan_ = s.consecutive_nan;
    if (s.extra_state_restored) state_restored();
    if (run_id_.empty()) run_id_ = s.run_id;
    if (s.iteration > 0 && s.seed != exp_.training.seed)
      differences.push_back(
          fmt::format("seed: {} in the checkpoint, {} configured (the data order changes)", s.seed,
                      exp_.training.seed));
    initial_weights_ = "the checkpoint " + dir;
    if (dpo_) dpo_->reference_weights = s.dpo_reference_weights, dpo_->reference_digest = s.dpo_reference_digest;
    log_.info("resumed from {} at iteration {} ({} consumed samples; saved by {} rank{}){}", dir,
              s.iteration, s.consumed_samples, s.world_size, s.world_size == 1 ? "" : "s",
              c.hf_init_path.empty() ? "" : "; hf_init_path is not used");
  } else {
    if (!c.load.empty()) log_.warning("no checkpoint in {} yet (load): starting a new run", c.load);
    if (!c.hf_init_path.empty() && !lora_) {
      optimizer_->write_master([&](const std::vector<FlatSlice>& slices) {
        differences = load_hf_weights(c.hf_init_path, setup_.spec, model_->layout(), *backend_,
                                      slices, model_->persistent_state());
      });
      initial_weights_ = "the Hugging Face model at hf_init_path " + c.hf_init_path;
      initial_weight_files_ = hf_weight_files(c.hf_init_path);
      log_.info("initial weights: Hugging Face model {}", c.hf_init_path);
    }
  }
  for (const auto& d : differences)
    log_.warning("the loaded model differs from the configuration: {}", d);
  if (run_id_.empty()) run_id_ = new_run_id();
}

int64_t Trainer::trainable_parameters() const {
  int64_t n = 0;
  for (const ParamInfo& p : model_->layout().params) n += p.numel();
  return n;
}

void Trainer::load_lora_base() {
  const CheckpointConfig& c = exp_.checkpoint;
  const ParamLayout& base = lora_->base_layout();
  // Under FSDP each rank holds its shards of the base's units.
  const std::vector<FlatSlice> weights = lora_->base_slices();
  std::vector<std::string> differences;
  std::string from = "a fresh initialisation (no pretrained_checkpoint or hf_init_path)";
  if (!c.pretrained_checkpoint.empty()) {
    const std::string dir = find_latest_checkpoint(c.pretrained_checkpoint);
    if (dir.empty())
      throw DataError(fmt::format("{}: no checkpoint in it (pretrained_checkpoint): expected the save "
                                  "directory of the run whose weights LoRA adapts",
                                  c.pretrained_checkpoint));
    TrainingTensors t;
    t.backend = backend_.get();
    t.spec = &setup_.spec;
    t.layout = &base;
    t.params_dtype = setup_.runtime.compute_dtype;
    for (const FlatSlice& w : weights) {
      t.owned.push_back(w.range);
      t.master_ranges.push_back(w.values);
    }
    const TrainerState s = load_checkpoint(dir, t, &differences, /*optimizer_state=*/false);
    from = fmt::format("the checkpoint {} (its iteration {})", dir, s.iteration);
    initial_weight_files_ = {(fs::path(dir) / "model.safetensors").string()};
  } else if (!c.hf_init_path.empty()) {
    differences = load_hf_weights(c.hf_init_path, setup_.spec, base, *backend_, weights, {});
    from = "the Hugging Face model " + c.hf_init_path;
    initial_weight_files_ = hf_weight_files(c.hf_init_path);
  } else {
    init_parameters(*backend_, setup_.spec, base, weights, static_cast<uint64_t>(exp_.training.seed));
  }
  for (const auto& d : differences) log_.warning("the LoRA base differs from the configuration: {}", d);
  const LoraOptions& o = lora_->options();
  const int64_t trainable = trainable_parameters();
  log_.info("LoRA: rank {}, alpha {} on {}: {} trainable parameters ({:.3f}% of {}); frozen base from {}",
            o.rank, o.alpha, fmt::join(o.targets, ", "), trainable,
            100.0 * static_cast<double>(trainable) / static_cast<double>(setup_.spec.total_params()),
            setup_.spec.total_params(), from);
  initial_weights_ = "LoRA adapters on " + from;
}

std::string Trainer::save_checkpoint() {
  const auto t0 = Clock::now();
  TrainerState s;
  s.iteration = completed_iterations_;
  s.consumed_samples = consumed_samples_;
  s.applied_steps = applied_steps_;
  s.skipped_iterations = skipped_iterations_;
  s.consecutive_nan = consecutive_nan_;
  s.seed = exp_.training.seed;
  s.world_size = parallel_->world_size();
  s.run_id = run_id_;
  if (dpo_) s.dpo_reference_weights = dpo_->reference_weights, s.dpo_reference_digest = dpo_->reference_digest;
  s.config_yaml = experiment_to_yaml(exp_);
  if (lora_) s.lora = lora_->options();
  const CheckpointConfig& c = exp_.checkpoint;
  TrainingTensors t = training_tensors();
  std::string dir;
  const int rank = parallel_->rank(), world = parallel_->world_size();
  const dist::DeviceMesh& mesh = setup_.mesh;
  // A model split over tensor-parallel ranks, pipeline stages or (its experts)
  // expert-parallel ranks: no rank holds all of it.
  const bool split = mesh.size(dist::MeshDim::TP) > 1 || mesh.size(dist::MeshDim::PP) > 1 ||
                     mesh.size(dist::MeshDim::EP) > 1;
  if (!optimizer_->sharded() && !split) {
    // Plain data-parallel ranks hold the same state: rank 0 writes it.
    if (rank == 0) dir = tessera::save_checkpoint(c.save, t, s, c.ckpt_keep_last);
  } else {
    // ZeRO-1 and FSDP ranks each hold a shard of the optimizer state, the parts of a split
    // model each a part of the model: each writes its own (a part once, by its first data x
    // context-parallel rank; the experts by their first expert-data-parallel rank), and rank 0
    // publishes the checkpoint once all are on disk. Whole parameters are the same on every
    // tensor-parallel rank, and without ZeRO-1 on every expert-parallel rank: the first writes
    // them.
    auto first = [&](dist::MeshDim d) { return mesh.coordinate(rank, d) == 0; };
    const bool writes =
        optimizer_->sharded() ||
        (mesh.size(dist::MeshDim::EP) > 1 ? first(dist::MeshDim::ExpertDP)
                                          : first(dist::MeshDim::DP) && first(dist::MeshDim::CP));
    const bool whole_params =
        first(dist::MeshDim::TP) && (optimizer_->sharded() || first(dist::MeshDim::EP));
    if (!optimizer_->sharded()) t.owned = {{0, model_->layout().total}};
    if (rank == 0) begin_sharded_checkpoint(c.save, s.iteration);
    parallel_->barrier();
    if (writes) write_checkpoint_shard(c.save, t, s.iteration, rank, world, whole_params);
    // FSDP: rank 0 has just gathered every parameter unit to write model.safetensors (a split
    // model writes none: its master weights are the weights).
    if (rank != 0 && parallel_->params_sharded() && !split) parallel_->follow_gathers();
    parallel_->barrier();
    if (rank == 0) dir = finish_sharded_checkpoint(c.save, t, s, world, c.ckpt_keep_last);
  }
  // LoRA: the adapters in peft's format beside them (PeftModel.from_pretrained(base, dir)),
  // whole: under tensor parallelism every rank takes part in gathering the split ones.
  if (lora_ && (rank == 0 || split)) {
    ParamLayout whole = model_->layout();
    std::vector<std::vector<uint8_t>> values;
    for (size_t i = 0; i < whole.params.size(); ++i) {
      values.push_back(lora_->whole_adapter(static_cast<int>(i)));
      whole.params[i].shape = whole.params[i].full_shape;
    }
    if (rank == 0)
      write_peft_adapter(dir, lora_->options(), whole, setup_.runtime.compute_dtype,
                         [&values](int index, void* dst) { std::memcpy(dst, values[index].data(), values[index].size()); });
  }
  // No rank goes on before the checkpoint is published: one that exits now (a signal stop)
  // would make the others abort, rank 0 in the middle of publishing.
  parallel_->barrier();
  last_saved_iteration_ = completed_iterations_;
  if (rank != 0) return "";
  log_.clear_progress();
  log_.info("saved checkpoint {} in {:.1f} s", dir, ms_since(t0) / 1e3);
  return dir;
}

// A stop signal to act on after an iteration (0: none). Data-parallel ranks save together,
// so they stop together: on the largest signal number any of them had received before the
// iteration's optimizer step (agree_on_stop_signal); a later one is agreed on in the next.
int Trainer::stop_signal_after_iteration() {
  return ranks_stop_together_ ? agreed_stop_signal_ : pending_stop_signal();
}

// One small all-reduce and host read per iteration, before the optimizer step, so that no
// collective on the compute stream follows the parameter gather.
int Trainer::agree_on_stop_signal() {
  float sig = static_cast<float>(pending_stop_signal());
  backend_->upload(stop_signal_, &sig);
  parallel_->max(stop_signal_);
  backend_->download(&sig, stop_signal_);
  return static_cast<int>(sig);
}

// Every rank reads its own clock: the ranks take the largest verdict (Megatron's MAX
// all-reduce), so that all stop after the same iteration.
bool Trainer::agree_out_of_time() {
  float late = minutes_since_process_start() > exp_.training.exit_duration_in_mins ? 1.0f : 0.0f;
  if (parallel_->world_size() == 1) return late > 0;
  backend_->upload(out_of_time_flag_, &late);
  parallel_->max(out_of_time_flag_);
  backend_->download(&late, out_of_time_flag_);
  return late > 0;
}

// Megatron checks the duration first; the last iteration needs no early exit.
std::string Trainer::exit_reason(int64_t it) const {
  const TrainingConfig& t = exp_.training;
  if (it >= t.train_iters) return "";
  if (out_of_time_)
    return fmt::format("the process has run {:.2f} minutes (exit_duration_in_mins {})",
                       minutes_since_process_start(), t.exit_duration_in_mins);
  if (t.exit_interval > 0 && it % t.exit_interval == 0)
    return fmt::format("it is a multiple of exit_interval ({})", t.exit_interval);
  return "";
}

// Saves the state (when `save` is set) before stopping, so a preempted job can resume.
void Trainer::stop_for_signal(int sig, const std::string& where) {
  if (!exp_.checkpoint.save.empty() && last_saved_iteration_ != completed_iterations_)
    save_checkpoint();
  stop_on_signal(log_, sig, where);
}

void Trainer::check_memory_fits() const {
  tessera::check_memory_fits(exp_, setup_, *backend_);
}

// A model replica (the ranks of one data-parallel rank: its tensor-parallel group) trains on
// micro_batch x seq_length x accumulation tokens per step, shared by its GPUs.
// Per what the throughput is: a GPU, or on the CPU backend a rank (a thread group of this
// process), as the run report says.
std::string_view Trainer::device_word() const {
  return backend_->device().kind == DeviceKind::GPU ? "GPU" : "rank";
}

int64_t Trainer::positions_per_step() const {
  return exp_.training.global_batch_size * exp_.training.seq_length * (dpo_ ? 2 : 1);
}

// A model replica's GPUs share its samples' tokens.
double Trainer::tokens_per_gpu_per_step() const {
  return static_cast<double>(positions_per_step()) / parallel_->world_size();
}

void Trainer::load_micro_batch(const SampleSource& source, uint64_t first_sample) {
  const profiler::PhaseSpan span(profiler_.get(), "data_loading");
  const int64_t T = exp_.training.seq_length;
  // Packed documents: each token's position in its document, for rope and attention.
  const bool packed = setup_.runtime.packed_documents();
  if (packed) host_positions_.resize(host_tokens_.size());
  for (int64_t b = 0; b < exp_.training.micro_batch_size; ++b)
    source.sample(first_sample + b, host_tokens_.data() + b * T, host_targets_.data() + b * T,
                  packed ? host_positions_.data() + b * T : nullptr);
  model_->set_batch(host_tokens_.data(), host_targets_.data(),
                    packed ? host_positions_.data() : nullptr);
}

int64_t Trainer::loss_positions(const SampleSource& source, uint64_t first, uint64_t count) const {
  const int64_t T = exp_.training.seq_length;
  if (!source.masks_targets()) return static_cast<int64_t>(count) * T;
  const profiler::PhaseSpan span(profiler_.get(), "loss_mask_count");
  std::vector<int32_t> tokens(static_cast<size_t>(T)), targets(static_cast<size_t>(T));
  int64_t counted = 0;
  for (uint64_t i = first; i < first + count; ++i) {
    source.sample(i, tokens.data(), targets.data());
    counted += std::count_if(targets.begin(), targets.end(), [](int32_t x) { return x >= 0; });
  }
  return counted;
}

int64_t Trainer::sample_pair_side(const PreferenceSource& pairs, uint64_t index, int side, int64_t row) {
  const int64_t T = exp_.training.seq_length;
  pairs.sample(index, side, host_tokens_.data() + row * T, host_targets_.data() + row * T,
               host_positions_.data() + row * T);
  return std::count_if(host_targets_.begin() + row * T, host_targets_.begin() + (row + 1) * T,
                       [](int32_t t) { return t >= 0; });
}

// The model's summed loss over the answer's targets is minus its log-probability; *tokens:
// how many targets that is. Each side has its own activation slot (run setup gives a DPO
// model two), so both answers' passes are kept for their backward.
double Trainer::answer_logp(const PreferenceSource& pairs, uint64_t index, int side, int64_t* tokens) {
  model_->use_slot(side);
  const int64_t counted = sample_pair_side(pairs, index, side, 0);
  model_->set_batch(host_tokens_.data(), host_targets_.data(), host_positions_.data());
  if (tokens) *tokens = counted;
  model_->zero_loss_sum();
  model_->forward_loss();
  parallel_->sum_over_sequence(model_->loss_sum());  // context-parallel ranks hold parts of it
  float loss_sum = 0;
  backend_->download(&loss_sum, model_->loss_sum());
  return -static_cast<double>(loss_sum);
}

// Context-parallel ranks hold the same sequences' log-probabilities: host values summed over
// the data-parallel group (which spans them) count once, from the first.
bool Trainer::counts_sequence_values() const {
  return model_->runtime().context_parallel_rank == 0 && holds_output_head();
}

bool Trainer::holds_output_head() const {
  const std::vector<LayerRange>& chunks = model_->runtime().pipeline_chunks;
  return chunks.empty() || chunks.back().end() == model_->spec().num_layers;
}

bool Trainer::pipelined() const {
  return exp_.training.pipeline_model_parallel_size > 1;
}

int64_t Trainer::load_pair(const PreferenceSource& pairs, uint64_t index, std::array<int64_t, 2>* tokens) {
  if (shared_prompts()) {
    const SharedPromptPair layout = pairs.sample_shared(index, setup_.runtime.seq_length, host_tokens_.data(),
                                                        host_targets_.data(), host_positions_.data());
    const auto counts = [&](int64_t begin, int64_t end) {
      return std::count_if(host_targets_.begin() + begin, host_targets_.begin() + end, [](int32_t t) { return t >= 0; });
    };
    if (tokens) *tokens = {counts(0, layout.chosen_end), counts(layout.chosen_end, layout.rejected_end)};
    model_->set_shared_prompt_pairs({&layout, 1});
    model_->set_batch(host_tokens_.data(), host_targets_.data(), host_positions_.data());
    return layout.chosen_end;
  }
  for (int side = 0; side < 2; ++side) {
    const int64_t counted = sample_pair_side(pairs, index, side, side);
    if (tokens) (*tokens)[side] = counted;
  }
  model_->set_batch(host_tokens_.data(), host_targets_.data(), host_positions_.data());
  return model_->runtime().tokens() / 2;
}

// Each answer's summed token losses is minus its log-probability; context-parallel ranks hold
// parts of both.
std::array<double, 2> Trainer::sequence_logps(int64_t rejected_row) {
  std::vector<float> losses(static_cast<size_t>(model_->runtime().tokens()));
  backend_->download(losses.data(), model_->token_losses());
  const auto split = losses.begin() + rejected_row;
  std::array<float, 2> sums = {static_cast<float>(-std::accumulate(losses.begin(), split, 0.0)),
                               static_cast<float>(-std::accumulate(split, losses.end(), 0.0))};
  if (model_->runtime().context_parallel_size > 1) {
    const Tensor both = dpo_->stats.flat_range(0, 2);
    backend_->upload(both, sums.data());
    parallel_->sum_over_sequence(both);
    backend_->download(sums.data(), both);
  }
  return {sums[0], sums[1]};
}

std::array<double, 2> Trainer::pair_logps(const PreferenceSource& pairs, uint64_t index,
                                          std::array<int64_t, 2>* tokens) {
  if (!pipelined() && shared_prompts()) {
    const int64_t rejected_row = load_pair(pairs, index, tokens);
    model_->zero_loss_sum();
    model_->forward_loss();
    return sequence_logps(rejected_row);
  }
  if (!pipelined()) {
    int64_t chosen = 0, rejected = 0;
    const std::array<double, 2> logps = {answer_logp(pairs, index, 0, &chosen), answer_logp(pairs, index, 1, &rejected)};
    if (tokens) *tokens = {chosen, rejected};
    return logps;
  }
  if (tokens) *tokens = {0, 0};
  // One micro-batch through the stages: the last stage's slot then holds its losses.
  model_->zero_loss_sum();
  int64_t rejected_row = 0;
  parallel_->run_forward_passes(1, [&](int64_t) { rejected_row = load_pair(pairs, index, tokens); }, [](int64_t) {});
  return holds_output_head() ? sequence_logps(rejected_row) : std::array<double, 2>{0, 0};
}

// A DPO run's reference is its starting weights, or reference_load's: their digest (with the
// model they are loaded into) keys the stored log-probabilities. A resumed run has the one its
// checkpoint recorded, which the reference it loads again must match.
void Trainer::identify_dpo_reference() {
  if (dpo_->options.reference_free) return;
  const std::vector<std::string>& files = reference_ ? reference_files_ : initial_weight_files_;
  const auto digest = [&] {
    ContentDigest d;
    d.add(spec_to_json(setup_.spec).dump());
    if (files.empty()) d.add(fmt::format("a fresh initialisation, seed {}", exp_.training.seed));
    for (const std::string& file : files) {
      d.add(fs::path(file).filename().string());
      d.add_file(file);
    }
    return d.hex();
  };
  if (!dpo_->reference_digest.empty()) {
    // A resumed run that loads its reference again must load the one it started with.
    if (reference_ && !setup_.reference_copy && digest() != dpo_->reference_digest)
      throw DataError(fmt::format(
          "{}: its run's DPO reference was {}; reference_load names {}, other weights: resume "
          "with the same reference", checkpoint_to_resume(exp_.checkpoint), dpo_->reference_weights,
          reference_weights_));
    return;
  }
  if (setup_.reference_copy) {  // its log-probabilities are not kept: nothing to key
    // A resumed frozen copy (reference_load's) must be the one the run started with: its
    // checkpoint records which.
    if (completed_iterations_ > 0 && reference_ && !dpo_->reference_weights.empty() &&
        dpo_->reference_weights != reference_weights_)
      throw DataError(fmt::format(
          "{}: its run's DPO reference was {}; reference_load names {}: resume with the same "
          "reference", checkpoint_to_resume(exp_.checkpoint), dpo_->reference_weights,
          reference_weights_));
    dpo_->reference_weights = reference_ ? reference_weights_ : initial_weights_;
    return;
  }
  if (completed_iterations_ > 0)
    throw DataError(fmt::format(
        "{}: records no DPO reference (written before DPO runs recorded theirs); a resumed run "
        "cannot tell which reference log-probabilities are its own: start again from the "
        "starting weights (finetune)", checkpoint_to_resume(exp_.checkpoint)));
  dpo_->reference_weights = reference_ ? reference_weights_ : initial_weights_;
  dpo_->reference_digest = digest();
}

// Before the first step or validation: the reference's log-probabilities of every pair the
// run reads, from the file kept for this dataset and reference, the missing ones computed
// now with the starting weights (each data-parallel rank every dp-th) and the file updated.
void Trainer::prepare_dpo_reference() {
  if (dpo_->prepared) return;
  dpo_->prepared = true;
  if (dpo_->options.reference_free) {
    log_.info("dpo: reference-free (dpo_reference_free): no reference log-probabilities");
    return;
  }
  if (setup_.reference_copy) {
    keep_dpo_reference_copy();
    return;
  }
  const auto start = Clock::now();
  const TrainingConfig& t = exp_.training;
  const PreferenceSource& train = *dpo_->pairs.train;
  DpoReferenceKey key{train.prefix(), preference_dataset_digest(train.prefix()), train.dataset_pairs(),
                      dpo_->reference_weights, dpo_->reference_digest, t.seq_length};
  const std::string path =
      t.dpo_reference_logps.empty() ? default_reference_logps_path(key) : t.dpo_reference_logps;
  DpoReferenceLogps& store = dpo_->reference.emplace(path, std::move(key));
  // The dataset pairs the remaining steps and the validation read, each once.
  std::vector<std::pair<const PreferenceSource*, uint64_t>> reads;
  for (uint64_t g = static_cast<uint64_t>(completed_iterations_) * t.global_batch_size;
       g < static_cast<uint64_t>(t.train_iters) * t.global_batch_size; ++g)
    reads.emplace_back(&train, g);
  if (dpo_->pairs.valid)
    for (uint64_t i = 0; i < std::min<uint64_t>(dpo_->pairs.valid->pairs(),
                                                 static_cast<uint64_t>(exp_.data.eval_iters) *
                                                     t.global_batch_size);
         ++i)
      reads.emplace_back(dpo_->pairs.valid.get(), i);
  std::set<uint64_t> pairs;
  std::map<uint64_t, std::pair<const PreferenceSource*, uint64_t>> missing;  // by dataset pair
  for (const auto& [source, index] : reads) {
    pairs.insert(source->pair(index));
    if (!store.has(source->pair(index))) missing.emplace(source->pair(index), std::pair{source, index});
  }
  // Every rank must find the same file: ranks on nodes that see different copies of it would
  // otherwise exchange different amounts below.
  {
    const float mine = static_cast<float>(missing.size());
    float all = counts_sequence_values() ? mine : 0.0f;
    dist::sum_host_values(*parallel_, *backend_, dpo_->stats, {&all, 1});
    if (all != mine * static_cast<float>(parallel_->data_parallel_size()))
      throw DataError(fmt::format("{}: this rank lacks {} of the pairs the run reads, the data-parallel "
                                  "ranks {} together: every rank must see the same file (a shared "
                                  "file system, or dpo_reference_logps naming one)",
                                  path, missing.size(), all));
  }
  if (!missing.empty()) {
    if (completed_iterations_ > 0 && !reference_)
      throw DataError(fmt::format(
          "{}: no reference log-probabilities of {} of the pairs this resumed run reads (dataset "
          "pair {} first); they can only be computed with the reference weights, {}, which a "
          "resumed run does not hold (the file was replaced, or train_iters raised beyond what "
          "the first run computed)",
          path, missing.size(), missing.begin()->first, dpo_->reference_weights));
    // Rank r computes every dp-th missing pair; the values meet in a sum over the ranks, exact
    // since each is an fp32 loss sum and the other ranks add zeros.
    const uint64_t dp = static_cast<uint64_t>(parallel_->data_parallel_size());
    const uint64_t rank = static_cast<uint64_t>(parallel_->data_parallel_rank());
    std::vector<float> parts(2 * missing.size(), 0.0f);
    uint64_t k = 0;
    if (reference_) reference_->use(true);
    for (const auto& [pair, read_at] : missing) {
      if (k % dp == rank) {
        const std::array<double, 2> logps = pair_logps(*read_at.first, read_at.second);
        if (counts_sequence_values())
          for (int side = 0; side < 2; ++side) parts[2 * k + side] = static_cast<float>(logps[side]);
      }
      ++k;
    }
    if (reference_) reference_->use(false);
    DeviceBuffer buffer(*backend_, parts.size() * sizeof(float), "dpo reference log-probabilities");
    dist::sum_host_values(*parallel_, *backend_, buffer.tensor(DType::F32, {static_cast<int64_t>(parts.size())}),
                          parts);
    k = 0;
    for (const auto& [pair, read_at] : missing) {
      store.set(pair, {parts[2 * k], parts[2 * k + 1]});
      ++k;
    }
    if (!comm_ || comm_->rank() == 0) {
      try {
        store.save();
      } catch (const DataError& e) {
        // Beside a read-only dataset: this run has them in memory; resuming it will not.
        if (!t.dpo_reference_logps.empty()) throw;
        log_.warning("dpo: the reference log-probabilities are not kept ({}); a resumed run "
                     "needs them: name a writable file with dpo_reference_logps", e.what());
      }
    }
  }
  log_.info("dpo: reference log-probabilities of the {} pairs this run reads: {} computed with {} "
            "({:.1f} s), {} read from {}",
            pairs.size(), missing.size(), dpo_->reference_weights, ms_since(start) / 1e3,
            pairs.size() - missing.size(), path);
  reference_.reset();  // the run needs only their log-probabilities now
}

// The frozen copy: the starting weights as the optimizer owns the policy's, and room for the
// policy's own where the optimizer keeps no master copy to restore them from.
void Trainer::keep_dpo_reference_copy() {
  if (reference_) {  // reference_load's, which a resumed run loads again
    dpo_->frozen.emplace(std::move(*reference_));
    reference_.reset();
  } else if (completed_iterations_ > 0) {
    throw ConfigError(origin_of(exp_, "dpo_precompute_ref_log_probs"), "dpo_precompute_ref_log_probs",
                      "false", "true to resume a DPO run: a frozen reference copy is not in its "
                      "checkpoints, while precomputed log-probabilities are kept beside the "
                      "dataset (or name the reference's checkpoint with reference_load)");
  } else {
    dpo_->frozen.emplace(*backend_, *optimizer_, *model_, *parallel_);
  }
  log_.info("dpo: a frozen copy of the reference ({}) on the device, {:.3f} GiB: the reference's "
            "log-probabilities are computed before each step",
            dpo_->reference_weights, static_cast<double>(dpo_->frozen->bytes()) / kGiB);
}

// The frozen copy's log-probabilities of the pairs `indices` of `pairs` (this rank's next).
void Trainer::reference_copy_logps(const PreferenceSource& pairs, const std::vector<uint64_t>& indices) {
  const profiler::PhaseSpan span(profiler_.get(), "dpo_reference");
  dpo_->frozen->use(true);
  dpo_->copy_logps.clear();
  for (uint64_t i : indices) dpo_->copy_logps[pairs.pair(i)] = pair_logps(pairs, i);
  dpo_->frozen->use(false);
}

std::array<double, 2> Trainer::reference_logps(const PreferenceSource& pairs, uint64_t index) const {
  if (setup_.reference_copy) return dpo_->copy_logps.at(pairs.pair(index));
  return dpo_->reference ? dpo_->reference->at(pairs.pair(index)) : std::array<double, 2>{0, 0};
}

DpoPair Trainer::score_pair(const PreferenceSource& pairs, uint64_t index, const std::array<double, 2>& logps,
                            const std::array<int64_t, 2>& tokens, std::array<double, 6>* sums) {
  const std::array<double, 2> reference = reference_logps(pairs, index);
  const double chosen = logps[0], rejected = logps[1];
  const DpoPair p = dpo_pair(dpo_->options, chosen, rejected, reference[0], reference[1], tokens[0], tokens[1]);
  const std::array<double, 6> pair = {p.loss, p.chosen_reward, p.rejected_reward,
                                      p.chosen_reward > p.rejected_reward ? 1.0 : 0.0, chosen,
                                      rejected};
  if (counts_sequence_values())
    for (size_t k = 0; k < 6; ++k) (*sums)[k] += pair[k];
  return p;
}

DpoBatchStats Trainer::dpo_means(const std::array<double, 6>& sums, int64_t pairs) {
  std::array<float, 6> values;
  for (size_t k = 0; k < 6; ++k) values[k] = static_cast<float>(sums[k]);
  dist::sum_host_values(*parallel_, *backend_, dpo_->stats, values);
  const double n = static_cast<double>(std::max<int64_t>(pairs, 1));
  return {values[0] / n, values[1] / n, values[2] / n, values[3] / n, values[4] / n, values[5] / n};
}

// Each pair: both answers' log-probabilities (forward passes, each kept in its slot), the
// loss's pull on each, then each answer's backward with its pull as the scale of its summed
// token losses (d loss / d logp times d logp, and logp is minus the summed losses), over the
// global batch's pairs: one forward and one backward per answer, as a batched pair costs.
DpoBatchStats Trainer::dpo_gradients() {
  const TrainingConfig& t = exp_.training;
  const int64_t dp = parallel_->data_parallel_size(), rank = parallel_->data_parallel_rank();
  const int64_t per_rank = t.global_batch_size / dp;
  const double pairs = static_cast<double>(t.global_batch_size);
  prepare_dpo_reference();
  std::array<double, 6> sums{};
  const PreferenceSource& train = *dpo_->pairs.train;
  if (setup_.reference_copy) {
    std::vector<uint64_t> mine;
    for (int64_t m = 0; m < per_rank; ++m) mine.push_back(consumed_samples_ + static_cast<uint64_t>(m * dp + rank));
    reference_copy_logps(train, mine);
  }
  const auto pair_at = [&](int64_t m) { return consumed_samples_ + static_cast<uint64_t>(m * dp + rank); };
  if (pipelined()) {
    // Each pair one micro-batch: the last stage scores it after its head's forward, and its
    // answers' backward takes their pulls. The MoE layers' auxiliary losses (weighed by the
    // scale times the micro-batch's tokens) count once a pair, a mean over the step's pairs.
    std::vector<std::array<int64_t, 2>> tokens(static_cast<size_t>(per_rank));
    std::vector<int64_t> rejected_rows(static_cast<size_t>(per_rank));
    const auto aux_scale = static_cast<float>(1.0 / (pairs * static_cast<double>(model_->runtime().tokens())));
    parallel_->run_scaled_micro_batches(
        per_rank, aux_scale, [&](int64_t m) { rejected_rows[m] = load_pair(train, pair_at(m), &tokens[m]); },
        [&](int64_t m) {
          const DpoPair p = score_pair(train, pair_at(m), sequence_logps(rejected_rows[m]), tokens[m], &sums);
          return std::vector<float>{static_cast<float>(-p.dloss_dchosen / pairs),
                                    static_cast<float>(-p.dloss_drejected / pairs)};
        });
    return dpo_means(sums, t.global_batch_size);
  }
  parallel_->run_micro_batches(
      per_rank, 1.0f, [](int64_t) {},
      [&](int64_t m) {
        const uint64_t g = pair_at(m);
        std::array<int64_t, 2> counts{};
        const std::array<double, 2> logps = pair_logps(train, g, &counts);
        const DpoPair p = score_pair(train, g, logps, counts, &sums);
        if (shared_prompts()) {
          // One backward of both answers, each scaled by its pull; the MoE layers' auxiliary
          // losses a mean over the step's pairs, as the pipelined path's.
          const std::array<float, 2> scales = {static_cast<float>(-p.dloss_dchosen / pairs),
                                               static_cast<float>(-p.dloss_drejected / pairs)};
          parallel_->begin_micro_batch(m == per_rank - 1);
          model_->loss_backward(scales, static_cast<float>(1.0 / (pairs * static_cast<double>(model_->runtime().tokens()))));
          return;
        }
        for (int side = 0; side < 2; ++side) {
          model_->use_slot(side);
          parallel_->begin_micro_batch(side == 1 && m == per_rank - 1);
          const double pull = side == 0 ? p.dloss_dchosen : p.dloss_drejected;
          // The MoE layers' auxiliary losses: a mean over the step's answers, as the pipelined
          // path's over its pairs.
          const auto scale = static_cast<float>(-pull / pairs);
          model_->loss_backward({&scale, 1},
                                static_cast<float>(1.0 / (2 * pairs * static_cast<double>(model_->runtime().tokens()))));
        }
      });
  return dpo_means(sums, t.global_batch_size);
}

double Trainer::evaluate_dpo() {
  prepare_dpo_reference();
  std::array<double, 6> sums{};
  const int64_t pairs = static_cast<int64_t>(std::min<uint64_t>(
      dpo_->pairs.valid->pairs(),
      static_cast<uint64_t>(exp_.data.eval_iters * exp_.training.global_batch_size)));
  // Pair i on data-parallel rank i mod dp.
  std::vector<uint64_t> mine;
  for (int64_t i = parallel_->data_parallel_rank(); i < pairs; i += parallel_->data_parallel_size())
    mine.push_back(static_cast<uint64_t>(i));
  if (setup_.reference_copy) reference_copy_logps(*dpo_->pairs.valid, mine);
  for (uint64_t i : mine) {
    std::array<int64_t, 2> counts{};
    const std::array<double, 2> logps = pair_logps(*dpo_->pairs.valid, i, &counts);
    score_pair(*dpo_->pairs.valid, i, logps, counts, &sums);
  }
  const DpoBatchStats s = dpo_means(sums, pairs);
  log_.info("dpo validation: loss {:.6f} | rewards/accuracies {:.4f} | rewards/margins {:.4f} | "
            "rewards/chosen {:.4f} | rewards/rejected {:.4f} ({} pairs)",
            s.loss, s.accuracy, s.margin(), s.chosen_reward, s.rejected_reward, pairs);
  if (metrics_)
    metrics_->write({{"iteration", completed_iterations_},
                     {"eval_rewards/accuracies", s.accuracy},
                     {"eval_rewards/margins", s.margin()},
                     {"eval_loss_dpo", s.loss}});
  return s.loss;
}

IterationStats Trainer::run_iteration(int64_t iteration) {
  const profiler::PhaseSpan step(profiler_.get(), "ProfilerStep#", iteration);
  const TrainingConfig& t = exp_.training;
  const int64_t dp = parallel_->data_parallel_size(), dp_rank = parallel_->data_parallel_rank();
  const int64_t accumulation = setup_.accumulation_steps;
  model_->zero_grads();
  model_->zero_loss_sum();
  int64_t loss_tokens = 0;
  std::optional<DpoBatchStats> pair_stats;
  std::optional<GrpoStepStats> grpo_stats;
  if (dpo_) {
    pair_stats = dpo_gradients();
  } else if (grpo_) {
    grpo_stats = grpo_->gradients(iteration);
  } else {
    // The loss is the mean over the global batch's positions that count (all of them without
    // loss masks); a batch whose every target is masked contributes no gradient.
    loss_tokens =
        loss_positions(*data_.train, consumed_samples_, static_cast<uint64_t>(t.global_batch_size));
    const float grad_scale = 1.0f / static_cast<float>(std::max<int64_t>(loss_tokens, 1));
    const auto load = [&](int64_t m) {
      // Data-parallel ranks that save stop only after an iteration, where they all agree: one
      // stopping here would save while the others go on to the next collective.
      if (int sig = pending_stop_signal(); sig && !ranks_stop_together_)
        stop_for_signal(sig, fmt::format("during iteration {}; its update was abandoned", iteration));
      // Megatron's sampler order: each micro-batch slot of the global batch holds
      // data_parallel_size consecutive micro-batches, one per rank.
      const uint64_t first =
          consumed_samples_ + static_cast<uint64_t>((m * dp + dp_rank) * t.micro_batch_size);
      load_micro_batch(*data_.train, first);
    };
    const auto run = [&](int64_t m) {
      const profiler::PhaseSpan span(profiler_.get(), "forward_backward", "micro_batch", m);
      parallel_->begin_micro_batch(m == accumulation - 1);
      model_->forward_backward(grad_scale);
    };
    parallel_->run_micro_batches(accumulation, grad_scale, load, run);
  }
  {
    const profiler::PhaseSpan span(profiler_.get(), "grad_reduce");
    parallel_->finish_gradient_reduction();
  }
  {
    const profiler::PhaseSpan span(profiler_.get(), "grad_norm");
    parallel_->grad_norm_sq(grad_norm_sq_);
    for (StepHook* hook : step_hooks_) hook->end_step(grad_norm_sq_);
  }
  IterationStats s;
  s.iteration = iteration;
  s.lr = learning_rate(t, iteration);
  // Collectives that need the compute stream come before the ZeRO-1 parameter gather, which
  // may then overlap with the next forward (overlap_param_gather).
  parallel_->sum(model_->loss_sum());
  if (ranks_stop_together_) agreed_stop_signal_ = agree_on_stop_signal();
  if (t.exit_duration_in_mins > 0) out_of_time_ = agree_out_of_time();
  {
    const profiler::PhaseSpan span(profiler_.get(), "optimizer");
    optimizer_->step(s.lr, grad_norm_sq_, applied_steps_ + 1);
    parallel_->params_updated();
  }
  float loss_sum = 0, norm_sq = 0;
  {
    const profiler::PhaseSpan span(profiler_.get(), "loss_readback");  // waits for the device
    backend_->download(&loss_sum, model_->loss_sum());
    backend_->download(&norm_sq, grad_norm_sq_);
    for (StepHook* hook : step_hooks_) hook->read_step(accumulation * dp);
  }
  s.loss = pair_stats   ? pair_stats->loss
           : grpo_stats ? grpo_stats->loss
                        : loss_sum / static_cast<double>(std::max<int64_t>(loss_tokens, 1));
  s.loss_tokens = loss_tokens;
  s.dpo = pair_stats;
  s.grpo = grpo_stats;
  s.real_tokens = positions_per_step();
  if (grpo_) {
    s.real_tokens = grpo_stats->batch_tokens;  // each completion's prompt and its tokens
  } else if (dpo_) {
    s.real_tokens = 0;
    for (int64_t i = 0; i < t.global_batch_size; ++i)
      s.real_tokens += dpo_->pairs.train->real_tokens(consumed_samples_ + static_cast<uint64_t>(i));
  } else if (data_.train->pads()) {
    s.real_tokens = 0;
    for (int64_t i = 0; i < t.global_batch_size; ++i)
      s.real_tokens += data_.train->real_tokens(consumed_samples_ + static_cast<uint64_t>(i))
                           .value_or(t.seq_length);
  }
  s.grad_norm = std::sqrt(static_cast<double>(norm_sq));
  s.skipped = !std::isfinite(norm_sq) || !std::isfinite(loss_sum);
  consumed_samples_ += static_cast<uint64_t>(t.global_batch_size);
  completed_iterations_ = iteration;
  if (s.skipped) {
    ++skipped_iterations_;
    ++consecutive_nan_;
    log_.warning(
        "iteration {}: non-finite {} (loss {}, grad norm {}); update skipped ({} in a row)",
        iteration,
        !std::isfinite(loss_sum) ? "loss" : non_finite_cause(),
        s.loss, s.grad_norm, consecutive_nan_);
    if (consecutive_nan_ >= t.max_consecutive_nan_iters) {
      // Before any update the weights are the ones the run started from: no learning rate
      // made them, and weights from a file are the likeliest cause.
      const std::string hint =
          applied_steps_ > 0
              ? "Lower lr, raise lr_warmup_iters or check the data."
              : fmt::format(
                    "No update was applied yet, so the learning rate is not the cause: "
                    "the starting weights ({}) give a non-finite loss or gradient; check "
                    "them and the data.",
                    initial_weights_);
      throw TrainingAborted(
          fmt::format("{} iterations in a row had a non-finite loss or gradient (last: {}); "
                      "stopping. {}",
                      consecutive_nan_, iteration, hint),
          kExitRuntimeFailure);
    }
  } else {
    ++applied_steps_;
    consecutive_nan_ = 0;
  }
  return s;
}

double Trainer::evaluate() {
  if (dpo_) return evaluate_dpo();
  const TrainingConfig& t = exp_.training;
  const int64_t dp = parallel_->data_parallel_size(), dp_rank = parallel_->data_parallel_rank();
  model_->zero_loss_sum();
  parallel_->run_forward_passes(
      exp_.data.eval_iters,
      [&](int64_t i) {
        // The same leading validation samples every time, so evaluations are comparable.
        const uint64_t first = static_cast<uint64_t>((i * dp + dp_rank) * t.micro_batch_size);
        load_micro_batch(*data_.valid, first);
      },
      [&](int64_t) { model_->forward_loss(); });
  parallel_->sum(model_->loss_sum());
  float loss_sum = 0;
  backend_->download(&loss_sum, model_->loss_sum());
  if (eval_loss_tokens_ < 0)
    eval_loss_tokens_ = loss_positions(
        *data_.valid, 0, static_cast<uint64_t>(exp_.data.eval_iters * t.micro_batch_size * dp));
  return loss_sum / static_cast<double>(std::max<int64_t>(eval_loss_tokens_, 1));
}

void Trainer::log_iteration(const IterationStats& s, double loss, double interval_ms,
                            int64_t interval_iters, double real_share) {
  const profiler::PhaseSpan span(profiler_.get(), "logging");
  // Profiled iterations run slower (the recorder's overhead): their lines say so.
  const bool profiled =
      profiler_ && profiler_->covers(s.iteration - interval_iters + 1, s.iteration);
  const TrainingConfig& t = exp_.training;
  const double ms = interval_ms / static_cast<double>(interval_iters);
  const double tokens_per_s = tokens_per_gpu_per_step() / (ms / 1e3);
  const double tflops = flops_per_token_ * tokens_per_s / 1e12;
  const double tflops_causal = flops_per_token_causal_ * tokens_per_s / 1e12;
  const MemoryStats mem = backend_->memory_stats();
  std::string hook_fields;
  for (const StepHook* hook : step_hooks_) hook_fields += hook->interval_fields();
  log_.clear_progress();
  const std::string_view per = device_word();
  // With loss masks, how many of the global batch's positions the loss counted (a DPO step
  // counts pairs, not positions).
  const bool masked = lm_objective() && data_.train->masks_targets();
  const int64_t positions = t.global_batch_size * t.seq_length;
  // With packing's padding, the tokens/s of real tokens beside the slots'.
  // A DPO answer, a GRPO completion pads its sequence.
  const bool pads = !lm_objective() || data_.train->pads();
  // objective dpo, grpo: TRL's statistics of the last step.
  std::string pairs;
  for (const auto& [name, value] : s.named()) pairs += fmt::format(" | {}: {:.4f}", name, value);
  const std::string real = pads ? fmt::format(" | real tokens per {} (tokens/s/{}): {:.1f} "
                                              "(packing efficiency {:.1f}%)",
                                              device_word(), device_word(),
                                              tokens_per_s * real_share, 100 * real_share)
                                : "";
  log_.info(
      "iteration {:>8}/{:>8} | consumed samples: {:>12} | elapsed time per iteration (ms): {:.1f} "
      "| "
      "throughput per {} (TFLOP/s/{}): {:.2f} | tokens per {} (tokens/s/{}): {:.1f} | "
      "learning rate: {:.6E} | global batch size: {:>5} | lm loss: {:.6E} | grad norm: {:.3f} | "
      "number of skipped iterations: {:>3} | number of nan iterations: {:>3} | "
      "mem allocated (GiB): {:.3f} | mem peak (GiB): {:.3f}{}{}{}{}{}",
      s.iteration, t.train_iters, consumed_samples_, ms, per, per, tflops, per, per, tokens_per_s,
      s.lr, t.global_batch_size, loss, s.grad_norm, skipped_iterations_, skipped_iterations_,
      mem.allocated_bytes / kGiB, mem.peak_bytes / kGiB, hook_fields,
      masked ? fmt::format(" | loss tokens: {} of {}", s.loss_tokens, positions) : "", real, pairs,
      profiled ? " | profiled" : "");
  for (StepHook* hook : step_hooks_)
    if (const std::string line = hook->interval_detail(s.iteration); !line.empty()) log_.info("{}", line);
  if (tensorboard_)
    tensorboard_->interval({.iteration = s.iteration,
                            .iterations = interval_iters,
                            .seconds_per_iteration = ms / 1e3,
                            .tflops_per_gpu = tflops,
                            .tokens_per_s_per_gpu = tokens_per_s,
                            .gpus = parallel_->world_size(),
                            .packing_efficiency = pads ? real_share : -1.0});
  if (!metrics_) return;
  nlohmann::json j;
  j["iteration"] = s.iteration;
  j["lm_loss"] = std::isfinite(loss) ? nlohmann::json(loss) : nlohmann::json(nullptr);
  j["lr"] = s.lr;
  j["grad_norm"] =
      std::isfinite(s.grad_norm) ? nlohmann::json(s.grad_norm) : nlohmann::json(nullptr);
  j["elapsed_ms"] = ms;
  j["tflops_per_gpu"] = tflops;
  j["tflops_per_gpu_causal"] = tflops_causal;
  j["tokens_per_s_per_gpu"] = tokens_per_s;
  j["tokens_per_s"] = tokens_per_s * static_cast<double>(parallel_->world_size());
  j["world_size"] = parallel_->world_size();
  j["consumed_samples"] = consumed_samples_;
  j["global_batch_size"] = t.global_batch_size;
  j["loss_tokens"] = s.loss_tokens;
  if (lora_) j["trainable_params"] = trainable_parameters();
  for (const auto& [name, value] : s.named()) j[name] = value;
  if (pads) {
    j["real_tokens_per_s_per_gpu"] = tokens_per_s * real_share;
    j["packing_efficiency"] = real_share;
  }
  j["skipped_iterations"] = skipped_iterations_;
  j["nan_iterations"] = skipped_iterations_;
  j["mem_allocated_gib"] = mem.allocated_bytes / kGiB;
  j["mem_peak_gib"] = mem.peak_bytes / kGiB;
  if (profiled) j["profiled"] = true;
  for (const StepHook* hook : step_hooks_) hook->add_interval_metrics(j);
  metrics_->write(j);
}

void Trainer::write_tensorboard_iteration(const IterationStats& s) {
  IterationScalars v{.iteration = s.iteration,
                     .consumed_samples = consumed_samples_,
                     .batch_size = exp_.training.global_batch_size,
                     .lm_loss = s.loss,
                     .learning_rate = s.lr,
                     .grad_norm = s.grad_norm,
                     .loss_tokens = lm_objective() && data_.train->masks_targets() ? s.loss_tokens : -1,
                     .named = s.named()};
  if (exp_.logging.log_memory_to_tensorboard) {
    const MemoryStats mem = backend_->memory_stats();
    v.mem_allocated_bytes = static_cast<double>(mem.allocated_bytes);
    v.mem_max_allocated_bytes = static_cast<double>(mem.peak_bytes);
  }
  tensorboard_->iteration(v);
  for (const StepHook* hook : step_hooks_) tensorboard_->scalars(s.iteration, hook->step_scalars());
}

void Trainer::report_evaluation(int64_t iteration, double loss, double ms) {
  log_.clear_progress();
  log_.info(
      "validation loss at iteration {} | lm loss value: {:.6E} | lm loss PPL: {:.6E} | "
      "time (ms): {:.1f}",
      iteration, loss, std::exp(loss), ms);
  if (tensorboard_) tensorboard_->validation(iteration, consumed_samples_, loss);
  if (!metrics_) return;
  nlohmann::json j;
  j["iteration"] = iteration;
  j["eval_lm_loss"] = loss;
  j["eval_ppl"] = std::exp(loss);
  metrics_->write(j);
}

double Trainer::evaluate_grpo(int64_t iteration) {
  const double accuracy = grpo_->evaluate();
  if (tensorboard_) tensorboard_->validation_scalar("eval/accuracy", iteration, accuracy);
  if (metrics_) metrics_->write({{"iteration", iteration}, {"eval_accuracy", accuracy}});
  return accuracy;
}

// skip_train, as Megatron: the starting weights evaluated at the iteration they come from;
// nothing is trained or saved.
TrainSummary Trainer::evaluate_only() {
  TrainSummary sum;
  sum.iterations = completed_iterations_;
  sum.skipped_iterations = skipped_iterations_;
  log_.info(
      "skip_train: evaluating the weights of iteration {} on {} validation micro-batches "
      "per rank, without training",
      completed_iterations_, exp_.data.eval_iters);
  if (grpo_) {
    sum.last_eval_accuracy = evaluate_grpo(completed_iterations_);
    return sum;
  }
  const auto t0 = Clock::now();
  sum.last_eval_loss = evaluate();
  report_evaluation(completed_iterations_, sum.last_eval_loss, ms_since(t0));
  return sum;
}

TrainSummary Trainer::train() {
  const TrainingConfig& t = exp_.training;
  install_stop_signal_handlers();
  if (exp_.data.skip_train) return evaluate_only();
  TrainSummary sum;
  if (completed_iterations_ >= t.train_iters) {
    // Resumed at or past the end: nothing runs, so there is no loss or throughput to report.
    sum.iterations = completed_iterations_;
    sum.skipped_iterations = skipped_iterations_;
    log_.warning(
        "nothing to train: the run resumed at iteration {} and train_iters is {} "
        "(raise --train_iters to train further)",
        completed_iterations_, t.train_iters);
    return sum;
  }
  // A resumed run names the iterations it runs, not the run's whole length.
  const std::string span =
      completed_iterations_ == 0
          ? fmt::format("training for {} iterations", t.train_iters)
          : fmt::format(
                "training iterations {} to {} ({} of the run's {}; resumed after "
                "iteration {})",
                completed_iterations_ + 1, t.train_iters, t.train_iters - completed_iterations_,
                t.train_iters, completed_iterations_);
  log_.info(
      "{}: global batch {} = micro batch {} x data parallel {} x accumulation {}, seq_length {}; "
      "{:.2f} GFLOP per token",
      span, t.global_batch_size, t.micro_batch_size, parallel_->data_parallel_size(),
      setup_.accumulation_steps, t.seq_length, flops_per_token_ / 1e9);
  if (!exp_.checkpoint.save.empty() && exp_.checkpoint.disable_last_saving)
    log_.warning(
        "disable_last_saving is true: no checkpoint at the end of the run, only every "
        "save_interval ({}) iterations{} (--disable_last_saving false saves the last one)",
        exp_.checkpoint.save_interval,
        exp_.checkpoint.save_interval == 0 || exp_.checkpoint.save_interval > t.train_iters
            ? ", so this run saves none"
            : "");
  backend_->synchronize();
  backend_->reset_peak_memory();
  const auto start = Clock::now();
  auto interval_start = start;
  double steady_ms = 0;  // time of iterations after the first (which includes warm-up)
  int64_t interval_iters = 0;
  // The logged loss is Megatron's: the mean over the interval's iterations that applied an
  // update, so a log every N iterations is not one batch's (noisy) loss.
  double interval_loss_sum = 0;
  int64_t interval_losses = 0;
  int64_t interval_real_tokens = 0;
  const int64_t first = completed_iterations_ + 1;  // > 1 when resuming
  int64_t last = t.train_iters;                     // earlier at target_loss or an early exit
  if (dpo_) prepare_dpo_reference();
  for (int64_t it = first; it <= t.train_iters; ++it) {
    // Starting and stopping the recorder is kept out of the iteration times.
    if (profiler_) interval_start += profiler_->before_iteration(it);
    const auto t0 = Clock::now();
    const IterationStats s = run_iteration(it);
    if (it > first) steady_ms += ms_since(t0);
    if (tensorboard_ && it % exp_.logging.tensorboard_log_interval == 0)
      write_tensorboard_iteration(s);
    const std::string exit_why = exit_reason(it);
    ++interval_iters;
    interval_real_tokens += s.real_tokens;
    if (!s.skipped && std::isfinite(s.loss)) interval_loss_sum += s.loss, ++interval_losses;
    if (it == first) sum.first_loss = s.loss;
    sum.last_loss = s.loss;
    if (it % exp_.logging.log_interval == 0 || it == t.train_iters || !exit_why.empty()) {
      const double logged_loss =
          interval_losses > 0 ? interval_loss_sum / static_cast<double>(interval_losses) : s.loss;
      const double slots = static_cast<double>(interval_iters * positions_per_step());
      log_iteration(s, logged_loss, ms_since(interval_start), interval_iters,
                    static_cast<double>(interval_real_tokens) / slots);
      for (StepHook* hook : step_hooks_) hook->end_interval();
      interval_start = Clock::now();
      interval_real_tokens = 0;
      interval_iters = 0;
      interval_loss_sum = 0;
      interval_losses = 0;
    }
    const bool has_validation = dpo_    ? dpo_->pairs.valid != nullptr
                                : grpo_ ? grpo_->has_validation()
                                        : data_.valid != nullptr;
    const bool eval_now = has_validation && exp_.data.eval_interval > 0 &&
                          (it % exp_.data.eval_interval == 0 || it == t.train_iters);
    if (eval_now && grpo_) {
      sum.last_eval_accuracy = evaluate_grpo(it);
      interval_start = Clock::now();
    } else if (eval_now) {
      const auto e0 = Clock::now();
      sum.last_eval_loss = evaluate();
      report_evaluation(it, sum.last_eval_loss, ms_since(e0));
      interval_start = Clock::now();  // keep evaluation out of the training throughput
      if (exp_.data.target_loss > 0 && sum.last_eval_loss <= exp_.data.target_loss) {
        report_target_reached(log_, metrics_, exp_.data.target_loss, it, sum.last_eval_loss,
                              ms_since(start) / 1e3,
                              consumed_samples_ * static_cast<uint64_t>(t.seq_length));
        last = it;
        break;
      }
    }
    if (profiler_) interval_start += profiler_->after_iteration(it, t.train_iters);
    const double elapsed_s = ms_since(start) / 1e3;
    log_.progress(fmt::format(
        "iteration {}/{} {:3.0f}% | loss {:.4f} | {:.0f} ms/it | ETA {}", it, t.train_iters,
        100.0 * it / t.train_iters, s.loss, elapsed_s * 1e3 / (it - first + 1),
        format_duration(elapsed_s / (it - first + 1) * (t.train_iters - it))));
    const CheckpointConfig& c = exp_.checkpoint;
    if (!c.save.empty() && c.save_interval > 0 && it % c.save_interval == 0) {
      save_checkpoint();
      interval_start = Clock::now();  // keep saving out of the training throughput
    }
    if (int sig = stop_signal_after_iteration())
      stop_for_signal(sig, fmt::format("after iteration {} (its update was applied)", it));
    if (!exit_why.empty()) {
      log_.clear_progress();
      log_.info("stopping after iteration {}: {}", it, exit_why);
      last = it;
      break;
    }
  }
  if (profiler_) profiler_->after_iteration(last, last);  // stopped early
  const CheckpointConfig& ckpt = exp_.checkpoint;
  if (!ckpt.save.empty() && last_saved_iteration_ != completed_iterations_) {
    // Primus's disable_last_saving skips the end-of-run checkpoint only; an early exit is a
    // stop to resume from, and saves.
    if (!ckpt.disable_last_saving || last < t.train_iters) {
      save_checkpoint();
    } else {
      log_.info("no checkpoint of iteration {}: disable_last_saving is true{}", last,
                last_saved_iteration_ > 0
                    ? fmt::format(" (the last one, of iteration {}, is in {})",
                                  last_saved_iteration_, ckpt.save)
                    : fmt::format("; save_interval {} saved none in this run", ckpt.save_interval));
    }
  }
  log_.clear_progress();
  sum.iterations = last;
  sum.skipped_iterations = skipped_iterations_;
  const int64_t ran = last - first + 1;
  const double ms = ran > 1 ? steady_ms / static_cast<double>(ran - 1) : ms_since(start);
  sum.tokens_per_s_per_gpu = tokens_per_gpu_per_step() / (ms / 1e3);
  sum.tflops_per_gpu = flops_per_token_ * sum.tokens_per_s_per_gpu / 1e12;
  sum.tflops_per_gpu_causal = flops_per_token_causal_ * sum.tokens_per_s_per_gpu / 1e12;
  sum.peak_memory_gib = backend_->memory_stats().peak_bytes / kGiB;
  const std::string_view per = device_word();
  log_.info(
      "done: {} in {:.1f} s; loss {:.4f} -> {:.4f}{}; {:.1f} tokens/s/{}, {:.3f} "
      "TFLOP/s/{} (excluding the first iteration; {:.3f} with causal attention counted half, "
      "as Megatron-Bridge counts); peak memory {:.3f} GiB",
      first == 1 ? fmt::format("{} iterations", last)
                 : fmt::format("{} iterations, {} to {}", ran, first, last),
      ms_since(start) / 1e3, sum.first_loss, sum.last_loss,
      sum.last_eval_loss >= 0       ? fmt::format(" (validation {:.4f})", sum.last_eval_loss)
      : sum.last_eval_accuracy >= 0 ? fmt::format(" (held-out accuracy {:.4f})", sum.last_eval_accuracy)
                                    : "",
      sum.tokens_per_s_per_gpu, per, sum.tflops_per_gpu, per, sum.tflops_per_gpu_causal,
      sum.peak_memory_gib);
  return sum;
}

}  // namespace tessera
