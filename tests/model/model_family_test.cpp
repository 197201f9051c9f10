// The model-family machinery: the registry and the model_family key, the layout the blocks
// declare (names, order, tensor-parallel styles, fused pieces), the activation plan's shared
// regions, and the rule that a row-parallel projection's residual is added on one
// tensor-parallel rank only.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "model/tiny_decoder.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/config/config.h"
#include "tessera/core/error.h"
#include "tessera/core/random.h"
#include "tessera/model/activation_plan.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/init.h"
#include "tessera/model/model_family.h"

namespace tessera {
namespace {

ModelSpec tiny_spec(int64_t layers = 2) { return tiny_decoder_spec(layers); }

TEST(ModelFamily, RegistryAndKeyNameTheFamilies) {
  ASSERT_NE(find_model_family("llama"), nullptr);
  EXPECT_EQ(find_model_family("nope"), nullptr);
  EXPECT_EQ(model_family_for_hf_type("qwen2"), find_model_family("llama"));
  EXPECT_EQ(model_family_for_hf_type("gpt2"), nullptr);
  // Every family is found by its name and by each model_type it reads, which the messages
  // list.
  for (const std::string& name : {"llama", "mixtral", "qwen3_moe", "deepseek"}) {
    const ModelFamily* f = find_model_family(name);
    ASSERT_NE(f, nullptr) << name;
    EXPECT_NE(model_family_names().find(name), std::string::npos) << name;
    for (const std::string& type : f->hf_model_types()) {
      EXPECT_EQ(model_family_for_hf_type(type), f) << type;
      EXPECT_NE(hf_model_type_names().find(type), std::string::npos) << type;
    }
  }
  EXPECT_EQ(model_family_for_hf_type("deepseek_v3"), find_model_family("deepseek"));

  LoadOptions o;
  o.cli_overrides = {"--model_family", "mixtral_like"};
  const Experiment e = load_experiment(o);
  try {
    make_model_spec(e, 256);
    FAIL() << "an unknown family was accepted";
  } catch (const ConfigError& err) {
    EXPECT_EQ(err.key(), "model_family");
    EXPECT_EQ(err.value(), "mixtral_like");
    EXPECT_NE(err.expected().find("llama"), std::string::npos) << err.what();
  }
}

TEST(ModelFamily, BlocksDeclareTheLayoutWithParallelStyles) {
  ModelSpec s = tiny_spec(2);
  s.qkv_bias = true;
  const ParamLayout l = make_param_layout(s);
  std::vector<std::string> names;
  for (const ParamInfo& p : l.params) names.push_back(p.name);
  const std::vector<std::string> layer1 = {
      "model.layers.1.self_attn.norm.weight",   "model.layers.1.self_attn.qkv_proj.weight",
      "model.layers.1.self_attn.qkv_proj.bias", "model.layers.1.self_attn.o_proj.weight",
      "model.layers.1.mlp.norm.weight",         "model.layers.1.mlp.gate_up_proj.weight",
      "model.layers.1.mlp.down_proj.weight"};
  const auto at = std::find(names.begin(), names.end(), layer1[0]);
  ASSERT_NE(at, names.end());
  EXPECT_EQ(std::vector<std::string>(at, at + layer1.size()), layer1);
  EXPECT_EQ(names.front(), "model.embed_tokens.weight");
  EXPECT_EQ(names.back(), "lm_head.weight");
  ASSERT_EQ(l.units.size(), 4u);  // embedding, 2 layers, tail

  const auto& qkv = *l.find("model.layers.0.self_attn.qkv_proj.weight");
  EXPECT_EQ(qkv.tp, TensorParallelStyle::Column);
  EXPECT_EQ(qkv.fused_rows, (std::vector<int64_t>{32, 16, 16}));  // q: 4x8, k and v: 2x8
  EXPECT_EQ(l.find("model.layers.0.mlp.gate_up_proj.weight")->fused_rows,
            (std::vector<int64_t>{40, 40}));
  EXPECT_EQ(l.find("model.layers.0.self_attn.o_proj.weight")->tp, TensorParallelStyle::Row);
  EXPECT_EQ(l.find("model.layers.0.mlp.down_proj.weight")->tp, TensorParallelStyle::Row);
  EXPECT_EQ(l.find("model.embed_tokens.weight")->tp, TensorParallelStyle::Vocab);
  EXPECT_EQ(l.find("model.layers.0.self_attn.norm.weight")->tp, TensorParallelStyle::Replicated);
  // Hugging Face's pieces of the fused tensor follow the same rows.
  const auto pieces = model_family("llama").hf_pieces(qkv, s);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[1].name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(pieces[1].offset, 32 * s.hidden);
  EXPECT_EQ(pieces[2].shape, (std::vector<int64_t>{16, 32}));
}

TEST(ActivationPlan, SharedRegionsAreAsLargeAsTheirLargestSet) {
  // 256-byte granules: a (16, 16) fp32 tensor is 4 granules, (16) fp32 one.
  ActivationPlan plan(/*selective_recompute=*/true);
  Tensor stored, layer_a1, layer_a2, layer_b, transient_small, transient_large, back1, back2;
  plan.add(&stored, DType::F32, {16, 16});
  plan.begin_layer(true);
  plan.add(&layer_a1, DType::F32, {16, 16});
  plan.add(&layer_a2, DType::F32, {16});
  plan.end_layer();
  plan.begin_layer(true);
  plan.add(&layer_b, DType::F32, {16, 32});
  plan.end_layer();
  plan.add(&transient_small, DType::F32, {16}, Keep::Recomputable);
  plan.add(&transient_large, DType::F32, {16, 16}, Keep::Recomputable);
  plan.begin_backward_scratch();
  plan.add(&back1, DType::F32, {16, 16});
  plan.end_backward_scratch();
  plan.begin_backward_scratch();
  plan.add(&back2, DType::F32, {16});
  plan.end_backward_scratch();
  // stored 1024 + layers max(1024 + 256, 2048) + transient 1024 + backward max(1024, 256).
  EXPECT_EQ(plan.bytes(), 1024u + 2048u + 1024u + 1024u);
  auto backend = make_cpu_backend();
  DeviceBuffer buffer(*backend, plan.bytes(), "plan");
  plan.bind(buffer);
  auto offset = [&](const Tensor& t) {
    return static_cast<const char*>(t.data) - static_cast<const char*>(stored.data);
  };
  EXPECT_EQ(offset(layer_a1), 1024);
  EXPECT_EQ(offset(layer_b), 1024);  // the recomputed layers share one region
  EXPECT_EQ(offset(layer_a2), 2048);
  EXPECT_EQ(offset(transient_small), offset(transient_large));
  EXPECT_EQ(offset(transient_small), 1024 + 2048);
  EXPECT_EQ(offset(back1), offset(back2));
  EXPECT_EQ(offset(back1), 1024 + 2048 + 1024);

  ActivationPlan stored_plan(/*selective_recompute=*/false);  // recomputable tensors then stay
  stored_plan.add(&transient_small, DType::F32, {16}, Keep::Recomputable);
  stored_plan.add(&transient_large, DType::F32, {16, 16}, Keep::Recomputable);
  EXPECT_EQ(stored_plan.bytes(), 256u + 1024u);
}

// With every output projection zero, a layer adds nothing but its residual. On
// tensor-parallel rank 0 the residual then reaches the head; on any other rank a row-parallel
// projection's partial sum must not carry it (the group's reduction adds rank 0's), so the
// final state, and with no bias the logits, are zero.
// Records what the model hands to its tensor-parallel group's all-reduces, and sums nothing:
// each rank's own partial sums stay visible.
class RecordingGroup final : public ParallelGroup {
 public:
  explicit RecordingGroup(Backend& b) : b_(b) {}
  void all_reduce(const Tensor& t) override {
    std::vector<float> v(t.numel());
    b_.download(v.data(), t);
    reduced.push_back(v);
  }
  void all_gather(const Tensor&, const Tensor&) override {}
  void reduce_scatter(const Tensor&, const Tensor&) override {}
  std::vector<std::vector<float>> reduced;

