#pragma once
// An Experiment from YAML text, through the real loader (presets, overrides, validation): the
// text goes to a temporary file named after the running test and the process, which is
// removed once loaded.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tessera/config/config.h"

namespace tessera::testing {

// `lines` ("key: value\n"...) as an `overrides:` block placed after a base experiment's
// keys: they win over the base, where repeating a top-level key is an error.
inline std::string overrides_yaml(const std::string& lines) {
  if (lines.empty()) return "";
  std::string out = "overrides:\n";
  std::istringstream in(lines);
  for (std::string line; std::getline(in, line);) out += "  " + line + "\n";
  return out;
}

inline Experiment experiment_from_yaml(const std::string& yaml,
                                       const std::vector<std::string>& cli_overrides = {},
                                       int data_parallel_size = 1) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? info->name() : "experiment";
  for (char& c : name)
    if (c == '/') c = '_';  // parameterised tests' names hold '/'
  const std::filesystem::path p = std::filesystem::temp_directory_path() /
                                  ("tessera_" + name + "_" + std::to_string(::getpid()) + ".yaml");
  std::ofstream(p) << yaml;
  LoadOptions o;
  o.config_path = p.string();
  o.cli_overrides = cli_overrides;
  o.data_parallel_size = data_parallel_size;
  struct Remove {
    std::filesystem::path p;
    ~Remove() { std::filesystem::remove(p); }
  } remove{p};
  return load_experiment(o);
}

}  // namespace tessera::testing
