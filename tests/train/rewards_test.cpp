// Verifiable rewards: answers extracted as math and GSM8K completions write them, compared by
// value, DAPO's over-long shaping, and an outside verifier command whose every failure is a
// clear error rather than a silent zero.
#include <gtest/gtest.h>

#include "tessera/core/error.h"
#include "tessera/train/rewards.h"

namespace tessera::testing {
namespace {

TEST(Rewards, AnswersAreExtractedAndComparedAsGradersDo) {
  EXPECT_EQ(extract_answer("so x = \\boxed{3} and then \\boxed{\\frac{1}{2}}.", AnswerFormat::Boxed), "\\frac{1}{2}");
  EXPECT_EQ(extract_answer("\\boxed{ {a}+{b} }", AnswerFormat::Boxed), "{a}+{b}");
  EXPECT_EQ(extract_answer("\\boxed{unclosed", AnswerFormat::Boxed), std::nullopt);
  EXPECT_EQ(extract_answer("no answer here", AnswerFormat::Boxed), std::nullopt);
  EXPECT_EQ(extract_answer("48 / 2 = 24\n#### 1,024\nThanks", AnswerFormat::Hash), "1,024");
  EXPECT_EQ(extract_answer("#### 5 #### 7", AnswerFormat::Hash), "7");
  const std::regex answer_tag("<answer>(.*?)</answer>");
  EXPECT_EQ(extract_answer("<think>hm</think><answer> 42 </answer>", AnswerFormat::Regex, &answer_tag), "42");
  const std::regex word("sports|music");
  EXPECT_EQ(extract_answer("The topic is music.", AnswerFormat::Regex, &word), "music");
  EXPECT_THROW(extract_answer("x", AnswerFormat::Regex), Error);

  EXPECT_TRUE(answers_match("1,024", "1024"));
  EXPECT_TRUE(answers_match(" 3.0 ", "3"));
  EXPECT_TRUE(answers_match("$18", "18."));
  EXPECT_TRUE(answers_match("\\frac{1}{2}", "\\frac{1}{2}"));
  EXPECT_FALSE(answers_match("18", "19"));
  EXPECT_FALSE(answers_match("1/2", "0.5"));  // not evaluated: text other than numbers must be equal
  EXPECT_FALSE(answers_match("", "0"));
}

TEST(Rewards, OverlongShapingFollowsDapo) {
  // Max 100 tokens with a cache of 20: no penalty to 80, then linear to -1 at 100.
  EXPECT_EQ(overlong_penalty(50, 100, 20), 0.0);
  EXPECT_EQ(overlong_penalty(80, 100, 20), 0.0);
  EXPECT_DOUBLE_EQ(overlong_penalty(90, 100, 20), -0.5);
  EXPECT_DOUBLE_EQ(overlong_penalty(100, 100, 20), -1.0);
  EXPECT_EQ(overlong_penalty(101, 100, 20), -1.0);
  EXPECT_THROW(overlong_penalty(1, 10, 20), Error);
}

TEST(Rewards, CommandVerifierAnswersOrFailsClearly) {
  const std::vector<RewardQuery> queries = {{"2+2?", "4", "4"}, {"3+3?", "7", "6"}, {"1+1?", "2", "2"}};
  // A verifier in Python: 1 when the completion is the answer.
  const std::string python = std::string(TESSERA_PYTHON) +
                             " -c 'import json,sys\nfor l in sys.stdin:\n q=json.loads(l); print(float(q[\"completion\"]==q[\"answer\"]))'";
  EXPECT_EQ(command_rewards(python, queries, 30), (std::vector<double>{1, 0, 1}));
  auto error_of = [&](const std::string& command, double timeout = 30) {
    try {
      command_rewards(command, queries, timeout);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of("echo broken >&2; exit 3").find("exited with code 3; its standard error ends:\nbroken"),
            std::string::npos);
  EXPECT_NE(error_of("kill -9 $$").find("was killed by signal 9"), std::string::npos);
  EXPECT_NE(error_of("printf '1\\nyes\\n0\\n'").find("line 2 of its output is 'yes'; expected a finite number"),
            std::string::npos);
  EXPECT_NE(error_of("printf '1\\nnan\\n0\\n'").find("line 2 of its output is 'nan'"), std::string::npos);
  EXPECT_NE(error_of("printf '1\\n0\\n'").find("wrote 2 rewards for 3 completions"), std::string::npos);
  EXPECT_NE(error_of("sleep 30", 0.5).find("did not finish within 0.5 s (killed)"), std::string::npos);
  // One that exits without reading its input still answers for itself.
  EXPECT_EQ(command_rewards("printf '0.5\\n0.25\\n1\\n'", queries, 30), (std::vector<double>{0.5, 0.25, 1}));
}

}  // namespace
}  // namespace tessera::testing
