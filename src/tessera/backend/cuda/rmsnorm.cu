#include "tessera/backend/cuda/rmsnorm.cuh"

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/backend/cuda/reduce.cuh"
#include "tessera/core/error.h"

namespace tessera::cuda {
namespace {

// One block of 256 threads per row: at C = 4096 bf16 that is 2 packs of 8 per thread and
// 8 resident blocks (rows) per SM. Rows wider than the one-pass kernel takes are read twice,
// the second time from L1 (8 KiB per row at C = 4096, 64 KiB per SM), so DRAM sees x once.
constexpr int kThreads = 256;
// Rows of up to 4,096 bf16 channels (2 packs a thread) take the one-pass forward.
constexpr int kRowPacks = 2;

// The pack as the compiler must treat it: new bits, so that floats converted from it before
// this point are not kept alive to stand for the ones converted after (a bf16 row then stays
// 4 registers a pack across the reduction, not 8).
template <class T, int VEC>
__device__ __forceinline__ void reload_opaque(Pack<T, VEC>& pack) {
  static_assert(sizeof(pack) == 16);
  auto* words = reinterpret_cast<uint32_t*>(pack.v);
#pragma unroll
  for (int i = 0; i < 4; ++i) opaque_bits(words[i]);
}

// One pack of a row's output, v = x * rstd * w in fp32: stored (unless out is null, with
// kCodes) and, with kCodes, converted to codes (in kFormat, scaled by `scale`) of the values
// stored (their rounding to T, as the FP8 cast reads them back), their |.| max-ed into m, or
// for bf16 pairs into m2 (two bf16 maxes, one a half).
template <class T, int VEC, bool kCodes, DType kFormat>
__device__ __forceinline__ void store_normed(const float (&v)[VEC], T* out, uint8_t* codes,
                                             int64_t at, float scale, unsigned& m, unsigned& m2) {
  if (!kCodes || out != nullptr) store_floats<T, VEC>(out + at, v);
  if constexpr (kCodes && std::is_same_v<T, bf16> && VEC % 4 == 0) {
    // Pairs: one rounding to bf16, one |.| and max of both halves (bf16 bit patterns order as
    // their floats do), one conversion to two codes.
    uint32_t words[VEC / 4] = {};
#pragma unroll
    for (int k = 0; k < VEC; k += 2) {
      const bf16x2 pair = floats_to_bf16x2(v[k], v[k + 1]);
      const uint32_t bits = *reinterpret_cast<const uint32_t*>(&pair);
      m2 = max_u16x2(m2, bits & 0x7fff7fffu);
      const float lo = __uint_as_float(bits << 16), hi = __uint_as_float(bits & 0xffff0000u);
      words[k / 4] |= static_cast<uint32_t>(fp8x2_encode<kFormat>(lo * scale, hi * scale))
                      << (16 * (k / 2 % 2));
    }
    if constexpr (VEC == 8) {
      *reinterpret_cast<uint2*>(codes + at) = make_uint2(words[0], words[1]);
    } else {
      *reinterpret_cast<uint32_t*>(codes + at) = words[0];
    }
  } else if constexpr (kCodes) {
    alignas(8) uint8_t q[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float stored = to_float(from_float<T>(v[k]));
      m = max(m, __float_as_uint(fabsf(stored)));
      q[k] = fp8_encode<kFormat>(stored * scale);
    }
    store_codes(codes + at, q);
  }
}

// The block's max of its threads' m and m2 (store_normed's) into *amax_bits, when non-null.
__device__ __forceinline__ void fold_block_amax(unsigned m, unsigned m2, unsigned* amax_bits,
                                                unsigned seen) {
  __shared__ unsigned warp_amax[kThreads / 32];
  if (amax_bits == nullptr) return;
  m = warp_reduce_max(max(m, max(m2 << 16, m2 & 0xffff0000u)));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) block_amax_to<kThreads>(amax_bits, warp_amax, seen);
}

// With kCodes also the codes of the values stored and their amax, max-ed into *amax_bits (when
// non-null) one atomic a block, as the cast kernel does: an FP8 linear's forward cast folded
// into its input's producer (rmsnorm_forward_cast). out may then be null: not stored.
template <class T, int VEC, bool kCodes = false, DType kFormat = DType::E4M3>
__global__ void rmsnorm_forward_kernel(T* out, float* rstd, const T* x, const T* weight, int64_t C,
                                       float eps, uint8_t* codes = nullptr,
                                       const float* scale_ptr = nullptr,
                                       unsigned* amax_bits = nullptr) {
  __shared__ float shared[32];
  const unsigned seen = kCodes ? amax_seen(amax_bits) : 0u;
  // Read before the reduction, off the row's path from its reduction to its codes.
  const float scale = kCodes ? *scale_ptr : 1.0f;
  const int64_t row = blockIdx.x;
  const T* xr = x + row * C;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x * VEC; c < C; c += kThreads * VEC) {
    float v[VEC];
    load_floats<T, VEC>(xr + c, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) ss += v[k] * v[k];
  }
  ss = block_sum(ss, shared);
  const float r = rsqrtf(ss / static_cast<float>(C) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  unsigned m = 0, m2 = 0;
  for (int64_t c = threadIdx.x * VEC; c < C; c += kThreads * VEC) {
    float v[VEC], w[VEC];
    load_floats<T, VEC>(xr + c, v);
    load_floats<T, VEC>(weight + c, w);
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = v[k] * r * w[k];
    store_normed<T, VEC, kCodes, kFormat>(v, out, codes, row * C + c, scale, m, m2);
  }
  if constexpr (kCodes) fold_block_amax(m, m2, amax_bits, seen);
}

// rmsnorm_forward_kernel for rows of at most kPacks packs a thread, in one pass: a thread's
// packs of x are all loaded before the sum of squares and held as loaded through the block's
// reduction. The first kernel's loop over a runtime row length issues one pack's load at a
// time and reads the row again after the reduction; here a row costs one DRAM latency and no
// second read. The weight, which every row reads (so L1 or L2 holds it), is loaded after the
// reduction: held too it would cost 8 registers, and 8 blocks an SM fit 32 (31 used). The same
// sums in the same order: the same bits.
template <class T, int VEC, int kPacks, bool kCodes = false, DType kFormat = DType::E4M3>
__global__ void rmsnorm_forward_row_kernel(T* out, float* rstd, const T* x, const T* weight,
                                           int64_t C, float eps, uint8_t* codes = nullptr,
                                           const float* scale_ptr = nullptr,
                                           unsigned* amax_bits = nullptr) {
  __shared__ float shared[32];
  const unsigned seen = kCodes ? amax_seen(amax_bits) : 0u;
  const float scale = kCodes ? *scale_ptr : 1.0f;
  const int64_t row = blockIdx.x;
  const int packs = static_cast<int>(C / VEC);
  Pack<T, VEC> xv[kPacks];
#pragma unroll
  for (int i = 0; i < kPacks; ++i) {
    const int p = threadIdx.x + i * kThreads;
    if (p < packs) xv[i] = load_pack<T, VEC>(x + row * C + p * VEC);
  }
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kPacks; ++i) {
    if (threadIdx.x + i * kThreads >= packs) continue;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float v = to_float(xv[i].v[k]);
      ss += v * v;
    }
  }
  ss = block_sum(ss, shared);
  const float r = rsqrtf(ss / static_cast<float>(C) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  unsigned m = 0, m2 = 0;
#pragma unroll
  for (int i = 0; i < kPacks; ++i) {
    const int p = threadIdx.x + i * kThreads;
    if (p >= packs) continue;
    reload_opaque(xv[i]);
    const Pack<T, VEC> w = load_pack<T, VEC>(weight + p * VEC);
    float v[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = to_float(xv[i].v[k]) * r * to_float(w.v[k]);
    store_normed<T, VEC, kCodes, kFormat>(v, out, codes, row * C + p * VEC, scale, m, m2);
  }
  if constexpr (kCodes) fold_block_amax(m, m2, amax_bits, seen);
}

// rmsnorm_transposed_codes: the codes of the forward's stored output (x * rstd * w in fp32 as
// rmsnorm_forward_kernel computes it, rounded to bf16) transposed, from x and the forward's
// rstd, never storing the output. The transposing cast's tile (fp8_cast_transpose_kernel): a
// block of 128 threads takes 128 rows of 64 columns, a thread 8 columns of rows 16 apart, its
// 8 rows' loads issued before any use; codes go through shared memory, as 32-bit words, to
// runs of 16 rows of the transposed output. bf16 with N % 128, C % 64 and 16-byte pointers.
constexpr int kTileRows = 128, kTileCols = 64, kTileThreads = 128, kTilePack = 8;
constexpr int kTileRowsPerPass = kTileThreads / (kTileCols / kTilePack);  // 16
constexpr int kTilePasses = kTileRows / kTileRowsPerPass;                 // 8

template <DType kFormat>
__global__ void __launch_bounds__(kTileThreads)
    rmsnorm_codes_t_kernel(const bf16* __restrict__ x, const float* __restrict__ rstd,
                           const bf16* __restrict__ weight, int64_t N, int64_t C,
                           const float* __restrict__ scale_ptr, uint8_t* __restrict__ out_t) {
  __shared__ __align__(16) uint8_t tile[kTileRows][kTileCols + 4];
  const float scale = *scale_ptr;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int t = threadIdx.x;
  const int tc = (t % (kTileCols / kTilePack)) * kTilePack;
  float w[kTilePack];
  load_floats<bf16, kTilePack>(weight + c0 + tc, w);
  uint4 v[kTilePasses];
  float r[kTilePasses];
#pragma unroll
  for (int p = 0; p < kTilePasses; ++p) {
    const int64_t row = r0 + t / (kTileCols / kTilePack) + p * kTileRowsPerPass;
    v[p] = *reinterpret_cast<const uint4*>(x + row * C + c0 + tc);
    r[p] = rstd[row];
  }
#pragma unroll
  for (int p = 0; p < kTilePasses; ++p) {
    const bf16* xv = reinterpret_cast<const bf16*>(&v[p]);
    uint32_t word[2] = {0, 0};
#pragma unroll
    for (int k = 0; k < kTilePack; k += 2) {
      // The forward's values as it stores them, as the cast reads them back (both rounded to
      // bf16 by one conversion).
      const bf16x2 pair =
          floats_to_bf16x2(to_float(xv[k]) * r[p] * w[k], to_float(xv[k + 1]) * r[p] * w[k + 1]);
      const uint32_t bits = *reinterpret_cast<const uint32_t*>(&pair);
      const float a = __uint_as_float(bits << 16), b = __uint_as_float(bits & 0xffff0000u);
      word[k / 4] |= static_cast<uint32_t>(fp8x2_encode<kFormat>(a * scale, b * scale))
                     << (16 * (k / 2 % 2));
    }
    const int tr = t / (kTileCols / kTilePack) + p * kTileRowsPerPass;
    *reinterpret_cast<uint32_t*>(&tile[tr][tc]) = word[0];
    *reinterpret_cast<uint32_t*>(&tile[tr][tc + 4]) = word[1];
  }
  __syncthreads();
  store_tile_transposed<kTileThreads, kTileCols>(tile, t, out_t, c0, N, r0);
}

// rmsnorm_codes_t_kernel for any shape and dtype: a thread an element, consecutive threads
// consecutive rows (the output's contiguous direction).
template <class T, DType kFormat>
__global__ void rmsnorm_codes_t_elements_kernel(const T* x, const float* rstd, const T* weight,
                                                int64_t N, int64_t C, const float* scale_ptr,
                                                uint8_t* out_t) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * C) return;
  const int64_t c = i / N, n = i % N;
  const float stored =
      to_float(from_float<T>(to_float(x[n * C + c]) * rstd[n] * to_float(weight[c])));
  out_t[i] = fp8_encode<kFormat>(stored * *scale_ptr);
}

