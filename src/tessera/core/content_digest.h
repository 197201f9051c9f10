#pragma once
// A 64-bit digest of bytes and files: it tells a changed dataset or set of weights from the
// one something was computed from. Not cryptographic (it does not resist a forger), and read
// in blocks so that files of any size are read once, without holding them in memory.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tessera {

class ContentDigest {
 public:
  void add(const void* data, size_t bytes);
  void add(std::string_view text) { add(text.data(), text.size()); }
  // The file's bytes; a DataError names a file that cannot be read.
  void add_file(const std::string& path);
  // 16 hex digits; the same bytes, added in the same pieces or not, give the same digest.
  std::string hex() const;

 private:
  void mix(uint64_t word);
  uint64_t state_ = 0x6a09e667f3bcc908ull;
  uint64_t pending_ = 0;   // bytes not yet a whole word, low byte first
  size_t pending_bytes_ = 0;
  uint64_t length_ = 0;
};

}  // namespace tessera
