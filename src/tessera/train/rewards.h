#pragma once
// Verifiable rewards for reinforcement learning (GRPO): a completion's answer checked against
// the expected one, its format against a pattern, DAPO's shaping of over-long completions, and
// any outside verifier as a command. Each reward is a number per completion; a run weighs and
// adds them.
#include <cstdint>
#include <optional>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/config/config.h"

namespace tessera {

// The answer a completion gives, or nullopt when it gives none in that format.
std::optional<std::string> extract_answer(std::string_view completion, AnswerFormat format,
                                          const std::regex* pattern = nullptr);

// Short answers compared as graders of math answers compare them: spaces around and a final
// period dropped, "$" and thousands separators dropped from numbers, and numbers equal by value
// ("3.0" is "3", "1,000" is "1000"); other text must be equal.
bool answers_match(std::string_view given, std::string_view expected);

// DAPO's over-long reward shaping for a completion of `length` tokens: 0 up to
// max_length - cache, then falling linearly to -1 at max_length, and -1 beyond.
double overlong_penalty(int64_t length, int64_t max_length, int64_t cache);

struct RewardQuery {
  std::string prompt, completion, answer;  // answer: the dataset's, may be empty
};

// An outside verifier: `command` runs under /bin/sh, reads one JSON object per line on its
// standard input ({"prompt", "completion", "answer"}, in order) and writes one reward per line,
// a finite number, on its standard output. A crash (a signal or a non-zero exit), a line that
// is not a finite number, a wrong count of lines, or no end within `timeout_seconds` (the
// command and its children are then killed) is an Error naming the command and what it did,
// with the end of its standard error: never a silent reward of zero.
std::vector<double> command_rewards(const std::string& command, const std::vector<RewardQuery>& queries,
                                    double timeout_seconds);

}  // namespace tessera
