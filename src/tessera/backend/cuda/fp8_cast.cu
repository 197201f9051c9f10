#include "tessera/backend/cuda/fp8_cast.cuh"

#include <cuda_fp8.h>

#include <cfloat>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/core/error.h"

namespace tessera::cuda {
namespace {

// A block of 256 threads casts a 64 x 64 tile. Loading, a thread takes 8 consecutive
// columns of one row (one 16-byte load of bf16) and two rows 32 apart, so a warp reads four
// full 128-byte rows; the transposed tile leaves through shared memory with each thread
// writing 16 consecutive codes of one output row. One atomic per block: per-warp atomics on
// the single amax address serialised into the cast's dominant cost.
constexpr int kTile = 64;
constexpr int kCastThreads = 256;
constexpr int kPack = 8;                             // columns per thread when loading
constexpr int kRowsPerPass = kCastThreads / (kTile / kPack);  // 32
constexpr int kRunT = kTile * kTile / kCastThreads;      // transposed codes per thread: 16

template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kFormat);
}

// One read of each element: its code goes to out (row-major) and, through the shared tile,
// to out_t. The amax is a max of |x| bit patterns: for non-negative floats unsigned order is
// float order, and any NaN sorts above Inf, so a NaN anywhere makes the amax NaN instead of
// being skipped as fmaxf would.
// vec_in: C % 8 == 0 and x (16 bytes), out (8 bytes) aligned, so a thread's 8 columns are
// all inside or all outside and move as single accesses; vec_t: likewise R % 16 == 0 and
// out_t 16-byte aligned for the transposed runs. Otherwise element by element.
template <class T, __nv_fp8_interpretation_t kFormat>
__global__ void __launch_bounds__(kCastThreads)
fp8_cast_transpose_kernel(const T* __restrict__ x, int64_t R, int64_t C,
                          const float* __restrict__ scale_ptr, uint8_t* __restrict__ out,
                          uint8_t* __restrict__ out_t, unsigned* __restrict__ amax_bits,
                          bool vec_in, bool vec_t) {
  // Rows of 72 bytes keep the 8-byte row-segment stores aligned; a warp's transposed reads
  // (one row, 32 consecutive columns) then touch 8 distinct banks.
  __shared__ __align__(16) uint8_t tile[kTile][kTile + 8];
  __shared__ unsigned warp_amax[kCastThreads / 32];
  const bool cast = out != nullptr || out_t != nullptr;
  const float scale = cast ? *scale_ptr : 1.0f;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int t = threadIdx.x;
  const int tc = (t % (kTile / kPack)) * kPack;
  unsigned m = 0;
#pragma unroll
  for (int pass = 0; pass < kTile / kRowsPerPass; ++pass) {
    const int tr = t / (kTile / kPack) + pass * kRowsPerPass;
    const int64_t r = r0 + tr, c = c0 + tc;
    float v[kPack];
    bool inside[kPack];
    if (vec_in) {
      const bool all = r < R && c < C;
      if (all) load_floats<T, kPack>(x + r * C + c, v);
#pragma unroll
      for (int k = 0; k < kPack; ++k) inside[k] = all;
    } else {
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        inside[k] = r < R && c + k < C;
        if (inside[k]) v[k] = to_float(x[r * C + c + k]);
      }
    }
    alignas(8) uint8_t q[kPack];
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      q[k] = 0;
      if (!inside[k]) continue;
      m = max(m, __float_as_uint(fabsf(v[k])));
      if (cast) q[k] = to_fp8<kFormat>(v[k] * scale);
    }
    if (out != nullptr) {
      if (vec_in) {
        if (inside[0]) *reinterpret_cast<uint2*>(out + r * C + c) = *reinterpret_cast<const uint2*>(q);
      } else {
#pragma unroll
        for (int k = 0; k < kPack; ++k)
          if (inside[k]) out[r * C + c + k] = q[k];
      }
    }
    if (out_t != nullptr) *reinterpret_cast<uint2*>(&tile[tr][tc]) = *reinterpret_cast<const uint2*>(q);
  }
  if (amax_bits != nullptr) {
    m = __reduce_max_sync(0xffffffffu, m);
    if (t % 32 == 0) warp_amax[t / 32] = m;
  }
  if (amax_bits == nullptr && out_t == nullptr) return;
  __syncthreads();
  if (amax_bits != nullptr && t == 0) {
    unsigned block_max = 0;
#pragma unroll
    for (int w = 0; w < kCastThreads / 32; ++w) block_max = max(block_max, warp_amax[w]);
    if (block_max != 0) atomicMax(amax_bits, block_max);
  }
  if (out_t == nullptr) return;
  // Thread t writes codes tile[j0 .. j0 + 16)[tcol], i.e. out_t row c0 + tcol, columns
  // r0 + j0 .. r0 + j0 + 16.
  const int tcol = t % kTile, j0 = (t / kTile) * kRunT;
  const int64_t c = c0 + tcol, r = r0 + j0;
  if (c >= C) return;
  alignas(16) uint8_t run[kRunT];
