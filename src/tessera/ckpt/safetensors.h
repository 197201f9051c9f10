#pragma once
// The safetensors format (Hugging Face): an 8-byte little-endian header length, a JSON
// header mapping each tensor name to {dtype, shape, data_offsets}, then the raw bytes.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/dtype.h"

namespace tessera {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // host memory of numel * dtype_size bytes
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
};

// Writes to `path` through a temporary file that is flushed to disk and then renamed into
// place, so a crash never leaves a half-written file under the final name.
void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// The same, with each tensor's bytes produced by fill(index, dst) just before it is written
// (`data` is ignored): writing a checkpoint of any size needs host memory for one tensor.
void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata,
                       const std::function<void(size_t index, void* dst)>& fill);

// The tensors and metadata of a safetensors file held in memory (`bytes`, `size`: the whole
// file), checked: a JSON object header inside the file, known dtypes, shapes whose bytes fit,
// and data_offsets that tile the data region exactly (no overlap, no gap), as the format
// requires. Tensors' `data` point into `bytes`. Throws DataError naming `path`.
struct SafetensorsHeader {
  std::vector<SafetensorsTensor> tensors;
  std::map<std::string, std::string> metadata;
  std::vector<std::pair<uint64_t, uint64_t>> offsets;  // each tensor's [begin, end) in the data
};
SafetensorsHeader parse_safetensors(const char* bytes, size_t size, const std::string& path);

// A safetensors file mapped into memory (read lazily, so opening a large file to check its
// header is cheap). Throws DataError naming the file on any malformation (short header, bad
// JSON, offsets outside the data or not tiling it, unknown dtype).
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* find(const std::string& name) const;
  // The tensor's values as fp32 (converting bf16 and fp16); throws DataError if absent.
  std::vector<float> to_float(const std::string& name) const;
  // Elements [begin, begin + count) of the tensor in row-major order, as fp32.
  std::vector<float> to_float(const std::string& name, int64_t begin, int64_t count) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// "F32", "BF16", ... as written in safetensors headers.
const char* safetensors_dtype_name(DType dtype);

}  // namespace tessera
