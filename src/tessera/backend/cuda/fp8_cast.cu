#include "tessera/backend/cuda/fp8_cast.cuh"

#include <cfloat>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/error.h"

namespace tessera::cuda {
namespace {

// A block of 128 threads casts a 128 x 64 tile. Loading, a thread takes 8 consecutive
// columns (one 16-byte load of bf16) of 8 rows 16 apart, all loads issued before any use,
// so that each thread keeps 128 bytes in flight: that, not arithmetic, sets the speed of a
// kernel that moves 4 bytes per element. Codes go into shared memory as 32-bit words; each
// thread then reads 4 x 4 blocks of codes as 4 words, transposes them in registers (byte
// permutes) and writes 16 consecutive codes to each of 4 output rows. One amax atomic per
// block: per-warp atomics on the single amax address serialised into the cast's dominant
// cost. Measured on H200 over one proxy step's casts: 3.7 TB/s, against 2.8 TB/s for 64 x 64
// tiles of 256 threads reading the transpose from shared memory a byte at a time.
constexpr int kTileRows = 128;
constexpr int kTileCols = 64;
constexpr int kCastThreads = 128;
constexpr int kPack = 8;  // columns per thread when loading
constexpr int kLoadRowsPerPass = kCastThreads / (kTileCols / kPack);  // 16
constexpr int kLoadPasses = kTileRows / kLoadRowsPerPass;             // 8
constexpr int kColGroups = kTileCols / 4;                             // 4 tile columns per thread
constexpr int kRunT = kTileRows / (kCastThreads / kColGroups);        // 16 codes per output row
static_assert(kRunT == 16, "a thread writes each of its transposed rows as one 16-byte store");

// Two codes widened to a word, so that shifting them into the upper half stays unsigned.
template <DType kFormat>
__device__ __forceinline__ uint32_t to_fp8x2(float a, float b) {
  return fp8x2_encode<kFormat>(a, b);
}

// A thread's kPack codes (two words) of row r from column c into out (R, C): one 8-byte store
// when vec_in, else code by code inside the matrix.
__device__ __forceinline__ void store_codes(uint8_t* out, int64_t r, int64_t C, int64_t c,
                                            const uint32_t (&words)[2], bool vec_in) {
  if (vec_in) {
    if (c < C) *reinterpret_cast<uint2*>(out + r * C + c) = make_uint2(words[0], words[1]);
    return;
  }
#pragma unroll
  for (int k = 0; k < kPack; ++k)
    if (c + k < C) out[r * C + c + k] = static_cast<uint8_t>(words[k / 4] >> (8 * (k % 4)));
}

// Thread threadIdx.x's share of a tile at (r0, c): rows r0 + threadIdx.x / 16 + 16 k below
// `rows`, its kPack columns from c (vectorised when vec_in); entries past rows or C stay unset.
template <class T, bool kAligned = false>
__device__ __forceinline__ void load_tile(T (&v)[kLoadPasses][kPack], const T* __restrict__ x,
                                          int64_t rows, int64_t C, int64_t r0, int64_t c,
                                          bool vec_in) {
  const int t = threadIdx.x;
#pragma unroll
  for (int pass = 0; pass < kLoadPasses; ++pass) {
    const int64_t r = r0 + t / (kTileCols / kPack) + pass * kLoadRowsPerPass;
    if (kAligned || vec_in) {
      if (kAligned || (r < rows && c < C)) {
#pragma unroll
        for (int k = 0; k < kPack; k += kVec16<T>)
          *reinterpret_cast<Pack<T, kVec16<T>>*>(&v[pass][k]) =
              load_pack<T, kVec16<T>>(x + r * C + c + k);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kPack; ++k)
        if (r < rows && c + k < C) v[pass][k] = x[r * C + c + k];
    }
  }
}

// One read of each element: its code goes to out (row-major) and, through the shared tile,
// to out_t. The amax is a max of |x| bit patterns: for non-negative floats unsigned order is
// float order, and any NaN sorts above Inf, so a NaN anywhere makes the amax NaN instead of
// being skipped as fmaxf would. Codes outside the matrix are 0 and never stored.
// vec_in: C % 8 == 0 and x (16 bytes), out (8 bytes) aligned, so a thread's 8 columns are
// all inside or all outside and move as single accesses; vec_t: likewise R % 16 == 0 and
// out_t 16-byte aligned for the transposed runs. Otherwise element by element.
// kAligned: whole tiles (R % 128, C % 64) with vec_in and vec_t, no bounds checks: 62 registers
// against 96, 8 blocks an SM against 5 (the full Llama step's transposing casts 127 -> 87 ms;
// performance-notes entry 62).
template <class T, DType kFormat, bool kAligned>
__global__ void TS_LAUNCH_BOUNDS(kCastThreads, kAligned && sizeof(T) == 2 ? 8 : 0)
    fp8_cast_transpose_kernel(const T* __restrict__ x, int64_t R, int64_t C,
                              const float* __restrict__ scale_ptr, uint8_t* __restrict__ out,
                              uint8_t* __restrict__ out_t, unsigned* __restrict__ amax_bits,
                              bool vec_in, bool vec_t) {
  // Rows of 68 bytes: a warp's transposed reads (16 consecutive words of two rows 16 apart)
  // fall in 32 distinct banks.
  __shared__ __align__(16) uint8_t tile[kTileRows][kTileCols + 4];
  __shared__ unsigned warp_amax[kCastThreads / 32];
  const bool cast = out != nullptr || out_t != nullptr;
  const unsigned seen = amax_seen(amax_bits);
  const float scale = cast ? *scale_ptr : 1.0f;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int t = threadIdx.x;
  const int tc = (t % (kTileCols / kPack)) * kPack;
  const int64_t c = c0 + tc;
  alignas(16) T v[kLoadPasses][kPack];
  load_tile<T, kAligned>(v, x, R, C, r0, c, vec_in);
  unsigned m = 0;
#pragma unroll
  for (int pass = 0; pass < kLoadPasses; ++pass) {
    const int tr = t / (kTileCols / kPack) + pass * kLoadRowsPerPass;
    const int64_t r = r0 + tr;
    uint32_t words[2] = {0, 0};
#pragma unroll
    for (int k = 0; k < kPack; k += 2) {
      const bool in0 = kAligned || (r < R && c + k < C);
      const bool in1 = kAligned || (r < R && c + k + 1 < C);
      const float a = in0 ? to_float(v[pass][k]) : 0.0f, b = in1 ? to_float(v[pass][k + 1]) : 0.0f;
      m = max(m, max(__float_as_uint(fabsf(a)), __float_as_uint(fabsf(b))));
      if (cast) words[k / 4] |= to_fp8x2<kFormat>(a * scale, b * scale) << (16 * (k / 2 % 2));
    }
    if (out != nullptr && (kAligned || r < R)) store_codes(out, r, C, c, words, kAligned || vec_in);
    if (out_t != nullptr) {
      *reinterpret_cast<uint32_t*>(&tile[tr][tc]) = words[0];
      *reinterpret_cast<uint32_t*>(&tile[tr][tc + 4]) = words[1];
    }
  }
  if (amax_bits != nullptr) {
    m = warp_reduce_max(m);
    if (t % 32 == 0) warp_amax[t / 32] = m;
  }
  if (amax_bits == nullptr && out_t == nullptr) return;
  __syncthreads();
  if (amax_bits != nullptr && t == 0) {
    block_amax_to<kCastThreads>(amax_bits, warp_amax, seen);
  }
  if (out_t == nullptr) return;
  // Thread t writes out_t rows c0 + cg .. c0 + cg + 4 (tile columns), columns r0 + j0 ..
  // r0 + j0 + 16 (tile rows).
  const int cg = (t % kColGroups) * 4, j0 = (t / kColGroups) * kRunT;
  uint32_t run[4][kRunT / 4];
  tile_column_runs(tile, cg, j0, run);
  const int64_t r = r0 + j0;
  if (!kAligned && r >= R) return;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t oc = c0 + cg + k;
    if (!kAligned && oc >= C) break;
    if (kAligned || vec_t) {
      *reinterpret_cast<uint4*>(out_t + oc * R + r) =
          make_uint4(run[k][0], run[k][1], run[k][2], run[k][3]);
    } else {
#pragma unroll
      for (int b = 0; b < kRunT; ++b)
        if (r + b < R) out_t[oc * R + r + b] = static_cast<uint8_t>(run[k][b / 4] >> (8 * (b % 4)));
    }
  }
}

// fp8_cast_transpose_kernel's tile, loads and transposes over row groups. Each tile first
// maps its rows to their groups (one row per thread, a binary search of the offsets): a tile
// may span several groups, and a group's scale and amax follow its rows. The transposed runs
// of 16 rows stay single 16-byte stores wherever a run lies in groups (with group_rows, in
// one) at an aligned address, which holds throughout when every group is a multiple of 16
// rows (the experts' activations and weights); other runs go byte by byte.
template <class T, DType kFormat>
__global__ void __launch_bounds__(kCastThreads)
    fp8_grouped_cast_kernel(const T* __restrict__ x, int64_t R, int64_t C, int64_t group_rows,
                            const int32_t* __restrict__ offsets, int64_t G,
                            const float* __restrict__ scale, bool per_group_scale,
                            uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                            unsigned* __restrict__ amax_bits, bool per_group_amax, bool vec_in,
                            bool aligned_t) {
  __shared__ __align__(16) uint8_t tile[kTileRows][kTileCols + 4];
  __shared__ int64_t row_group[kTileRows];  // -1: the row is in no group
  __shared__ int64_t group_begin[kTileRows], group_size[kTileRows];
  __shared__ float row_scale[kTileRows];
  // Per-group amaxes, at the tile row where the group's rows in this tile start.
  __shared__ unsigned group_amax[kTileRows];
  __shared__ unsigned warp_amax[kCastThreads / 32];
  const int t = threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int tc = (t % (kTileCols / kPack)) * kPack;
  const int64_t c = c0 + tc;
  // The tile's loads go first, so that they do not wait for the offsets (rows of x past the
  // groups are read, never used).
  alignas(16) T v[kLoadPasses][kPack];
  load_tile(v, x, R, C, r0, c, vec_in);
  const unsigned seen = per_group_amax ? 0u : amax_seen(amax_bits);
  // Clamped into [0, R]: whatever the offsets hold, no access leaves x.
  int64_t used = R;
  if (offsets != nullptr) used = offsets[G] < 0 ? 0 : offsets[G] < R ? offsets[G] : R;
  if (r0 >= used) return;  // the whole block: no barrier is left waiting
  const bool cast = out != nullptr || out_t != nullptr;
  static_assert(kCastThreads == kTileRows, "one thread maps each tile row to its group");
  {
    const int64_t r = r0 + t;
    int64_t g = -1, begin = 0, size = 0;
    if (r < used) {
      if (offsets == nullptr) {
        g = r / group_rows;
        begin = g * group_rows;
        size = group_rows;
      } else if (!per_group_scale && !per_group_amax) {
        // One scale and amax, and the transpose x's: only whether the row is in a group
        // matters, so the rows skip the search (a chain of dependent loads at every block's
        // start).
        g = 0;
      } else {  // the last g with offsets[g] <= r: offsets[g] <= r < offsets[g + 1]
        int64_t lo = 0, hi = G - 1;
        while (lo < hi) {
          const int64_t mid = (lo + hi + 1) / 2;
          if (offsets[mid] <= r) {
            lo = mid;
          } else {
            hi = mid - 1;
          }
        }
        g = lo;
        begin = offsets[g];
        size = offsets[g + 1] - begin;
      }
    }
    row_group[t] = g;
    group_begin[t] = begin;
    group_size[t] = size;
    row_scale[t] = cast && g >= 0 ? scale[per_group_scale ? g : 0] : 1.0f;
    group_amax[t] = 0;
  }
  __syncthreads();
  unsigned m = 0;
#pragma unroll
  for (int pass = 0; pass < kLoadPasses; ++pass) {
    const int tr = t / (kTileCols / kPack) + pass * kLoadRowsPerPass;
    const int64_t r = r0 + tr;
    const float s = row_scale[tr];
    uint32_t words[2] = {0, 0};
    unsigned row_m = 0;
#pragma unroll
    for (int k = 0; k < kPack; k += 2) {
      const bool in0 = r < used && c + k < C, in1 = r < used && c + k + 1 < C;
      const float a = in0 ? to_float(v[pass][k]) : 0.0f, b = in1 ? to_float(v[pass][k + 1]) : 0.0f;
      row_m = max(row_m, max(__float_as_uint(fabsf(a)), __float_as_uint(fabsf(b))));
      if (cast) words[k / 4] |= to_fp8x2<kFormat>(a * s, b * s) << (16 * (k / 2 % 2));
    }
    if (per_group_amax) {
      if (row_m != 0)
        atomicMax(&group_amax[group_begin[tr] > r0 ? group_begin[tr] - r0 : 0], row_m);
    } else {
      m = max(m, row_m);
    }
    if (out != nullptr && r < used) store_codes(out, r, C, c, words, vec_in);
    if (out_t != nullptr) {
      *reinterpret_cast<uint32_t*>(&tile[tr][tc]) = words[0];
      *reinterpret_cast<uint32_t*>(&tile[tr][tc + 4]) = words[1];
    }
  }
  if (amax_bits != nullptr && !per_group_amax) {
    m = warp_reduce_max(m);
    if (t % 32 == 0) warp_amax[t / 32] = m;
  }
  __syncthreads();
  if (amax_bits != nullptr) {
    if (per_group_amax) {
      if (group_amax[t] != 0) atomicMax(amax_bits + row_group[t], group_amax[t]);
    } else if (t == 0) {
      block_amax_to<kCastThreads>(amax_bits, warp_amax, seen);
    }
  }
  if (out_t == nullptr) return;
  // Thread t writes columns c0 + cg .. c0 + cg + 4 of x (rows of out_t), tile rows j0 .. j0 +
  // 16, as fp8_cast_transpose_kernel does. With offsets out_t is x's transpose (C, R); with
  // group_rows each group's block is transposed in place.
  const int cg = (t % kColGroups) * 4, j0 = (t / kColGroups) * kRunT;
  uint32_t run[4][kRunT / 4];
  tile_column_runs(tile, cg, j0, run);
  if (row_group[j0] < 0) return;  // rows past the groups come only after rows in them
  const int64_t r = r0 + j0;
  const bool whole_t = offsets != nullptr;
  // Whether the run is one 16-byte store: all its rows in groups (and with group_rows, one).
  const bool one_run =
      whole_t ? row_group[j0 + kRunT - 1] >= 0 : row_group[j0 + kRunT - 1] == row_group[j0];
  const int64_t begin = group_begin[j0], size = group_size[j0];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t oc = c0 + cg + k;
    if (oc >= C) break;
    const int64_t at = whole_t ? oc * R + r : begin * C + oc * size + (r - begin);
    if (one_run && aligned_t && at % 16 == 0) {
      *reinterpret_cast<uint4*>(out_t + at) =
          make_uint4(run[k][0], run[k][1], run[k][2], run[k][3]);
    } else {
#pragma unroll
      for (int b = 0; b < kRunT; ++b) {
        if (row_group[j0 + b] < 0) break;
        const int64_t gb = group_begin[j0 + b];
        out_t[whole_t ? oc * R + r + b : gb * C + oc * group_size[j0 + b] + (r + b - gb)] =
            static_cast<uint8_t>(run[k][b / 4] >> (8 * (b % 4)));
      }
    }
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
  const int64_t grid_y = ceil_div(R, kTileRows);
  TS_CHECK(grid_y <= 65535, "fp8_cast_transpose: {} rows exceed the grid ({} max)", R,
           int64_t{65535} * kTileRows);
  const dim3 grid(static_cast<unsigned>(ceil_div(C, kTileCols)), static_cast<unsigned>(grid_y));
  auto* o = static_cast<uint8_t*>(out);
  auto* ot = static_cast<uint8_t*>(out_t);
  auto* a = reinterpret_cast<unsigned*>(amax);
  const bool vec_in = C % kPack == 0 && is_aligned(x, 16) && (o == nullptr || is_aligned(o, kPack));
  const bool vec_t = R % kRunT == 0 && (ot == nullptr || is_aligned(ot, kRunT));
  // Whole tiles with every access vectorised: the kernel without its bounds checks.
  const bool aligned = vec_in && vec_t && R % kTileRows == 0 && C % kTileCols == 0;
  dispatch_float(x_dtype, "fp8_cast_transpose", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x);
    const auto launch = [&](auto kernel) {
      kernel<<<grid, kCastThreads, 0, stream>>>(in, R, C, scale, o, ot, a, vec_in, vec_t);
    };
    TS_CHECK(format == DType::E4M3 || format == DType::E5M2 || (out == nullptr && out_t == nullptr),
             "fp8_cast_transpose: output dtype {} is not fp8", dtype_name(format));
    if (format == DType::E5M2) {
      aligned ? launch(fp8_cast_transpose_kernel<T, DType::E5M2, true>)
              : launch(fp8_cast_transpose_kernel<T, DType::E5M2, false>);
    } else {
      aligned ? launch(fp8_cast_transpose_kernel<T, DType::E4M3, true>)
              : launch(fp8_cast_transpose_kernel<T, DType::E4M3, false>);
    }
  });
  TS_CUDA_CHECK_LAUNCH("fp8_cast_transpose_kernel");
}

