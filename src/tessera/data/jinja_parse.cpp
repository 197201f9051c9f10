// Jinja source -> syntax tree: the template is cut into text and tags with jinja2's
// whitespace rules (as transformers configures them: trim_blocks, lstrip_blocks), each tag's
// inside is tokenized, and a recursive-descent parser with jinja2's precedence builds nodes.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <optional>

#include "tessera/core/error.h"
#include "tessera/data/jinja_ast.h"

namespace tessera::jinja {
namespace {

using Node = Template::Node;
using NodePtr = std::unique_ptr<Node>;
constexpr int kMaxNesting = 200;  // statements and expressions: deeper is a hostile template

// One piece of the source: text, or a tag's inside with its whitespace-control marks.
struct Piece {
  enum class Kind { Text, Var, Block, Comment } kind;
  std::string text;
  int line = 0;
  char left = 0, right = 0;  // '-' or '+' just inside the delimiters, else 0
};

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// Cuts the source into pieces and applies the whitespace rules to the text between tags.
std::vector<Piece> split_pieces(const std::string& src, const std::string& display) {
  std::vector<Piece> pieces;
  size_t i = 0;
  int line = 1;
  const auto count_lines = [&](size_t from, size_t to) {
    for (size_t k = from; k < to; ++k) line += src[k] == '\n';
  };
  while (i < src.size()) {
    size_t open = i;
    while (open + 1 < src.size() &&
           !(src[open] == '{' && (src[open + 1] == '{' || src[open + 1] == '%' || src[open + 1] == '#')))
      ++open;
    if (open + 1 >= src.size()) open = src.size();
    if (open > i) pieces.push_back({Piece::Kind::Text, src.substr(i, open - i), line});
    count_lines(i, open);
    if (open == src.size()) break;
    const char type = src[open + 1];
    Piece p{type == '{' ? Piece::Kind::Var : type == '%' ? Piece::Kind::Block : Piece::Kind::Comment,
            "", line};
    size_t body = open + 2;
    if (body < src.size() && (src[body] == '-' || src[body] == '+')) p.left = src[body++];
    const char close = type == '{' ? '}' : type;
    size_t end = body;
    char quote = 0;
    for (; end + 1 < src.size(); ++end) {
      const char c = src[end];
      if (type != '#' && quote) {
        if (c == '\\') ++end;
        else if (c == quote) quote = 0;
      } else if (type != '#' && (c == '\'' || c == '"')) {
        quote = c;
      } else if (c == close && src[end + 1] == '}') {
        break;
      }
    }
    if (end + 1 >= src.size())
      throw DataError(fmt::format("{} line {}: a '{{{}' that is never closed", display, line, type));
    size_t inner_end = end;
    if (inner_end > body && (src[inner_end - 1] == '-' || src[inner_end - 1] == '+')) {
      p.right = src[inner_end - 1];
      --inner_end;
    }
    p.text = src.substr(body, inner_end - body);
    count_lines(open, end + 2);
    i = end + 2;
    pieces.push_back(std::move(p));
  }
  // Whitespace control, on the text beside each tag.
  for (size_t k = 0; k < pieces.size(); ++k) {
    if (pieces[k].kind != Piece::Kind::Text) continue;
    std::string& t = pieces[k].text;
    const Piece* prev = k > 0 ? &pieces[k - 1] : nullptr;
    const Piece* next = k + 1 < pieces.size() ? &pieces[k + 1] : nullptr;
    if (next && next->left == '-') {
      while (!t.empty() && is_space(t.back())) t.pop_back();
    } else if (next && next->kind != Piece::Kind::Var && next->left != '+') {
      // lstrip_blocks: blanks between a line's start and a block tag go. The template's
      // start is a line's start; blanks right after a tag are on that tag's line.
      size_t cut = t.size();
      while (cut > 0 && (t[cut - 1] == ' ' || t[cut - 1] == '\t')) --cut;
      if (cut > 0 ? t[cut - 1] == '\n' : k == 0) t.resize(cut);
    }
    if (prev && prev->right == '-') {
      size_t from = 0;
      while (from < t.size() && is_space(t[from])) ++from;
      t.erase(0, from);
    } else if (prev && prev->kind != Piece::Kind::Var && prev->right != '+') {
      // trim_blocks: the newline right after a block tag goes.
      if (t.starts_with("\r\n")) t.erase(0, 2);
      else if (t.starts_with("\n")) t.erase(0, 1);
    }
  }
  // Comments leave nothing behind; dropping them last kept their whitespace rules above.
  std::erase_if(pieces, [](const Piece& p) { return p.kind == Piece::Kind::Comment; });
  return pieces;
}

struct Token {
  enum class Kind { Name, Int, Float, String, Op, End } kind;
  std::string text;  // Name: the name; String: the unescaped value; Op: the operator
  int64_t i = 0;
  double f = 0;
};

// Python's unicode-escape, as jinja2 reads string literals.
void append_utf8(std::string* out, uint32_t cp) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::vector<Token> tokenize(const std::string& s, const std::string& where) {
  std::vector<Token> out;
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (is_space(c)) {
      ++i;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      out.push_back({Token::Kind::Name, s.substr(i, j - i)});
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      while (j < s.size() && (std::isdigit(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      bool is_float = false;
      if (j + 1 < s.size() && s[j] == '.' && std::isdigit(static_cast<unsigned char>(s[j + 1]))) {
        is_float = true;
        for (++j; j < s.size() && std::isdigit(static_cast<unsigned char>(s[j])); ++j) {
        }
      }
      if (j < s.size() && (s[j] == 'e' || s[j] == 'E')) {
        size_t k = j + 1;
        if (k < s.size() && (s[k] == '+' || s[k] == '-')) ++k;
        if (k < s.size() && std::isdigit(static_cast<unsigned char>(s[k]))) {
          is_float = true;
          for (j = k; j < s.size() && std::isdigit(static_cast<unsigned char>(s[j])); ++j) {
          }
        }
      }
      std::string digits;
      for (size_t k = i; k < j; ++k)
        if (s[k] != '_') digits += s[k];
      Token t{is_float ? Token::Kind::Float : Token::Kind::Int, digits};
      try {
        if (is_float) t.f = std::stod(digits);
        else t.i = std::stoll(digits);
      } catch (const std::exception&) {
        throw DataError(fmt::format("{}: the number {} is out of range", where, digits));
      }
      out.push_back(std::move(t));
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string v;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] != '\\' || j + 1 >= s.size()) {
          v += s[j];
          continue;
        }
        const char e = s[++j];
        const auto hex = [&](int n) -> std::optional<uint32_t> {
          if (j + n >= s.size()) return std::nullopt;
          uint32_t cp = 0;
          for (int k = 1; k <= n; ++k) {
            const char h = s[j + k];
            if (!std::isxdigit(static_cast<unsigned char>(h))) return std::nullopt;
            cp = cp * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h))
                                                     ? h - '0'
                                                     : std::tolower(h) - 'a' + 10);
          }
          return cp;
        };
        switch (e) {
          case 'n': v += '\n'; break;
          case 't': v += '\t'; break;
          case 'r': v += '\r'; break;
          case '0': v += '\0'; break;
          case 'a': v += '\a'; break;
          case 'b': v += '\b'; break;
          case 'f': v += '\f'; break;
          case 'v': v += '\v'; break;
          case '\\': case '\'': case '"': v += e; break;
          case 'x': case 'u': case 'U': {
            const int n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            const auto cp = hex(n);
            if (!cp || *cp > 0x10FFFF)
              throw DataError(fmt::format("{}: a bad \\{} escape in a string", where, e));
            append_utf8(&v, *cp);
            j += n;
            break;
          }
          default: v += '\\', v += e;
        }
      }
      if (j >= s.size()) throw DataError(fmt::format("{}: a string that is never closed", where));
      out.push_back({Token::Kind::String, std::move(v)});
      i = j + 1;
    } else {
      static const char* const kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/",
                                         "%",  "~",  "<",  ">",  "=",  "|", ".", ",", ":", "(",
                                         ")",  "[",  "]",  "{",  "}"};
      const char* found = nullptr;
      for (const char* op : kOps)
        if (s.compare(i, std::char_traits<char>::length(op), op) == 0) {
          found = op;
          break;
        }
      if (!found) throw DataError(fmt::format("{}: unexpected character '{}'", where, c));
      out.push_back({Token::Kind::Op, found});
      i += std::char_traits<char>::length(found);
    }
  }
  out.push_back({Token::Kind::End, ""});
  return out;
}

