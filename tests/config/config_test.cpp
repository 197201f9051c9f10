#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "common/run_command.h"
#include "tessera/config/config.h"
#include "tessera/config/keys.h"
#include "tessera/core/error.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tessera_config_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p.string();
  }

  Experiment load(const std::string& path, std::vector<std::string> cli = {}) {
    LoadOptions o;
    o.config_path = path;
    o.cli_overrides = std::move(cli);
    return load_experiment(o);
  }

  // Loads and returns the ConfigError; fails the test if loading succeeds.
  ConfigError load_error(const std::string& path, std::vector<std::string> cli = {}) {
    try {
      load(path, std::move(cli));
    } catch (const ConfigError& e) {
      return e;
    }
    ADD_FAILURE() << "expected a ConfigError";
    return ConfigError("", "", "", "");
  }

  fs::path dir_;
};

constexpr const char* kMinimal = "model: tiny_llama\nmock_data: true\n";

TEST_F(ConfigTest, DefaultExperimentIsLlama3TokensOfTheBrownCorpus) {
  LoadOptions o;
  const Experiment e = load_experiment(o);
  EXPECT_EQ(e.model, "tiny_llama");
  EXPECT_EQ(e.model_config.num_layers, 4);     // from the preset
  EXPECT_EQ(e.model_config.hidden_size, 128);  // from the experiment's overrides
  EXPECT_EQ(e.training.seq_length, 256);
  EXPECT_FALSE(e.data.mock_data);
  EXPECT_TRUE(e.data.data_path.ends_with("build/data/brown_llama3_text_document"));
  EXPECT_EQ(e.data.tokenizer_model, "llama3");
  EXPECT_EQ(e.origin.at("num_layers"), "<shipped>/models/tiny_llama.yaml:3");
  EXPECT_EQ(e.origin.at("hidden_size"), "<shipped>/experiments/default.yaml:17");
}

TEST_F(ConfigTest, EveryShippedExperimentLoads) {
  for (const char* name : {"llama2_7B-pretrain", "llama2_70B-pretrain", "llama3_8B-pretrain",
                           "llama3.1_8B-pretrain", "llama3.1_70B-pretrain", "llama3.3_70B-pretrain",
                           "qwen2.5_7B-pretrain", "qwen2.5_72B-pretrain", "mistral_7B-pretrain"}) {
    SCOPED_TRACE(name);
    const Experiment e = load(name);
    EXPECT_TRUE(e.data.mock_data);
    EXPECT_GT(e.model_config.num_layers, 20);
    EXPECT_EQ(e.exp_name, name);
  }
}

TEST_F(ConfigTest, PresetValuesMatchPublishedArchitectures) {
  const Experiment l31 = load("llama3.1_8B-pretrain");
  EXPECT_EQ(l31.model_config.num_layers, 32);
  EXPECT_EQ(l31.model_config.hidden_size, 4096);
  EXPECT_EQ(l31.model_config.ffn_hidden_size, 14336);
  EXPECT_EQ(l31.model_config.num_query_groups, 8);
  EXPECT_EQ(l31.model_config.vocab_size, 128256);
  EXPECT_TRUE(l31.model_config.use_rope_scaling);  // inherited through extends
  EXPECT_DOUBLE_EQ(l31.model_config.rotary_base, 500000.0);
  EXPECT_EQ(l31.training.micro_batch_size, 2);
  EXPECT_EQ(l31.training.global_batch_size, 128);  // Primus's MI300X configuration
  const Experiment qwen = load("qwen2.5_7B-pretrain");
  EXPECT_TRUE(qwen.model_config.add_qkv_bias);
  EXPECT_EQ(qwen.model_config.num_query_groups, 4);
  EXPECT_EQ(qwen.model_config.vocab_size, 152064);
  EXPECT_EQ(load("mistral_7B-pretrain").model_config.sliding_window, 4096);
  EXPECT_EQ(load("llama3.3_70B-pretrain").model_config.num_layers, 80);
}

TEST_F(ConfigTest, CliOverridesWinInBothSpellings) {
  const std::string p = write("exp.yaml", std::string(kMinimal) + "lr: 0.1\nnum_layers: 3\n");
  const Experiment e = load(p, {"--lr", "0.5", "--num_layers=7", "--use-rope-scaling",
                                "--lr-warmup-iters", "0"});
  EXPECT_DOUBLE_EQ(e.training.lr, 0.5);
  EXPECT_EQ(e.model_config.num_layers, 7);
  EXPECT_TRUE(e.model_config.use_rope_scaling);
  EXPECT_EQ(e.origin.at("lr"), "command line");
  EXPECT_EQ(e.origin.at("num_layers"), "command line");
}

