#pragma once
// The GPU facts benchmarks, `tessera memory` and `tessera preflight` report and rely on,
// from this build's GPU platform (backend/backend_factory.h), in a form that also compiles
// without one (where there is no GPU to describe).
#include <optional>
#include <string>

#include "tessera/analysis/gpu_specs.h"
#include "tessera/backend/backend_factory.h"

namespace tessera::bench {

// Device `device` of this build's GPU platform; nullopt without one or without a GPU.
std::optional<DeviceInfo> gpu_info(int device);

// The spec table entry (configs/gpus.yaml) for `requested` when given, else for the visible
// GPU 0. Throws ConfigError for an unknown requested name; nullopt when nothing matches.
std::optional<analysis::GpuSpec> resolve_gpu_spec(const std::string& requested);

}  // namespace tessera::bench
