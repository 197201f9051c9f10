#pragma once
// An Experiment from YAML text, through the real loader (presets, overrides, validation): the
// text goes to a temporary file named after the running test and the process, which is
// removed once loaded.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tessera/config/config.h"

namespace tessera::testing {

inline Experiment experiment_from_yaml(const std::string& yaml,
                                       const std::vector<std::string>& cli_overrides = {},
                                       int data_parallel_size = 1) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path p =
      std::filesystem::temp_directory_path() /
      ("tessera_" + std::string(info ? info->name() : "experiment") + "_" +
       std::to_string(::getpid()) + ".yaml");
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
