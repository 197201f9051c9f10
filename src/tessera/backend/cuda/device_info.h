#pragma once
// Device facts and run-time library versions for the CUDA platform (device_info.cu). Plain
// C++ declarations, included by cuda_platform.cpp.
#include <string>

#include "tessera/ops/platform.h"

namespace tessera::cuda {

// Device `device` (0-based, below device_count()). Throws InternalError on a CUDA failure.
DeviceInfo device_info(int device);

// "9.10.2", or "not found (<the loader's message>)".
std::string cudnn_version();
// "2.27.3", or "not found (<the loader's message>)".
std::string nccl_version();

}  // namespace tessera::cuda
