#pragma once
// The two pieces of NumPy that Megatron's GPT dataset depends on, so that Tessera's sample
// indices are the ones Megatron builds for the same data and seed, saved in the files it
// saves them in: .npy arrays, and the legacy numpy.random.RandomState(seed).shuffle.
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "tessera/data/mapped_file.h"

namespace tessera {

enum class NpyType { Int16, Int32, UInt32, Int64 };

// A C-ordered 1-D (cols == 0) or 2-D array of integers, built in memory or mapped from a
// .npy file. Move-only.
class NpyArray {
 public:
  NpyArray() = default;
  NpyArray(NpyType type, uint64_t rows, uint64_t cols = 0);  // zero-filled
  // Maps a .npy file (format 1.0-3.0, little-endian integers, C order). Throws DataError
  // naming the file when it is not one.
  static NpyArray load(const std::string& path);
  // Writes the array as a .npy file that numpy.load reads. Throws DataError on failure.
  void save(const std::string& path) const;

  NpyType type() const { return type_; }
  uint64_t rows() const { return rows_; }
  uint64_t cols() const { return cols_; }  // 0 for a 1-D array
  uint64_t size() const { return rows_ * (cols_ ? cols_ : 1); }
  int64_t at(uint64_t i) const;  // element i in C order
  int64_t at(uint64_t row, uint64_t col) const { return at(row * cols_ + col); }
  template <class T>
  T* data() {
    return reinterpret_cast<T*>(owned_.data());
  }

 private:
  const uint8_t* bytes() const { return owned_.empty() ? mapped_.data() + offset_ : owned_.data(); }

  NpyType type_ = NpyType::Int64;
  uint64_t rows_ = 0, cols_ = 0;
  std::vector<uint8_t> owned_;
  MappedFile mapped_;
  size_t offset_ = 0;  // data offset in the mapped file
};

// numpy.random.RandomState(seed) as far as shuffle() goes: MT19937 seeded exactly as
// std::mt19937 seeds it, and NumPy's bounded draw (a bit mask and rejection). Any other
// draw, e.g. modulo or Lemire's method, gives a different permutation.
class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : mt_(seed) {}

  // Uniform in [0, max], as NumPy's random_interval.
  uint64_t interval(uint64_t max);

  // In-place Fisher-Yates from the back, drawing as RandomState.shuffle does for 1-D arrays.
  template <class T>
  void shuffle(T* data, uint64_t n) {
    for (uint64_t i = n; i-- > 1;) std::swap(data[i], data[interval(i)]);
  }

 private:
  std::mt19937 mt_;
};

}  // namespace tessera
