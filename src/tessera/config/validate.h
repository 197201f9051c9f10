#pragma once
#include <string>
#include <utility>
#include <vector>

#include "tessera/config/config.h"

namespace tessera {

// Cross-key checks (divisibility, ranges, impossible combinations). Throws ConfigError
// naming the file or command line that set the offending key.
// world_size: the ranks of the job, which tensor, pipeline and context parallelism divide.
void validate_experiment(const Experiment& e, int world_size);

// grpo_rewards' terms, "name[:weight],...", as (name, weight) in order; throws
// std::invalid_argument saying what is wrong with the text.
std::vector<std::pair<std::string, double>> grpo_reward_terms(const std::string& text);

// A stop-strings value (grpo_stop_strings, generate's --stop): a YAML/JSON list of strings
// ('["\n\n", "</answer>"]') or one string; empty: none. Throws std::invalid_argument saying
// what is wrong (an empty string, a list that is not one of strings).
std::vector<std::string> parse_stop_strings(const std::string& value);

// The completions a GRPO rank decodes at once (its generator's slots): grpo_max_num_seqs, or
// all of the rank's completions of a generation batch.
int64_t grpo_generation_slots(const TrainingConfig& t, int64_t data_parallel_size);
// The ranks of a job of `job_ranks` that train: all, but under GRPO's split placement the
// grpo_generation_gpus that only generate.
int grpo_training_ranks(const TrainingConfig& t, int job_ranks);
// Split placement: the most completions a training rank asks its generation rank for at once,
// its share of a generation batch or of an evaluation (at most eval_iters x global_batch_size /
// grpo_num_generations held-out prompts).
int64_t grpo_link_completions(const Experiment& e, int64_t data_parallel_size);
// Split placement: a generation rank serving `served` of `training_ranks` training ranks decodes
// up to `slots` sequences at once (grpo_max_num_seqs, or all of its ranks' completions of a
// batch), and its link holds what they ask at once.
struct GrpoGenerationShare {
  int64_t slots = 0, link_completions = 0;
};
GrpoGenerationShare grpo_generation_share(const Experiment& e, int64_t training_ranks, int64_t served);

}  // namespace tessera
