#include "tessera/analysis/progress.h"

#include <unistd.h>

#include <cstdio>

#include <fmt/format.h>

namespace tessera::analysis {

namespace {

std::string with_commas(uint64_t v) {
  std::string digits = std::to_string(v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

std::string human_bytes(uint64_t bytes) {
  if (bytes >= (1ull << 30)) return fmt::format("{:.2f} GB", bytes / 1e9);
  if (bytes >= (1ull << 20)) return fmt::format("{:.1f} MB", bytes / 1e6);
  return fmt::format("{:.1f} KB", bytes / 1e3);
}

}  // namespace

Progress::Progress(std::string label, uint64_t total_bytes, bool enabled)
    : label_(std::move(label)),
      total_(total_bytes),
      tty_(enabled && isatty(fileno(stderr))),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

void Progress::update(uint64_t bytes, uint64_t events) {
  if (!tty_) return;
  auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ < std::chrono::milliseconds(250)) return;
  last_draw_ = now;
  double pct = total_ ? 100.0 * static_cast<double>(bytes) / static_cast<double>(total_) : 0.0;
  fmt::print(stderr, "\r{}: {} / {} ({:.0f}%), {} events   ", label_, human_bytes(bytes),
             human_bytes(total_), pct, with_commas(events));
  std::fflush(stderr);
  drawn_ = true;
}

double Progress::finish() {
  if (drawn_) {
    fmt::print(stderr, "\r{:<100}\r", "");
    std::fflush(stderr);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

std::string read_summary(uint64_t events, uint64_t json_bytes, double seconds,
                         uint64_t file_bytes) {
  std::string size =
      file_bytes && file_bytes != json_bytes
          ? fmt::format("{} of JSON, {} on disk", human_bytes(json_bytes), human_bytes(file_bytes))
          : human_bytes(json_bytes);
  return fmt::format("parsed {} events ({}) in {:.2f} s, {:.0f} MB/s", with_commas(events), size,
                     seconds, seconds > 0 ? json_bytes / 1e6 / seconds : 0.0);
}

}  // namespace tessera::analysis
