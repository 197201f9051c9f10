#pragma once
// An environment variable set (or unset) for a scope and restored after it, for tests of code
// that reads the environment (Tessera's data root, distributed launch variables).
#include <cstdlib>
#include <optional>
#include <string>

namespace tessera::testing {

class ScopedEnv {
 public:
  // `value` nullopt unsets the variable.
  ScopedEnv(std::string name, const std::optional<std::string>& value) : name_(std::move(name)) {
    if (const char* old = std::getenv(name_.c_str())) saved_ = old;
    if (value)
      setenv(name_.c_str(), value->c_str(), 1);
    else
      unsetenv(name_.c_str());
  }
  ~ScopedEnv() {
    if (saved_)
      setenv(name_.c_str(), saved_->c_str(), 1);
    else
      unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> saved_;
};

}  // namespace tessera::testing
