#include "tessera/bench/gpu_info.h"

#include "tessera/core/error.h"

namespace tessera::bench {

std::optional<DeviceInfo> gpu_info(int device) {
  if (device >= gpu_device_count()) return std::nullopt;
  return gpu_platform()->device_info(device);
}

std::optional<analysis::GpuSpec> resolve_gpu_spec(const std::string& requested) {
  if (!requested.empty()) {
    if (auto spec = analysis::find_gpu_spec(requested)) return spec;
    std::string names;
    for (const auto& s : analysis::load_gpu_specs()) names += (names.empty() ? "" : ", ") + s.name;
    throw ConfigError("command line", "gpu", requested, "one of " + names + " (configs/gpus.yaml)");
  }
  if (auto g = gpu_info(0)) return analysis::find_gpu_spec(g->name);
  return std::nullopt;
}

}  // namespace tessera::bench
