// Generation with a KV cache against the model without one: at every step the cached
// generator's logits are those of a full forward pass over the whole sequence so far (the
// training model's forward_logits), for GQA, a sliding window shorter than the sequence, QKV
// bias, a tied head, Qwen3-MoE's QK norm with an MoE layer (shared expert), and DeepSeek's
// multi-latent attention (with and without a query latent, with YaRN) beside a sigmoid-routed MoE
// layer; and the sampler's rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/core/random.h"
#include "tessera/model/continuations.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/generator.h"
#include "tessera/model/init.h"
#include "tessera/model/sampling.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {
namespace {

// mla: 0 GQA, 1 multi-latent attention with a query latent and YaRN, 2 without a query latent.
ModelSpec spec(int64_t window, bool bias, bool tied, bool moe = false, int mla = 0) {
  ModelSpec s;
  if (mla > 0) {
    s.family = "deepseek";
    s.mla = {true, mla == 1 ? 24 : 0, 16, 8, 8, 12};
    s.yarn = {mla == 1, 4.0, 16, 32.0, 1.0, 0.8, 1.0};
    s.moe.experts = 4;
    s.moe.topk = 2;
    s.moe.ffn = 32;
    s.moe.shared_ffn = 16;
    s.moe.sigmoid = true;
    s.moe.layers = {false, true};
  } else if (moe) {
    s.family = "qwen3_moe";
    s.qk_norm = true;
    s.moe.experts = 4;
    s.moe.topk = 2;
    s.moe.ffn = 32;
    s.moe.shared_ffn = 16;
    s.moe.layers = {true, false};
  }
  s.vocab_size = s.tokenizer_vocab = 96;
  s.num_layers = 2;
  s.hidden = 64;
  s.ffn = 80;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 16;
  s.max_position_embeddings = 64;
  s.sliding_window = window;
  s.qkv_bias = bias;
  s.tied_embeddings = tied;
  s.init_std = 0.2f;  // large enough that the next token depends strongly on the context
  if (mla > 0) s.kv_heads = s.heads, s.head_dim = s.mla.rope_dim;
  return s;
}

// Random weights, the same for every model built from them.
std::vector<float> weights(Backend& b, const ModelSpec& s) {
  const ParamLayout layout = make_param_layout(s);
  DeviceBuffer buf(b, layout.total * 4, "weights");
  const Tensor flat = buf.tensor(DType::F32, {layout.total});
  init_parameters(b, s, layout, flat, 11);
  // Biases start at zero: give them values so that a missing bias would show.
  for (const ParamInfo& p : layout.params)
    if (p.name.ends_with(".bias"))
      b.init_normal(flat.flat_range(p.offset, p.numel()), 12, 0, 0, 0.3f);
  std::vector<float> host(layout.total);
  b.download(host.data(), flat);
  return host;
}

// The logits of the last position of `tokens` from the training model, no cache.
std::vector<float> full_forward(Backend& b, const ModelSpec& s, const std::vector<float>& w,
                                const std::vector<int32_t>& tokens) {
  ModelRuntime rt;
  rt.micro_batch = 1;
  rt.seq_length = static_cast<int64_t>(tokens.size());
  DecoderModel model(b, s, rt);
  b.upload(model.params(), w.data());
  const std::vector<int32_t> targets(tokens.size(), -1);
  model.set_batch(tokens.data(), targets.data());
  DeviceBuffer out(b, tokens.size() * s.vocab_size * 4, "logits");
  const Tensor logits = out.tensor(DType::F32, {rt.seq_length, s.vocab_size});
  model.forward_logits(logits);
  std::vector<float> all(tokens.size() * s.vocab_size);
  b.download(all.data(), logits);
  return std::vector<float>(all.end() - s.vocab_size, all.end());
}

double max_relative(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0, scale = 0;
  for (float x : b) scale = std::max(scale, static_cast<double>(std::fabs(x)));
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - b[i]));
  return worst / scale;
}

