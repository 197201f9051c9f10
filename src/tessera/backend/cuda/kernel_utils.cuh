#pragma once
// Device helpers shared by the kernel families: dtype conversion, 16-byte packs, fixed-order
// reductions, and the dispatch from DType to the kernel's element type.
//
// Every memory-bound kernel moves data in Packs of VEC elements. VEC = 16 / sizeof(T) gives
// one 128-bit load or store per pack (LDG.128/STG.128), the widest access a thread can
// issue; the launcher falls back to VEC = 1 when a pointer or a row length does not allow
// it (odd test shapes, unaligned views), so every kernel is written once for both.
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"

namespace tessera::cuda {

// ---- element conversion: all arithmetic happens in fp32 ----

template <class T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return bf16_to_float(x);
  }
}

template <class T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return float_to_bf16(x);
  }
}

// ---- packs ----

template <int Bytes>
struct RawBits;
template <>
struct RawBits<16> {
  using type = uint4;
};
template <>
struct RawBits<8> {
  using type = uint2;
};
template <>
struct RawBits<4> {
  using type = uint32_t;
};
template <>
struct RawBits<2> {
  using type = uint16_t;
};

// VEC consecutive elements moved as one access of VEC * sizeof(T) bytes.
template <class T, int VEC>
struct Pack {
  using Raw = typename RawBits<static_cast<int>(sizeof(T)) * VEC>::type;
  alignas(sizeof(Raw)) T v[VEC];
};

template <class T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* p) {
  using Raw = typename Pack<T, VEC>::Raw;
  Pack<T, VEC> pack;
  *reinterpret_cast<Raw*>(pack.v) = *reinterpret_cast<const Raw*>(p);
  return pack;
}

template <class T, int VEC>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, VEC>& pack) {
  using Raw = typename Pack<T, VEC>::Raw;
  *reinterpret_cast<Raw*>(p) = *reinterpret_cast<const Raw*>(pack.v);
}

// Elements per 16-byte pack.
template <class T>
inline constexpr int kVec16 = static_cast<int>(16 / sizeof(T));

// VEC elements at p (VEC-aligned), converted to fp32, in accesses of at most 16 bytes: a kernel
// that mixes bf16 and fp32 tensors picks VEC = 8 and issues one LDG.128 for the bf16 operand
// and two for the fp32 one.
template <class T, int VEC>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[VEC]) {
  constexpr int kPer = VEC < kVec16<T> ? VEC : kVec16<T>;
#pragma unroll
  for (int a = 0; a < VEC / kPer; ++a) {
    const Pack<T, kPer> pack = load_pack<T, kPer>(p + a * kPer);
#pragma unroll
    for (int k = 0; k < kPer; ++k) out[a * kPer + k] = to_float(pack.v[k]);
  }
}

template <class T, int VEC>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[VEC]) {
  constexpr int kPer = VEC < kVec16<T> ? VEC : kVec16<T>;
#pragma unroll
  for (int a = 0; a < VEC / kPer; ++a) {
    Pack<T, kPer> pack;
    if constexpr (std::is_same_v<T, bf16> && kPer % 2 == 0) {
      auto* pairs = reinterpret_cast<bf16x2*>(pack.v);
#pragma unroll
      for (int k = 0; k < kPer / 2; ++k) {
        pairs[k] = floats_to_bf16x2(in[a * kPer + 2 * k], in[a * kPer + 2 * k + 1]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kPer; ++k) pack.v[k] = from_float<T>(in[a * kPer + k]);
    }
    store_pack<T, kPer>(p + a * kPer, pack);
  }
}

// A thread's VEC codes in one store (VEC of 16-byte packs: 8 for bf16, 4 for fp32, 1 without).
template <int VEC>
__device__ __forceinline__ void store_codes(uint8_t* p, const uint8_t (&q)[VEC]) {
  if constexpr (VEC == 8) {
    *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(q);
  } else if constexpr (VEC == 4) {
    *reinterpret_cast<uint32_t*>(p) = *reinterpret_cast<const uint32_t*>(q);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) p[k] = q[k];
  }
}

// Rows j..j+3 of 4 columns (one word each, column 0 in the low byte) -> the 4 columns' words
// of rows j..j+3 (row j in the low byte).
__device__ __forceinline__ void transpose_4x4_bytes(const uint32_t (&rows)[4],
                                                    uint32_t (&cols)[4]) {
  const uint32_t lo01 = __byte_perm(rows[0], rows[1], 0x5140),
                 hi01 = __byte_perm(rows[0], rows[1], 0x7362);
  const uint32_t lo23 = __byte_perm(rows[2], rows[3], 0x5140),
                 hi23 = __byte_perm(rows[2], rows[3], 0x7362);
  cols[0] = __byte_perm(lo01, lo23, 0x5410);
  cols[1] = __byte_perm(lo01, lo23, 0x7632);
  cols[2] = __byte_perm(hi01, hi23, 0x5410);
  cols[3] = __byte_perm(hi01, hi23, 0x7632);
}

