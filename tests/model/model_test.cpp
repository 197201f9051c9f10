#include <cmath>
#include <cstring>
#include <functional>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/model_step.h"
#include "model/tiny_decoder.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/core/random.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/init.h"
#include "tessera/model/rope.h"

namespace tessera {
namespace {

ModelSpec tiny_spec() {
  ModelSpec s = tiny_decoder_spec(3);
  s.qkv_bias = true;
  return s;
}

// Loss and flat gradients of one micro-batch for a given runtime.
struct Result {
  float loss_sum = 0;
  std::vector<float> grads;
};

// Targets at positions where `ignored` holds are -1 (no loss); by default every fifth.
Result run(const ModelSpec& spec, ModelRuntime rt,
           const std::function<bool(int64_t)>& ignored = [](int64_t i) { return i % 5 == 0; }) {
  auto backend = make_cpu_backend();
  DecoderModel model(*backend, spec, rt);
  testing::init_test_model(*backend, spec, model);
  const int64_t N = rt.micro_batch * rt.seq_length;
  std::vector<int32_t> tokens(N), targets(N);
  for (int64_t i = 0; i < N; ++i) {
    tokens[i] = static_cast<int32_t>(random_below(1, i, 64));
    targets[i] = ignored(i) ? -1 : static_cast<int32_t>(random_below(2, i, 64));
  }
  model.set_batch(tokens.data(), targets.data());
  model.forward_backward(1.0f / N);
  Result r;
  backend->download(&r.loss_sum, model.loss_sum());
  r.grads.resize(model.layout().total);
  backend->download(r.grads.data(), model.grads());
  return r;
}

ModelRuntime base_runtime() {
  ModelRuntime rt;
  rt.micro_batch = 2;
  rt.seq_length = 12;
  return rt;
}

// FP8 attention (fp8_dot_product_attention) reaches every layer's attention: on the CPU's
// emulation of its codes the loss and gradients move by the codes' error and no more, and full
// recompute replays the same codes.
TEST(Model, Fp8AttentionMovesTheLossByItsCodesErrorOnly) {
  ModelSpec spec = tiny_spec();
  spec.head_dim = 128;  // FP8 attention's heads
  const Result exact = run(spec, base_runtime());
  ModelRuntime rt = base_runtime();
  rt.fp8_attention = true;
  const Result fp8 = run(spec, rt);
  EXPECT_NE(fp8.loss_sum, exact.loss_sum);
  EXPECT_LT(std::abs(fp8.loss_sum - exact.loss_sum), 0.01 * std::abs(exact.loss_sum));
  const double grads = relative_difference(fp8.grads, exact.grads);
  EXPECT_GT(grads, 0.0);
  EXPECT_LT(grads, 0.1);
  rt.recompute = RecomputeGranularity::Full;
  EXPECT_EQ(run(spec, rt).grads, fp8.grads);
}

TEST(Model, RecomputeGivesIdenticalGradients) {
  const ModelSpec spec = tiny_spec();
  const Result plain = run(spec, base_runtime());
  ASSERT_TRUE(std::isfinite(plain.loss_sum));
  for (auto [mode, layers] : {std::pair{RecomputeGranularity::Full, int64_t{0}},
                              std::pair{RecomputeGranularity::Full, int64_t{2}},
                              std::pair{RecomputeGranularity::Selective, int64_t{0}}}) {
    ModelRuntime rt = base_runtime();
    rt.recompute = mode;
    rt.recompute_num_layers = layers;
    const Result r = run(spec, rt);
    // Recompute re-runs the same ops on the same inputs: bitwise equal on the CPU.
    EXPECT_EQ(r.loss_sum, plain.loss_sum);
    EXPECT_EQ(0, std::memcmp(r.grads.data(), plain.grads.data(), r.grads.size() * 4))
        << "recompute mode " << static_cast<int>(mode) << " layers " << layers;
  }
}

TEST(Model, RecomputeReducesPlannedActivationMemory) {
  const ModelSpec spec = tiny_spec();
  ModelRuntime rt = base_runtime();
  const size_t plain = DecoderModel::plan_memory(spec, rt).activations;
  rt.recompute = RecomputeGranularity::Selective;
  const size_t selective = DecoderModel::plan_memory(spec, rt).activations;
  rt.recompute = RecomputeGranularity::Full;
  const size_t full = DecoderModel::plan_memory(spec, rt).activations;
  EXPECT_LT(selective, plain);
  EXPECT_LT(full, selective);
}

TEST(Model, CrossEntropyChunkingDoesNotChangeResults) {
  const ModelSpec spec = tiny_spec();
  const Result whole = run(spec, base_runtime());
  ModelRuntime rt = base_runtime();
  rt.cross_entropy_chunk_tokens = 7;  // does not divide 24 tokens
  const Result chunked = run(spec, rt);
  EXPECT_NEAR(chunked.loss_sum, whole.loss_sum, 1e-5 * std::abs(whole.loss_sum));
  double diff = 0, norm = 0;
  for (size_t i = 0; i < whole.grads.size(); ++i) {
    diff += std::pow(chunked.grads[i] - whole.grads[i], 2);
    norm += std::pow(whole.grads[i], 2);
  }
  EXPECT_LT(std::sqrt(diff / norm), 1e-6);
}

// Loss masks: a masked target adds nothing to the loss or the gradients, an unmasked one its
// whole share. Two complementary masks therefore add up to the unmasked batch.
TEST(Model, MaskedTargetsAddNothingToLossOrGradients) {
  const ModelSpec spec = tiny_spec();
  const Result full = run(spec, base_runtime(), [](int64_t) { return false; });
  const Result even = run(spec, base_runtime(), [](int64_t i) { return i % 3 == 0; });
  const Result odd = run(spec, base_runtime(), [](int64_t i) { return i % 3 != 0; });
  EXPECT_NEAR(even.loss_sum + odd.loss_sum, full.loss_sum, 1e-5 * std::abs(full.loss_sum));
  double diff = 0, norm = 0;
  for (size_t i = 0; i < full.grads.size(); ++i) {
    diff += std::pow(even.grads[i] + odd.grads[i] - full.grads[i], 2);
    norm += std::pow(full.grads[i], 2);
  }
  EXPECT_LT(std::sqrt(diff / norm), 1e-5);
  // All masked: no loss, no gradient.
  const Result none = run(spec, base_runtime(), [](int64_t) { return true; });
  EXPECT_EQ(none.loss_sum, 0.0f);
  for (float g : none.grads) ASSERT_EQ(g, 0.0f);
}

// DPO's passes: two batches forward in their own activation slots, then each one's backward at
// a scale chosen afterwards, give the gradients of forward_backward at those scales: the
// stored activations of one slot survive the other's forward, and the head's second run
// reproduces its first (bitwise), or its kept logit gradients, scaled, stand in for it.
TEST(Model, LossBackwardOfKeptSlotsEqualsForwardBackward) {
  const ModelSpec spec = tiny_spec();
  for (const auto [mode, keep] : {std::pair{RecomputeGranularity::None, false},
                                  std::pair{RecomputeGranularity::Selective, false},
                                  std::pair{RecomputeGranularity::Full, false},
                                  std::pair{RecomputeGranularity::None, true},
                                  std::pair{RecomputeGranularity::Full, true}}) {
    ModelRuntime rt = base_runtime();
    rt.recompute = mode;
    rt.pipeline_slots = 2;
    rt.keep_logit_grads = keep;
    auto backend = make_cpu_backend();
    DecoderModel model(*backend, spec, rt);
    const int64_t P = model.layout().total;
    testing::init_test_model(*backend, spec, model);
    const int64_t N = rt.micro_batch * rt.seq_length;
    std::vector<int32_t> tokens[2], targets[2];
    for (int b = 0; b < 2; ++b)
      for (int64_t i = 0; i < N; ++i) {
        tokens[b].push_back(static_cast<int32_t>(random_below(10 + b, i, 64)));
        targets[b].push_back(i % 4 == b ? -1 : static_cast<int32_t>(random_below(20 + b, i, 64)));
      }
    const float scales[2] = {0.37f, -0.21f};
    auto grads = [&] {
      std::vector<float> g(P);
      backend->download(g.data(), model.grads());
      return g;
    };
    model.zero_grads();
    for (int b = 0; b < 2; ++b) {
      model.set_batch(tokens[b].data(), targets[b].data());
      model.forward_backward(scales[b]);
    }
    const std::vector<float> expected = grads();
    model.zero_grads();
    float losses[2];
    for (int b = 0; b < 2; ++b) {
      model.use_slot(b);
      model.set_batch(tokens[b].data(), targets[b].data());
      model.zero_loss_sum();
      model.forward_loss();
      backend->download(&losses[b], model.loss_sum());
    }
    for (int b = 0; b < 2; ++b) {
      model.use_slot(b);
      model.zero_loss_sum();
      model.loss_backward({&scales[b], 1}, scales[b]);
      float again = 0;
      backend->download(&again, model.loss_sum());
      EXPECT_EQ(again, keep ? 0.0f : losses[b]) << "the head's second run, batch " << b;
    }
    // The kept gradients are scaled after the cross-entropy rather than in it: one rounding more.
    if (keep)
      EXPECT_LT(relative_difference(grads(), expected), 1e-6) << "recompute mode " << static_cast<int>(mode);
    else
      EXPECT_EQ(0, std::memcmp(grads().data(), expected.data(), P * sizeof(float)))
          << "recompute mode " << static_cast<int>(mode);
  }
}

// GRPO's backward: per-position weights on the targets' log-probabilities, here -a on the
// positions of one set and -b on the rest, give the gradients of forward_backward at scale a
// over the first set plus at scale b over the second (each with the other's targets masked);
// the token losses are the forward's, position by position. Also with a logit soft-cap.
TEST(Model, TokenLossBackwardWeighsEachPosition) {
  for (double softcap : {0.0, 5.0}) {
    ModelSpec spec = tiny_spec();
    spec.logit_softcap = softcap;
    const ModelRuntime rt = base_runtime();
    auto backend = make_cpu_backend();
    DecoderModel model(*backend, spec, rt);
    const int64_t P = model.layout().total;
    testing::init_test_model(*backend, spec, model);
    const int64_t N = rt.micro_batch * rt.seq_length;
    std::vector<int32_t> tokens, targets, first(N), second(N);
    for (int64_t i = 0; i < N; ++i) {
      tokens.push_back(static_cast<int32_t>(random_below(30, i, 64)));
      targets.push_back(i % 5 == 0 ? -1 : static_cast<int32_t>(random_below(31, i, 64)));
      const bool in_first = random_below(32, i, 3) == 0;
      first[i] = in_first ? targets[i] : -1;
      second[i] = in_first ? -1 : targets[i];
    }
    const float a = 0.43f, b = -0.17f;
    auto grads = [&] {
      std::vector<float> g(P);
      backend->download(g.data(), model.grads());
      return g;
    };
    model.zero_grads();
    model.set_batch(tokens.data(), first.data());
    model.forward_backward(a);
    model.set_batch(tokens.data(), second.data());
    model.forward_backward(b);
    const std::vector<float> expected = grads();

    model.zero_grads();
    model.set_batch(tokens.data(), targets.data());
    model.zero_loss_sum();
    model.forward_loss();
    float loss_sum = 0;
    backend->download(&loss_sum, model.loss_sum());
    std::vector<float> losses(N);
    backend->download(losses.data(), model.token_losses());
    double total = 0;
    for (int64_t i = 0; i < N; ++i) {
      if (targets[i] < 0) EXPECT_EQ(losses[i], 0.0f) << "ignored position " << i;
      total += losses[i];
    }
    EXPECT_NEAR(total, loss_sum, 1e-5 * std::abs(loss_sum));
    std::vector<float> weights(N);
    for (int64_t i = 0; i < N; ++i) weights[i] = first[i] >= 0 ? -a : -b;
    DeviceBuffer buffer(*backend, N * sizeof(float), "weights");
    const Tensor dlogps = buffer.tensor(DType::F32, {N});
    backend->upload(dlogps, weights.data());
    model.zero_loss_sum();
    model.token_loss_backward(dlogps, 0.0f);
    float again = 0;
    backend->download(&again, model.loss_sum());
    EXPECT_EQ(again, 0.0f) << "the head's second run adds no loss";
    EXPECT_LT(relative_difference(grads(), expected), 1e-5) << "softcap " << softcap;
  }
}

// head_on_loss_rows: the output head on the rows whose targets count alone (gathered, and
// their losses and gradients scattered back) gives the whole head's losses, token losses and
// gradients, in each of its passes: forward_backward, the kept logit gradients' backward (DPO)
// and the per-position backward (GRPO); with chunks that cut the loss rows, a soft-cap, most
// rows masked, and none left (after a step whose head wrote its weight's gradient).
TEST(Model, HeadOnLossRowsEqualsTheWholeHead) {
  struct Outcome {
    float loss_sum = 0;
    std::vector<float> token_losses, grads;
  };
  enum class Pass { ForwardBackward, Kept, PerToken };
  const auto outcome = [](const ModelSpec& spec, ModelRuntime rt, Pass pass,
                          const std::function<bool(int64_t)>& ignored) {
    rt.keep_logit_grads = pass == Pass::Kept;
    auto backend = make_cpu_backend();
    DecoderModel model(*backend, spec, rt);
    testing::init_test_model(*backend, spec, model);
    const int64_t N = rt.tokens();
    std::vector<int32_t> tokens(N), targets(N);
    std::vector<float> weights(N);
    for (int64_t i = 0; i < N; ++i) {
      tokens[i] = static_cast<int32_t>(random_below(40, i, 64));
      targets[i] = ignored(i) ? -1 : static_cast<int32_t>(random_below(41, i, 64));
      weights[i] = static_cast<float>(random_below(42, i, 7)) - 3.0f;
    }
    // A step before, on every target: what its head left in the gradients must not reach the
    // step under test (whose head may have no rows at all).
    model.zero_grads();
    model.set_batch(tokens.data(), tokens.data());
    model.forward_backward(0.5f);
    model.zero_grads();
    model.zero_loss_sum();
    model.set_batch(tokens.data(), targets.data());
    DeviceBuffer buffer(*backend, N * sizeof(float), "weights");
    const Tensor dlogps = buffer.tensor(DType::F32, {N});
    backend->upload(dlogps, weights.data());
    if (pass == Pass::ForwardBackward) {
      model.forward_backward(0.3f);
    } else {
      model.forward_loss();
      const float scale = 0.3f;
      if (pass == Pass::Kept) model.loss_backward({&scale, 1}, scale);
      if (pass == Pass::PerToken) model.token_loss_backward(dlogps, 0.0f);
    }
    Outcome o;
    backend->download(&o.loss_sum, model.loss_sum());
    o.token_losses.resize(N);
    backend->download(o.token_losses.data(), model.token_losses());
    o.grads.resize(model.layout().total);
    backend->download(o.grads.data(), model.grads());
    return o;
  };
  const std::function<bool(int64_t)> masks[] = {
      [](int64_t i) { return i % 5 == 0; }, [](int64_t i) { return i % 6 != 1; },
      [](int64_t) { return true; }};
  for (double softcap : {0.0, 5.0})
    for (int64_t chunk : {int64_t{8192}, int64_t{3}})
      for (Pass pass : {Pass::ForwardBackward, Pass::Kept, Pass::PerToken})
        for (size_t m = 0; m < std::size(masks); ++m) {
          ModelSpec spec = tiny_spec();
          spec.logit_softcap = softcap;
          ModelRuntime rt = base_runtime();
          rt.cross_entropy_chunk_tokens = chunk;
          const Outcome whole = outcome(spec, rt, pass, masks[m]);
          rt.head_on_loss_rows = true;
          const Outcome rows = outcome(spec, rt, pass, masks[m]);
          const std::string what = fmt::format("softcap {} chunk {} pass {} mask {}", softcap, chunk,
                                               static_cast<int>(pass), m);
          EXPECT_NEAR(rows.loss_sum, whole.loss_sum, 1e-6 * std::abs(whole.loss_sum)) << what;
          EXPECT_LT(relative_difference(rows.token_losses, whole.token_losses), 1e-6) << what;
          if (m == 2) {
            for (float g : rows.grads) ASSERT_EQ(g, 0.0f) << what;
          } else {
            EXPECT_LT(relative_difference(rows.grads, whole.grads), 1e-6) << what;
          }
        }
}

TEST(ModelSpec, FlopsFollowTheMegatronConvention) {
  // Llama 3.1 8B at seq 8192: 57.9 GFLOP per token (DESIGN.md).
  ModelSpec s;
  s.vocab_size = 128256;
  s.num_layers = 32;
  s.hidden = 4096;
  s.ffn = 14336;
  s.heads = 32;
  s.kv_heads = 8;
  s.head_dim = 128;
  EXPECT_NEAR(s.flops_per_token(8192) / 1e9, 57.9, 0.05);
  EXPECT_EQ(s.total_params(), 8030261248);  // published size of Llama 3.1 8B
  // Megatron-Bridge counts causal attention half: its 744 TFLOP/s at 14,451 tokens/s/GPU for
  // Llama 3 8B FP8 on 8xH100 is 51.5 GFLOP per token.
  EXPECT_NEAR(s.flops_per_token(8192, ModelSpec::AttentionCount::CausalHalf) / 1e9,
              744e12 / 14451 / 1e9, 0.05);
  s.sliding_window = 4096;                   // window caps the attention term
  EXPECT_NEAR(s.flops_per_token(8192), 6.0 * s.matmul_params() + 12.0 * 32 * 4096 * 4096, 1.0);
}

TEST(ParamLayout, SegmentsCoverEverythingAndDecayOnlyMatrices) {
  const ModelSpec spec = tiny_spec();
  const ParamLayout l = make_param_layout(spec);
  const auto segs = l.decay_segments();
  int64_t covered = 0;
  for (const auto& s : segs) {
    EXPECT_EQ(s.offset, covered);
    covered += s.count;
  }
  EXPECT_EQ(covered, l.total);
  for (const ParamInfo& p : l.params) {
    EXPECT_EQ(p.offset % 64, 0) << p.name;
    EXPECT_EQ(p.decay, p.shape.rank() == 2) << p.name;
    for (const auto& s : segs)
      if (p.offset >= s.offset && p.offset < s.offset + s.count) EXPECT_EQ(s.decay, p.decay) << p.name;
  }
}

TEST(Rope, Llama31ScalingMatchesTheReferenceBands) {
  ModelSpec s = tiny_spec();
  s.head_dim = 128;
  s.rotary_base = 500000;
  const std::vector<double> plain = rope_inverse_frequencies(s);
  s.rope_scaling = {true, 8.0, 1.0, 4.0, 8192};
  const std::vector<double> scaled = rope_inverse_frequencies(s);
  // High frequencies (wavelength < 2048) are kept, low ones (> 8192) divided by 8.
  EXPECT_DOUBLE_EQ(scaled[0], plain[0]);
  EXPECT_DOUBLE_EQ(scaled[63], plain[63] / 8.0);
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_LE(scaled[i], plain[i] * (1 + 1e-12));
    EXPECT_GE(scaled[i], plain[i] / 8.0 * (1 - 1e-12));
  }
  const std::vector<float> table = rope_table(s, 3);
  EXPECT_FLOAT_EQ(table[0], 1.0f);                            // cos(0)
  EXPECT_FLOAT_EQ(table[64], 0.0f);                           // sin(0)
  EXPECT_FLOAT_EQ(table[128 + 1], static_cast<float>(std::cos(scaled[1])));
  EXPECT_FLOAT_EQ(table[256 + 64 + 2], static_cast<float>(std::sin(2 * scaled[2])));
}

}  // namespace
}  // namespace tessera
