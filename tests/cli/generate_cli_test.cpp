// tessera generate through the real binary: a checkpoint trained with the byte-level
// tokenizer continues a text prompt greedily (the same ids every time, and the ids the prompt
// given as ids produces), sampling is reproducible for a seed, and bad arguments exit 2.
#include <gtest/gtest.h>

#include <algorithm>
#include <regex>
#include <string>

#include "common/run_command.h"
#include "common/scratch_dir.h"

namespace tessera::testing {
namespace {

std::string ids_line(const std::string& output) {
  std::smatch m;
  static const std::regex kIds("ids: ([0-9 ]*)");
  return std::regex_search(output, m, kIds) ? m[1].str() : "";
}

TEST(GenerateCli, ContinuesAPromptFromACheckpoint) {
  ScratchDir dir;
  const std::string save = (dir / "ckpt").string();
  const RunResult trained = run_tessera(
      "train --device cpu --model tiny_llama --mock_data true --tokenizer_type ByteLevel "
      "--vocab_size 320 --seq_length 32 --micro_batch_size 2 --global_batch_size 2 "
      "--train_iters 3 --lr_warmup_iters 1 --eval_interval 0 --log_progress false --workspace " +
      dir.path().string() + " --save " + save);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;

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

}  // namespace
}  // namespace tessera::testing