// Each block takes kRowsPerBlock consecutive rows (a fixed number, so the partial sums and
// hence dweight's bits do not depend on the GPU). Per row: pass 1 reduces sum(g w x), pass 2
// re-reads g, x, w from L1 and updates dx. Each thread owns the same channels in every row,
// so its dweight terms accumulate in shared memory without atomics; the block then writes
// its partial row, and column_sums_accumulate adds the partials in block order.
// Shared memory holds channel c + k of pack c / VEC at k * (C / VEC) + c / VEC: for a fixed
// k the 32 lanes of a warp touch 32 consecutive words, free of bank conflicts.
constexpr int kRowsPerBlock = 16;

template <class T, int VEC>
__global__ void rmsnorm_backward_kernel(T* dx, float* partial, const T* dout, const T* x,
                                        const T* weight, const float* rstd, int64_t N, int64_t C) {
  extern __shared__ float dweight_acc[];  // (C)
  __shared__ float shared[32];
  const int64_t packs = C / VEC;
  for (int64_t c = threadIdx.x; c < C; c += kThreads) dweight_acc[c] = 0.0f;
  __syncthreads();  // zeroed with another thread-to-channel mapping than the one used below
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int64_t row1 = min(N, row0 + kRowsPerBlock);
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t row = row0; row < row1; ++row) {
    const T* g = dout + row * C;
    const T* xr = x + row * C;
    T* dxr = dx + row * C;
    const float r = rstd[row];
    float gwx = 0.0f;
    for (int64_t c = threadIdx.x * VEC; c < C; c += kThreads * VEC) {
      float gv[VEC], xv[VEC], wv[VEC];
      load_floats<T, VEC>(g + c, gv);
      load_floats<T, VEC>(xr + c, xv);
      load_floats<T, VEC>(weight + c, wv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) gwx += gv[k] * wv[k] * xv[k];
    }
    gwx = block_sum(gwx, shared);
    const float coef = r * r * gwx * inv_c;
    for (int64_t c = threadIdx.x * VEC; c < C; c += kThreads * VEC) {
      float gv[VEC], xv[VEC], wv[VEC], dv[VEC];
      load_floats<T, VEC>(g + c, gv);
      load_floats<T, VEC>(xr + c, xv);
      load_floats<T, VEC>(weight + c, wv);
      load_floats<T, VEC>(dxr + c, dv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        dv[k] += r * (wv[k] * gv[k] - xv[k] * coef);
        dweight_acc[k * packs + c / VEC] += gv[k] * xv[k] * r;
      }
      store_floats<T, VEC>(dxr + c, dv);
    }
  }
  __syncthreads();
  float* out = partial + static_cast<int64_t>(blockIdx.x) * C;
  for (int64_t c = threadIdx.x; c < C; c += kThreads)
    out[c] = dweight_acc[(c % VEC) * packs + c / VEC];
}

