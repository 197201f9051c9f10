#include "tessera/backend/backend_factory.h"

#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/core/error.h"
#include "tessera/distributed/communicator.h"
#ifdef TESSERA_WITH_CUDA
#include "tessera/backend/cuda/cuda_platform.h"
#endif

namespace tessera {

const Platform* gpu_platform() {
#ifdef TESSERA_WITH_CUDA
  return &cuda::cuda_platform();
#else
  return nullptr;
#endif
}

int gpu_device_count() {
  const Platform* p = gpu_platform();
  return p ? p->device_count() : 0;
}

std::string no_gpu_reason() {
  const Platform* p = gpu_platform();
  if (!p)
    return "this build has no GPU backend (no nvcc at build time, or -DTESSERA_GPU other than "
           "cuda)";
  return p->unavailable_reason();
}

std::unique_ptr<Backend> make_backend(DeviceChoice choice, int device_index,
                                      const BackendOptions& options) {
  const int gpus = gpu_device_count();
  if (choice == DeviceChoice::Cpu || (choice == DeviceChoice::Auto && gpus == 0))
    return make_cpu_backend();
  if (!gpu_platform())
    throw ConfigError(
        "command line", "device", "cuda",
        "cpu or auto: this build has no CUDA backend (nvcc was not found at build time)");
  if (gpus == 0)
    throw ConfigError("command line", "device", "cuda",
                      "a visible CUDA GPU (none found: " + no_gpu_reason() + ")");
  return gpu_platform()->make_backend(device_index, options);
}

std::unique_ptr<dist::Communicator> make_communicator(Backend& backend,
                                                      dist::Rendezvous& rendezvous,
                                                      double timeout_s, Logger& log) {
  if (backend.device().kind != DeviceKind::GPU || !gpu_platform())
    throw ConfigError("command line", "device", device_name(backend.device()),
                      "cuda: a job of several processes trains one GPU per process (on the CPU, "
                      "run the ranks as threads of one process: tessera train --device cpu "
                      "--nproc_per_node N)");
  return gpu_platform()->make_communicator(backend, rendezvous, timeout_s, log);
}

}  // namespace tessera
