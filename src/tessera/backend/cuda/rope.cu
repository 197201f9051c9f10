#include "tessera/backend/cuda/rope.cuh"

#include <algorithm>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/core/error.h"

namespace tessera::cuda {
namespace {

// One block per token: its threads cover (rotated head, pack of VEC pairs); at H + KV = 40,
// D = 128 that is 40 x 8 = 320 threads, each doing two 16-byte loads and stores of the head
// and two pairs of fp32 loads of the (L2-resident) cos/sin row.
// The rotation of one pair by the angle whose cosine is c and (signed) sine is `sine`, with its
// roundings pinned (no contraction the compiler may choose differently per kernel), so that
// rope_backward_cast's codes are of exactly the values rope_backward stores.
__device__ __forceinline__ void rotate_pair(float x1, float x2, float c, float sine, float& a,
                                            float& b) {
  a = __fmaf_rn(x1, c, -__fmul_rn(x2, sine));
  b = __fmaf_rn(x2, c, __fmul_rn(x1, sine));
}

template <class T, int VEC>
__global__ void rope_kernel(T* qkv, const float* freqs, int64_t seq, int64_t rotated_heads,
                            int64_t width, int64_t head_dim, float sign) {
  const int64_t row = blockIdx.x;
  const int64_t half = head_dim / 2, packs = half / VEC;
  const float* cos_t = freqs + (row % seq) * head_dim;
  const float* sin_t = cos_t + half;
  T* token = qkv + row * width;
  for (int64_t p = threadIdx.x; p < rotated_heads * packs; p += blockDim.x) {
    const int64_t head = p / packs, i = (p % packs) * VEC;
    T* x = token + head * head_dim + i;
    float x1[VEC], x2[VEC], c[VEC], s[VEC];
    load_floats<T, VEC>(x, x1);
    load_floats<T, VEC>(x + half, x2);
    load_floats<float, VEC>(cos_t + i, c);
    load_floats<float, VEC>(sin_t + i, s);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      rotate_pair(x1[k], x2[k], c[k], sign * s[k], x1[k], x2[k]);
    }
    store_floats<T, VEC>(x, x1);
    store_floats<T, VEC>(x + half, x2);
  }
}

void launch_rope(const char* name, void* qkv, const float* freqs, const RopeShape& s, DType dtype,
                 float sign, cudaStream_t stream) {
  NvtxRange range(name);
  const int64_t rows = s.batch * s.seq;
  if (rows == 0) return;
  check_grid(name, rows);
  const int64_t width = s.width;
  const int64_t rotated = s.heads + s.kv_heads;
  dispatch_float(dtype, name, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = kVec16<T>;
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const int64_t work = rotated * (s.head_dim / 2 / VEC);
      const int threads = static_cast<int>(std::min<int64_t>(1024, ceil_div(work, 32) * 32));
      rope_kernel<T, VEC><<<rows, threads, 0, stream>>>(static_cast<T*>(qkv), freqs, s.seq, rotated,
                                                        width, s.head_dim, sign);
    };
    if ((s.head_dim / 2) % kVec == 0 && is_aligned(qkv, 16) && is_aligned(freqs, 16)) {
      launch(std::integral_constant<int, kVec>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
    TS_CUDA_CHECK_LAUNCH("rope_kernel");
  });
}

// rope_backward writing dqkv's FP8 codes in both layouts instead of its rotated values (the QKV
// projection's output-gradient cast folded into its producer). A block of 128 threads takes 128
// rows of one head (128 columns): a thread 8 pairs (columns i and i + 64) of rows 16 apart,
// rotated when the head is a query or key head, their codes to the row-major output at once
// and through shared memory, as 32-bit words, to the transposed one in runs of 16 rows. One
// amax atomic a block. bf16, head_dim 128, N % 128 == 0, 16-byte aligned pointers.
constexpr int kTileRows = 128, kTileDim = 128, kTileThreads = 128, kTilePack = 8;
constexpr int kTileRowsPerPass = kTileThreads / (kTileDim / 2 / kTilePack);  // 16
constexpr int kTilePasses = kTileRows / kTileRowsPerPass;                    // 8
constexpr int kTileRun = 16;  // rows of a transposed run

template <DType kFormat>
__global__ void __launch_bounds__(kTileThreads)
    rope_backward_cast_kernel(const bf16* __restrict__ dqkv, const float* __restrict__ freqs,
                              int64_t N, int64_t seq, int64_t rotated_heads, int64_t width,
                              const float* __restrict__ scale_ptr, uint8_t* __restrict__ out,
                              uint8_t* __restrict__ out_t, unsigned* __restrict__ amax_bits) {
  __shared__ __align__(16) uint8_t tile[kTileRows][kTileDim + 4];
  __shared__ unsigned warp_amax[kTileThreads / 32];
  constexpr int kHalf = kTileDim / 2;
  const float scale = *scale_ptr;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int64_t head = blockIdx.x, c0 = head * kTileDim;
  const bool rotate = head < rotated_heads;
  const int t = threadIdx.x;
  const int pc = (t % (kHalf / kTilePack)) * kTilePack;
  unsigned m = 0;
#pragma unroll 2
  for (int p = 0; p < kTilePasses; ++p) {
    const int tr = t / (kHalf / kTilePack) + p * kTileRowsPerPass;
    const int64_t r = r0 + tr;
    float x1[kTilePack], x2[kTilePack];
    load_floats<bf16, kTilePack>(dqkv + r * width + c0 + pc, x1);
    load_floats<bf16, kTilePack>(dqkv + r * width + c0 + kHalf + pc, x2);
    if (rotate) {
      const float* cos_t = freqs + (r % seq) * kTileDim;
      float c[kTilePack], sn[kTilePack];
      load_floats<float, kTilePack>(cos_t + pc, c);
      load_floats<float, kTilePack>(cos_t + kHalf + pc, sn);
#pragma unroll
      for (int k = 0; k < kTilePack; ++k) {
        rotate_pair(x1[k], x2[k], c[k], -sn[k], x1[k], x2[k]);
        // The values rope_backward stores, as the cast reads them back.
        x1[k] = to_float(from_float<bf16>(x1[k]));
        x2[k] = to_float(from_float<bf16>(x2[k]));
      }
    }
    uint32_t w1[2] = {0, 0}, w2[2] = {0, 0};
#pragma unroll
    for (int k = 0; k < kTilePack; k += 2) {
      m = max(m, max(max(__float_as_uint(fabsf(x1[k])), __float_as_uint(fabsf(x1[k + 1]))),
                     max(__float_as_uint(fabsf(x2[k])), __float_as_uint(fabsf(x2[k + 1])))));
      const int shift = 16 * (k / 2 % 2);
      w1[k / 4] |= static_cast<uint32_t>(fp8x2_encode<kFormat>(x1[k] * scale, x1[k + 1] * scale))
                   << shift;
      w2[k / 4] |= static_cast<uint32_t>(fp8x2_encode<kFormat>(x2[k] * scale, x2[k + 1] * scale))
                   << shift;
    }
    *reinterpret_cast<uint2*>(out + r * width + c0 + pc) = make_uint2(w1[0], w1[1]);
    *reinterpret_cast<uint2*>(out + r * width + c0 + kHalf + pc) = make_uint2(w2[0], w2[1]);
    // 32-bit words: rows of 132 bytes keep only 4-byte alignment.
    *reinterpret_cast<uint32_t*>(&tile[tr][pc]) = w1[0];
    *reinterpret_cast<uint32_t*>(&tile[tr][pc + 4]) = w1[1];
    *reinterpret_cast<uint32_t*>(&tile[tr][kHalf + pc]) = w2[0];
    *reinterpret_cast<uint32_t*>(&tile[tr][kHalf + pc + 4]) = w2[1];
  }
  if (amax_bits != nullptr) {
    m = warp_reduce_max(m);
    if (t % 32 == 0) warp_amax[t / 32] = m;
  }
  __syncthreads();
  if (amax_bits != nullptr && t == 0) block_amax_to<kTileThreads>(amax_bits, warp_amax);
    // 32 groups of 4 columns x 8 runs of 16 rows: two (group, run) a thread.
#pragma unroll
  for (int job = t; job < (kTileDim / 4) * (kTileRows / kTileRun); job += kTileThreads) {
    const int cg = (job % (kTileDim / 4)) * 4, j0 = (job / (kTileDim / 4)) * kTileRun;
    uint32_t run[4][kTileRun / 4];
    tile_column_runs(tile, cg, j0, run);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      *reinterpret_cast<uint4*>(out_t + (c0 + cg + k) * N + r0 + j0) =
          make_uint4(run[k][0], run[k][1], run[k][2], run[k][3]);
  }
}

}  // namespace

