#include "tessera/ckpt/safetensors.h"

#include <cstring>
#include <filesystem>
#include <fstream>

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
    {DType::F32, "F32"},      {DType::BF16, "BF16"},     {DType::F16, "F16"},
    {DType::E4M3, "F8_E4M3"}, {DType::E5M2, "F8_E5M2"},  {DType::I32, "I32"},
    {DType::I64, "I64"},      {DType::U8, "U8"},
};

const char* st_name(DType d) {
  for (const auto& n : kNames)
    if (n.dtype == d) return n.name;
  return "?";
}

bool st_dtype(const std::string& s, DType* out) {
  for (const auto& n : kNames)
    if (s == n.name) return *out = n.dtype, true;
  return false;
}

}  // namespace

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype);
    header[t.name] = {{"dtype", st_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw DataError(fmt::format("{}: cannot open for writing", tmp));
    const uint64_t n = json.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out.write(json.data(), static_cast<std::streamsize>(json.size()));
    for (const auto& t : tensors)
      out.write(static_cast<const char*>(t.data),
                static_cast<std::streamsize>(t.numel() * dtype_size(t.dtype)));
    if (!out.flush()) {
      std::filesystem::remove(tmp);
      throw DataError(fmt::format("{}: write failed (disk full?)", tmp));
    }
  }
  std::filesystem::rename(tmp, path);
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw DataError(fmt::format("{}: cannot open safetensors file", path));
  const auto size = static_cast<size_t>(in.tellg());
  in.seekg(0);
  bytes_.resize(size);
  in.read(bytes_.data(), static_cast<std::streamsize>(size));
  if (size < 8) throw DataError(fmt::format("{}: {} bytes, too short for a safetensors header", path, size));
  uint64_t n = 0;
  std::memcpy(&n, bytes_.data(), 8);
  if (n > size - 8)
    throw DataError(fmt::format("{}: header length {} exceeds the file size {} (truncated file?)", path, n, size));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes_.begin() + 8, bytes_.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("{}: malformed JSON header: {}", path, e.what()));
  }
  const size_t data_start = 8 + n, data_size = size - data_start;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      for (const auto& [k, mv] : v.items()) metadata_[k] = mv.is_string() ? mv.get<std::string>() : mv.dump();
      continue;
    }
    SafetensorsTensor t;
    t.name = name;
    try {
      if (!st_dtype(v.at("dtype").get<std::string>(), &t.dtype))
        throw DataError(fmt::format("{}: tensor '{}' has unsupported dtype {}", path, name, v.at("dtype").dump()));
      t.shape = v.at("shape").get<std::vector<int64_t>>();
      const auto off = v.at("data_offsets").get<std::vector<uint64_t>>();
      if (off.size() != 2 || off[0] > off[1] || off[1] > data_size ||
          off[1] - off[0] != static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype))
        throw DataError(fmt::format("{}: tensor '{}' has data_offsets {} inconsistent with its shape "
                                    "or the file size (truncated file?)", path, name, v.at("data_offsets").dump()));
      t.data = bytes_.data() + data_start + off[0];
    } catch (const nlohmann::json::exception& e) {
      throw DataError(fmt::format("{}: tensor '{}' entry is malformed: {}", path, name, e.what()));
    }
    tensors_.push_back(std::move(t));
  }
}

const SafetensorsTensor* SafetensorsFile::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

std::vector<float> SafetensorsFile::to_float(const std::string& name) const {
  const SafetensorsTensor* t = find(name);
  if (!t) throw DataError(fmt::format("{}: no tensor named '{}'", path_, name));
  std::vector<float> out(t->numel());
  if (t->dtype == DType::F32) {
    std::memcpy(out.data(), t->data, out.size() * 4);
  } else if (t->dtype == DType::BF16) {
    const auto* b = static_cast<const uint16_t*>(t->data);
    for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_bits_to_float(b[i]);
  } else {
    throw DataError(fmt::format("{}: tensor '{}' is {}, expected F32 or BF16", path_, name, st_name(t->dtype)));
  }
  return out;
}

}  // namespace tessera