// rmsnorm_backward_kernel with a thread's packs of a row (at most kPacks: C <= kPacks * kThreads
// * VEC) held in registers as they were loaded: g, x and the incoming dx of a row are all
// issued before its reduction, so a row costs one DRAM latency, not two (the first kernel
// loads dx only after the reduction), at 4 blocks of 16 rows an SM. The same sums in the same
// order as rmsnorm_backward_kernel: the same bits.
template <class T, int VEC, int kPacks>
__global__ void TS_LAUNCH_BOUNDS(kThreads, 4)
    rmsnorm_backward_rows_kernel(T* dx, float* partial, const T* dout, const T* x, const T* weight,
                                 const float* rstd, int64_t N, int64_t C) {
  extern __shared__ float dweight_acc[];  // (C)
  __shared__ float shared[32];
  const int64_t packs = C / VEC;
  for (int64_t c = threadIdx.x; c < C; c += kThreads) dweight_acc[c] = 0.0f;
  Pack<T, VEC> w[kPacks];
#pragma unroll
  for (int i = 0; i < kPacks; ++i) {
    const int64_t p = threadIdx.x + i * kThreads;
    if (p < packs) w[i] = load_pack<T, VEC>(weight + p * VEC);
  }
  __syncthreads();  // zeroed with another thread-to-channel mapping than the one used below
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int64_t row1 = min(N, row0 + kRowsPerBlock);
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t row = row0; row < row1; ++row) {
    Pack<T, VEC> g[kPacks], xv[kPacks], d[kPacks];
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int64_t p = threadIdx.x + i * kThreads;
      if (p < packs) {
        g[i] = load_pack<T, VEC>(dout + row * C + p * VEC);
        xv[i] = load_pack<T, VEC>(x + row * C + p * VEC);
        d[i] = load_pack<T, VEC>(dx + row * C + p * VEC);
      }
    }
    const float r = rstd[row];
    float gwx = 0.0f;
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      if (threadIdx.x + i * kThreads < packs) {
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          gwx += to_float(g[i].v[k]) * to_float(w[i].v[k]) * to_float(xv[i].v[k]);
      }
    }
    gwx = block_sum(gwx, shared);
    const float coef = r * r * gwx * inv_c;
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int64_t p = threadIdx.x + i * kThreads;
      if (p >= packs) continue;
      reload_opaque(g[i]);
      reload_opaque(xv[i]);
      reload_opaque(w[i]);
      float dv[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float gk = to_float(g[i].v[k]), xk = to_float(xv[i].v[k]);
        dv[k] = to_float(d[i].v[k]) + r * (to_float(w[i].v[k]) * gk - xk * coef);
        dweight_acc[k * packs + p] += gk * xk * r;
      }
      store_floats<T, VEC>(dx + row * C + p * VEC, dv);
    }
  }
  __syncthreads();
  float* out = partial + static_cast<int64_t>(blockIdx.x) * C;
  for (int64_t c = threadIdx.x; c < C; c += kThreads)
    out[c] = dweight_acc[(c % VEC) * packs + c / VEC];
}

