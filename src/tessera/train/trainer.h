#pragma once
// The training loop: data -> forward/backward over micro-batches -> gradient norm ->
// AdamW -> metrics, with NaN skipping, evaluation and clean stops on signals.
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "tessera/ckpt/checkpoint.h"
#include "tessera/config/config.h"
#include "tessera/data/dataset.h"
#include "tessera/data/preference_dataset.h"
#include "tessera/data/tokenizer.h"
#include "tessera/distributed/communicator.h"
#include "tessera/distributed/parallelism.h"
#include "tessera/model/lora_model.h"
#include "tessera/model/model.h"
#include "tessera/obs/logger.h"
#include "tessera/obs/metrics.h"
#include "tessera/ops/backend.h"
#include "tessera/optim/adamw_optimizer.h"
#include "tessera/run/run_setup.h"
#include "tessera/train/dpo.h"
#include "tessera/train/frozen_reference.h"
#include "tessera/train/grpo_run.h"

namespace tessera::profiler {
class TrainingProfiler;  // obs/profiler/training_profiler.h
}

namespace tessera {

class TrainingTensorBoard;  // obs/tensorboard.h

struct IterationStats {
  int64_t iteration = 0;
  double loss = 0;       // mean token loss of the global batch, over the positions that count
  int64_t loss_tokens = 0;  // positions of the global batch the loss counts (loss masks)
  int64_t real_tokens = 0;  // tokens of the global batch that are not padding (packing)
  double grad_norm = 0;  // before clipping
  double lr = 0;
  bool skipped = false;              // non-finite loss or gradient: no update applied
  std::optional<DpoBatchStats> dpo;  // objective dpo: the global batch's pair statistics
  std::optional<GrpoStepStats> grpo;  // objective grpo: the step's statistics
  // The objective's statistics under TRL's names (DPO's or GRPO's; none for lm).
  std::vector<std::pair<std::string, double>> named() const {
    return dpo ? dpo->trl_named() : grpo ? grpo->trl_named() : std::vector<std::pair<std::string, double>>{};
  }
};

struct TrainSummary {
  int64_t iterations = 0;
  int64_t skipped_iterations = 0;
  double first_loss = 0, last_loss = 0;
  double last_eval_loss = -1;
  double last_eval_accuracy = -1;  // objective grpo: the held-out share of right answers
  double tokens_per_s_per_gpu = 0;  // over all iterations after the first
  double tflops_per_gpu = 0;
  double tflops_per_gpu_causal = 0;  // Megatron-Bridge's count: causal attention halved
  double peak_memory_gib = 0;
};

// Whether `backend` can run the run's precision and FP8 recipe (bf16 and FP8 need a GPU).
// Throws ConfigError naming the key.
void check_device_runs(const Experiment& e, const RunSetup& setup, Backend& backend);
// Whether the run's memory plan (and, on the CPU backend, the host batch) fits what the
// device has, before anything is allocated. Throws OutOfMemoryError with the breakdown and
// what to change.
void check_memory_fits(const Experiment& e, const RunSetup& setup, Backend& backend);

// What the checks before a run found out, for the run to use.
struct RunStart {
  std::string resume_dir;  // the checkpoint the run resumes (checkpoint_to_resume); empty: none
  // The run's tokenizer when the checks needed its vocabulary (a model whose vocab_size is not
  // set), so the trainer does not load it twice; null otherwise.
  std::unique_ptr<Tokenizer> tokenizer;
};

// What refuses a run before it touches any directory, so that a refused run writes nothing:
// the device checks above, the memory plan, and the checkpoint it resumes (opened and
// checked against the configured model; a DataError names the previous good checkpoint) or
// the Hugging Face model it starts from (config.json and every tensor header). `world_size`
// and `rank`: the job's ranks, thread ranks included.
RunStart check_run_can_start(const Experiment& e, Backend& backend, int world_size, int rank);

class Trainer {
 public:
  // metrics may be null (tests). The backend is owned by the trainer. comm (not owned):
  // the job this rank trains in (distributed/parallelize.h); null: one device. run_id: the
  // run's (train/run_directories.h), written into its checkpoints; empty: the resumed
  // checkpoint's, else a new one. tokenizer: the run's, when the checks before the run loaded
  // it (RunStart); null: made from the experiment. A stop signal received while it sets up
  // (loading data or a checkpoint) ends it with TrainingAborted once the step in progress
  // returns. generation (objective grpo, split placement): the link to the ranks that decode
  // its completions, comm then being the training ranks'.
  Trainer(const Experiment& experiment, std::unique_ptr<Backend> backend, Logger& logger,
          MetricsWriter* metrics, dist::Communicator* comm = nullptr, std::string run_id = "",
          std::unique_ptr<Tokenizer> tokenizer = nullptr, const GrpoGenerationLink* generation = nullptr);
  ~Trainer();

