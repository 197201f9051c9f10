#pragma once
#include <memory>
#include <string>

#include "tessera/config/config.h"
#include "tessera/ops/backend.h"

namespace tessera {

// Number of CUDA devices usable by this build (0 without the CUDA backend or a driver).
int cuda_device_count();

// The backend for `choice` (auto: CUDA when a GPU is present, else the CPU). Throws
// ConfigError when CUDA is asked for but unavailable, naming why.
std::unique_ptr<Backend> make_backend(DeviceChoice choice, int device_index);

}  // namespace tessera
