#pragma once
// Error types. Every failure a user can cause (bad config, bad data, not enough memory)
// has its own type so the CLI can map it to a clear message and an exit code instead
// of a crash trace.
#include <stdexcept>
#include <string>
#include <string_view>

#include <sstream>

namespace tessera {

// Replaces each "{}" in f with the next argument (streamed). Headers that GPU kernels include
// use this instead of fmt, whose C++20 mode nvcc cannot compile.
template <class... Args>
std::string format_message(std::string_view f, const Args&... args) {
  std::ostringstream out;
  size_t pos = 0;
  [[maybe_unused]] auto put = [&](const auto& arg) {  // unused for a message without arguments
    const size_t at = f.find("{}", pos);
    if (at == std::string_view::npos) return;
    out << f.substr(pos, at - pos) << arg;
    pos = at + 2;
  };
  (put(args), ...);
  out << f.substr(pos);
  return out.str();
}

// Exit codes of the CLI: 2 for invalid input (config, arguments), 3 for runtime failures
// that are not bugs (out of memory, bad data, too many NaN iterations), 130/143 on signals.
inline constexpr int kExitInvalidInput = 2;
inline constexpr int kExitRuntimeFailure = 3;

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Invalid configuration or command line. The message names the file (or "command line"),
// the key, the offending value and what was expected.
class ConfigError : public Error {
 public:
  ConfigError(std::string source, std::string key, std::string value, std::string expected)
      : Error(format(source, key, value, expected)),
        source_(std::move(source)),
        key_(std::move(key)),
        value_(std::move(value)),
        expected_(std::move(expected)) {}
  const std::string& source() const { return source_; }
  const std::string& key() const { return key_; }
  const std::string& value() const { return value_; }
  const std::string& expected() const { return expected_; }

 private:
  static std::string format(const std::string& source, const std::string& key,
                            const std::string& value, const std::string& expected) {
    return source + ": key '" + key + "' has value '" + value + "': expected " + expected;
  }
  std::string source_, key_, value_, expected_;
};

// Errors in input data files (datasets, checkpoints, tokenizers): message names the file.
class DataError : public Error {
 public:
  using Error::Error;
};

// Input data the user must fix, as a bad argument must be (a conversation without a role,
// a sample longer than allowed), rather than one that could not be read: exits 2.
class InvalidDataError : public DataError {
 public:
  using DataError::DataError;
};

// A device allocation that does not fit. The message carries the needed and free bytes and
// what to change.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

// Training could not continue (too many non-finite iterations in a row, interrupted).
class TrainingAborted : public Error {
 public:
  TrainingAborted(const std::string& message, int exit_code) : Error(message), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

// A distributed job cannot go on: a peer that never connected, died or disagrees on the
// configuration, or a collective that failed or timed out. The message names the rank.
class DistributedError : public Error {
 public:
  using Error::Error;
};

// A broken internal invariant: a bug in Tessera, not in the user's input.
class InternalError : public Error {
 public:
  using Error::Error;
};

[[noreturn]] void throw_internal_error(const char* file, int line, const std::string& message);

}  // namespace tessera

// Checks an internal invariant; the message is only formatted on failure.
#define TS_CHECK(cond, ...)                                                        \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      ::tessera::throw_internal_error(__FILE__, __LINE__,                          \
                                      std::string("check failed: " #cond ": ") +   \
                                          ::tessera::format_message(__VA_ARGS__)); \
    }                                                                              \
  } while (0)
