#include "tessera/data/bpe_tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <simdjson.h>
#include <nlohmann/json.hpp>

#include "tessera/core/error.h"
#include "tessera/data/bpe_model.h"
#include "tessera/data/bpe_regex.h"
#include "tessera/data/bpe_unicode.h"

namespace tessera {
namespace {

namespace dom = simdjson::dom;

// GPT-2's pattern, which a ByteLevel pre-tokenizer with use_regex applies.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// What pretraining calls the end of a document, by the names model families give it.
constexpr std::string_view kEodTokens[] = {"<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"};

std::string escape_regex(std::string_view literal) {
  std::string out;
  for (char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

void replace_all(std::string_view text, std::string_view from, std::string_view to,
                 std::string* out) {
  size_t start = 0;
  for (size_t at; (at = text.find(from, start)) != std::string_view::npos;
       start = at + from.size()) {
    out->append(text.substr(start, at - start));
    out->append(to);
  }
  out->append(text.substr(start));
}

}  // namespace

// Reads fields of one tokenizer.json; every complaint names the file.
class BpeTokenizer::JsonFields {
 public:
  explicit JsonFields(const std::string& path) : path_(path) {}

  const std::string& path() const { return path_; }
  DataError error(std::string_view what) const {
    return DataError(fmt::format("{}: {}", path_, what));
  }
  // The field, or nullopt when it is missing or null.
  std::optional<dom::element> find(dom::element object, std::string_view key) const {
    dom::element e;
    if (object.at_key(key).get(e) != simdjson::SUCCESS || e.is_null()) return std::nullopt;
    return e;
  }
  std::string_view string(dom::element e, std::string_view what) const {
    std::string_view s;
    if (e.get_string().get(s) != simdjson::SUCCESS)
      throw error(fmt::format("{} is not a string", what));
    return s;
  }
  std::string_view string(dom::element object, std::string_view key, std::string_view what) const {
    const auto e = find(object, key);
    if (!e) throw error(fmt::format("{} has no \"{}\"", what, key));
    return string(*e, fmt::format("{}.{}", what, key));
  }
  bool flag(dom::element object, std::string_view key, bool fallback) const {
    const auto e = find(object, key);
    bool b = fallback;
    if (e && e->get_bool().get(b) != simdjson::SUCCESS)
      throw error(fmt::format("\"{}\" is not true or false", key));
    return b;
  }
  int32_t id(dom::element e, std::string_view what) const {
    int64_t v;
    if (e.get_int64().get(v) != simdjson::SUCCESS || v < 0 || v > INT32_MAX)
      throw error(fmt::format("{} is not a token id (an integer from 0 to 2^31-1)", what));
    return static_cast<int32_t>(v);
  }
  // The steps of a component: its "Sequence" list (flattened), or the component itself.
  std::vector<dom::element> steps(dom::element component, std::string_view list_key) const {
    if (string(component, "type", "a normalizer or pre-tokenizer") != "Sequence")
      return {component};
    dom::array list;
    const auto e = find(component, list_key);
    if (!e || e->get_array().get(list) != simdjson::SUCCESS)
      throw error(fmt::format("a Sequence without a \"{}\" list", list_key));
    std::vector<dom::element> out;
    for (dom::element step : list)
      for (dom::element s : steps(step, list_key)) out.push_back(s);
    return out;
  }

 private:
  const std::string& path_;
};

BpeTokenizer::BpeTokenizer(const std::string& path, const std::string& label) : label_(label) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw DataError(fmt::format("{}: no such file: expected a Hugging Face tokenizer.json", path));
  dom::parser parser;
  dom::element doc;
  if (const auto error = parser.load(path).get(doc); error != simdjson::SUCCESS)
    throw DataError(fmt::format("{}: not valid JSON ({}): expected a Hugging Face tokenizer.json",
                                path, simdjson::error_message(error)));
  load(JsonFields(path), doc);
}

BpeTokenizer::BpeTokenizer(const std::string& json_text, const std::string& display,
                           const std::string& label, bool /*from_text*/)
    : label_(label) {
  dom::parser parser;
  dom::element doc;
  if (const auto error = parser.parse(json_text).get(doc); error != simdjson::SUCCESS)
    throw DataError(fmt::format("{}: {}", display, simdjson::error_message(error)));
  load(JsonFields(display), doc);
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_gpt2_files(const std::string& vocab_file,
                                                            const std::string& merge_file) {
  const auto read = [](const std::string& path, std::string_view what) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw DataError(fmt::format("{}: cannot open: expected GPT-2's {}", path, what));
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
  };
  const std::string vocab = read(vocab_file, "vocab.json");
  std::istringstream merges(read(merge_file, "merges.txt"));
  nlohmann::json merge_list = nlohmann::json::array();
  for (std::string line; std::getline(merges, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.starts_with("#version")) continue;
    merge_list.push_back(line);
  }
  // The tokenizer.json of the same model: a byte-level BPE behind GPT-2's regex.
  const std::string text =
      R"({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},)"
      R"( "added_tokens": [], "model": {"type": "BPE", "vocab": )" +
      vocab + R"(, "merges": )" + merge_list.dump() + "}}";
  return std::unique_ptr<BpeTokenizer>(new BpeTokenizer(
      text, fmt::format("{} and {}", vocab_file, merge_file), "GPT2BPETokenizer", true));
}

void BpeTokenizer::load(const JsonFields& json, const dom::element& doc) {
  if (!doc.is_object() || !json.find(doc, "model") || !json.find(doc, "model")->is_object())
    throw json.error("no \"model\" object: expected a Hugging Face tokenizer.json");
  // The pre-tokenizer decides whether the model is byte-level, so it comes before the model.
  read_normalizers(json, doc);
  read_pre_tokenizers(json, doc);
  read_model(json, doc);
  read_added_tokens(json, doc);
  prepare_decoding();
  for (std::string_view name : kEodTokens) {
    if (const auto id = token_to_id(name)) {
      eod_id_ = *id;
      eod_token_ = name;
      break;
    }
  }
  if (eod_id_ < 0)
    throw json.error(
        fmt::format("no end-of-document token: expected one of {}", fmt::join(kEodTokens, ", ")));
}

BpeTokenizer::~BpeTokenizer() = default;

void BpeTokenizer::read_normalizers(const JsonFields& json, const dom::element& doc) {
  const auto normalizer = json.find(doc, "normalizer");
  if (!normalizer) return;
  for (dom::element step : json.steps(*normalizer, "normalizers")) {
    const std::string_view type = json.string(step, "type", "the normalizer");
    const auto pattern = json.find(step, "pattern");
    if (type == "NFC") {
      normalizers_.push_back({Normalizer::Kind::Nfc, "", ""});
    } else if (type == "Prepend") {
      normalizers_.push_back(
          {Normalizer::Kind::Prepend, std::string(json.string(step, "prepend", "Prepend")), ""});
    } else if (type == "Replace" && pattern && json.find(*pattern, "String")) {
      const std::string_view from = json.string(*pattern, "String", "Replace.pattern");
      if (from.empty()) throw json.error("Replace of an empty string");
      normalizers_.push_back({Normalizer::Kind::Replace, std::string(from),
                              std::string(json.string(step, "content", "Replace"))});
    } else {
      throw json.error(
          fmt::format("normalizer {} is not supported: expected NFC, Prepend, "
                      "Replace of a String, or a Sequence of them",
                      type));
    }
  }
}

// Split regexes then ByteLevel (byte-level models), or nothing (SentencePiece-style models).
void BpeTokenizer::read_pre_tokenizers(const JsonFields& json, const dom::element& doc) {
  const auto pre = json.find(doc, "pre_tokenizer");
  if (!pre) return;
  for (dom::element step : json.steps(*pre, "pretokenizers")) {
    const std::string_view type = json.string(step, "type", "the pre-tokenizer");
    if (type == "Split" && !byte_level_) {
      const std::string_view behavior = json.string(step, "behavior", "Split");
      const bool invert = json.flag(step, "invert", false);
      if (behavior != "Isolated" || invert)
        throw json.error(
            fmt::format("Split pre-tokenizer with behavior {}{} is not supported: "
                        "expected Isolated without invert",
                        behavior, invert ? " (inverted)" : ""));
      const auto pattern = json.find(step, "pattern");
      if (!pattern) throw json.error("Split pre-tokenizer without a pattern");
      const std::string regex =
          json.find(*pattern, "Regex")
              ? std::string(json.string(*pattern, "Regex", "Split.pattern"))
              : escape_regex(json.string(*pattern, "String", "Split.pattern"));
      splits_.push_back(std::make_unique<SplitRegex>(regex, json.path()));
    } else if (type == "ByteLevel" && !byte_level_) {
      if (json.flag(step, "add_prefix_space", false))
        throw json.error(
            "ByteLevel pre-tokenizer with add_prefix_space is not supported: "
            "expected add_prefix_space false");
      if (json.flag(step, "use_regex", true))
        splits_.push_back(std::make_unique<SplitRegex>(kGpt2Pattern, json.path()));
      byte_level_ = true;
    } else {
      throw json.error(
          fmt::format("pre-tokenizer {} is not supported here: expected Split "
                      "(Isolated) steps followed by ByteLevel, ByteLevel alone, or "
                      "none (SentencePiece-style models)",
                      type));
    }
  }
  if (!splits_.empty() && !byte_level_)
    throw json.error(
        "a Split pre-tokenizer without ByteLevel is not supported: expected "
        "Split (Isolated) steps followed by ByteLevel");
}

void BpeTokenizer::read_model(const JsonFields& json, const dom::element& doc) {
  const dom::element model = *json.find(doc, "model");
  std::string_view type = "BPE";
  if (const auto t = json.find(model, "type")) type = json.string(*t, "model.type");
  if (type != "BPE")
    throw json.error(
        fmt::format("model type {} is not supported: expected BPE (byte-level as in "
                    "Llama 3 and Qwen, or SentencePiece-style as in Llama 2)",
                    type));
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (const auto v = json.find(model, key); v && !json.string(*v, key).empty())
      throw json.error(fmt::format("model.{} is not supported: expected null or \"\"", key));
  }
  BpeModelOptions options;
  options.byte_level = byte_level_;
  options.ignore_merges = json.flag(model, "ignore_merges", false);
  options.byte_fallback = json.flag(model, "byte_fallback", false);
  options.fuse_unk = json.flag(model, "fuse_unk", false);
  if (const auto unk = json.find(model, "unk_token"))
    options.unk_token = json.string(*unk, "model.unk_token");

