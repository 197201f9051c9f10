#pragma once
// AMD: CUDA's names mapped onto HIP (ggml's vendors/hip.h does the same), and the device
// helpers every vendor header defines (tessera/backend/cuda/vendor.h).
//
// What is checked: the portable kernel families compile with this header for gfx90a (the CTest
// test Vendor.PortableKernelsCompileForHip, Debian's hipcc). Nothing here has run on an AMD
// GPU. The BLAS and collectives sections are compiled only where hipBLASLt and RCCL are
// installed, which Debian 12 does not package; the portable kernels need neither.
#include <hip/hip_bfloat16.h>
#include <hip/hip_runtime.h>

#include <cstdint>

#include "tessera/core/dtype.h"

// ---- runtime ----
#define cudaDevAttrMaxSharedMemoryPerMultiprocessor \
  hipDeviceAttributeMaxSharedMemoryPerMultiprocessor
#define cudaDeviceGetAttribute hipDeviceGetAttribute
#define cudaDeviceProp hipDeviceProp_t
#define cudaDriverGetVersion hipDriverGetVersion
#define cudaErrorInvalidConfiguration hipErrorInvalidConfiguration
#define cudaErrorInvalidValue hipErrorInvalidValue
#define cudaErrorMemoryAllocation hipErrorOutOfMemory
#define cudaError_t hipError_t
#define cudaEventCreate hipEventCreate
#define cudaEventDestroy hipEventDestroy
#define cudaEventElapsedTime hipEventElapsedTime
#define cudaEventRecord hipEventRecord
#define cudaEventSynchronize hipEventSynchronize
#define cudaEvent_t hipEvent_t
#define cudaFree hipFree
#define cudaFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define cudaGetDevice hipGetDevice
#define cudaGetDeviceCount hipGetDeviceCount
#define cudaGetDeviceProperties hipGetDeviceProperties
#define cudaGetErrorName hipGetErrorName
#define cudaGetErrorString hipGetErrorString
#define cudaGetLastError hipGetLastError
#define cudaMalloc hipMalloc
#define cudaMemGetInfo hipMemGetInfo
#define cudaMemcpy hipMemcpy
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaMemsetAsync hipMemsetAsync
#define cudaRuntimeGetVersion hipRuntimeGetVersion
#define cudaSetDevice hipSetDevice
#define cudaStreamCreateWithFlags hipStreamCreateWithFlags
#define cudaStreamDestroy hipStreamDestroy
#define cudaStreamNonBlocking hipStreamNonBlocking
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaStreamWaitEvent hipStreamWaitEvent
#define cudaStream_t hipStream_t
#define cudaSuccess hipSuccess

// CUDA's runtime takes a kernel as a typed pointer; HIP's as const void*.
template <class Kernel>
inline hipError_t cudaFuncSetAttribute(Kernel* kernel, hipFuncAttribute attribute, int value) {
  return hipFuncSetAttribute(reinterpret_cast<const void*>(kernel), attribute, value);
}

// ---- trace ranges: roctx (part of roctracer) where installed; without it, none ----
#if __has_include(<roctracer/roctx.h>)
#include <roctracer/roctx.h>
#define nvtxRangePushA roctxRangePushA
#define nvtxRangePop roctxRangePop
#else
inline int nvtxRangePushA(const char*) {
  return 0;
}
inline int nvtxRangePop() {
  return 0;
}
#endif

// ---- BLAS: hipBLASLt mirrors cuBLASLt's API for the bf16 GEMMs (not FP8 on gfx90a) ----
#if __has_include(<hipblaslt/hipblaslt.h>)
#include <hipblaslt/hipblaslt.h>
#define CUBLASLT_EPILOGUE_BIAS HIPBLASLT_EPILOGUE_BIAS
#define CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE HIPBLASLT_MATMUL_DESC_BIAS_DATA_TYPE
#define CUBLASLT_MATMUL_DESC_BIAS_POINTER HIPBLASLT_MATMUL_DESC_BIAS_POINTER
#define CUBLASLT_MATMUL_DESC_EPILOGUE HIPBLASLT_MATMUL_DESC_EPILOGUE
#define CUBLASLT_MATMUL_DESC_TRANSA HIPBLASLT_MATMUL_DESC_TRANSA
#define CUBLASLT_MATMUL_DESC_TRANSB HIPBLASLT_MATMUL_DESC_TRANSB
#define CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES HIPBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES
#define CUBLAS_COMPUTE_32F HIPBLAS_COMPUTE_32F
#define CUBLAS_OP_N HIPBLAS_OP_N
#define CUBLAS_OP_T HIPBLAS_OP_T
#define CUBLAS_STATUS_NOT_SUPPORTED HIPBLAS_STATUS_NOT_SUPPORTED
#define CUBLAS_STATUS_SUCCESS HIPBLAS_STATUS_SUCCESS
#define CUDA_R_16BF HIP_R_16BF
#define CUDA_R_32F HIP_R_32F
#define cublasLtCreate hipblasLtCreate
#define cublasLtDestroy hipblasLtDestroy
#define cublasLtHandle_t hipblasLtHandle_t
#define cublasLtMatmul hipblasLtMatmul
#define cublasLtMatmulAlgoGetHeuristic hipblasLtMatmulAlgoGetHeuristic
#define cublasLtMatmulAlgo_t hipblasLtMatmulAlgo_t
#define cublasLtMatmulDescCreate hipblasLtMatmulDescCreate
#define cublasLtMatmulDescDestroy hipblasLtMatmulDescDestroy
#define cublasLtMatmulDescSetAttribute hipblasLtMatmulDescSetAttribute
#define cublasLtMatmulDesc_t hipblasLtMatmulDesc_t
#define cublasLtMatmulHeuristicResult_t hipblasLtMatmulHeuristicResult_t
#define cublasLtMatmulPreferenceCreate hipblasLtMatmulPreferenceCreate
#define cublasLtMatmulPreferenceDestroy hipblasLtMatmulPreferenceDestroy
#define cublasLtMatmulPreferenceSetAttribute hipblasLtMatmulPreferenceSetAttribute
#define cublasLtMatmulPreference_t hipblasLtMatmulPreference_t
#define cublasLtMatrixLayoutCreate hipblasLtMatrixLayoutCreate
#define cublasLtMatrixLayoutDestroy hipblasLtMatrixLayoutDestroy
#define cublasLtMatrixLayout_t hipblasLtMatrixLayout_t
#define cublasStatus_t hipblasStatus_t
#endif