struct Case {
  const char* name;
  int64_t window;
  bool bias, tied;
  bool moe = false;
  int mla = 0;
};

class GeneratorVsFullForward : public ::testing::TestWithParam<Case> {};

TEST_P(GeneratorVsFullForward, EveryStepsLogitsMatchAndGreedyTokensAgree) {
  const Case c = GetParam();
  const ModelSpec s = spec(c.window, c.bias, c.tied, c.moe, c.mla);
  auto backend = make_cpu_backend();
  const std::vector<float> w = weights(*backend, s);
  const ParamLayout layout = make_param_layout(s);
  Generator gen(*backend, s, DType::F32, 24);
  gen.load([&](const ParamInfo& p) {
    return std::vector<float>(w.begin() + p.offset, w.begin() + p.offset + p.numel());
  });
  std::vector<int32_t> tokens;
  for (int i = 0; i < 7; ++i) tokens.push_back(static_cast<int32_t>(random_below(5, i, 96)));
  std::vector<float> logits = gen.prefill(tokens);
  Sampler greedy({});
  std::map<int32_t, int> distinct;
  for (int step = 0; step < 12; ++step) {
    SCOPED_TRACE("step " + std::to_string(step) + ", " + std::to_string(tokens.size()) + " tokens");
    const std::vector<float> reference = full_forward(*backend, s, w, tokens);
    EXPECT_LT(max_relative(logits, reference), 1e-5);
    const int32_t next = greedy.next(logits, s.vocab_size);
    EXPECT_EQ(next, greedy.next(reference, s.vocab_size));
    ++distinct[next];
    tokens.push_back(next);
    logits = gen.step(next);
  }
  EXPECT_EQ(gen.position(), 19);
  EXPECT_GT(distinct.size(), 1u) << "the model must not be constant for the check to mean much";
}

INSTANTIATE_TEST_SUITE_P(Models, GeneratorVsFullForward,
                         ::testing::Values(Case{"gqa", 0, false, false},
                                           Case{"window5_bias", 5, true, false},
                                           Case{"tied", 0, false, true},
                                           Case{"qk_norm_moe", 0, false, false, true},
                                           Case{"mla_q_latent_yarn", 0, false, false, false, 1},
                                           Case{"mla_direct_queries", 0, false, false, false, 2}),
                         [](const auto& info) { return std::string(info.param.name); });

// Continuous batching: slots at positions of their own, decoded together (two prompts, a copy
// of the first taking other tokens, a slot idle until a third prompt enters mid-flight): each
// slot's logits and greedy tokens are those of decoding its sequence alone, for every family
// (multi-latent attention's tokens packed as one run, each with its position's rotary row).
TEST_P(GeneratorVsFullForward, SlotsAtTheirOwnPositionsDecodedTogetherMatchEachDecodedAlone) {
  const Case c = GetParam();
  const ModelSpec s = spec(c.window, c.bias, c.tied, c.moe, c.mla);
  auto backend = make_cpu_backend();
  const std::vector<float> w = weights(*backend, s);
  const auto load = [&](Generator& g) {
    g.load([&](const ParamInfo& p) { return std::vector<float>(w.begin() + p.offset, w.begin() + p.offset + p.numel()); });
  };
  constexpr int64_t kSlots = 4, kSteps = 10;
  Generator together(*backend, s, DType::F32, 15, kSlots);
  load(together);
  const std::vector<std::vector<int32_t>> prompts = {{5, 9, 33, 2, 71}, {44, 3}, {5, 9, 33, 2, 71}, {8, 61, 12}};
  together.prefill_slot(0, prompts[0]);
  together.prefill_slot(1, prompts[1]);
  together.copy_slot(0, 2);
  EXPECT_EQ(together.position(2), 5);
  // Each slot's tokens: its own first one, then greedy; slot 3 enters at step 4.
  std::vector<int32_t> next = {7, 40, 88, -1};
  std::vector<std::vector<int32_t>> taken(kSlots);
  std::vector<std::vector<std::vector<float>>> logits(kSlots);
  Sampler greedy({});
  for (int step = 0; step < kSteps; ++step) {
    if (step == 4) {
      together.prefill_slot(3, prompts[3]);
      next[3] = 19;
    }
    together.step_slots(next);
    const std::vector<float> all = together.logits(kSlots);
    for (int64_t b = 0; b < kSlots; ++b) {
      if (next[b] < 0) continue;
      taken[b].push_back(next[b]);
      logits[b].emplace_back(all.begin() + b * s.vocab_size, all.begin() + (b + 1) * s.vocab_size);
      next[b] = greedy.next(logits[b].back(), s.vocab_size);
    }
  }
  EXPECT_EQ(together.position(0), 5 + kSteps);
  EXPECT_EQ(together.position(1), 2 + kSteps);
  EXPECT_EQ(together.position(3), 3 + kSteps - 4);
  for (int64_t b = 0; b < kSlots; ++b) {
    SCOPED_TRACE("slot " + std::to_string(b));
    Generator alone(*backend, s, DType::F32, 24);
    load(alone);
    alone.prefill(prompts[b]);
    for (size_t step = 0; step < taken[b].size(); ++step) {
      const std::vector<float> one = alone.step(taken[b][step]);
      EXPECT_LT(max_relative(logits[b][step], one), 1e-5) << "step " << step;
      if (step + 1 < taken[b].size()) EXPECT_EQ(taken[b][step + 1], greedy.next(one, s.vocab_size)) << "step " << step;
    }
  }
  EXPECT_NE(taken[0], taken[2]);
}

