// Evaluates a parsed template with Python's and jinja2's semantics: truthiness, int/float
// arithmetic, str() and repr() of values, undefined values that print as nothing but fail on
// use, one scope per loop iteration (a set inside a loop is gone after it: templates use
// namespace() for that), and the filters, tests and string methods chat templates call.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <functional>
#include <optional>

#include "tessera/core/error.h"
#include "tessera/data/jinja_ast.h"

namespace tessera::jinja {

struct Callable {
  using Args = std::vector<Value>;
  using Kwargs = std::vector<std::pair<std::string, Value>>;
  std::string name;
  std::function<Value(Args&, Kwargs&)> fn;
};

TaggedString TaggedString::substr(size_t pos, size_t n) const {
  TaggedString r;
  r.text = text.substr(pos, n);
  r.tags = tags.substr(pos, n);
  return r;
}

namespace {
template <typename Items, typename Get>
uint32_t nested_depth(const Items& items, Get get) {
  uint32_t depth = 0;
  for (const auto& item : items) depth = std::max(depth, get(item).depth);
  if (depth + 1 > Value::kMaxDepth)
    throw DataError(fmt::format("lists and dicts nested deeper than {}", Value::kMaxDepth));
  return depth + 1;
}
}  // namespace

Value Value::make_list(List v) {
  Value r = with_kind(Kind::List);
  r.depth = nested_depth(v, [](const Value& x) -> const Value& { return x; });
  r.list = std::make_shared<List>(std::move(v));
  return r;
}

Value Value::make_dict(Dict v) {
  Value r = with_kind(Kind::Dict);
  r.depth = nested_depth(v, [](const auto& kv) -> const Value& { return kv.second; });
  r.dict = std::make_shared<Dict>(std::move(v));
  return r;
}

const Value* Value::find(const std::string& key) const {
  if (!dict) return nullptr;
  for (const auto& [k, v] : *dict)
    if (k == key) return &v;
  return nullptr;
}

namespace {

using Node = Template::Node;
using Kind = Value::Kind;
using Args = Callable::Args;
using Kwargs = Callable::Kwargs;

constexpr uint64_t kMaxSteps = 20'000'000;        // node evaluations in one render
constexpr size_t kMaxOutputBytes = size_t{64} << 20;  // a chat is kilobytes
constexpr size_t kMaxListItems = 1'000'000;
constexpr int kMaxCallDepth = 100;

// Control flow out of a loop body.
enum class Flow { Normal, Break, Continue };

// Code-point starts of a UTF-8 string (Python indexes strings by code point), plus its size.
std::vector<size_t> code_points(const std::string& s) {
  std::vector<size_t> starts;
  for (size_t i = 0; i < s.size(); ++i)
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) starts.push_back(i);
  starts.push_back(s.size());
  return starts;
}

bool is_py_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

std::string kind_name(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined: return "undefined";
    case Kind::None: return "NoneType";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::List: return "list";
    case Kind::Dict: return "dict";
    case Kind::Namespace: return "Namespace";
    case Kind::Callable: return "function";
  }
  return "?";
}

// Python's repr of a float: the shortest digits that read back, in fixed notation for
// exponents -4..15, else d.ddde+XX.
std::string float_repr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, f, std::chars_format::scientific);
  std::string sci(buf, end);  // [-]d[.ddd]e[+-]XX
  const size_t e = sci.find('e');
  const int exp = std::stoi(sci.substr(e + 1));
  const bool negative = sci[0] == '-';
  std::string digits;
  for (size_t k = negative; k < e; ++k)
    if (sci[k] != '.') digits += sci[k];
  std::string out = negative ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exp + 1) {
      out += digits + std::string(static_cast<size_t>(exp + 1) - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, static_cast<size_t>(exp + 1)) + "." + digits.substr(static_cast<size_t>(exp + 1));
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  return out + fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
}

std::string py_repr(const Value& v);

// str(v): what {{ v }} writes.
TaggedString py_str(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined: return {};
    case Kind::None: return TaggedString("None");
    case Kind::Bool: return TaggedString(v.b ? "True" : "False");
    case Kind::Int: return TaggedString(std::to_string(v.i));
    case Kind::Float: return TaggedString(float_repr(v.f));
    case Kind::String: return v.s;
    default: return TaggedString(py_repr(v));
  }
}

std::string quote_py(const std::string& s) {
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (const char c : s) {
    if (c == q || c == '\\') out += '\\', out += c;
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
    else out += c;
  }
  return out + q;
}

std::string py_repr(const Value& v) {
  switch (v.kind) {
    case Kind::String: return quote_py(v.s.text);
    case Kind::List: {
      std::string out = v.tuple ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + py_repr((*v.list)[k]);
      if (v.tuple && v.list->size() == 1) out += ",";
      return out + (v.tuple ? ")" : "]");
    }
    case Kind::Dict: {
      std::string out = "{";
      for (size_t k = 0; k < v.dict->size(); ++k)
        out += (k ? ", " : "") + quote_py((*v.dict)[k].first) + ": " + py_repr((*v.dict)[k].second);
      return out + "}";
    }
    case Kind::Namespace: return "<Namespace>";
    case Kind::Callable: return "<function " + v.call->name + ">";
    default: return py_str(v).text;
  }
}

