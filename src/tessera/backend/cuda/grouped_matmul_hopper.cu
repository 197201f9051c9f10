// Grouped bf16 and FP8 GEMMs for Hopper (sm_90a) that read the groups' row offsets on the
// device.
//
// One persistent kernel per call, launched in clusters of two CTAs (a CTA an SM) that walk
// pairs of 128 x 256 output tiles: the pair's tiles are neighbours in rows (2t, 2t + 1) and
// share their b tile, which each CTA loads half of into both (TMA multicast), so that b crosses
// from L2 once a pair rather than once a tile (the weights, in the forward and data gradient).
// In each CTA a producer warp streams 64-deep slices of both operands through a four-stage
// ring with TMA (128-byte swizzled boxes, mbarrier tracked, reads past an operand's extent
// zero-filled); two consumer warpgroups own 64 output rows each and multiply with wgmma
// m64n256k16 from shared memory, releasing a stage in both CTAs once the MMAs that read it
// have completed (a stage is refilled only when both are done with it). The ring runs across
// tiles, so the next tile's first slices load while this one's outputs are stored; the bf16
// outputs of the forward kinds are packed and stored behind the next tile's first MMAs, and
// the weight gradients' fp32 tiles of small groups leave through a staging box by TMA. The
// pairs launched are those that can run at once (cudaOccupancyMaxActiveClusters).
//
// The consumers' releases are CTA-scope arrivals even on the other CTA's barrier: their only
// message is that the MMAs have read the stage, and a cluster-scope release costs a fence per
// slice (measured: the kernel at 0.50-0.69 of cuBLAS with it, 0.92-1.06 without).
//
// Three operand layouts, one kernel:
//   forward         out (R, N) rows of group g = a (R, K) rows of g @ b[g]^T,  b (G, N, K)
//   data gradient   the same with b[g] not transposed,                          b (G, K, N)
//   weight gradient out[g] (M, N) = beta out[g] + a[rows_g]^T b[rows_g],        a (R, M), b (R, N)
// and two of FP8 codes, whose MMAs take only K-major operands (so the data gradient is the
// forward over the weights' transposed codes):
//   FP8 forward          as the forward, scaled by a's scale_inv and b[g]'s
//   FP8 weight gradient  out[g] = beta out[g] + a_t[:, rows_g] b_t[:, rows_g]^T, scaled,
//                        a_t (M, R) and b_t (N, R): the transposes of the activations
// FP8 slices are 128 codes deep (one 128-byte row, as bf16's 64). With split accumulation
// (Transformer Engine's use_split_accumulator: the data and weight gradients by default) each
// slice's products are summed apart and added to the fp32 accumulators, as cuBLASLt does
// without fast accumulation: the tensor cores keep fewer bits of an FP8 sum than fp32's over
// thousands of rows. The partial sums take registers, so those MMAs are two of 64 x 128 in
// turn, waited for before their sum is added.
// The forward kinds tile each group's rows (a group's last tile loads rows of the next one,
// which the store leaves alone); the tile list follows the offsets, so every CTA first turns
// them into a table of tile counts in shared memory. The weight gradient tiles each (M, N) and
// reduces over the group's rows: where its last slice runs past them, the consumers zero
// those rows of both operands in shared memory before the MMAs, so no row of another group
// enters the sum.
//
// Tile order: a group's row tiles innermost (forward; one weight tile then meets all the rows
// that use it while it is in L2), the output's 256-column tiles innermost (weight gradient; b's
// rows, the smaller operand of an expert, stay in L2 across a row of tiles).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/grouped_matmul_hopper.cuh"
#include "tessera/backend/cuda/hopper_ptx.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"

