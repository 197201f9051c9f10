#include "tessera/core/command_line.h"

namespace tessera {

std::string option_name(std::string_view name) {
  std::string out(name);
  for (char& c : out)
    if (c == '-') c = '_';
  return out;
}

std::optional<CommandLineOption> parse_command_line_option(std::string_view arg) {
  if (!arg.starts_with("--") || arg.size() == 2) return std::nullopt;
  std::string_view name = arg.substr(2);
  CommandLineOption o;
  // Only the name is normalised: a value keeps its dashes (--data_path=/data/my-corpus).
  if (const size_t eq = name.find('='); eq != std::string_view::npos) {
    o.value = std::string(name.substr(eq + 1));
    name = name.substr(0, eq);
  }
  o.name = option_name(name);
  return o;
}

}  // namespace tessera