// The continuation engine's promise (model/continuations.h): a continuation is the same however
// many slots it shares and whatever else is decoded beside it. Prompts of different lengths with
// one to three continuations each, some ending early at an end token (freeing their slots
// mid-flight), decoded in 1, 3 and 16 slots, with draws on the device (temperature) and on the
// host (top-k): the same ids, the same log-probabilities within 1e-5, and each ending as its ids
// say.
TEST(Continuations, DoNotDependOnTheSlotsTheyShareOrWhatIsDecodedBesideThem) {
  const ModelSpec s = spec(0, false, false);
  auto backend = make_cpu_backend();
  const std::vector<float> w = weights(*backend, s);
  const std::vector<std::vector<int32_t>> prompts = {{5, 9, 33, 2, 71}, {44, 3}, {8, 61, 12}, {1}, {90, 91, 92, 93}};
  std::vector<PromptContinuations> asked;
  for (size_t p = 0; p < prompts.size(); ++p) {
    PromptContinuations& c = asked.emplace_back();
    c.prompt = prompts[p];
    for (size_t k = 0; k <= p % 3; ++k) c.streams.push_back(static_cast<int32_t>(10 * p + k));
  }
  // One id in 8 ends a continuation: most end early, some run to the length limit.
  const auto is_end = [](int32_t token) { return token % 8 == 7; };
  for (const int64_t top_k : {0, 20}) {
    SCOPED_TRACE(top_k ? "top-k on the host" : "temperature on the device");
    ContinuationRequest r;
    r.sampling.temperature = 1.0;
    r.sampling.top_k = top_k;
    r.sampling.seed = 11;
    r.max_new_tokens = 12;
    r.vocab = s.vocab_size;
    r.is_end_token = is_end;
    std::vector<std::vector<std::vector<Continuation>>> runs;
    for (const int64_t slots : {1, 3, 16}) {
      Generator gen(*backend, s, DType::F32, 5 + r.max_new_tokens, slots);
      gen.load([&](const ParamInfo& p) { return std::vector<float>(w.begin() + p.offset, w.begin() + p.offset + p.numel()); });
      runs.push_back(continue_prompts(gen, asked, r));
    }
    int ended_early = 0, ran_to_the_limit = 0;
    for (size_t p = 0; p < asked.size(); ++p) {
      ASSERT_EQ(runs[0][p].size(), asked[p].streams.size());
      for (size_t k = 0; k < asked[p].streams.size(); ++k) {
        const Continuation& one = runs[0][p][k];
        const bool early = is_end(one.ids.back());
        ended_early += early;
        ran_to_the_limit += !early;
        EXPECT_EQ(one.end, early ? Continuation::End::Token : Continuation::End::Length);
        if (!early) EXPECT_EQ(one.ids.size(), 12u);
        EXPECT_EQ(std::count_if(one.ids.begin(), one.ids.end(), is_end), early ? 1 : 0);
        for (size_t run = 1; run < runs.size(); ++run) {
          const Continuation& other = runs[run][p][k];
          EXPECT_EQ(other.ids, one.ids) << "prompt " << p << " continuation " << k << " run " << run;
          ASSERT_EQ(other.logps.size(), one.logps.size());
          for (size_t i = 0; i < one.logps.size(); ++i) EXPECT_NEAR(other.logps[i], one.logps[i], 1e-5);
          EXPECT_NEAR(other.entropy_sum, one.entropy_sum, 1e-4);
        }
      }
    }
    EXPECT_GT(ended_early, 0) << "no continuation ended early: the test frees no slot mid-flight";
    EXPECT_GT(ran_to_the_limit, 0);
    EXPECT_NE(runs[0][2][0].ids, runs[0][2][1].ids);  // two streams of one prompt differ
  }
}