namespace tessera::cuda {

namespace {

using namespace hopper;

enum class GroupedKind { Forward, DataGrad, WeightGrad, Fp8Forward, Fp8WeightGrad };

template <GroupedKind kKind>
constexpr bool kIsFp8 = kKind == GroupedKind::Fp8Forward || kKind == GroupedKind::Fp8WeightGrad;
// The kinds whose tiles walk each group's rows (the rest reduce over them).
template <GroupedKind kKind>
constexpr bool kRowTiles =
    !(kKind == GroupedKind::WeightGrad || kKind == GroupedKind::Fp8WeightGrad);

constexpr int kBlockM = 128;  // output rows a tile: 64 per consumer warpgroup
constexpr int kBlockN = 256;
constexpr int kBlockK = 64;  // one 128-byte swizzled row of bf16 (FP8: kBlockKCodes)
constexpr int kBlockKCodes = 128;
// The reduction a ring stage holds: one 128-byte row of each operand's rows.
template <GroupedKind kKind>
constexpr int kSliceDepth = kIsFp8<kKind> ? kBlockKCodes : kBlockK;
constexpr int kStages = 4;
constexpr int kThreads = 384;  // warpgroup 0 produces, 1 and 2 consume
constexpr int kConsumerWarps = 8;
constexpr int kMaxGroups = 1024;
constexpr int kCluster = 2;  // CTAs of a pair: row tiles 2t and 2t + 1, one b tile
constexpr uint32_t kBoxBytes = 64 * 64 * 2;          // a 64 x 64 box
constexpr uint32_t kABytes = kBlockM * kBlockK * 2;  // 16 KiB
constexpr uint32_t kBBytes = kBlockN * kBlockK * 2;  // 32 KiB
constexpr uint32_t kStageBytes = kABytes + kBBytes;
constexpr uint32_t kBarrierOffset = kStages * kStageBytes;
constexpr uint32_t kTableOffset = kBarrierOffset + 2 * kStages * 8;
// The weight gradients' fp32 outputs leave through a staging box per consumer warpgroup (64
// rows x 32 columns, 128-byte swizzled like the ring's tiles) and TMA stores.
constexpr uint32_t kStagingBytes = 64 * 32 * 4;
constexpr uint32_t kStagingOffset = (kTableOffset + (kMaxGroups + 1) * 4 + 1023) / 1024 * 1024;
constexpr size_t kSmemBytes = kStagingOffset + 2 * kStagingBytes + 1024;  // + alignment slack

struct GroupedParams {
  void* out;
  const int32_t* offsets;
  int groups;
  int out_rows;          // WeightGrad: M (the forward kinds' output rows are their groups')
  int n, k;              // output columns; the reduction (forward kinds; WeightGrad: per group)
  int n_tiles, m_pairs;  // m_pairs: WeightGrad's pairs of M tiles
  float beta;
  bool out_fp32;
  bool tma_out;              // weight gradients stored through out_map (weight_tile_params)
  const float* a_scale_inv;  // FP8 kinds: (1)
  const float* b_scale_inv;  // FP8 kinds: (G) for the forward, (1) for the weight gradient
};

struct Tile {
  int group;
  int m0, m_end;  // output rows [m0, min(m0 + 128, m_end))
  int n0;
  int k0, k_end;  // the reduction's range: columns of a (forward kinds) or rows (WeightGrad)
};

// The row tiles of a group of `rows` rows, in pairs.
__device__ __forceinline__ int row_pairs(int rows) {
  return (rows + kCluster * kBlockM - 1) / (kCluster * kBlockM);
}

// The tile pairs before group g, for g = 0..G, in `table` (shared memory): every thread's list.
__device__ void build_tile_table(int* table, const GroupedParams& p) {
  for (int g = threadIdx.x; g < p.groups; g += blockDim.x)
    table[g + 1] = row_pairs(p.offsets[g + 1] - p.offsets[g]) * p.n_tiles;
  __syncthreads();
  if (threadIdx.x == 0) {
    table[0] = 0;
    for (int g = 1; g <= p.groups; ++g) table[g] += table[g - 1];
  }
  __syncthreads();
}

template <GroupedKind kKind>
__device__ __forceinline__ int tile_count(const GroupedParams& p, const int* table) {
  if constexpr (!kRowTiles<kKind>) return p.groups * p.m_pairs * p.n_tiles;
  return table[p.groups];
}

// Pair t's tile for cluster rank `rank`: the pair's two row tiles share their b tile. (Of a
// group's odd row tiles, the last pair's second lies past the group: it loads and multiplies
// like the first and stores nothing.)
template <GroupedKind kKind>
__device__ __forceinline__ Tile decode_tile(int t, int rank, const GroupedParams& p, const int* table) {
  Tile tile;
  if constexpr (!kRowTiles<kKind>) {
    const int per_group = p.m_pairs * p.n_tiles;
    tile.group = t / per_group;
    const int local = t % per_group;
    tile.m0 = ((local / p.n_tiles) * kCluster + rank) * kBlockM;
    tile.m_end = p.out_rows;
    tile.n0 = (local % p.n_tiles) * kBlockN;
    tile.k0 = p.offsets[tile.group];
    tile.k_end = p.offsets[tile.group + 1];
  } else {
    // The group holding tile t: the last g with table[g] <= t (empty groups have no tiles).
    int lo = 0, hi = p.groups - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (table[mid] <= t)
        lo = mid;
      else
        hi = mid - 1;
    }
    tile.group = lo;
    const int first = p.offsets[lo];
    const int pairs = row_pairs(p.offsets[lo + 1] - first);
    const int local = t - table[lo];
    tile.m0 = first + ((local % pairs) * kCluster + rank) * kBlockM;
    tile.m_end = p.offsets[lo + 1];
    tile.n0 = (local / pairs) * kBlockN;
    tile.k0 = 0;
    tile.k_end = p.k;
  }
  return tile;
}

// Byte addresses in the CTA's shared memory, from its 1024-byte aligned base: the ring's
// stages (a's tile, then b's) and their barriers.
struct Ring {
  uint32_t base;
  __device__ uint32_t a(int s) const { return base + s * kStageBytes; }
  __device__ uint32_t b(int s) const { return base + s * kStageBytes + kABytes; }
  __device__ uint32_t full(int s) const { return base + kBarrierOffset + 8 * s; }
  __device__ uint32_t empty(int s) const { return base + kBarrierOffset + 8 * (kStages + s); }
};

// The rows of a weight gradient's slice from `rows` on hold the next group's rows (or zeros):
// cleared in both operands (0 x Inf would still reach the sum) before the MMAs read them. Each
// consumer warpgroup clears its own part of a and half of b; both wait for both. bf16 slices
// are MN-major (a slice's rows are rows of shared memory); FP8 ones K-major (a slice's rows are
// 16-byte chunks of every row, at their swizzled places; FP8 groups are whole chunks).
template <GroupedKind kKind>
__device__ __forceinline__ void clear_rows_past_group(int rows, int consumer, uint8_t* a,
                                                      uint8_t* b) {
  if constexpr (kKind == GroupedKind::WeightGrad) {
    const uint32_t first_row = static_cast<uint32_t>(rows) * 128;
    uint8_t* const blocks[3] = {a + consumer * kBoxBytes, b + 2 * consumer * kBoxBytes,
                                b + (2 * consumer + 1) * kBoxBytes};
    for (uint8_t* block : blocks)
      for (int c = threadIdx.x % 128; c < (kBlockK - rows) * 8; c += 128)
        reinterpret_cast<uint4*>(block + first_row)[c] = make_uint4(0, 0, 0, 0);
  } else {
    const int first_chunk = rows / 16, chunks = 8 - first_chunk;
    // This warpgroup's 64 rows of a, then its 128 of b's 256.
    for (int i = threadIdx.x % 128; i < 192 * chunks; i += 128) {
      const int r = i / chunks, chunk = first_chunk + i % chunks;
      uint8_t* const row =
          r < 64 ? a + (consumer * 64 + r) * 128 : b + (consumer * 128 + r - 64) * 128;
      const int swizzle_row = r < 64 ? r : r - 64;  // both parts start on an 8-row atom
      reinterpret_cast<uint4*>(row)[chunk ^ (swizzle_row % 8)] = make_uint4(0, 0, 0, 0);
    }
  }
  fence_async_shared();
  named_barrier(1, 256);
}

// The consumer warpgroups: 64 rows each of every tile of this CTA, multiplied from the ring
// and stored.
template <GroupedKind kKind, Fp8Pair kPair, bool kSplit>
__device__ __forceinline__ void consume(const GroupedParams& p, const CUtensorMap& out_map,
                                        const int* table, int tiles, int first_pair,
                                        int pair_stride, int rank, const Ring& ring,
                                        uint8_t* smem) {
  // Broadcast from lane 0 so that the compiler knows the warpgroup is warp-uniform.
  const int consumer = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128 - 1, 0);
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int row_in_tile = consumer * 64 + warp * 16 + g;
  const bool arrives = lane == 0;
  // A stage this warp is done with, released in both CTAs of the pair (each loaded half of
  // its b tile into both).
  auto release = [&](int s) {
    for (int cta = 0; cta < kCluster; ++cta) mbar_arrive_cluster(ring.empty(s), cta);
  };

