#pragma once
// A fresh directory per test under the system temp directory, named after the running test
// and the process (ctest runs tests in parallel). Kept when the test failed, for a look at
// what it wrote; removed otherwise.
#include <unistd.h>

#include <filesystem>
#include <string>

#include <gtest/gtest.h>

namespace tessera::testing {

class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(info->test_suite_name()) + "_" + info->name();
    for (char& c : name)
      if (c == '/') c = '_';  // parameterised tests' names hold '/'
    path_ = std::filesystem::temp_directory_path() /
            ("tessera_" + name + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    if (!::testing::Test::HasFailure()) std::filesystem::remove_all(path_);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace tessera::testing
