#pragma once
// Writing Chrome-trace JSON: string escaping, exact microsecond timestamps, and a file that
// appears atomically (written to a temporary name beside it, renamed on commit), plain or
// gzip-compressed by its extension.
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace tessera::profiler {

// Appends `s` as a JSON string literal (quotes included): ", \ and control characters are
// escaped; other bytes, UTF-8 included, pass through unchanged.
void append_json_string(std::string& out, std::string_view s);
std::string json_string(std::string_view s);

// Nanoseconds as microseconds with exactly three decimals ("-1.500", "1234.005"), the
// Chrome-trace unit; exact for every int64 (no floating point).
void append_us(std::string& out, int64_t ns);
std::string format_us(int64_t ns);

// A file written in pieces that appears at `path` only on commit(). Paths ending in ".gz"
// are gzip-compressed (fast level). Without commit() (an exception, an abandoned write) the
// temporary file is removed and whatever was at `path` before stays. Throws tessera::Error
// naming the file when it cannot be created or written.
class TraceFile {
 public:
  explicit TraceFile(std::string path);
  ~TraceFile();
  TraceFile(const TraceFile&) = delete;
  TraceFile& operator=(const TraceFile&) = delete;

  void write(std::string_view text);
  // Flushes, closes and renames into place; returns the bytes on disk.
  uint64_t commit();
  const std::string& temp_path() const { return temp_path_; }

 private:
  void close_handles() noexcept;

  std::string path_, temp_path_;
  bool gzip_ = false;
  void* gz_ = nullptr;  // gzFile
  FILE* plain_ = nullptr;
  bool committed_ = false;
};

}  // namespace tessera::profiler