  // Descriptors at stage 0, k-step 0 (hopper_ptx.cuh). K-major operands (a and the forward's
  // b, every FP8 operand): k-step kk is 32 bytes along the 128-byte rows (16 bf16 or 32
  // codes). MN-major ones (the rest): k-step kk is 16 rows further, 64-column blocks a box
  // apart. This warpgroup's 64 rows of a are 64 rows (K-major) or one 64-column block
  // (MN-major) into the stage.
  constexpr bool kFp8 = kIsFp8<kKind>;
  constexpr bool kTransA = kKind == GroupedKind::WeightGrad;
  constexpr bool kTransB = kKind == GroupedKind::DataGrad || kKind == GroupedKind::WeightGrad;
  constexpr int kSlice = kSliceDepth<kKind>;
  const uint64_t a_desc = kTransA ? smem_desc(ring.a(0) + consumer * kBoxBytes, kBoxBytes, 1024)
                                  : smem_desc(ring.a(0) + consumer * 64 * 128, 16, 1024);
  const uint64_t b_desc =
      kTransB ? smem_desc(ring.b(0), kBoxBytes, 1024) : smem_desc(ring.b(0), 16, 1024);
  auto step = [](bool trans, int kk) {
    return static_cast<uint32_t>(trans ? kk * 16 * 128 : kk * 32);
  };