TEST(Generator, RefusesPositionsBeyondItsRoom) {
  const ModelSpec s = spec(0, false, false);
  auto backend = make_cpu_backend();
  Generator gen(*backend, s, DType::F32, 4);
  gen.load([&](const ParamInfo& p) { return std::vector<float>(p.numel(), 0.01f); });
  gen.prefill({1, 2, 3});
  gen.step(4);
  EXPECT_THROW(gen.step(5), Error);
  EXPECT_THROW(gen.prefill({1, 2, 3, 4, 5}), Error);
  EXPECT_THROW(gen.prefill({1, 200}), DataError);  // outside the vocabulary
}

// GRPO's generation: a generator reading a training model's weights in place (no copy) samples
// tokens whose log-probabilities under its logits are the ones the training forward computes
// for the same sequence (Model::token_losses), position by position; an update to the model's
// weights is what the generator reads next.
TEST(Generator, InPlaceOnAModelsWeightsGivesTheTrainingForwardsLogProbabilities) {
  const ModelSpec s = spec(0, false, false);
  auto backend = make_cpu_backend();
  const std::vector<float> w = weights(*backend, s);
  ModelRuntime rt;
  rt.micro_batch = 1;
  rt.seq_length = 20;
  DecoderModel model(*backend, s, rt);
  backend->upload(model.params(), w.data());
  Generator gen(*backend, s, model.params(), model.layout(), rt.seq_length);
  SamplingOptions o;
  o.temperature = 1.0, o.seed = 4;
  Sampler sampler(o);
  std::vector<int32_t> tokens = {3, 17, 42, 8};
  const size_t prompt = tokens.size();
  std::vector<double> sampled_logps;
  std::vector<float> logits = gen.prefill(tokens);
  while (static_cast<int64_t>(tokens.size()) < rt.seq_length) {
    const int32_t next = sampler.next(logits, s.vocab_size);
    double z = 0;
    for (float l : logits) z += std::exp(static_cast<double>(l));
    sampled_logps.push_back(logits[next] - std::log(z));
    tokens.push_back(next);
    if (static_cast<int64_t>(tokens.size()) < rt.seq_length) logits = gen.step(next);
  }
  std::vector<int32_t> targets(tokens.size(), -1);
  for (size_t i = prompt - 1; i + 1 < tokens.size(); ++i) targets[i] = tokens[i + 1];
  model.set_batch(tokens.data(), targets.data());
  model.forward_loss();
  std::vector<float> losses(tokens.size());
  backend->download(losses.data(), model.token_losses());
  for (size_t t = 0; t < sampled_logps.size(); ++t)
    EXPECT_NEAR(-losses[prompt - 1 + t], sampled_logps[t], 1e-4) << "completion token " << t;

  // The model's weights changed: the generator's next prefill reads them.
  std::vector<float> scaled = w;
  for (float& x : scaled) x *= 0.5f;
  backend->upload(model.params(), scaled.data());
  const std::vector<float> after = gen.prefill({3, 17, 42, 8});
  EXPECT_LT(max_relative(after, full_forward(*backend, s, scaled, {3, 17, 42, 8})), 1e-5);
}

