#include "tessera/train/grpo_run.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>
#include <span>

#include <fmt/format.h>

#include "tessera/config/tokenizer_model.h"
#include "tessera/config/validate.h"
#include "tessera/core/error.h"
#include "tessera/core/random.h"
#include "tessera/data/chat.h"
#include "tessera/data/tokenizer.h"
#include "tessera/distributed/communicator.h"
#include "tessera/distributed/parallelism.h"
#include "tessera/model/continuations.h"
#include "tessera/model/generator.h"
#include "tessera/model/lora_model.h"
#include "tessera/model/model.h"
#include "tessera/obs/logger.h"
#include "tessera/obs/profiler/training_profiler.h"
#include "tessera/plan/memory_plan.h"
#include "tessera/train/frozen_reference.h"
#include "tessera/train/rewards.h"

namespace tessera {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct PromptSets {
  std::vector<GrpoPrompt> train, valid;
};

PromptSets read_prompt_sets(const Experiment& e, const Tokenizer& tokenizer, const ChatFormat* chat) {
  const TrainingConfig& t = e.training;
  const auto terms = grpo_reward_terms(t.grpo_rewards);
  const bool need_answer =
      std::any_of(terms.begin(), terms.end(), [](const auto& term) { return term.first == "answer"; });
  const int64_t room = t.seq_length - t.grpo_max_completion_length;
  PromptSets out;
  out.train = read_grpo_prompts(e.data.train_data_path, tokenizer, chat, need_answer, room);
  if (!e.data.valid_data_path.empty())
    out.valid = read_grpo_prompts(e.data.valid_data_path, tokenizer, chat, need_answer, room);
  return out;
}

}  // namespace

void check_grpo_prompts(const Experiment& e, const Tokenizer& tokenizer) {
  read_prompt_sets(e, tokenizer, grpo_chat_format(e.data, tokenizer).get());
}

std::vector<std::pair<std::string, double>> GrpoStepStats::trl_named() const {
  std::vector<std::pair<std::string, double>> out = {{"reward", reward}, {"reward_std", reward_std}};
  for (const auto& [name, mean] : reward_means) out.emplace_back("rewards/" + name + "/mean", mean);
  if (accuracy >= 0) out.emplace_back("accuracy", accuracy);
  out.insert(out.end(), {{"completions/mean_length", mean_length},
                         {"completions/max_length", max_length},
                         {"completions/clipped_ratio", clipped_ratio},
                         {"kl", kl},
                         {"entropy", entropy},
                         {"clip_ratio/low_mean", clip_low},
                         {"clip_ratio/high_mean", clip_high},
                         {"clip_ratio/region_mean", clip_region},
                         {"frac_reward_zero_std", frac_reward_zero_std},
                         {"time/generation_s", generation_s},
                         {"time/reference_s", reference_s},
                         {"time/training_s", training_s},
                         {"generation_tokens_per_s", decode_s > 0 ? generated_tokens / decode_s : 0.0}});
  if (offload_s >= 0) out.emplace_back("time/optimizer_offload_s", offload_s);
  if (weight_sync_s >= 0) out.emplace_back("time/weight_sync_s", weight_sync_s);
  return out;
}

