#pragma once
// What the fuzz targets share (scripts/fuzz.sh builds them with libFuzzer, the suite replays
// their corpora). Each target feeds its input to one parser of untrusted input the way the
// command that uses it does. A refusal, the error Tessera gives bad input (ConfigError,
// DataError, OutOfMemoryError), is an expected outcome; a crash, a sanitizer report, a leak,
// a hang or any other exception is a finding.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/error.h"

namespace tessera::fuzz {

namespace fs = std::filesystem;

// This process's scratch directory: on /dev/shm where there is one (targets write their
// input to files thousands of times a second), removed when the process exits.
inline const fs::path& scratch_dir() {
  static const fs::path dir = [] {
    std::error_code ec;
    const fs::path base =
        fs::is_directory("/dev/shm", ec) ? fs::path("/dev/shm") : fs::temp_directory_path();
    const fs::path d = base / ("tessera_fuzz_" + std::to_string(::getpid()));
    fs::remove_all(d, ec);
    fs::create_directories(d);
    std::atexit([] {
      std::error_code ignored;
      fs::remove_all(scratch_dir(), ignored);
    });
    return d;
  }();
  return dir;
}

// A fresh, empty directory `name` under the scratch directory.
inline fs::path fresh_dir(const std::string& name) {
  const fs::path d = scratch_dir() / name;
  std::error_code ec;
  fs::remove_all(d, ec);
  fs::create_directories(d);
  return d;
}

inline void write_file(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// `text` cut at each `separator`, into at most `max_parts` pieces (the last keeps the rest).
inline std::vector<std::string_view> split(std::string_view text, std::string_view separator,
                                           size_t max_parts) {
  std::vector<std::string_view> parts;
  while (parts.size() + 1 < max_parts) {
    const size_t at = text.find(separator);
    if (at == std::string_view::npos) break;
    parts.push_back(text.substr(0, at));
    text.remove_prefix(at + separator.size());
  }
  parts.push_back(text);
  return parts;
}

// Runs `parse`, letting through the refusals bad input is meant to get.
template <class Parse>
void refusal_or_success(Parse&& parse) {
  try {
    parse();
  } catch (const ConfigError&) {
  } catch (const DataError&) {
  } catch (const OutOfMemoryError&) {
  }
}

}  // namespace tessera::fuzz