  dom::object vocab_object;
  dom::array merge_list;
  if (const auto v = json.find(model, "vocab"); !v || v->get_object().get(vocab_object))
    throw json.error("model.vocab is not an object of token ids");
  if (const auto m = json.find(model, "merges"); !m || m->get_array().get(merge_list))
    throw json.error("model.merges is not a list");
  std::vector<std::pair<std::string_view, int32_t>> vocab;
  for (const dom::key_value_pair kv : vocab_object)
    vocab.emplace_back(kv.key, json.id(kv.value, fmt::format("the id of '{}'", kv.key)));
  std::vector<std::pair<std::string_view, std::string_view>> merges;
  for (dom::element m : merge_list) {
    dom::array pair;
    if (m.get_array().get(pair) == simdjson::SUCCESS && pair.size() == 2) {  // ["a", "b"]
      merges.emplace_back(json.string(pair.at(0), "a merge"), json.string(pair.at(1), "a merge"));
      continue;
    }
    const std::string_view s = json.string(m, "a merge");  // "a b"
    const size_t space = s.find(' ');
    if (space == std::string_view::npos || s.find(' ', space + 1) != std::string_view::npos)
      throw json.error(fmt::format("merge '{}' is not two tokens separated by a space", s));
    merges.emplace_back(s.substr(0, space), s.substr(space + 1));
  }
  model_ = std::make_unique<BpeModel>(options, vocab, merges, json.path());
}

void BpeTokenizer::read_added_tokens(const JsonFields& json, const dom::element& doc) {
  trie_.emplace_back();
  const auto list = json.find(doc, "added_tokens");
  if (!list) return;
  dom::array tokens;
  if (list->get_array().get(tokens)) throw json.error("added_tokens is not a list");
  for (dom::element t : tokens) {
    const std::string_view content = json.string(t, "content", "an added token");
    const auto id_field = json.find(t, "id");
    if (!id_field) throw json.error(fmt::format("added token '{}' has no id", content));
    const int32_t id = json.id(*id_field, fmt::format("the id of added token '{}'", content));
    for (const char* option : {"single_word", "lstrip", "rstrip"})
      if (json.flag(t, option, false))
        throw json.error(
            fmt::format("added token '{}' sets {}, which is not supported: "
                        "expected false",
                        content, option));
    if (content.empty()) throw json.error(fmt::format("added token {} is empty", id));
    added_.emplace_back(content, id);
    add_token_to_trie(content, id);
  }
}

void BpeTokenizer::prepare_decoding() {
  // Decoding undoes the string replacements of the normalizers, last first.
  const auto undo_replacements = [&](std::string text) {
    for (auto n = normalizers_.rbegin(); n != normalizers_.rend(); ++n) {
      if (n->kind != Normalizer::Kind::Replace) continue;
      std::string undone;
      replace_all(text, n->replacement, n->text, &undone);
      text = std::move(undone);
    }
    return text;
  };
  int32_t id_end = model_->id_end();
  for (const auto& [content, id] : added_) id_end = std::max(id_end, id + 1);
  decoded_.resize(static_cast<size_t>(id_end));
  is_added_.assign(static_cast<size_t>(id_end), false);
  for (int32_t id = 0; id < model_->id_end(); ++id) {
    const int byte = model_->fallback_byte(id);
    decoded_[id] =
        byte >= 0 ? std::string(1, static_cast<char>(byte)) : undo_replacements(model_->word(id));
  }
  for (const auto& [content, id] : added_) {
    decoded_[id] = content;
    is_added_[id] = true;
  }
  for (const Normalizer& n : normalizers_)
    if (n.kind == Normalizer::Kind::Prepend) section_prefix_ = undo_replacements(n.text);

  // Character-level words can end before each "▁" when no token has one after another
  // character: no merge can then cross that point, and words can be cached.
  if (byte_level_) return;
  for (const Normalizer& n : normalizers_)
    if (n.kind == Normalizer::Kind::Replace && n.text == " ") word_mark_ = n.replacement;
  const std::string mark = word_mark_;
  for (int32_t id = 0; id < model_->id_end() && !word_mark_.empty(); ++id) {
    const std::string& w = model_->word(id);
    for (size_t at = w.find(mark, 1); at != std::string::npos; at = w.find(mark, at + 1)) {
      if (at < mark.size() || w.compare(at - mark.size(), mark.size(), mark) != 0) {
        word_mark_.clear();
        break;
      }
    }
  }
}

void BpeTokenizer::add_token_to_trie(std::string_view content, int32_t id) {
  int32_t node = 0;
  for (unsigned char c : content) {
    auto& children = trie_[node].children;
    const auto it = std::find_if(children.begin(), children.end(),
                                 [c](const auto& child) { return child.first == c; });
    if (it != children.end()) {
      node = it->second;
    } else {
      const auto child = static_cast<int32_t>(trie_.size());
      trie_[node].children.emplace_back(c, child);  // trie_ may grow below: index again
      trie_.emplace_back();
      node = child;
    }
  }
  trie_[node].token = id;
  starts_added_[static_cast<unsigned char>(content[0])] = true;
}

// The leftmost added token at or after `from`, the longest one where several start there.
BpeTokenizer::AddedMatch BpeTokenizer::find_added(std::string_view text, size_t from) const {
  for (size_t i = from; i < text.size(); ++i) {
    if (!starts_added_[static_cast<unsigned char>(text[i])]) continue;
    AddedMatch best;
    int32_t node = 0;
    for (size_t j = i; j < text.size(); ++j) {
      const auto& children = trie_[node].children;
      const auto c = static_cast<unsigned char>(text[j]);
      const auto it = std::find_if(children.begin(), children.end(),
                                   [c](const auto& child) { return child.first == c; });
      if (it == children.end()) break;
      node = it->second;
      if (trie_[node].token >= 0) best = {i, j + 1 - i, trie_[node].token};
    }
    if (best.id >= 0) return best;
  }
  return {};
}

std::string_view BpeTokenizer::normalize(std::string_view text, std::string* storage) const {
  for (const Normalizer& n : normalizers_) {
    std::string next;
    switch (n.kind) {
      case Normalizer::Kind::Nfc:
        if (unicode::is_trivially_nfc(text)) continue;
        unicode::append_nfc(text, &next);
        break;
      case Normalizer::Kind::Prepend:
        next.assign(n.text).append(text);
        break;
      case Normalizer::Kind::Replace:
        if (text.find(n.text) == std::string_view::npos) continue;
        replace_all(text, n.text, n.replacement, &next);
        break;
    }
    *storage = std::move(next);
    text = *storage;
  }
  return text;
}

void BpeTokenizer::encode_section(std::string_view text, std::vector<int32_t>* out) const {
  if (text.empty()) return;
  std::string storage;
  text = normalize(text, &storage);
  if (!byte_level_) {
    size_t start = 0;
    const size_t mark = word_mark_.size();
    for (size_t at = mark ? text.find(word_mark_, 1) : std::string_view::npos;
         at != std::string_view::npos; at = text.find(word_mark_, at + mark)) {
      if (at >= mark && text.compare(at - mark, mark, word_mark_) == 0) continue;
      model_->encode_word(text.substr(start, at - start), out);
      start = at;
    }
    model_->encode_word(text.substr(start), out);
    return;
  }
  thread_local std::vector<std::string_view> pieces, split_pieces;
  pieces.assign(1, text);
  for (const auto& split : splits_) {
    split_pieces.clear();
    for (std::string_view piece : pieces) split->split(piece, &split_pieces);
    std::swap(pieces, split_pieces);
  }
  for (std::string_view piece : pieces) model_->encode_word(piece, out);
}

void BpeTokenizer::encode(std::string_view text, std::vector<int32_t>* out) const {
  size_t start = 0;
  for (AddedMatch m; (m = find_added(text, start)).id >= 0; start = m.pos + m.size) {
    encode_section(text.substr(start, m.pos - start), out);
    out->push_back(m.id);
  }
  encode_section(text.substr(start), out);
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  bool section_start = true;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size() || (decoded_[id].empty() && !is_added_[id]))
      throw DataError(fmt::format("token id {} is not in the vocabulary of tokenizer {} (size {})",
                                  id, name(), vocab_size()));
    std::string_view piece = decoded_[id];
    if (is_added_[id]) {
      section_start = true;
    } else {
      if (section_start && piece.starts_with(section_prefix_))
        piece.remove_prefix(section_prefix_.size());
      section_start = false;
    }
    out.append(piece);
  }
  return out;
}

std::optional<int32_t> BpeTokenizer::token_to_id(std::string_view token) const {
  for (const auto& [content, id] : added_)
    if (content == token) return id;
  return model_->find_token(token);
}

}  // namespace tessera
