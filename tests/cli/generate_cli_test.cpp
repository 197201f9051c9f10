// tessera generate through the real binary: a checkpoint trained with the byte-level
// tokenizer continues a text prompt greedily (the same ids every time, and the ids the prompt
// given as ids produces), sampling is reproducible for a seed, and bad arguments exit 2.
// Samples decoded together are each the one decoded alone from its stream; a stop string
// ends a continuation; a prompts file gives each prompt's continuations as JSON lines.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>
#include "common/run_command.h"
#include "common/scratch_dir.h"

namespace tessera::testing {
namespace {

std::string ids_line(const std::string& output) {
  std::smatch m;
  static const std::regex kIds("ids: ([0-9 ]*)");
  return std::regex_search(output, m, kIds) ? m[1].str() : "";
}

// A tiny model trained a few steps with the byte-level tokenizer, saved in `save`.
void train_byte_level_checkpoint(const ScratchDir& dir, const std::string& save) {
  const RunResult trained = run_tessera(
      "train --device cpu --model tiny_llama --mock_data true --tokenizer_type ByteLevel "
      "--vocab_size 320 --seq_length 32 --micro_batch_size 2 --global_batch_size 2 "
      "--train_iters 3 --lr_warmup_iters 1 --eval_interval 0 --log_progress false --workspace " +
      dir.path().string() + " --save " + save);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
}

TEST(GenerateCli, ContinuesAPromptFromACheckpoint) {
  ScratchDir dir;
  const std::string save = (dir / "ckpt").string();
  ASSERT_NO_FATAL_FAILURE(train_byte_level_checkpoint(dir, save));

  const std::string base = "generate --device cpu --from " + save + " --max_new_tokens 6 ";
  const RunResult greedy = run_tessera(base + "--prompt 'Dan' --ignore_eos");
  ASSERT_EQ(greedy.exit_code, 0) << greedy.output;
  // The text printed is the prompt with its continuation, as transformers' pipeline and
  // Megatron's text server return it.
  EXPECT_EQ(greedy.output.rfind("Dan", 0), 0u) << greedy.output;
  // Megatron's name of --from.
  const RunResult load = run_tessera("generate --device cpu --load " + save +
                                     " --max_new_tokens 6 --prompt 'Dan' --ignore_eos");
  ASSERT_EQ(load.exit_code, 0) << load.output;
  const auto text = [](const std::string& output) { return output.substr(0, output.find("ids:")); };
  EXPECT_EQ(text(load.output), text(greedy.output));
  EXPECT_EQ(ids_line(load.output), ids_line(greedy.output));
  EXPECT_TRUE(contains(greedy.output, "prompt of 3 tokens")) << greedy.output;
  EXPECT_TRUE(contains(greedy.output, "6 new tokens at")) << greedy.output;
  EXPECT_TRUE(contains(greedy.output, "tokens/s")) << greedy.output;
  const std::string ids = ids_line(greedy.output);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), ' '), 5) << greedy.output;
  // "Dan" is the bytes 68 97 110 to the byte-level tokenizer (named, so that the same 257 ids
  // are sampled: without a tokenizer every row of the padded vocabulary may be).
  const RunResult by_ids =
      run_tessera(base + "--prompt_ids '68 97 110' --ignore_eos --tokenizer ByteLevel");
  ASSERT_EQ(by_ids.exit_code, 0) << by_ids.output;
  EXPECT_EQ(ids_line(by_ids.output), ids);

  const std::string sampled =
      base + "--prompt 'Dan' --ignore_eos --temperature 1.5 --top_k 50 --seed 9";
  const RunResult a = run_tessera(sampled), b = run_tessera(sampled);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(ids_line(a.output), ids_line(b.output)) << "the same seed samples the same tokens";

  for (const std::string& bad :
       {"generate --device cpu --from " + (dir / "nothing").string() + " --prompt x",
        base + "--prompt x --prompt_ids '1 2'", base + "--prompt x --top_p 0",
        base + "--prompt x --device tpu", base + "--prompt_ids '1 x'",
        base + "--load " + save + " --prompt x"}) {
    const RunResult r = run_tessera(bad);
    EXPECT_EQ(r.exit_code, 2) << bad << "\n" << r.output;
  }
}