GrpoRun::GrpoRun(const Parts& parts, std::unique_ptr<FrozenReference> reference, std::string reference_weights)
    : p_(parts),
      t_(parts.experiment.training),
      chat_(grpo_chat_format(parts.experiment.data, parts.tokenizer)),
      stop_(parts.tokenizer, parse_stop_strings(t_.grpo_stop_strings)),
      reference_weights_(reference ? std::move(reference_weights) : "the starting weights") {
  terms_ = grpo_reward_terms(t_.grpo_rewards);
  PromptSets prompts = read_prompt_sets(p_.experiment, p_.tokenizer, chat_.get());
  train_ = std::move(prompts.train);
  valid_ = std::move(prompts.valid);
  if (!t_.grpo_answer_regex.empty()) answer_regex_ = std::regex(t_.grpo_answer_regex, std::regex::ECMAScript);
  if (!t_.grpo_format_regex.empty()) format_regex_ = std::regex(t_.grpo_format_regex, std::regex::ECMAScript);
  options_ = {t_.grpo_epsilon, t_.grpo_epsilon_high, t_.grpo_beta, t_.grpo_loss_type, t_.grpo_max_completion_length};
  const int64_t dp = p_.parallel.data_parallel_size();
  per_rank_ = t_.global_batch_size / dp;
  accumulation_ = per_rank_ / t_.micro_batch_size;
  Model& model = p_.model;
  // Slots for the completions this rank decodes at once, reading the policy's weights in place:
  // under LoRA its frozen base (whole: no FSDP with GRPO) with the adapters added. Offloading,
  // the KV cache lives in the AdamW moments' memory (on the host while generating).
  const LoraModel* lora = p_.lora;
  if (p_.generation) {
    client_ = std::make_unique<GrpoGenerationClient>(*p_.generation, model.backend(), p_.generation->job->rank(),
                                                     grpo_link_completions(p_.experiment, dp), t_.seq_length);
  } else {
    const int64_t slots = grpo_generation_slots(t_, dp);
    const Tensor cache_region = t_.grpo_offload_optimizer_state ? lend_moments_to_cache(slots) : Tensor{};
    generator_ = std::make_unique<Generator>(model.backend(), model.spec(),
                                             lora ? lora->base_slices().front().values : model.params(),
                                             lora ? lora->base_layout() : model.layout(), t_.seq_length, slots,
                                             cache_region);
    if (p_.lora) generator_->use_adapters(&p_.lora->adapters());
  }
  if (t_.grpo_beta > 0)
    reference_ = reference ? std::move(reference)
                           : std::make_unique<FrozenReference>(model.backend(), p_.optimizer, model, p_.parallel);
  const int64_t tokens = model.runtime().tokens();
  scratch_ = DeviceBuffer(model.backend(), plan::grpo_exchange_bytes(tokens, t_.global_batch_size, terms_.size()),
                          "grpo exchange");
  tokens_.resize(static_cast<size_t>(tokens));
  targets_.resize(static_cast<size_t>(tokens));
}

GrpoRun::~GrpoRun() = default;

// The AdamW moments' memory for a KV cache of `slots` sequences, their host copy allocated now.
Tensor GrpoRun::lend_moments_to_cache(int64_t slots) {
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const Tensor region = p_.optimizer.moments_region();
  const size_t need =
      Generator::cache_bytes(p_.model.spec(), p_.model.runtime().compute_dtype, t_.seq_length, slots);
  if (region.nbytes() < need) {
    const auto it = p_.experiment.origin.find("grpo_offload_optimizer_state");
    throw ConfigError(it == p_.experiment.origin.end() ? "default" : it->second, "grpo_offload_optimizer_state",
                      "true",
                      fmt::format("false, or a KV cache that fits in the {:.3f} GiB of AdamW moments this rank "
                                  "holds: {} completions at once (grpo_max_num_seqs) x seq_length {} need {:.3f} GiB",
                                  static_cast<double>(region.nbytes()) / kGiB, slots, t_.seq_length,
                                  static_cast<double>(need) / kGiB));
  }
  const auto t0 = Clock::now();
  p_.optimizer.reserve_moments_stash();
  p_.log.info("grpo: the KV cache ({:.3f} GiB) in the AdamW moments' memory while generating; their host copy, "
              "{:.3f} GiB page-locked, allocated in {:.1f} s",
              static_cast<double>(need) / kGiB, static_cast<double>(region.nbytes()) / kGiB, seconds_since(t0));
  return region;
}

double GrpoRun::sync_generator() {
  Model& model = p_.model;
  if (client_) return client_->send_weights(model.params(), model.persistent_state());
  if (!model.persistent_state().empty()) generator_->copy_state(model.persistent_state());
  return 0.0;
}

