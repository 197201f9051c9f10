#include "tessera/ckpt/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tessera/core/error.h"

namespace tessera {
namespace {

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kNames[] = {
    {DType::F32, "F32"},      {DType::BF16, "BF16"}, {DType::F16, "F16"}, {DType::E4M3, "F8_E4M3"},
    {DType::E5M2, "F8_E5M2"}, {DType::I32, "I32"},   {DType::I64, "I64"}, {DType::U8, "U8"},
};

bool st_dtype(const std::string& s, DType* out) {
  for (const auto& n : kNames)
    if (s == n.name) return *out = n.dtype, true;
  return false;
}

float half_bits_to_float(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  const float sign = (h & 0x8000) ? -1.0f : 1.0f;
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -24);  // subnormal
  if (exponent == 31) return mantissa ? NAN : sign * INFINITY;
  return sign * std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
}

void write_all(int fd, const char* data, size_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0)
      throw DataError(fmt::format("{}: write failed: {} (disk full?)", path, std::strerror(errno)));
    data += w;
    n -= static_cast<size_t>(w);
  }
}

// `__metadata__` is a map of strings in the format; values of other types are kept as their
// JSON text rather than refused, as transformers' files sometimes hold them.
void metadata_value(std::map<std::string, std::string>& metadata, const std::string& key,
                    const nlohmann::json& value) {
  metadata[key] = value.is_string() ? value.get<std::string>() : value.dump();
}

// The format forbids overlapping tensors and bytes no tensor holds (a polyglot file, or a
// tensor reading another's bytes): sorted by offset, the tensors must tile the data region
// exactly, each starting where the one before ends.
void check_tiling(const SafetensorsHeader& h, uint64_t data_size, const std::string& path) {
  std::vector<size_t> order(h.tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return h.offsets[a] < h.offsets[b]; });
  uint64_t at = 0;
  const SafetensorsTensor* previous = nullptr;
  for (size_t i : order) {
    const auto [begin, end] = h.offsets[i];
    if (begin != at)
      throw DataError(fmt::format(
          "{}: tensor '{}' has data_offsets [{}, {}], but {}; expected the tensors' "
          "data_offsets to tile the data region exactly (damaged or forged file?)",
          path, h.tensors[i].name, begin, end,
          begin < at
              ? fmt::format("its bytes overlap tensor '{}', which ends at {}", previous->name, at)
              : fmt::format("bytes [{}, {}) belong to no tensor", at, begin)));
    at = end;
    previous = &h.tensors[i];
  }
  if (at != data_size)
    throw DataError(fmt::format(
        "{}: bytes [{}, {}) of the data region belong to no tensor; expected the tensors' "
        "data_offsets to tile it exactly (damaged or forged file?)",
        path, at, data_size));
}

}  // namespace

