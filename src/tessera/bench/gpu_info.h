#pragma once
// The GPU facts benchmarks, `tessera memory` and `tessera preflight` report and rely on, in a
// form that also compiles without the CUDA backend (where there is no GPU to describe).
#include <cstddef>
#include <optional>
#include <string>

#include "tessera/analysis/gpu_specs.h"

namespace tessera::bench {

struct GpuInfo {
  std::string name;                // "NVIDIA H200"
  std::string compute_capability;  // "9.0"
  int multiprocessors = 0;
  size_t total_bytes = 0, free_bytes = 0, l2_bytes = 0;
  std::string driver, runtime, cublaslt;  // "13.0", "13.0", "13.1.0"
};

bool built_with_cuda();
// Device `device` of this build's CUDA backend; nullopt without one or without a GPU.
std::optional<GpuInfo> gpu_info(int device);
// Why gpu_info() has nothing: no CUDA backend in this build, or the CUDA runtime's reason.
std::string no_gpu_reason();
// Versions of libraries opened at run time; "not found (...)" when absent, "-" in builds
// without CUDA.
std::string cudnn_version();
std::string nccl_version();

// The spec table entry (configs/gpus.yaml) for `requested` when given, else for the visible
// GPU 0. Throws ConfigError for an unknown requested name; nullopt when nothing matches.
std::optional<analysis::GpuSpec> resolve_gpu_spec(const std::string& requested);

}  // namespace tessera::bench