  // The row tiles' bf16 outputs: a tile's accumulators are packed here once its MMAs are
  // done, and stored while the next tile's first MMAs run, rather than with the tensor cores
  // idle (measured 0-3.6% faster, performance-notes entry 57). Split accumulation's partial
  // sums leave no registers for that: its tiles store at once.
  constexpr bool kStoresBehind = kRowTiles<kKind> && !kSplit;
  uint32_t packed[64];
  Tile behind{};
  bool has_behind = false;
  auto store_packed = [&](const Tile& tile) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = tile.m0 + row_in_tile + 8 * h;
      if (row >= min(tile.m0 + kBlockM, tile.m_end)) continue;
      bf16* const out_row = static_cast<bf16*>(p.out) + static_cast<int64_t>(row) * p.n;
#pragma unroll
      for (int c = 0; c < 32; ++c) {
        const int col = tile.n0 + 8 * c + 2 * t4;
        if (col < p.n) *reinterpret_cast<uint32_t*>(out_row + col) = packed[2 * c + h];
      }
    }
  };

  // A weight gradient tile's fp32 sums (this warpgroup's 64 rows), 32 columns at a time,
  // through the staging box and TMA stores (adds for beta 1), which drain while the next
  // tile's MMAs run; stored from registers, the sums take the tensor cores' time (4 bytes an
  // output, written once a tile of few slices: weight_tile_params says where). Rows past M
  // and columns past N are the map's edges: TMA leaves them alone.
  const bool staging_leader = threadIdx.x % 128 == 0;
  const uint32_t staging = ring.base + kStagingOffset + consumer * kStagingBytes;
  auto store_weight_tile = [&](const Tile& tile, const float(&sums)[128], float scale) {
    uint8_t* const box = smem + kStagingOffset + consumer * kStagingBytes;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (tile.n0 + 32 * j >= p.n) break;
      if (staging_leader) bulk_wait_read();  // the previous box has left the staging buffer
      named_barrier(2 + consumer, 128);
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = warp * 16 + g + 8 * h;
          const int c = 4 * j + cc;
          // Columns 8 cc + 2 t4 (+1): 16-byte chunk 2 cc + t4 / 2 of the row, swizzled.
          const uint32_t at = row * 128 + (((2 * cc + t4 / 2) ^ (row % 8)) << 4) + 8 * (t4 % 2);
          *reinterpret_cast<float2*>(box + at) =
              make_float2(scale * sums[4 * c + 2 * h], scale * sums[4 * c + 2 * h + 1]);
        }
      }
      fence_async_shared();
      named_barrier(2 + consumer, 128);
      if (staging_leader) {
        const int c0 = tile.n0 + 32 * j, c1 = tile.m0 + 64 * consumer;
        if (p.beta == 0.f) {
          tma_store(&out_map, staging, c0, c1, tile.group);
        } else {
          tma_reduce_add(&out_map, staging, c0, c1, tile.group);
        }
        bulk_commit();
      }
    }
  };

  float acc[128];
  int it = 0;
  for (int t = first_pair; t < tiles; t += pair_stride) {
    const Tile tile = decode_tile<kKind>(t, rank, p, table);
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    int slices = 0;
    for (int k0 = tile.k0; k0 < tile.k_end; k0 += kSlice, ++it, ++slices) {
      const int s = it % kStages;
      mbar_wait(ring.full(s), (it / kStages) & 1);
      if constexpr (!kRowTiles<kKind>) {
        const int rows = tile.k_end - k0;  // this group's rows left; the slice may hold others
        if (rows < kSlice) {
          clear_rows_past_group<kKind>(rows, consumer, smem + (ring.a(s) - ring.base),
                                       smem + (ring.b(s) - ring.base));
        }
      }
      const uint32_t stage_offset = static_cast<uint32_t>(s) * kStageBytes;
      if constexpr (kSplit) {
        // Each half of the tile's 256 columns: the slice's sum apart, then added.
        float part[64];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
            wgmma_m64n128_fp8_ss<kPair>(part, a_desc + ((stage_offset + kk * 32) >> 4),
                                        b_desc + ((stage_offset + half * 128 * 128 + kk * 32) >> 4),
                                        kk > 0);
          }
          wgmma_commit();
          wgmma_wait<0>();
          fence_accumulators(part);
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[64 * half + i] += part[i];
        }
        if (arrives) release(s);
      } else {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t a_k = a_desc + ((stage_offset + step(kTransA, kk)) >> 4);
          const uint64_t b_k = b_desc + ((stage_offset + step(kTransB, kk)) >> 4);
          if constexpr (kFp8) {
            wgmma_m64n256_fp8_ss<kPair>(acc, a_k, b_k, 1);
          } else {
            wgmma_m64n256_ss<kTransA, kTransB>(acc, a_k, b_k, 1);
          }
        }
        wgmma_commit();
        if constexpr (kStoresBehind) {
          if (slices == 0 && has_behind) store_packed(behind), has_behind = false;
        }
        // The previous slice's MMAs are complete once at most this one's are pending.
        wgmma_wait<1>();
        if (slices > 0 && arrives) release((it - 1) % kStages);
      }
    }
    if constexpr (!kSplit) {
      wgmma_wait<0>();
      fence_accumulators(acc);
      if (slices > 0 && arrives) release((it - 1) % kStages);
    }

    float scale = 1.f;
    if constexpr (kFp8) {
      scale = p.a_scale_inv[0] * p.b_scale_inv[kKind == GroupedKind::Fp8Forward ? tile.group : 0];
    }
    // Accumulator chunk c holds columns 8c + 2 t4 (+1) of rows row_in_tile (+8).
    if constexpr (kRowTiles<kKind>) {
#pragma unroll
      for (int c = 0; c < 32; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          packed[2 * c + h] = pack_bf16(scale * acc[4 * c + 2 * h], scale * acc[4 * c + 2 * h + 1]);
      if constexpr (kStoresBehind) {
        behind = tile, has_behind = true;
      } else {
        store_packed(tile);
      }
    } else if (p.tma_out) {
      store_weight_tile(tile, acc, scale);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = tile.m0 + row_in_tile + 8 * h;
        if (row >= min(tile.m0 + kBlockM, tile.m_end)) continue;
        const int64_t row_offset = (static_cast<int64_t>(tile.group) * p.out_rows + row) * p.n;
#pragma unroll
        for (int c = 0; c < 32; ++c) {
          const int col = tile.n0 + 8 * c + 2 * t4;
          if (col >= p.n) continue;
          float v0 = scale * acc[4 * c + 2 * h], v1 = scale * acc[4 * c + 2 * h + 1];
          if (p.out_fp32) {
            float2* const dst =
                reinterpret_cast<float2*>(static_cast<float*>(p.out) + row_offset + col);
            if (p.beta != 0.f) {
              const float2 old = *dst;
              v0 = fmaf(p.beta, old.x, v0), v1 = fmaf(p.beta, old.y, v1);
            }
            *dst = make_float2(v0, v1);
          } else {
            uint32_t* const dst =
                reinterpret_cast<uint32_t*>(static_cast<bf16*>(p.out) + row_offset + col);
            if (p.beta != 0.f) {
              const uint32_t old = *dst;
              v0 = fmaf(p.beta, __uint_as_float(old << 16), v0);
              v1 = fmaf(p.beta, __uint_as_float(old & 0xFFFF0000u), v1);
            }
            *dst = pack_bf16(v0, v1);
          }
        }
      }
    }
  }
  if (has_behind) store_packed(behind);
  if (p.tma_out && staging_leader) bulk_wait();  // the last boxes written before the CTA ends
}