const char* safetensors_dtype_name(DType d) {
  for (const auto& n : kNames)
    if (n.dtype == d) return n.name;
  return "?";
}

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  write_safetensors(path, tensors, metadata, [&](size_t i, void* dst) {
    std::memcpy(dst, tensors[i].data, tensors[i].nbytes());
  });
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata,
                       const std::function<void(size_t index, void* dst)>& fill) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  size_t largest = 0;
  for (const auto& t : tensors) {
    const uint64_t bytes = t.nbytes();
    header[t.name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    largest = std::max<size_t>(largest, bytes);
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw DataError(fmt::format("{}: cannot open for writing: {}", tmp, std::strerror(errno)));
  try {
    const uint64_t n = json.size();
    write_all(fd, reinterpret_cast<const char*>(&n), 8, tmp);
    write_all(fd, json.data(), json.size(), tmp);
    std::vector<char> buffer(largest);
    for (size_t i = 0; i < tensors.size(); ++i) {
      fill(i, buffer.data());
      write_all(fd, buffer.data(), tensors[i].nbytes(), tmp);
    }
    // Durable before it gets its final name: after a power loss the name never points at
    // data that did not reach the disk.
    if (::fsync(fd) != 0)
      throw DataError(fmt::format("{}: fsync failed: {}", tmp, std::strerror(errno)));
  } catch (...) {
    ::close(fd);
    std::filesystem::remove(tmp);
    throw;
  }
  ::close(fd);
  std::filesystem::rename(tmp, path);
}

SafetensorsHeader parse_safetensors(const char* bytes, size_t size, const std::string& path) {
  if (size < 8)
    throw DataError(fmt::format("{}: {} bytes, too short for a safetensors header", path, size));
  uint64_t n = 0;
  std::memcpy(&n, bytes, 8);
  if (n > size - 8)
    throw DataError(fmt::format("{}: header length {} exceeds the file size {} (truncated file?)",
                                path, n, size));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes + 8, bytes + 8 + n);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("{}: malformed JSON header: {}", path, e.what()));
  }
  if (!header.is_object())
    throw DataError(fmt::format("{}: the header is {}; expected a JSON object of tensors", path,
                                header.type_name()));
  const size_t data_start = 8 + n, data_size = size - data_start;
  SafetensorsHeader out;
  auto malformed = [&](const std::string& name, const std::string& what) {
    return DataError(fmt::format("{}: tensor '{}' entry is malformed: {}", path, name, what));
  };
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object())
        throw DataError(fmt::format("{}: __metadata__ is {}; expected an object of strings", path,
                                    v.type_name()));
      for (const auto& [k, mv] : v.items()) metadata_value(out.metadata, k, mv);
      continue;
    }
    if (!v.is_object())
      throw malformed(name, fmt::format("{} instead of an object", v.type_name()));
    SafetensorsTensor t;
    t.name = name;
    const auto dtype = v.find("dtype");
    if (dtype == v.end() || !dtype->is_string()) throw malformed(name, "no dtype string");
    if (!st_dtype(dtype->get<std::string>(), &t.dtype))
      throw DataError(
          fmt::format("{}: tensor '{}' has unsupported dtype {}", path, name, dtype->dump()));
    const auto shape = v.find("shape");
    if (shape == v.end() || !shape->is_array()) throw malformed(name, "no shape list");
    // The element count and byte size, refused where they overflow (SafetensorsTensor::numel
    // multiplies the dimensions in 64 bits).
    int64_t numel = 1;
    for (const auto& d : *shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX) ||
          __builtin_mul_overflow(numel, d.get<int64_t>(), &numel))
        throw malformed(name, fmt::format("shape {} is not a list of non-negative integers with "
                                          "a product below 2^63",
                                          shape->dump()));
      t.shape.push_back(d.get<int64_t>());
    }
    int64_t bytes_needed = 0;
    if (__builtin_mul_overflow(numel, static_cast<int64_t>(dtype_size(t.dtype)), &bytes_needed))
      throw malformed(name, fmt::format("shape {} holds more bytes than any file", shape->dump()));
    const auto offsets = v.find("data_offsets");
    if (offsets == v.end() || !offsets->is_array() || offsets->size() != 2 ||
        !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned())
      throw malformed(name, "data_offsets is not a pair of non-negative integers");
    const uint64_t begin = (*offsets)[0].get<uint64_t>(), end = (*offsets)[1].get<uint64_t>();
    if (begin > end || end > data_size || end - begin != static_cast<uint64_t>(bytes_needed))
      throw DataError(
          fmt::format("{}: tensor '{}' has data_offsets {} inconsistent with its shape "
                      "or the file size (truncated file?)",
                      path, name, offsets->dump()));
    t.data = bytes + data_start + begin;
    out.tensors.push_back(std::move(t));
    out.offsets.emplace_back(begin, end);
  }
  check_tiling(out, data_size, path);
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw DataError(
        fmt::format("{}: cannot open safetensors file: {}", path, std::strerror(errno)));
  struct stat st {};
  ::fstat(fd, &st);
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw DataError(fmt::format("{}: cannot map {} bytes: {}", path, size_, std::strerror(errno)));
  }
  SafetensorsHeader header = parse_safetensors(static_cast<const char*>(map_), size_, path);
  tensors_ = std::move(header.tensors);
  metadata_ = std::move(header.metadata);
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, size_);
}

namespace {

// Checkpoints written before the decoder's norms were named by their slot called a block's
// pre-norms by Hugging Face's Llama names: the name such a checkpoint holds for `name`, or "".
std::string legacy_norm_name(const std::string& name) {
  static const std::pair<std::string_view, std::string_view> kRenamed[] = {
      {"self_attn.norm.weight", "input_layernorm.weight"},
      {"mlp.norm.weight", "post_attention_layernorm.weight"}};
  for (const auto& [now, before] : kRenamed)
    if (name.ends_with(now)) return name.substr(0, name.size() - now.size()) + std::string(before);
  return "";
}

}  // namespace

const SafetensorsTensor* SafetensorsFile::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  const std::string legacy = legacy_norm_name(name);
  if (legacy.empty()) return nullptr;
  for (const auto& t : tensors_)
    if (t.name == legacy) return &t;
  return nullptr;
}

std::vector<float> SafetensorsFile::to_float(const std::string& name) const {
  const SafetensorsTensor* t = find(name);
  if (!t) throw DataError(fmt::format("{}: no tensor named '{}'", path_, name));
  return to_float(name, 0, t->numel());
}

std::vector<float> SafetensorsFile::to_float(const std::string& name, int64_t begin,
                                             int64_t count) const {
  const SafetensorsTensor* t = find(name);
  if (!t) throw DataError(fmt::format("{}: no tensor named '{}'", path_, name));
  TS_CHECK(begin >= 0 && count >= 0 && begin + count <= t->numel(),
           "{}: elements [{}, {}) outside tensor '{}' of {}", path_, begin, begin + count, name,
           t->numel());
  std::vector<float> out(count);
  // Tensor data need not be aligned in the file: read 16-bit values byte-wise.
  const char* src = static_cast<const char*>(t->data);
  auto half = [&](size_t i) {
    uint16_t bits;
    std::memcpy(&bits, src + (static_cast<size_t>(begin) + i) * 2, 2);
    return bits;
  };
  switch (t->dtype) {
    case DType::F32:
      std::memcpy(out.data(), src + static_cast<size_t>(begin) * 4, out.size() * 4);
      break;
    case DType::BF16:
      for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_bits_to_float(half(i));
      break;
    case DType::F16:
      for (size_t i = 0; i < out.size(); ++i) out[i] = half_bits_to_float(half(i));
      break;
    default:
      throw DataError(fmt::format("{}: tensor '{}' is {}, expected F32, BF16 or F16", path_, name,
                                  safetensors_dtype_name(t->dtype)));
  }
  return out;
}

}  // namespace tessera
