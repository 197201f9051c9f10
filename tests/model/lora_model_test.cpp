// LoRA (model/lora_model.h) against the plain model it stands for: with adapters A, B on the
// chosen projections, the loss is the plain model's with W + (alpha / r) B A in their place,
// and the adapters' gradients are (alpha / r) dW A^T and (alpha / r) B^T dW of that model's
// weight gradients dW (whose parity with PyTorch the model tests prove), accumulated over
// micro-batches; the frozen weights do not move.
#include <cmath>

#include <gtest/gtest.h>

#include "model/tiny_decoder.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/core/error.h"
#include "tessera/core/random.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/generator.h"
#include "tessera/model/init.h"
#include "tessera/model/lora_model.h"

namespace tessera {
namespace {


std::vector<float> download(Backend& b, const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  b.download(v.data(), t);
  return v;
}


// out (m, n) = s * x (m, k) @ y (k, n), or its transpose products, on the host in double.
std::vector<float> product(const std::vector<float>& x, const std::vector<float>& y, int64_t m,
                           int64_t k, int64_t n, double s) {
  std::vector<float> out(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t q = 0; q < k; ++q) acc += static_cast<double>(x[i * k + q]) * y[q * n + j];
      out[i * n + j] = static_cast<float>(s * acc);
    }
  return out;
}

std::vector<float> transpose(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> t(x.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[j * rows + i] = x[i * cols + j];
  return t;
}

// Two sequences of 12 tokens.
ModelRuntime small_runtime() {
  ModelRuntime rt;
  rt.micro_batch = 2;
  rt.seq_length = 12;
  return rt;
}

LoraOptions lora_options(int64_t rank, double alpha, const std::string& targets) {
  LoraOptions o;
  o.rank = rank;
  o.alpha = alpha;
  o.targets = lora_targets(targets);
  return o;
}

TEST(LoraModel, IsThePlainModelWithMergedWeightsAndItsGradientsFollowDw) {
  const ModelSpec spec = tiny_decoder_spec();
  auto backend = make_cpu_backend();
  const ModelRuntime rt = small_runtime();
  const LoraOptions options = lora_options(3, 6, "q_proj,v_proj,o_proj,linear_fc1,down_proj");
  LoraModel lora(*backend, spec, rt, options);
  DecoderModel plain(*backend, spec, rt);
  ASSERT_EQ(lora.base_layout().total, plain.layout().total);

  // Base weights, and adapters with B away from zero so that the update is visible.
  init_parameters(*backend, spec, lora.base_layout(), lora.base_slices(), 7);
  init_parameters(*backend, spec, lora.layout(), lora.params(), 8);
  for (const LoraAdapted& a : lora.adapted())
    backend->init_normal(lora.param(a.b), 9, static_cast<uint64_t>(a.b) * 1000, 0.0f, 0.2f);
  // peft's names: one adapter per Hugging Face projection, k_proj and gate/up included only as
  // chosen (linear_fc1 is gate and up).
  EXPECT_NE(lora.layout().find("model.layers.1.self_attn.q_proj.lora_A.weight"), nullptr);
  EXPECT_NE(lora.layout().find("model.layers.1.mlp.up_proj.lora_B.weight"), nullptr);
  EXPECT_EQ(lora.layout().find("model.layers.1.self_attn.k_proj.lora_A.weight"), nullptr);
  EXPECT_EQ(lora.adapted().size(), 2u * 6);
  const std::vector<float> frozen_before = download(*backend, lora.base_slices()[0].values);

  // The plain model's weights: the base with (alpha / r) B A added on each adapted piece.
  std::vector<float> merged = frozen_before;
  for (const LoraAdapted& a : lora.adapted()) {
    const std::vector<float> delta = product(download(*backend, lora.param(a.b)),
                                             download(*backend, lora.param(a.a)), a.rows,
                                             options.rank, a.cols, options.scale());
    const int64_t at = plain.layout().params[a.base_weight].offset + a.row0 * a.cols;
    for (size_t i = 0; i < delta.size(); ++i) merged[at + i] += delta[i];
  }
  backend->upload(plain.params(), merged.data());

  // Two micro-batches, gradients accumulated.
  lora.zero_grads();
  plain.zero_grads();
  float lora_loss = 0, plain_loss = 0;
  for (int m = 0; m < 2; ++m) {
    std::vector<int32_t> tokens(24), targets(24);
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<int32_t>(random_below(11, m * 100 + i, 64));
      targets[i] = i % 5 == 4 ? -1 : static_cast<int32_t>(random_below(12, m * 100 + i, 64));
    }
    for (Model* model : {static_cast<Model*>(&lora), static_cast<Model*>(&plain)}) {
      model->zero_loss_sum();
      model->set_batch(tokens.data(), targets.data());
      model->forward_backward(0.05f);
    }
    float l = 0, p = 0;
    backend->download(&l, lora.loss_sum());
    backend->download(&p, plain.loss_sum());
    lora_loss += l, plain_loss += p;
  }
  EXPECT_NEAR(lora_loss, plain_loss, 1e-5 * std::fabs(plain_loss));

  const std::vector<float> dw = download(*backend, plain.grads());
  for (const LoraAdapted& a : lora.adapted()) {
    SCOPED_TRACE(lora.layout().params[a.a].name);
    const int64_t at = plain.layout().params[a.base_weight].offset + a.row0 * a.cols;
    const std::vector<float> piece(dw.begin() + at, dw.begin() + at + a.rows * a.cols);
    const std::vector<float> A = download(*backend, lora.param(a.a));
    const std::vector<float> B = download(*backend, lora.param(a.b));
    // dB = s dW A^T (rows, r); dA = s B^T dW (r, cols).
    const std::vector<float> want_db =
        product(piece, transpose(A, options.rank, a.cols), a.rows, a.cols, options.rank, options.scale());
    const std::vector<float> want_da =
        product(transpose(B, a.rows, options.rank), piece, options.rank, a.rows, a.cols, options.scale());
    EXPECT_LT(relative_difference(download(*backend, lora.grad(a.b)), want_db), 1e-5);
    EXPECT_LT(relative_difference(download(*backend, lora.grad(a.a)), want_da), 1e-5);
  }
  EXPECT_EQ(download(*backend, lora.base_slices()[0].values), frozen_before);
}

TEST(LoraModel, TargetsAreHuggingFaceOrMegatronNames) {
  EXPECT_EQ(lora_targets("all-linear").size(), 7u);
  EXPECT_EQ(lora_targets("linear_qkv, linear_proj"),
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"}));
  EXPECT_EQ(lora_targets("down_proj,q_proj"), (std::vector<std::string>{"q_proj", "down_proj"}));
  try {
    lora_targets("q_proj,qkv");
    FAIL() << "an unknown projection was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'qkv' is none of them"), std::string::npos) << e.what();
  }
  EXPECT_THROW(lora_targets(" , "), ConfigError);
}

