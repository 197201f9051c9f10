#include "tessera/data/chat.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tessera/core/error.h"
#include "tessera/data/jinja.h"
#include "tessera/data/tokenizer.h"

namespace tessera {
namespace fs = std::filesystem;
namespace {

using jinja::Value;
constexpr const char* kRoles[] = {"system", "user", "assistant", "tool"};

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(fmt::format("{}: cannot open for reading", path.string()));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TokenRole role_of(const std::string& role) {
  if (role == "system") return TokenRole::System;
  if (role == "user") return TokenRole::User;
  if (role == "assistant") return TokenRole::Assistant;
  return TokenRole::Tool;
}

// Checks one conversation, naming the message and field at fault.
void check_messages(const nlohmann::ordered_json& messages, const std::string& field, const std::string& where) {
  if (!messages.is_array() || messages.empty())
    throw DataError(fmt::format("{}: '{}' is not a non-empty list of messages", where, field));
  for (size_t k = 0; k < messages.size(); ++k) {
    const nlohmann::ordered_json& m = messages[k];
    const std::string at = fmt::format("{}: {}[{}]", where, field, k);
    if (!m.is_object()) throw DataError(fmt::format("{} is not an object with role and content", at));
    const auto role = m.find("role");
    if (role == m.end()) throw DataError(fmt::format("{} has no 'role'", at));
    if (!role->is_string() || std::find(std::begin(kRoles), std::end(kRoles), role->get<std::string>()) == std::end(kRoles))
      throw DataError(fmt::format("{}.role is {}; expected one of system, user, assistant, tool", at, role->dump()));
    const auto content = m.find("content");
    const bool tool_calls = m.contains("tool_calls") && !m["tool_calls"].empty();
    if (content == m.end() || content->is_null()) {
      if (!tool_calls) throw DataError(fmt::format("{} has no 'content'", at));
    } else if (!content->is_string()) {
      throw DataError(fmt::format("{}.content is a JSON {}; expected a string", at, content->type_name()));
    } else if (content->get_ref<const std::string&>().empty() && !tool_calls) {
      throw DataError(fmt::format("{}.content is empty", at));
    }
  }
}

// The last run of assistant tokens is the sample's completion.
void mark_final_turn(ChatSample* s) {
  size_t k = s->roles.size();
  while (k > 0 && token_role(s->roles[k - 1]) != TokenRole::Assistant) --k;
  for (; k > 0 && token_role(s->roles[k - 1]) == TokenRole::Assistant; --k) s->roles[k - 1] |= kFinalTurn;
}

// Special tokens as transformers' special_tokens_map gives them to the template: strings, or
// {"content": ...} objects; absent or null ones are left out.
std::string token_text(const nlohmann::ordered_json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}

}  // namespace

ChatFormat::ChatFormat(const std::string& tokenizer_json, const Tokenizer& tokenizer) : tokenizer_(tokenizer) {
  const fs::path dir = fs::path(tokenizer_json).parent_path();
  const fs::path config_path = dir / "tokenizer_config.json", jinja_path = dir / "chat_template.jinja";
  nlohmann::ordered_json config = nlohmann::ordered_json::object();
  if (fs::exists(config_path)) {
    try {
      config = nlohmann::ordered_json::parse(read_file(config_path));
    } catch (const nlohmann::ordered_json::exception& e) {
      throw DataError(fmt::format("{}: not valid JSON: {}", config_path.string(), e.what()));
    }
    if (!config.is_object()) throw DataError(fmt::format("{}: not a JSON object", config_path.string()));
  }
  if (fs::exists(jinja_path)) {
    source_ = read_file(jinja_path);
    display_ = jinja_path.string();
  } else if (const auto t = config.find("chat_template"); t != config.end() && t->is_string()) {
    source_ = t->get<std::string>();
    display_ = config_path.string() + " chat_template";
  } else if (t != config.end() && t->is_array()) {
    // Several named templates: transformers uses the one named "default".
    for (const auto& named : *t)
      if (named.is_object() && named.value("name", "") == "default" && named.contains("template") &&
          named["template"].is_string())
        source_ = named["template"].get<std::string>();
    display_ = config_path.string() + " chat_template \"default\"";
  }
  if (source_.empty())
    throw DataError(fmt::format(
        "{}: no chat template (expected chat_template in tokenizer_config.json or a "
        "chat_template.jinja beside tokenizer.json); conversations cannot be rendered for this "
        "tokenizer: use a chat model's tokenizer, or plain prompt/completion strings",
        dir.string()));
  template_ = std::make_unique<jinja::Template>(source_, display_);
  for (const char* name : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"})
    if (const auto v = config.find(name); v != config.end())
      if (const std::string text = token_text(*v); !text.empty()) special_tokens_.emplace_back(name, text);
  if (const auto extra = config.find("additional_special_tokens"); extra != config.end() && extra->is_array())
    for (const auto& t : *extra)
      if (const std::string text = token_text(t); !text.empty()) additional_special_tokens_.push_back(text);
  bos_text_ = config.contains("bos_token") ? token_text(config["bos_token"]) : "";
  eos_text_ = config.contains("eos_token") ? token_text(config["eos_token"]) : "";
  if (const auto added = config.find("added_tokens_decoder"); added != config.end() && added->is_object())
    for (const auto& [id, token] : added->items())
      if (token.is_object() && token.value("special", false)) {
        try {
          closing_ids_.push_back(std::stoi(id));
        } catch (const std::exception&) {
          throw DataError(fmt::format("{}: added_tokens_decoder key '{}' is not a token id", config_path.string(), id));
        }
      }
}

ChatFormat::~ChatFormat() = default;

ChatSample ChatFormat::render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                              const std::string& where, const nlohmann::ordered_json* tools) const {
  jinja::List list;
  for (const auto& m : messages) {
    const uint8_t tag = static_cast<uint8_t>(role_of(m["role"].get<std::string>()));
    jinja::Dict d;
    for (const auto& [k, v] : m.items()) d.emplace_back(k, jinja::from_json(v, k == "role" ? 0 : tag));
    list.push_back(Value::make_dict(std::move(d)));
  }
  std::map<std::string, Value> context = {{"messages", Value::make_list(std::move(list))},
                                          {"add_generation_prompt", Value::boolean(add_generation_prompt)},
                                          {"tools", tools ? jinja::from_json(*tools) : Value::none()},
                                          {"documents", Value::none()}};
  for (const auto& [name, text] : special_tokens_) context[name] = Value::string(text);
  if (!additional_special_tokens_.empty()) {
    jinja::List extra;
    for (const std::string& t : additional_special_tokens_) extra.push_back(Value::string(t));
    context["additional_special_tokens"] = Value::make_list(std::move(extra));
  }
  jinja::TaggedString text;
  try {
    text = template_->render(context);
  } catch (const DataError& e) {
    throw DataError(fmt::format("{}: {}", where, e.what()));
  }

  ChatSample out;
  tokenizer_.encode(text.text, &out.ids);
  out.roles.assign(out.ids.size(), static_cast<uint8_t>(TokenRole::Template));
  // Each token's bytes: the tokenizer decodes token by token to exactly the text encoded.
  size_t at = 0;
  bool in_assistant_turn = false;
  for (size_t k = 0; k < out.ids.size(); ++k) {
    const size_t bytes = tokenizer_.decode({out.ids[k]}).size();
    if (at + bytes > text.text.size()) break;
    uint8_t role = 0;  // the assistant's when any byte is, else the first role among them
    for (size_t b = at; b < at + bytes; ++b) {
      if (text.tags[b] == static_cast<uint8_t>(TokenRole::Assistant)) {
        role = text.tags[b];
        break;
      }
      if (role == 0) role = text.tags[b];
    }
    at += bytes;
    if (role == static_cast<uint8_t>(TokenRole::Assistant)) {
      in_assistant_turn = true;
    } else if (in_assistant_turn && role == 0) {
      // The template's text that closes the assistant's turn, through its closing token.
      role = static_cast<uint8_t>(TokenRole::Assistant);
      if (std::find(closing_ids_.begin(), closing_ids_.end(), out.ids[k]) != closing_ids_.end())
        in_assistant_turn = false;
    } else {
      in_assistant_turn = false;
    }
    out.roles[k] = role;
  }
  mark_final_turn(&out);
  if (at != text.text.size())
    throw DataError(fmt::format(
        "{}: tokenizer {} does not decode token by token to the rendered text ({} of {} bytes), "
        "so the roles of its tokens are unknown; chat data needs a byte-level tokenizer "
        "(Llama 3, Qwen)",
        where, tokenizer_.name(), at, text.text.size()));
  return out;
}

ChatSample ChatFormat::encode(const nlohmann::ordered_json& line, const std::string& where) const {
  // The functions a conversation may call, as apply_chat_template's tools= takes them.
  const nlohmann::ordered_json* tools = nullptr;
  if (const auto t = line.find("tools"); t != line.end() && !t->is_null()) {
    if (!t->is_array())
      throw DataError(fmt::format("{}: 'tools' is a JSON {}; expected a list of function schemas",
                                  where, t->type_name()));
    tools = &*t;
  }
  const auto messages = line.find("messages");
  if (messages != line.end()) {
    check_messages(*messages, "messages", where);
    if (messages->back()["role"] != "assistant")
      throw DataError(fmt::format(
          "{}: the conversation ends with a '{}' message; expected it to end with the "
          "assistant's answer (there is nothing to learn after the last assistant turn)",
          where, messages->back()["role"].get<std::string>()));
    return render(*messages, false, where, tools);
  }
  const auto prompt = line.find("prompt"), completion = line.find("completion");
  if (prompt == line.end() || completion == line.end())
    throw DataError(fmt::format(
        "{}: neither 'messages' nor 'prompt' and 'completion'; expected a conversation "
        "({{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}}) or a prompt and its completion",
        where));
  return encode_answer(*prompt, *completion, "completion", where, tools);
}

ChatSample ChatFormat::encode_answer(const nlohmann::ordered_json& prompt,
                                     const nlohmann::ordered_json& answer, const char* field,
                                     const std::string& where,
                                     const nlohmann::ordered_json* tools) const {
  if (prompt.is_array() || answer.is_array()) {
    check_messages(prompt, "prompt", where);
    check_messages(answer, field, where);
    for (const auto& m : answer)
      if (m["role"] != "assistant")
        throw DataError(fmt::format("{}: {} holds a '{}' message; expected only the assistant's",
                                    where, field, m["role"].get<std::string>()));
    nlohmann::ordered_json all = prompt;
    for (const auto& m : answer) all.push_back(m);
    return render(all, false, where, tools);
  }
  for (const auto& [name, v] : {std::pair{"prompt", &prompt}, std::pair{field, &answer}})
    if (!v->is_string() || v->get_ref<const std::string&>().empty())
      throw DataError(fmt::format("{}: '{}' is {}; expected a non-empty string (or a list of messages)",
                                  where, name, v->is_string() ? "empty" : "a JSON " + std::string(v->type_name())));
  ChatSample out;
  out.ids = encode_text(prompt.get<std::string>());
  out.roles.assign(out.ids.size(), static_cast<uint8_t>(TokenRole::User));
  if (!bos_text_.empty() && !out.ids.empty()) out.roles[0] = static_cast<uint8_t>(TokenRole::Template);
  tokenizer_.encode(answer.get<std::string>(), &out.ids);
  if (!eos_text_.empty()) tokenizer_.encode(eos_text_, &out.ids);
  else out.ids.push_back(tokenizer_.eod_id());
  out.roles.resize(out.ids.size(), static_cast<uint8_t>(TokenRole::Assistant));
  mark_final_turn(&out);
  return out;
}

std::pair<ChatSample, ChatSample> ChatFormat::encode_preference(const nlohmann::ordered_json& line,
                                                                const std::string& where) const {
  for (const char* field : {"prompt", "chosen", "rejected"})
    if (!line.contains(field))
      throw DataError(fmt::format(
          "{}: no '{}'; expected a preference pair: prompt, chosen and rejected (TRL's fields), "
          "each a string or a list of messages",
          where, field));
  if (line["chosen"] == line["rejected"])
    throw DataError(fmt::format(
        "{}: 'chosen' and 'rejected' are the same; a preference pair needs two different answers",
        where));
  return {encode_answer(line["prompt"], line["chosen"], "chosen", where),
          encode_answer(line["prompt"], line["rejected"], "rejected", where)};
}

bool ChatFormat::is_special(int32_t id) const {
  return std::find(closing_ids_.begin(), closing_ids_.end(), id) != closing_ids_.end();
}

std::vector<int32_t> ChatFormat::encode_text(const std::string& text) const {
  std::vector<int32_t> ids;
  tokenizer_.encode(bos_text_ + text, &ids);
  return ids;
}

std::vector<int32_t> ChatFormat::encode_prompt(const nlohmann::ordered_json& messages, const std::string& where) const {
  check_messages(messages, "messages", where);
  return render(messages, true, where).ids;
}

}  // namespace tessera
