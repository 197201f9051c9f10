#pragma once
// GRPO's steps (objective grpo): each generation batch, the policy samples
// grpo_num_generations completions of each of global_batch_size / grpo_num_generations
// prompts with its own weights, in place (model/generator.h); the rewards score them
// (train/rewards.h) and each group's advantages follow (train/grpo.h); then
// grpo_num_iterations optimizer steps train on the batch, one completion per sequence, each
// through a forward pass for its tokens' log-probabilities and a backward weighted per token
// (Model::token_loss_backward).
//
// Data parallelism splits the completions as it splits samples (Megatron's order). Each
// completion's sampling is seeded by the run's seed, its generation batch and its place in
// the global batch, so the completions do not depend on the number of ranks; the ranks
// exchange rewards and lengths, and every rank computes every group's advantages.
#include <cstdint>
#include <memory>
#include <regex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/data/stop_strings.h"
#include "tessera/model/continuations.h"
#include "tessera/model/sampling.h"
#include "tessera/ops/device_buffer.h"
#include "tessera/train/grpo.h"
#include "tessera/train/grpo_generation.h"
#include "tessera/train/grpo_prompts.h"

namespace tessera {

class AdamWOptimizer;
class ChatFormat;
class FrozenReference;
class Generator;
class Logger;
class LoraModel;
class Model;
class Tokenizer;
namespace dist {
class Parallelism;
}
namespace profiler {
class TrainingProfiler;
}

// A step's statistics, over the global batch.
struct GrpoStepStats {
  double loss = 0;
  double reward = 0, reward_std = 0;  // the weighted sum's mean, and its std over the batch
  std::vector<std::pair<std::string, double>> reward_means;  // each reward, unweighted
  double accuracy = -1;  // the answer reward's mean (share of right answers); -1 without it
  double mean_length = 0, max_length = 0, clipped_ratio = 0;  // completions, in tokens
  double kl = 0, clip_low = 0, clip_high = 0, clip_region = 0;
  double entropy = 0;  // the policy's, per completion token, as it sampled
  double frac_reward_zero_std = 0;  // groups whose rewards are all equal
  // The generation batch's: seconds generating (0 on a step that reuses the batch), tokens
  // generated, and its prompt and completion tokens.
  double generation_s = 0;
  int64_t generated_tokens = 0, batch_tokens = 0;
  // The decoding's own seconds, where it ran (the generation rank, split; there it overlaps the
  // last batch's training with grpo_async_generation): generation_tokens_per_s's.
  double decode_s = 0;
  double reference_s = 0, training_s = 0;  // this step's reference and policy passes
  // The AdamW moments' trips to the host and back around its generation (with
  // grpo_offload_optimizer_state; -1 without), part of generation_s.
  double offload_s = -1;
  // Split placement: the weights' broadcast to the generation ranks (-1 colocated), part of
  // generation_s.
  double weight_sync_s = -1;
  // Under TRL's names, as the iteration line, metrics.jsonl and TensorBoard report them.
  std::vector<std::pair<std::string, double>> trl_named() const;
};

// Reads objective grpo's prompt files (train_data_path, valid_data_path) as a run would, so
// that a bad line stops the run before it writes anything; throws DataError naming the line.
void check_grpo_prompts(const Experiment& e, const Tokenizer& tokenizer);

class GrpoRun {
 public:
  struct Parts {
    const Experiment& experiment;
    Model& model;
    AdamWOptimizer& optimizer;
    dist::Parallelism& parallel;
    const Tokenizer& tokenizer;
    Logger& log;
    profiler::TrainingProfiler* profiler;  // may be null
    LoraModel* lora = nullptr;  // `model` when it is LoRA's: generation reads its base and adapters
    // Split placement (grpo_generation_gpus): where the completions are decoded; null:
    // colocated, here with the weights in place.
    const GrpoGenerationLink* generation = nullptr;
  };
  // Reads the prompts (train_data_path, valid_data_path). With grpo_beta, the KL reference is
  // `reference` (reference_load's weights, described by `reference_weights`), else a copy of
  // the weights as they are now (call after they are loaded).
  explicit GrpoRun(const Parts& parts, std::unique_ptr<FrozenReference> reference = nullptr,
                   std::string reference_weights = "");
  ~GrpoRun();

  std::string describe() const;
  // Iteration `iteration`'s gradients (accumulated into the model's), generating a new batch
  // when it starts one; every rank gets the same statistics.
  GrpoStepStats gradients(int64_t iteration);
  // Greedy completions of the first validation prompts (at most eval_iters x
  // global_batch_size / grpo_num_generations): the share of right answers (or without the
  // answer reward, the mean reward), logged and returned.
  double evaluate();
  bool has_validation() const { return !valid_.empty(); }
  // Prompt and completion tokens of one step, over the global batch.
  int64_t batch_tokens() const { return batch_tokens_; }