// Parses the expressions of one tag.
class ExprParser {
 public:
  ExprParser(std::vector<Token> tokens, std::string where, int line)
      : t_(std::move(tokens)), where_(std::move(where)), line_(line) {}

  bool at_end() const { return t_[p_].kind == Token::Kind::End; }
  bool at_name(const char* name) const {
    return t_[p_].kind == Token::Kind::Name && t_[p_].text == name;
  }
  bool at_op(const char* op) const { return t_[p_].kind == Token::Kind::Op && t_[p_].text == op; }
  bool take_name(const char* name) { return at_name(name) ? (++p_, true) : false; }
  bool take_op(const char* op) { return at_op(op) ? (++p_, true) : false; }
  std::string name() {
    if (t_[p_].kind != Token::Kind::Name) fail("a name");
    return t_[p_++].text;
  }
  void expect_op(const char* op) {
    if (!take_op(op)) fail(fmt::format("'{}'", op));
  }
  void expect_end() {
    if (!at_end()) fail("the end of the tag");
  }
  [[noreturn]] void fail(const std::string& expected) const {
    const Token& t = t_[p_];
    throw DataError(fmt::format("{}: expected {}, found {}", where_, expected,
                                t.kind == Token::Kind::End ? "the end of the tag" : "'" + t.text + "'"));
  }

