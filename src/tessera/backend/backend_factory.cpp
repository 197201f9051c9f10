#include "tessera/backend/backend_factory.h"

#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/core/error.h"
#ifdef TESSERA_WITH_CUDA
#include "tessera/backend/cuda/cuda_backend.h"
#endif

namespace tessera {

int cuda_device_count() {
#ifdef TESSERA_WITH_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

std::unique_ptr<Backend> make_backend(DeviceChoice choice, int device_index,
                                      const BackendOptions& options) {
  const int gpus = cuda_device_count();
  if (choice == DeviceChoice::Cpu || (choice == DeviceChoice::Auto && gpus == 0))
    return make_cpu_backend();
#ifdef TESSERA_WITH_CUDA
  if (gpus == 0)
    throw ConfigError("command line", "device", "cuda", "a visible CUDA GPU (none found: " + cuda::unavailable_reason() + ")");
  return cuda::make_cuda_backend(device_index, options.attention, options.gemm_autotune);
#else
  (void)options;
  throw ConfigError("command line", "device", "cuda",
                    "cpu or auto: this build has no CUDA backend (nvcc was not found at build time)");
#endif
}

}  // namespace tessera
