#include "tessera/analysis/json_stream.h"

#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <simdjson.h>

#include "tessera/core/error.h"

namespace tessera::analysis {
namespace {

constexpr size_t kPadding = simdjson::SIMDJSON_PADDING;
// The largest event (or top-level member) the scanner hands out. Real events hold a few
// kilobytes at most (the largest, "Concrete Inputs" of big ops, tens of kilobytes).
constexpr size_t kMaxValueBytes = size_t{64} << 20;

class FileSource : public ByteSource {
 public:
  FileSource(std::string path, FILE* f) : path_(std::move(path)), f_(f) {
    std::fseek(f_, 0, SEEK_END);
    file_size_ = static_cast<uint64_t>(std::ftell(f_));
    std::fseek(f_, 0, SEEK_SET);
  }
  ~FileSource() override { std::fclose(f_); }
  size_t read(char* dst, size_t n) override {
    size_t got = std::fread(dst, 1, n, f_);
    if (got == 0 && std::ferror(f_)) {
      throw DataError(fmt::format("{}: read error: {}", path_, std::strerror(errno)));
    }
    consumed_ += got;
    return got;
  }
  uint64_t file_bytes_consumed() const override { return consumed_; }

 protected:
  std::string path_;
  FILE* f_;
  uint64_t consumed_ = 0;
};

// Inflates gzip (and concatenated gzip members, as `cat a.gz b.gz` produces) in a stream.
class GzipSource : public FileSource {
 public:
  GzipSource(std::string path, FILE* f) : FileSource(std::move(path), f), in_(1u << 20) {
    std::memset(&z_, 0, sizeof(z_));
    if (inflateInit2(&z_, 15 + 32) != Z_OK) {
      throw DataError(fmt::format("{}: cannot initialise zlib", path_));
    }
  }
  ~GzipSource() override { inflateEnd(&z_); }
  size_t read(char* dst, size_t n) override {
    z_.next_out = reinterpret_cast<Bytef*>(dst);
    z_.avail_out = static_cast<uInt>(n);
    while (z_.avail_out > 0) {
      if (z_.avail_in == 0) {
        size_t got = FileSource::read(in_.data(), in_.size());
        if (got == 0) {
          if (!stream_ended_) {
            throw DataError(fmt::format(
                "{}: truncated gzip stream after {} compressed bytes: expected more data", path_,
                consumed_));
          }
          break;
        }
        z_.next_in = reinterpret_cast<Bytef*>(in_.data());
        z_.avail_in = static_cast<uInt>(got);
      }
      if (stream_ended_) {  // another gzip member follows
        inflateReset(&z_);
        stream_ended_ = false;
      }
      int rc = inflate(&z_, Z_NO_FLUSH);
      if (rc == Z_STREAM_END) {
        stream_ended_ = true;
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
        throw DataError(fmt::format("{}: corrupt gzip data after {} compressed bytes: {}", path_,
                                    consumed_, z_.msg ? z_.msg : "inflate failed"));
      }
    }
    return n - z_.avail_out;
  }

 private:
  std::vector<char> in_;
  z_stream z_;
  bool stream_ended_ = false;
};

bool is_space(char c) {
  return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

std::string describe(int c) {
  if (c < 0) return "end of file";
  if (c >= 32 && c < 127) return fmt::format("'{}'", static_cast<char>(c));
  return fmt::format("byte 0x{:02x}", c & 0xff);
}

// `"a", "b", "c", ... (12 members)`: enough to recognise what the file is.
std::string member_list(const std::vector<std::string>& keys, size_t count) {
  std::string out;
  for (const std::string& k : keys) out += (out.empty() ? "\"" : ", \"") + k + "\"";
  if (count > keys.size()) out += fmt::format(", ... ({} members)", count);
  return out;
}

}  // namespace

void throw_not_a_trace(const std::string& path, const std::string& found) {
  throw DataError(fmt::format(
      "{}: not a Chrome/PyTorch profiler trace (a JSON object with a \"traceEvents\" array of "
      "events, or a JSON array of events): found {}",
      path, found));
}

std::unique_ptr<ByteSource> open_byte_source(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw DataError(fmt::format(
        "{}: is a directory: expected a trace file (--ranks DIR reads a directory of traces)",
        path));
  }
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) {
    throw DataError(fmt::format("{}: cannot open trace: {}", path, std::strerror(errno)));
  }
  unsigned char magic[2] = {0, 0};
  size_t got = std::fread(magic, 1, 2, f);
  std::fseek(f, 0, SEEK_SET);
  if (got == 2 && magic[0] == 0x1f && magic[1] == 0x8b) {
    return std::make_unique<GzipSource>(path, f);
  }
  return std::make_unique<FileSource>(path, f);
}