template <GroupedKind kKind, Fp8Pair kPair, bool kSplit>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_matmul_hopper_kernel(const __grid_constant__ CUtensorMap a_map,
                                 const __grid_constant__ CUtensorMap b_map,
                                 const __grid_constant__ CUtensorMap out_map,
                                 const GroupedParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* const smem = smem_raw + (base - raw);
  const Ring ring{base};
  int* const table = reinterpret_cast<int*>(smem + kTableOffset);

  // A stage is refilled once both CTAs' consumers are done with it: each CTA loads half of
  // the pair's b tile into both.
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(ring.full(s), 1);
      mbar_init(ring.empty(s), kCluster * kConsumerWarps);
    }
    mbar_init_fence();
  }
  if constexpr (kRowTiles<kKind>) build_tile_table(table, p);
  cluster_sync();  // the partner's barriers are initialised before anything signals them
  const int tiles = tile_count<kKind>(p, table);
  const int rank = static_cast<int>(cluster_rank());
  const int first_pair = static_cast<int>(blockIdx.x) / kCluster;
  const int pair_stride = static_cast<int>(gridDim.x) / kCluster;

  const int warp_group = threadIdx.x / 128;
  if (warp_group == 0) {
    release_registers<40>();
    if (threadIdx.x == 0) {
      constexpr uint16_t kBoth = (1u << kCluster) - 1;
      int it = 0;  // slices loaded by this CTA: the ring's position
      for (int t = first_pair; t < tiles; t += pair_stride) {
        const Tile tile = decode_tile<kKind>(t, rank, p, table);
        for (int k0 = tile.k0; k0 < tile.k_end; k0 += kSliceDepth<kKind>, ++it) {
          const int s = it % kStages;
          mbar_wait(ring.empty(s), ((it / kStages) & 1) ^ 1);
          mbar_expect_tx(ring.full(s), kStageBytes);
          // This CTA's a tile, and its half of the pair's b tile into both CTAs.
          if constexpr (kKind == GroupedKind::WeightGrad) {
            // a's rows k0.. x columns m0.. (two 64-column boxes), b's rows x 256 columns.
            for (int j = 0; j < 2; ++j)
              tma_load(ring.a(s) + j * kBoxBytes, &a_map, ring.full(s), tile.m0 + 64 * j, k0, 0);
            for (int j = 2 * rank; j < 2 * rank + 2; ++j)
              tma_load_multicast(ring.b(s) + j * kBoxBytes, &b_map, ring.full(s), tile.n0 + 64 * j, k0,
                                 0, kBoth);
          } else {
            // K-major a: the tile's rows x the slice (the FP8 weight gradient's a_t: M rows x
            // the group's rows).
            tma_load(ring.a(s), &a_map, ring.full(s), k0, tile.m0, 0);
            if constexpr (kKind == GroupedKind::DataGrad) {
              for (int j = 2 * rank; j < 2 * rank + 2; ++j)
                tma_load_multicast(ring.b(s) + j * kBoxBytes, &b_map, ring.full(s), tile.n0 + 64 * j,
                                   k0, tile.group, kBoth);
            } else {  // K-major b: the group's weight, or the FP8 weight gradient's b_t
              const int plane = kKind == GroupedKind::Fp8WeightGrad ? 0 : tile.group;
              tma_load_multicast(ring.b(s) + rank * kBBytes / 2, &b_map, ring.full(s), k0,
                                 tile.n0 + rank * kBlockN / 2, plane, kBoth);
            }
          }
        }
      }
    }
  } else {
    claim_registers<232>();
    consume<kKind, kPair, kSplit>(p, out_map, table, tiles, first_pair, pair_stride, rank, ring,
                                  smem);
  }
  // Neither CTA leaves while the other may still signal its barriers.
  cluster_sync();
