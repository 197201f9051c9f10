#pragma once
// Entry points of the CUDA backend for code compiled without nvcc (cuda_platform.cpp).
// Plain C++: no CUDA header leaks into tessera_lib through this file.
#include <cstdint>
#include <memory>
#include <string>

#include "tessera/config/config.h"
#include "tessera/ops/backend.h"
#include "tessera/ops/platform.h"

namespace tessera::cuda {

// cuBLASLt's FP8 GEMMs need every dimension a multiple of 16 (CudaBackend's do_*_fp8 check it):
// the CUDA backend's and platform's fp8_gemm_multiple().
inline constexpr int64_t kFp8GemmMultiple = 16;

// Number of usable CUDA devices; 0 (never an abort) without a driver or a GPU.
int device_count();

// Why device_count() is 0, e.g. "CUDA driver version is insufficient for CUDA runtime
// version"; empty when a device is available.
std::string unavailable_reason();

// The backend on device `device` (0-based), attention on options.attention (the rule is in
// cuda_backend.cuh), GEMM algorithms timed per shape when options.gemm_autotune (matmul.cuh).
// Throws ConfigError for an index out of range, and for AttentionBackend::Vendor when cuDNN
// cannot be loaded (naming why).
std::unique_ptr<Backend> make_cuda_backend(int device, const BackendOptions& options = {});

// Memory that another library allocated on a CUDA backend's device for Tessera (NCCL's
// collective buffers) counts in the backend's memory_stats() like its own, from
// count_foreign_allocation until uncount_foreign_allocation; the backend never frees it.
void count_foreign_allocation(Backend& backend, void* ptr, size_t bytes);
void uncount_foreign_allocation(Backend& backend, void* ptr);

// What a CudaBackend allocates of its own for a step with demands `d` (Platform's
// step_buffer_bytes): the cuBLASLt workspace, the kernel scratch grown to the largest request
// in whole granules, the AdamW chunk table and the FP8 scale slots. The cuDNN attention
// workspace counts Tessera's part (softmax sums, dQ accumulator) and not the engine's own,
// which only a built plan knows (0 for cuDNN 9.x's SDPA engines on Hopper).
size_t step_buffer_bytes(const StepBufferDemand& d);

}  // namespace tessera::cuda
