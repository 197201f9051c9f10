#pragma once
// The syntax tree jinja_parse.cpp builds and jinja_render.cpp walks (internal to jinja).
#include <memory>
#include <string>
#include <vector>

#include "tessera/data/jinja.h"

namespace tessera::jinja {

struct Template::Node {
  enum class Kind {
    // Expressions.
    Literal,   // literal
    Name,      // name
    Attr,      // kids[0].name
    Item,      // kids[0][kids[1]]
    Slice,     // kids[0][kids[1]:kids[2]:kids[3]] (absent parts are null)
    Call,      // kids[0](args): kids[1..] with arg_names (empty for positional)
    Filter,    // kids[0] | name(args): kids[1..] with arg_names
    Test,      // kids[0] is [not] name(args): kids[1..]; negate
    Unary,     // op kids[0]: "-", "+", "not"
    Binary,    // kids[0] op kids[1]: arithmetic, comparison, "in", "not in", "~", "and", "or"
    Cond,      // kids[1] if kids[0] else kids[2] (kids[2] null: undefined)
    ListLit,   // [kids...], and (kids...,) with op "tuple"
    DictLit,   // {kids[0]: kids[1], ...}
    // Statements.
    Block,     // kids in order
    Text,      // literal text
    Output,    // {{ kids[0] }}
    If,        // kids: cond, body, cond, body, ..., [else body] (odd count: the last is else)
    For,       // names in kids[0]; kids[1] body; kids[2] else (may be null); kids[3] filter
    Set,       // arg_names (or name.attr) = kids[0]; a block set has kids[0] of kind Block
    Macro,     // name(arg_names, defaults in kids[1..] null when none) with body kids[0]
    Break,
    Continue,
  };
  Kind kind;
  int line = 0;
  std::string name, attr, op;
  Value literal;
  bool negate = false;
  std::vector<std::string> arg_names;  // Call/Filter/Test keyword names; For targets; Macro params
  std::vector<std::unique_ptr<Node>> kids;

  Node(Kind k, int l) : kind(k), line(l) {}
};

std::unique_ptr<Template::Node> parse_template(const std::string& source, const std::string& display);

}  // namespace tessera::jinja