#else
  __trap();  // compiled without sm_90a; grouped_matmul_hopper_takes said no
#endif
}

// Rows of out from offsets[G] on, zeroed: the forward kinds' rows past the groups.
__global__ void zero_rows_past_groups_kernel(bf16* out, const int32_t* end, int64_t R, int64_t N) {
  const int64_t total = R * N;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(*end) * N + blockIdx.x * blockDim.x + threadIdx.x;
       i < total; i += stride)
    out[i] = bf16{};
}

// The pairs of kind kKind that run at once on `device`, with the kernel's shared memory
// allowed: found once per kind and device (the answers never change; asked on every launch
// they would cost the host a few driver queries per GEMM).
template <GroupedKind kKind, Fp8Pair kPair, bool kSplit>
int resident_pairs(int device, cudaLaunchConfig_t config) {
  constexpr auto kernel = grouped_matmul_hopper_kernel<kKind, kPair, kSplit>;
  static std::atomic<int> known[64];  // runs_on admits devices 0..63 only
  int pairs = known[device].load(std::memory_order_relaxed);
  if (pairs > 0) return pairs;
  TS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(kSmemBytes)));
  int sms = 0;
  TS_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // A pair's CTAs share a GPC, so the SMs of a GPC with an odd count may hold fewer pairs than
  // half the SMs, and a persistent grid larger than what runs would leave its last pairs for
  // a second wave.
  config.gridDim = dim3(static_cast<unsigned>(sms));
  TS_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&pairs, kernel, &config));
  pairs = std::max(pairs, 1);
  known[device].store(pairs, std::memory_order_relaxed);
  return pairs;
}