  NodePtr expression(bool with_condition = true) {
    Depth d(this);
    NodePtr e = or_expr();
    if (!with_condition) return e;
    while (take_name("if")) {
      auto n = node(Node::Kind::Cond);
      n->kids.push_back(or_expr());
      n->kids.push_back(std::move(e));
      n->kids.push_back(take_name("else") ? expression() : nullptr);
      e = std::move(n);
    }
    return e;
  }

  // `a, b` where a tuple may stand without parentheses (for targets, set values).
  NodePtr tuple_or_expression() {
    NodePtr first = expression();
    if (!at_op(",")) return first;
    auto list = node(Node::Kind::ListLit);
    list->op = "tuple";
    list->kids.push_back(std::move(first));
    while (take_op(",") && !at_end()) list->kids.push_back(expression());
    return list;
  }

 private:
  struct Depth {
    explicit Depth(ExprParser* p) : p_(p) {
      if (++p_->depth_ > kMaxNesting)
        throw DataError(fmt::format("{}: expressions nested deeper than {}", p_->where_, kMaxNesting));
    }
    ~Depth() { --p_->depth_; }
    ExprParser* p_;
  };
  NodePtr node(Node::Kind k) { return std::make_unique<Node>(k, line_); }
  NodePtr binary(std::string op, NodePtr l, NodePtr r) {
    auto n = node(Node::Kind::Binary);
    n->op = std::move(op);
    n->kids.push_back(std::move(l));
    n->kids.push_back(std::move(r));
    return n;
  }

  NodePtr or_expr() {
    NodePtr l = and_expr();
    while (take_name("or")) l = binary("or", std::move(l), and_expr());
    return l;
  }
  NodePtr and_expr() {
    NodePtr l = not_expr();
    while (take_name("and")) l = binary("and", std::move(l), not_expr());
    return l;
  }
  NodePtr not_expr() {
    if (take_name("not")) {
      Depth d(this);
      auto n = node(Node::Kind::Unary);
      n->op = "not";
      n->kids.push_back(not_expr());
      return n;
    }
    return compare();
  }
  NodePtr compare() {
    NodePtr l = math1();
    for (;;) {
      std::string op;
      for (const char* o : {"==", "!=", "<=", ">=", "<", ">"})
        if (take_op(o)) {
          op = o;
          break;
        }
      if (op.empty() && take_name("in")) op = "in";
      if (op.empty() && at_name("not") && t_[p_ + 1].kind == Token::Kind::Name &&
          t_[p_ + 1].text == "in") {
        p_ += 2;
        op = "not in";
      }
      if (op.empty()) return l;
      l = binary(op, std::move(l), math1());
    }
  }
  NodePtr math1() {
    NodePtr l = concat();
    for (;;) {
      if (take_op("+")) l = binary("+", std::move(l), concat());
      else if (take_op("-")) l = binary("-", std::move(l), concat());
      else return l;
    }
  }
  NodePtr concat() {
    NodePtr l = math2();
    while (take_op("~")) l = binary("~", std::move(l), math2());
    return l;
  }
  NodePtr math2() {
    NodePtr l = power();
    for (;;) {
      std::string op;
      for (const char* o : {"//", "*", "/", "%"})
        if (take_op(o)) {
          op = o;
          break;
        }
      if (op.empty()) return l;
      l = binary(op, std::move(l), power());
    }
  }
  NodePtr power() {
    NodePtr l = unary();
    while (take_op("**")) l = binary("**", std::move(l), unary());
    return l;
  }
  // As jinja2: `-x | f` is `(-x) | f`, the sign taken before the filters.
  NodePtr unary(bool with_filters = true) {
    Depth d(this);
    NodePtr e;
    if (at_op("-") || at_op("+")) {
      e = node(Node::Kind::Unary);
      e->op = t_[p_++].text;
      e->kids.push_back(unary(false));
    } else {
      e = postfix(primary());
    }
    return with_filters ? filters(std::move(e)) : std::move(e);
  }

