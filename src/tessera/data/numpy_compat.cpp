#include "tessera/data/numpy_compat.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {
namespace {

constexpr char kNpyMagic[] = "\x93NUMPY";
constexpr size_t kNpyMagicLen = 6;

const char* descr(NpyType t) {
  switch (t) {
    case NpyType::Int16:
      return "<i2";
    case NpyType::Int32:
      return "<i4";
    case NpyType::UInt32:
      return "<u4";
    case NpyType::Int64:
      return "<i8";
  }
  return "?";
}

size_t item_size(NpyType t) {
  switch (t) {
    case NpyType::Int16:
      return 2;
    case NpyType::Int32:
    case NpyType::UInt32:
      return 4;
    case NpyType::Int64:
      return 8;
  }
  return 0;
}

// The value of `'key': ` in a .npy header dict, up to the next ',' or '}' outside parentheses.
std::string header_value(const std::string& header, const std::string& key) {
  const size_t at = header.find("'" + key + "':");
  if (at == std::string::npos) return "";
  size_t pos = at + key.size() + 3;
  while (pos < header.size() && header[pos] == ' ') ++pos;
  const size_t end =
      header[pos] == '(' ? header.find(')', pos) + 1 : header.find_first_of(",}", pos);
  return end == std::string::npos ? "" : header.substr(pos, end - pos);
}

// Mapped arrays sit at the header's end, so read them bytewise rather than assume alignment.
template <class T>
int64_t read_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return static_cast<int64_t>(v);
}

}  // namespace

NpyArray::NpyArray(NpyType type, uint64_t rows, uint64_t cols)
    : type_(type), rows_(rows), cols_(cols), owned_(size() * item_size(type)) {}

NpyArray NpyArray::load(const std::string& path) {
  NpyArray a;
  a.mapped_ = MappedFile(path, "NumPy array");
  const uint8_t* p = a.mapped_.data();
  const size_t n = a.mapped_.size();
  auto bad = [&](const std::string& why) {
    return DataError(fmt::format("{}: not a .npy integer array Tessera wrote: {}", path, why));
  };
  if (n < 10 || std::memcmp(p, kNpyMagic, kNpyMagicLen) != 0) throw bad("no \\x93NUMPY magic");
  const uint8_t major = p[6];
  size_t header_len = 0, header_at = 0;
  if (major == 1) {
    header_len = p[8] | (p[9] << 8);
    header_at = 10;
  } else if ((major == 2 || major == 3) && n >= 12) {
    header_len =
        static_cast<size_t>(p[8]) | p[9] << 8 | p[10] << 16 | static_cast<size_t>(p[11]) << 24;
    header_at = 12;
  } else {
    throw bad(fmt::format("format version {}", major));
  }
  if (header_at + header_len > n) throw bad("truncated header");
  const std::string header(reinterpret_cast<const char*>(p + header_at), header_len);
  const std::string type = header_value(header, "descr");
  bool known = false;
  for (NpyType t : {NpyType::Int16, NpyType::Int32, NpyType::UInt32, NpyType::Int64})
    if (type == fmt::format("'{}'", descr(t))) a.type_ = t, known = true;
  if (!known) throw bad(fmt::format("dtype {}", type));
  if (header_value(header, "fortran_order") != "False") throw bad("Fortran order");
  const std::string shape = header_value(header, "shape");  // "(12,)" or "(12, 2)"
  unsigned long long rows = 0, cols = 0;
  const int dims = std::sscanf(shape.c_str(), "(%llu, %llu", &rows, &cols);
  if (dims < 1 || (dims == 1 && shape.find(",)") == std::string::npos)) throw bad("shape " + shape);
  a.rows_ = rows;
  a.cols_ = dims == 2 ? cols : 0;
  a.offset_ = header_at + header_len;
  if (n - a.offset_ != a.size() * item_size(a.type_))
    throw bad(fmt::format("{} data bytes for shape {} of {}", n - a.offset_, shape, type));
  return a;
}

void NpyArray::save(const std::string& path) const {
  const std::string shape =
      cols_ ? fmt::format("({}, {})", rows_, cols_) : fmt::format("({},)", rows_);
  std::string header =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", descr(type_), shape);
  // NumPy pads the header with spaces and a newline so the data starts 64-byte aligned.
  const size_t unpadded = kNpyMagicLen + 2 + 2 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::string prefix(kNpyMagic, kNpyMagicLen);
  prefix += {'\x01', '\x00', static_cast<char>(header.size() & 0xff),
             static_cast<char>(header.size() >> 8)};
  prefix += header;
  FILE* f = std::fopen(path.c_str(), "wb");
  const size_t data_bytes = size() * item_size(type_);
  bool ok = f && std::fwrite(prefix.data(), 1, prefix.size(), f) == prefix.size() &&
            std::fwrite(bytes(), 1, data_bytes, f) == data_bytes;
  if (f && std::fclose(f) != 0) ok = false;
  if (!ok) throw DataError(fmt::format("{}: write failed: {}", path, std::strerror(errno)));
}

int64_t NpyArray::at(uint64_t i) const {
  const uint8_t* p = bytes() + i * item_size(type_);
  switch (type_) {
    case NpyType::Int16:
      return read_le<int16_t>(p);
    case NpyType::Int32:
      return read_le<int32_t>(p);
    case NpyType::UInt32:
      return read_le<uint32_t>(p);
    case NpyType::Int64:
      return read_le<int64_t>(p);
  }
  return 0;
}

uint64_t NumpyRandomState::interval(uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  for (int shift = 1; shift <= 32; shift *= 2) mask |= mask >> shift;
  uint64_t value;
  if (max <= 0xffffffffull) {
    do value = mt_() & mask;
    while (value > max);
  } else {
    // NumPy's 64-bit MT19937 draw: the first 32-bit output is the high half.
    do {
      const uint64_t high = mt_();
      value = ((high << 32) | mt_()) & mask;
    } while (value > max);
  }
  return value;
}

}  // namespace tessera
