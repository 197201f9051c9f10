// The Qwen3 family: its presets at the released models' sizes, the keys it refuses, the
// per-head QK norms its layout declares, and its Hugging Face config in both directions.
// Parity of logits, loss and gradients with PyTorch is torch_parity_test's "qwen3" case; with
// transformers' Qwen3ForCausalLM, scripts/ckpt/hf_transformers_check.py on the GPU machine.
#include <gtest/gtest.h>

#include "tessera/config/config.h"
#include "tessera/core/error.h"
#include "tessera/model/model_family.h"
#include "tessera/model/model_spec.h"
#include "tessera/model/param_layout.h"

namespace tessera {
namespace {

Experiment experiment(std::vector<std::string> overrides) {
  LoadOptions o;
  o.cli_overrides = std::move(overrides);
  o.cli_overrides.insert(o.cli_overrides.end(), {"--mock_data", "true"});
  return load_experiment(o);
}

TEST(Qwen3Family, PresetsHaveTheReleasedSizes) {
  // Qwen3-4B ties its head to the embedding; Qwen3-8B does not (Hugging Face's counts).
  const ModelSpec four = make_model_spec(experiment({"--model", "qwen3_4B"}), 151936);
  EXPECT_EQ(four.family, "qwen3");
  EXPECT_EQ(four.total_params(), 4022468096);
  EXPECT_EQ(four.head_dim, 128);
  EXPECT_TRUE(four.tied_embeddings);
  const ModelSpec eight = make_model_spec(experiment({"--model", "qwen3_8B"}), 151936);
  EXPECT_EQ(eight.total_params(), 8190735360);
  EXPECT_FALSE(eight.tied_embeddings);
}

TEST(Qwen3Family, AttentionNormalisesEachQueryAndKeyHead) {
  const ModelSpec s = make_model_spec(experiment({"--model", "tiny_qwen3"}), 256);
  const ParamLayout layout = make_param_layout(s);
  const ParamInfo* q_norm = layout.find("model.layers.0.self_attn.q_norm.weight");
  const ParamInfo* k_norm = layout.find("model.layers.0.self_attn.k_norm.weight");
  ASSERT_NE(q_norm, nullptr);
  ASSERT_NE(k_norm, nullptr);
  EXPECT_EQ(q_norm->shape.numel(), s.head_dim);  // one norm shared by every head
  EXPECT_EQ(k_norm->shape.numel(), s.head_dim);
  EXPECT_FALSE(q_norm->decay);
  EXPECT_EQ(layout.find("model.layers.0.self_attn.qkv_proj.bias"), nullptr);
  EXPECT_EQ(layout.lm_head, layout.embedding);  // tied, as Qwen3-4B
}

TEST(Qwen3Family, RefusesWhatQwen3DoesNotHaveNamingTheKey) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--qk_layernorm", "false"}, "qk_layernorm"},
      {{"--add_qkv_bias", "true"}, "add_qkv_bias"},
      {{"--sliding_window", "64"}, "sliding_window"},
      {{"--num_experts", "4"}, "num_experts"},
  };
  for (const auto& [extra, key] : cases) {
    std::vector<std::string> args = {"--model", "tiny_qwen3"};
    args.insert(args.end(), extra.begin(), extra.end());
    try {
      make_model_spec(experiment(args), 256);
      ADD_FAILURE() << key << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.key(), key) << e.what();
      EXPECT_NE(e.expected().find("qwen3"), std::string::npos) << e.what();
    }
  }
}

TEST(Qwen3Family, HuggingFaceConfigReadsBackAsTheSameModel) {
  const ModelFamily& f = model_family("qwen3");
  EXPECT_EQ(model_family_for_hf_type("qwen3"), &f);
  const ModelSpec s = make_model_spec(experiment({"--model", "qwen3_4B"}), 151936);
  const nlohmann::ordered_json j = f.hf_config(s);
  EXPECT_EQ(j["architectures"][0], "Qwen3ForCausalLM");
  EXPECT_EQ(j["head_dim"], 128);
  EXPECT_EQ(j["tie_word_embeddings"], true);
  EXPECT_EQ(j["attention_bias"], false);
  const ModelSpec back = f.read_hf_config(nlohmann::json::parse(j.dump()), "config.json");
  EXPECT_EQ(back.hidden, s.hidden);
  EXPECT_EQ(back.ffn, s.ffn);
  EXPECT_EQ(back.heads, s.heads);
  EXPECT_EQ(back.kv_heads, s.kv_heads);
  EXPECT_EQ(back.head_dim, s.head_dim);
  EXPECT_EQ(back.num_layers, s.num_layers);
  EXPECT_EQ(back.vocab_size, s.vocab_size);
  EXPECT_EQ(back.rotary_base, s.rotary_base);
  EXPECT_FLOAT_EQ(back.norm_eps, s.norm_eps);
  EXPECT_TRUE(back.qk_norm);
  EXPECT_TRUE(back.tied_embeddings);

  // Qwen3Config's defaults for what a config leaves out: head_dim 128 whatever the width.
  nlohmann::json minimal = {{"model_type", "qwen3"},         {"hidden_size", 64},
                            {"intermediate_size", 96},       {"num_hidden_layers", 2},
                            {"num_attention_heads", 4},      {"num_key_value_heads", 2},
                            {"vocab_size", 128}};
  EXPECT_EQ(f.read_hf_config(minimal, "config.json").head_dim, 128);
  minimal["attention_bias"] = true;
  try {
    f.read_hf_config(minimal, "/m/config.json");
    FAIL() << "attention_bias: true was read";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("/m/config.json: attention_bias: true"),
              std::string::npos)
        << e.what();
  }
}

// A checkpoint's description is checked as make_spec checks an experiment, for both dense
// QK-norm families: one without QK norms, or with what Qwen3 and OLMo 2 lack, is not one the
// family builds.
TEST(QkNormDecoderFamilies, ACheckpointDescriptionOfAnotherShapeIsNamed) {
  for (const std::string family : {"qwen3", "olmo2"}) {
    SCOPED_TRACE(family);
    ModelSpec s = make_model_spec(experiment({"--model", "tiny_" + family}), 256);
    const ModelFamily& f = model_family(family);
    EXPECT_EQ(f.spec_problem(s), "");
    s.qk_norm = false;
    EXPECT_EQ(f.spec_problem(s), "model_family " + family + " without qk_layernorm");
    s.qk_norm = true;
    s.qkv_bias = true;
    EXPECT_EQ(f.spec_problem(s), "model_family " + family + " with add_qkv_bias");
    s.qkv_bias = false;
    s.sliding_window = 16;
    EXPECT_EQ(f.spec_problem(s), "model_family " + family + " with a sliding window");
  }
}

}  // namespace
}  // namespace tessera