std::string GrpoRun::describe() const {
  std::string stops;
  for (const std::string& stop : stop_.strings()) stops += fmt::format("{}{:?}", stops.empty() ? ", ending at " : " or ", stop);
  std::string rewards;
  for (const auto& [name, weight] : terms_) rewards += fmt::format("{}{} x {}", rewards.empty() ? "" : " + ", weight, name);
  return fmt::format(
      "{} prompts ({}){}; {} completions per prompt, {} prompt{} per step, up to {} new tokens "
      "(temperature {}, top-k {}, top-p {}, min-p {}{}); reward {}; {} optimizer step{} per "
      "generation batch; {}; {}",
      train_.size(), p_.experiment.data.train_data_path,
      valid_.empty() ? "" : fmt::format(", {} held out", valid_.size()), t_.grpo_num_generations,
      t_.global_batch_size / t_.grpo_num_generations, t_.global_batch_size == t_.grpo_num_generations ? "" : "s",
      t_.grpo_max_completion_length, t_.grpo_temperature,
      t_.grpo_top_k, t_.grpo_top_p, t_.grpo_min_p,
      stops,
      rewards, t_.grpo_num_iterations,
      t_.grpo_num_iterations == 1 ? "" : "s",
      reference_ ? fmt::format("KL to a frozen copy of {} (beta {}, {:.3f} GiB)", reference_weights_, t_.grpo_beta,
                               static_cast<double>(reference_->bytes()) / (1024.0 * 1024.0 * 1024.0))
                 : std::string("no KL term (grpo_beta 0)"),
      placement());
}

std::string GrpoRun::placement() const {
  if (!p_.generation) return "colocated: decoded with the weights in place";
  const GrpoGenerationLink& g = *p_.generation;
  return fmt::format("split: decoded on generation rank{} {} of the job, the weights broadcast to {} before each "
                     "batch and evaluation",
                     g.generation_ranks == 1 ? "" : "s",
                     g.generation_ranks == 1 ? fmt::format("{}", g.training_ranks)
                                             : fmt::format("{}-{}", g.training_ranks,
                                                           g.training_ranks + g.generation_ranks - 1),
                     g.generation_ranks == 1 ? "it" : "them");
}

// Megatron's sampler order: each micro-batch slot of the global batch holds
// data_parallel_size consecutive micro-batches, one per rank.
int64_t GrpoRun::global_index(int64_t micro_batch, int64_t row) const {
  return (micro_batch * p_.parallel.data_parallel_size() + p_.parallel.data_parallel_rank()) *
             t_.micro_batch_size +
         row;
}

// The prompts' completions, decoded with continuous batching (model/continuations.h):
// [prompt][stream].
std::vector<std::vector<GrpoRun::Completion>> GrpoRun::complete(const std::vector<PromptContinuations>& prompts,
                                                                const SamplingOptions& sampling, uint64_t seed) {
  ContinuationRequest request =
      grpo_continuation_request(t_, p_.tokenizer, chat_.get(), stop_, p_.model.spec().vocab_size);
  request.sampling = sampling;
  request.sampling.seed = seed;
  // Offloading, the moments leave the memory the KV cache fills and come back once it is done.
  const auto t0 = Clock::now();
  if (t_.grpo_offload_optimizer_state) p_.optimizer.stash_moments();
  offload_s_ = seconds_since(t0);
  std::vector<std::vector<Continuation>> groups;
  if (client_) {
    GrpoGenerationClient::Reply reply = client_->complete(prompts, request.sampling);
    groups = std::move(reply.continuations);
    decode_s_ = reply.decode_s;
  } else {
    const auto d0 = Clock::now();
    groups = continue_prompts(*generator_, prompts, request);
    decode_s_ = seconds_since(d0);
  }
  if (t_.grpo_offload_optimizer_state) {
    const auto t1 = Clock::now();
    p_.optimizer.restore_moments();
    offload_s_ += seconds_since(t1);
  }
  return completions_of(groups, /*keep_logps=*/false);
}