void fp8_grouped_cast(const void* x, DType x_dtype, int64_t R, int64_t C, int64_t group_rows,
                      const int32_t* offsets, int64_t G, const float* scale, bool per_group_scale,
                      void* out, void* out_t, DType format, float* amax, bool per_group_amax,
                      cudaStream_t stream) {
  NvtxRange range("fp8_grouped_cast");
  if (R == 0 || C == 0 || G == 0) return;
  const int64_t grid_y = ceil_div(R, kTileRows);
  TS_CHECK(grid_y <= 65535, "fp8_grouped_cast: {} rows exceed the grid ({} max)", R,
           int64_t{65535} * kTileRows);
  const dim3 grid(static_cast<unsigned>(ceil_div(C, kTileCols)), static_cast<unsigned>(grid_y));
  auto* o = static_cast<uint8_t*>(out);
  auto* ot = static_cast<uint8_t*>(out_t);
  auto* a = reinterpret_cast<unsigned*>(amax);
  const bool vec_in = C % kPack == 0 && is_aligned(x, 16) && (o == nullptr || is_aligned(o, kPack));
  const bool aligned_t = ot == nullptr || is_aligned(ot, kRunT);
  dispatch_float(x_dtype, "fp8_grouped_cast", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x);
    if (format == DType::E5M2) {
      fp8_grouped_cast_kernel<T, DType::E5M2><<<grid, kCastThreads, 0, stream>>>(
          in, R, C, group_rows, offsets, G, scale, per_group_scale, o, ot, a, per_group_amax,
          vec_in, aligned_t);
    } else {
      TS_CHECK(format == DType::E4M3 || (out == nullptr && out_t == nullptr),
               "fp8_grouped_cast: output dtype {} is not fp8", dtype_name(format));
      fp8_grouped_cast_kernel<T, DType::E4M3><<<grid, kCastThreads, 0, stream>>>(
          in, R, C, group_rows, offsets, G, scale, per_group_scale, o, ot, a, per_group_amax,
          vec_in, aligned_t);
    }
  });
  TS_CUDA_CHECK_LAUNCH("fp8_grouped_cast_kernel");
}

