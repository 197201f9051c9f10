#pragma once
// Tensors for op tests on any backend (ggml test-backend-ops rules): random inputs that are
// never zero, guard regions around every tensor, NaN poison, host values in and out of
// tensors of any float dtype, and relative errors.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "tessera/ops/device_buffer.h"

namespace tessera::test {

// normal(0, scale) values, redrawn where they come out as zero: a zero input can hide a
// missing term or an unwritten output.
inline std::vector<float> random_normal(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) {
    do x = d(rng);
    while (x == 0.0f);
  }
  return v;
}

template <class T>
bool all_nonzero(const std::vector<T>& v) {
  return std::none_of(v.begin(), v.end(), [](T x) { return x == T(0); });
}

inline std::vector<float> round_bf16(std::vector<float> v) {
  for (auto& x : v) x = round_to_bf16(x);
  return v;
}

// ||a - ref|| / ||ref|| (the absolute norm where ref is all zeros); infinite if a holds a NaN
// or an infinity.
template <class T>
double relative_error(const std::vector<T>& a, const std::vector<T>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::infinity();
    const double d = static_cast<double>(a[i]) - static_cast<double>(ref[i]);
    diff += d * d;
    norm += static_cast<double>(ref[i]) * static_cast<double>(ref[i]);
  }
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

// A tensor with 256 guard bytes before and after (so the tensor keeps the allocation's
// alignment), filled with a sentinel that no op writes.
class GuardedTensor {
 public:
  static constexpr size_t kGuard = 256;
  static constexpr unsigned char kSentinel = 0xA5;

  GuardedTensor(Backend& b, DType dtype, Shape shape) : backend_(&b) {
    const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
    buffer_ = DeviceBuffer(b, bytes + 2 * kGuard, "test tensor");
    const std::vector<unsigned char> pattern(kGuard, kSentinel);
    for (const Tensor& guard : guards()) b.upload(guard, pattern.data());
    tensor_ = buffer_.tensor(dtype, shape, kGuard);
  }
  const Tensor& t() const { return tensor_; }
  operator const Tensor&() const { return tensor_; }

  // True when no byte outside the tensor changed.
  bool guards_intact() const {
    std::vector<unsigned char> bytes(kGuard);
    for (const Tensor& guard : guards()) {
      backend_->download(bytes.data(), guard);
      if (std::count(bytes.begin(), bytes.end(), kSentinel) != kGuard) return false;
    }
    return true;
  }

 private:
  std::array<Tensor, 2> guards() const {
    const int64_t n = kGuard;
    return {buffer_.tensor(DType::U8, {n}),
            buffer_.tensor(DType::U8, {n}, buffer_.bytes() - kGuard)};
  }

  Backend* backend_;
  DeviceBuffer buffer_;
  Tensor tensor_;
};

// Host fp32 values into a tensor of any float dtype (bf16 rounded to nearest even).
inline void upload_float(Backend& b, const Tensor& t, const std::vector<float>& v) {
  EXPECT_EQ(static_cast<int64_t>(v.size()), t.numel());
  if (t.dtype == DType::F32) return b.upload(t, v.data());
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = float_to_bf16_bits(v[i]);
  b.upload(t, bits.data());
}

inline std::vector<float> download_float(Backend& b, const Tensor& t) {
  std::vector<float> out(t.numel());
  if (t.dtype == DType::F32) {
    b.download(out.data(), t);
  } else {
    std::vector<uint16_t> bits(out.size());
    b.download(bits.data(), t);
    for (size_t i = 0; i < bits.size(); ++i) out[i] = bf16_bits_to_float(bits[i]);
  }
  return out;
}

// NaN in every element, uploaded so that no op under test takes part.
inline void poison(Backend& b, const Tensor& t) {
  upload_float(b, t, std::vector<float>(static_cast<size_t>(t.numel()), std::nanf("")));
}

}  // namespace tessera::test
