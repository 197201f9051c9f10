// Stop strings: a completion is stopped after the token that completes one, wherever the
// string falls across tokens, and only by text the completion itself holds.
#include "tessera/data/stop_strings.h"

#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tessera/config/config.h"
#include "tessera/config/validate.h"
#include "tessera/data/tokenizer.h"

namespace tessera {
namespace {

std::unique_ptr<Tokenizer> qwen3() {
  DataConfig data;
  data.tokenizer_type = TokenizerType::HuggingFace;
  data.tokenizer_model = "qwen3";
  return make_tokenizer(data);
}

TEST(StopStrings, StopAtTheTokenThatCompletesOneAcrossTokens) {
  const auto tok = qwen3();
  std::vector<int32_t> ids;
  tok->encode("The answer is 42.\n\nThat is all, my friend.", &ids);
  ASSERT_GT(ids.size(), 8u);
  const StopStrings stops(*tok, {"\n\n", "friend"});
  // The first prefix whose text holds a stop string ends with "\n\n".
  size_t first = 0;
  for (size_t n = 1; n <= ids.size() && first == 0; ++n)
    if (stops.stopped(std::span(ids).first(n))) first = n;
  ASSERT_GT(first, 0u);
  const std::string text = tok->decode(std::vector<int32_t>(ids.begin(), ids.begin() + first));
  EXPECT_NE(text.find("\n\n"), std::string::npos) << text;
  EXPECT_EQ(tok->decode(std::vector<int32_t>(ids.begin(), ids.begin() + first - 1)).find("\n\n"),
            std::string::npos);
  // A string split over several tokens stops at the last of them.
  const StopStrings split(*tok, {"answer is 4"});
  size_t at = 0;
  for (size_t n = 1; n <= ids.size() && at == 0; ++n)
    if (split.stopped(std::span(ids).first(n))) at = n;
  EXPECT_NE(tok->decode(std::vector<int32_t>(ids.begin(), ids.begin() + at)).find("answer is 4"),
            std::string::npos);
  // Long completions: only the tail is decoded, and still found.
  std::vector<int32_t> longer;
  tok->encode(std::string(3000, 'a') + " and then friend", &longer);
  EXPECT_TRUE(stops.stopped(longer));
  longer.resize(longer.size() - 1);
  EXPECT_FALSE(stops.stopped(longer));
  EXPECT_FALSE(StopStrings().stopped(ids));
  EXPECT_THROW(StopStrings(*tok, {""}), std::invalid_argument);
}

TEST(StopStrings, ValuesAreOneStringOrAList) {
  EXPECT_TRUE(parse_stop_strings("").empty());
  EXPECT_EQ(parse_stop_strings("</answer>"), std::vector<std::string>{"</answer>"});
  EXPECT_EQ(parse_stop_strings(R"(["\n\n", "</answer>", '###'])"),
            (std::vector<std::string>{"\n\n", "</answer>", "###"}));
  EXPECT_THROW(parse_stop_strings(R"(["a", ""])"), std::invalid_argument);
  EXPECT_THROW(parse_stop_strings(R"([["a"]])"), std::invalid_argument);
  EXPECT_THROW(parse_stop_strings(R"(["a")"), std::invalid_argument);
}

}  // namespace
}  // namespace tessera
