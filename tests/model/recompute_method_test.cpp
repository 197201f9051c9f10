// Megatron's recompute_method with full recompute: which layers the backward re-runs (block:
// the first recompute_num_layers of each model chunk; uniform: groups of recompute_num_layers
// layers re-run from the group's input), checked on the ops a backward actually runs; the loss,
// gradients and MoE statistics the same as without recompute; and the memory each keeps.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "model/tiny_decoder.h"
#include "common/model_step.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/core/random.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/init.h"
#include "tessera/ops/op_observer.h"

namespace tessera {
namespace {

using testing::one_model_step;

ModelSpec tiny_spec(std::string family = "llama") {
  ModelSpec s = tiny_decoder_spec(5);
  s.family = family;
  if (family == "mixtral") {
    s.moe.experts = 4;
    s.moe.topk = 2;
    s.moe.ffn = 24;
    s.moe.layers = {true, false, true, true, false};
    s.moe.aux_loss_coeff = 0.01;
    s.moe.z_loss_coeff = 0.001;
  }
  return s;
}

ModelRuntime runtime(RecomputeMethod method, int64_t layers) {
  ModelRuntime rt;
  rt.micro_batch = 2;
  rt.seq_length = 12;
  rt.recompute = RecomputeGranularity::Full;
  rt.recompute_method = method;
  rt.recompute_num_layers = layers;
  return rt;
}

// The shape of a backward pass: "B" for each layer's backward, "R<n>" for a recompute that runs
// n attention forwards (one per re-run layer).
class BackwardShape final : public OpObserver {
 public:
  void op_begin(const char* name, const OpArgs&) override {
    if (in_recompute_ && std::string_view(name) == "attention_forward") ++recomputed_;
  }
  void op_end() override {}
  void range_begin(const char* name) override {
    ranges_.emplace_back(name);
    if (ranges_.back() == "recompute" && !in_recompute_) in_recompute_ = true, recomputed_ = 0;
    if (ranges_.back() == "layer_backward") shape_ += "B ";
  }
  void range_end() override {
    if (ranges_.back() == "recompute" &&
        std::count(ranges_.begin(), ranges_.end(), "recompute") == 1) {
      in_recompute_ = false;
      shape_ += "R" + std::to_string(recomputed_) + " ";
    }
    ranges_.pop_back();
  }
  const std::string& shape() const { return shape_; }

