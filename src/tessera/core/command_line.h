#pragma once
// The option syntax every tessera command shares (docs/cli.md): `--name value` and
// `--name=value` are the same, and so are dashes and underscores in a name (`--num-gpus` is
// `--num_gpus`): Megatron and torchrun spell options with dashes, Tessera's configuration keys
// with underscores. Every command's parser reads its options through this one function, so no
// command accepts a spelling another refuses.
#include <optional>
#include <string>
#include <string_view>

namespace tessera {

struct CommandLineOption {
  std::string name;                  // without the leading "--", every '-' turned into '_'
  std::optional<std::string> value;  // the text after the first '=', when there is one
};

// "--num-gpus=8" -> {"num_gpus", "8"}; "--bf16" -> {"bf16", nullopt}. Anything that does not
// start with "--", and "--" alone (the end of the options), is not an option: nullopt.
// Single-dash short options (-o, -h) are left to each command.
std::optional<CommandLineOption> parse_command_line_option(std::string_view arg);

// "num-gpus" -> "num_gpus": the spelling options and configuration keys are compared in.
std::string option_name(std::string_view name);

}  // namespace tessera