// Gradient steps on the adapters alone lower the loss of a batch (the direction is right and
// the updated adapters reach the next pass).
TEST(LoraModel, AdapterStepsLowerTheLoss) {
  const ModelSpec spec = tiny_decoder_spec();
  auto backend = make_cpu_backend();
  LoraModel lora(*backend, spec, small_runtime(), lora_options(4, 8, "all-linear"));
  init_parameters(*backend, spec, lora.base_layout(), lora.base_slices(), 7);
  init_parameters(*backend, spec, lora.layout(), lora.params(), 8);
  std::vector<int32_t> tokens(24), targets(24);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>(random_below(11, i, 64));
    targets[i] = static_cast<int32_t>(random_below(12, i, 64));
  }
  std::vector<float> losses;
  for (int step = 0; step < 6; ++step) {
    lora.zero_grads();
    lora.zero_loss_sum();
    lora.set_batch(tokens.data(), targets.data());
    lora.forward_backward(1.0f / 24);
    float loss = 0;
    backend->download(&loss, lora.loss_sum());
    losses.push_back(loss / 24);
    std::vector<float> p = download(*backend, lora.params()), g = download(*backend, lora.grads());
    for (size_t i = 0; i < p.size(); ++i) p[i] -= 0.05f * g[i];
    backend->upload(lora.params(), p.data());
    lora.params_updated();  // as an optimizer step says it
  }
  for (size_t k = 1; k < losses.size(); ++k) EXPECT_LT(losses[k], losses[k - 1]) << "step " << k;
  EXPECT_LT(losses.back(), losses.front() - 0.01);
}

// Generation in place on the frozen base with the adapters added (GRPO's policy under LoRA):
// the prompt's next-token logits and each cached step's are the LoRA model's full forward of
// the same tokens, fused projections (q, k, v; gate, up) included.
TEST(LoraModel, GeneratorOnItsBaseWithItsAdaptersGivesItsLogits) {
  const ModelSpec spec = tiny_decoder_spec();
  auto backend = make_cpu_backend();
  ModelRuntime rt;
  rt.micro_batch = 1;
  rt.seq_length = 12;
  LoraModel lora(*backend, spec, rt, lora_options(3, 6, "all-linear"));
  init_parameters(*backend, spec, lora.base_layout(), lora.base_slices(), 7);
  init_parameters(*backend, spec, lora.layout(), lora.params(), 8);
  for (const LoraAdapted& a : lora.adapted())
    backend->init_normal(lora.param(a.b), 9, static_cast<uint64_t>(a.b) * 1000, 0.0f, 0.2f);
  Generator gen(*backend, spec, lora.base_slices().front().values, lora.base_layout(), rt.seq_length);
  gen.use_adapters(&lora.adapters());

  std::vector<int32_t> tokens(static_cast<size_t>(rt.seq_length));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(random_below(13, i, 64));
  DeviceBuffer buffer(*backend, static_cast<size_t>(rt.seq_length * spec.vocab_size) * 4, "logits");
  const Tensor logits = buffer.tensor(DType::F32, {rt.seq_length, spec.vocab_size});
  lora.set_batch(tokens.data(), tokens.data());
  lora.forward_logits(logits);
  const std::vector<float> full = download(*backend, logits);
  const auto row = [&](size_t t) {
    return std::vector<float>(full.begin() + static_cast<int64_t>(t * spec.vocab_size),
                              full.begin() + static_cast<int64_t>((t + 1) * spec.vocab_size));
  };
  constexpr size_t kPrompt = 5;
  std::vector<float> got = gen.prefill({tokens.begin(), tokens.begin() + kPrompt});
  EXPECT_LT(relative_difference(got, row(kPrompt - 1)), 1e-5) << "prefill";
  for (size_t t = kPrompt; t < tokens.size(); ++t) {
    got = gen.step(tokens[t]);
    EXPECT_LT(relative_difference(got, row(t)), 1e-5) << "step at position " << t;
  }
  // Without the adapters it is the base alone, which the adapters moved.
  Generator base(*backend, spec, lora.base_slices().front().values, lora.base_layout(), rt.seq_length);
  EXPECT_GT(relative_difference(base.prefill({tokens.begin(), tokens.begin() + kPrompt}), row(kPrompt - 1)), 1e-3);
}

}  // namespace
}  // namespace tessera
