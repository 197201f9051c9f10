// Megatron's and Primus's spellings (config/megatron_keys.h): Primus experiment files load as
// written, Megatron's precision flags set `precision`, keys Tessera has no part of are accepted
// and recorded, and values Tessera would not honour are refused naming the key.
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/experiment_yaml.h"
#include "common/scratch_dir.h"
#include "tessera/config/config.h"
#include "tessera/config/keys.h"
#include "tessera/config/megatron_keys.h"
#include "tessera/core/error.h"

namespace tessera {
namespace {

using testing::experiment_from_yaml;

constexpr const char* kMinimal = "model: tiny_llama\nmock_data: true\n";

ConfigError yaml_error(const std::string& yaml, const std::vector<std::string>& cli = {}) {
  try {
    experiment_from_yaml(yaml, cli);
  } catch (const ConfigError& e) {
    return e;
  }
  ADD_FAILURE() << "expected a ConfigError for\n" << yaml;
  return ConfigError("", "", "", "");
}

const AcceptedMegatronKey* accepted(const Experiment& e, const std::string& key) {
  for (const AcceptedMegatronKey& k : e.megatron_keys)
    if (k.key == key) return &k;
  return nullptr;
}

TEST(MegatronKeys, Bf16AndFp16SetPrecisionInYamlAndOnTheCommandLine) {
  EXPECT_EQ(experiment_from_yaml(kMinimal).training.precision, Precision::Auto);
  EXPECT_EQ(experiment_from_yaml(kMinimal, {"--bf16"}).training.precision, Precision::Bf16);
  EXPECT_EQ(experiment_from_yaml(kMinimal, {"--bf16", "true"}).training.precision, Precision::Bf16);
  EXPECT_EQ(experiment_from_yaml(kMinimal, {"--bf16=false"}).training.precision, Precision::Fp32);
  const Experiment yaml = experiment_from_yaml(std::string(kMinimal) + "bf16: true\nfp16: false\n");
  EXPECT_EQ(yaml.training.precision, Precision::Bf16);
  EXPECT_NE(yaml.origin.at("precision").find(":3"), std::string::npos)
      << yaml.origin.at("precision");
  // null is Megatron's "not set": precision keeps its value.
  EXPECT_EQ(experiment_from_yaml(std::string(kMinimal) + "precision: fp32\nbf16: null\n")
                .training.precision,
            Precision::Fp32);
  // The last setting wins, as for any key: the command line over the file.
  EXPECT_EQ(experiment_from_yaml(std::string(kMinimal) + "bf16: true\n", {"--precision", "fp32"})
                .training.precision,
            Precision::Fp32);

  for (const auto& [yaml, cli] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {std::string(kMinimal) + "fp16: true\n", {}}, {kMinimal, {"--fp16"}}}) {
    const ConfigError err = yaml_error(yaml, cli);
    EXPECT_EQ(err.key(), "fp16");
    EXPECT_NE(err.expected().find("not implemented"), std::string::npos) << err.what();
  }
  // bf16 on the CPU backend is refused as precision: bf16 is.
  EXPECT_EQ(yaml_error(kMinimal, {"--device", "cpu", "--bf16"}).key(), "precision");
  EXPECT_EQ(yaml_error(std::string(kMinimal) + "bf16: maybe\n").key(), "bf16");
}

TEST(MegatronKeys, DistributedTimeoutMinutesIsDistTimeoutMinutes) {
  const Experiment e =
      experiment_from_yaml(std::string(kMinimal) + "distributed_timeout_minutes: 60\n");
  EXPECT_DOUBLE_EQ(e.training.dist_timeout_minutes, 60.0);
  EXPECT_EQ(yaml_error(kMinimal, {"--distributed-timeout-minutes", "soon"}).key(),
            "distributed_timeout_minutes");
}

TEST(MegatronKeys, NullOnANumberOrBooleanKeyIsItsBuiltInDefault) {
  const Experiment e = experiment_from_yaml(std::string(kMinimal) +
                                            "overrides:\n  lr_decay_iters: null\n"
                                            "  use_rope_scaling: ~\n  init_method_std: null\n");
  EXPECT_EQ(e.training.lr_decay_iters, 0);
  EXPECT_FALSE(e.model_config.use_rope_scaling);
  EXPECT_DOUBLE_EQ(e.model_config.init_method_std, 0.02);  // tiny_llama sets 0.02 too
  // Over a preset's value: llama3.1_8B sets use_rope_scaling, null takes it back to false.
  const Experiment l =
      experiment_from_yaml("model: llama3.1_8B\nmock_data: true\nuse_rope_scaling: null\n");
  EXPECT_FALSE(l.model_config.use_rope_scaling);
}

TEST(MegatronKeys, KeysWithoutEffectAreRecordedWithTheirLastValueAndOrigin) {
  const Experiment e = experiment_from_yaml(
      std::string(kMinimal) +
          "wandb_project: first\noverrides:\n  wandb_project: \"Primus_Pretrain\"\n"
          "  ckpt_format: torch_dist\n  eod_mask_loss: true\n  no_load_optim: null\n",
      {"--stderr-sink-level", "DEBUG", "--use-flash-attn"});
  const AcceptedMegatronKey* wandb = accepted(e, "wandb_project");
  ASSERT_NE(wandb, nullptr);
  EXPECT_EQ(wandb->value, "Primus_Pretrain");
  EXPECT_NE(wandb->origin.find(":5"), std::string::npos) << wandb->origin;
  EXPECT_EQ(accepted(e, "eod_mask_loss"), nullptr);  // a Tessera key: it does what it says
  EXPECT_TRUE(e.data.eod_mask_loss);
  ASSERT_NE(accepted(e, "stderr_sink_level"), nullptr);
  EXPECT_EQ(accepted(e, "stderr_sink_level")->origin, "command line");
  EXPECT_EQ(accepted(e, "ckpt_format")->value, "torch_dist");
  // Megatron's store_true flags that are Tessera keys read null ("not set") as false.
  EXPECT_EQ(accepted(e, "no_load_optim"), nullptr);
  EXPECT_FALSE(e.checkpoint.no_load_optim);
  EXPECT_EQ(e.megatron_keys.size(), 4u);  // each key once
}

TEST(MegatronKeys, ValuesTesseraWouldNotHonourAreRefused) {
  struct Case {
    std::string yaml;
    std::vector<std::string> cli;
    std::string key, fragment;
  };
  for (const Case& c : std::vector<Case>{
           {"test_data_path: /data/test\n", {}, "test_data_path", "validation"},
       }) {
    SCOPED_TRACE(c.key);
    const ConfigError err = yaml_error(std::string(kMinimal) + c.yaml, c.cli);
    EXPECT_EQ(err.key(), c.key);
    EXPECT_NE(err.expected().find(c.fragment), std::string::npos) << err.what();
  }
  // Primus's disable_last_saving is Tessera's key now: with save, the run's end saves nothing.
  EXPECT_TRUE(experiment_from_yaml(std::string(kMinimal) +
                                   "save: /tmp/tessera_never_written\ndisable_last_saving: true\n")
                  .checkpoint.disable_last_saving);
}

TEST(MegatronKeys, NoneIsAlsoATesseraKeyAndEveryOneIsDocumented) {
  std::ifstream in(std::string(TESSERA_TESTS_DIR) + "/../docs/configuration.md");
  const std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::set<std::string_view> names;
  for (const MegatronKey& k : megatron_keys()) {
    EXPECT_EQ(find_key(k.name), nullptr)
        << k.name << " is a Tessera key now: remove its entry from config/megatron_keys.cpp";
    EXPECT_TRUE(names.insert(k.name).second) << k.name << " twice";
    EXPECT_TRUE(static_cast<bool>(k.set) != static_cast<bool>(k.check)) << k.name;
    EXPECT_NE(doc.find("`" + std::string(k.name) + "`"), std::string::npos)
        << k.name << " is not in docs/configuration.md";
  }
}

class PrimusExperiment : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : {"PRIMUS_TEAM", "PRIMUS_USER", "PRIMUS_EXP_NAME", "PRIMUS_WORKSPACE"})
      ::unsetenv(v);
  }
  Experiment load(const std::string& path, std::vector<std::string> cli = {}) {
    LoadOptions o;
    o.config_path = path;
    o.cli_overrides = std::move(cli);
    return load_experiment(o);
  }
  ConfigError load_error(const std::string& path) {
    try {
      load(path);
    } catch (const ConfigError& e) {
      return e;
    }
    ADD_FAILURE() << "expected a ConfigError";
    return ConfigError("", "", "", "");
  }
  std::string write(const std::string& name, const std::string& text) {
    const auto p = dir_.path() / name;
    std::ofstream(p) << text;
    return p.string();
  }
  testing::ScratchDir dir_;
};