 private:
  std::vector<std::string> ranges_;
  bool in_recompute_ = false;
  int recomputed_ = 0;
  std::string shape_;
};

std::string backward_shape(const ModelSpec& spec, const ModelRuntime& rt) {
  auto backend = make_cpu_backend();
  DecoderModel model(*backend, spec, rt);
  const int64_t N = rt.tokens(), P = model.layout().total;
  DeviceBuffer master(*backend, P * sizeof(float), "master");
  init_parameters(*backend, spec, model.layout(), master.tensor(DType::F32, {P}), 7);
  backend->copy(model.params(), master.tensor(DType::F32, {P}));
  std::vector<int32_t> tokens(N), targets(N);
  for (int64_t i = 0; i < N; ++i)
    tokens[i] = targets[i] = static_cast<int32_t>(random_below(3, i, 64));
  model.set_batch(tokens.data(), targets.data());
  model.forward_chunk(0, true, 1.0f / N);
  BackwardShape observer;
  backend->set_op_observer(&observer);
  model.backward_chunk(0);
  backend->set_op_observer(nullptr);
  return observer.shape();
}

TEST(RecomputeMethod, RolesOfAChunksLayers) {
  auto roles = [](RecomputeMethod method, int64_t n, int64_t count) {
    std::string out;
    const ModelRuntime rt = runtime(method, n);
    for (int64_t i = 0; i < count; ++i) {
      const RecomputeRole r = rt.recompute_role(i, count);
      out += !r.recomputed                  ? "."
             : r.group_start && r.group_end ? "1"
             : r.group_start                ? "["
             : r.group_end                  ? "]"
                                            : "-";
    }
    return out;
  };
  // Block: the first N layers one by one; 0 none; more than the chunk's layers all of them.
  EXPECT_EQ(roles(RecomputeMethod::Block, 2, 5), "11...");
  EXPECT_EQ(roles(RecomputeMethod::Block, 0, 5), ".....");
  EXPECT_EQ(roles(RecomputeMethod::Block, 80, 5), "11111");
  // Uniform: groups of N, the last one shorter.
  EXPECT_EQ(roles(RecomputeMethod::Uniform, 2, 5), "[][]1");
  EXPECT_EQ(roles(RecomputeMethod::Uniform, 3, 5), "[-][]");
  EXPECT_EQ(roles(RecomputeMethod::Uniform, 1, 5), "11111");
  // No method: every layer (Tessera's full recompute), or with N the block method.
  EXPECT_EQ(roles(RecomputeMethod::None, 0, 5), "11111");
  EXPECT_EQ(roles(RecomputeMethod::None, 3, 5), "111..");
  ModelRuntime selective = runtime(RecomputeMethod::None, 0);
  selective.recompute = RecomputeGranularity::Selective;
  EXPECT_FALSE(selective.recompute_role(0, 5).recomputed);
}

TEST(RecomputeMethod, TheBackwardReRunsTheRightLayers) {
  const ModelSpec spec = tiny_spec();
  // Layers run backward from the last: block 2 re-runs layers 1 and 0, each just before its own
  // backward; uniform 2 re-runs the groups {4}, {2, 3}, {0, 1} as wholes before their last
  // layer's backward; uniform 3 the groups {3, 4} and {0, 1, 2}.
  EXPECT_EQ(backward_shape(spec, runtime(RecomputeMethod::Block, 2)), "B B B R1 B R1 B ");
  EXPECT_EQ(backward_shape(spec, runtime(RecomputeMethod::Uniform, 2)), "R1 B R2 B B R2 B B ");
  EXPECT_EQ(backward_shape(spec, runtime(RecomputeMethod::Uniform, 3)), "R2 B B R3 B B B ");
  EXPECT_EQ(backward_shape(spec, runtime(RecomputeMethod::Block, 0)), "B B B B B ");
  EXPECT_EQ(backward_shape(spec, runtime(RecomputeMethod::None, 0)), "R1 B R1 B R1 B R1 B R1 B ");
  // Per model chunk, as Megatron counts: the last pipeline stage, layers 2-4, re-runs its own
  // first layer (layer 2) with block 1.
  ModelRuntime stage = runtime(RecomputeMethod::Block, 1);
  stage.pipeline_chunks = {{2, 3}};
  EXPECT_EQ(backward_shape(spec, stage), "B B R1 B ");
}

TEST(RecomputeMethod, LossGradientsAndMoeStatisticsAreUnchanged) {
  for (const std::string family : {"llama", "mixtral"}) {
    SCOPED_TRACE(family);
    const ModelSpec spec = tiny_spec(family);
    ModelRuntime plain = runtime(RecomputeMethod::None, 0);
    plain.recompute = RecomputeGranularity::None;
    const testing::ModelStep reference = one_model_step(spec, plain);
    ASSERT_TRUE(std::isfinite(reference.loss_sum));
    for (auto [method, layers] : {std::pair{RecomputeMethod::Uniform, int64_t{2}},
                                  std::pair{RecomputeMethod::Uniform, int64_t{3}},
                                  std::pair{RecomputeMethod::Uniform, int64_t{5}},
                                  std::pair{RecomputeMethod::Block, int64_t{2}},
                                  std::pair{RecomputeMethod::Block, int64_t{0}}}) {
      SCOPED_TRACE(std::to_string(static_cast<int>(method)) + " " + std::to_string(layers));
      const testing::ModelStep r = one_model_step(spec, runtime(method, layers));
      // The same ops on the same inputs: bitwise equal on the CPU.
      EXPECT_EQ(r.loss_sum, reference.loss_sum);
      EXPECT_EQ(0, std::memcmp(r.grads.data(), reference.grads.data(), r.grads.size() * 4));
      // Re-run MoE layers count their tokens once (inside a group, forward_output runs again).
      EXPECT_EQ(r.moe_stats, reference.moe_stats);
    }
  }
}

TEST(RecomputeMethod, ActivationsKeptFollowTheMethod) {
  const ModelSpec spec = tiny_spec();
  auto activations = [&](RecomputeMethod method, int64_t layers) {
    return static_cast<int64_t>(
        DecoderModel::plan_memory(spec, runtime(method, layers)).activations);
  };
  ModelRuntime plain = runtime(RecomputeMethod::None, 0);
  plain.recompute = RecomputeGranularity::None;
  const int64_t none = static_cast<int64_t>(DecoderModel::plan_memory(spec, plain).activations);
  const int64_t every = activations(RecomputeMethod::None, 0);
  // No recompute keeps 6 residual states and 5 layers' activations (S each); recomputing
  // every layer keeps the states and one layer's refilled region.
  const int64_t layer = (none - every) / 4;
  const int64_t residual = spec.hidden * 24 * static_cast<int64_t>(sizeof(float));  // 256-aligned
  ASSERT_GT(layer, residual);
  EXPECT_EQ((none - every) % 4, 0);
  // Block: N layers share the region, the others keep their own.
  EXPECT_EQ(activations(RecomputeMethod::Block, 0), none);
  EXPECT_EQ(activations(RecomputeMethod::Block, 2), none - layer);
  EXPECT_EQ(activations(RecomputeMethod::Block, 3), none - 2 * layer);
  EXPECT_EQ(activations(RecomputeMethod::Block, 5), every);
  EXPECT_EQ(activations(RecomputeMethod::Uniform, 1), every);
  // Uniform 2: groups {0, 1}, {2, 3}, {4} keep the inputs of their groups only (two states
  // fewer), and refill two layers and the state between them at once.
  EXPECT_EQ(activations(RecomputeMethod::Uniform, 2), every + layer - residual);
  // One group of all five layers: one input stored, and everything else refilled at once,
  // which is all that no recompute keeps.
  EXPECT_EQ(activations(RecomputeMethod::Uniform, 5), none);
}

}  // namespace
}  // namespace tessera
