#pragma once
// The safetensors format (Hugging Face): an 8-byte little-endian header length, a JSON
// header mapping each tensor name to {dtype, shape, data_offsets}, then the raw bytes.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tessera/core/dtype.h"

namespace tessera {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // host memory of numel * dtype_size bytes
  int64_t numel() const;
};

// Writes to `path` through a temporary file renamed into place, so a crash never leaves a
// half-written file under the final name.
void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// A safetensors file read into memory. Throws DataError naming the file on any malformation
// (short header, bad JSON, offsets outside the data, unknown dtype).
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* find(const std::string& name) const;
  // The tensor's values as fp32 (converting bf16); throws DataError if absent.
  std::vector<float> to_float(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<char> bytes_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace tessera
