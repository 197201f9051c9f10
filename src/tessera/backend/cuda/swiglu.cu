#include "tessera/backend/cuda/swiglu.cuh"

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/core/error.h"

namespace tessera::cuda {
namespace {

// Flat grid, one thread per pack of VEC outputs: (N * F / VEC) threads in blocks of 256, so
// each thread issues 16-byte loads of gate and up (and dout) and 16-byte stores. Pure
// streaming: N = 8192, F = 14336 moves 705 MB forward and 1.17 GB backward in bf16.
constexpr int kThreads = 256;

// __fdividef, not the IEEE division, whose slow path held registers (the backward tiles' 86
// against 72) and issue slots in kernels bound by bytes in flight. 1 + e^-x is in [1, inf]:
// __fdividef returns 0 only past 2^126, where the sigmoid is below 1e-38.
__device__ __forceinline__ float sigmoid(float x) {
  return __fdividef(1.0f, 1.0f + __expf(-x));
}

// One function for both forward kernels: the cast's codes are of exactly the values stored.
__device__ __forceinline__ float swiglu_value(float gate, float up) {
  return gate * sigmoid(gate) * up;
}

template <class T, int VEC>
__global__ void swiglu_forward_kernel(T* out, const T* gate_up, int64_t N, int64_t F) {
  const int64_t packs_per_row = F / VEC;
  const int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= N * packs_per_row) return;
  const int64_t n = p / packs_per_row, f = (p % packs_per_row) * VEC;
  const T* gate = gate_up + n * 2 * F + f;
  float g[VEC], u[VEC];
  load_floats<T, VEC>(gate, g);
  load_floats<T, VEC>(gate + F, u);
#pragma unroll
  for (int k = 0; k < VEC; ++k) g[k] = swiglu_value(g[k], u[k]);
  store_floats<T, VEC>(out + n * F + f, g);
}

// swiglu_forward_kernel, also writing the codes of the stored values (their rounding to T, as
// the cast reads them back) and their amax, as the cast kernel reduces it; out, codes and
// codes_t are each written when non-null. Same grid as swiglu_forward_kernel (kernels of the
// same occupancy keep the stream at the bandwidth). Transposed codes here are single bytes
// N apart: the layout for shapes the tiled kernel below does not take.
template <class T, int VEC, DType kFormat>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_cast_kernel(T* out, uint8_t* codes, uint8_t* codes_t, const T* gate_up,
                               int64_t N, int64_t F, const float* scale_ptr, unsigned* amax_bits) {
  __shared__ unsigned warp_amax[kThreads / 32];
  const unsigned seen = amax_seen(amax_bits);
  const int64_t packs_per_row = F / VEC;
  const int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned m = 0;
  if (p < N * packs_per_row) {
    const int64_t n = p / packs_per_row, f = (p % packs_per_row) * VEC;
    const T* gate = gate_up + n * 2 * F + f;
    float g[VEC], u[VEC];
    load_floats<T, VEC>(gate, g);
    load_floats<T, VEC>(gate + F, u);
    const float scale = *scale_ptr;
    alignas(8) uint8_t q[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      g[k] = swiglu_value(g[k], u[k]);
      const float stored = to_float(from_float<T>(g[k]));
      m = max(m, __float_as_uint(fabsf(stored)));
      q[k] = fp8_encode<kFormat>(stored * scale);
    }
    if (out != nullptr) store_floats<T, VEC>(out + n * F + f, g);
    if (codes != nullptr) store_codes(codes + n * F + f, q);
    if (codes_t != nullptr) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) codes_t[(f + k) * N + n] = q[k];
    }
  }
  if (amax_bits == nullptr) return;
  m = warp_reduce_max(m);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) block_amax_to<kThreads>(amax_bits, warp_amax, seen);
}

// silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))). One function for both backward
// kernels: the folded cast's codes are of exactly the values the plain backward stores.
__device__ __forceinline__ void swiglu_grad(float gate, float up, float dout, float& dgate,
                                            float& dup) {
  const float sig = sigmoid(gate);
  dgate = dout * up * sig * (1.0f + gate * (1.0f - sig));
  dup = dout * gate * sig;
}