TEST(GenerateCli, SamplesTogetherStopStringsAndAPromptsFile) {
  ScratchDir dir;
  const std::string save = (dir / "ckpt").string();
  ASSERT_NO_FATAL_FAILURE(train_byte_level_checkpoint(dir, save));
  const std::string base =
      "generate --device cpu --from " + save + " --max_new_tokens 8 --ignore_eos ";
  const auto ids_of = [](const std::string& output, const std::string& name) {
    std::smatch m;
    const std::regex line(name + ": ([0-9 ]*)");
    return std::regex_search(output, m, line) ? m[1].str() : "";
  };

  // Three samples decoded together: each is the sample its stream gives alone (stream 1 is
  // the first, which a single sample draws from), and they differ.
  const std::string sampled = base + "--prompt 'Dan' --temperature 1.5 --seed 4 ";
  const RunResult three = run_tessera(sampled + "--num_samples 3");
  ASSERT_EQ(three.exit_code, 0) << three.output;
  EXPECT_TRUE(contains(three.output, "--- sample 3 (length, 8 tokens)")) << three.output;
  const RunResult one = run_tessera(sampled);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(ids_of(three.output, "ids\\[1\\]"), ids_line(one.output));
  EXPECT_NE(ids_of(three.output, "ids\\[1\\]"), ids_of(three.output, "ids\\[2\\]"));
  // Greedy samples are all the greedy continuation; on the host's top-k path as well.
  const RunResult greedy = run_tessera(base + "--prompt 'Dan'");
  const RunResult greedy3 = run_tessera(base + "--prompt 'Dan' --num_samples 3 --top_k 5");
  ASSERT_EQ(greedy3.exit_code, 0) << greedy3.output;
  for (const char* i : {"ids\\[1\\]", "ids\\[2\\]", "ids\\[3\\]"})
    EXPECT_EQ(ids_of(greedy3.output, i), ids_line(greedy.output)) << i;

  // A stop string made of the greedy continuation's 3rd and 4th bytes ends it after the first
  // token whose text completes it (the byte-level tokenizer: one byte per token).
  std::istringstream greedy_ids(ids_line(greedy.output));
  std::vector<int> bytes;
  for (int id; greedy_ids >> id;) bytes.push_back(id);
  ASSERT_EQ(bytes.size(), 8u);
  bool printable = true;
  for (int i : {2, 3})
    printable = printable && bytes[i] >= 33 && bytes[i] < 127 && bytes[i] != '\'' &&
                bytes[i] != '"' && bytes[i] != '\\';
  if (printable) {
    const std::string stop{static_cast<char>(bytes[2]), static_cast<char>(bytes[3])};
    const RunResult stopped = run_tessera(base + "--prompt 'Dan' --stop '" + stop + "'");
    ASSERT_EQ(stopped.exit_code, 0) << stopped.output;
    std::string text, expected;
    for (int b : bytes) {
      text += static_cast<char>(b);
      expected += (expected.empty() ? "" : " ") + std::to_string(b);
      if (text.find(stop) != std::string::npos) break;
    }
    EXPECT_EQ(ids_line(stopped.output), expected) << stop;
  }

  // A prompts file: each prompt's continuations as decoding it alone gives them.
  {
    std::ofstream out(dir / "prompts.jsonl");
    out << R"({"prompt": "Dan"})"
        << "\n"
        << R"({"question": "Why?"})"
        << "\n";
  }
  const std::string written = (dir / "out" / "completions.jsonl").string();
  const RunResult file = run_tessera(base + "--prompts " + (dir / "prompts.jsonl").string() +
                                     " --num_samples 2 -o " + written);
  ASSERT_EQ(file.exit_code, 0) << file.output;
  EXPECT_TRUE(contains(file.output, "2 prompts of up to")) << file.output;
  std::ifstream in(written);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["line"], 1);
  EXPECT_EQ(lines[1]["prompt"], "Why?");
  ASSERT_EQ(lines[0]["completions"].size(), 2u);
  for (const auto& c : lines[0]["completions"]) {
    EXPECT_EQ(c["finish_reason"], "length");
    EXPECT_EQ(c["ids"].size(), 8u);
  }
  std::string first;
  for (const auto& id : lines[0]["completions"][0]["ids"])
    first += (first.empty() ? "" : " ") + std::to_string(id.get<int>());
  const RunResult alone = run_tessera(base + "--prompt_ids '68 97 110' --tokenizer ByteLevel");
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  EXPECT_EQ(first, ids_line(alone.output))
      << "greedy: the prompt file's first prompt continues as alone";

  // Each id's log-probability under the model, the same from the device's draw (temperature
  // and min-p) and from the host's (top-k).
  const RunResult host =
      run_tessera(base + "--prompts " + (dir / "prompts.jsonl").string() + " --top_k 1000");
  ASSERT_EQ(host.exit_code, 0) << host.output;
  const nlohmann::json host_first =
      nlohmann::json::parse(host.output.substr(0, host.output.find('\n')));
  const auto& device_logps = lines[0]["completions"][0]["logprobs"];
  const auto& host_logps = host_first["completions"][0]["logprobs"];
  ASSERT_EQ(device_logps.size(), 8u);
  ASSERT_EQ(host_logps.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_LE(device_logps[i].get<double>(), 0.0);
    EXPECT_NEAR(device_logps[i].get<double>(), host_logps[i].get<double>(), 1e-5) << i;
  }

  // A bad line is named and nothing is written.
  {
    std::ofstream out(dir / "bad.jsonl");
    out << R"({"prompt": "Dan"})"
        << "\n"
        << R"({"text": "no prompt"})"
        << "\n";
  }
  const std::string never = (dir / "never.jsonl").string();
  const RunResult bad =
      run_tessera(base + "--prompts " + (dir / "bad.jsonl").string() + " -o " + never);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_TRUE(contains(bad.output, "bad.jsonl:2")) << bad.output;
  EXPECT_FALSE(std::filesystem::exists(never));
  for (const std::string& wrong :
       {base + "--prompt x --stop '[\"\"]'", base + "--prompt x -o " + never,
        base + "--prompt x --num_samples 0", base + "--prompts x --chat"}) {
    const RunResult r = run_tessera(wrong);
    EXPECT_EQ(r.exit_code, 2) << wrong << "\n" << r.output;
  }
}

