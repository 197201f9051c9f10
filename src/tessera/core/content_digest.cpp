#include "tessera/core/content_digest.h"

#include <cstring>
#include <fstream>
#include <vector>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {

void ContentDigest::mix(uint64_t word) {
  // Multiply-rotate steps (the finaliser of splitmix64 on each word): every input bit
  // reaches every state bit within two words.
  uint64_t z = (state_ ^ word) + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  state_ = z ^ (z >> 31);
}

void ContentDigest::add(const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  length_ += bytes;
  while (bytes > 0 && pending_bytes_ > 0) {
    pending_ |= static_cast<uint64_t>(*p++) << (8 * pending_bytes_);
    --bytes;
    if (++pending_bytes_ == 8) mix(pending_), pending_ = 0, pending_bytes_ = 0;
  }
  for (; bytes >= 8; p += 8, bytes -= 8) {
    uint64_t word = 0;
    for (int i = 0; i < 8; ++i) word |= static_cast<uint64_t>(p[i]) << (8 * i);
    mix(word);
  }
  for (; bytes > 0; --bytes) pending_ |= static_cast<uint64_t>(*p++) << (8 * pending_bytes_++);
}

void ContentDigest::add_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(fmt::format("{}: cannot open for reading", path));
  std::vector<char> block(1 << 20);
  while (in) {
    in.read(block.data(), static_cast<std::streamsize>(block.size()));
    add(block.data(), static_cast<size_t>(in.gcount()));
  }
  if (in.bad()) throw DataError(fmt::format("{}: read failed", path));
}

std::string ContentDigest::hex() const {
  ContentDigest end = *this;
  end.mix(pending_ ^ (static_cast<uint64_t>(pending_bytes_) << 56));
  end.mix(length_);
  return fmt::format("{:016x}", end.state_);
}

}  // namespace tessera
