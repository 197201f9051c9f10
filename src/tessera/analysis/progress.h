#pragma once
// Progress of a long read: a self-overwriting status line on a terminal (nothing when stderr
// is redirected, so logs stay clean) and one summary line at the end.
#include <chrono>
#include <cstdint>
#include <string>

namespace tessera::analysis {

class Progress {
 public:
  Progress(std::string label, uint64_t total_bytes, bool enabled);
  // At most a few redraws a second, whatever the call rate.
  void update(uint64_t bytes, uint64_t events);
  // Clears the status line; returns the seconds since construction.
  double finish();

 private:
  std::string label_;
  uint64_t total_;
  bool tty_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

// "parsed 1,234,567 events (1.02 GB) in 4.1 s, 249 MB/s"; with `file_bytes` set (a
// compressed file), "(1.02 GB of JSON, 61.0 MB on disk)". MB/s counts JSON bytes.
std::string read_summary(uint64_t events, uint64_t json_bytes, double seconds,
                         uint64_t file_bytes = 0);

}  // namespace tessera::analysis