TEST_F(ConfigTest, ExtendsChainChildWinsAndCyclesAreReported) {
  write("base.yaml", "model: tiny_llama\nmock_data: true\nlr: 0.1\nseed: 7\n");
  const std::string mid = write("mid.yaml", "extends: base.yaml\nlr: 0.2\n");
  const std::string child = write("sub/child.yaml", "extends: ../mid.yaml\noverrides:\n  seed: 9\n");
  const Experiment e = load(child);
  EXPECT_DOUBLE_EQ(e.training.lr, 0.2);
  EXPECT_EQ(e.training.seed, 9);
  EXPECT_EQ(load(mid).training.seed, 7);

  write("a.yaml", "extends: b.yaml\n");
  const std::string b = write("b.yaml", "extends: a.yaml\n");
  const ConfigError err = load_error(b);
  EXPECT_EQ(err.key(), "extends");
  EXPECT_NE(std::string(err.what()).find("cycle"), std::string::npos);
}

TEST_F(ConfigTest, PrimusModulesLayoutIsAccepted) {
  const std::string p = write("primus.yaml",
                              "work_group: amd\nuser_name: me\nexp_name: x\nworkspace: ./out\n"
                              "modules:\n  pre_trainer:\n    model: tiny_qwen.yaml\n"
                              "    overrides:\n      mock_data: true\n      train_iters: 5\n");
  const Experiment e = load(p);
  EXPECT_TRUE(e.model_config.add_qkv_bias);
  EXPECT_EQ(e.training.train_iters, 5);
  EXPECT_EQ(e.experiment_root(), "out/amd/me/x");
}

TEST_F(ConfigTest, VariableSubstitution) {
  ::setenv("TESSERA_TEST_VAR", "from_env", 1);
  ::unsetenv("TESSERA_TEST_UNSET");
  const std::string p = write("vars.yaml", std::string(kMinimal) +
                                               "exp_name: ${TESSERA_TEST_VAR:fallback}\n"
                                               "user_name: ${TESSERA_TEST_UNSET:someone}\n"
                                               "work_group: pre_${TESSERA_TEST_UNSET:x}_post\n");
  const Experiment e = load(p);
  EXPECT_EQ(e.exp_name, "from_env");
  EXPECT_EQ(e.user_name, "someone");
  EXPECT_EQ(e.work_group, "pre_x_post");

  const std::string bad = write("bad.yaml", std::string(kMinimal) + "exp_name: ${TESSERA_TEST_UNSET}\n");
  const ConfigError err = load_error(bad);
  EXPECT_EQ(err.key(), "exp_name");
  EXPECT_NE(err.expected().find("TESSERA_TEST_UNSET"), std::string::npos);
}

TEST_F(ConfigTest, UnknownKeySuggestsTheClosestOne) {
  const std::string p = write("typo.yaml", std::string(kMinimal) + "lr_warmup_iter: 10\n");
  const ConfigError err = load_error(p);
  EXPECT_EQ(err.key(), "lr_warmup_iter");
  EXPECT_EQ(err.source(), p + ":3");
  EXPECT_NE(err.expected().find("did you mean 'lr_warmup_iters'"), std::string::npos);

  const ConfigError cli = load_error(write("ok.yaml", kMinimal), {"--micro_bach_size", "2"});
  EXPECT_EQ(cli.source(), "command line");
  EXPECT_NE(cli.expected().find("micro_batch_size"), std::string::npos);
}

TEST_F(ConfigTest, WrongTypesNameKeyValueAndExpectation) {
  struct Case {
    std::string key, value, expected_fragment;
  };
  for (const Case& c : std::vector<Case>{{"train_iters", "ten", "an integer"},
                                         {"lr", "fast", "a finite number"},
                                         {"mock_data", "maybe", "true or false"},
                                         {"lr_decay_style", "exponential", "one of: cosine, linear, constant"},
                                         {"num_layers", "2.5", "an integer"}}) {
    SCOPED_TRACE(c.key);
    // Under overrides:, as kMinimal's own mock_data may not be given twice in one mapping.
    const std::string p =
        write("t.yaml", std::string(kMinimal) + "overrides:\n  " + c.key + ": " + c.value + "\n");
    const ConfigError err = load_error(p);
    EXPECT_EQ(err.key(), c.key);
    EXPECT_EQ(err.value(), c.value);
    EXPECT_NE(err.expected().find(c.expected_fragment), std::string::npos) << err.what();
    EXPECT_NE(std::string(err.what()).find(p), std::string::npos);
  }
  const std::string list = write("list.yaml", std::string(kMinimal) + "lr: [1, 2]\n");
  EXPECT_NE(load_error(list).expected().find("single value"), std::string::npos);
}