std::vector<std::vector<GrpoRun::Completion>> GrpoRun::completions_of(std::vector<std::vector<Continuation>>& groups,
                                                                      bool keep_logps) {
  std::vector<std::vector<Completion>> out;
  for (std::vector<Continuation>& group : groups) {
    std::vector<Completion>& mine = out.emplace_back();
    for (Continuation& c : group) {
      Completion& done = mine.emplace_back();
      done.ids = std::move(c.ids);
      done.entropy_sum = c.entropy_sum;
      done.clipped = c.end == Continuation::End::Length;
      done.stopped = c.end == Continuation::End::Stop;
      if (keep_logps) done.old_logp.assign(c.logps.begin(), c.logps.end());
    }
  }
  return out;
}

// Each reward term's value for each completion: [term][completion].
std::vector<std::vector<double>> GrpoRun::rewards(const std::vector<const GrpoPrompt*>& prompts,
                                                  const std::vector<Completion*>& completions) const {
  std::vector<std::string> texts;
  for (const Completion* c : completions) {
    std::vector<int32_t> ids = c->ids;
    if (!c->clipped && !c->stopped && !ids.empty()) ids.pop_back();  // the end token
    texts.push_back(p_.tokenizer.decode(ids));
  }
  std::vector<std::vector<double>> out;
  for (const auto& [name, weight] : terms_) {
    std::vector<double>& v = out.emplace_back();
    if (name == "command") {
      std::vector<RewardQuery> queries;
      for (size_t i = 0; i < texts.size(); ++i) queries.push_back({prompts[i]->text, texts[i], prompts[i]->answer});
      v = command_rewards(t_.grpo_reward_command, queries, t_.grpo_reward_timeout);
      continue;
    }
    for (size_t i = 0; i < texts.size(); ++i) {
      if (name == "answer") {
        const auto given = extract_answer(texts[i], t_.grpo_answer_format,
                                          t_.grpo_answer_format == AnswerFormat::Regex ? &answer_regex_ : nullptr);
        v.push_back(given && answers_match(*given, prompts[i]->answer) ? 1.0 : 0.0);
      } else if (name == "format") {
        v.push_back(std::regex_match(texts[i], format_regex_) ? 1.0 : 0.0);
      } else {  // overlong
        v.push_back(overlong_penalty(static_cast<int64_t>(completions[i]->ids.size()),
                                     t_.grpo_max_completion_length, t_.grpo_overlong_cache));
      }
    }
  }
  return out;
}

// Each epoch's prompts in an order of its own, the same on every rank; this rank's completions
// of batch `batch` in micro-batch order, consecutive ones of one group (one prompt) sharing its
// prefill, each with its random stream: its place in the global batch.
GrpoRun::BatchRequest GrpoRun::batch_request(int64_t batch) {
  const int64_t G = t_.grpo_num_generations, B = t_.global_batch_size, P = B / G;
  const int64_t n = static_cast<int64_t>(train_.size());
  BatchRequest r;
  r.prompt_of.resize(static_cast<size_t>(B));
  for (int64_t g = 0; g < P; ++g) {
    const int64_t at = batch * P + g, epoch = at / n;
    if (epoch != order_epoch_) {
      order_.resize(static_cast<size_t>(n));
      std::iota(order_.begin(), order_.end(), 0);
      std::mt19937_64 rng(random_bits(static_cast<uint64_t>(t_.seed), static_cast<uint64_t>(epoch)));
      std::shuffle(order_.begin(), order_.end(), rng);
      order_epoch_ = epoch;
    }
    for (int64_t k = 0; k < G; ++k) r.prompt_of[static_cast<size_t>(g * G + k)] = static_cast<int64_t>(order_[static_cast<size_t>(at % n)]);
  }
  r.seed = random_bits(static_cast<uint64_t>(t_.seed) ^ 0x6772706full, static_cast<uint64_t>(batch));
  std::vector<int64_t> mine_global;
  for (int64_t m = 0; m < accumulation_; ++m)
    for (int64_t b = 0; b < t_.micro_batch_size; ++b) mine_global.push_back(global_index(m, b));
  for (size_t k = 0; k < mine_global.size();) {
    const int64_t group = mine_global[k] / G;
    PromptContinuations& g = r.groups.emplace_back();
    size_t end = k;
    for (; end < mine_global.size() && mine_global[end] / G == group && (end == k || mine_global[end] == mine_global[end - 1] + 1); ++end)
      g.streams.push_back(static_cast<int32_t>(mine_global[end]));
    r.group_prompt.push_back(r.prompt_of[static_cast<size_t>(mine_global[k])]);
    g.prompt = train_[static_cast<size_t>(r.group_prompt.back())].ids;
    k = end;
  }
  return r;
}