  NodePtr primary() {
    Depth d(this);
    const Token& t = t_[p_];
    if (t.kind == Token::Kind::String) {
      std::string v;
      while (t_[p_].kind == Token::Kind::String) v += t_[p_++].text;  // adjacent ones join
      auto n = node(Node::Kind::Literal);
      n->literal = Value::string(std::move(v));
      return n;
    }
    if (t.kind == Token::Kind::Int || t.kind == Token::Kind::Float) {
      auto n = node(Node::Kind::Literal);
      n->literal = t.kind == Token::Kind::Int ? Value::integer(t.i) : Value::number(t.f);
      ++p_;
      return n;
    }
    if (t.kind == Token::Kind::Name) {
      ++p_;
      auto n = node(Node::Kind::Literal);
      if (t.text == "true" || t.text == "True") n->literal = Value::boolean(true);
      else if (t.text == "false" || t.text == "False") n->literal = Value::boolean(false);
      else if (t.text == "none" || t.text == "None") n->literal = Value::none();
      else {
        n->kind = Node::Kind::Name;
        n->name = t.text;
      }
      return n;
    }
    if (take_op("(")) {
      if (take_op(")")) {
        auto empty = node(Node::Kind::ListLit);
        empty->op = "tuple";
        return empty;
      }
      NodePtr e = expression();
      if (at_op(",")) {
        auto list = node(Node::Kind::ListLit);
        list->op = "tuple";
        list->kids.push_back(std::move(e));
        while (take_op(",") && !at_op(")")) list->kids.push_back(expression());
        e = std::move(list);
      }
      expect_op(")");
      return e;
    }
    if (take_op("[")) {
      auto list = node(Node::Kind::ListLit);
      while (!at_op("]")) {
        list->kids.push_back(expression());
        if (!take_op(",")) break;
      }
      expect_op("]");
      return list;
    }
    if (take_op("{")) {
      auto dict = node(Node::Kind::DictLit);
      while (!at_op("}")) {
        dict->kids.push_back(expression());
        expect_op(":");
        dict->kids.push_back(expression());
        if (!take_op(",")) break;
      }
      expect_op("}");
      return dict;
    }
    fail("a value");
  }

  // Arguments of a call, filter or test, after its '('.
  void arguments(Node* n) {
    while (!take_op(")")) {
      if (t_[p_].kind == Token::Kind::Name && t_[p_ + 1].kind == Token::Kind::Op &&
          t_[p_ + 1].text == "=") {
        n->arg_names.push_back(t_[p_].text);
        p_ += 2;
      } else {
        if (!n->arg_names.empty() && !n->arg_names.back().empty())
          fail("a keyword argument (positional ones come first)");
        n->arg_names.emplace_back();
      }
      n->kids.push_back(expression());
      if (!take_op(",")) {
        expect_op(")");
        break;
      }
    }
  }

