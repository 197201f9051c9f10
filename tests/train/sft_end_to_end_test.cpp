// Supervised fine-tuning end to end on the CPU, as configs/experiments/sft_tiny.yaml says to
// run it: pretrain the default experiment's tiny model on the Brown corpus, write the synthetic
// instruction task (scripts/data/sft_topic_task.py) and render it with Llama 3's chat template
// (preprocess --chat), fine-tune the pretrained weights with sft_tiny (finetune, whole
// conversations packed bfd with positions and attention per conversation, loss on the
// assistant's tokens), then ask the held-out questions, whose wordings training never showed
// (generate --chat); then prefer another answer style with DPO (dpo_tiny).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/run_command.h"
#include "common/scratch_dir.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

// The checkpoint's greedy replies to the held-out questions ({"prompt", "answer"} lines), with
// the expected answers; *said gets both, a line each. One `generate --prompts` decodes them
// all together, each question as a user's message in the chat template (as --chat renders it).
std::vector<std::pair<std::string, std::string>> replies(const fs::path& checkpoint, const fs::path& held_out,
                                                         int max_new_tokens, std::string* said) {
  const fs::path questions = checkpoint.string() + "_questions.jsonl", out_path = checkpoint.string() + "_replies.jsonl";
  std::vector<std::string> answers;
  {
    std::ifstream in(held_out);
    std::ofstream q(questions);
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      answers.push_back(j["answer"].get<std::string>());
      q << nlohmann::json{{"prompt", nlohmann::json::array({{{"role", "user"}, {"content", j["prompt"]}}})}}.dump()
        << "\n";
    }
  }
  const RunResult r = run_command(std::string(TESSERA_BINARY) + " generate --from " + checkpoint.string() +
                                  " --prompts " + questions.string() + " -o " + out_path.string() +
                                  " --max_new_tokens " + std::to_string(max_new_tokens) + " --device cpu");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::pair<std::string, std::string>> out;
  std::ifstream in(out_path);
  for (std::string line; std::getline(in, line) && out.size() < answers.size();) {
    const std::string text = nlohmann::json::parse(line)["completions"][0]["text"].get<std::string>();
    out.emplace_back(answers[out.size()], text.substr(0, text.find('\n')));  // the reply's first line
    *said += out.back().first + ": " + out.back().second + "\n";
  }
  EXPECT_EQ(out.size(), 20u);
  return out;
}

// The share of held-out questions the checkpoint answers exactly, greedily, in at most
// max_new_tokens tokens.
double accuracy(const fs::path& checkpoint, const fs::path& held_out, std::string* said, int max_new_tokens = 3) {
  const auto r = replies(checkpoint, held_out, max_new_tokens, said);
  return static_cast<double>(std::count_if(r.begin(), r.end(), [](const auto& x) { return x.first == x.second; })) /
         static_cast<double>(std::max<size_t>(r.size(), 1));
}