  TrainSummary train();
  // One optimizer step (all micro-batches of the global batch). Used by train() and tests.
  IterationStats run_iteration(int64_t iteration);
  double evaluate();  // mean validation token loss (objective dpo: mean validation DPO loss)
  // Sequence positions a step runs: global_batch_size samples of seq_length tokens (a DPO
  // pair is two sequences, its answers).
  int64_t positions_per_step() const;
  // Writes the current state to the `save` directory (ckpt/checkpoint.h); returns its path.
  std::string save_checkpoint();

  // Counters a checkpoint restores: iterations completed and samples consumed so far.
  int64_t completed_iterations() const { return completed_iterations_; }
  uint64_t consumed_samples() const { return consumed_samples_; }

  Model& model() { return *model_; }
  AdamWOptimizer& optimizer() { return *optimizer_; }
  Backend& backend() { return *backend_; }
  const ModelSpec& spec() const { return setup_.spec; }

 private:
  // The constructor's steps, in order.
  void check_device_can_run() const;
  void log_run() const;
  void open_data();
  void open_host_batch();  // the host arrays of a micro-batch's tokens, targets and positions
  void build_model();
  void start_state();
  // Stops with TrainingAborted when a stop signal arrived while `doing` (setting up).
  void stop_if_signalled(const char* doing);

  void check_memory_fits() const;
  double tokens_per_gpu_per_step() const;
  std::string_view device_word() const;
  void load_micro_batch(const SampleSource& source, uint64_t first_sample);
  // Positions of samples [first, first + count) whose targets count for the loss: all of
  // them unless the source masks targets. Every rank counts the whole global batch, so that
  // the loss is the mean over its counted tokens without a collective.
  int64_t loss_positions(const SampleSource& source, uint64_t first, uint64_t count) const;
  // loss: the mean over the interval's applied iterations (the last one's when none applied).
  // real_share: the interval's real tokens over its slots (below 1 with packing's padding).
  void log_iteration(const IterationStats& s, double loss, double interval_ms,
                     int64_t interval_iters, double real_share);
  TrainingTensors training_tensors() const;
  // A checkpoint's extra state was loaded into the step hooks' tensors.
  void state_restored();
  std::string non_finite_cause() const;
  void restore_start_state();
  // reference_load: its weights into the policy's place, kept in reference_ (before the
  // starting weights are loaded over them).
  void load_reference();
  // LoRA: the frozen base from pretrained_checkpoint, hf_init_path or the initialisation.
  void load_lora_base();
  // Elements of the parameters the optimizer updates (the adapters under LoRA).
  int64_t trainable_parameters() const;
  int stop_signal_after_iteration();
  int agree_on_stop_signal();
  bool agree_out_of_time();
  // The early exits (exit_interval, exit_duration_in_mins): why the run stops after iteration
  // `it`, or empty.
  std::string exit_reason(int64_t it) const;
  TrainSummary evaluate_only();
  // The validation loss of `iteration` to the log, metrics.jsonl and TensorBoard.
  void report_evaluation(int64_t iteration, double loss, double ms);
  void write_tensorboard_iteration(const IterationStats& s);
  // objective dpo: one side of a preference pair into row `row` of the host batch (its target
  // count); one side's summed log-probability over the answer (a forward pass of it alone);
  // the reference (the starting weights' digest) and its log-probabilities of the pairs the run
  // reads; the step's gradients.
  int64_t sample_pair_side(const PreferenceSource& pairs, uint64_t index, int side, int64_t row);
  double answer_logp(const PreferenceSource& pairs, uint64_t index, int side, int64_t* tokens = nullptr);
  // Over pipeline stages a pair is one micro-batch of its two answers (chosen first), and with
  // shared prompts (dpo_shared_prompt) everywhere: it as the model's batch, with each answer's
  // target count, returning the first row of the rejected answer's (its token losses);
  // and the current slot's answers' log-probabilities after the head's forward (on the last
  // stage), split at that row.
  bool pipelined() const;
  bool holds_output_head() const;  // the last pipeline stage (or no pipeline)
  bool shared_prompts() const { return setup_.runtime.shared_prompt_side > 0; }
  int64_t load_pair(const PreferenceSource& pairs, uint64_t index, std::array<int64_t, 2>* tokens);
  std::array<double, 2> sequence_logps(int64_t rejected_row);
  // dpo_shared_prompt: lays the pairs out with their prompt once where the run allows it.
  void choose_dpo_layout();
  // Both answers' log-probabilities (forward passes only), and their target counts; over
  // pipeline stages zeros but on the last stage.
  std::array<double, 2> pair_logps(const PreferenceSource& pairs, uint64_t index,
                                   std::array<int64_t, 2>* tokens = nullptr);
  // Whether this rank's per-sequence host values count in sums over the ranks: one rank of
  // each data-parallel replica (the first context-parallel rank of the last pipeline stage).
  bool counts_sequence_values() const;
  void identify_dpo_reference();
  void prepare_dpo_reference();
  void keep_dpo_reference_copy();
  void reference_copy_logps(const PreferenceSource& pairs, const std::vector<uint64_t>& indices);
  std::array<double, 2> reference_logps(const PreferenceSource& pairs, uint64_t index) const;
  // A pair's loss from its answers' log-probabilities and target counts against the
  // reference's; adds its statistics (in DpoBatchStats' order) to *sums.
  DpoPair score_pair(const PreferenceSource& pairs, uint64_t index, const std::array<double, 2>& logps,
                     const std::array<int64_t, 2>& tokens, std::array<double, 6>* sums);
  DpoBatchStats dpo_gradients();
  // Pair statistics summed over the data-parallel ranks, as means over `pairs`.
  DpoBatchStats dpo_means(const std::array<double, 6>& sums, int64_t pairs);
  double evaluate_dpo();
  // objective grpo: the held-out accuracy (GrpoRun::evaluate), to metrics and TensorBoard.
  double evaluate_grpo(int64_t iteration);
  [[noreturn]] void stop_for_signal(int sig, const std::string& where);