// pair_bound: at least the pairs of tiles there are (the device knows how many).
// out_map: the weight gradients' output where p.tma_out (else unused).
template <GroupedKind kKind, Fp8Pair kPair = Fp8Pair::E4m3E4m3, bool kSplit = false>
void launch(const CUtensorMap& a_map, const CUtensorMap& b_map, const CUtensorMap& out_map,
            const GroupedParams& p, int64_t pair_bound, cudaStream_t stream) {
  if (pair_bound == 0) return;
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kCluster, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  int device = 0;
  TS_CUDA_CHECK(cudaGetDevice(&device));
  const int64_t pairs =
      std::min<int64_t>(pair_bound, resident_pairs<kKind, kPair, kSplit>(device, config));
  config.gridDim = dim3(static_cast<unsigned>(pairs * kCluster));
  TS_CUDA_CHECK(cudaLaunchKernelEx(&config, grouped_matmul_hopper_kernel<kKind, kPair, kSplit>,
                                   a_map, b_map, out_map, p));
}

}  // namespace

bool grouped_matmul_hopper_runs_on(int device) {
  return runs_on(device);
}

bool grouped_matmul_hopper_takes(int device, int64_t groups, int element_bytes,
                                 std::initializer_list<int64_t> widths,
                                 std::initializer_list<const void*> bases) {
  if (groups < 1 || groups > kMaxGroups) return false;
  for (int64_t w : widths)
    if (w <= 0 || (w * element_bytes) % 16 != 0 || w > (int64_t{1} << 30)) return false;
  for (const void* b : bases)
    if (reinterpret_cast<uintptr_t>(b) % 16 != 0) return false;
  return runs_on(device);
}

namespace {

// The row-tile kinds' parameters and a bound on their pairs of tiles: at most a partial pair
// of row tiles per group beyond R's whole ones.
GroupedParams row_tile_params(void* out, const int32_t* offsets, int64_t G, int64_t N, int64_t K) {
  GroupedParams p{};
  p.out = out, p.offsets = offsets, p.groups = static_cast<int>(G);
  p.n = static_cast<int>(N), p.k = static_cast<int>(K);
  p.n_tiles = static_cast<int>((N + kBlockN - 1) / kBlockN);
  return p;
}
int64_t row_tile_pairs(const GroupedParams& p, int64_t R) {
  return R > 0 ? ((R + kCluster * kBlockM - 1) / (kCluster * kBlockM) + p.groups) * p.n_tiles : 0;
}

void zero_rows_past_groups(bf16* out, const int32_t* offsets, int64_t G, int64_t R, int64_t N,
                           cudaStream_t stream) {
  if (R == 0) return;
  zero_rows_past_groups_kernel<<<264, 256, 0, stream>>>(out, offsets + G, R, N);
  TS_CUDA_CHECK_LAUNCH("zero_rows_past_groups_kernel");
}

// The weight gradients' tiles store through TMA (p.tma_out) where that pays: fp32 sums
// (beta 0, or 1 as TMA's add) of groups of at most 1,024 rows on average, whose tiles reduce
// over a few slices and spend much of their time storing (lab: the 64 experts' weight gradient
// 12% faster, Qwen3-30B-A3B's FP8 ones 16-27%). Over Mixtral's 2,048 rows the staging's
// barriers cost more than they hide (FP8 with split accumulation 4% slower), so those tiles
// store from registers.
GroupedParams weight_tile_params(void* out, bool out_fp32, const int32_t* offsets, int64_t G,
                                 int64_t R, int64_t M, int64_t N, float beta) {
  constexpr int64_t kMostStagedRowsPerGroup = 1024;
  GroupedParams p{};
  p.out = out, p.offsets = offsets, p.groups = static_cast<int>(G);
  p.out_rows = static_cast<int>(M), p.n = static_cast<int>(N);
  p.n_tiles = static_cast<int>((N + kBlockN - 1) / kBlockN);
  p.m_pairs = static_cast<int>((M + kCluster * kBlockM - 1) / (kCluster * kBlockM));
  p.beta = beta, p.out_fp32 = out_fp32;
  p.tma_out = out_fp32 && (beta == 0.f || beta == 1.f) && R <= kMostStagedRowsPerGroup * G;
  return p;
}

// The weight gradients' output (G, M, N) fp32 as TMA stores it, in the staging box's shape,
// where p.tma_out; elsewhere the kernel stores from registers and never reads its out_map, so
// `unused` (a map made anyway) stands in and no map is made for nothing.
CUtensorMap weight_out_map(const GroupedParams& p, void* out, int64_t G, int64_t M, int64_t N,
                           const CUtensorMap& unused) {
  if (!p.tma_out) return unused;
  const uint64_t dims[3] = {static_cast<uint64_t>(N), static_cast<uint64_t>(M),
                            static_cast<uint64_t>(G)};
  const uint64_t strides[2] = {static_cast<uint64_t>(N) * 4,
                               static_cast<uint64_t>(M) * static_cast<uint64_t>(N) * 4};
  const uint32_t box[3] = {32, 64, 1};
  return tensor_map(out, 4, dims, strides, box);
}

// The FP8 kinds' instances: a's format x split accumulation.
template <GroupedKind kKind>
void launch_fp8(bool a_e5m2, bool split, const CUtensorMap& a_map, const CUtensorMap& b_map,
                const CUtensorMap& out_map, const GroupedParams& p, int64_t pair_bound,
                cudaStream_t stream) {
  constexpr Fp8Pair k44 = Fp8Pair::E4m3E4m3, k54 = Fp8Pair::E5m2E4m3;
  if (a_e5m2) {
    split ? launch<kKind, k54, true>(a_map, b_map, out_map, p, pair_bound, stream)
          : launch<kKind, k54, false>(a_map, b_map, out_map, p, pair_bound, stream);
  } else {
    split ? launch<kKind, k44, true>(a_map, b_map, out_map, p, pair_bound, stream)
          : launch<kKind, k44, false>(a_map, b_map, out_map, p, pair_bound, stream);
  }
}

}  // namespace