TraceScanner::TraceScanner(std::string path, std::unique_ptr<ByteSource> source, size_t chunk_bytes)
    : path_(std::move(path)),
      source_(std::move(source)),
      chunk_(chunk_bytes),
      buf_(chunk_bytes + kPadding) {
  pos_ = end_ = buf_.data();
}

bool TraceScanner::fill() {
  if (pos_ < end_) return true;
  if (capturing_) carry_.append(capture_start_, end_ - capture_start_);
  base_ += end_ - buf_.data();
  size_t got = source_->read(buf_.data(), chunk_);
  pos_ = buf_.data();
  end_ = pos_ + got;
  capture_start_ = pos_;
  uint64_t consumed = source_->file_bytes_consumed();
  if (handler_ && handler_->on_progress && consumed - last_progress_ >= (4u << 20)) {
    last_progress_ = consumed;
    handler_->on_progress(consumed);
  }
  return got > 0;
}

bool TraceScanner::skip_whitespace() {
  for (;;) {
    while (pos_ < end_ && is_space(*pos_)) ++pos_;
    if (pos_ < end_) return true;
    if (!fill()) return false;
  }
}

int TraceScanner::peek() {
  if (!skip_whitespace()) return -1;
  return static_cast<unsigned char>(*pos_);
}

void TraceScanner::fail(const std::string& expected, uint64_t offset) const {
  throw DataError(fmt::format("{}: invalid trace JSON at byte {}: {}", path_, offset, expected));
}

void TraceScanner::fail_here(const std::string& expected) {
  int c = peek();
  fail(fmt::format("expected {}, found {}", expected, describe(c)), bytes_scanned());
}

std::string TraceScanner::read_key() {
  if (peek() != '"') fail_here("'\"' starting a member name");
  std::string key;
  ++pos_;
  for (;;) {
    if (pos_ == end_ && !fill()) fail_here("'\"' closing a member name");
    char c = *pos_++;
    if (c == '"') break;
    if (c == '\\') {
      if (pos_ == end_ && !fill()) fail_here("an escaped character");
      c = *pos_++;
    }
    key.push_back(c);
  }
  if (peek() != ':') fail_here("':' after member name \"" + key + "\"");
  ++pos_;
  return key;
}