// The device draw (Backend::sample_tokens) on one row of logits repeated over 40000 streams:
// frequencies follow softmax(logit / temperature) within 5 standard deviations, ids at or
// beyond `vocab` are never drawn, min-p leaves out what it should, temperature 0 is the argmax;
// its log-probability and entropy are those of softmax(logits) at temperature 1.
TEST(Sampler, DeviceDrawFollowsTheSoftmaxAndReportsLogProbabilityAndEntropy) {
  const std::vector<float> row = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f, 50.0f};  // id 5: padding
  constexpr int64_t kRows = 40000, V = 6, vocab = 5;
  auto backend = make_cpu_backend();
  DeviceBuffer buf(*backend, kRows * (V + 5) * 4, "draw");
  const Tensor logits = buf.tensor(DType::F32, {kRows, V});
  const Tensor streams = buf.tensor(DType::I32, {kRows}, kRows * V * 4);
  const Tensor steps = buf.tensor(DType::I32, {kRows}, kRows * (V + 4) * 4);
  const Tensor tokens = buf.tensor(DType::I32, {kRows}, kRows * (V + 1) * 4);
  const Tensor logps = buf.tensor(DType::F32, {kRows}, kRows * (V + 2) * 4);
  const Tensor entropy = buf.tensor(DType::F32, {kRows}, kRows * (V + 3) * 4);
  std::vector<float> all;
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < kRows; ++r) all.insert(all.end(), row.begin(), row.end()), ids.push_back(static_cast<int32_t>(r));
  backend->upload(logits, all.data());
  backend->upload(streams, ids.data());
  backend->upload(steps, std::vector<int32_t>(kRows, 3).data());
  const auto draw = [&](float temperature, float min_p) {
    backend->sample_tokens(tokens, logps, entropy, logits, streams, steps, vocab, temperature, min_p, 99);
    std::vector<int32_t> t(kRows);
    backend->download(t.data(), tokens);
    std::map<int32_t, int> counts;
    for (int32_t x : t) ++counts[x];
    return counts;
  };
  std::map<int32_t, int> counts = draw(2.0f, 0.0f);
  EXPECT_EQ(counts.count(5), 0u);
  double z = 0;
  for (int id = 0; id < vocab; ++id) z += std::exp(row[id] / 2.0);
  for (int id = 0; id < vocab; ++id) {
    const double p = std::exp(row[id] / 2.0) / z;
    EXPECT_NEAR(counts[id], kRows * p, 5 * std::sqrt(kRows * p * (1 - p))) << "id " << id;
  }
  // At temperature 1 and every row the same, each row's log-probability of its token and
  // entropy over all 6 columns (the padding's included).
  std::vector<int32_t> t(kRows);
  std::vector<float> lp(kRows), h(kRows);
  backend->download(t.data(), tokens);
  backend->download(lp.data(), logps);
  backend->download(h.data(), entropy);
  double all_z = 0, weighted = 0;
  for (float x : row) all_z += std::exp(static_cast<double>(x) - 50.0), weighted += std::exp(x - 50.0) * (x - 50.0);
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_NEAR(lp[r], row[t[r]] - 50.0 - std::log(all_z), 1e-5);
    EXPECT_NEAR(h[r], std::log(all_z) - weighted / all_z, 1e-5);
  }
  // Min-p 0.5 at temperature 1 keeps ids 1 and 3; temperature 0 is the first of equal maxima.
  counts = draw(1.0f, 0.5f);
  EXPECT_EQ(counts.size(), 2u);
  EXPECT_GT(counts[1], 0);
  EXPECT_GT(counts[3], 0);
  counts = draw(0.0f, 0.0f);
  EXPECT_EQ(counts.size(), 1u);
  EXPECT_EQ(counts.begin()->first, 1);
}

