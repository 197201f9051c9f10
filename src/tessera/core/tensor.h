#pragma once
// Tensor: a non-owning, contiguous, row-major view of memory that a backend owns.
// Every op in the op API takes contiguous tensors; layouts such as the packed QKV
// activation are described by the op's shape arguments, not by strides, so that each
// kernel can assume dense rows and 16-byte aligned vector access.
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "tessera/core/dtype.h"
#include "tessera/core/error.h"

namespace tessera {

// Where a tensor lives: host memory, or the memory of a GPU of whichever vendor the build
// has (ops/platform.h); backends and platforms name the vendor, core/ never does.
enum class DeviceKind : uint8_t { CPU, GPU };

struct Device {
  DeviceKind kind = DeviceKind::CPU;
  int index = 0;
  bool operator==(const Device&) const = default;
};

std::string device_name(Device d);

class Shape {
 public:
  static constexpr int kMaxRank = 4;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[i]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  std::string str() const;

 private:
  std::array<int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  Shape shape;
  Device device;

  bool defined() const { return data != nullptr; }
  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  int64_t dim(int i) const { return shape[i]; }

  // The same memory seen with another shape of equal element count.
  Tensor view(Shape new_shape) const;
  // Rows [begin, end) along the first dimension.
  Tensor rows(int64_t begin, int64_t end) const;
  // A flat range of elements [offset, offset + count) as a 1-D tensor.
  Tensor flat_range(int64_t offset, int64_t count) const;

  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

// Precondition helpers for op implementations; failures are bugs in the caller.
void expect_dtype(const Tensor& t, DType d, const char* what);
void expect_shape(const Tensor& t, Shape s, const char* what);
void expect_numel(const Tensor& t, int64_t n, const char* what);

}  // namespace tessera