 private:
  // grpo_offload_optimizer_state: the AdamW moments' memory for a KV cache of `slots` sequences
  // (ConfigError when it cannot hold it), their host copy allocated now.
  Tensor lend_moments_to_cache(int64_t slots);
  // The generator's weights made the policy's current ones: read in place (colocated, only the
  // blocks' state copied) or broadcast to the generation ranks; the seconds of the broadcast.
  double sync_generator();
  // Where the completions are decoded, for describe().
  std::string placement() const;

  struct Completion {
    int64_t prompt = -1;  // index into prompts_
    std::vector<int32_t> ids;  // the completion's tokens
    std::vector<double> old_logp;  // the sampling policy's, per token (kept for mu > 1)
    std::vector<double> ref_logp;
    double entropy_sum = 0;
    bool clipped = false;  // ended at the length limit, not at an end token
    bool stopped = false;  // ended at a stop string (its last token stays in the text)
  };
  // What this rank asks of generation batch `batch`: each global completion's prompt, this
  // rank's groups with their streams and each group's prompt, and the batch's sampling seed.
  struct BatchRequest {
    std::vector<int64_t> prompt_of, group_prompt;
    std::vector<PromptContinuations> groups;
    uint64_t seed = 0;
  };
  BatchRequest batch_request(int64_t batch);
  // This rank's completions of generation batch `batch`, rewarded and exchanged; `iteration`
  // is the one it starts.
  void generate_batch(int64_t batch, int64_t iteration);
  // Completions from their continuations (moved out), [prompt][stream]; keep_logps: the
  // sampler's log-probabilities as the old policy's (a batch sampled ahead, by weights the
  // training ranks no longer hold).
  static std::vector<std::vector<Completion>> completions_of(std::vector<std::vector<Continuation>>& groups,
                                                             bool keep_logps);
  // Completions of each prompt, one per stream (the random stream of its sampling under
  // `seed`), [prompt][stream], decoded with continuous batching; greedy at temperature 0.
  std::vector<std::vector<Completion>> complete(const std::vector<PromptContinuations>& prompts,
                                                const SamplingOptions& sampling, uint64_t seed);
  std::vector<std::vector<double>> rewards(const std::vector<const GrpoPrompt*>& prompts,
                                           const std::vector<Completion*>& completions) const;
  // Loads this rank's completion `c` into the model's batch rows [row, row + 1).
  void fill_row(const Completion& c, int64_t row);
  // The model's log-probabilities of each completion token of micro-batch rows, after a forward.
  std::vector<std::vector<double>> row_logps(int64_t rows);
  int64_t global_index(int64_t micro_batch, int64_t row) const;
  // In place: summed over the data-parallel ranks, through the exchange buffer.
  void sum_over_ranks(std::span<float> values);

  Parts p_;
  const TrainingConfig& t_;
  std::unique_ptr<ChatFormat> chat_;
  StopStrings stop_;
  std::string reference_weights_;  // what the KL reference is, for the log
  std::vector<GrpoPrompt> train_, valid_;
  std::vector<std::pair<std::string, double>> terms_;
  std::regex answer_regex_, format_regex_;
  std::unique_ptr<Generator> generator_;          // colocated
  std::unique_ptr<GrpoGenerationClient> client_;  // split
  std::unique_ptr<FrozenReference> reference_;
  GrpoOptions options_;
  int64_t accumulation_ = 1, per_rank_ = 1;
  // The generation batch in hand: its number, this rank's completions (in micro-batch order),
  // each global completion's advantage and whether its group takes part, and its statistics.
  int64_t batch_ = -1;
  double offload_s_ = 0;  // the last complete()'s moments to the host and back
  double weight_sync_s_ = 0;  // the last generate_batch()'s broadcasts
  double decode_s_ = 0;       // the last batch's decoding
  int64_t synced_iteration_ = -1;  // the iteration whose weights the generation ranks hold
  // grpo_async_generation: the batch asked for ahead, and its ticket (-1: none).
  int64_t ahead_batch_ = -1;
  int ahead_ticket_ = -1;
  std::vector<Completion> mine_;
  std::vector<double> advantages_;
  std::vector<bool> included_;
  GrpoBatchCounts counts_;
  GrpoStepStats batch_stats_;
  int64_t batch_tokens_ = 0;
  std::vector<uint64_t> order_;  // the prompts' order in the epoch in hand
  int64_t order_epoch_ = -1;
  DeviceBuffer scratch_;  // exchanged values, and the per-token weights of the backward
  std::vector<int32_t> tokens_, targets_;
};

}  // namespace tessera