// json.dumps(v, ensure_ascii=False, indent=indent), as transformers' tojson.
void to_json(const Value& v, int indent, int depth, std::string* out) {
  const auto newline = [&](int d) {
    if (indent < 0) return;
    out->push_back('\n');
    out->append(static_cast<size_t>(indent) * static_cast<size_t>(d), ' ');
  };
  switch (v.kind) {
    case Kind::None: *out += "null"; return;
    case Kind::Bool: *out += v.b ? "true" : "false"; return;
    case Kind::Int: *out += std::to_string(v.i); return;
    case Kind::Float:
      *out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity") : float_repr(v.f);
      return;
    case Kind::String: {
      *out += '"';
      for (const char c : v.s.text) {
        switch (c) {
          case '"': *out += "\\\""; break;
          case '\\': *out += "\\\\"; break;
          case '\n': *out += "\\n"; break;
          case '\r': *out += "\\r"; break;
          case '\t': *out += "\\t"; break;
          case '\b': *out += "\\b"; break;
          case '\f': *out += "\\f"; break;
          default:
            if (static_cast<unsigned char>(c) < 0x20) *out += fmt::format("\\u{:04x}", static_cast<unsigned char>(c));
            else *out += c;
        }
      }
      *out += '"';
      return;
    }
    case Kind::List: {
      *out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) *out += indent >= 0 ? "," : ", ";
        newline(depth + 1);
        to_json((*v.list)[k], indent, depth + 1, out);
      }
      if (!v.list->empty()) newline(depth);
      *out += ']';
      return;
    }
    case Kind::Dict: {
      *out += '{';
      for (size_t k = 0; k < v.dict->size(); ++k) {
        if (k) *out += indent >= 0 ? "," : ", ";
        newline(depth + 1);
        to_json(Value::string((*v.dict)[k].first), indent, depth + 1, out);
        *out += ": ";
        to_json((*v.dict)[k].second, indent, depth + 1, out);
      }
      if (!v.dict->empty()) newline(depth);
      *out += '}';
      return;
    }
    default:
      throw DataError(fmt::format("tojson: a value of type {} is not JSON", kind_name(v)));
  }
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined:
    case Kind::None: return false;
    case Kind::Bool: return v.b;
    case Kind::Int: return v.i != 0;
    case Kind::Float: return v.f != 0;
    case Kind::String: return !v.s.text.empty();
    case Kind::List: return !v.list->empty();
    case Kind::Dict:
    case Kind::Namespace: return !v.dict->empty();
    case Kind::Callable: return true;
  }
  return false;
}

bool is_number(const Value& v) { return v.kind == Kind::Int || v.kind == Kind::Float || v.kind == Kind::Bool; }
double as_double(const Value& v) { return v.kind == Kind::Float ? v.f : v.kind == Kind::Int ? static_cast<double>(v.i) : v.b; }
int64_t as_int(const Value& v) { return v.kind == Kind::Int ? v.i : v.b; }

bool equal(const Value& a, const Value& b) {
  if (is_number(a) && is_number(b)) {
    if (a.kind == Kind::Float || b.kind == Kind::Float) return as_double(a) == as_double(b);
    return as_int(a) == as_int(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::Undefined:
    case Kind::None: return true;
    case Kind::String: return a.s.text == b.s.text;
    case Kind::List:
      return a.list->size() == b.list->size() &&
             std::equal(a.list->begin(), a.list->end(), b.list->begin(), equal);
    case Kind::Namespace: return a.dict == b.dict;  // jinja2 compares namespaces by identity
    case Kind::Dict:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, v] : *a.dict) {
        const Value* o = b.find(k);
        if (!o || !equal(v, *o)) return false;
      }
      return true;
    case Kind::Callable: return a.call == b.call;
    default: return false;
  }
}