TEST(SftEndToEnd, FineTuningTeachesAHeldOutInstructionTask) {
  ScratchDir dir;
  const std::string bin = TESSERA_BINARY, ws = " --workspace " + (dir / "ws").string();
  const fs::path topic = dir / "topic";
  RunResult r = run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_TESTS_DIR +
                            "/../scripts/data/sft_topic_task.py --sentences " + topic.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_command(bin + " preprocess --chat --input " + topic.string() + "_train.jsonl" +
                  " --output-prefix " + topic.string() + " --tokenizer-model llama3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 1. A short pretraining on Brown (the default experiment), as sft_tiny.yaml's first command.
  r = run_command(bin + " train --train_iters 20 --lr_warmup_iters 5 --eval_interval 0 "
                        "--log_progress false --save " +
                  (dir / "pretrained").string() + ws + " --exp_name pretrain");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 2. Fine-tuning its weights on the task, as the shipped experiment says.
  r = run_command(bin + " train --config sft_tiny --load " + (dir / "pretrained").string() +
                  " --save " + (dir / "tuned").string() + " --data_path " + topic.string() +
                  "_chat_document --log_progress false" + ws);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("finetune: the weights of"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(packing efficiency)"), std::string::npos) << r.output;
  // 3. Held-out accuracy rises from none to nearly all (measured on 2 CPU cores: 0 of 20
  // before, 20 of 20 after).
  std::string said_before, said_after;
  const fs::path held_out = topic.string() + "_held_out.jsonl";
  const double before = accuracy(dir / "pretrained", held_out, &said_before);
  const double after = accuracy(dir / "tuned", held_out, &said_after);
  std::printf("held-out accuracy: %.2f before fine-tuning, %.2f after\n", before, after);
  EXPECT_LE(before, 0.1) << said_before;
  EXPECT_GE(after, 0.75) << said_after;
  EXPECT_GE(after - before, 0.65);

  // 4. DPO from the fine-tuned weights, as dpo_tiny.yaml says: pairs of the same task prefer
  // the sentence "sports, I am sure." (a quarter of the fine-tuning answers) to the bare
  // "sports" (the rest, and the fine-tuned model's greedy choice) or to the sentence with the
  // wrong topic. On the 20 held-out pairs (wordings training never showed) the policy moves the
  // chosen answers' log-probabilities above the rejected ones' against the reference, and its
  // greedy replies become the chosen sentences with the right topic.
  r = run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_TESTS_DIR +
                  "/../scripts/data/sft_topic_task.py --preference " + topic.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_command(bin + " preprocess --preference --input " + topic.string() + "_pairs.jsonl" +
                  " --output-prefix " + topic.string() + "_pairs --tokenizer-model llama3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Measured on 2 CPU cores over DPO seeds 1-6 and two fine-tuning seeds, with the pairs as two
  // sequences and with the prompt once: held-out rewards/accuracies 1.0 and 20 of 20 sentence
  // replies right every time.
  r = run_command(bin + " train --config dpo_tiny --load " + (dir / "tuned").string() + " --save " +
                  (dir / "preferred").string() + " --data_path " + topic.string() +
                  "_pairs_preference_document --log_progress false" + ws);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  double held_out_accuracy = -1;
  for (const auto& entry : fs::recursive_directory_iterator(dir / "ws"))
    if (entry.path().filename() == "metrics.jsonl" && entry.path().string().find("dpo_tiny") != std::string::npos) {
      std::ifstream in(entry.path());
      for (std::string line; std::getline(in, line);) {
        const auto j = nlohmann::json::parse(line);
        if (j.contains("eval_rewards/accuracies")) held_out_accuracy = j["eval_rewards/accuracies"];
      }
    }
  std::string said_tuned, said_preferred;
  const fs::path sentence_questions = topic.string() + "_pairs_held_out.jsonl";
  const double chosen_before = accuracy(dir / "tuned", sentence_questions, &said_tuned, 8);
  const double chosen_after = accuracy(dir / "preferred", sentence_questions, &said_preferred, 8);
  std::printf("DPO: held-out rewards/accuracies %.2f; replies the chosen sentence %.2f before, %.2f after\n",
              held_out_accuracy, chosen_before, chosen_after);
  EXPECT_GT(held_out_accuracy, 0.9) << r.output;
  EXPECT_EQ(chosen_before, 0.0) << said_tuned;
  EXPECT_GE(chosen_after, 0.9) << said_preferred;
}


// LoRA as configs/experiments/sft_lora_tiny.yaml runs it: a model fine-tuned on the task with
// its labels swapped answers the held-out questions wrong; rank-8 adapters on its frozen
// weights, trained on the true labels, make it answer them right. The checkpoints hold the
// adapters alone (and in peft's format), and generate merges them into the base.
TEST(SftEndToEnd, LoraCorrectsAFrozenModel) {
  ScratchDir dir;
  const std::string bin = TESSERA_BINARY, python = TESSERA_PYTHON, ws = " --workspace " + (dir / "ws").string();
  const std::string script = std::string(TESSERA_TESTS_DIR) + "/../scripts/data/sft_topic_task.py ";
  const fs::path topic = dir / "topic", swapped = dir / "swapped";
  for (const auto& [args, prefix] : {std::pair{std::string(), topic}, std::pair{std::string("--swapped "), swapped}}) {
    RunResult r = run_command(python + " " + script + args + prefix.string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = run_command(bin + " preprocess --chat --input " + prefix.string() + "_train.jsonl" +
                    " --output-prefix " + prefix.string() + " --tokenizer-model llama3");
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  // The pretraining the experiment's comment runs (the default experiment, 20 iterations).
  RunResult r = run_command(bin + " train --train_iters 20 --eval_interval 0 --log_progress false --save " +
                            (dir / "pretrained").string() + ws + " --exp_name pretrain");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_command(bin + " train --config sft_tiny --load " + (dir / "pretrained").string() + " --save " +
                  (dir / "swapped_model").string() + " --data_path " + swapped.string() +
                  "_chat_document --log_progress false" + ws);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_command(bin + " train --config sft_lora_tiny --pretrained_checkpoint " + (dir / "swapped_model").string() +
                  " --save " + (dir / "lora").string() + " --data_path " + topic.string() +
                  "_chat_document --log_progress false" + ws);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("LoRA: rank 8, alpha 16 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
            std::string::npos)
      << r.output;
  // Measured on 2 CPU cores: 0 of 20 before, 20 of 20 after.
  std::string said_before, said_after;
  const fs::path held_out = topic.string() + "_held_out.jsonl";
  const double before = accuracy(dir / "swapped_model", held_out, &said_before);
  const double after = accuracy(dir / "lora", held_out, &said_after);
  std::printf("held-out accuracy: %.2f frozen, %.2f with LoRA\n", before, after);
  EXPECT_LE(before, 0.1) << said_before;
  EXPECT_GE(after, 0.75) << said_after;
  // The checkpoint holds the adapters alone: two per adapted projection piece (4 layers x 7).
  const fs::path last = dir / "lora" / "iter_0000060";
  const nlohmann::json state = nlohmann::json::parse(std::ifstream(last / "trainer_state.json"));
  EXPECT_EQ(state["lora"]["rank"], 8);
  std::ifstream model(last / "model.safetensors", std::ios::binary);
  uint64_t header_bytes = 0;
  model.read(reinterpret_cast<char*>(&header_bytes), 8);
  std::string header(header_bytes, '\0');
  model.read(header.data(), static_cast<std::streamsize>(header_bytes));
  const nlohmann::json tensors = nlohmann::json::parse(header);
  EXPECT_EQ(tensors.size(), 2u * 4 * 7 + (tensors.contains("__metadata__") ? 1 : 0));
  EXPECT_TRUE(tensors.contains("model.layers.0.self_attn.q_proj.lora_A.weight")) << header;
  EXPECT_TRUE(fs::exists(last / "adapter_config.json"));
  EXPECT_TRUE(fs::exists(last / "adapter_model.safetensors"));
}

}  // namespace
}  // namespace tessera::testing