  NodePtr postfix(NodePtr e) {
    for (;;) {
      Depth d(this);
      if (take_op(".")) {
        auto n = node(Node::Kind::Attr);
        if (t_[p_].kind == Token::Kind::Int) {  // x.0 is x[0]
          n->kind = Node::Kind::Item;
          n->kids.push_back(std::move(e));
          auto idx = node(Node::Kind::Literal);
          idx->literal = Value::integer(t_[p_++].i);
          n->kids.push_back(std::move(idx));
        } else {
          n->name = name();
          n->kids.push_back(std::move(e));
        }
        e = std::move(n);
      } else if (take_op("[")) {
        NodePtr parts[3];
        int colons = 0;
        while (!at_op("]")) {
          if (take_op(":")) {
            if (++colons > 2) fail("']'");
            continue;
          }
          if (parts[colons]) fail("':' or ']'");
          parts[colons] = expression();
        }
        expect_op("]");
        auto n = node(colons ? Node::Kind::Slice : Node::Kind::Item);
        n->kids.push_back(std::move(e));
        if (!colons && !parts[0]) fail("an index");
        for (int k = 0; k < (colons ? 3 : 1); ++k) n->kids.push_back(std::move(parts[k]));
        e = std::move(n);
      } else if (take_op("(")) {
        auto n = node(Node::Kind::Call);
        n->kids.push_back(std::move(e));
        arguments(n.get());
        e = std::move(n);
      } else {
        return e;
      }
    }
  }

