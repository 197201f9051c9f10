// The OLMo 2 family: its presets at the released models' sizes, the post-norms and whole QK
// norms its layout declares, the keys it refuses (tensor parallelism among them), and its
// Hugging Face config in both directions. Parity of logits, loss and gradients with PyTorch is
// torch_parity_test's "olmo2" case; with transformers' Olmo2ForCausalLM,
// scripts/ckpt/hf_transformers_check.py on the GPU machine.
#include <gtest/gtest.h>

#include "tessera/config/config.h"
#include "tessera/core/error.h"
#include "tessera/model/model_family.h"
#include "tessera/model/model_spec.h"
#include "tessera/model/param_layout.h"

namespace tessera {
namespace {

Experiment experiment(std::vector<std::string> overrides, int ranks = 1) {
  LoadOptions o;
  o.data_parallel_size = ranks;
  o.cli_overrides = std::move(overrides);
  o.cli_overrides.insert(o.cli_overrides.end(), {"--mock_data", "true"});
  return load_experiment(o);
}

TEST(Olmo2Family, PresetsHaveTheReleasedSizes) {
  const ModelSpec seven = make_model_spec(experiment({"--model", "olmo2_7B"}), 100352);
  EXPECT_EQ(seven.family, "olmo2");
  EXPECT_EQ(seven.total_params(), 7298617344);  // OLMo-2-1124-7B: 7.30B
  const ModelSpec thirteen = make_model_spec(experiment({"--model", "olmo2_13B"}), 100352);
  EXPECT_NEAR(thirteen.total_params() / 1e9, 13.7, 0.05);  // OLMo-2-1124-13B
}

TEST(Olmo2Family, BlocksNormTheirOutputAndAttentionNormsAllOfQAndK) {
  const ModelSpec s = make_model_spec(experiment({"--model", "tiny_olmo2"}), 256);
  const ParamLayout layout = make_param_layout(s);
  for (const char* block : {"self_attn", "mlp"}) {
    const std::string p = std::string("model.layers.0.") + block;
    EXPECT_EQ(layout.find(p + ".norm.weight"), nullptr) << block << " has a pre-norm";
    const ParamInfo* post = layout.find(p + ".post_norm.weight");
    ASSERT_NE(post, nullptr) << block;
    EXPECT_EQ(post->numel(), s.hidden);
    EXPECT_FALSE(post->decay);
  }
  const ParamInfo* q_norm = layout.find("model.layers.0.self_attn.q_norm.weight");
  const ParamInfo* k_norm = layout.find("model.layers.0.self_attn.k_norm.weight");
  ASSERT_NE(q_norm, nullptr);
  ASSERT_NE(k_norm, nullptr);
  EXPECT_EQ(q_norm->numel(), s.heads * s.head_dim);
  EXPECT_EQ(k_norm->numel(), s.kv_heads * s.head_dim);
}

TEST(Olmo2Family, RefusesWhatOlmo2CannotRunNamingTheKey) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--qk_layernorm", "false"}, "qk_layernorm"},
      {{"--add_qkv_bias", "true"}, "add_qkv_bias"},
      {{"--num_experts", "4"}, "num_experts"},
      {{"--tensor_model_parallel_size", "2"}, "tensor_model_parallel_size"},
  };
  for (const auto& [extra, key] : cases) {
    std::vector<std::string> args = {"--model", "tiny_olmo2"};
    args.insert(args.end(), extra.begin(), extra.end());
    try {
      make_model_spec(experiment(args, key == "tensor_model_parallel_size" ? 2 : 1), 256);
      ADD_FAILURE() << key << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.key(), key) << e.what();
      EXPECT_NE(e.expected().find("olmo2"), std::string::npos) << e.what();
    }
  }
}

TEST(Olmo2Family, HuggingFaceNamesAndConfigReadBackAsTheSameModel) {
  const ModelFamily& f = model_family("olmo2");
  EXPECT_EQ(model_family_for_hf_type("olmo2"), &f);
  const ModelSpec s = make_model_spec(experiment({"--model", "olmo2_7B"}), 100352);
  const ParamLayout layout = make_param_layout(s);
  const auto hf_name = [&](const std::string& name) {
    const std::vector<HfTensorPiece> pieces = f.hf_pieces(*layout.find(name), s);
    return pieces.size() == 1 ? pieces[0].name : std::string("(several)");
  };
  EXPECT_EQ(hf_name("model.layers.3.self_attn.post_norm.weight"),
            "model.layers.3.post_attention_layernorm.weight");
  EXPECT_EQ(hf_name("model.layers.3.mlp.post_norm.weight"),
            "model.layers.3.post_feedforward_layernorm.weight");
  EXPECT_EQ(hf_name("model.layers.3.self_attn.q_norm.weight"),
            "model.layers.3.self_attn.q_norm.weight");

  const nlohmann::ordered_json j = f.hf_config(s);
  EXPECT_EQ(j["architectures"][0], "Olmo2ForCausalLM");
  EXPECT_FALSE(j.contains("head_dim"));
  const ModelSpec back = f.read_hf_config(nlohmann::json::parse(j.dump()), "config.json");
  EXPECT_EQ(back.hidden, s.hidden);
  EXPECT_EQ(back.ffn, s.ffn);
  EXPECT_EQ(back.heads, s.heads);
  EXPECT_EQ(back.kv_heads, s.kv_heads);
  EXPECT_EQ(back.head_dim, s.head_dim);
  EXPECT_EQ(back.num_layers, s.num_layers);
  EXPECT_EQ(back.rotary_base, s.rotary_base);
  EXPECT_FLOAT_EQ(back.norm_eps, s.norm_eps);
  EXPECT_TRUE(back.qk_norm);
  EXPECT_FALSE(back.tied_embeddings);
}

}  // namespace
}  // namespace tessera