void GrpoRun::generate_batch(int64_t batch, int64_t iteration) {
  const profiler::PhaseSpan span(p_.profiler, "generation");
  const auto t0 = Clock::now();
  const int64_t G = t_.grpo_num_generations, B = t_.global_batch_size, P = B / G;
  Model& model = p_.model;
  p_.parallel.params_complete();  // ZeRO-1's overlapped gather of the last update
  const SamplingOptions sampling{t_.grpo_temperature, t_.grpo_top_k, t_.grpo_top_p, t_.grpo_min_p, 0};
  const BatchRequest asked = batch_request(batch);
  weight_sync_s_ = 0;
  // The weights go to the generation ranks once per update: the batch asked for ahead and this
  // one's synchronous request, or the next batch's, may both follow the same one.
  const auto sync_once = [&] {
    if (synced_iteration_ != iteration) weight_sync_s_ += sync_generator();
    synced_iteration_ = iteration;
  };
  std::vector<std::vector<Completion>> done;
  if (ahead_ticket_ >= 0 && ahead_batch_ == batch) {
    // Sampled ahead, from the weights before the last batch's updates: the sampling policy's
    // log-probabilities are the generator's.
    GrpoGenerationClient::Reply reply = client_->receive(ahead_ticket_);
    decode_s_ = reply.decode_s;
    done = completions_of(reply.continuations, /*keep_logps=*/true);
    ahead_ticket_ = -1;
  } else {
    sync_once();
    done = complete(asked.groups, sampling, asked.seed);
  }
  // grpo_async_generation: the next batch decodes from the weights as they are now while this
  // one trains (one batch off-policy).
  if (t_.grpo_async_generation && batch + 1 <= (t_.train_iters - 1) / t_.grpo_num_iterations) {
    sync_once();
    const BatchRequest next = batch_request(batch + 1);
    SamplingOptions s = sampling;
    s.seed = next.seed;
    ahead_ticket_ = client_->request(next.groups, s);
    ahead_batch_ = batch + 1;
  }
  mine_.clear();
  std::vector<const GrpoPrompt*> prompts;
  for (size_t g = 0; g < done.size(); ++g)
    for (Completion& c : done[g]) {
      c.prompt = asked.group_prompt[g];
      mine_.push_back(std::move(c));
      prompts.push_back(&train_[static_cast<size_t>(asked.group_prompt[g])]);
    }
  std::vector<Completion*> completions;
  for (Completion& c : mine_) completions.push_back(&c);
  const std::vector<std::vector<double>> values = rewards(prompts, completions);

  // Every completion's reward terms, length and clip flag, and the entropy summed, exchanged.
  const size_t F = terms_.size();
  std::vector<float> all((F + 2) * static_cast<size_t>(B) + 2, 0.0f);
  double entropy = 0;
  for (int64_t m = 0, k = 0; m < accumulation_; ++m)
    for (int64_t b = 0; b < t_.micro_batch_size; ++b, ++k) {
      const auto j = static_cast<size_t>(global_index(m, b));
      for (size_t f = 0; f < F; ++f) all[f * B + j] = static_cast<float>(values[f][static_cast<size_t>(k)]);
      all[F * B + j] = static_cast<float>(mine_[static_cast<size_t>(k)].ids.size());
      all[(F + 1) * B + j] = mine_[static_cast<size_t>(k)].clipped ? 1.0f : 0.0f;
      entropy += mine_[static_cast<size_t>(k)].entropy_sum;
    }
  all[(F + 2) * B] = static_cast<float>(entropy);
  sum_over_ranks(all);

  std::vector<double> reward(static_cast<size_t>(B), 0.0);
  for (size_t f = 0; f < F; ++f)
    for (int64_t j = 0; j < B; ++j) reward[static_cast<size_t>(j)] += terms_[f].second * all[f * B + static_cast<size_t>(j)];
  advantages_ = group_advantages(reward, G, t_.grpo_scale_rewards);
  const std::vector<bool> informative = informative_groups(reward, G);
  included_.assign(static_cast<size_t>(B), true);
  GrpoStepStats& s = batch_stats_;
  s = GrpoStepStats{};
  counts_ = {};
  batch_tokens_ = 0;
  double length_sum = 0, clipped = 0;
  for (int64_t j = 0; j < B; ++j) {
    const double length = all[F * B + static_cast<size_t>(j)];
    included_[static_cast<size_t>(j)] = !t_.grpo_dynamic_sampling || informative[static_cast<size_t>(j / G)];
    if (included_[static_cast<size_t>(j)]) ++counts_.completions, counts_.tokens += static_cast<int64_t>(length);
    length_sum += length;
    s.max_length = std::max(s.max_length, length);
    clipped += all[(F + 1) * B + static_cast<size_t>(j)];
    batch_tokens_ += static_cast<int64_t>(train_[static_cast<size_t>(asked.prompt_of[static_cast<size_t>(j)])].ids.size() + length);
    s.reward += reward[static_cast<size_t>(j)] / static_cast<double>(B);
  }
  // TRL's reward_std: the mean of the groups' standard deviations.
  for (const double std : group_stds(reward, G)) s.reward_std += std / static_cast<double>(P);
  for (int64_t g = 0; g < P; ++g)
    if (!informative[static_cast<size_t>(g)]) s.frac_reward_zero_std += 1.0 / static_cast<double>(P);
  for (size_t f = 0; f < F; ++f) {
    double mean = 0;
    for (int64_t j = 0; j < B; ++j) mean += all[f * B + static_cast<size_t>(j)] / static_cast<double>(B);
    s.reward_means.emplace_back(terms_[f].first, mean);
    if (terms_[f].first == "answer") s.accuracy = mean;
  }
  s.mean_length = length_sum / static_cast<double>(B);
  s.clipped_ratio = clipped / static_cast<double>(B);
  s.entropy = all[(F + 2) * B] / std::max(length_sum, 1.0);
  s.generated_tokens = static_cast<int64_t>(length_sum);
  s.batch_tokens = batch_tokens_;
  s.generation_s = seconds_since(t0);
  s.offload_s = t_.grpo_offload_optimizer_state ? offload_s_ : -1;
  s.weight_sync_s = client_ ? weight_sync_s_ : -1;
  s.decode_s = decode_s_;
  batch_ = batch;

  if (reference_) {
    const profiler::PhaseSpan ref_span(p_.profiler, "grpo_reference");
    const auto r0 = Clock::now();
    reference_->use(true);
    for (int64_t m = 0; m < accumulation_; ++m) {
      for (int64_t b = 0; b < t_.micro_batch_size; ++b) fill_row(mine_[static_cast<size_t>(m * t_.micro_batch_size + b)], b);
      model.set_batch(tokens_.data(), targets_.data());
      model.forward_loss();
      std::vector<std::vector<double>> logps = row_logps(t_.micro_batch_size);
      for (int64_t b = 0; b < t_.micro_batch_size; ++b)
        mine_[static_cast<size_t>(m * t_.micro_batch_size + b)].ref_logp = std::move(logps[static_cast<size_t>(b)]);
    }
    reference_->use(false);
    model.zero_loss_sum();
    s.reference_s = seconds_since(r0);
  }
}