  Experiment exp_;
  std::unique_ptr<Backend> backend_;
  Logger& log_;
  MetricsWriter* metrics_;
  dist::Communicator* comm_ = nullptr;
  const GrpoGenerationLink* generation_ = nullptr;
  std::unique_ptr<Tokenizer> tokenizer_;
  RunSetup setup_;
  // Model FLOPs per token of a step (ModelSpec::flops_per_token), in Tessera's count and with
  // causal attention counted half (Megatron-Bridge's): fixed for the run.
  double flops_per_token_ = 0, flops_per_token_causal_ = 0;
  std::string run_id_;
  // Where the weights came from, for the hint when the first iterations are not finite.
  std::string initial_weights_ = "a fresh initialisation with init_method_std";
  // Their files (a checkpoint's model.safetensors, a Hugging Face model's); none for a fresh
  // initialisation.
  std::vector<std::string> initial_weight_files_;
  // reference_load's weights (a frozen copy), their description and files, until DPO or GRPO
  // takes them; empty optional: the reference is the starting weights.
  std::optional<FrozenReference> reference_;
  std::string reference_weights_;
  std::vector<std::string> reference_files_;
  DataSources data_;
  std::unique_ptr<Model> model_;
  LoraModel* lora_ = nullptr;  // model_, when the run trains LoRA adapters
  std::unique_ptr<dist::Parallelism> parallel_;
  std::unique_ptr<AdamWOptimizer> optimizer_;
  DeviceBuffer scalar_buffer_;
  Tensor grad_norm_sq_;
  Tensor stop_signal_;        // (1) fp32: the signal number, max-reduced over the ranks
  Tensor out_of_time_flag_;   // (1) fp32: 1 once exit_duration_in_mins has passed, max-reduced
  bool out_of_time_ = false;  // agreed during the last iteration
  // Data-parallel runs that save: every rank takes part in a checkpoint, so a stop signal is
  // acted on only after an iteration, once the ranks have agreed on it.
  bool ranks_stop_together_ = false;
  int agreed_stop_signal_ = 0;
  std::vector<int32_t> host_tokens_, host_targets_, host_positions_;
  int64_t eval_loss_tokens_ = -1;  // of the validation batches, counted at the first evaluation
  std::unique_ptr<TrainingTensorBoard> tensorboard_;  // rank 0 with tensorboard_dir, else null
  struct DpoState;
  std::unique_ptr<DpoState> dpo_;  // objective dpo only
  std::unique_ptr<GrpoRun> grpo_;  // objective grpo only
  // Whether the run trains on the next-token loss of a dataset's samples (objective lm).
  bool lm_objective() const { return !dpo_ && !grpo_; }

  int64_t completed_iterations_ = 0;
  int64_t last_saved_iteration_ = -1;
  uint64_t consumed_samples_ = 0;
  int64_t applied_steps_ = 0;
  int64_t skipped_iterations_ = 0;
  int64_t consecutive_nan_ = 0;
  std::vector<StepHook*> step_hooks_;  // the model's (model/step_hook.h)
  // Records iterations [profile_step_start, profile_step_end) when logging.profile is on
  // for this rank, else null. Declared last: it detaches from the backend first.
  std::unique_ptr<profiler::TrainingProfiler> profiler_;
};

}  // namespace tessera