template <class T, int VEC>
__global__ void swiglu_backward_kernel(T* dgate_up, const T* dout, const T* gate_up, int64_t N,
                                       int64_t F) {
  const int64_t packs_per_row = F / VEC;
  const int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= N * packs_per_row) return;
  const int64_t n = p / packs_per_row, f = (p % packs_per_row) * VEC;
  const T* gate = gate_up + n * 2 * F + f;
  T* dgate = dgate_up + n * 2 * F + f;
  float g[VEC], u[VEC], d[VEC];
  load_floats<T, VEC>(gate, g);
  load_floats<T, VEC>(gate + F, u);
  load_floats<T, VEC>(dout + n * F + f, d);
#pragma unroll
  for (int k = 0; k < VEC; ++k) swiglu_grad(g[k], u[k], d[k], g[k], u[k]);
  store_floats<T, VEC>(dgate, g);
  store_floats<T, VEC>(dgate + F, u);
}

// The SwiGLU's forward or backward writing its result's FP8 codes in both layouts in one tile
// pass: h's (N, F) and (F, N) in the forward (h itself not stored: the down projection's
// forward reads the first, its weight gradient keeps the second), d(gate_up)'s (N, 2F) and
// (2F, N) in the backward (d(gate_up) itself not stored). A block of 128 threads takes 128 rows
// of 64 columns of F and, in the backward, writes both halves of those columns: each element's
// sigmoid is computed once, and gate, up and dout are read once, where a cast of the bf16
// gradient reads 2F columns back and its tiles would compute the sigmoid twice
// (performance-notes entries 16 and 53). Loads as fp8_cast_transpose_kernel's (a thread's 8
// columns of rows 16 apart), kCastInFlight of its 8 rows' loads issued before any use; codes go
// to the row-major output at once (when out is non-null) and through shared memory, as 32-bit
// words, to the transposed one in runs of 16 rows. One amax atomic a block. Aligned shapes only
// (N % 128, F % 64, 16-byte pointers).
constexpr int kCastRows = 128, kCastCols = 64, kCastThreads = 128, kCastPack = 8;
constexpr int kCastRowsPerPass = kCastThreads / (kCastCols / kCastPack);  // 16
constexpr int kCastPasses = kCastRows / kCastRowsPerPass;                 // 8
constexpr int kCastInFlight = 4;  // measured: 4 rows' loads beat 1, 2 and 8 (lab, H200)

