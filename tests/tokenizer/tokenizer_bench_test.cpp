// `tessera bench tokenizer` end to end: a table with Tessera's rows and the reference's, the
// ids checked equal, CSV and markdown written; bad names and paths rejected with exit 2.
#include "common/run_command.h"
#include "tokenizer/tokenizer_test_util.h"

namespace tessera::testing {
namespace {

TEST(TokenizerBench, TimesTesseraAndTheReferenceOnTheSameIds) {
  const ScratchDir dir;
  write_file(dir / "a.txt", "The Fulton County Grand Jury said Friday 1,234 things.\n");
  write_file(dir / "b.txt", "  Unicode: caf\xC3\xA9, \xE4\xB8\xAD\xE6\x96\x87, emoji \xF0\x9F\x98\x80!\n");
  const RunResult r = run_tessera("bench tokenizer --tokenizer_model llama3 --data " +
                                  dir.path().string() + " --repeat 1 --threads 2 -o " +
                                  (dir / "out").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;  // 0 only when every id agrees with the reference
  EXPECT_NE(r.output.find("| llama3 | tessera | 1 |"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("| llama3 | tessera | 2 |"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("| llama3 | @huggingface/tokenizers | 1 |"), std::string::npos)
      << r.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "tokenizer_throughput.csv"));
  EXPECT_TRUE(fs::exists(dir / "out" / "tokenizer_bench.md"));
}

TEST(TokenizerBench, BadNamesAndPathsAreInvalidInput) {
  const ScratchDir dir;
  write_file(dir / "a.txt", "text\n");
  RunResult r = run_tessera("bench tokenizer --tokenizer_model llama9 --no_reference --data " +
                            dir.path().string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("llama9"), std::string::npos) << r.output;
  r = run_tessera("bench tokenizer --no_reference --data " + (dir / "missing").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("missing"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace tessera::testing
