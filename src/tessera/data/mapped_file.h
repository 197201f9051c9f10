#pragma once
// A read-only memory map of a whole file. Datasets and their index caches are read through
// maps so that a multi-gigabyte corpus costs page cache, not process memory, and opening it
// is instant.
#include <cstddef>
#include <cstdint>
#include <string>

namespace tessera {

class MappedFile {
 public:
  MappedFile() = default;
  // Throws DataError naming the path when it cannot be opened or mapped. `what` says what
  // the file is for ("Megatron index"), for the message.
  MappedFile(const std::string& path, const std::string& what);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void release();

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace tessera