#pragma unroll
  for (int k = 0; k < kRunT; ++k) run[k] = tile[j0 + k][tcol];
  if (vec_t) {
    if (r < R) *reinterpret_cast<uint4*>(out_t + c * R + r) = *reinterpret_cast<const uint4*>(run);
  } else {
#pragma unroll
    for (int k = 0; k < kRunT; ++k)
      if (r + k < R) out_t[c * R + r + k] = run[k];
  }
}

__global__ void fp8_update_scales_kernel(float* history, int64_t H, int64_t S, float* scale,
                                         float* scale_inv, float* nonfinite, float fp8_max,
                                         int margin, bool most_recent, bool roll) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= S) return;
  float new_scale = scale[s];
  if (!isfinite(history[s])) {
    if (nonfinite != nullptr) *nonfinite = NAN;
    history[s] = 0.0f;
  } else {
    float amax = history[s];
    if (!most_recent)
      for (int64_t h = 1; h < H; ++h) amax = fmaxf(amax, history[h * S + s]);
    if (amax > 0.0f && isfinite(amax)) new_scale = ldexpf(fp8_max / amax, -margin);
    if (isinf(new_scale)) new_scale = FLT_MAX;
  }
  scale[s] = new_scale;
  scale_inv[s] = 1.0f / new_scale;
  if (!roll) return;
  const float first = history[s];
  for (int64_t h = 0; h + 1 < H; ++h) history[h * S + s] = history[(h + 1) * S + s];
  history[(H - 1) * S + s] = first;
  history[s] = 0.0f;
}

}  // namespace

void fp8_cast_transpose(const void* x, DType x_dtype, int64_t R, int64_t C, const float* scale,
                        void* out, void* out_t, DType format, float* amax, cudaStream_t stream) {
  NvtxRange range("fp8_cast_transpose");
  if (R == 0 || C == 0) return;
  const int64_t grid_y = ceil_div(R, kTile);
  TS_CHECK(grid_y <= 65535, "fp8_cast_transpose: {} rows exceed the grid ({} max)", R,
           int64_t{65535} * kTile);
  const dim3 grid(static_cast<unsigned>(ceil_div(C, kTile)), static_cast<unsigned>(grid_y));
  auto* o = static_cast<uint8_t*>(out);
  auto* ot = static_cast<uint8_t*>(out_t);
  auto* a = reinterpret_cast<unsigned*>(amax);
  const bool vec_in = C % kPack == 0 && is_aligned(x, 16) && (o == nullptr || is_aligned(o, kPack));
  const bool vec_t = R % kRunT == 0 && (ot == nullptr || is_aligned(ot, kRunT));
  dispatch_float(x_dtype, "fp8_cast_transpose", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x);
    if (format == DType::E5M2) {
      fp8_cast_transpose_kernel<T, __NV_E5M2><<<grid, kCastThreads, 0, stream>>>(in, R, C, scale, o, ot, a,
                                                                            vec_in, vec_t);
    } else {
      TS_CHECK(format == DType::E4M3 || (out == nullptr && out_t == nullptr),
               "fp8_cast_transpose: output dtype {} is not fp8", dtype_name(format));
      fp8_cast_transpose_kernel<T, __NV_E4M3><<<grid, kCastThreads, 0, stream>>>(in, R, C, scale, o, ot, a,
                                                                            vec_in, vec_t);
    }
  });
  TS_CUDA_CHECK_LAUNCH("fp8_cast_transpose_kernel");
}

void fp8_update_scales(float* history, int64_t H, int64_t S, float* scale, float* scale_inv,
                       float* nonfinite, float fp8_max, int margin, bool most_recent, bool roll,
                       cudaStream_t stream) {
  NvtxRange range("fp8_update_scales");
  if (S == 0) return;
  constexpr int kThreads = 128;
  const int64_t blocks = ceil_div(S, kThreads);
  check_grid("fp8_update_scales", blocks);
  fp8_update_scales_kernel<<<blocks, kThreads, 0, stream>>>(history, H, S, scale, scale_inv,
                                                            nonfinite, fp8_max, margin, most_recent,
                                                            roll);
  TS_CUDA_CHECK_LAUNCH("fp8_update_scales_kernel");
}

}  // namespace tessera::cuda