// Registers capped so that 8 backward (64 registers, none spilled) and 10 forward blocks fit an
// SM: more tiles' loads in flight (the full Llama step's SwiGLU casts 288 -> 245 ms with the
// sigmoid above; performance-notes entry 62).
template <DType kFormat, bool kBackward>
__global__ void TS_LAUNCH_BOUNDS(kCastThreads, kBackward ? 8 : 10)
    swiglu_cast_tiles_kernel(const bf16* __restrict__ gate_up, const bf16* __restrict__ dout,
                             int64_t N, int64_t F, const float* __restrict__ scale_ptr,
                             uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                             unsigned* __restrict__ amax_bits) {
  constexpr int kHalves = kBackward ? 2 : 1;  // of the result's columns: (d gate, d up) or h
  // Rows of 68 bytes, as the cast kernel's: the transposed reads fall in distinct banks.
  __shared__ __align__(16) uint8_t tile[kHalves][kCastRows][kCastCols + 4];
  __shared__ unsigned warp_amax[kCastThreads / 32];
  const unsigned seen = amax_seen(amax_bits);
  const float scale = *scale_ptr;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kCastRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kCastCols;
  const int t = threadIdx.x;
  const int tc = (t % (kCastCols / kCastPack)) * kCastPack;
  const int64_t c = c0 + tc;
  unsigned m = 0;
#pragma unroll
  for (int p0 = 0; p0 < kCastPasses; p0 += kCastInFlight) {
    uint4 g[kCastInFlight], u[kCastInFlight], d[kCastInFlight];
#pragma unroll
    for (int i = 0; i < kCastInFlight; ++i) {
      const int64_t r = r0 + t / (kCastCols / kCastPack) + (p0 + i) * kCastRowsPerPass;
      g[i] = *reinterpret_cast<const uint4*>(gate_up + r * 2 * F + c);
      u[i] = *reinterpret_cast<const uint4*>(gate_up + r * 2 * F + F + c);
      if constexpr (kBackward) d[i] = *reinterpret_cast<const uint4*>(dout + r * F + c);
    }
#pragma unroll
    for (int i = 0; i < kCastInFlight; ++i) {
      const int tr = t / (kCastCols / kCastPack) + (p0 + i) * kCastRowsPerPass;
      const int64_t r = r0 + tr;
      const bf16* gv = reinterpret_cast<const bf16*>(&g[i]);
      const bf16* uv = reinterpret_cast<const bf16*>(&u[i]);
      const bf16* dv = reinterpret_cast<const bf16*>(&d[i]);
      uint32_t w[kHalves][2] = {};
#pragma unroll
      for (int k = 0; k < kCastPack; k += 2) {
        float v[kHalves][2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if constexpr (kBackward) {
            swiglu_grad(to_float(gv[k + e]), to_float(uv[k + e]), to_float(dv[k + e]), v[0][e],
                        v[1][e]);
          } else {
            v[0][e] = swiglu_value(to_float(gv[k + e]), to_float(uv[k + e]));
          }
          // The values the plain kernels store, as the cast reads them back.
#pragma unroll
          for (int h = 0; h < kHalves; ++h) {
            v[h][e] = to_float(from_float<bf16>(v[h][e]));
            m = max(m, __float_as_uint(fabsf(v[h][e])));
          }
        }
        const int shift = 16 * (k / 2 % 2);
#pragma unroll
        for (int h = 0; h < kHalves; ++h)
          w[h][k / 4] |=
              static_cast<uint32_t>(fp8x2_encode<kFormat>(v[h][0] * scale, v[h][1] * scale))
              << shift;
      }
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        if (out != nullptr)
          *reinterpret_cast<uint2*>(out + r * kHalves * F + h * F + c) =
              make_uint2(w[h][0], w[h][1]);
        *reinterpret_cast<uint32_t*>(&tile[h][tr][tc]) = w[h][0];
        *reinterpret_cast<uint32_t*>(&tile[h][tr][tc + 4]) = w[h][1];
      }
    }
  }
  if (amax_bits != nullptr) {
    m = warp_reduce_max(m);
    if (t % 32 == 0) warp_amax[t / 32] = m;
  }
  __syncthreads();
  if (amax_bits != nullptr && t == 0) block_amax_to<kCastThreads>(amax_bits, warp_amax, seen);
#pragma unroll
  for (int half = 0; half < kHalves; ++half)
    store_tile_transposed<kCastThreads, kCastCols>(tile[half], t, out_t, half * F + c0, N, r0);
}

// Whether swiglu_cast_tiles_kernel takes these shapes and pointers.
bool cast_tiles_fit(int64_t N, int64_t F, DType dtype,
                    std::initializer_list<const void*> pointers) {
  if (dtype != DType::BF16 || N % kCastRows != 0 || F % kCastCols != 0) return false;
  for (const void* p : pointers)
    if (!is_aligned(p, 16)) return false;
  return true;
}

// swiglu_cast_tiles_kernel over (N, F) in `format`.
template <bool kBackward>
void launch_cast_tiles(const void* gate_up, const void* dout, int64_t N, int64_t F, void* codes,
                       void* codes_t, DType format, const float* scale, float* amax,
                       cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(F / kCastCols), static_cast<unsigned>(N / kCastRows));
  const auto launch = [&](auto kernel) {
    kernel<<<grid, kCastThreads, 0, stream>>>(
        static_cast<const bf16*>(gate_up), static_cast<const bf16*>(dout), N, F, scale,
        static_cast<uint8_t*>(codes), static_cast<uint8_t*>(codes_t),
        reinterpret_cast<unsigned*>(amax));
  };
  if (format == DType::E4M3) {
    launch(swiglu_cast_tiles_kernel<DType::E4M3, kBackward>);
  } else {
    launch(swiglu_cast_tiles_kernel<DType::E5M2, kBackward>);
  }
  TS_CUDA_CHECK_LAUNCH("swiglu_cast_tiles_kernel");
}

