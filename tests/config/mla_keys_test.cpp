// Multi-latent attention's keys (Megatron's MLATransformerConfig names) and DeepSeek's YaRN
// RoPE keys: defaults, and the combinations Tessera refuses, each a ConfigError naming the key
// (exit 2 from the CLI).
#include <unistd.h>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "common/run_command.h"
#include "common/scratch_dir.h"
#include "tessera/config/config.h"
#include "tessera/core/error.h"

namespace tessera {
namespace {

using testing::run_command;
using testing::ScratchDir;

// A small MLA model's keys, valid as they are.
constexpr const char* kMlaYaml =
    "mock_data: true\nmodel_family: deepseek\nmulti_latent_attention: true\nnum_layers: 2\n"
    "hidden_size: 32\nnum_attention_heads: 4\nkv_lora_rank: 16\nqk_head_dim: 8\n"
    "qk_pos_emb_head_dim: 4\nv_head_dim: 6\n";

Experiment load_mla(const ScratchDir& dir, std::vector<std::string> cli = {}) {
  const std::string path = (dir.path() / "mla.yaml").string();
  std::ofstream(path) << kMlaYaml;
  LoadOptions o;
  o.config_path = path;
  o.cli_overrides = std::move(cli);
  return load_experiment(o);
}

TEST(MlaKeys, DefaultsAreMegatrons) {
  ScratchDir dir;
  LoadOptions defaults;
  defaults.cli_overrides = {"--mock_data", "true"};
  const ModelConfig d = load_experiment(defaults).model_config;
  EXPECT_FALSE(d.multi_latent_attention);
  EXPECT_EQ(d.q_lora_rank, 0);
  EXPECT_EQ(d.kv_lora_rank, 0);
  EXPECT_EQ(d.qk_head_dim, 128);
  EXPECT_EQ(d.qk_pos_emb_head_dim, 64);
  EXPECT_EQ(d.v_head_dim, 128);
  EXPECT_EQ(d.rope_type, RopeType::Default);
  EXPECT_DOUBLE_EQ(d.rotary_scaling_factor, 1.0);
  EXPECT_EQ(d.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(d.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(d.beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(d.mscale, 1.0);
  EXPECT_DOUBLE_EQ(d.mscale_all_dim, 0.0);

  const ModelConfig m =
      load_mla(dir, {"--q_lora_rank", "null", "--rope_type", "yarn", "--rotary_scaling_factor",
                     "40", "--mscale_all_dim", "0.707"})
          .model_config;
  EXPECT_TRUE(m.multi_latent_attention);
  EXPECT_EQ(m.q_lora_rank, 0);
  EXPECT_EQ(m.kv_lora_rank, 16);
  EXPECT_EQ(m.rope_type, RopeType::Yarn);
  EXPECT_DOUBLE_EQ(m.rotary_scaling_factor, 40.0);
  EXPECT_DOUBLE_EQ(m.mscale_all_dim, 0.707);
  EXPECT_EQ(load_mla(dir, {"--q_lora_rank", "24"}).model_config.q_lora_rank, 24);
  // kv_channels is not MLA's: any value loads (Primus's DeepSeek files set it).
  EXPECT_NO_THROW(load_mla(dir, {"--kv_channels", "128", "--num_attention_heads", "3"}));
}

TEST(MlaKeys, InvalidCombinationsNameTheKey) {
  ScratchDir dir;
  struct Bad {
    std::vector<std::string> cli;
    const char* key;
    const char* says;
  };
  for (const Bad& b : std::vector<Bad>{
           {{"--kv_lora_rank", "0"},
            "kv_lora_rank",
            "a positive width with multi_latent_attention"},
           {{"--num_query_groups", "2"}, "num_query_groups", "0 or num_attention_heads (4)"},
           {{"--qk_pos_emb_head_dim", "5"}, "qk_pos_emb_head_dim", "a positive even dimension"},
           {{"--qk_pos_emb_head_dim", "0"}, "qk_pos_emb_head_dim", "a positive even dimension"},
           {{"--qk_head_dim", "0"}, "qk_head_dim", "a positive per-head dimension"},
           {{"--v_head_dim", "-1"}, "v_head_dim", "a positive per-head dimension"},
           {{"--q_lora_rank", "-3"}, "q_lora_rank", "null (queries projected directly"},
           {{"--context_parallel_size", "2"},
            "context_parallel_size",
            "1 with multi_latent_attention"},
           {{"--tensor_model_parallel_size", "2"},
            "tensor_model_parallel_size",
            "1 with multi_latent_attention"},
           {{"--pipeline_model_parallel_size", "2"},
            "pipeline_model_parallel_size",
            "1 with multi_latent_attention"},
           {{"--use_rope_scaling", "true"}, "use_rope_scaling", "rope_type yarn"},
           {{"--qk_layernorm", "true"}, "qk_layernorm", "false with multi_latent_attention"},
           {{"--add_qkv_bias", "true"}, "add_qkv_bias", "false with multi_latent_attention"},
           {{"--rotary_scaling_factor", "0.5"}, "rotary_scaling_factor", "at least 1"},
           {{"--beta_fast", "1"}, "beta_fast", "greater than beta_slow (1)"},
           {{"--beta_slow", "0"}, "beta_slow", "a positive number of rotations"},
           {{"--mscale", "-1"}, "mscale", "non-negative"},
           {{"--mscale_all_dim", "-0.5"}, "mscale_all_dim", "non-negative"},
           {{"--original_max_position_embeddings", "0"},
            "original_max_position_embeddings",
            "at least 1"},
           {{"--multi_latent_attention", "false", "--rope_type", "yarn"},
            "rope_type",
            "without multi_latent_attention"},
           {{"--rope_type", "ntk"}, "rope_type", "one of: null, rope, yarn"}}) {
    SCOPED_TRACE(b.key);
    try {
      load_mla(dir, b.cli);
      ADD_FAILURE() << "loaded";
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.key(), b.key) << e.what();
      EXPECT_NE(e.expected().find(b.says), std::string::npos) << e.what();
    }
  }
  // YaRN's keys are checked only where YaRN runs: rope_type rope leaves them unread.
  EXPECT_NO_THROW(load_mla(dir, {"--rope_type", "rope", "--rotary_scaling_factor", "0.5"}));
}

TEST(MlaKeys, CommandLineExitsTwoNamingTheKey) {
  ScratchDir dir;
  const std::string path = (dir.path() / "mla.yaml").string();
  std::ofstream(path) << kMlaYaml;
  const auto r =
      run_command("cd " + dir.path().string() + " && " + TESSERA_BINARY + " train --config " +
                  path + " --workspace ws --context_parallel_size 2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("key 'context_parallel_size' has value '2'"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("multi_latent_attention"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "ws"));
}

}  // namespace
}  // namespace tessera
