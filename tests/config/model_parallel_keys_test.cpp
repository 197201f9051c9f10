// Megatron's model-parallel keys: sizes of 1 load from an unmodified Primus experiment, the
// mesh they describe is Megatron's, and every impossible mesh is a ConfigError (exit 2 from
// `tessera train`) naming the key that does not fit.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/experiment_yaml.h"
#include "common/run_command.h"
#include "common/scratch_dir.h"
#include "tessera/core/error.h"
#include "tessera/model/model_spec.h"
#include "tessera/run/run_setup.h"

namespace tessera {
namespace {

// 4 heads in 2 query groups, 4 layers, MLP width 96.
constexpr const char* kTiny =
    "model: tiny_llama\nmock_data: true\nvocab_size: 50\nmake_vocab_size_divisible_by: 1\n"
    "num_layers: 4\nhidden_size: 32\nffn_hidden_size: 96\nnum_attention_heads: 4\n"
    "num_query_groups: 2\nseq_length: 16\nmicro_batch_size: 1\nglobal_batch_size: 8\n";

Experiment load(const std::string& lines, int world) {
  return testing::experiment_from_yaml(std::string(kTiny) + testing::overrides_yaml(lines), {},
                                       world);
}

struct Refusal {
  std::string key, message;
};

// The key a ConfigError names and its message; empty when the experiment loads.
Refusal refusal(const std::string& lines, int world) {
  try {
    load(lines, world);
  } catch (const ConfigError& e) {
    return {e.key(), e.what()};
  }
  return {};
}

TEST(ModelParallelKeys, SizesOfOneLoadFromAPrimusExperiment) {
  const Experiment e = testing::experiment_from_yaml(
      "modules:\n  pre_trainer:\n    model: tiny_llama.yaml\n    overrides:\n"
      "      mock_data: true\n      tensor_model_parallel_size: 1\n"
      "      pipeline_model_parallel_size: 1\n      context_parallel_size: 1\n"
      "      sequence_parallel: false\n      virtual_pipeline_model_parallel_size: null\n"
      "      decoder_first_pipeline_num_layers: null\n"
      "      decoder_last_pipeline_num_layers: null\n");
  EXPECT_EQ(e.training.tensor_model_parallel_size, 1);
  EXPECT_EQ(e.training.pipeline_model_parallel_size, 1);
  EXPECT_EQ(e.training.context_parallel_size, 1);
  EXPECT_EQ(e.training.virtual_pipeline_model_parallel_size, 0);
  // sequence_parallel without tensor parallelism is accepted and off, as in Megatron.
  EXPECT_NO_THROW(load("sequence_parallel: true\n", 1));
}

TEST(ModelParallelKeys, MeshFollowsMegatronsRankOrder) {
  Experiment e = load("", 8);
  e.training.tensor_model_parallel_size = 2;
  e.training.pipeline_model_parallel_size = 2;
  const dist::DeviceMesh mesh = device_mesh(e.training, 8);
  EXPECT_EQ(mesh.size(dist::MeshDim::DP), 2);
  // tp fastest, then (cp,) dp, then pp: rank 5 = tp 1 + 2 x (dp 0 + 2 x pp 1).
  EXPECT_EQ(mesh.coordinate(5, dist::MeshDim::TP), 1);
  EXPECT_EQ(mesh.coordinate(5, dist::MeshDim::DP), 0);
  EXPECT_EQ(mesh.coordinate(5, dist::MeshDim::PP), 1);
  EXPECT_EQ(mesh.group_ranks(5, dist::MeshDim::DP), (std::vector<int>{5, 7}));
}

TEST(ModelParallelKeys, VocabularyIsPaddedForEveryTensorParallelRank) {
  Experiment e = load("", 1);
  EXPECT_EQ(make_model_spec(e, 50).vocab_size, 50);
  e.training.tensor_model_parallel_size = 4;
  EXPECT_EQ(make_model_spec(e, 50).vocab_size, 52);  // Megatron: a multiple of 1 x 4
  e.model_config.make_vocab_size_divisible_by = 8;
  EXPECT_EQ(make_model_spec(e, 50).vocab_size, 64);
}

TEST(ModelParallelKeys, ImpossibleMeshesNameTheKey) {
  struct Case {
    std::string lines;
    int world;
    std::string key, fragment;
  };
  const std::vector<Case> cases = {
      {"tensor_model_parallel_size: 0\n", 1, "tensor_model_parallel_size", "positive"},
      {"tensor_model_parallel_size: 3\n", 4, "tensor_model_parallel_size",
       "(3 x 1 x 1) to divide the number of ranks, 4"},
      {"tensor_model_parallel_size: 2\npipeline_model_parallel_size: 3\n", 4,
       "pipeline_model_parallel_size", "(2 x 3 x 1) to divide"},
      {"context_parallel_size: 3\n", 4, "context_parallel_size", "to divide"},
      {"tensor_model_parallel_size: 8\n", 8, "tensor_model_parallel_size",
       "a divisor of num_attention_heads (4) and num_query_groups (2)"},
      {"tensor_model_parallel_size: 4\n", 4, "tensor_model_parallel_size", "num_query_groups (2)"},
      {"tensor_model_parallel_size: 2\nffn_hidden_size: 95\n", 2, "tensor_model_parallel_size",
       "a divisor of ffn_hidden_size (95)"},
      {"tensor_model_parallel_size: 2\nsequence_parallel: true\nseq_length: 15\n", 2, "seq_length",
       "a multiple of tensor_model_parallel_size (2) with sequence_parallel"},
      {"context_parallel_size: 2\nseq_length: 18\n", 2, "seq_length",
       "a multiple of 2 x context_parallel_size = 4"},
      {"pipeline_model_parallel_size: 3\n", 3, "pipeline_model_parallel_size",
       "a divisor of num_layers (4)"},
      {"pipeline_model_parallel_size: 2\nvirtual_pipeline_model_parallel_size: 3\n", 2,
       "virtual_pipeline_model_parallel_size", "num_layers (4) divisible by"},
      {"pipeline_model_parallel_size: 2\nnum_layers_per_virtual_pipeline_stage: 3\n", 2,
       "num_layers_per_virtual_pipeline_stage", "num_layers (4) divisible by"},
      {"pipeline_model_parallel_size: 2\nvirtual_pipeline_model_parallel_size: 2\n"
       "num_layers_per_virtual_pipeline_stage: 1\n",
       2, "num_layers_per_virtual_pipeline_stage", "0 when virtual_pipeline_model_parallel_size"},
      {"pipeline_model_parallel_size: 3\ndecoder_first_pipeline_num_layers: 1\n", 3,
       "decoder_first_pipeline_num_layers", "leave the other 2 stage(s) an equal"},
      {"pipeline_model_parallel_size: 2\ndecoder_first_pipeline_num_layers: 3\n"
       "decoder_last_pipeline_num_layers: 2\n",
       2, "decoder_last_pipeline_num_layers", "-1 remain"},
      {"decoder_last_pipeline_num_layers: 2\n", 1, "decoder_last_pipeline_num_layers",
       "0 without pipeline parallelism"},
      {"pipeline_model_parallel_size: 2\nvirtual_pipeline_model_parallel_size: 2\n"
       "global_batch_size: 5\n",
       2, "global_batch_size", "= 5) a multiple of pipeline_model_parallel_size (2)"},
      // The data-parallel size is what the model-parallel sizes leave of the world.
      {"tensor_model_parallel_size: 2\nglobal_batch_size: 3\n", 4, "global_batch_size",
       "micro_batch_size x data-parallel size = 1 x 2"},
      // Layouts that are not combined.
      {"pipeline_model_parallel_size: 2\nuntie_embeddings_and_output_weights: false\n", 2,
       "untie_embeddings_and_output_weights", "the embedding (first stage) and the output head"},
      {"pipeline_model_parallel_size: 2\nuse_torch_fsdp2: true\n", 4, "use_torch_fsdp2",
       "composes with tensor and context parallelism only"},
      {"pipeline_model_parallel_size: 4\nuse_torch_fsdp2: true\n", 4, "use_torch_fsdp2",
       "use use_distributed_optimizer with pipelines"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.lines);
    const Refusal r = refusal(c.lines, c.world);
    EXPECT_EQ(r.key, c.key) << r.message;
    EXPECT_NE(r.message.find(c.fragment), std::string::npos) << r.message;
  }
}

TEST(ModelParallelKeys, PossibleMeshesLoad) {
  for (const auto& [lines, world] : std::vector<std::pair<std::string, int>>{
           {"tensor_model_parallel_size: 2\nsequence_parallel: true\n", 4},
           {"pipeline_model_parallel_size: 4\n", 4},
           {"pipeline_model_parallel_size: 2\nvirtual_pipeline_model_parallel_size: 2\n", 2},
           {"pipeline_model_parallel_size: 2\nnum_layers_per_virtual_pipeline_stage: 1\n", 4},
           {"pipeline_model_parallel_size: 3\ndecoder_last_pipeline_num_layers: 2\n", 3},
           {"tensor_model_parallel_size: 2\npipeline_model_parallel_size: 2\n", 8},
           {"context_parallel_size: 2\nsliding_window: 4\n", 2},
           {"context_parallel_size: 2\ntensor_model_parallel_size: 2\n"
            "pipeline_model_parallel_size: 2\n",
            8}}) {
    SCOPED_TRACE(lines);
    const Refusal r = refusal(lines, world);
    EXPECT_EQ(r.key, "") << r.message;
  }
}

TEST(ModelParallelKeys, DerivedMlpWidthMustSplitEvenly) {
  // hidden 48 derives an MLP width of int(8 x 48 / 3 / 64) x 64 = 128; tensor parallelism of 3
  // passes the key checks (3 heads, 3 groups) and is refused where the width is known.
  Experiment e = testing::experiment_from_yaml(
      "model: tiny_llama\nmock_data: true\nvocab_size: 48\nmake_vocab_size_divisible_by: 1\n"
      "hidden_size: 48\nffn_hidden_size: 0\nnum_attention_heads: 3\nnum_query_groups: 3\n");
  e.training.tensor_model_parallel_size = 3;
  try {
    make_run_setup(e, {3, DType::F32, 0}, [] { return int64_t{48}; });
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& err) {
    EXPECT_EQ(err.key(), "tensor_model_parallel_size");
    EXPECT_NE(std::string(err.what()).find("a divisor of the MLP width (128"), std::string::npos)
        << err.what();
  }
}

TEST(ModelParallelKeys, TrainExitsTwoNamingTheKeyAndWritesNothing) {
  testing::ScratchDir dir;
  const testing::RunResult r = testing::run_tessera(
      "train --device cpu --nproc_per_node 4 --model tiny_llama --mock_data true "
      "--vocab_size 64 --global_batch_size 4 --tensor_model_parallel_size 3 --workspace " +
      (dir / "ws").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("key 'tensor_model_parallel_size' has value '3'"), std::string::npos)
      << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir / "ws"));
}

}  // namespace
}  // namespace tessera