void GrpoRun::fill_row(const Completion& c, int64_t row) {
  const int64_t T = t_.seq_length;
  const std::vector<int32_t>& prompt = train_[static_cast<size_t>(c.prompt)].ids;
  int32_t* tokens = tokens_.data() + row * T;
  int32_t* targets = targets_.data() + row * T;
  std::fill(tokens, tokens + T, p_.tokenizer.eod_id());
  std::fill(targets, targets + T, -1);
  std::copy(prompt.begin(), prompt.end(), tokens);
  std::copy(c.ids.begin(), c.ids.end(), tokens + prompt.size());
  // Each completion token is the target of the position before it.
  for (size_t t = 0; t < c.ids.size(); ++t) targets[prompt.size() - 1 + t] = c.ids[t];
}

std::vector<std::vector<double>> GrpoRun::row_logps(int64_t rows) {
  const int64_t T = t_.seq_length;
  std::vector<float> losses(static_cast<size_t>(rows * T));
  p_.model.backend().download(losses.data(), p_.model.token_losses());
  std::vector<std::vector<double>> out(static_cast<size_t>(rows));
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t i = 0; i < T; ++i)
      if (targets_[static_cast<size_t>(b * T + i)] >= 0) out[static_cast<size_t>(b)].push_back(-losses[static_cast<size_t>(b * T + i)]);
  return out;
}

