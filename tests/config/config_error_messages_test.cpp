// Configuration mistakes users make on `tessera train`: each one exits 2,
// writes nothing, and its message names the real cause and the fix rather than
// a symptom further down the line.
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/run_command.h"
#include "common/scratch_dir.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

class ConfigErrorMessage : public ::testing::Test {
 protected:
  void write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
  }

  // Runs `tessera train ARGS` in the scratch directory with a workspace inside
  // it; expects exit code 2 and no file added there. Returns the output.
  std::string train_error(const std::string& args) {
    const std::set<fs::path> before = files();
    const RunResult r = run_command("cd " + dir_.path().string() + " && " + TESSERA_BINARY +
                                    " train " + args + " --workspace ws");
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_EQ(files(), before) << args << " wrote files";
    return r.output;
  }

  std::set<fs::path> files() const {
    std::set<fs::path> out;
    for (const auto& f : fs::recursive_directory_iterator(dir_.path())) out.insert(f.path());
    return out;
  }

  ScratchDir dir_;
};

TEST_F(ConfigErrorMessage, ExtendsCycleNamesTheWholeChain) {
  write("a.yaml", "extends: b.yaml\n");
  write("b.yaml", "model: tiny_llama\nextends: a.yaml\n");
  const std::string out = train_error("--config a.yaml");
  EXPECT_TRUE(contains(out, "b.yaml:2: key 'extends' has value 'a.yaml'")) << out;
  EXPECT_TRUE(contains(out, "a.yaml -> b.yaml -> a.yaml loops; remove one extends:")) << out;
}

TEST_F(ConfigErrorMessage, ModelPresetAsExperimentSuggestsDashDashModel) {
  for (const std::string preset : {"tiny_llama", "models/tiny_llama.yaml"}) {
    const std::string out = train_error("--config " + preset);
    EXPECT_TRUE(contains(out, "command line: key 'config' has value '" + preset + "'")) << out;
    EXPECT_TRUE(contains(out, preset + " is a model preset: train it with --model " + preset))
        << out;
  }
  // A preset with a shipped experiment of its own points to that too.
  const std::string out = train_error("--config llama3.1_8B");
  EXPECT_TRUE(contains(out, "its shipped experiment is --config llama3.1_8B-pretrain")) << out;
}

TEST_F(ConfigErrorMessage, ShortTrainItersIsBlamedNotTheShippedWarmup) {
  // The shipped default experiment warms up for 20 iterations.
  const std::string out = train_error("--train_iters 5");
  EXPECT_TRUE(contains(out,
                       "command line: key 'train_iters' has value '5': expected at least "
                       "lr_warmup_iters (20, set at <shipped>/experiments/default.yaml:"))
      << out;
  EXPECT_TRUE(contains(out,
                       "lower --lr_warmup_iters to 5 or less, or raise --train_iters (or "
                       "--lr_decay_iters) to 20 or more"))
      << out;
  // Set on the command line too, the warm-up is the value that does not fit.
  const std::string both = train_error("--train_iters 5 --lr_warmup_iters 8");
  EXPECT_TRUE(contains(both,
                       "key 'lr_warmup_iters' has value '8': expected at most train_iters "
                       "(5, set on the command line)"))
      << both;
}

TEST_F(ConfigErrorMessage, MisspelledFlagBeforeAnotherFlagSuggestsTheKey) {
  for (const std::string args :
       {"--trian_iters --lr 1e-3", "--trian_iters 5 --lr 1e-3", "--mock-dta --lr 1e-3"}) {
    const std::string out = train_error(args);
    EXPECT_TRUE(contains(out, "command line: key '")) << out;
    EXPECT_TRUE(contains(out, "expected a known key; did you mean '")) << out;
    EXPECT_TRUE(contains(out, args.starts_with("--mock") ? "'mock_data'" : "'train_iters'")) << out;
    EXPECT_FALSE(contains(out, "a value after")) << out;
  }
}

TEST_F(ConfigErrorMessage, DuplicateKeyNamesFileLineAndKey) {
  write("top.yaml", "model: tiny_llama\nmock_data: true\nlr: 0.1\nlr: 0.2\n");
  // --train_iters 1: should the file be accepted, the run is short.
  const std::string top = train_error("--config top.yaml --train_iters 1");
  EXPECT_TRUE(contains(top,
                       "top.yaml:4: key 'lr' has value '0.2': expected each key once in a "
                       "mapping, but 'lr' is also set at line 3"))
      << top;
  write("nested.yaml", "model: tiny_llama\noverrides:\n  seed: 1\n  mock_data: true\n  seed: 2\n");
  const std::string nested = train_error("--config nested.yaml --train_iters 1");
  EXPECT_TRUE(contains(nested, "nested.yaml:5: key 'seed' has value '2'")) << nested;
  EXPECT_TRUE(contains(nested, "also set at line 3")) << nested;
}