// ---- collectives: RCCL keeps NCCL's API names ----
#if defined(TESSERA_WITH_NCCL)
#include <rccl/rccl.h>
#endif

// Host-and-device functions shared with core/ (core/host_device.h).
#define TS_HOST_DEVICE __host__ __device__ __forceinline__

#include "tessera/backend/cuda/vendors/fp8_codes.h"

namespace tessera::cuda {

// ---- bf16 (HIP 5.2 has no bf16x2 type: a pair of scalars, converted one by one) ----

using bf16 = hip_bfloat16;
struct bf16x2 {
  bf16 x, y;
};

#if defined(__HIPCC__)
__device__ __forceinline__ float bf16_to_float(bf16 x) {
  return static_cast<float>(x);
}
// Round to nearest even, as float_to_bf16_bits on the host.
__device__ __forceinline__ bf16 float_to_bf16(float x) {
  return bf16(x);
}
__device__ __forceinline__ bf16x2 floats_to_bf16x2(float lo, float hi) {
  return {bf16(lo), bf16(hi)};
}

// ---- warps ----
// The kernels reduce over warps of 32 lanes. A wavefront of 64 lanes (gfx90a) holds two of
// them: shuffles stay within each half (width 32) and a ballot reports the caller's half.

template <class T>
__device__ __forceinline__ T warp_shfl_xor(T v, int lane_mask) {
  return __shfl_xor(v, lane_mask, 32);
}

template <class T>
__device__ __forceinline__ T warp_shfl_down(T v, unsigned delta) {
  return __shfl_down(v, delta, 32);
}

__device__ __forceinline__ unsigned warp_ballot(bool predicate) {
  return static_cast<unsigned>(__ballot(predicate) >> (__lane_id() & 32u));
}

// A wavefront runs in lockstep; the fences order its shared-memory accesses as __syncwarp does.
__device__ __forceinline__ void warp_sync() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}

__device__ __forceinline__ unsigned warp_reduce_max(unsigned v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const unsigned other = warp_shfl_xor(v, offset);
    v = other > v ? other : v;
  }
  return v;
}

// The portable 2^x (CUDA's header uses the special-function unit's approximation).
__device__ __forceinline__ float exp2_approx(float x) {
  return exp2f(x);
}

// HIP's second __launch_bounds__ argument is the minimum waves per SIMD (amdgpu_waves_per_eu),
// not blocks per multiprocessor: `blocks` blocks of `threads` on a CU's four SIMDs, in 64-lane
// waves, are blocks * ceil(threads / 64) / 4 waves a SIMD (rounded up; 0 stays 0, no cap).
#define TS_LAUNCH_BOUNDS(threads, blocks) \
  __launch_bounds__(threads, ((blocks) * (((threads) + 63) / 64) + 3) / 4)

// ---- memory and integer pairs ----

// A relaxed atomic load: the device-coherent value, whatever an SM's cache holds.
__device__ __forceinline__ unsigned load_device_coherent(const unsigned* p) {
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}

__device__ __forceinline__ void opaque_bits(uint32_t& w) {
  asm volatile("" : "+v"(w));
}

__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
  const uint32_t lo = max(a & 0xffffu, b & 0xffffu), hi = max(a >> 16, b >> 16);
  return lo | (hi << 16);
}

// ---- FP8 codes: no conversion instruction on gfx90a, so integer code (vendors/fp8_codes.h) ----

template <DType kFormat>
__device__ __forceinline__ uint8_t fp8_encode(float v) {
  return fp8_encode_bits<kFormat>(v);
}

template <DType kFormat>
__device__ __forceinline__ uint16_t fp8x2_encode(float lo, float hi) {
  return static_cast<uint16_t>(fp8_encode_bits<kFormat>(lo) |
                               (static_cast<uint16_t>(fp8_encode_bits<kFormat>(hi)) << 8));
}
#endif  // __HIPCC__

}  // namespace tessera::cuda
