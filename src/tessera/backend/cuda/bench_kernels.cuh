#pragma once
// What the benchmarks and `tessera preflight` need from the CUDA stack beyond the op API:
// device properties (the L2 size sets how many input copies a benchmark rotates through),
// the versions of the driver, runtime and cuBLASLt, and the versions of cuDNN and NCCL, which
// Tessera does not link: they are opened with dlopen, so a machine without them still runs.
//
// Plain C++ declarations: included by host code compiled without nvcc (bench/gpu_info.cpp),
// like cuda_backend.h.
#include <cstddef>
#include <string>

namespace tessera::cuda {

struct GpuProperties {
  std::string name;
  int sm_major = 0, sm_minor = 0, multiprocessors = 0;
  size_t total_bytes = 0, free_bytes = 0, l2_bytes = 0;
  int driver_version = 0, runtime_version = 0;  // CUDA's encoding: 13000 = 13.0
  size_t cublaslt_version = 0;                  // 130100 = 13.1.0
};

// Properties of device `device` (0-based, below device_count()). Throws InternalError on a
// CUDA failure.
GpuProperties gpu_properties(int device);

// "9.10.2", or "not found (<the loader's message>)".
std::string cudnn_version();
// "2.27.3", or "not found (<the loader's message>)".
std::string nccl_version();

}  // namespace tessera::cuda