// Columns cg .. cg + 4 of a tile of codes (rows padded to kPitch bytes) over rows j0 .. j0 +
// 4 kWords: four runs of 4 kWords codes, four to a word, each a row of the transposed output
// (the transposing casts' write-out).
template <int kRows, int kPitch, int kWords>
__device__ __forceinline__ void tile_column_runs(const uint8_t (&tile)[kRows][kPitch], int cg,
                                                 int j0, uint32_t (&run)[4][kWords]) {
#pragma unroll
  for (int j = 0; j < 4 * kWords; j += 4) {
    const uint32_t rows[4] = {*reinterpret_cast<const uint32_t*>(&tile[j0 + j][cg]),
                              *reinterpret_cast<const uint32_t*>(&tile[j0 + j + 1][cg]),
                              *reinterpret_cast<const uint32_t*>(&tile[j0 + j + 2][cg]),
                              *reinterpret_cast<const uint32_t*>(&tile[j0 + j + 3][cg])};
    uint32_t cols[4];
    transpose_4x4_bytes(rows, cols);
#pragma unroll
    for (int k = 0; k < 4; ++k) run[k][j / 4] = cols[k];
  }
}

// The transposing kernels' write-out of a whole tile of codes, kRows x kCols (rows padded to
// kPitch bytes) that kThreads threads wrote: each thread 4 tile columns over 16 tile rows
// (tile_column_runs), tile column c to row `first + c` of out_t (rows of `ld` codes), tile row
// j to its column r0 + j. Every run must lie inside out_t, 16-byte aligned.
template <int kThreads, int kCols, int kRows, int kPitch>
__device__ __forceinline__ void store_tile_transposed(const uint8_t (&tile)[kRows][kPitch], int t,
                                                      uint8_t* out_t, int64_t first, int64_t ld,
                                                      int64_t r0) {
  constexpr int kColGroups = kCols / 4;
  constexpr int kRun = kRows / (kThreads / kColGroups);
  static_assert(kRun == 16, "a thread's runs are 16 codes, one 16-byte store");
  const int cg = (t % kColGroups) * 4, j0 = (t / kColGroups) * kRun;
  uint32_t run[4][kRun / 4];
  tile_column_runs(tile, cg, j0, run);
#pragma unroll
  for (int k = 0; k < 4; ++k)
    *reinterpret_cast<uint4*>(out_t + (first + cg + k) * ld + r0 + j0) =
        make_uint4(run[k][0], run[k][1], run[k][2], run[k][3]);
}

// ---- reductions (fixed order: the same bits on every run) ----

// Butterfly sum: every lane ends with the same bits, since each step adds a + b on one lane
// and b + a on its partner.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += warp_shfl_xor(v, offset);
  return v;
}

// Sum over a block whose size is a multiple of 32; every thread receives the total.
// shared: 32 floats. Ends with a barrier so that `shared` may be reused at once.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = warp_sum(lane < warps ? shared[lane] : 0.0f);
  __syncthreads();
  return v;
}

// *amax_bits as a block reads it before its values (0 where null; thread 0's is the one used):
// amaxes only grow, so it is a lower bound of the value at the block's end.
__device__ __forceinline__ unsigned amax_seen(const unsigned* amax_bits) {
  return amax_bits != nullptr && threadIdx.x == 0 ? load_device_coherent(amax_bits) : 0u;
}

// An amax over a block of kThreads: warp_amax holds each warp's max of |x| bit patterns (for
// non-negative floats unsigned order is float order, and a NaN sorts above Inf); one thread
// folds them into *amax_bits, one atomic a block (per-warp atomics on the one address
// serialise), none when the block's max is not above `seen` (amax_seen at the kernel's start):
// an atomic that could not change the value is not sent to the one address every block of
// the kernel shares.
template <int kThreads>
__device__ __forceinline__ void block_amax_to(unsigned* amax_bits, const unsigned* warp_amax,
                                              unsigned seen) {
  unsigned block_max = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) block_max = max(block_max, warp_amax[w]);
  if (block_max > seen) atomicMax(amax_bits, block_max);
}

// ---- host-side launch helpers ----

inline bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Throws InternalError: `op` has no kernel for `dtype` (defined in cuda_check.cu).
[[noreturn]] void throw_unsupported_dtype(const char* op, DType dtype);
// Throws InternalError: a grid of `blocks` exceeds the 2^31 - 1 limit of gridDim.x.
void check_grid(const char* op, int64_t blocks);

// Calls f(T{}) with T the element type of a compute dtype (fp32 or bf16).
template <class F>
void dispatch_float(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::F32:
      f(float{});
      break;
    case DType::BF16:
      f(bf16{});
      break;
    default:
      throw_unsupported_dtype(op, dtype);
  }
}

}  // namespace tessera::cuda
