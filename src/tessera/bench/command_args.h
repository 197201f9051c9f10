#pragma once
// Command lines in the CLI's conventions (docs/cli.md): `--name value`, `--name=value`, bare
// flags, `-o DIR` for `--output DIR`, and positional arguments. Dashes and underscores in a
// name are the same (`--sizes-mib` is `--sizes_mib`): options are read through
// core/command_line.h, as every command and the configuration loader read them. Each command
// declares the names it takes; anything else is either an error or, for commands that load an
// experiment, kept as `--key value` tokens for the configuration loader.
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace tessera::bench {

class CommandArgs {
 public:
  // valued: names followed by a value; flags: names without one (both without "--").
  // pass_unknown: keep other `--key value` pairs in unknown() instead of failing.
  CommandArgs(const std::vector<std::string>& args, const std::set<std::string>& valued,
              const std::set<std::string>& flags, bool pass_unknown);

  bool has(const std::string& name) const;
  std::string get(const std::string& name, const std::string& fallback) const;
  // An integer at least `min`; ConfigError names the option otherwise.
  int64_t get_int(const std::string& name, int64_t fallback, int64_t min = 1) const;
  // Comma-separated: "1024,2048" -> {"1024", "2048"}.
  std::vector<std::string> get_list(const std::string& name,
                                    const std::vector<std::string>& fallback) const;
  std::vector<int64_t> get_int_list(const std::string& name, const std::vector<int64_t>& fallback,
                                    int64_t min = 1) const;

  const std::vector<std::string>& positional() const { return positional_; }
  const std::vector<std::string>& unknown() const { return unknown_; }

 private:
  std::map<std::string, std::string> values_;  // by name with underscores; flags map to ""
  std::vector<std::string> positional_, unknown_;
};

std::vector<std::string> split_list(const std::string& text);

}  // namespace tessera::bench