TEST_F(ConfigErrorMessage, ComplexKeyIsRefusedWithItsLine) {
  write("complex.yaml", "model: tiny_llama\nmock_data: true\n? [lr, seed]\n: 1\n");
  const std::string out = train_error("--config complex.yaml --train_iters 1");
  EXPECT_TRUE(contains(out, "complex.yaml:3: key '(key)'")) << out;
  EXPECT_TRUE(contains(out, "expected a plain key name")) << out;
}


// LoRA and DPO keys that cannot do what they say are refused by name before anything runs.
TEST_F(ConfigErrorMessage, GrpoKeysThatCannotRunAreNamed) {
  const fs::path prompts = dir_ / "prompts.jsonl";
  std::ofstream(prompts) << R"({"prompt": "Is golf a sport?", "answer": "yes"})" << "\n";
  const std::string grpo = "--model tiny_llama --train_iters 2 --lr_warmup_iters 0 --objective grpo --data_path null "
                           "--train_data_path " + prompts.string() + " --global_batch_size 8 --micro_batch_size 2 --grpo_max_completion_length 16 ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--grpo_num_generations 1", "key 'grpo_num_generations' has value '1': expected 2 or more"},
      {"--grpo_num_generations 3", "key 'global_batch_size' has value '8': expected a multiple of grpo_num_generations (3)"},
      {"--grpo_max_completion_length 4096", "key 'grpo_max_completion_length' has value '4096': expected 1 or more and below seq_length"},
      {"--grpo_temperature 0", "key 'grpo_temperature' has value '0"},
      {"--grpo_max_num_seqs -1", "key 'grpo_max_num_seqs' has value '-1': expected 0 (all of a rank's completions at once) or a positive count"},
      {"--grpo_rewards answer,speed", "key 'grpo_rewards' has value 'answer,speed': expected comma-separated name[:weight] of answer, format, overlong and command ('speed' is not a reward)"},
      {"--grpo_rewards answer:x", "'x' is not a weight"},
      {"--grpo_rewards format", "key 'grpo_format_regex' has value 'null': expected a pattern with the format reward"},
      {"--grpo_rewards format --grpo_format_regex '(['", "key 'grpo_format_regex' has value '(['"},
      {"--grpo_rewards command", "key 'grpo_reward_command' has value 'null': expected a command with the command reward"},
      {"--grpo_answer_format regex", "key 'grpo_answer_regex' has value 'null': expected a pattern with grpo_answer_format regex"},
      {"--tensor_model_parallel_size 2 --nproc_per_node 2",
       "key 'tensor_model_parallel_size' has value '2': expected 1 with objective grpo"},
      {"--use_torch_fsdp2 true", "key 'use_torch_fsdp2' has value 'true': expected false with objective grpo"},
      {"--train_data_path " + (dir_ / "missing.jsonl").string(), "expected an existing JSON-lines file of prompts"},
      {"--grpo_epsilon 1", "key 'grpo_epsilon' has value '1"}};
  for (const auto& [args, message] : cases) {
    const std::string out = train_error(grpo + args);
    EXPECT_TRUE(contains(out, message)) << args << "\n" << out;
  }
}

TEST_F(ConfigErrorMessage, LoraAndDpoKeysThatCannotRunAreNamed) {
  fs::create_directories(dir_ / "base");
  const std::string tiny = "--model tiny_llama --mock_data true --train_iters 2 --lr_warmup_iters 0 ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--lora_rank 8 --lora_dropout 0.1",
       "key 'lora_dropout' has value '0.1': expected 0.0: dropout on the adapters' input is not implemented"},
      {"--lora_rank 8 --lora_target_modules q_proj,qkv", "key 'lora_target_modules' has value 'q_proj,qkv'"},
      {"--lora_rank 8 --finetune --load base",
       "key 'finetune' has value 'true': expected false with lora_rank: the frozen base comes from "
       "pretrained_checkpoint"},
      {"--lora_rank 8 --pretrained_checkpoint missing",
       "key 'pretrained_checkpoint' has value 'missing': expected an existing checkpoint directory"},
      {"--pretrained_checkpoint base", "expected unset without lora_rank"},
      // Tensor and context parallelism and FSDP run the adapters; pipeline stages do not.
      {"--lora_rank 8 --num_layers 4 --pipeline_model_parallel_size 2 --nproc_per_node 2 --device cpu",
       "key 'pipeline_model_parallel_size' has value '2': expected off with lora_rank"},
      {"--objective dpo --dpo_rpo_alpha -1", "key 'dpo_rpo_alpha' has value '-1"},
      {"--objective dpo --lora_rank 8 --dpo_precompute_ref_log_probs false",
       "key 'dpo_precompute_ref_log_probs' has value 'false': expected true with lora_rank"},
      {"--objective dpo --dpo_reference_free --dpo_precompute_ref_log_probs false",
       "key 'dpo_precompute_ref_log_probs' has value 'false': expected true with dpo_reference_free"}};
  for (const auto& [args, message] : cases) {
    const std::string out = train_error(tiny + args);
    EXPECT_TRUE(contains(out, message)) << args << "\n" << out;
  }
}

}  // namespace
}  // namespace tessera::testing
