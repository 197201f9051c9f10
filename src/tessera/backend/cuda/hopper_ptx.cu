// The host's side of hopper_ptx.cuh: tensor maps for TMA.
#include <atomic>
#include <string>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/hopper_ptx.cuh"
#include "tessera/core/error.h"

namespace tessera::cuda {

CUtensorMap hopper::tensor_map(const void* base, int element_bytes, const uint64_t (&dims)[3],
                               const uint64_t (&strides)[2], const uint32_t (&box)[3]) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    TS_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                   cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
      throw InternalError("the driver has no cuTensorMapEncodeTiled (TMA)");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map;
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult made =
      encode(&map,
             element_bytes == 4   ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
             : element_bytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                  : CU_TENSOR_MAP_DATA_TYPE_UINT8,
             3, const_cast<void*>(base), dims, strides, box, element_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (made != CUDA_SUCCESS) {
    throw InternalError("cuTensorMapEncodeTiled failed (" + std::to_string(made) +
                        ") for a tensor of " + std::to_string(dims[0]) + " x " +
                        std::to_string(dims[1]) + " x " + std::to_string(dims[2]) + " elements");
  }
  return map;
}

namespace {

// Rows of `width` elements of element_bytes as (planes, seq, width), in boxes of `rows` rows x
// one 128-byte swizzle span.
CUtensorMap rows_map(const void* base, int element_bytes, int64_t width, int64_t seq,
                     int64_t planes, uint32_t rows) {
  const uint64_t row_bytes = static_cast<uint64_t>(width) * static_cast<uint64_t>(element_bytes);
  const uint64_t dims[3] = {static_cast<uint64_t>(width), static_cast<uint64_t>(seq),
                            static_cast<uint64_t>(planes)};
  const uint64_t strides[2] = {row_bytes, row_bytes * static_cast<uint64_t>(seq)};
  const uint32_t box[3] = {128u / static_cast<uint32_t>(element_bytes), rows, 1};
  return hopper::tensor_map(base, element_bytes, dims, strides, box);
}

}  // namespace

CUtensorMap hopper::row_map(const bf16* base, int64_t width, int64_t seq, int64_t planes,
                            uint32_t rows) {
  return rows_map(base, 2, width, seq, planes, rows);
}

CUtensorMap hopper::codes_map(const void* base, int64_t width, int64_t seq, int64_t planes,
                              uint32_t rows) {
  return rows_map(base, 1, width, seq, planes, rows);
}

bool hopper::runs_on(int device) {
#if defined(TESSERA_CUDA_SM90A)
  // Asked on every call of the kernels' users: each device's answer is looked up once (0: not
  // yet, 1: no, 2: yes).
  static std::atomic<int> sm90[64];
  if (device < 0 || device >= 64) return false;
  if (sm90[device] == 0) {
    int major = 0, minor = 0;
    TS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    TS_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    sm90[device] = major == 9 && minor == 0 ? 2 : 1;
  }
  return sm90[device] == 2;
#else
  (void)device;
  return false;
#endif
}

}  // namespace tessera::cuda
