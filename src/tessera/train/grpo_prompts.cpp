#include "tessera/train/grpo_prompts.h"

#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tessera/core/error.h"
#include "tessera/data/chat.h"
#include "tessera/data/tokenizer.h"

namespace tessera {
namespace {

std::string trimmed(const std::string& s) {
  const size_t first = s.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(" \t\r\n") - first + 1);
}

// GSM8K's answers are worked solutions ending in "#### 72": the answer is what follows.
std::string final_answer(const std::string& answer) {
  const size_t hash = answer.rfind("####");
  return trimmed(hash == std::string::npos ? answer : answer.substr(hash + 4));
}

}  // namespace

std::vector<GrpoPrompt> read_grpo_prompts(const std::string& path, const Tokenizer& tokenizer,
                                          const ChatFormat* chat, bool need_answer, int64_t max_tokens) {
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("{}: cannot be read (the GRPO prompts)", path));
  std::vector<GrpoPrompt> out;
  int64_t line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (trimmed(line).empty()) continue;
    const std::string where = fmt::format("{}:{}", path, line_no);
    nlohmann::ordered_json j;
    try {
      j = nlohmann::ordered_json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw DataError(fmt::format("{}: not JSON ({})", where, e.what()));
    }
    if (!j.is_object()) throw DataError(fmt::format("{}: expected a JSON object with a prompt", where));
    GrpoPrompt p;
    p.line = line_no;
    if (j.contains("prompt")) {
      const auto& prompt = j["prompt"];
      if (prompt.is_string()) {
        p.text = prompt.get<std::string>();
        if (p.text.empty()) throw DataError(fmt::format("{}: 'prompt' is empty", where));
        if (chat) {
          p.ids = chat->encode_text(p.text);
        } else {
          tokenizer.encode(p.text, &p.ids);
        }
      } else if (prompt.is_array()) {
        if (!chat)
          throw DataError(fmt::format("{}: 'prompt' is a list of messages, but the tokenizer ({}) has no chat "
                                      "template",
                                      where, tokenizer.name()));
        p.ids = chat->encode_prompt(prompt, where);
        for (const auto& m : prompt)
          if (m.is_object() && m.contains("content") && m["content"].is_string())
            p.text += (p.text.empty() ? "" : "\n") + m["content"].get<std::string>();
      } else {
        throw DataError(fmt::format("{}: 'prompt' is a JSON {}; expected a string or a list of messages", where,
                                    prompt.type_name()));
      }
    } else if (j.contains("question")) {
      const auto& q = j["question"];
      if (!q.is_string() || q.get<std::string>().empty())
        throw DataError(fmt::format("{}: 'question' must be a non-empty string", where));
      p.text = q.get<std::string>();
      if (chat) {
        p.ids = chat->encode_prompt(nlohmann::ordered_json::array({{{"role", "user"}, {"content", p.text}}}), where);
      } else {
        tokenizer.encode(p.text, &p.ids);
      }
    } else {
      throw DataError(fmt::format("{}: no 'prompt' (or GSM8K's 'question')", where));
    }
    if (p.ids.empty()) throw DataError(fmt::format("{}: the prompt encodes to no tokens", where));
    if (j.contains("answer")) {
      if (!j["answer"].is_string() && !j["answer"].is_number())
        throw DataError(fmt::format("{}: 'answer' is a JSON {}; expected a string", where, j["answer"].type_name()));
      p.answer = final_answer(j["answer"].is_string() ? j["answer"].get<std::string>() : j["answer"].dump());
    }
    if (need_answer && p.answer.empty())
      throw DataError(fmt::format("{}: no 'answer', which the answer reward checks completions against", where));
    if (static_cast<int64_t>(p.ids.size()) > max_tokens)
      throw DataError(fmt::format("{}: the prompt has {} tokens; seq_length leaves {} beside "
                                  "grpo_max_completion_length (shorten it, or raise seq_length)",
                                  where, p.ids.size(), max_tokens));
    out.push_back(std::move(p));
  }
  if (out.empty()) throw DataError(fmt::format("{}: no prompts", path));
  return out;
}

}  // namespace tessera