// configs/experiments/primus/llama3.1_8B-pretrain.yaml is Primus's own example file.
TEST_F(PrimusExperiment, ShippedPrimusExampleLoadsAsWritten) {
  const Experiment e = load("primus/llama3.1_8B-pretrain");
  EXPECT_EQ(e.experiment_root(), "output/amd/root/llama3.1_8B-pretrain");
  EXPECT_EQ(e.model_config.num_layers, 32);  // model: llama3.1_8B.yaml, the shipped preset
  EXPECT_TRUE(e.model_config.use_rope_scaling);
  EXPECT_DOUBLE_EQ(e.model_config.norm_epsilon, 1e-6);
  EXPECT_EQ(e.training.global_batch_size, 256);
  EXPECT_EQ(e.training.train_iters, 50);
  EXPECT_EQ(e.training.lr_decay_iters, 0);  // null
  EXPECT_DOUBLE_EQ(e.training.weight_decay, 0.1);
  EXPECT_TRUE(e.data.mock_data);
  // From config: pre_trainer.yaml (Primus's module defaults), under the experiment's overrides.
  EXPECT_TRUE(e.training.use_distributed_optimizer);
  EXPECT_TRUE(e.training.overlap_param_gather);
  EXPECT_DOUBLE_EQ(e.training.dist_timeout_minutes, 60.0);
  EXPECT_TRUE(
      e.origin.at("use_distributed_optimizer").starts_with("<shipped>/primus/pre_trainer.yaml:"))
      << e.origin.at("use_distributed_optimizer");
  EXPECT_EQ(e.checkpoint.save_interval, 20000);
  for (const char* key : {"wandb_project", "stderr_sink_level", "log_avg_skip_iterations",
                          "log_avg_reset_interval", "gradient_accumulation_fusion",
                          "test_data_path", "ckpt_format", "enable_primus_turbo"})
    EXPECT_NE(accepted(e, key), nullptr) << key;
  EXPECT_TRUE(e.checkpoint.disable_last_saving);
}

