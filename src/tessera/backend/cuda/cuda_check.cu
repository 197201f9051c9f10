#include "tessera/backend/cuda/cuda_check.cuh"

#include <string>

#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/core/error.h"

namespace tessera::cuda {

void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line) {
  throw InternalError(std::string("CUDA error at ") + file + ":" + std::to_string(line) + ": " +
                      call + " failed: " + cudaGetErrorName(error) + " (" +
                      cudaGetErrorString(error) + ")");
}

void throw_unsupported_dtype(const char* op, DType dtype) {
  throw InternalError(std::string("cuda ") + op + ": no kernel for dtype " +
                      std::string(dtype_name(dtype)));
}

void check_grid(const char* op, int64_t blocks) {
  if (blocks > 2147483647)
    throw InternalError(std::string("cuda ") + op + ": " + std::to_string(blocks) +
                        " blocks exceed the grid limit");
}

}  // namespace tessera::cuda
