#pragma once
// NVIDIA: the CUDA runtime, bf16 and FP8 types, cuBLASLt, NCCL (when the build found it) and
// NVTX, and the device helpers every vendor header defines (tessera/backend/cuda/vendor.h).
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <cstdint>

#if defined(TESSERA_WITH_NCCL)
#include <nccl.h>
#endif

#include "tessera/core/dtype.h"

// Host-and-device functions shared with core/ (core/host_device.h).
#define TS_HOST_DEVICE __host__ __device__ __forceinline__

namespace tessera::cuda {

using bf16 = __nv_bfloat16;
using bf16x2 = __nv_bfloat162;

#if defined(__CUDACC__)
__device__ __forceinline__ float bf16_to_float(bf16 x) {
  return __bfloat162float(x);
}
// Round to nearest even, as float_to_bf16_bits on the host.
__device__ __forceinline__ bf16 float_to_bf16(float x) {
  return __float2bfloat16_rn(x);
}
// One instruction for the pair (F2FP.BF16.F32.PACK_AB), half the work of two singles.
__device__ __forceinline__ bf16x2 floats_to_bf16x2(float lo, float hi) {
  return __floats2bfloat162_rn(lo, hi);
}

// ---- warps: the kernels reduce over 32 lanes (a CUDA warp) ----

template <class T>
__device__ __forceinline__ T warp_shfl_xor(T v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}

template <class T>
__device__ __forceinline__ T warp_shfl_down(T v, unsigned delta) {
  return __shfl_down_sync(0xffffffffu, v, delta);
}

// Bit l: whether lane l's predicate holds.
__device__ __forceinline__ unsigned warp_ballot(bool predicate) {
  return __ballot_sync(0xffffffffu, predicate);
}

// Orders the warp's shared-memory accesses before the call against those after it.
__device__ __forceinline__ void warp_sync() {
  __syncwarp();
}

__device__ __forceinline__ unsigned warp_reduce_max(unsigned v) {
  return __reduce_max_sync(0xffffffffu, v);
}

// 2^x on the special-function unit: one MUFU.EX2 (~2 ulp; subnormal results flush to zero).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A kernel's launch bounds: at most `threads` a block, registers capped so that `blocks` of
// them fit an SM (0: no cap).
#define TS_LAUNCH_BOUNDS(threads, blocks) __launch_bounds__(threads, blocks)

// ---- memory and integer pairs ----

// *p as the device's last level of cache holds it (not a line an SM cached earlier): the
// value other blocks' atomics have left there so far.
__device__ __forceinline__ unsigned load_device_coherent(const unsigned* p) {
  return __ldcg(p);
}

// w, from here on bits the compiler cannot see through: values it derived from w before are
// not reused for those derived after (no instruction is emitted).
__device__ __forceinline__ void opaque_bits(uint32_t& w) {
  asm volatile("" : "+r"(w));
}

// The unsigned max of each 16-bit half (one VIMNMX.U16x2 on sm_90).
__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
  return __vmaxu2(a, b);
}

// ---- FP8 codes (core/fp8.h's conversion: round to nearest even, saturating) ----

template <DType kFormat>
inline constexpr __nv_fp8_interpretation_t kFp8Interpretation =
    kFormat == DType::E4M3 ? __NV_E4M3 : __NV_E5M2;

template <DType kFormat>
__device__ __forceinline__ uint8_t fp8_encode(float v) {
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kFp8Interpretation<kFormat>));
}

// Two codes in one 16-bit word, lo in the low byte (one cvt instruction on sm_89 and newer).
template <DType kFormat>
__device__ __forceinline__ uint16_t fp8x2_encode(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, kFp8Interpretation<kFormat>);
}
#endif  // __CUDACC__

}  // namespace tessera::cuda
