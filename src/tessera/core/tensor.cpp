#include "tessera/core/tensor.h"

#include <fmt/format.h>

namespace tessera {

std::string device_name(Device d) {
  return d.kind == DeviceKind::CPU ? "cpu" : fmt::format("gpu:{}", d.index);
}

Shape::Shape(std::initializer_list<int64_t> dims) {
  TS_CHECK(dims.size() <= kMaxRank, "rank {} exceeds {}", dims.size(), kMaxRank);
  for (int64_t d : dims) {
    TS_CHECK(d >= 0, "negative dimension {}", d);
    dims_[rank_++] = d;
  }
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank_ != o.rank_) return false;
  for (int i = 0; i < rank_; ++i)
    if (dims_[i] != o.dims_[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < rank_; ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
  return s + ")";
}

Tensor Tensor::view(Shape new_shape) const {
  TS_CHECK(new_shape.numel() == numel(), "view {} of tensor {}", new_shape.str(), shape.str());
  Tensor t = *this;
  t.shape = new_shape;
  return t;
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  TS_CHECK(shape.rank() >= 1 && begin >= 0 && begin <= end && end <= shape[0],
           "rows [{}, {}) of {}", begin, end, shape.str());
  const int64_t row = shape[0] == 0 ? 0 : numel() / shape[0];
  Tensor t = *this;
  t.data = static_cast<char*>(data) + begin * row * dtype_size(dtype);
  switch (shape.rank()) {
    case 1: t.shape = Shape{end - begin}; break;
    case 2: t.shape = Shape{end - begin, shape[1]}; break;
    case 3: t.shape = Shape{end - begin, shape[1], shape[2]}; break;
    default: t.shape = Shape{end - begin, shape[1], shape[2], shape[3]}; break;
  }
  return t;
}

Tensor Tensor::flat_range(int64_t offset, int64_t count) const {
  TS_CHECK(offset >= 0 && count >= 0 && offset + count <= numel(), "range [{}, +{}) of {}",
           offset, count, numel());
  Tensor t = *this;
  t.data = static_cast<char*>(data) + offset * dtype_size(dtype);
  t.shape = Shape{count};
  return t;
}

void expect_dtype(const Tensor& t, DType d, const char* what) {
  TS_CHECK(t.dtype == d, "{} has dtype {}, expected {}", what, dtype_name(t.dtype), dtype_name(d));
}

void expect_shape(const Tensor& t, Shape s, const char* what) {
  TS_CHECK(t.shape == s, "{} has shape {}, expected {}", what, t.shape.str(), s.str());
}

void expect_numel(const Tensor& t, int64_t n, const char* what) {
  TS_CHECK(t.numel() == n, "{} has {} elements, expected {}", what, t.numel(), n);
}

}  // namespace tessera
