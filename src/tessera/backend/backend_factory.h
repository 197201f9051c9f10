#pragma once
#include <memory>
#include <string>

#include "tessera/config/config.h"
#include "tessera/ops/backend.h"

namespace tessera {

// Number of CUDA devices usable by this build (0 without the CUDA backend or a driver).
int cuda_device_count();

// Choices a backend is made with beyond the device (the CPU backend ignores them).
struct BackendOptions {
  // Fused attention on CUDA: Tessera's kernels, cuDNN's SDPA, or auto (cuDNN where it loads and
  // takes the shape, else Tessera's); the rule is in backend/cuda/cuda_backend.cuh.
  AttentionBackend attention = AttentionBackend::Auto;
  // Time cuBLASLt's candidate algorithms per GEMM shape (backend/cuda/matmul.cuh).
  bool gemm_autotune = true;
};

// Options from an experiment's training config.
inline BackendOptions backend_options(const TrainingConfig& t) {
  BackendOptions o;
  o.attention = t.attention_backend;
  o.gemm_autotune = t.gemm_autotune;
  return o;
}

// The backend for `choice` (auto: CUDA when a GPU is present, else the CPU). Throws
// ConfigError when CUDA is asked for but unavailable, naming why, and when
// attention_backend cudnn is asked for but cuDNN cannot be loaded.
std::unique_ptr<Backend> make_backend(DeviceChoice choice, int device_index,
                                      const BackendOptions& options = {});

}  // namespace tessera