bool rope_backward_cast(const void* dqkv, const float* freqs, const RopeShape& s, DType dtype,
                        void* codes, void* codes_t, DType format, const float* scale, float* amax,
                        cudaStream_t stream) {
  NvtxRange range("rope_backward_cast");
  TS_CHECK(format == DType::E4M3 || format == DType::E5M2, "rope_backward_cast: codes dtype {}",
           dtype_name(format));
  const int64_t N = s.batch * s.seq;
  if (dtype != DType::BF16 || s.head_dim != kTileDim || N % kTileRows != 0 ||
      s.width % kTileDim != 0)
    return false;
  for (const void* p : {dqkv, static_cast<const void*>(freqs), static_cast<const void*>(codes),
                        static_cast<const void*>(codes_t)})
    if (!is_aligned(p, 16)) return false;
  if (N == 0) return true;
  const dim3 grid(static_cast<unsigned>(s.width / kTileDim), static_cast<unsigned>(N / kTileRows));
  const auto launch = [&](auto kernel) {
    kernel<<<grid, kTileThreads, 0, stream>>>(
        static_cast<const bf16*>(dqkv), freqs, N, s.seq, s.heads + s.kv_heads, s.width, scale,
        static_cast<uint8_t*>(codes), static_cast<uint8_t*>(codes_t),
        reinterpret_cast<unsigned*>(amax));
  };
  if (format == DType::E4M3) {
    launch(rope_backward_cast_kernel<DType::E4M3>);
  } else {
    launch(rope_backward_cast_kernel<DType::E5M2>);
  }
  TS_CUDA_CHECK_LAUNCH("rope_backward_cast_kernel");
  return true;
}

void rope_forward(void* qkv, const float* freqs, const RopeShape& s, DType dtype,
                  cudaStream_t stream) {
  launch_rope("rope_forward", qkv, freqs, s, dtype, 1.0f, stream);
}

void rope_backward(void* dqkv, const float* freqs, const RopeShape& s, DType dtype,
                   cudaStream_t stream) {
  launch_rope("rope_backward", dqkv, freqs, s, dtype, -1.0f, stream);
}

}  // namespace tessera::cuda