void grouped_matmul_hopper(bf16* out, const bf16* a, const bf16* b, const int32_t* offsets,
                           int64_t G, int64_t R, int64_t N, int64_t K, bool trans_b,
                           cudaStream_t stream) {
  const GroupedParams p = row_tile_params(out, offsets, G, N, K);
  const CUtensorMap a_map = row_map(a, K, R, 1, kBlockM);
  if (trans_b) {
    launch<GroupedKind::Forward>(a_map, row_map(b, K, N, G, kBlockN / kCluster), a_map, p,
                                 row_tile_pairs(p, R), stream);
  } else {
    launch<GroupedKind::DataGrad>(a_map, row_map(b, N, K, G, 64), a_map, p, row_tile_pairs(p, R),
                                  stream);
  }
  zero_rows_past_groups(out, offsets, G, R, N, stream);
}

void grouped_matmul_wgrad_hopper(void* out, bool out_fp32, const bf16* a, const bf16* b,
                                 const int32_t* offsets, int64_t G, int64_t R, int64_t M, int64_t N,
                                 float beta, cudaStream_t stream) {
  const GroupedParams p = weight_tile_params(out, out_fp32, offsets, G, R, M, N, beta);
  // R = 0 still writes beta * out; a map needs at least one row.
  const int64_t map_rows = std::max<int64_t>(R, 1);
  const CUtensorMap a_map = row_map(a, M, map_rows, 1, 64);
  launch<GroupedKind::WeightGrad>(a_map, row_map(b, N, map_rows, 1, 64),
                                  weight_out_map(p, out, G, M, N, a_map), p,
                                  G * p.m_pairs * p.n_tiles, stream);
}

void grouped_matmul_fp8_hopper(bf16* out, const void* a, bool a_e5m2, const void* b,
                               const float* a_scale_inv, const float* b_scale_inv,
                               const int32_t* offsets, int64_t G, int64_t R, int64_t N, int64_t K,
                               bool split_accumulation, cudaStream_t stream) {
  GroupedParams p = row_tile_params(out, offsets, G, N, K);
  p.a_scale_inv = a_scale_inv, p.b_scale_inv = b_scale_inv;
  const CUtensorMap a_map = codes_map(a, K, R, 1, kBlockM);
  launch_fp8<GroupedKind::Fp8Forward>(a_e5m2, split_accumulation, a_map,
                                      codes_map(b, K, N, G, kBlockN / kCluster), a_map, p,
                                      row_tile_pairs(p, R), stream);
  zero_rows_past_groups(out, offsets, G, R, N, stream);
}

void grouped_matmul_fp8_wgrad_hopper(void* out, bool out_fp32, const void* a_t, bool a_e5m2,
                                     const void* b_t, const float* a_scale_inv,
                                     const float* b_scale_inv, const int32_t* offsets, int64_t G,
                                     int64_t R, int64_t M, int64_t N, float beta,
                                     bool split_accumulation, cudaStream_t stream) {
  GroupedParams p = weight_tile_params(out, out_fp32, offsets, G, R, M, N, beta);
  p.a_scale_inv = a_scale_inv, p.b_scale_inv = b_scale_inv;
  // R = 0 still writes beta * out; a map needs at least 16 columns (TMA's stride rule).
  const int64_t map_columns = std::max<int64_t>(R, 16);
  const CUtensorMap a_map = codes_map(a_t, map_columns, M, 1, kBlockM);
  launch_fp8<GroupedKind::Fp8WeightGrad>(
      a_e5m2, split_accumulation, a_map, codes_map(b_t, map_columns, N, 1, kBlockN / kCluster),
      weight_out_map(p, out, G, M, N, a_map), p, G * p.m_pairs * p.n_tiles, stream);
}

}  // namespace tessera::cuda
