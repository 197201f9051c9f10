// GRPO's prompts file (train/grpo_prompts.h), as a run reads train_data_path: the input is the
// file, read with a byte-level tokenizer (no chat template) for prompts of at most 64 tokens,
// with and without the answers the answer reward needs; its first line is also read as
// grpo_rewards' terms. Each must refuse (DataError, std::invalid_argument) or finish.
#include <stdexcept>

#include "fuzz/fuzz_support.h"
#include "tessera/config/validate.h"
#include "tessera/data/tokenizer.h"
#include "tessera/train/grpo_prompts.h"

using namespace tessera;
using namespace tessera::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(as_text(data, size));
  const fs::path file = scratch_dir() / "prompts.jsonl";
  write_file(file, text);
  static const ByteTokenizer tokenizer;
  for (const bool need_answer : {false, true})
    refusal_or_success([&] { read_grpo_prompts(file.string(), tokenizer, nullptr, need_answer, 64); });
  try {
    grpo_reward_terms(text.substr(0, text.find('\n')));
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
