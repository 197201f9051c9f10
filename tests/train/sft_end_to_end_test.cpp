// Supervised fine-tuning end to end on the CPU, as a user runs it: pretrain a tiny model on the
// Brown corpus (the default experiment), render a synthetic instruction task with Llama 3's
// chat template (preprocess --chat), fine-tune the pretrained weights on it (finetune, whole
// conversations packed bfd with positions and attention per conversation, loss on the
// assistant's tokens), then ask the model about sentences it never saw (generate --chat). The
// task: say whether a sentence's topic is sports or music, from its keyword. Held-out
// sentences use other wordings than the training ones.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/run_command.h"
#include "common/scratch_dir.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

const std::vector<std::string> kSports = {"football", "tennis", "soccer", "baseball", "golf",
                                          "hockey",   "rugby",  "cricket", "boxing",  "swimming"};
const std::vector<std::string> kMusic = {"piano", "guitar", "violin",  "drums",  "singing",
                                         "opera", "jazz",   "concert", "melody", "orchestra"};

std::string fill(std::string pattern, const std::string& word) {
  return pattern.replace(pattern.find("{}"), 2, word);
}

std::string question(const std::string& sentence) {
  return "Topic of: " + sentence + " Answer sports or music.";
}

// The share of held-out questions the checkpoint answers exactly, greedily; *answers gets
// what it said.
double accuracy(const fs::path& checkpoint, std::string* answers) {
  const std::vector<std::string> held_out = {"Yesterday the topic was {}.",
                                             "She has loved {} since childhood."};
  int right = 0, asked = 0;
  for (const std::string& pattern : held_out)
    for (size_t w = 0; w < 5; ++w)
      for (const auto& [words, label] : {std::pair{&kSports, "sports"}, std::pair{&kMusic, "music"}}) {
        const std::string prompt = question(fill(pattern, (*words)[w * 2]));
        const RunResult r = run_command(std::string(TESSERA_BINARY) + " generate --from " +
                                        checkpoint.string() + " --chat --prompt '" + prompt +
                                        "' --max_new_tokens 3 --device cpu");
        EXPECT_EQ(r.exit_code, 0) << r.output;
        // The reply is the first line (stdout, flushed before the numbers on stderr).
        const std::string reply = r.output.substr(0, r.output.find('\n'));
        right += reply == label;
        *answers += std::string(label) + ": " + reply + "\n";
        ++asked;
      }
  return static_cast<double>(right) / asked;
}

TEST(SftEndToEnd, FineTuningTeachesAHeldOutInstructionTask) {
  ScratchDir dir;
  const std::vector<std::string> patterns = {
      "I really enjoy {} on weekends.",     "My friend talked about {} all day.",
      "We watched {} last night.",          "Nothing beats {} in the summer.",
      "He wrote a long letter about {}.",   "They spent the evening on {}."};
  {
    std::ofstream out(dir / "train.jsonl");
    for (int repeat = 0; repeat < 4; ++repeat)
      for (const std::string& pattern : patterns)
        for (const auto& [words, label] : {std::pair{&kSports, "sports"}, std::pair{&kMusic, "music"}})
          for (const std::string& word : *words)
            out << nlohmann::json{{"messages",
                                   {{{"role", "user"}, {"content", question(fill(pattern, word))}},
                                    {{"role", "assistant"}, {"content", label}}}}}
                       .dump()
                << "\n";
  }
  const std::string bin = TESSERA_BINARY, ws = " --workspace " + (dir / "ws").string();
  RunResult r = run_command(bin + " preprocess --chat --input " + (dir / "train.jsonl").string() +
                            " --output-prefix " + (dir / "task").string() + " --tokenizer-model llama3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 1. A short pretraining on Brown (the default experiment's model, data and tokenizer).
  r = run_command(bin + " train --config default --train_iters 20 --lr_warmup_iters 5 "
                        "--eval_interval 0 --log_progress false --save " +
                  (dir / "pretrained").string() + ws + " --exp_name pretrain");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 2. Fine-tuning its weights on the task.
  r = run_command(bin + " train --config default --finetune --load " + (dir / "pretrained").string() +
                  " --save " + (dir / "tuned").string() + " --data_path " +
                  (dir / "task_chat_document").string() +
                  " --split 100,0,0 --seq_length 64 --micro_batch_size 8 --global_batch_size 8 "
                  "--train_iters 120 --lr 2e-3 --min_lr 2e-4 --lr_warmup_iters 10 "
                  "--eval_interval 0 --log_interval 20 --log_progress false --packing_strategy bfd "
                  "--reset_position_ids --reset_attention_mask" + ws + " --exp_name sft");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("finetune: the weights of"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(packing efficiency)"), std::string::npos) << r.output;
  // 3. Held-out accuracy rises from none to nearly all (measured on 2 CPU cores: 0 of 20
  // before, 20 of 20 after).
  std::string said_before, said_after;
  const double before = accuracy(dir / "pretrained", &said_before);
  const double after = accuracy(dir / "tuned", &said_after);
  std::printf("held-out accuracy: %.2f before fine-tuning, %.2f after\n", before, after);
  EXPECT_LE(before, 0.1) << said_before;
  EXPECT_GE(after, 0.75) << said_after;
  EXPECT_GE(after - before, 0.65);
}

}  // namespace
}  // namespace tessera::testing