TEST_F(PrimusExperiment, ModulesPreTrainerIsTheOnlyModuleAndItsFrameworkIsMegatron) {
  const std::string module =
      "modules:\n  pre_trainer:\n    framework: megatron\n"
      "    config: pre_trainer\n    model: tiny_llama.yaml\n"
      "    overrides:\n      mock_data: true\n      train_iters: 7\n"
      "      lr_warmup_iters: 1\n";
  const Experiment e = load(write("ok.yaml", module));
  EXPECT_EQ(e.training.train_iters, 7);
  EXPECT_EQ(e.model_config.num_layers, 4);  // the model preset over the module's defaults
  EXPECT_EQ(e.training.seq_length, 1024);   // from pre_trainer.yaml

  struct Case {
    std::string from, to, key;
  };
  for (const Case& c : std::vector<Case>{
           {"framework: megatron", "framework: torchtitan", "modules.pre_trainer.framework"},
           {"config: pre_trainer", "config: sft_trainer.yaml", "modules.pre_trainer.config"},
           {"model: tiny_llama.yaml", "model: lama3_8B.yaml", "model"},
           {"    overrides:", "    trainer: x\n    overrides:", "modules.pre_trainer.trainer"},
           {"modules:\n", "modules:\n  post_trainer:\n    framework: megatron\n",
            "modules.post_trainer"},
       }) {
    SCOPED_TRACE(c.to);
    std::string yaml = module;
    yaml.replace(yaml.find(c.from), c.from.size(), c.to);
    const ConfigError err = load_error(write("bad.yaml", yaml));
    EXPECT_EQ(err.key(), c.key) << err.what();
    if (c.key == "model")  // a preset that does not exist, as Primus names them (with .yaml)
      EXPECT_NE(err.expected().find("did you mean llama3_8B?"), std::string::npos) << err.what();
  }
}

TEST(PresetNames, AnUnknownPresetSuggestsTheNearestIgnoringCase) {
  struct Case {
    std::string ref, suggestion;
  };
  for (const Case& c : std::vector<Case>{
           {"lama3_8B", "did you mean llama3_8B?"},
           {"llama3.1_8b", "did you mean llama3.1_8B?"},
           {"Qwen2.5_7b.yaml", "did you mean qwen2.5_7B?"},
           {"gpt5", "the shipped ones are deepseek_v2_lite, deepseek_v3, llama2_70B, "}}) {
    SCOPED_TRACE(c.ref);
    const ConfigError err = yaml_error("mock_data: true\n", {"--model", c.ref});
    EXPECT_EQ(err.key(), "model");
    EXPECT_NE(err.expected().find(c.suggestion), std::string::npos) << err.what();
  }
  const ConfigError exp = [] {
    try {
      LoadOptions o;
      o.config_path = "llama3.1_8b-pretrain";
      load_experiment(o);
    } catch (const ConfigError& e) {
      return e;
    }
    return ConfigError("", "", "", "");
  }();
  EXPECT_NE(exp.expected().find("did you mean llama3.1_8B-pretrain?"), std::string::npos)
      << exp.what();
}

}  // namespace
}  // namespace tessera