GrpoStepStats GrpoRun::gradients(int64_t iteration) {
  const int64_t batch = (iteration - 1) / t_.grpo_num_iterations;
  const bool generated = batch != batch_;
  if (generated) generate_batch(batch, iteration);
  GrpoStepStats s = batch_stats_;
  if (!generated) {  // the batch's generation was reported with the step that made it
    s.generation_s = s.reference_s = s.decode_s = 0, s.generated_tokens = 0;
    if (s.weight_sync_s > 0) s.weight_sync_s = 0;
  }
  const auto t0 = Clock::now();
  Model& model = p_.model;
  const int64_t T = t_.seq_length, mb = t_.micro_batch_size;
  // loss, then clip low, high and region and KL summed over the completion tokens
  std::array<double, 5> sums{};
  std::vector<float> weights(static_cast<size_t>(mb * T));
  const Tensor dlogps = scratch_.tensor(DType::F32, {mb * T});
  const float aux_scale = 1.0f / static_cast<float>(std::max<int64_t>(counts_.tokens, 1));
  p_.parallel.run_micro_batches(
      accumulation_, 1.0f,
      [&](int64_t m) {
        for (int64_t b = 0; b < mb; ++b) fill_row(mine_[static_cast<size_t>(m * mb + b)], b);
        model.set_batch(tokens_.data(), targets_.data());
      },
      [&](int64_t m) {
        const profiler::PhaseSpan span(p_.profiler, "forward_backward", "micro_batch", m);
        p_.parallel.begin_micro_batch(m == accumulation_ - 1);
        model.forward_loss();
        std::vector<std::vector<double>> logps = row_logps(mb);
        std::vector<GrpoCompletion> part;
        std::vector<int64_t> rows;
        for (int64_t b = 0; b < mb; ++b) {
          Completion& c = mine_[static_cast<size_t>(m * mb + b)];
          // The old policy is the one that sampled: this batch's first step's weights.
          if (c.old_logp.empty()) c.old_logp = logps[static_cast<size_t>(b)];
          if (!included_[static_cast<size_t>(global_index(m, b))]) continue;
          part.push_back({std::move(logps[static_cast<size_t>(b)]), c.old_logp, c.ref_logp,
                          advantages_[static_cast<size_t>(global_index(m, b))]});
          rows.push_back(b);
        }
        std::fill(weights.begin(), weights.end(), 0.0f);
        const GrpoBatchLoss loss = grpo_loss(options_, part, counts_);
        for (size_t i = 0; i < rows.size(); ++i) {
          const int64_t start = rows[i] * T + static_cast<int64_t>(train_[static_cast<size_t>(mine_[static_cast<size_t>(m * mb + rows[i])].prompt)].ids.size()) - 1;
          for (size_t t = 0; t < loss.dloss_dlogp[i].size(); ++t)
            weights[static_cast<size_t>(start) + t] = static_cast<float>(loss.dloss_dlogp[i][t]);
        }
        const double n = static_cast<double>(loss.tokens);
        sums[0] += loss.loss;
        sums[1] += loss.clip_low * n, sums[2] += loss.clip_high * n, sums[3] += loss.clip_region * n;
        sums[4] += loss.kl * n;
        model.backend().upload(dlogps, weights.data());
        model.token_loss_backward(dlogps, aux_scale);
      });
  std::array<float, 5> values;
  for (size_t k = 0; k < 5; ++k) values[k] = static_cast<float>(sums[k]);
  sum_over_ranks(values);
  const double tokens = static_cast<double>(std::max<int64_t>(counts_.tokens, 1));
  s.loss = values[0];
  s.clip_low = values[1] / tokens, s.clip_high = values[2] / tokens, s.clip_region = values[3] / tokens;
  s.kl = values[4] / tokens;
  s.training_s = seconds_since(t0);
  return s;
}