template <class T>
bool packed(int64_t C, std::initializer_list<const void*> pointers) {
  if (C % kVec16<T> != 0) return false;
  for (const void* p : pointers)
    if (!is_aligned(p, 16)) return false;
  return true;
}

}  // namespace

void rmsnorm_forward(void* out, float* rstd, const void* x, const void* weight, int64_t N,
                     int64_t C, float eps, DType dtype, cudaStream_t stream) {
  NvtxRange range("rmsnorm_forward");
  if (N == 0) return;
  check_grid("rmsnorm_forward", N);
  dispatch_float(dtype, "rmsnorm_forward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = kVec16<T>;
    auto* o = static_cast<T*>(out);
    auto* xs = static_cast<const T*>(x);
    auto* w = static_cast<const T*>(weight);
    if (packed<T>(C, {out, x, weight}) && C <= kRowPacks * kThreads * kVec) {
      rmsnorm_forward_row_kernel<T, kVec, kRowPacks>
          <<<N, kThreads, 0, stream>>>(o, rstd, xs, w, C, eps);
    } else if (packed<T>(C, {out, x, weight})) {
      rmsnorm_forward_kernel<T, kVec><<<N, kThreads, 0, stream>>>(o, rstd, xs, w, C, eps);
    } else {
      rmsnorm_forward_kernel<T, 1><<<N, kThreads, 0, stream>>>(o, rstd, xs, w, C, eps);
    }
    TS_CUDA_CHECK_LAUNCH("rmsnorm_forward_kernel");
  });
}