Value callable(std::string name, std::function<Value(Args&, Kwargs&)> fn) {
  Value v;
  v.kind = Kind::Callable;
  v.call = std::make_shared<const Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

// The argument at position `pos` or keyword `name`, else `fallback` (nullptr: required).
Value arg(Args& args, Kwargs& kwargs, size_t pos, const char* name, const Value* fallback,
          const std::string& fn) {
  if (pos < args.size()) return args[pos];
  for (auto& [k, v] : kwargs)
    if (k == name) return v;
  if (!fallback) throw DataError(fmt::format("{}() is missing its argument '{}'", fn, name));
  return *fallback;
}

Value pair_or_list(List items, bool tuple) {
  Value v = Value::make_list(std::move(items));
  v.tuple = tuple;
  return v;
}

const Value kNone = Value::none();
const Value kUndefined;

class Renderer {
 public:
  Renderer(const std::string& display, const std::map<std::string, Value>& context)
      : display_(display) {
    scopes_.emplace_back(context.begin(), context.end());
    add_globals();
  }

  ~Renderer() {
    for (const auto& ns : namespaces_) ns->clear();
  }

  TaggedString run(const Node& root) {
    TaggedString out;
    exec(root, &out);
    return out;
  }

 private:
  using Scope = std::map<std::string, Value>;

  [[noreturn]] void fail(const Node& n, const std::string& what) const {
    throw DataError(fmt::format("{} line {}: {}", display_, n.line, what));
  }
  void step(const Node& n) {
    if (++steps_ > kMaxSteps)
      fail(n, fmt::format("the template did not finish in {} steps (a loop that does not end?)", kMaxSteps));
  }
  void emit(const Node& n, TaggedString* out, const TaggedString& s) {
    if (out->text.size() + s.text.size() > kMaxOutputBytes)
      fail(n, fmt::format("the template writes more than {} MB", kMaxOutputBytes >> 20));
    out->append(s);
  }

  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it)
      if (const auto f = it->find(name); f != it->end()) return f->second;
    return kUndefined;
  }

  // ---- statements ----
  Flow exec(const Node& n, TaggedString* out) {
    step(n);
    switch (n.kind) {
      case Node::Kind::Block:
        for (const auto& k : n.kids)
          if (const Flow f = exec(*k, out); f != Flow::Normal) return f;
        return Flow::Normal;
      case Node::Kind::Text: emit(n, out, n.literal.s); return Flow::Normal;
      case Node::Kind::Output: emit(n, out, py_str(eval(*n.kids[0]))); return Flow::Normal;
      case Node::Kind::If:
        for (size_t k = 0; k + 1 < n.kids.size(); k += 2)
          if (truthy(eval(*n.kids[k]))) return exec(*n.kids[k + 1], out);
        if (n.kids.size() % 2) return exec(*n.kids.back(), out);
        return Flow::Normal;
      case Node::Kind::For: return exec_for(n, out);
      case Node::Kind::Set: exec_set(n); return Flow::Normal;
      case Node::Kind::Macro: define_macro(n); return Flow::Normal;
      case Node::Kind::Break: return Flow::Break;
      case Node::Kind::Continue: return Flow::Continue;
      default: emit(n, out, py_str(eval(n))); return Flow::Normal;
    }
  }

  std::vector<Value> iterate(const Node& n, const Value& v) {
    switch (v.kind) {
      case Kind::Undefined: return {};
      case Kind::List: return *v.list;
      case Kind::Dict: {
        std::vector<Value> keys;
        for (const auto& kv : *v.dict) keys.push_back(Value::string(kv.first));
        return keys;
      }
      case Kind::String: {
        const auto cps = code_points(v.s.text);
        std::vector<Value> chars;
        for (size_t k = 0; k + 1 < cps.size(); ++k)
          chars.push_back(Value::string(v.s.substr(cps[k], cps[k + 1] - cps[k])));
        return chars;
      }
      default: fail(n, fmt::format("'{}' object is not iterable", kind_name(v)));
    }
  }

  void bind_targets(const Node& n, const std::vector<std::string>& names, const Value& item) {
    if (names.size() == 1) {
      scopes_.back()[names[0]] = item;
      return;
    }
    std::vector<Value> parts = iterate(n, item);
    if (parts.size() != names.size())
      fail(n, fmt::format("cannot unpack {} values into {} names", parts.size(), names.size()));
    for (size_t k = 0; k < names.size(); ++k) scopes_.back()[names[k]] = parts[k];
  }

  Flow exec_for(const Node& n, TaggedString* out) {
    std::vector<Value> items = iterate(n, eval(*n.kids[0]));
    if (const Node* filter = n.kids[3].get()) {
      std::vector<Value> kept;
      for (const Value& item : items) {
        scopes_.emplace_back();
        bind_targets(n, n.arg_names, item);
        const bool keep = truthy(eval(*filter));
        scopes_.pop_back();
        if (keep) kept.push_back(item);
      }
      items = std::move(kept);
    }
    const int64_t length = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < length; ++k) {
      scopes_.emplace_back();
      Dict loop = {{"index", Value::integer(k + 1)},
                   {"index0", Value::integer(k)},
                   {"revindex", Value::integer(length - k)},
                   {"revindex0", Value::integer(length - k - 1)},
                   {"first", Value::boolean(k == 0)},
                   {"last", Value::boolean(k == length - 1)},
                   {"length", Value::integer(length)},
                   {"previtem", k > 0 ? items[static_cast<size_t>(k - 1)] : kUndefined},
                   {"nextitem", k + 1 < length ? items[static_cast<size_t>(k + 1)] : kUndefined}};
      loop.emplace_back("cycle", callable("loop.cycle", [k](Args& a, Kwargs&) {
                          if (a.empty()) throw DataError("loop.cycle() needs at least one value");
                          return a[static_cast<size_t>(k) % a.size()];
                        }));
      scopes_.back()["loop"] = Value::make_dict(std::move(loop));
      bind_targets(n, n.arg_names, items[static_cast<size_t>(k)]);
      const Flow f = exec(*n.kids[1], out);
      scopes_.pop_back();
      if (f == Flow::Break) break;
    }
    if (items.empty() && n.kids[2]) return exec(*n.kids[2], out);
    return Flow::Normal;
  }

  void exec_set(const Node& n) {
    Value v;
    if (n.kids[0]->kind == Node::Kind::Block) {
      TaggedString captured;
      exec(*n.kids[0], &captured);
      v = Value::string(std::move(captured));
    } else {
      v = eval(*n.kids[0]);
    }
    if (n.attr.empty()) {
      if (n.arg_names.size() == 1) scopes_.back()[n.name] = std::move(v);
      else bind_targets(n, n.arg_names, v);
      return;
    }
    const Value target = lookup(n.name);
    if (target.kind != Kind::Namespace)
      fail(n, fmt::format("cannot set '{}.{}': '{}' is not a namespace()", n.name, n.attr, n.name));
    for (auto& [k, old] : *target.dict)
      if (k == n.attr) {
        old = std::move(v);
        return;
      }
    target.dict->emplace_back(n.attr, std::move(v));
  }

  void define_macro(const Node& n) {
    const Node* macro = &n;
    scopes_.back()[n.name] = callable(n.name, [this, macro](Args& args, Kwargs& kwargs) {
      if (args.size() > macro->arg_names.size())
        fail(*macro, fmt::format("macro '{}' takes {} arguments, given {}", macro->name,
                                 macro->arg_names.size(), args.size()));
      if (++call_depth_ > kMaxCallDepth) fail(*macro, "macros call each other too deeply");
      Scope scope;
      for (size_t k = 0; k < macro->arg_names.size(); ++k) {
        const std::string& name = macro->arg_names[k];
        const Node* fallback = macro->kids[k + 1].get();
        Value v = k < args.size() ? args[k] : kUndefined;
        for (auto& [kw, kv] : kwargs)
          if (kw == name) v = kv;
        if (v.kind == Kind::Undefined && fallback) v = eval(*fallback);
        scope[name] = v;
      }
      // A macro sees the template's top-level names and its arguments.
      std::vector<Scope> saved(scopes_.begin() + 1, scopes_.end());
      scopes_.resize(1);
      scopes_.push_back(std::move(scope));
      TaggedString out;
      exec(*macro->kids[0], &out);
      scopes_.pop_back();
      scopes_.insert(scopes_.end(), saved.begin(), saved.end());
      --call_depth_;
      return Value::string(std::move(out));
    });
  }

  // ---- expressions ----
  Value eval(const Node& n) {
    step(n);
    switch (n.kind) {
      case Node::Kind::Literal: return n.literal;
      case Node::Kind::Name: return lookup(n.name);
      case Node::Kind::Attr: return attribute(n, eval(*n.kids[0]), n.name);
      case Node::Kind::Item: return item(n, eval(*n.kids[0]), eval(*n.kids[1]));
      case Node::Kind::Slice: return slice(n);
      case Node::Kind::ListLit: {
        List l;
        for (const auto& k : n.kids) l.push_back(eval(*k));
        return pair_or_list(std::move(l), n.op == "tuple");
      }
      case Node::Kind::DictLit: {
        Dict d;
        for (size_t k = 0; k + 1 < n.kids.size(); k += 2) {
          const Value key = eval(*n.kids[k]);
          if (key.kind != Kind::String) fail(n, "dict keys must be strings");
          std::erase_if(d, [&](const auto& kv) { return kv.first == key.s.text; });
          d.emplace_back(key.s.text, eval(*n.kids[k + 1]));
        }
        return Value::make_dict(std::move(d));
      }
      case Node::Kind::Call: {
        const Value f = eval(*n.kids[0]);
        if (f.kind != Kind::Callable)
          fail(n, f.kind == Kind::Undefined ? "a call of something undefined"
                                            : fmt::format("'{}' object is not callable", kind_name(f)));
        Args args;
        Kwargs kwargs;
        evaluate_arguments(n, 1, &args, &kwargs);
        return checked(n, [&] { return f.call->fn(args, kwargs); });
      }
      case Node::Kind::Filter: return filter(n);
      case Node::Kind::Test: {
        const bool r = test(n);
        return Value::boolean(n.negate ? !r : r);
      }
      case Node::Kind::Unary: {
        const Value v = eval(*n.kids[0]);
        if (n.op == "not") return Value::boolean(!truthy(v));
        if (!is_number(v)) fail(n, fmt::format("bad operand type for unary {}: '{}'", n.op, kind_name(v)));
        if (n.op == "+") return v.kind == Kind::Float ? v : Value::integer(as_int(v));
        return v.kind == Kind::Float ? Value::number(-v.f) : Value::integer(-as_int(v));
      }
      case Node::Kind::Binary: return binary(n);
      case Node::Kind::Cond:
        if (truthy(eval(*n.kids[0]))) return eval(*n.kids[1]);
        return n.kids[2] ? eval(*n.kids[2]) : kUndefined;
      default: fail(n, "a statement where a value was expected");
    }
  }

  // Runs a builtin, naming the template line in its errors.
  template <typename F>
  Value checked(const Node& n, F&& f) {
    try {
      return f();
    } catch (const DataError& e) {
      const std::string what = e.what();
      if (what.starts_with(display_)) throw;
      fail(n, what);
    }
  }

  void evaluate_arguments(const Node& n, size_t first, Args* args, Kwargs* kwargs) {
    for (size_t k = first; k < n.kids.size(); ++k) {
      const std::string& name = n.arg_names[k - first];
      if (name.empty()) args->push_back(eval(*n.kids[k]));
      else kwargs->emplace_back(name, eval(*n.kids[k]));
    }
  }

  Value attribute(const Node& n, const Value& v, const std::string& name) {
    if (v.kind == Kind::Undefined) fail(n, fmt::format("'{}' of something undefined", name));
    if (Value m = method(v, name); m.kind != Kind::Undefined) return m;
    if (v.kind == Kind::Dict || v.kind == Kind::Namespace) {
      const Value* f = v.find(name);
      return f ? *f : kUndefined;
    }
    return kUndefined;
  }

  Value item(const Node& n, const Value& v, const Value& key) {
    if (v.kind == Kind::Undefined) fail(n, fmt::format("{} of something undefined", py_repr(key)));
    if ((v.kind == Kind::List || v.kind == Kind::String) && (key.kind == Kind::Int || key.kind == Kind::Bool)) {
      const auto cps = v.kind == Kind::String ? code_points(v.s.text) : std::vector<size_t>{};
      const int64_t size = v.kind == Kind::List ? static_cast<int64_t>(v.list->size())
                                                : static_cast<int64_t>(cps.size()) - 1;
      int64_t k = as_int(key);
      if (k < 0) k += size;
      if (k < 0 || k >= size) return kUndefined;
      if (v.kind == Kind::List) return (*v.list)[static_cast<size_t>(k)];
      return Value::string(v.s.substr(cps[static_cast<size_t>(k)], cps[static_cast<size_t>(k) + 1] - cps[static_cast<size_t>(k)]));
    }
    if ((v.kind == Kind::Dict || v.kind == Kind::Namespace) && key.kind == Kind::String) {
      if (const Value* f = v.find(key.s.text)) return *f;
    }
    if (key.kind == Kind::String) return attribute(n, v, key.s.text);
    return kUndefined;
  }

  Value slice(const Node& n) {
    const Value v = eval(*n.kids[0]);
    const auto part = [&](int k) -> std::optional<int64_t> {
      if (!n.kids[static_cast<size_t>(k)]) return std::nullopt;
      const Value p = eval(*n.kids[static_cast<size_t>(k)]);
      if (p.kind == Kind::None) return std::nullopt;
      if (p.kind != Kind::Int) fail(n, "slice indices must be integers");
      return p.i;
    };
    const auto start = part(1), stop = part(2), stride = part(3);
    const int64_t step_by = stride.value_or(1);
    if (step_by == 0) fail(n, "slice step cannot be zero");
    if (v.kind != Kind::List && v.kind != Kind::String)
      fail(n, fmt::format("'{}' object cannot be sliced", kind_name(v)));
    const auto cps = v.kind == Kind::String ? code_points(v.s.text) : std::vector<size_t>{};
    const int64_t size = v.kind == Kind::List ? static_cast<int64_t>(v.list->size())
                                              : static_cast<int64_t>(cps.size()) - 1;
    // Python's slice.indices.
    const auto clamp = [&](std::optional<int64_t> x, int64_t fallback) {
      if (!x) return fallback;
      int64_t k = *x < 0 ? *x + size : *x;
      if (step_by > 0) return std::clamp<int64_t>(k, 0, size);
      return std::clamp<int64_t>(k, -1, size - 1);
    };
    const int64_t from = clamp(start, step_by > 0 ? 0 : size - 1);
    const int64_t to = clamp(stop, step_by > 0 ? size : -1);
    std::vector<int64_t> picked;
    for (int64_t k = from; step_by > 0 ? k < to : k > to; k += step_by) picked.push_back(k);
    if (v.kind == Kind::List) {
      List out;
      for (const int64_t k : picked) out.push_back((*v.list)[static_cast<size_t>(k)]);
      return Value::make_list(std::move(out));
    }
    TaggedString out;
    for (const int64_t k : picked)
      out.append(v.s.substr(cps[static_cast<size_t>(k)], cps[static_cast<size_t>(k) + 1] - cps[static_cast<size_t>(k)]));
    return Value::string(std::move(out));
  }

  Value binary(const Node& n) {
    const std::string& op = n.op;
    if (op == "and") {
      Value l = eval(*n.kids[0]);
      return truthy(l) ? eval(*n.kids[1]) : l;
    }
    if (op == "or") {
      Value l = eval(*n.kids[0]);
      return truthy(l) ? l : eval(*n.kids[1]);
    }
    const Value l = eval(*n.kids[0]), r = eval(*n.kids[1]);
    if (op == "~") {
      TaggedString s = py_str(l);
      s.append(py_str(r));
      return Value::string(std::move(s));
    }
    if (op == "==") return Value::boolean(equal(l, r));
    if (op == "!=") return Value::boolean(!equal(l, r));
    if (op == "in" || op == "not in") {
      bool found = false;
      if (r.kind == Kind::String && l.kind == Kind::String) found = r.s.text.find(l.s.text) != std::string::npos;
      else if (r.kind == Kind::List) found = std::any_of(r.list->begin(), r.list->end(), [&](const Value& x) { return equal(l, x); });
      else if ((r.kind == Kind::Dict || r.kind == Kind::Namespace) && l.kind == Kind::String) found = r.find(l.s.text);
      else if (r.kind == Kind::Undefined) found = false;
      else fail(n, fmt::format("'in <{}>' needs a string, list or dict", kind_name(r)));
      return Value::boolean(op == "in" ? found : !found);
    }
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      int c;
      if (is_number(l) && is_number(r)) c = as_double(l) < as_double(r) ? -1 : as_double(l) > as_double(r);
      else if (l.kind == Kind::String && r.kind == Kind::String) c = l.s.text.compare(r.s.text);
      else fail(n, fmt::format("'{}' not supported between '{}' and '{}'", op, kind_name(l), kind_name(r)));
      return Value::boolean(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
    }
    if (op == "+") {
      if (l.kind == Kind::String && r.kind == Kind::String) {
        TaggedString s = l.s;
        s.append(r.s);
        if (s.text.size() > kMaxOutputBytes) fail(n, "a string longer than the output bound");
        return Value::string(std::move(s));
      }
      if (l.kind == Kind::List && r.kind == Kind::List) {
        List out = *l.list;
        out.insert(out.end(), r.list->begin(), r.list->end());
        if (out.size() > kMaxListItems) fail(n, "a list longer than the bound");
        return Value::make_list(std::move(out));
      }
    }
    if (op == "*" && ((l.kind == Kind::String && r.kind == Kind::Int) || (l.kind == Kind::Int && r.kind == Kind::String))) {
      const Value& s = l.kind == Kind::String ? l : r;
      const int64_t times = std::max<int64_t>(0, l.kind == Kind::Int ? l.i : r.i);
      if (static_cast<double>(times) * static_cast<double>(s.s.text.size()) > kMaxOutputBytes)
        fail(n, "a string longer than the output bound");
      TaggedString out;
      for (int64_t k = 0; k < times; ++k) out.append(s.s);
      return Value::string(std::move(out));
    }
    if (!is_number(l) || !is_number(r))
      fail(n, fmt::format("unsupported operand types for {}: '{}' and '{}'", op, kind_name(l), kind_name(r)));
    const bool ints = l.kind != Kind::Float && r.kind != Kind::Float;
    const double a = as_double(l), b = as_double(r);
    if (op == "/") {
      if (b == 0) fail(n, "division by zero");
      return Value::number(a / b);
    }
    if (op == "//" || op == "%") {
      if (b == 0) fail(n, "division by zero");
      if (ints) {
        const int64_t x = as_int(l), y = as_int(r);
        if (x == INT64_MIN && y == -1) fail(n, "integer overflow");
        int64_t q = x / y, m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) --q, m += y;
        return Value::integer(op == "//" ? q : m);
      }
      const double q = std::floor(a / b);
      return Value::number(op == "//" ? q : a - q * b);
    }
    if (op == "**") {
      if (!ints || as_int(r) < 0) return Value::number(std::pow(a, b));
      const int64_t base = as_int(l), exponent = as_int(r);
      if (base == 0 || base == 1) return Value::integer(exponent == 0 ? 1 : base);
      if (base == -1) return Value::integer(exponent % 2 ? -1 : 1);
      int64_t out = 1;  // |base| >= 2 overflows within 63 steps
      for (int64_t k = 0; k < exponent; ++k)
        if (__builtin_mul_overflow(out, base, &out)) fail(n, "integer overflow");
      return Value::integer(out);
    }
    if (ints) {
      const int64_t x = as_int(l), y = as_int(r);
      int64_t out;
      const bool overflow = op == "+" ? __builtin_add_overflow(x, y, &out)
                            : op == "-" ? __builtin_sub_overflow(x, y, &out)
                                        : __builtin_mul_overflow(x, y, &out);
      if (overflow) fail(n, "integer overflow");
      return Value::integer(out);
    }
    return Value::number(op == "+" ? a + b : op == "-" ? a - b : a * b);
  }

  // ---- string and dict methods ----
  static TaggedString strip(const TaggedString& s, const Value& chars, bool left, bool right) {
    const auto drop = [&](char c) {
      return chars.kind == Kind::String ? chars.s.text.find(c) != std::string::npos : is_py_space(c);
    };
    size_t from = 0, to = s.text.size();
    if (left)
      while (from < to && drop(s.text[from])) ++from;
    if (right)
      while (to > from && drop(s.text[to - 1])) --to;
    return s.substr(from, to - from);
  }

  static List split(const TaggedString& s, const Value& sep, int64_t max_splits) {
    List out;
    if (sep.kind != Kind::String) {  // runs of whitespace, no empty pieces
      size_t k = 0;
      while (k < s.text.size()) {
        while (k < s.text.size() && is_py_space(s.text[k])) ++k;
        if (k == s.text.size()) break;
        size_t e = k;
        if (max_splits >= 0 && static_cast<int64_t>(out.size()) == max_splits) {
          size_t end = s.text.size();
          while (end > k && is_py_space(s.text[end - 1])) --end;
          out.push_back(Value::string(s.substr(k, end - k)));
          break;
        }
        while (e < s.text.size() && !is_py_space(s.text[e])) ++e;
        out.push_back(Value::string(s.substr(k, e - k)));
        k = e;
      }
      return out;
    }
    if (sep.s.text.empty()) throw DataError("split(): empty separator");
    size_t k = 0;
    for (;;) {
      const size_t f = s.text.find(sep.s.text, k);
      if (f == std::string::npos || (max_splits >= 0 && static_cast<int64_t>(out.size()) == max_splits)) {
        out.push_back(Value::string(s.substr(k)));
        return out;
      }
      out.push_back(Value::string(s.substr(k, f - k)));
      k = f + sep.s.text.size();
    }
  }

  static TaggedString replace(const TaggedString& s, const std::string& from, const TaggedString& to,
                              int64_t count) {
    if (from.empty()) return s;
    TaggedString out;
    size_t k = 0;
    for (int64_t done = 0; count < 0 || done < count; ++done) {
      const size_t f = s.text.find(from, k);
      if (f == std::string::npos) break;
      out.append(s.substr(k, f - k));
      out.append(to);
      k = f + from.size();
      if (out.text.size() > kMaxOutputBytes) throw DataError("replace(): a string longer than the output bound");
    }
    out.append(s.substr(k));
    return out;
  }

  static TaggedString map_case(const TaggedString& s, int (*f)(int)) {
    TaggedString out = s;
    for (char& c : out.text)
      if (static_cast<unsigned char>(c) < 0x80) c = static_cast<char>(f(c));
    return out;
  }

  static TaggedString title(const TaggedString& s, bool only_first) {
    TaggedString out = s;
    bool start = true;
    for (char& c : out.text) {
      // Bytes of non-ASCII characters count as letters (nearly all in chat text are).
      const bool alpha = std::isalpha(static_cast<unsigned char>(c)) != 0 || static_cast<unsigned char>(c) >= 0x80;
      if (static_cast<unsigned char>(c) < 0x80)
        c = static_cast<char>(start ? std::toupper(c) : only_first ? std::tolower(c) : (alpha ? std::tolower(c) : c));
      start = only_first ? false : !alpha;
    }
    return out;
  }

  static bool affix(const TaggedString& s, const Value& what, bool prefix) {
    const auto one = [&](const Value& w) {
      if (w.kind != Kind::String) throw DataError("startswith/endswith take a string or a tuple of them");
      return prefix ? s.text.starts_with(w.s.text) : s.text.ends_with(w.s.text);
    };
    if (what.kind == Kind::List) return std::any_of(what.list->begin(), what.list->end(), one);
    return one(what);
  }

  Value method(const Value& v, const std::string& name) {
    const Value self = v;
    const auto bind = [&](std::function<Value(Args&, Kwargs&)> fn) { return callable(name, std::move(fn)); };
    if (v.kind == Kind::String) {
      const TaggedString& s = v.s;
      if (name == "strip" || name == "lstrip" || name == "rstrip")
        return bind([s, name](Args& a, Kwargs& k) {
          const Value chars = arg(a, k, 0, "chars", &kNone, name);
          return Value::string(strip(s, chars, name != "rstrip", name != "lstrip"));
        });
      if (name == "split")
        return bind([s](Args& a, Kwargs& k) {
          const Value max = Value::integer(-1);
          return Value::make_list(split(s, arg(a, k, 0, "sep", &kNone, "split"),
                                        as_int(arg(a, k, 1, "maxsplit", &max, "split"))));
        });
      if (name == "startswith" || name == "endswith")
        return bind([s, name](Args& a, Kwargs& k) {
          return Value::boolean(affix(s, arg(a, k, 0, "prefix", nullptr, name), name == "startswith"));
        });
      if (name == "upper" || name == "lower")
        return bind([s, name](Args&, Kwargs&) {
          return Value::string(map_case(s, name == "upper" ? ::toupper : ::tolower));
        });
      if (name == "title" || name == "capitalize")
        return bind([s, name](Args&, Kwargs&) { return Value::string(title(s, name == "capitalize")); });
      if (name == "replace")
        return bind([s](Args& a, Kwargs& k) {
          const Value all = Value::integer(-1);
          const Value from = arg(a, k, 0, "old", nullptr, "replace"), to = arg(a, k, 1, "new", nullptr, "replace");
          if (from.kind != Kind::String || to.kind != Kind::String) throw DataError("replace() takes strings");
          return Value::string(replace(s, from.s.text, to.s, as_int(arg(a, k, 2, "count", &all, "replace"))));
        });
      if (name == "find" || name == "count")
        return bind([s, name](Args& a, Kwargs& k) {
          const Value w = arg(a, k, 0, "sub", nullptr, name);
          if (w.kind != Kind::String) throw DataError(name + "() takes a string");
          if (name == "find") {
            const size_t f = s.text.find(w.s.text);
            if (f == std::string::npos) return Value::integer(-1);
            return Value::integer(static_cast<int64_t>(code_points(s.text.substr(0, f)).size()) - 1);
          }
          if (w.s.text.empty()) return Value::integer(static_cast<int64_t>(code_points(s.text).size()));
          int64_t c = 0;
          for (size_t f = s.text.find(w.s.text); f != std::string::npos; f = s.text.find(w.s.text, f + w.s.text.size())) ++c;
          return Value::integer(c);
        });
    }
    if (v.kind == Kind::Dict) {
      if (name == "items" || name == "keys" || name == "values")
        return bind([self, name](Args&, Kwargs&) {
          List out;
          for (const auto& [key, val] : *self.dict) {
            if (name == "items") out.push_back(pair_or_list({Value::string(key), val}, true));
            else out.push_back(name == "keys" ? Value::string(key) : val);
          }
          return Value::make_list(std::move(out));
        });
      if (name == "get")
        return bind([self](Args& a, Kwargs& k) {
          const Value key = arg(a, k, 0, "key", nullptr, "get");
          const Value* f = key.kind == Kind::String ? self.find(key.s.text) : nullptr;
          return f ? *f : arg(a, k, 1, "default", &kNone, "get");
        });
    }
    return kUndefined;
  }

  // ---- filters and tests ----
  Value filter(const Node& n) {
    const Value v = eval(*n.kids[0]);
    Args args;
    Kwargs kwargs;
    evaluate_arguments(n, 1, &args, &kwargs);
    return checked(n, [&] { return apply_filter(n, n.name, v, args, kwargs); });
  }

  size_t length(const Node& n, const Value& v) {
    switch (v.kind) {
      case Kind::String: return code_points(v.s.text).size() - 1;
      case Kind::List: return v.list->size();
      case Kind::Dict:
      case Kind::Namespace: return v.dict->size();
      case Kind::Undefined: return 0;
      default: fail(n, fmt::format("object of type '{}' has no length", kind_name(v)));
    }
  }

  Value apply_filter(const Node& n, const std::string& name, const Value& v, Args& a, Kwargs& k) {
    const Value zero = Value::integer(0), empty = Value::string("");
    if (name == "trim") return Value::string(strip(py_str(v), arg(a, k, 0, "chars", &kNone, name), true, true));
    if (name == "length" || name == "count") return Value::integer(static_cast<int64_t>(length(n, v)));
    if (name == "tojson") {
      const Value indent = arg(a, k, 0, "indent", &kNone, name);
      std::string out;
      to_json(v, indent.kind == Kind::Int ? static_cast<int>(std::clamp<int64_t>(indent.i, 0, 64)) : -1, 0, &out);
      return Value::string(std::move(out));
    }
    if (name == "string") return Value::string(py_str(v));
    if (name == "safe") return v;
    if (name == "upper" || name == "lower") return Value::string(map_case(py_str(v), name == "upper" ? ::toupper : ::tolower));
    if (name == "capitalize" || name == "title") return Value::string(title(py_str(v), name == "capitalize"));
    if (name == "replace") {
      const Value from = arg(a, k, 0, "old", nullptr, name), to = arg(a, k, 1, "new", nullptr, name);
      const Value all = Value::integer(-1);
      return Value::string(replace(py_str(v), py_str(from).text, py_str(to), as_int(arg(a, k, 2, "count", &all, name))));
    }
    if (name == "default" || name == "d") {
      const Value fallback = arg(a, k, 0, "default_value", &empty, name);
      const bool boolean = truthy(arg(a, k, 1, "boolean", &kNone, name));
      return (v.kind == Kind::Undefined || (boolean && !truthy(v))) ? fallback : v;
    }
    if (name == "first" || name == "last") {
      const std::vector<Value> items = iterate(n, v);
      if (items.empty()) return kUndefined;
      return name == "first" ? items.front() : items.back();
    }
    if (name == "list") return Value::make_list(iterate(n, v));
    if (name == "reverse") {
      if (v.kind == Kind::String) {
        const auto cps = code_points(v.s.text);
        TaggedString out;
        for (size_t j = cps.size() - 1; j > 0; --j) out.append(v.s.substr(cps[j - 1], cps[j] - cps[j - 1]));
        return Value::string(std::move(out));
      }
      std::vector<Value> items = iterate(n, v);
      std::reverse(items.begin(), items.end());
      return Value::make_list(std::move(items));
    }
    if (name == "join") {
      const Value sep = arg(a, k, 0, "d", &empty, name), attr = arg(a, k, 1, "attribute", &kNone, name);
      TaggedString out;
      bool first = true;
      for (const Value& x : iterate(n, v)) {
        if (!first) out.append(py_str(sep));
        first = false;
        out.append(py_str(attr.kind == Kind::None ? x : attribute(n, x, py_str(attr).text)));
        if (out.text.size() > kMaxOutputBytes) fail(n, "join(): a string longer than the output bound");
      }
      return Value::string(std::move(out));
    }
    if (name == "items") {
      if (v.kind == Kind::Undefined) return Value::make_list();
      if (v.kind != Kind::Dict && v.kind != Kind::Namespace) fail(n, "the filter 'items' needs a dict");
      List out;
      for (const auto& [key, val] : *v.dict) out.push_back(pair_or_list({Value::string(key), val}, true));
      return Value::make_list(std::move(out));
    }
    if (name == "int") {
      if (v.kind == Kind::Float) return Value::integer(static_cast<int64_t>(v.f));
      if (is_number(v)) return Value::integer(as_int(v));
      if (v.kind == Kind::String) {
        const std::string t = strip(v.s, kNone, true, true).text;
        int64_t out = 0;
        const auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), out);
        if (ec == std::errc() && p == t.data() + t.size()) return Value::integer(out);
      }
      return arg(a, k, 0, "default", &zero, name);
    }
    if (name == "float") {
      if (is_number(v)) return Value::number(as_double(v));
      if (v.kind == Kind::String) {
        try {
          size_t used = 0;
          const std::string t = strip(v.s, kNone, true, true).text;
          const double f = std::stod(t, &used);
          if (used == t.size()) return Value::number(f);
        } catch (const std::exception&) {
        }
      }
      const Value zero_f = Value::number(0);
      return arg(a, k, 0, "default", &zero_f, name);
    }
    if (name == "abs") {
      if (!is_number(v)) fail(n, "abs() needs a number");
      return v.kind == Kind::Float ? Value::number(std::abs(v.f)) : Value::integer(std::abs(as_int(v)));
    }
    if (name == "indent") {
      const Value four = Value::integer(4), no = Value::boolean(false);
      const std::string pad(static_cast<size_t>(std::clamp<int64_t>(as_int(arg(a, k, 0, "width", &four, name)), 0, 256)), ' ');
      const bool first = truthy(arg(a, k, 1, "first", &no, name)), blank = truthy(arg(a, k, 2, "blank", &no, name));
      const TaggedString s = py_str(v);
      TaggedString out;
      size_t from = 0;
      for (bool first_line = true;; first_line = false) {
        const size_t nl = s.text.find('\n', from);
        const TaggedString line = s.substr(from, nl == std::string::npos ? std::string::npos : nl - from);
        if ((first_line ? first : true) && (blank || !line.text.empty())) out.append(TaggedString(pad));
        out.append(line);
        if (nl == std::string::npos) break;
        out.append(s.substr(nl, 1));
        from = nl + 1;
      }
      return Value::string(std::move(out));
    }
    if (name == "unique") {
      List out;
      for (const Value& x : iterate(n, v))
        if (std::none_of(out.begin(), out.end(), [&](const Value& y) { return equal(x, y); })) out.push_back(x);
      return Value::make_list(std::move(out));
    }
    if (name == "map" || name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      List out;
      for (const Value& x : iterate(n, v)) {
        if (name == "map") {
          const Value attr = arg(a, k, a.size(), "attribute", &kNone, name);  // keyword only
          if (attr.kind != Kind::None) {
            out.push_back(attribute(n, x, py_str(attr).text));
          } else {
            if (a.empty()) fail(n, "map() needs a filter name or attribute=");
            Args rest(a.begin() + 1, a.end());
            out.push_back(apply_filter(n, py_str(a[0]).text, x, rest, k));
          }
          continue;
        }
        const bool by_attr = name.ends_with("attr");
        const Value subject = by_attr ? attribute(n, x, py_str(arg(a, k, 0, "attribute", nullptr, name)).text) : x;
        const size_t test_at = by_attr ? 1 : 0;
        bool pass;
        if (a.size() <= test_at) {
          pass = truthy(subject);
        } else {
          Args rest(a.begin() + static_cast<std::ptrdiff_t>(test_at) + 1, a.end());
          pass = run_test(n, py_str(a[test_at]).text, subject, rest);
        }
        if (pass == (name == "select" || name == "selectattr")) out.push_back(x);
      }
      return Value::make_list(std::move(out));
    }
    fail(n, fmt::format("the filter '{}' is not supported", name));
  }

  bool test(const Node& n) {
    const Value v = eval(*n.kids[0]);
    Args args;
    Kwargs kwargs;
    evaluate_arguments(n, 1, &args, &kwargs);
    return run_test(n, n.name, v, args);
  }

  bool run_test(const Node& n, const std::string& name, const Value& v, const Args& a) {
    const auto other = [&]() -> const Value& {
      if (a.empty()) fail(n, fmt::format("the test '{}' needs a value to compare with", name));
      return a[0];
    };
    if (name == "defined") return v.kind != Kind::Undefined;
    if (name == "undefined") return v.kind == Kind::Undefined;
    if (name == "none") return v.kind == Kind::None;
    if (name == "boolean") return v.kind == Kind::Bool;
    if (name == "true") return v.kind == Kind::Bool && v.b;
    if (name == "false") return v.kind == Kind::Bool && !v.b;
    if (name == "integer") return v.kind == Kind::Int;
    if (name == "float") return v.kind == Kind::Float;
    if (name == "number") return is_number(v);
    if (name == "string") return v.kind == Kind::String;
    if (name == "mapping") return v.kind == Kind::Dict || v.kind == Kind::Namespace;
    if (name == "sequence") return v.kind == Kind::List || v.kind == Kind::String || v.kind == Kind::Dict;
    if (name == "iterable") return v.kind == Kind::List || v.kind == Kind::String || v.kind == Kind::Dict;
    if (name == "callable") return v.kind == Kind::Callable;
    if (name == "lower" || name == "upper") {
      if (v.kind != Kind::String) return false;
      return py_str(Value::string(map_case(v.s, name == "lower" ? ::tolower : ::toupper))).text == v.s.text;
    }
    if (name == "even" || name == "odd" || name == "divisibleby") {
      if (v.kind != Kind::Int) fail(n, fmt::format("the test '{}' needs an integer", name));
      const int64_t d = name == "divisibleby" ? as_int(other()) : 2;
      if (d == 0) fail(n, "divisibleby 0");
      const bool divisible = v.i % d == 0;
      return name == "odd" ? !divisible : divisible;
    }
    if (name == "eq" || name == "equalto" || name == "==") return equal(v, other());
    if (name == "ne" || name == "!=") return !equal(v, other());
    if (name == "sameas") return equal(v, other()) && v.kind == other().kind;
    if (name == "in") {
      const Value& c = other();
      if (c.kind == Kind::List) return std::any_of(c.list->begin(), c.list->end(), [&](const Value& x) { return equal(v, x); });
      if (c.kind == Kind::String && v.kind == Kind::String) return c.s.text.find(v.s.text) != std::string::npos;
      if ((c.kind == Kind::Dict || c.kind == Kind::Namespace) && v.kind == Kind::String) return c.find(v.s.text);
      fail(n, "the test 'in' needs a list, string or dict");
    }
    for (const char* op : {"lt", "le", "gt", "ge", "<", "<=", ">", ">="}) {
      if (name != op) continue;
      const Value& o = other();
      int c;
      if (is_number(v) && is_number(o)) c = as_double(v) < as_double(o) ? -1 : as_double(v) > as_double(o);
      else if (v.kind == Kind::String && o.kind == Kind::String) c = v.s.text.compare(o.s.text);
      else fail(n, fmt::format("the test '{}' cannot compare {} and {}", name, kind_name(v), kind_name(o)));
      const std::string s = name;
      return s == "lt" || s == "<" ? c < 0 : s == "le" || s == "<=" ? c <= 0 : s == "gt" || s == ">" ? c > 0 : c >= 0;
    }
    fail(n, fmt::format("the test '{}' is not supported", name));
  }

  // ---- globals ----
  void add_globals() {
    Scope& g = scopes_.front();
    g.emplace("range", callable("range", [](Args& a, Kwargs&) {
      for (const Value& x : a)
        if (x.kind != Kind::Int) throw DataError("range() takes integers");
      if (a.empty() || a.size() > 3) throw DataError("range() takes 1 to 3 integers");
      const int64_t start = a.size() > 1 ? a[0].i : 0, stop = a.size() > 1 ? a[1].i : a[0].i;
      const int64_t by = a.size() > 2 ? a[2].i : 1;
      if (by == 0) throw DataError("range() step must not be zero");
      List out;
      for (int64_t k = start; by > 0 ? k < stop : k > stop; k += by) {
        if (out.size() >= kMaxListItems) throw DataError(fmt::format("range() longer than {} items", kMaxListItems));
        out.push_back(Value::integer(k));
      }
      return Value::make_list(std::move(out));
    }));
    g.emplace("namespace", callable("namespace", [this](Args& a, Kwargs& k) {
      Value ns = Value::make_dict();
      ns.kind = Kind::Namespace;
      namespaces_.push_back(ns.dict);
      for (const Value& d : a)
        if (d.kind == Kind::Dict) ns.dict->insert(ns.dict->end(), d.dict->begin(), d.dict->end());
      for (auto& [key, val] : k) ns.dict->emplace_back(key, val);
      return ns;
    }));
    g.emplace("dict", callable("dict", [](Args&, Kwargs& k) { return Value::make_dict(Dict(k.begin(), k.end())); }));
    g.emplace("raise_exception", callable("raise_exception", [](Args& a, Kwargs&) -> Value {
      throw DataError(fmt::format("the chat template refuses the input: {}",
                                  a.empty() ? std::string("(no message)") : py_str(a[0]).text));
    }));
    g.emplace("strftime_now", callable("strftime_now", [](Args& a, Kwargs&) {
      if (a.empty() || a[0].kind != Kind::String) throw DataError("strftime_now() takes a format string");
      const std::time_t now = std::time(nullptr);
      std::tm local{};
      localtime_r(&now, &local);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof buf, a[0].s.text.c_str(), &local);
      return Value::string(std::string(buf, n));
    }));
  }

  const std::string& display_;
  std::vector<Scope> scopes_;
  // A namespace may come to hold itself (set ns.me = [ns]); emptied after the render, none
  // outlives it.
  std::vector<std::shared_ptr<Dict>> namespaces_;
  uint64_t steps_ = 0;
  int call_depth_ = 0;
};

}  // namespace

Value from_json(const nlohmann::ordered_json& j, uint8_t tag) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      if (j.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) return Value::number(j.get<double>());
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_float: return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::string(j.get<std::string>(), tag);
    case nlohmann::ordered_json::value_t::array: {
      List l;
      for (const auto& x : j) l.push_back(from_json(x, tag));
      return Value::make_list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      for (const auto& [k, v] : j.items()) d.emplace_back(k, from_json(v, tag));
      return Value::make_dict(std::move(d));
    }
    default: return Value();
  }
}

Template::Template(const std::string& source, std::string display)
    : display_(std::move(display)), root_(parse_template(source, display_)) {}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;

TaggedString Template::render(const std::map<std::string, Value>& context) const {
  return Renderer(display_, context).run(*root_);
}

}  // namespace tessera::jinja