TEST_F(ConfigTest, ImpossibleCombinationsAreRejected) {
  const std::string p = write("exp.yaml", kMinimal);
  struct Case {
    std::vector<std::string> cli;
    std::string key;
  };
  const std::vector<Case> cases = {
      {{"--micro_batch_size", "3", "--global_batch_size", "8"}, "global_batch_size"},
      {{"--num_attention_heads", "4", "--num_query_groups", "3"}, "num_query_groups"},
      {{"--seq_length", "4096", "--max_position_embeddings", "2048"}, "seq_length"},
      {{"--hidden_size", "250"}, "num_attention_heads"},
      {{"--min_lr", "1", "--lr", "0.1"}, "min_lr"},
      {{"--lr_warmup_iters", "500", "--train_iters", "100"}, "lr_warmup_iters"},
      {{"--device", "cpu", "--precision", "bf16"}, "precision"},
      {{"--recompute_granularity", "selective", "--recompute_num_layers", "2"},
       "recompute_num_layers"},
      {{"--mock_data", "false"}, "train_data_path"},
      {{"--mock_data", "false", "--train_data_path", "/no/such/corpus"}, "train_data_path"},
      {{"--split", "1,x,0"}, "split"},
      {{"--adam_beta2", "1.0"}, "adam_beta2"},
      {{"--use_torch_fsdp2", "true", "--use_distributed_optimizer", "true"}, "use_torch_fsdp2"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.key);
    const ConfigError err = load_error(p, c.cli);
    EXPECT_EQ(err.key(), c.key) << err.what();
  }
}

// A data_path or valid_data_path prefix without its files passed validation: `tessera train`
// made the experiment directory and only then failed (exit 3) opening the data. Like
// train_data_path, it is now exit 2 naming the key and the missing files, with nothing written.
TEST_F(ConfigTest, MissingDataPathPrefixIsRefusedBeforeAnythingIsWritten) {
  // Validation looks only for the files; whether they parse is the data loader's business.
  for (const char* ext : {".bin", ".idx"}) write(std::string("present") + ext, "");
  const std::string present = (dir_ / "present").string(), missing = (dir_ / "missing").string();
  const std::string train = std::string(TESSERA_BINARY) +
                            " train --device cpu --tokenizer_type ByteLevel --workspace " +
                            (dir_ / "ws").string() + " ";
  struct Case {
    std::string args, key;
  };
  for (const Case& c : std::vector<Case>{
           {"--data_path " + missing, "data_path"},
           {"--data_path \"0.5 " + present + " 0.5 " + missing + "\"", "data_path"},
           {"--data_path " + present + " --eval_interval 5 --valid_data_path " + missing,
            "valid_data_path"},
       }) {
    SCOPED_TRACE(c.args);
    const auto r = testing::run_command(train + c.args);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    for (const std::string& part :
         {"key '" + c.key + "'", missing + ".bin and " + missing + ".idx not found"})
      EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
    EXPECT_FALSE(fs::exists(dir_ / "ws"));
  }
  // Half a dataset is missing too; the message names the absent half.
  fs::remove(dir_ / "present.idx");
  const ConfigError err = load_error(write(
      "exp.yaml", "model: tiny_llama\ndata_path: " + present + "\ntokenizer_type: ByteLevel\n"));
  EXPECT_EQ(err.key(), "data_path");
  EXPECT_NE(err.expected().find("; " + present + ".idx not found"), std::string::npos)
      << err.what();
}

TEST_F(ConfigTest, MissingFilesAreNamed) {
  const ConfigError err = load_error((dir_ / "missing.yaml").string());
  EXPECT_EQ(err.key(), "config");
  const std::string p = write("bad_model.yaml", "model: llama9_1T\nmock_data: true\n");
  const ConfigError m = load_error(p);
  EXPECT_EQ(m.key(), "model");
  EXPECT_EQ(m.value(), "llama9_1T");
  const std::string syntax = write("syntax.yaml", "model: [unclosed\n");
  EXPECT_EQ(load_error(syntax).key(), "(syntax)");
}

TEST_F(ConfigTest, EffectiveYamlRoundTrips) {
  const std::string p = write("exp.yaml", std::string(kMinimal) + "exp_name: \"odd: name\"\n");
  const Experiment e = load(p, {"--lr", "0.25", "--recompute_granularity", "selective"});
  const std::string dumped = write("dumped.yaml", experiment_to_yaml(e));
  const Experiment again = load(dumped);
  for (const auto& k : config_keys()) EXPECT_EQ(k.get(again), k.get(e)) << k.name;
}

TEST_F(ConfigTest, EveryKeyIsDocumented) {
  std::ifstream in(std::string(TESSERA_TESTS_DIR) + "/../docs/configuration.md");
  ASSERT_TRUE(in) << "docs/configuration.md is missing";
  const std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const auto& k : config_keys())
    EXPECT_NE(doc.find("`" + std::string(k.name) + "`"), std::string::npos)
        << k.name << " is not in docs/configuration.md";
}

}  // namespace
}  // namespace tessera