void fp8_update_scales(float* history, int64_t H, int64_t S, float* scale, float* scale_inv,
                       float* nonfinite, float fp8_max, int margin, bool most_recent, bool roll,
                       cudaStream_t stream) {
  NvtxRange range("fp8_update_scales");
  if (S == 0) return;
  constexpr int kThreads = 128;
  const int64_t blocks = ceil_div(S, kThreads);
  check_grid("fp8_update_scales", blocks);
  fp8_update_scales_kernel<<<blocks, kThreads, 0, stream>>>(
      history, H, S, scale, scale_inv, nonfinite, fp8_max, margin, most_recent, roll);
  TS_CUDA_CHECK_LAUNCH("fp8_update_scales_kernel");
}

// ---- block scaling ----

namespace {

constexpr int kBlock = 128;              // tile length and block side (core/fp8.h kFp8BlockSize)
constexpr int kBlockThreads = 256;       // 8 warps
constexpr int kBlockPitch = kBlock + 1;  // floats per shared row: column reads hit 32 banks

// Warp max of |v| (non-negative, finite or not: fmaxf drops NaN, which the caller reports
// apart through nonfinite).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, warp_shfl_xor(v, o));
  return v;
}

// One CTA per 128 x 128 tile of x (rows r0.., columns c0..), staged in shared memory as fp32
// (zero outside x). Scales: a warp per tile row (out, Tile1x128), a warp per tile column
// (out_t, Tile1x128) or the CTA's (Block128x128). Codes are written row by row for out and
// column by column of x (rows of out_t) for out_t, a byte per thread, consecutive threads on
// consecutive bytes.
template <class T, DType kFormat>
__global__ void __launch_bounds__(kBlockThreads)
    fp8_block_cast_kernel(const T* x, int64_t R, int64_t C, bool blocks, uint8_t* out,
                          float* out_scale_inv, uint8_t* out_t, float* out_t_scale_inv,
                          float fp8_max, float* nonfinite) {
  extern __shared__ float tile[];  // [kBlock][kBlockPitch]
  __shared__ float row_scale[kBlock], col_scale[kBlock], warp_amax[kBlockThreads / 32];
  __shared__ float tile_scale;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBlock;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kBlock;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  bool bad = false;
  for (int i = threadIdx.x; i < kBlock * kBlock; i += kBlockThreads) {
    const int r = i / kBlock, c = i % kBlock;
    float v = 0.0f;
    if (r0 + r < R && c0 + c < C) v = to_float(x[(r0 + r) * C + c0 + c]);
    bad = bad || !isfinite(v);
    tile[r * kBlockPitch + c] = v;
  }
  if (bad && nonfinite != nullptr) *nonfinite = NAN;
  __syncthreads();
  const int64_t kb_c = (C + kBlock - 1) / kBlock, kb_r = (R + kBlock - 1) / kBlock;
  if (blocks) {
    float m = 0.0f;
    for (int i = threadIdx.x; i < kBlock * kBlock; i += kBlockThreads)
      m = fmaxf(m, fabsf(tile[(i / kBlock) * kBlockPitch + i % kBlock]));
    m = warp_max(m);
    if (lane == 0) warp_amax[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      float a = 0.0f;
      for (int w = 0; w < kBlockThreads / 32; ++w) a = fmaxf(a, warp_amax[w]);
      const float s = fp8_block_scale_on_device(a, fp8_max);
      tile_scale = s;
      const int64_t rb = blockIdx.y, cb = blockIdx.x;
      if (out) out_scale_inv[rb * ((kb_c + 3) / 4 * 4) + cb] = 1.0f / s;
      if (out_t) out_t_scale_inv[cb * ((kb_r + 3) / 4 * 4) + rb] = 1.0f / s;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kBlock; i += kBlockThreads)
      row_scale[i] = col_scale[i] = tile_scale;
    __syncthreads();
  } else {
    // Warp w takes tile rows (and columns) w, w + 8, ...: lanes stride over the 128 entries.
    for (int j = warp; j < kBlock; j += kBlockThreads / 32) {
      float mr = 0.0f, mc = 0.0f;
      for (int k = lane; k < kBlock; k += 32) {
        mr = fmaxf(mr, fabsf(tile[j * kBlockPitch + k]));
        mc = fmaxf(mc, fabsf(tile[k * kBlockPitch + j]));
      }
      mr = warp_max(mr);
      mc = warp_max(mc);
      if (lane == 0) {
        const float sr = fp8_block_scale_on_device(mr, fp8_max),
                    sc = fp8_block_scale_on_device(mc, fp8_max);
        row_scale[j] = sr;
        col_scale[j] = sc;
        if (out && r0 + j < R) out_scale_inv[blockIdx.x * R + r0 + j] = 1.0f / sr;
        if (out_t && c0 + j < C) out_t_scale_inv[blockIdx.y * C + c0 + j] = 1.0f / sc;
      }
    }
    __syncthreads();
  }
  if (out) {
    for (int i = threadIdx.x; i < kBlock * kBlock; i += kBlockThreads) {
      const int r = i / kBlock, c = i % kBlock;
      if (r0 + r < R && c0 + c < C)
        out[(r0 + r) * C + c0 + c] = fp8_encode<kFormat>(tile[r * kBlockPitch + c] * row_scale[r]);
    }
  }
  if (out_t) {
    for (int i = threadIdx.x; i < kBlock * kBlock; i += kBlockThreads) {
      const int c = i / kBlock, r = i % kBlock;
      if (r0 + r < R && c0 + c < C)
        out_t[(c0 + c) * R + r0 + r] =
            fp8_encode<kFormat>(tile[r * kBlockPitch + c] * col_scale[c]);
    }
  }
}

}  // namespace

