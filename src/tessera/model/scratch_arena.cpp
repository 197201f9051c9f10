#include "tessera/model/scratch_arena.h"

#include "tessera/core/error.h"

namespace tessera {

Tensor ScratchArena::take(DType dtype, Shape shape) {
  const size_t bytes = aligned(static_cast<size_t>(shape.numel()) * dtype_size(dtype));
  TS_CHECK(used_ + bytes <= buffer_.bytes(), "generation scratch: {} bytes needed, {} of {} free",
           bytes, buffer_.bytes() - used_, buffer_.bytes());
  const Tensor t = buffer_.tensor(dtype, shape, used_);
  used_ += bytes;
  return t;
}

}  // namespace tessera
