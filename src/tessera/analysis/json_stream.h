#pragma once
// Streaming access to a Chrome-trace JSON file without holding the file in memory.
//
// A trace is `{"key": value, ..., "traceEvents": [ {event}, {event}, ... ], ...}` or a bare
// `[ {event}, ... ]`. TraceScanner walks that outer structure byte by byte and hands out
// each event object as one contiguous, simdjson-padded piece of text, so that the decoder
// (trace_reader.cpp) parses events one at a time and memory stays at one read chunk plus one
// event, whatever the file size. Top-level members other than traceEvents (distributedInfo,
// deviceProperties, baseTimeNanoseconds, ...) are handed out whole. Files starting with the
// gzip magic bytes are inflated on the fly.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::analysis {

// Reads a file, inflating it when it is gzip-compressed. Throws DataError naming the file.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  // Fills up to `n` bytes; returns 0 only at the end of the (decompressed) stream.
  virtual size_t read(char* dst, size_t n) = 0;
  // Bytes of the file on disk consumed so far and in total (for progress and MB/s).
  virtual uint64_t file_bytes_consumed() const = 0;
  uint64_t file_size() const { return file_size_; }

 protected:
  uint64_t file_size_ = 0;
};

std::unique_ptr<ByteSource> open_byte_source(const std::string& path);

// Throws DataError for valid JSON that is not a trace; `found` says what the file holds instead.
[[noreturn]] void throw_not_a_trace(const std::string& path, const std::string& found);

// A piece of JSON text that simdjson may parse in place: `capacity` >= size + padding bytes
// are readable from `data`.
struct PaddedText {
  const char* data;
  size_t size;
  size_t capacity;
  std::string_view view() const { return {data, size}; }
};

// How much of a trace is read at a time: memory stays at this plus one event.
inline constexpr size_t kTraceChunkBytes = size_t{8} << 20;

class TraceScanner {
 public:
  struct Handler {
    // A top-level member other than traceEvents, with its value as JSON text.
    std::function<void(std::string_view key, std::string_view value)> on_member;
    // One element of traceEvents; `offset` is its byte offset in the (decompressed) JSON.
    std::function<void(const PaddedText& event, uint64_t offset)> on_event;
    // Called every few MB with the file bytes consumed so far.
    std::function<void(uint64_t file_bytes)> on_progress;
  };

  // `chunk_bytes`: read granularity (tests use tiny chunks to exercise refills).
  TraceScanner(std::string path, std::unique_ptr<ByteSource> source,
               size_t chunk_bytes = kTraceChunkBytes);
  // Scans the whole file. Throws DataError (file name, byte offset, what was expected) on
  // anything that is not a complete Chrome-trace JSON document, and (throw_not_a_trace) on a
  // JSON object without a traceEvents array, such as a metrics.jsonl line.
  void scan(const Handler& handler);
  uint64_t bytes_scanned() const { return base_ + (pos_ - buf_.data()); }
  const ByteSource& source() const { return *source_; }

 private:
  bool fill();  // refills the buffer when pos_ == end_; false at end of input
  bool skip_whitespace();
  int peek();  // -1 at end of input
  [[noreturn]] void fail(const std::string& expected, uint64_t offset) const;
  [[noreturn]] void fail_here(const std::string& expected);
  std::string read_key();
  // Captures one JSON value starting at pos_; the text stays valid until the next capture.
  PaddedText capture_value();
  void scan_events(const Handler& handler);

  std::string path_;
  std::unique_ptr<ByteSource> source_;
  size_t chunk_;
  std::vector<char> buf_;
  char* pos_ = nullptr;
  char* end_ = nullptr;
  uint64_t base_ = 0;  // offset of buf_[0] in the decompressed stream
  uint64_t last_progress_ = 0;
  const Handler* handler_ = nullptr;
  // Text of a value that crossed a buffer refill; capacity keeps simdjson's padding.
  std::string carry_;
  bool capturing_ = false;
  char* capture_start_ = nullptr;
};

}  // namespace tessera::analysis