void fp8_block_cast(const void* x, DType x_dtype, int64_t R, int64_t C, Fp8Scaling scaling,
                    void* out, float* out_scale_inv, void* out_t, float* out_t_scale_inv,
                    DType format, float* nonfinite, cudaStream_t stream) {
  NvtxRange range("fp8_block_cast");
  if (R == 0 || C == 0) return;
  const dim3 grid(static_cast<unsigned>(ceil_div(C, kBlock)),
                  static_cast<unsigned>(ceil_div(R, kBlock)));
  TS_CHECK(grid.y <= 65535, "fp8_block_cast: {} rows exceed the grid", R);
  const size_t smem = static_cast<size_t>(kBlock) * kBlockPitch * sizeof(float);
  const bool blocks = scaling == Fp8Scaling::Block128x128;
  const float max = fp8_max(format);
  dispatch_float(x_dtype, "fp8_block_cast", [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kernel) {
      TS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
      kernel<<<grid, kBlockThreads, smem, stream>>>(
          static_cast<const T*>(x), R, C, blocks, static_cast<uint8_t*>(out), out_scale_inv,
          static_cast<uint8_t*>(out_t), out_t_scale_inv, max, nonfinite);
    };
    if (format == DType::E4M3) {
      launch(fp8_block_cast_kernel<T, DType::E4M3>);
    } else {
      launch(fp8_block_cast_kernel<T, DType::E5M2>);
    }
    TS_CUDA_CHECK_LAUNCH("fp8_block_cast_kernel");
  });
}

}  // namespace tessera::cuda