double GrpoRun::evaluate() {
  const profiler::PhaseSpan span(p_.profiler, "grpo_evaluation");
  const int64_t count = std::min<int64_t>(static_cast<int64_t>(valid_.size()),
                                          p_.experiment.data.eval_iters * t_.global_batch_size / t_.grpo_num_generations);
  const int64_t dp = p_.parallel.data_parallel_size(), rank = p_.parallel.data_parallel_rank();
  p_.parallel.params_complete();
  sync_generator();
  synced_iteration_ = -1;  // evaluations come between iterations: the next batch sends again
  // Greedy, each held-out prompt once, decoded together.
  std::vector<PromptContinuations> asked;
  std::vector<const GrpoPrompt*> prompts;
  for (int64_t i = rank; i < count; i += dp) {
    asked.push_back({valid_[static_cast<size_t>(i)].ids, {0}});
    prompts.push_back(&valid_[static_cast<size_t>(i)]);
  }
  std::vector<Completion> done;
  for (std::vector<Completion>& one : complete(asked, SamplingOptions{}, 0)) done.push_back(std::move(one[0]));
  std::vector<Completion*> completions;
  for (Completion& c : done) completions.push_back(&c);
  const std::vector<std::vector<double>> values = rewards(prompts, completions);
  const auto answer = std::find_if(terms_.begin(), terms_.end(), [](const auto& term) { return term.first == "answer"; });
  double score = 0;
  for (size_t i = 0; i < done.size(); ++i) {
    if (answer != terms_.end()) {
      score += values[static_cast<size_t>(answer - terms_.begin())][i];
    } else {
      for (size_t f = 0; f < terms_.size(); ++f) score += terms_[f].second * values[f][i];
    }
  }
  float total = static_cast<float>(score);
  sum_over_ranks({&total, 1});
  const double mean = total / static_cast<double>(std::max<int64_t>(count, 1));
  p_.log.info("grpo validation: {} {:.4f} over {} held-out prompts (greedy)",
              answer != terms_.end() ? "accuracy" : "reward", mean, count);
  return mean;
}

void GrpoRun::sum_over_ranks(std::span<float> values) {
  dist::sum_host_values(p_.parallel, p_.model.backend(), scratch_.tensor(DType::F32, {static_cast<int64_t>(scratch_.bytes() / 4)}), values);
}

}  // namespace tessera
