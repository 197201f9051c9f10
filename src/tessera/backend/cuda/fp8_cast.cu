#include "tessera/backend/cuda/fp8_cast.cuh"

#include <cuda_fp8.h>

#include <cfloat>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/core/error.h"

namespace tessera::cuda {
namespace {

constexpr int kTile = 32;       // a block casts a 32 x 32 tile
constexpr int kTileRows = 8;    // with 32 x 8 threads, four rows each

template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kFormat);
}

// One read of each element: its code goes to out (row-major, coalesced along columns) and,
// through a shared tile, to out_t (coalesced along the original rows). The amax is a max of
// |x| bit patterns: for non-negative floats unsigned order is float order, and any NaN sorts
// above Inf, so a NaN anywhere makes the amax NaN instead of being skipped as fmaxf would.
template <class T, __nv_fp8_interpretation_t kFormat>
__global__ void fp8_cast_transpose_kernel(const T* __restrict__ x, int64_t R, int64_t C,
                                          const float* __restrict__ scale_ptr,
                                          uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                                          unsigned* __restrict__ amax_bits) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const bool cast = out != nullptr || out_t != nullptr;
  const float scale = cast ? *scale_ptr : 1.0f;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
  unsigned m = 0;
  for (int k = ty; k < kTile; k += kTileRows) {
    const int64_t r = r0 + k, c = c0 + tx;
    if (r < R && c < C) {
      const float v = to_float(x[r * C + c]);
      m = max(m, __float_as_uint(fabsf(v)));
      if (cast) {
        const uint8_t q = to_fp8<kFormat>(v * scale);
        if (out != nullptr) out[r * C + c] = q;
        tile[k][tx] = q;
      }
    }
  }
  if (amax_bits != nullptr) {
    m = __reduce_max_sync(0xffffffffu, m);
    if (tx == 0 && m != 0) atomicMax(amax_bits, m);
  }
  if (out_t == nullptr) return;
  __syncthreads();
  for (int k = ty; k < kTile; k += kTileRows) {
    const int64_t c = c0 + k, r = r0 + tx;
    if (c < C && r < R) out_t[c * R + r] = tile[tx][k];
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
  const dim3 block(kTile, kTileRows);
  auto* o = static_cast<uint8_t*>(out);
  auto* ot = static_cast<uint8_t*>(out_t);
  auto* a = reinterpret_cast<unsigned*>(amax);
  dispatch_float(x_dtype, "fp8_cast_transpose", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x);
    if (format == DType::E5M2) {
      fp8_cast_transpose_kernel<T, __NV_E5M2><<<grid, block, 0, stream>>>(in, R, C, scale, o, ot, a);
    } else {
      TS_CHECK(format == DType::E4M3 || (out == nullptr && out_t == nullptr),
               "fp8_cast_transpose: output dtype {} is not fp8", dtype_name(format));
      fp8_cast_transpose_kernel<T, __NV_E4M3><<<grid, block, 0, stream>>>(in, R, C, scale, o, ot, a);
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
