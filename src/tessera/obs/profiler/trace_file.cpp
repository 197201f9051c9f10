#include "tessera/obs/profiler/trace_file.h"

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera::profiler {

void append_json_string(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out.push_back('"');
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (u < 0x20 || u == 0x7f) {
          out += "\\u00";
          out.push_back(kHex[u >> 4]);
          out.push_back(kHex[u & 15]);
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
}

std::string json_string(std::string_view s) {
  std::string out;
  append_json_string(out, s);
  return out;
}

void append_us(std::string& out, int64_t ns) {
  // Work in unsigned magnitude so that INT64_MIN does not overflow.
  const bool negative = ns < 0;
  const uint64_t mag =
      negative ? uint64_t{0} - static_cast<uint64_t>(ns) : static_cast<uint64_t>(ns);
  char buf[32];
  const int n = std::snprintf(buf, sizeof(buf), "%s%llu.%03llu", negative ? "-" : "",
                              static_cast<unsigned long long>(mag / 1000),
                              static_cast<unsigned long long>(mag % 1000));
  out.append(buf, static_cast<size_t>(n));
}

std::string format_us(int64_t ns) {
  std::string out;
  append_us(out, ns);
  return out;
}

// ---- TraceFile ----

TraceFile::TraceFile(std::string path) : path_(std::move(path)) {
  namespace fs = std::filesystem;
  gzip_ = path_.size() > 3 && path_.compare(path_.size() - 3, 3, ".gz") == 0;
  // Beside the destination (same file system, so the rename is atomic); the pid keeps
  // concurrent writers (several ranks into one directory) apart.
  temp_path_ = path_ + fmt::format(".tmp-{}", static_cast<long>(::getpid()));
  const fs::path parent = fs::path(path_).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    if (ec)
      throw Error(
          fmt::format("{}: cannot create the directory: {}", parent.string(), ec.message()));
  }
  if (gzip_) {
    gzFile f = gzopen(temp_path_.c_str(), "wb1");
    if (f == nullptr)
      throw Error(
          fmt::format("{}: cannot create the trace file: {}", temp_path_, std::strerror(errno)));
    gzbuffer(f, 1 << 20);
    gz_ = f;
  } else {
    plain_ = std::fopen(temp_path_.c_str(), "wb");
    if (plain_ == nullptr)
      throw Error(
          fmt::format("{}: cannot create the trace file: {}", temp_path_, std::strerror(errno)));
  }
}

TraceFile::~TraceFile() {
  if (committed_) return;
  close_handles();
  std::error_code ec;
  std::filesystem::remove(temp_path_, ec);  // abandoned: leave the destination untouched
}

void TraceFile::close_handles() noexcept {
  if (gz_ != nullptr) gzclose(static_cast<gzFile>(gz_));
  if (plain_ != nullptr) std::fclose(plain_);
  gz_ = nullptr;
  plain_ = nullptr;
}

void TraceFile::write(std::string_view text) {
  if (text.empty()) return;
  if (gz_ != nullptr) {
    size_t done = 0;
    while (done < text.size()) {  // gzwrite takes an unsigned int length
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(text.size() - done, 1u << 30));
      if (gzwrite(static_cast<gzFile>(gz_), text.data() + done, chunk) != static_cast<int>(chunk)) {
        int code = 0;
        const char* msg = gzerror(static_cast<gzFile>(gz_), &code);
        throw Error(fmt::format("{}: write failed: {}", temp_path_,
                                code == Z_ERRNO ? std::strerror(errno) : msg));
      }
      done += chunk;
    }
  } else if (plain_ != nullptr) {
    if (std::fwrite(text.data(), 1, text.size(), plain_) != text.size())
      throw Error(fmt::format("{}: write failed: {}", temp_path_, std::strerror(errno)));
  } else {
    throw Error(fmt::format("{}: write after commit", temp_path_));
  }
}

uint64_t TraceFile::commit() {
  if (committed_) throw Error(fmt::format("{}: committed twice", path_));
  if (gz_ != nullptr) {
    const int rc = gzclose(static_cast<gzFile>(gz_));
    gz_ = nullptr;
    if (rc != Z_OK) throw Error(fmt::format("{}: closing failed (zlib error {})", temp_path_, rc));
  } else if (plain_ != nullptr) {
    const bool ok = std::fflush(plain_) == 0 && ::fsync(fileno(plain_)) == 0;
    const int err = errno;
    const bool closed = std::fclose(plain_) == 0;
    plain_ = nullptr;
    if (!ok || !closed)
      throw Error(fmt::format("{}: closing failed: {}", temp_path_, std::strerror(err)));
  }
  std::error_code ec;
  const uint64_t bytes = std::filesystem::file_size(temp_path_, ec);
  std::filesystem::rename(temp_path_, path_, ec);
  if (ec)
    throw Error(fmt::format("{}: cannot move {} into place: {}", path_, temp_path_, ec.message()));
  committed_ = true;
  return bytes;
}

}  // namespace tessera::profiler
