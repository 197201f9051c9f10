#pragma once
// Running command lines from tests: the tessera binary under test, python3, node, chromium.
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace tessera::testing {

struct RunResult {
  int exit_code = -1;  // -1 when the command could not start or died of a signal
  std::string output;  // stdout and stderr, interleaved
};

inline RunResult run_command(const std::string& command) {
  RunResult r;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) r.output.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// TESSERA_BINARY: the build's tessera, set by tests/CMakeLists.txt.
inline RunResult run_tessera(const std::string& args) {
  return run_command(std::string(TESSERA_BINARY) + " " + args);
}

}  // namespace tessera::testing
