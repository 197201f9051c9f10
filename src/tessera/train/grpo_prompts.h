#pragma once
// GRPO's prompts: a JSON-lines file, one prompt per line with the answer its completions are
// checked against.
//   prompt    a string (plain text, BOS first, as TRL tokenizes a standard prompt) or a list
//             of {role, content} messages (rendered with the tokenizer's chat template, the
//             assistant's turn opened);
//   question  GSM8K's name: a string taken as the user's message (through the chat template
//             when the tokenizer has one, else plain text);
//   answer    a string; GSM8K's worked answers end with "#### <answer>", and only what follows
//             the last "####" is kept. May be absent when no reward needs it.
#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

class ChatFormat;
class Tokenizer;

struct GrpoPrompt {
  std::vector<int32_t> ids;
  std::string text;    // the prompt as the reward command reads it
  std::string answer;  // empty: none given
  int64_t line = 0;    // in its file, from 1
};

// Every line's prompt; a DataError naming the file, line and field for a line that is not a
// JSON object, has neither prompt nor question, a prompt of the wrong type, an empty prompt,
// or (need_answer) no answer; and for a prompt of more than max_tokens tokens (the room
// seq_length leaves beside the completion). `chat`: the tokenizer's chat template, or null
// when it has none (then a message list is refused).
std::vector<GrpoPrompt> read_grpo_prompts(const std::string& path, const Tokenizer& tokenizer,
                                          const ChatFormat* chat, bool need_answer, int64_t max_tokens);

}  // namespace tessera
