#include "tessera/ckpt/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
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
  const char* bytes = static_cast<const char*>(map_);
  if (size_ < 8)
    throw DataError(fmt::format("{}: {} bytes, too short for a safetensors header", path, size_));
  uint64_t n = 0;
  std::memcpy(&n, bytes, 8);
  if (n > size_ - 8)
    throw DataError(fmt::format("{}: header length {} exceeds the file size {} (truncated file?)",
                                path, n, size_));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes + 8, bytes + 8 + n);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("{}: malformed JSON header: {}", path, e.what()));
  }
  const size_t data_start = 8 + n, data_size = size_ - data_start;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      for (const auto& [k, mv] : v.items())
        metadata_[k] = mv.is_string() ? mv.get<std::string>() : mv.dump();
      continue;
    }
    SafetensorsTensor t;
    t.name = name;
    try {
      if (!st_dtype(v.at("dtype").get<std::string>(), &t.dtype))
        throw DataError(fmt::format("{}: tensor '{}' has unsupported dtype {}", path, name,
                                    v.at("dtype").dump()));
      t.shape = v.at("shape").get<std::vector<int64_t>>();
      const auto off = v.at("data_offsets").get<std::vector<uint64_t>>();
      if (off.size() != 2 || off[0] > off[1] || off[1] > data_size || off[1] - off[0] != t.nbytes())
        throw DataError(
            fmt::format("{}: tensor '{}' has data_offsets {} inconsistent with its shape "
                        "or the file size (truncated file?)",
                        path, name, v.at("data_offsets").dump()));
      t.data = bytes + data_start + off[0];
    } catch (const nlohmann::json::exception& e) {
      throw DataError(fmt::format("{}: tensor '{}' entry is malformed: {}", path, name, e.what()));
    }
    tensors_.push_back(std::move(t));
  }
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
  const auto* h = static_cast<const uint16_t*>(t->data) + begin;
  switch (t->dtype) {
    case DType::F32:
      std::memcpy(out.data(), static_cast<const float*>(t->data) + begin, out.size() * 4);
      break;
    case DType::BF16:
      for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_bits_to_float(h[i]);
      break;
    case DType::F16:
      for (size_t i = 0; i < out.size(); ++i) out[i] = half_bits_to_float(h[i]);
      break;
    default:
      throw DataError(fmt::format("{}: tensor '{}' is {}, expected F32, BF16 or F16", path_, name,
                                  safetensors_dtype_name(t->dtype)));
  }
  return out;
}

}  // namespace tessera
