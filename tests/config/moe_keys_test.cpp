// The MoE keys (Megatron's names): presets, moe_layer_freq's forms, and the combinations
// Megatron refuses, each a ConfigError naming the key (exit 2 from the CLI).
#include <unistd.h>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "common/run_command.h"
#include "common/scratch_dir.h"
#include "tessera/config/config.h"
#include "tessera/config/keys.h"
#include "tessera/config/moe_layer_freq.h"
#include "tessera/core/error.h"

namespace tessera {
namespace {

using testing::run_command;
using testing::ScratchDir;

Experiment load(const std::string& path, std::vector<std::string> cli = {}, int ranks = 1) {
  LoadOptions o;
  o.config_path = path;
  o.cli_overrides = std::move(cli);
  o.data_parallel_size = ranks;
  return load_experiment(o);
}

// tiny_moe on mock data with `cli` (the experiment file is written beside the test's own
// scratch directory, which a test may hold at the same time).
Experiment load_tiny_moe(std::vector<std::string> cli = {}, int ranks = 1) {
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() /
      ("tessera_moe_keys_tiny_moe_" + std::to_string(::getpid()) + ".yaml");
  std::ofstream(path) << "model: tiny_moe\nmock_data: true\n";
  struct Remove {
    std::filesystem::path p;
    ~Remove() { std::filesystem::remove(p); }
  } remove{path};
  return load(path.string(), std::move(cli), ranks);
}

// The ConfigError of loading tiny_moe with `cli`; fails the test if it loads.
ConfigError tiny_moe_error(std::vector<std::string> cli, int ranks = 1) {
  try {
    load_tiny_moe(std::move(cli), ranks);
  } catch (const ConfigError& e) {
    return e;
  }
  ADD_FAILURE() << "expected a ConfigError";
  return ConfigError("", "", "", "");
}

TEST(MoeKeys, ShippedMoeExperimentsLoadWithPublishedShapes) {
  for (const char* name :
       {"mixtral_8x7B-pretrain", "mixtral_8x22B-pretrain", "qwen3_30B_A3B-pretrain"}) {
    SCOPED_TRACE(name);
    // Their experts spread over a node's 8 GPUs, as Primus's configurations spread them.
    const Experiment e = load(name, {}, 8);
    EXPECT_TRUE(e.data.mock_data);
    EXPECT_EQ(e.exp_name, name);
    EXPECT_EQ(e.training.seq_length, std::string(name) == "mixtral_8x22B-pretrain" ? 8192 : 4096);
    EXPECT_EQ(e.training.expert_model_parallel_size, 8);
  }
  const ModelConfig m7 = load("mixtral_8x7B-pretrain", {}, 8).model_config;
  EXPECT_EQ(m7.model_family, "mixtral");
  EXPECT_EQ(m7.num_experts, 8);
  EXPECT_EQ(m7.moe_router_topk, 2);
  EXPECT_EQ(m7.moe_ffn_hidden_size, 14336);
  EXPECT_EQ(m7.num_query_groups, 8);
  const ModelConfig m22 =
      load("mixtral_8x22B-pretrain", {"--expert_model_parallel_size", "1"}).model_config;
  EXPECT_EQ(m22.num_layers, 56);
  EXPECT_EQ(m22.hidden_size, 6144);
  EXPECT_EQ(m22.num_experts, 8);  // inherited through extends
  EXPECT_EQ(m22.vocab_size, 32768);
  const ModelConfig q = load("qwen3_30B_A3B-pretrain", {}, 8).model_config;
  EXPECT_EQ(q.model_family, "qwen3_moe");
  EXPECT_TRUE(q.qk_layernorm);
  EXPECT_EQ(q.num_experts, 128);
  EXPECT_EQ(q.moe_router_topk, 8);
  EXPECT_EQ(q.moe_ffn_hidden_size, 768);
  EXPECT_EQ(q.kv_channels, 128);
  const ModelConfig tiny = load_tiny_moe().model_config;
  EXPECT_EQ(tiny.num_experts, 4);
  EXPECT_GT(tiny.moe_z_loss_coeff, 0);
}

TEST(MoeKeys, LayerFreqTakesAnIntervalOrMegatronsLists) {
  std::string why;
  using Flags = std::vector<bool>;
  EXPECT_EQ(parse_moe_layer_freq("1", 3, &why), Flags({true, true, true}));
  EXPECT_EQ(parse_moe_layer_freq("2", 5, &why), Flags({true, false, true, false, true}));
  EXPECT_EQ(parse_moe_layer_freq("[1,0,1]", 3, &why), Flags({true, false, true}));
  EXPECT_EQ(parse_moe_layer_freq("[1, 0, 1]", 3, &why), Flags({true, false, true}));
  EXPECT_EQ(parse_moe_layer_freq("[0]*2+[1]*3", 5, &why), Flags({false, false, true, true, true}));
  EXPECT_EQ(parse_moe_layer_freq("([0]*1+[1,0]*2)", 5, &why),
            Flags({false, true, false, true, false}));
  EXPECT_FALSE(parse_moe_layer_freq("0", 3, &why));
  EXPECT_FALSE(parse_moe_layer_freq("[1,2]", 2, &why));
  EXPECT_FALSE(parse_moe_layer_freq("[1,0", 2, &why));
  EXPECT_FALSE(parse_moe_layer_freq("[1]*3", 4, &why));
  EXPECT_NE(why.find("num_layers is 4, the list has 3"), std::string::npos) << why;
}

TEST(MoeKeys, LayerFreqAsAYamlListAndOnTheCommandLine) {
  ScratchDir dir;
  const std::string path = (dir.path() / "exp.yaml").string();
  std::ofstream(path) << "model: tiny_moe\nmock_data: true\nmoe_layer_freq: [0, 1, 1, 0]\n";
  EXPECT_EQ(load(path).model_config.moe_layer_freq, "[0, 1, 1, 0]");
  EXPECT_EQ(load(path, {"--moe_layer_freq", "[0]*2+[1]*2"}).model_config.moe_layer_freq,
            "[0]*2+[1]*2");
  const ConfigError e = tiny_moe_error({"--moe_layer_freq", "[1,0,1]"});
  EXPECT_EQ(e.key(), "moe_layer_freq");
  EXPECT_NE(e.expected().find("num_layers is 4"), std::string::npos) << e.what();
  // Other keys still take single values only.
  std::ofstream(path) << "model: tiny_moe\nmock_data: true\nnum_layers: [1, 2]\n";
  try {
    load(path);
    ADD_FAILURE() << "a list for num_layers loaded";
  } catch (const ConfigError& err) {
    EXPECT_EQ(err.key(), "num_layers");
  }
}

TEST(MoeKeys, MegatronsInvalidCombinationsNameTheKey) {
  struct Bad {
    std::vector<std::string> cli;
    const char* key;
    const char* says;
    int ranks = 1;
  };
  for (const Bad& b : std::vector<Bad>{
           {{"--moe_router_topk", "5"}, "moe_router_topk", "between 1 and num_experts (4)"},
           {{"--moe_router_topk", "0"}, "moe_router_topk", "between 1 and num_experts"},
           {{"--expert_model_parallel_size", "3"},
            "expert_model_parallel_size",
            "a divisor of num_experts (4)"},
           {{"--expert_model_parallel_size", "4"},
            "expert_model_parallel_size",
            "a divisor of the data-parallel ranks (2)",
            2},
           {{"--moe_router_score_function", "sinkhorn"},
            "moe_router_score_function",
            "one of: softmax, sigmoid"},
           {{"--moe_router_load_balancing_type", "sinkhorn"},
            "moe_router_load_balancing_type",
            "one of: aux_loss, seq_aux_loss, none"},
           {{"--moe_router_enable_expert_bias", "true"},
            "moe_router_enable_expert_bias",
            "unless moe_router_score_function is sigmoid"},
           {{"--moe_router_score_function", "sigmoid", "--moe_router_pre_softmax", "true"},
            "moe_router_pre_softmax",
            "false with moe_router_score_function sigmoid"},
           {{"--moe_router_num_groups", "2"}, "moe_router_num_groups", "set together"},
           {{"--moe_router_num_groups", "3", "--moe_router_group_topk", "1"},
            "moe_router_num_groups",
            "a divisor of num_experts"},
           {{"--moe_router_num_groups", "2", "--moe_router_group_topk", "3"},
            "moe_router_group_topk",
            "between 1 and moe_router_num_groups (2)"},
           {{"--moe_router_num_groups", "4", "--moe_router_group_topk", "1"},
            "moe_router_topk",
            "at most moe_router_group_topk x experts per group = 1 x 1"},
           {{"--moe_expert_capacity_factor", "0"},
            "moe_expert_capacity_factor",
            "a positive number"},
           {{"--moe_pad_expert_input_to_capacity", "true"},
            "moe_pad_expert_input_to_capacity",
            "not implemented"},
           {{"--moe_token_drop_policy", "random"}, "moe_token_drop_policy", "probs"},
           {{"--moe_expert_capacity_factor", "-2"},
            "moe_expert_capacity_factor",
            "null or a non-negative number"},
           {{"--moe_aux_loss_coeff", "-1"}, "moe_aux_loss_coeff", "non-negative"},
           {{"--moe_shared_expert_intermediate_size", "-8"},
            "moe_shared_expert_intermediate_size",
            "no shared expert"},
           {{"--moe_layer_freq", "0"}, "moe_layer_freq", "a positive interval"},
           // Megatron's allgather and flex give the same routing (config/keys.cpp); deepep not.
           {{"--moe_token_dispatcher_type", "deepep"},
            "moe_token_dispatcher_type",
            "one of: alltoall, allgather, flex"},
           {{"--num_experts", "0", "--expert_model_parallel_size", "2"},
            "expert_model_parallel_size",
            "1 for a dense model",
            2},
           {{"--expert_model_parallel_size", "2", "--use_torch_fsdp2", "true"},
            "expert_model_parallel_size",
            "1 with use_torch_fsdp2",
            2},
           // MoE layers are not laid out over context-parallel ranks yet, nor under
           // sequence parallelism (tensor and pipeline parallelism compose: ModelParallel's
           // MoE meshes).
           {{"--expert_model_parallel_size", "2", "--context_parallel_size", "2"},
            "expert_model_parallel_size",
            "does not compose with context parallelism",
            4},
           {{"--context_parallel_size", "2"},
            "context_parallel_size",
            "1 for a mixture-of-experts model",
            2},
           {{"--tensor_model_parallel_size", "2", "--sequence_parallel", "true"},
            "sequence_parallel",
            "runs the routed experts on the whole micro-batch",
            2},
           {{"--tensor_model_parallel_size", "2", "--moe_shared_expert_intermediate_size", "3"},
            "moe_shared_expert_intermediate_size",
            "a multiple of tensor_model_parallel_size (2)",
            2},
       }) {
    SCOPED_TRACE(b.key);
    const ConfigError e = tiny_moe_error(b.cli, b.ranks);
    EXPECT_EQ(e.key(), b.key) << e.what();
    EXPECT_NE(std::string(e.what()).find(b.says), std::string::npos) << e.what();
  }
}

TEST(MoeKeys, CapacityFactorNullRoundTrips) {
  const Experiment e = load_tiny_moe({"--moe_expert_capacity_factor", "null"});
  EXPECT_LT(e.model_config.moe_expert_capacity_factor, 0);
  EXPECT_EQ(find_key("moe_expert_capacity_factor")->get(e), "null");
  const Experiment dropping = load_tiny_moe(
      {"--moe_expert_capacity_factor", "1.25", "--moe_token_drop_policy", "position"});
  EXPECT_DOUBLE_EQ(dropping.model_config.moe_expert_capacity_factor, 1.25);
  EXPECT_EQ(dropping.model_config.moe_token_drop_policy, MoeDropPolicy::Position);
  EXPECT_EQ(find_key("moe_token_drop_policy")->get(dropping), "position");
}

// The CLI: exit 2, the key and the value named, nothing written.
TEST(MoeKeys, CliExitsTwoNamingTheKey) {
  ScratchDir dir;
  for (const auto& [args, key] : std::vector<std::pair<std::string, std::string>>{
           {"--moe_router_topk 9", "key 'moe_router_topk' has value '9'"},
           {"--num_experts 6 --moe_router_topk 2 --expert_model_parallel_size 4",
            "key 'expert_model_parallel_size' has value '4'"},
           {"--device cpu --nproc_per_node 4 --expert_model_parallel_size 2 "
            "--context_parallel_size 2",
            "key 'expert_model_parallel_size' has value '2'"}}) {
    const auto r = run_command("cd " + dir.path().string() + " && " + TESSERA_BINARY +
                               " train --model tiny_moe --mock_data true --workspace ws " + args);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(key), std::string::npos) << r.output;
    EXPECT_FALSE(std::filesystem::exists(dir.path() / "ws")) << args;
  }
}

}  // namespace
}  // namespace tessera