 private:
  Backend& b_;
};

// With the row-parallel projections zeroed, a layer's output is the residual alone: rank 0 of
// two hands its all-reduce the residual stream, rank 1 zeros, so that the sum over the ranks
// holds the residual once.
TEST(ResidualRule, RowParallelProjectionsAddTheResidualOnRankZeroOnly) {
  const ModelSpec spec = tiny_spec(1);
  std::vector<std::vector<float>> o_proj_outputs;
  for (int rank : {0, 1}) {
    auto backend = make_cpu_backend();
    ModelRuntime rt;
    rt.micro_batch = 1;
    rt.seq_length = 8;
    rt.tensor_parallel_size = 2;
    rt.tensor_parallel_rank = rank;
    DecoderModel model(*backend, spec, rt);
    RecordingGroup group(*backend);
    model.set_tensor_parallel_group(&group);
    const int64_t P = model.layout().total;
    DeviceBuffer master(*backend, P * sizeof(float), "master");
    init_parameters(*backend, spec, model.layout(), master.tensor(DType::F32, {P}), 3);
    backend->copy(model.params(), master.tensor(DType::F32, {P}));
    for (const char* name :
         {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"}) {
      const ParamInfo* p = model.layout().find(name);
      backend->fill(model.params().flat_range(p->offset, p->numel()), 0.0f);
    }
    // Tokens of both ranks' halves of the vocabulary.
    std::vector<int32_t> tokens(8), targets(8, -1);
    for (int i = 0; i < 8; ++i) tokens[i] = static_cast<int32_t>(i * 8 + 3);
    model.set_batch(tokens.data(), targets.data());
    model.forward_loss();
    // All-reduces: the embedding, then each row-parallel projection (o_proj, down_proj).
    ASSERT_EQ(group.reduced.size(), 3u);
    o_proj_outputs.push_back(group.reduced[1]);
  }
  const auto nonzero = [](const std::vector<float>& v) {
    return std::count_if(v.begin(), v.end(), [](float x) { return x != 0.0f; });
  };
  // Rank 0 looked up tokens 0..31 only: half the rows of its embedding output are zeros.
  EXPECT_EQ(nonzero(o_proj_outputs[0]), 4 * 32) << "rank 0 carries the residual through";
  EXPECT_EQ(nonzero(o_proj_outputs[1]), 0) << "another rank added the residual too";
}

}  // namespace
}  // namespace tessera
