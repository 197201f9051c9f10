#pragma once
// Conversations -> token ids and the role of each token, for supervised fine-tuning.
//
// A JSON line holds either `messages` (a list of {role, content}, as transformers and TRL
// take them) or `prompt` and `completion` (strings, or lists of messages), and optionally
// `tools` (function schemas, apply_chat_template's tools=). Conversations are
// rendered with the tokenizer's own chat template (chat_template.jinja beside tokenizer.json,
// else tokenizer_config.json's chat_template), exactly as transformers'
// apply_chat_template(..., tokenize=True) renders and tokenizes them. Plain prompt/completion
// strings are tokenized as TRL does: BOS (when the tokenizer has one) + prompt, then the
// completion and EOS.
//
// Each token's role says whose text it is: the bytes of every message's content keep their
// role through the template (jinja.h tags them), a token is the assistant's when any of its
// bytes are, and an assistant turn also owns the template text after it up to and including
// the special token that closes the turn (<|eot_id|>, <|im_end|>): the model must learn to
// stop. Everything else the template writes (headers, BOS) is role Template. The final
// assistant turn's tokens also carry kFinalTurn (loss_mask: completion trains on them only).
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tessera/config/config.h"

namespace tessera {

class Tokenizer;
namespace jinja {
class Template;
}

enum class TokenRole : uint8_t { Template = 0, System = 1, User = 2, Assistant = 3, Tool = 4 };
// Set in the role byte of the tokens of a sample's final assistant turn (its completion).
constexpr uint8_t kFinalTurn = 0x80;

inline TokenRole token_role(uint8_t role_byte) { return static_cast<TokenRole>(role_byte & 0x7f); }

// Whether a token with this role byte is trained on under `mask`.
inline bool counts_for_loss(uint8_t role_byte, LossMask mask) {
  switch (mask) {
    case LossMask::All: return true;
    case LossMask::Assistant: return token_role(role_byte) == TokenRole::Assistant;
    case LossMask::Completion: return token_role(role_byte) == TokenRole::Assistant && (role_byte & kFinalTurn);
  }
  return true;
}

struct ChatSample {
  std::vector<int32_t> ids;
  std::vector<uint8_t> roles;  // a TokenRole per id, with kFinalTurn on the final assistant turn
};

// Where preprocessing writes the roles of the chat dataset at `tokens_prefix`.
inline std::string chat_roles_prefix(const std::string& tokens_prefix) { return tokens_prefix + "_roles"; }

class ChatFormat {
 public:
  // The chat template and special tokens of the tokenizer whose tokenizer.json is at
  // `tokenizer_json`. Throws DataError naming the file when it has no chat template or the
  // template does not parse.
  ChatFormat(const std::string& tokenizer_json, const Tokenizer& tokenizer);
  ~ChatFormat();

  // One JSON line's sample. `where` ("file:line") prefixes every DataError: a missing or
  // unknown role, empty content, a conversation that does not end with the assistant, a
  // template that refuses the conversation (raise_exception) or fails.
  ChatSample encode(const nlohmann::ordered_json& line, const std::string& where) const;
  // A preference pair (TRL's prompt, chosen and rejected: strings, or lists of messages), the
  // two answers to one prompt, each encoded as a prompt and its completion. Also refused, with
  // `where`: a missing field, the two answers the same.
  std::pair<ChatSample, ChatSample> encode_preference(const nlohmann::ordered_json& line,
                                                      const std::string& where) const;
  // The conversation rendered, the assistant's turn opened (add_generation_prompt): the
  // prompt `generate --chat` continues.
  std::vector<int32_t> encode_prompt(const nlohmann::ordered_json& messages, const std::string& where) const;
  // A plain-text prompt as TRL tokenizes one (no template): BOS, when the tokenizer has one,
  // then the text.
  std::vector<int32_t> encode_text(const std::string& text) const;

  const std::string& template_source() const { return source_; }
  // Whether `id` is a special token (tokenizer_config.json's added_tokens_decoder), such as
  // the one that closes the assistant's turn: where a chat reply ends.
  bool is_special(int32_t id) const;

 private:
  // A prompt and one answer to it, the answer's field named `field` in errors.
  ChatSample encode_answer(const nlohmann::ordered_json& prompt, const nlohmann::ordered_json& answer,
                           const char* field, const std::string& where,
                           const nlohmann::ordered_json* tools = nullptr) const;
  // `tools`: the line's function schemas, or null (the template's tools is None).
  ChatSample render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                    const std::string& where, const nlohmann::ordered_json* tools = nullptr) const;

  const Tokenizer& tokenizer_;
  std::string source_, display_;
  std::unique_ptr<jinja::Template> template_;
  std::vector<std::pair<std::string, std::string>> special_tokens_;  // bos_token -> "<s>", ...
  std::vector<std::string> additional_special_tokens_;
  std::vector<int32_t> closing_ids_;  // special tokens (added_tokens_decoder "special": true)
  std::string bos_text_, eos_text_;
};

}  // namespace tessera
