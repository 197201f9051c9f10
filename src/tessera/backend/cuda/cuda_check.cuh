#pragma once
// Error checks for runtime calls and kernel launches, and the NVTX range every launcher opens
// (cuBLASLt's checks are the GEMM adapter's, matmul.cuh). A failed call throws
// tessera::InternalError naming the call, file:line and the runtime's message: with a correct
// caller, a runtime error means a broken invariant or a broken device, never bad user input
// (out of memory is handled separately by CudaBackend::allocate).
#include "tessera/backend/cuda/vendor.h"

namespace tessera::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line);

// Marks a launcher in traces (Nsight Systems, our CUPTI profiler; roctx ranges on HIP) with the
// op's name.
class NvtxRange {
 public:
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace tessera::cuda

#define TS_CUDA_CHECK(call)                                                    \
  do {                                                                         \
    const cudaError_t ts_error_ = (call);                                      \
    if (ts_error_ != cudaSuccess)                                              \
      ::tessera::cuda::throw_cuda_error(ts_error_, #call, __FILE__, __LINE__); \
  } while (0)

// After a <<<...>>> launch: configuration errors (too many threads, too much shared memory)
// surface here; faults inside the kernel surface at the next synchronizing call.
#define TS_CUDA_CHECK_LAUNCH(kernel_name) \
  ::tessera::cuda::check_launch(kernel_name, __FILE__, __LINE__)

namespace tessera::cuda {
inline void check_launch(const char* kernel_name, const char* file, int line) {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) throw_cuda_error(error, kernel_name, file, line);
}
}  // namespace tessera::cuda
