#pragma once
// The CUDA platform (backend/platform.h): CudaBackend, the NCCL communicator, the CUPTI
// tracer and device facts. Plain C++, so that platform.cpp includes it without nvcc.
#include "tessera/backend/platform.h"

namespace tessera::cuda {

const Platform& cuda_platform();

}  // namespace tessera::cuda
