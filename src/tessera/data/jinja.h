#pragma once
// The part of Jinja that Hugging Face chat templates are written in, evaluated as transformers
// evaluates them (jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks,
// loop controls, transformers' tojson, raise_exception and strftime_now), so that a
// tokenizer_config.json's chat_template renders to the same text. Tested against
// @huggingface/jinja on the shipped templates and on the language's corners.
//
// Every string carries a tag per byte: the text a template writes keeps the tags of the
// strings it came from (a message's content keeps its role through `+`, `| trim`, slicing and
// split), which is how chat data knows which rendered bytes are the assistant's.
//
// Statements: if/elif/else, for (tuple targets, `if` filter, else, loop.*), set (names,
// namespace attributes, blocks), macro, break/continue, generation (rendered as its body).
// Templates are untrusted input: parsing and rendering are bounded (nesting, steps, output
// size) and every failure is a DataError naming the template's line.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace tessera::jinja {

struct Value;
using List = std::vector<Value>;
// A dict keeps insertion order, as Python's does (tojson and items() show it).
using Dict = std::vector<std::pair<std::string, Value>>;
struct Callable;

// A string and the tag of each of its bytes (0: written by the template itself).
struct TaggedString {
  std::string text;
  std::basic_string<uint8_t> tags;

  TaggedString() = default;
  TaggedString(std::string t, uint8_t tag = 0) : text(std::move(t)), tags(text.size(), tag) {}
  void append(const TaggedString& s) { text += s.text, tags += s.tags; }
  TaggedString substr(size_t pos, size_t n = std::string::npos) const;
};

struct Value {
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace, Callable };
  Kind kind = Kind::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  TaggedString s;
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;  // Dict and Namespace (a namespace is a dict set may change)
  std::shared_ptr<const Callable> call;
  uint32_t depth = 0;  // of nested lists and dicts
  bool tuple = false;  // a list Python would hold as a tuple: printed (a, b)

  static Value none() { return with_kind(Kind::None); }
  static Value boolean(bool v) {
    Value r = with_kind(Kind::Bool);
    r.b = v;
    return r;
  }
  static Value integer(int64_t v) {
    Value r = with_kind(Kind::Int);
    r.i = v;
    return r;
  }
  static Value number(double v) {
    Value r = with_kind(Kind::Float);
    r.f = v;
    return r;
  }
  static Value string(TaggedString v) {
    Value r = with_kind(Kind::String);
    r.s = std::move(v);
    return r;
  }
  static Value string(std::string v, uint8_t tag = 0) { return string(TaggedString(std::move(v), tag)); }
  // Lists and dicts nest at most kMaxDepth deep (DataError beyond), so that walking one
  // (printing, comparing, freeing) cannot exhaust the stack.
  static constexpr uint32_t kMaxDepth = 256;
  static Value make_list(List v = {});
  static Value make_dict(Dict v = {});
  // The value of key in a dict or namespace, or nullptr.
  const Value* find(const std::string& key) const;

 private:
  static Value with_kind(Kind k) {
    Value r;
    r.kind = k;
    return r;
  }
};

// A JSON value as a template sees it (objects keep their key order); its strings carry `tag`.
Value from_json(const nlohmann::ordered_json& j, uint8_t tag = 0);

class Template {
 public:
  // Parses `source`; `display` names it in errors (e.g. "tokenizer_config.json chat_template").
  // Throws DataError for a syntax error or a statement outside the supported part.
  Template(const std::string& source, std::string display);
  ~Template();
  Template(Template&&) noexcept;

  // Renders with `context` as the template's variables (messages, bos_token, ...). Throws
  // DataError for an evaluation error, for raise_exception(...) (with its message), and
  // when the output or the work passes the bounds.
  TaggedString render(const std::map<std::string, Value>& context) const;

  struct Node;

 private:
  std::string display_;
  std::unique_ptr<Node> root_;
};

}  // namespace tessera::jinja