void rmsnorm_forward_cast(void* out, float* rstd, void* codes, const void* x, const void* weight,
                          int64_t N, int64_t C, float eps, DType dtype, DType format,
                          const float* scale, float* amax, cudaStream_t stream) {
  NvtxRange range("rmsnorm_forward_cast");
  if (N == 0) return;
  TS_CHECK(format == DType::E4M3 || format == DType::E5M2, "rmsnorm_forward_cast: codes dtype {}",
           dtype_name(format));
  check_grid("rmsnorm_forward_cast", N);
  dispatch_float(dtype, "rmsnorm_forward_cast", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = kVec16<T>;
    auto* o = static_cast<T*>(out);
    auto* q = static_cast<uint8_t*>(codes);
    auto* xs = static_cast<const T*>(x);
    auto* w = static_cast<const T*>(weight);
    auto* amax_bits = reinterpret_cast<unsigned*>(amax);
    const auto launch = [&](auto kernel) {
      kernel<<<N, kThreads, 0, stream>>>(o, rstd, xs, w, C, eps, q, scale, amax_bits);
    };
    const bool vec = packed<T>(C, {out, x, weight, codes});
    const bool row = vec && C <= kRowPacks * kThreads * kVec;
    const auto with_format = [&](auto f) {
      constexpr DType kFormat = decltype(f)::value;
      if (row) {
        launch(rmsnorm_forward_row_kernel<T, kVec, kRowPacks, true, kFormat>);
      } else if (vec) {
        launch(rmsnorm_forward_kernel<T, kVec, true, kFormat>);
      } else {
        launch(rmsnorm_forward_kernel<T, 1, true, kFormat>);
      }
    };
    if (format == DType::E4M3) {
      with_format(std::integral_constant<DType, DType::E4M3>{});
    } else {
      with_format(std::integral_constant<DType, DType::E5M2>{});
    }
    TS_CUDA_CHECK_LAUNCH("rmsnorm_forward_kernel");
  });
}