// Calls launch(T{}, VEC) with 16-byte packs when F and every pointer allow them.
template <class Launch>
void launch_packed(const char* name, int64_t F, DType dtype,
                   std::initializer_list<const void*> pointers, Launch&& launch) {
  dispatch_float(dtype, name, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = kVec16<T>;
    bool vec = F % kVec == 0;
    for (const void* p : pointers) vec = vec && is_aligned(p, 16);
    if (vec) {
      launch(T{}, std::integral_constant<int, kVec>{});
    } else {
      launch(T{}, std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace

void swiglu_forward(void* out, const void* gate_up, int64_t N, int64_t F, DType dtype,
                    cudaStream_t stream) {
  NvtxRange range("swiglu_forward");
  if (N == 0 || F == 0) return;
  launch_packed("swiglu_forward", F, dtype, {out, gate_up}, [&](auto tag, auto vec_tag) {
    using T = decltype(tag);
    constexpr int VEC = decltype(vec_tag)::value;
    const int64_t blocks = ceil_div(N * (F / VEC), kThreads);
    check_grid("swiglu_forward", blocks);
    swiglu_forward_kernel<T, VEC><<<blocks, kThreads, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(gate_up), N, F);
  });
  TS_CUDA_CHECK_LAUNCH("swiglu_forward_kernel");
}

void swiglu_forward_cast(void* out, void* codes, void* codes_t, const void* gate_up, int64_t N,
                         int64_t F, DType dtype, DType format, const float* scale, float* amax,
                         cudaStream_t stream) {
  NvtxRange range("swiglu_forward_cast");
  TS_CHECK(format == DType::E4M3 || format == DType::E5M2, "swiglu_forward_cast: codes dtype {}",
           dtype_name(format));
  if (N == 0 || F == 0) return;
  if (codes_t != nullptr && out == nullptr &&
      cast_tiles_fit(N, F, dtype, {gate_up, codes, codes_t}))
    return launch_cast_tiles<false>(gate_up, nullptr, N, F, codes, codes_t, format, scale, amax,
                                    stream);
  launch_packed("swiglu_forward_cast", F, dtype, {out, gate_up, codes}, [&](auto tag, auto vec_tag) {
    using T = decltype(tag);
    constexpr int VEC = decltype(vec_tag)::value;
    const int64_t blocks = ceil_div(N * (F / VEC), kThreads);
    check_grid("swiglu_forward_cast", blocks);
    const auto launch = [&](auto kernel) {
      kernel<<<blocks, kThreads, 0, stream>>>(
          static_cast<T*>(out), static_cast<uint8_t*>(codes), static_cast<uint8_t*>(codes_t),
          static_cast<const T*>(gate_up), N, F, scale, reinterpret_cast<unsigned*>(amax));
    };
    if (format == DType::E4M3) {
      launch(swiglu_forward_cast_kernel<T, VEC, DType::E4M3>);
    } else {
      launch(swiglu_forward_cast_kernel<T, VEC, DType::E5M2>);
    }
  });
  TS_CUDA_CHECK_LAUNCH("swiglu_forward_cast_kernel");
}

void swiglu_backward(void* dgate_up, const void* dout, const void* gate_up, int64_t N, int64_t F,
                     DType dtype, cudaStream_t stream) {
  NvtxRange range("swiglu_backward");
  if (N == 0 || F == 0) return;
  launch_packed("swiglu_backward", F, dtype, {dgate_up, dout, gate_up},
                [&](auto tag, auto vec_tag) {
                  using T = decltype(tag);
                  constexpr int VEC = decltype(vec_tag)::value;
                  const int64_t blocks = ceil_div(N * (F / VEC), kThreads);
                  check_grid("swiglu_backward", blocks);
                  swiglu_backward_kernel<T, VEC><<<blocks, kThreads, 0, stream>>>(
                      static_cast<T*>(dgate_up), static_cast<const T*>(dout),
                      static_cast<const T*>(gate_up), N, F);
                });
  TS_CUDA_CHECK_LAUNCH("swiglu_backward_kernel");
}

bool swiglu_backward_cast(const void* dout, const void* gate_up, int64_t N, int64_t F, DType dtype,
                          void* codes, void* codes_t, DType format, const float* scale, float* amax,
                          cudaStream_t stream) {
  NvtxRange range("swiglu_backward_cast");
  TS_CHECK(format == DType::E4M3 || format == DType::E5M2, "swiglu_backward_cast: codes dtype {}",
           dtype_name(format));
  if (!cast_tiles_fit(N, F, dtype, {dout, gate_up, codes, codes_t})) return false;
  if (N == 0 || F == 0) return true;
  launch_cast_tiles<true>(gate_up, dout, N, F, codes, codes_t, format, scale, amax, stream);
  return true;
}

}  // namespace tessera::cuda
