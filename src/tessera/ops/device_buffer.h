#pragma once
// DeviceBuffer: owning handle to one allocation made through a Backend.
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "tessera/ops/backend.h"

namespace tessera {

// HostBuffer: owning handle to host memory a Backend allocated for fast transfers
// (Backend::allocate_host).
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(Backend& backend, size_t bytes, const char* what)
      : backend_(&backend), data_(backend.allocate_host(bytes, what)), bytes_(bytes) {}
  ~HostBuffer() {
    if (data_) backend_->release_host(data_);
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  HostBuffer(HostBuffer&& o) noexcept { *this = std::move(o); }
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    std::swap(backend_, o.backend_);
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend& backend, size_t bytes, const char* what)
      : backend_(&backend), data_(bytes ? backend.allocate(bytes, what) : nullptr), bytes_(bytes) {}
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(backend_, o.backend_);
      std::swap(data_, o.data_);
      std::swap(bytes_, o.bytes_);
    }
    return *this;
  }

  void reset() {
    if (data_) backend_->release(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

  // A tensor over the buffer starting at byte_offset.
  Tensor tensor(DType dtype, Shape shape, size_t byte_offset = 0) const {
    TS_CHECK(byte_offset + static_cast<size_t>(shape.numel()) * dtype_size(dtype) <= bytes_,
             "tensor {} at offset {} exceeds buffer of {} bytes", shape.str(), byte_offset, bytes_);
    return Tensor{static_cast<char*>(data_) + byte_offset, dtype, shape, backend_->device()};
  }

 private:
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Uploads n host fp32 values into dst, an fp32 or bf16 tensor of n elements (bf16 rounded to
// nearest even on the host): loaded weights and optimizer state into wherever a run keeps
// them.
inline void upload_values(Backend& backend, const Tensor& dst, const float* values) {
  if (dst.dtype == DType::F32) return backend.upload(dst, values);
  TS_CHECK(dst.dtype == DType::BF16, "upload_values: {} destination, expected fp32 or bf16",
           dtype_name(dst.dtype));
  std::vector<uint16_t> bits(static_cast<size_t>(dst.numel()));
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = float_to_bf16_bits(values[i]);
  backend.upload(dst, bits.data());
}

}  // namespace tessera
