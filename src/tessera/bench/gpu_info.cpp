#include "tessera/bench/gpu_info.h"

#include "tessera/backend/backend_factory.h"
#include "tessera/core/error.h"
#ifdef TESSERA_WITH_CUDA
#include "tessera/backend/cuda/bench_kernels.cuh"
#include "tessera/backend/cuda/cuda_backend.h"
#endif

namespace tessera::bench {

bool built_with_cuda() {
#ifdef TESSERA_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::optional<GpuInfo> gpu_info(int device) {
#ifdef TESSERA_WITH_CUDA
  if (device >= cuda_device_count()) return std::nullopt;
  const cuda::GpuProperties p = cuda::gpu_properties(device);
  auto version = [](int v) {
    return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
  };
  const size_t lt = p.cublaslt_version;
  GpuInfo g;
  g.name = p.name;
  g.compute_capability = std::to_string(p.sm_major) + "." + std::to_string(p.sm_minor);
  g.multiprocessors = p.multiprocessors;
  g.total_bytes = p.total_bytes;
  g.free_bytes = p.free_bytes;
  g.l2_bytes = p.l2_bytes;
  g.driver = version(p.driver_version);
  g.runtime = version(p.runtime_version);
  g.cublaslt = std::to_string(lt / 10000) + "." + std::to_string(lt / 100 % 100) + "." +
               std::to_string(lt % 100);
  return g;
#else
  (void)device;
  return std::nullopt;
#endif
}

std::string no_gpu_reason() {
#ifdef TESSERA_WITH_CUDA
  return cuda_device_count() > 0 ? "" : cuda::unavailable_reason();
#else
  return "this build has no CUDA backend (no nvcc at build time, or -DTESSERA_CUDA=OFF)";
#endif
}

std::string cudnn_version() {
#ifdef TESSERA_WITH_CUDA
  return cuda::cudnn_version();
#else
  return "-";
#endif
}

std::string nccl_version() {
#ifdef TESSERA_WITH_CUDA
  return cuda::nccl_version();
#else
  return "-";
#endif
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