  NodePtr filters(NodePtr e) {
    for (;;) {
      Depth d(this);
      if (take_op("|")) {
        auto n = node(Node::Kind::Filter);
        n->name = name();
        while (take_op(".")) n->name += "." + name();
        n->kids.push_back(std::move(e));
        if (take_op("(")) arguments(n.get());
        e = std::move(n);
      } else if (take_name("is")) {
        auto n = node(Node::Kind::Test);
        n->negate = take_name("not");
        n->name = name();
        n->kids.push_back(std::move(e));
        if (take_op("(")) {
          arguments(n.get());
        } else if (t_[p_].kind == Token::Kind::String || t_[p_].kind == Token::Kind::Int ||
                   t_[p_].kind == Token::Kind::Float ||
                   (t_[p_].kind == Token::Kind::Name && !at_name("and") && !at_name("or") &&
                    !at_name("if") && !at_name("else") && !at_name("in") && !at_name("not") &&
                    !at_name("is"))) {
          n->arg_names.emplace_back();  // `x is divisibleby 3`: one argument, no parentheses
          n->kids.push_back(postfix(primary()));
        }
        e = std::move(n);
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  size_t p_ = 0;
  std::string where_;
  int line_;
  int depth_ = 0;
};

// Parses the statements of a template.
class StatementParser {
 public:
  StatementParser(std::vector<Piece> pieces, const std::string& display)
      : pieces_(std::move(pieces)), display_(display) {}

  NodePtr parse() {
    std::string end;
    NodePtr body = block({}, &end);
    return body;
  }

 private:
  std::string where(int line) const { return fmt::format("{} line {}", display_, line); }

  // Statements until a block tag whose first word is one of `ends` (its name in *end; the
  // tag's parser is left positioned after that word) or the end of the template.
  NodePtr block(const std::vector<std::string>& ends, std::string* end) {
    if (++depth_ > kMaxNesting)
      throw DataError(fmt::format("{}: statements nested deeper than {}",
                                  where(k_ < pieces_.size() ? pieces_[k_].line : 0), kMaxNesting));
    auto body = std::make_unique<Node>(Node::Kind::Block, k_ < pieces_.size() ? pieces_[k_].line : 0);
    for (; k_ < pieces_.size(); ++k_) {
      const Piece& p = pieces_[k_];
      if (p.kind == Piece::Kind::Text) {
        auto t = std::make_unique<Node>(Node::Kind::Text, p.line);
        t->literal = Value::string(p.text);
        body->kids.push_back(std::move(t));
        continue;
      }
      tag_ = std::make_unique<ExprParser>(tokenize(p.text, where(p.line)), where(p.line), p.line);
      if (p.kind == Piece::Kind::Var) {
        auto out = std::make_unique<Node>(Node::Kind::Output, p.line);
        out->kids.push_back(tag_->tuple_or_expression());
        tag_->expect_end();
        body->kids.push_back(std::move(out));
        continue;
      }
      const std::string word = tag_->name();
      if (std::find(ends.begin(), ends.end(), word) != ends.end()) {
        *end = word;
        --depth_;
        return body;
      }
      body->kids.push_back(statement(word, p.line));
    }
    if (!ends.empty())
      throw DataError(fmt::format("{}: the template ends inside a block; expected {{% {} %}}",
                                  display_, ends.back()));
    --depth_;
    return body;
  }

  // Moves past the tag that ended a block, checking nothing follows its word.
  void close_tag() {
    tag_->expect_end();
    ++k_;
  }

  NodePtr statement(const std::string& word, int line) {
    if (word == "if") {
      auto n = std::make_unique<Node>(Node::Kind::If, line);
      for (;;) {
        n->kids.push_back(tag_->expression());
        tag_->expect_end();
        ++k_;
        std::string end;
        n->kids.push_back(block({"elif", "else", "endif"}, &end));
        if (end == "elif") continue;
        if (end == "else") {
          close_tag();
          n->kids.push_back(block({"endif"}, &end));
        }
        close_tag();
        --k_;  // the caller's loop moves past the endif
        return n;
      }
    }
    if (word == "for") {
      auto n = std::make_unique<Node>(Node::Kind::For, line);
      do n->arg_names.push_back(tag_->name());
      while (tag_->take_op(","));
      if (!tag_->take_name("in")) tag_->fail("'in'");
      NodePtr iter = tag_->expression(false);
      NodePtr filter = tag_->take_name("if") ? tag_->expression(false) : nullptr;
      if (tag_->take_name("recursive")) tag_->fail("a loop without 'recursive' (not supported)");
      tag_->expect_end();
      ++k_;
      std::string end;
      n->kids.push_back(std::move(iter));
      n->kids.push_back(block({"else", "endfor"}, &end));
      n->kids.push_back(nullptr);
      if (end == "else") {
        close_tag();
        n->kids[2] = block({"endfor"}, &end);
      }
      n->kids.push_back(std::move(filter));
      close_tag();
      --k_;
      return n;
    }
    if (word == "set") {
      auto n = std::make_unique<Node>(Node::Kind::Set, line);
      n->name = tag_->name();
      if (tag_->take_op(".")) n->attr = tag_->name();
      n->arg_names.push_back(n->name);
      while (n->attr.empty() && tag_->take_op(",")) n->arg_names.push_back(tag_->name());
      if (tag_->take_op("=")) {
        n->kids.push_back(tag_->tuple_or_expression());
        tag_->expect_end();
        return n;
      }
      tag_->expect_end();
      ++k_;
      std::string end;
      n->kids.push_back(block({"endset"}, &end));
      close_tag();
      --k_;
      return n;
    }
    if (word == "macro") {
      auto n = std::make_unique<Node>(Node::Kind::Macro, line);
      n->name = tag_->name();
      n->kids.push_back(nullptr);  // the body, below
      tag_->expect_op("(");
      while (!tag_->take_op(")")) {
        n->arg_names.push_back(tag_->name());
        n->kids.push_back(tag_->take_op("=") ? tag_->expression() : nullptr);
        if (!tag_->take_op(",")) {
          tag_->expect_op(")");
          break;
        }
      }
      tag_->expect_end();
      ++k_;
      std::string end;
      n->kids[0] = block({"endmacro"}, &end);
      close_tag();
      --k_;
      return n;
    }
    if (word == "generation") {  // transformers' marker of assistant text: rendered as is
      tag_->expect_end();
      ++k_;
      std::string end;
      NodePtr body = block({"endgeneration"}, &end);
      close_tag();
      --k_;
      return body;
    }
    if (word == "break" || word == "continue") {
      tag_->expect_end();
      return std::make_unique<Node>(word == "break" ? Node::Kind::Break : Node::Kind::Continue, line);
    }
    throw DataError(fmt::format(
        "{}: the statement '{}' is not supported (expected if, for, set, macro, generation, "
        "break or continue)",
        where(line), word));
  }

  std::vector<Piece> pieces_;
  const std::string& display_;
  size_t k_ = 0;
  int depth_ = 0;
  std::unique_ptr<ExprParser> tag_;
};

}  // namespace

NodePtr parse_template(const std::string& source, const std::string& display) {
  // jinja2 drops the template's own final newline (keep_trailing_newline=False).
  std::string body = source;
  if (body.ends_with("\r\n")) body.resize(body.size() - 2);
  else if (body.ends_with("\n")) body.pop_back();
  return StatementParser(split_pieces(body, display), display).parse();
}

}  // namespace tessera::jinja