TEST(Sampler, GreedyTopKTopPMinPAndTemperatureFollowTheirDefinitions) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f, 50.0f};  // id 5: padding
  EXPECT_EQ(Sampler({}).next(logits, 5), 1) << "greedy: the first of equal maxima";
  SamplingOptions top1;
  top1.temperature = 1.0, top1.top_k = 1;
  EXPECT_EQ(Sampler(top1).next(logits, 5), 1);
  SamplingOptions narrow;
  narrow.temperature = 1.0, narrow.top_p = 1e-6;
  EXPECT_EQ(Sampler(narrow).next(logits, 5), 1) << "the nucleus keeps at least the top token";

  // At temperature 2 over {0, 1, 2, 3} (top_k 4 drops id 4), frequencies follow
  // softmax(logit / 2): checked within 5 standard deviations over 40000 draws.
  SamplingOptions o;
  o.temperature = 2.0, o.top_k = 4, o.seed = 7;
  Sampler sampler(o);
  std::map<int32_t, int> counts;
  constexpr int kDraws = 40000;
  for (int i = 0; i < kDraws; ++i) ++counts[sampler.next(logits, 5)];
  EXPECT_EQ(counts.count(4), 0u);
  EXPECT_EQ(counts.count(5), 0u);
  double z = 0;
  for (int id = 0; id < 4; ++id) z += std::exp(logits[id] / 2.0);
  for (int id = 0; id < 4; ++id) {
    const double p = std::exp(logits[id] / 2.0) / z;
    const double sd = std::sqrt(kDraws * p * (1 - p));
    EXPECT_NEAR(counts[id], kDraws * p, 5 * sd) << "id " << id;
  }
  // Without top-k or top-p (sampled without sorting), over every id below the vocabulary.
  SamplingOptions all;
  all.temperature = 2.0, all.seed = 9;
  Sampler every(all);
  std::map<int32_t, int> drawn;
  for (int i = 0; i < kDraws; ++i) ++drawn[every.next(logits, 5)];
  EXPECT_EQ(drawn.count(5), 0u);
  z = 0;
  for (int id = 0; id < 5; ++id) z += std::exp(logits[id] / 2.0);
  for (int id = 0; id < 5; ++id) {
    const double p = std::exp(logits[id] / 2.0) / z;
    EXPECT_NEAR(drawn[id], kDraws * p, 5 * std::sqrt(kDraws * p * (1 - p))) << "unsorted, id " << id;
  }
  // Min-p 0.5 at temperature 1: ids 1 and 3 (e^3 each) stay, id 2 (e^2 < 0.5 e^3) goes.
  SamplingOptions min_p;
  min_p.temperature = 1.0, min_p.min_p = 0.5, min_p.seed = 5;
  Sampler ms(min_p);
  std::map<int32_t, int> kept;
  for (int i = 0; i < 2000; ++i) ++kept[ms.next(logits, 5)];
  EXPECT_EQ(kept.size(), 2u);
  EXPECT_GT(kept[1], 0);
  EXPECT_GT(kept[3], 0);
  // At temperature 1 ids 1 and 3 have probability 0.40 each: top_p 0.6 keeps both, nothing else.
  SamplingOptions nucleus;
  nucleus.temperature = 1.0, nucleus.top_p = 0.6, nucleus.seed = 3;
  Sampler ns(nucleus);
  for (int i = 0; i < 2000; ++i) {
    const int32_t t = ns.next(logits, 5);
    EXPECT_TRUE(t == 1 || t == 3) << t;
  }
}

}  // namespace
}  // namespace tessera
