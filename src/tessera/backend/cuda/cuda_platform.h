#pragma once
// The CUDA platform (ops/platform.h): CudaBackend, the NCCL communicator, the CUPTI
// tracer and device facts. Plain C++, so that backend_factory.cpp includes it without nvcc.
#include "tessera/ops/platform.h"

namespace tessera::cuda {

const Platform& cuda_platform();

}  // namespace tessera::cuda
