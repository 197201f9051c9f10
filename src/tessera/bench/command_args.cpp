#include "tessera/bench/command_args.h"

#include <fmt/format.h>

#include "tessera/core/command_line.h"
#include "tessera/core/error.h"

namespace tessera::bench {
namespace {

int64_t parse_int(const std::string& name, const std::string& text, int64_t min) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || v < min)
    throw ConfigError("command line", name, text, fmt::format("an integer >= {}", min));
  return v;
}

std::set<std::string> option_names(const std::set<std::string>& names) {
  std::set<std::string> out;
  for (const std::string& n : names) out.insert(option_name(n));
  return out;
}

}  // namespace

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const size_t end = comma == std::string::npos ? text.size() : comma;
    if (end > start) out.push_back(text.substr(start, end - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

CommandArgs::CommandArgs(const std::vector<std::string>& args,
                         const std::set<std::string>& declared_valued,
                         const std::set<std::string>& declared_flags, bool pass_unknown) {
  const std::set<std::string> valued = option_names(declared_valued);
  const std::set<std::string> flags = option_names(declared_flags);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (!a.starts_with("-") || a == "-") {
      positional_.push_back(a);
      continue;
    }
    std::string name, value;
    bool inline_value = false;
    if (const auto option = parse_command_line_option(a)) {
      name = option->name;
      inline_value = option->value.has_value();
      value = option->value.value_or("");
    } else {
      // Short options: -o is --output; others (-n) are spelled as their long name.
      name = a == "-o" ? "output" : option_name(a.substr(a.starts_with("--") ? 2 : 1));
    }
    if (flags.contains(name)) {
      if (inline_value) throw ConfigError("command line", name, value, "no value (a flag)");
      values_[name] = "";
    } else if (valued.contains(name)) {
      if (!inline_value) {
        if (i + 1 >= args.size()) throw ConfigError("command line", name, "", "a value after " + a);
        value = args[++i];
      }
      values_[name] = value;
    } else if (pass_unknown) {
      unknown_.push_back(a);
      if (!inline_value && i + 1 < args.size() && !args[i + 1].starts_with("--"))
        unknown_.push_back(args[++i]);
    } else {
      std::string known;
      for (const auto& n : valued) known += " --" + n;
      for (const auto& n : flags) known += " --" + n;
      throw ConfigError("command line", name, value, "one of the options:" + known);
    }
  }
}

bool CommandArgs::has(const std::string& name) const {
  return values_.contains(option_name(name));
}

std::string CommandArgs::get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(option_name(name));
  return it == values_.end() ? fallback : it->second;
}

int64_t CommandArgs::get_int(const std::string& name, int64_t fallback, int64_t min) const {
  return has(name) ? parse_int(name, get(name, ""), min) : fallback;
}

std::vector<std::string> CommandArgs::get_list(const std::string& name,
                                               const std::vector<std::string>& fallback) const {
  if (!has(name)) return fallback;
  std::vector<std::string> items = split_list(get(name, ""));
  if (items.empty()) throw ConfigError("command line", name, "", "a comma-separated list");
  return items;
}

std::vector<int64_t> CommandArgs::get_int_list(const std::string& name,
                                               const std::vector<int64_t>& fallback,
                                               int64_t min) const {
  if (!has(name)) return fallback;
  std::vector<int64_t> out;
  for (const std::string& item : get_list(name, {})) out.push_back(parse_int(name, item, min));
  return out;
}

}  // namespace tessera::bench