PaddedText TraceScanner::capture_value() {
  if (peek() < 0) fail_here("a value");
  const uint64_t start_offset = bytes_scanned();
  carry_.clear();
  capturing_ = true;
  capture_start_ = pos_;
  // Depth of open braces/brackets; a scalar ends at the first delimiter at depth 0.
  int depth = 0;
  bool in_string = false;
  bool escaped = false;
  const char first = *pos_;
  for (;;) {
    if (pos_ == end_ && !fill()) {
      capturing_ = false;
      fail(fmt::format("file ends inside the value that starts at byte {} (truncated trace?)",
                       start_offset),
           bytes_scanned());
    }
    // Checked at each refill, the only place a value grows past the buffer: one event with a
    // name of gigabytes (a few megabytes of gzip) must not take the host's memory.
    if (carry_.size() > kMaxValueBytes) {
      capturing_ = false;
      fail(fmt::format("the value that starts at byte {} is longer than {} MiB; expected trace "
                       "events of at most that size (a damaged or hostile trace?)",
                       start_offset, kMaxValueBytes >> 20),
           bytes_scanned());
    }
    const char c = *pos_;
    if (in_string) {
      ++pos_;
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
        if (depth == 0) break;  // a string scalar
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      if (depth == 0) break;  // closes the enclosing container: end of a scalar
      if (--depth == 0) {
        ++pos_;
        break;
      }
    } else if (depth == 0 && (c == ',' || is_space(c)) && first != '"') {
      break;
    }
    ++pos_;
  }
  capturing_ = false;
  if (carry_.empty()) {
    return {capture_start_, static_cast<size_t>(pos_ - capture_start_),
            static_cast<size_t>(buf_.data() + buf_.size() - capture_start_)};
  }
  carry_.append(capture_start_, pos_ - capture_start_);
  carry_.reserve(carry_.size() + kPadding);
  return {carry_.data(), carry_.size(), carry_.capacity()};
}

void TraceScanner::scan_events(const Handler& handler) {
  ++pos_;  // '['
  bool need_value = false;
  for (;;) {
    int c = peek();
    if (c == ']' && !need_value) {
      ++pos_;
      return;
    }
    if (c == '{') {
      const uint64_t offset = bytes_scanned();
      PaddedText text = capture_value();
      handler.on_event(text, offset);
      c = peek();
      if (c == ',') {
        ++pos_;
        need_value = true;
      } else if (c == ']') {
        need_value = false;
      } else {
        fail_here("',' or ']' after an event in traceEvents (truncated trace?)");
      }
      continue;
    }
    if (c < 0) {
      fail(fmt::format("file ends inside traceEvents: expected an event or ']' (truncated "
                       "trace?)"),
           bytes_scanned());
    }
    fail_here(need_value ? "'{' starting an event" : "'{' starting an event or ']'");
  }
}

void TraceScanner::scan(const Handler& handler) {
  handler_ = &handler;
  int c = peek();
  if (c == '[') {  // the bare-array form of the Chrome trace format
    scan_events(handler);
  } else if (c == '{') {
    ++pos_;
    bool first = true, has_events = false;
    std::vector<std::string> keys;  // the first few, to say what the file is if not a trace
    size_t members = 0;
    for (;;) {
      c = peek();
      if (c == '}' && first) {
        ++pos_;
        break;
      }
      std::string key = read_key();
      if (++members <= 5) keys.push_back(key);
      if (key == "traceEvents") {
        if (peek() != '[') {
          throw_not_a_trace(
              path_, fmt::format("\"traceEvents\" starting with {}, not '['", describe(peek())));
        }
        scan_events(handler);
        has_events = true;
      } else {
        PaddedText value = capture_value();
        if (handler.on_member) handler.on_member(key, value.view());
      }
      first = false;
      c = peek();
      if (c == ',') {
        ++pos_;
        continue;
      }
      if (c == '}') {
        ++pos_;
        break;
      }
      if (c < 0)
        fail("file ends before the '}' closing the trace (truncated trace?)", bytes_scanned());
      fail_here("',' or '}' after a top-level member");
    }
    if (!has_events) {
      std::string found = members == 0 ? "an empty JSON object"
                                       : "a JSON object with members " + member_list(keys, members);
      // Lines of JSON objects: a metrics.jsonl, or events written without the trace around them.
      if (peek() == '{')
        found += " and more JSON objects after it (JSON Lines, e.g. metrics.jsonl)";
      throw_not_a_trace(path_, found);
    }
  } else {
    fail_here("'{' or '[' starting a Chrome trace (is this a JSON trace file?)");
  }
  if (peek() >= 0) fail_here("end of file after the trace");
  if (handler.on_progress) handler.on_progress(source_->file_bytes_consumed());
  handler_ = nullptr;
}

}  // namespace tessera::analysis