void rmsnorm_transposed_codes(void* codes_t, const void* x, const float* rstd, const void* weight,
                              int64_t N, int64_t C, DType dtype, DType format, const float* scale,
                              cudaStream_t stream) {
  NvtxRange range("rmsnorm_transposed_codes");
  TS_CHECK(format == DType::E4M3 || format == DType::E5M2,
           "rmsnorm_transposed_codes: codes dtype {}", dtype_name(format));
  if (N == 0 || C == 0) return;
  const bool tiles = dtype == DType::BF16 && N % kTileRows == 0 && C % kTileCols == 0 &&
                     is_aligned(x, 16) && is_aligned(weight, 16) && is_aligned(codes_t, 16);
  auto* out_t = static_cast<uint8_t*>(codes_t);
  const auto with_format = [&](auto launch) {
    if (format == DType::E4M3) {
      launch(std::integral_constant<DType, DType::E4M3>{});
    } else {
      launch(std::integral_constant<DType, DType::E5M2>{});
    }
  };
  if (tiles) {
    const dim3 grid(static_cast<unsigned>(C / kTileCols), static_cast<unsigned>(N / kTileRows));
    with_format([&](auto f) {
      rmsnorm_codes_t_kernel<decltype(f)::value><<<grid, kTileThreads, 0, stream>>>(
          static_cast<const bf16*>(x), rstd, static_cast<const bf16*>(weight), N, C, scale, out_t);
    });
    TS_CUDA_CHECK_LAUNCH("rmsnorm_codes_t_kernel");
    return;
  }
  const int64_t blocks = ceil_div(N * C, kThreads);
  check_grid("rmsnorm_transposed_codes", blocks);
  dispatch_float(dtype, "rmsnorm_transposed_codes", [&](auto tag) {
    using T = decltype(tag);
    with_format([&](auto f) {
      rmsnorm_codes_t_elements_kernel<T, decltype(f)::value><<<blocks, kThreads, 0, stream>>>(
          static_cast<const T*>(x), rstd, static_cast<const T*>(weight), N, C, scale, out_t);
    });
  });
  TS_CUDA_CHECK_LAUNCH("rmsnorm_codes_t_elements_kernel");
}

size_t rmsnorm_backward_scratch_bytes(int64_t N, int64_t C) {
  return static_cast<size_t>(ceil_div(N, kRowsPerBlock)) * static_cast<size_t>(C) * sizeof(float);
}

void rmsnorm_backward(void* dx, void* dweight, DType dweight_dtype, const void* dout, const void* x,
                      const void* weight, const float* rstd, int64_t N, int64_t C, DType dtype,
                      void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  NvtxRange range("rmsnorm_backward");
  if (N == 0 || C == 0) return;
  const int64_t blocks = ceil_div(N, kRowsPerBlock);
  if (scratch_bytes < rmsnorm_backward_scratch_bytes(N, C)) {
    throw_cuda_error(cudaErrorInvalidValue, "rmsnorm_backward: scratch too small", __FILE__,
                     __LINE__);
  }
  auto* partial = static_cast<float*>(scratch);
  const size_t smem = static_cast<size_t>(C) * sizeof(float);
  dispatch_float(dtype, "rmsnorm_backward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = kVec16<T>;
    auto launch = [&](auto kernel) {
      // Rows wider than 12K channels need more than the default 48 KiB of shared memory.
      if (smem > 48 * 1024) {
        TS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
      }
      kernel<<<blocks, kThreads, smem, stream>>>(
          static_cast<T*>(dx), partial, static_cast<const T*>(dout), static_cast<const T*>(x),
          static_cast<const T*>(weight), rstd, N, C);
    };
    if (packed<T>(C, {dx, dout, x, weight}) && C <= 2 * kThreads * kVec) {
      launch(rmsnorm_backward_rows_kernel<T, kVec, 2>);
    } else if (packed<T>(C, {dx, dout, x, weight})) {
      launch(rmsnorm_backward_kernel<T, kVec>);
    } else {
      launch(rmsnorm_backward_kernel<T, 1>);
    }
    TS_CUDA_CHECK_LAUNCH("rmsnorm_backward_kernel");
  });
  column_sums_accumulate(dweight, dweight_dtype, partial, blocks, C, stream);
}

}  // namespace tessera::cuda