// Multi-latent attention decodes its samples together, each from its stream, as the other
// families do: the first is what one sample gives.
TEST(GenerateCli, MultiLatentAttentionSamplesTogether) {
  ScratchDir dir;
  const std::string save = (dir / "ckpt").string();
  const RunResult trained = run_tessera(
      "train --device cpu --model tiny_mla --mock_data true --tokenizer_type ByteLevel "
      "--vocab_size 320 "
      "--seq_length 32 --micro_batch_size 2 --global_batch_size 2 --train_iters 2 "
      "--lr_warmup_iters 1 "
      "--eval_interval 0 --log_progress false --workspace " +
      dir.path().string() + " --save " + save);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const std::string base =
      "generate --device cpu --from " + save + " --max_new_tokens 5 --ignore_eos --prompt 'Dan' ";
  const RunResult one = run_tessera(base + "--temperature 1 --seed 3");
  const RunResult three = run_tessera(base + "--temperature 1 --seed 3 --num_samples 3");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  ASSERT_EQ(three.exit_code, 0) << three.output;
  std::smatch m;
  const std::string text = three.output;
  ASSERT_TRUE(std::regex_search(text, m, std::regex("ids\\[1\\]: ([0-9 ]*)"))) << three.output;
  EXPECT_EQ(m[1].str(), ids_line(one.output));
  EXPECT_TRUE(contains(three.output, "--- sample 3")) << three.output;
  EXPECT_TRUE(contains(three.output, "3 sequences decoded at once at most")) << three.output;
}

}  // namespace
}  // namespace tessera::testing
