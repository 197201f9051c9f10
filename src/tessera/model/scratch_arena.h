#pragma once
// Device scratch handed out front to back and given back in the reverse order: the
// temporaries of generation, whose sizes change with the number of new tokens, from one
// allocation made up front (no allocation per token).
#include <cstddef>

#include "tessera/core/tensor.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {

class ScratchArena {
 public:
  ScratchArena() = default;
  ScratchArena(Backend& backend, size_t bytes) : buffer_(backend, bytes, "generation scratch") {}

  // The next 256-byte aligned tensor; throws InternalError when the arena is too small (its
  // size is planned from the blocks' cached_scratch_bytes).
  Tensor take(DType dtype, Shape shape);
  size_t mark() const { return used_; }
  void release(size_t mark) { used_ = mark; }

  static size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

 private:
  DeviceBuffer buffer_;
  size_t used_ = 0;
};

}  // namespace tessera
