#pragma once
// The platform factory: this build's GPU platform (ops/platform.h), and the backend and
// communicator a run asks for. The only place that picks a vendor.
#include <memory>
#include <string>

#include "tessera/config/config.h"
#include "tessera/ops/platform.h"

namespace tessera {

// This build's GPU platform; null when it was built without one.
const Platform* gpu_platform();
// gpu_platform()'s device count, 0 without a platform.
int gpu_device_count();
// Why no GPU can be used: no platform in this build, or the platform's reason.
std::string no_gpu_reason();

// The backend for `choice` (auto: a GPU when one is present, else the CPU). Throws
// ConfigError when a GPU is asked for but unavailable, naming why, and when the options ask
// for what the GPU's platform cannot do.
std::unique_ptr<Backend> make_backend(DeviceChoice choice, int device_index,
                                      const BackendOptions& options = {});

// This process's communicator in a job of several processes, one per device, over
// `backend`'s platform (Platform::make_communicator). Throws ConfigError for a backend that
// has no communicator between processes (the CPU's).
std::unique_ptr<dist::Communicator> make_communicator(Backend& backend,
                                                      dist::Rendezvous& rendezvous,
                                                      double timeout_s, Logger& log);

}  // namespace tessera
