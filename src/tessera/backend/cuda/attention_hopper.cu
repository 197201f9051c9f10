// Flash-attention forward for Hopper (sm_90a): the FlashAttention-3 structure. A producer warp
// loads Q once and K/V tiles into a two-stage ring with TMA (mbarrier-tracked, 128-byte
// swizzled boxes, rows past T zero-filled by the copy engine); two consumer warpgroups own 64
// query rows each and run S = Q K^T and O += P V as warpgroup MMAs (wgmma m64n128k16: Q and K
// from shared memory, P from registers, V read transposed from shared memory), with the online
// softmax in registers between them.
//
// Why this beats attention.cu's warp-MMA forward at head_dim 128: a wgmma reads its B operand
// from shared memory once for the warpgroup's 64 rows (mma.sync re-reads it per warp through
// ldmatrix, which caps the tensor cores at the shared-memory port), and TMA frees the
// consumers from address arithmetic and copy issue. The softmax of one tile overlaps the MMAs
// two ways: the two consumer warpgroups take turns to issue their MMAs (FA3's ping-pong: one's
// exponentials while the other's MMAs), and within a warpgroup S of tile n+1 is issued before
// P V of tile n, so the tensor cores work while the softmax of tile n+1 runs (FA3's
// intra-warpgroup overlap).
//
// The masks are attention.cu's: causal, sliding window, packed documents (attention_common.cuh),
// element masks only on tiles that hold an invisible pair, tiles with no visible pair never
// loaded. Grid order as there: the heaviest query tiles start first.
//
// Under context parallelism (p.segments > 1, ContextSegments) the same kernel reads every
// rank's keys from the gathered keys and values (p.kv) by position and this rank's queries in
// place: masks and tile ranges are in positions, loads and stores in rows.
//
// FP8 attention (kFp8, attention_fp8.cu casts the operands) runs both products on e4m3 codes
// at twice the bf16 rate: S = Q K^T as wgmma m64n128k32 from shared memory, O += P V with P's
// codes in registers and V's transposed codes in shared memory (FP8 wgmma takes K-major
// operands only). Each 128-token tile of a head has its own descale: a tile's scores are
// scaled by its query and key descales in the softmax, and O is held in units of the current
// value tile's descale, converted by the ratio of two tiles' descales where the softmax
// rescales it anyway. P is coded as 256 p (e4m3's smallest subnormal is 2^-9, so p down to
// 2^-17 stays a code); the row sums stay fp32, so the factor cancels in the normalisation.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "tessera/backend/cuda/attention.cuh"
#include "tessera/backend/cuda/attention_common.cuh"
#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/hopper_ptx.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/core/error.h"

namespace tessera::cuda {

namespace {

using namespace hopper;

constexpr int kD = 128;
constexpr int kBlockM = 128;  // query rows per CTA: 64 per consumer warpgroup
constexpr int kBlockN = 128;  // keys per tile
constexpr int kStages = 2;
constexpr int kThreads = 384;  // warpgroup 0 produces, 1 and 2 consume
constexpr int kConsumerWarps = 8;
// One TMA box: 128 rows x 128 bytes (64 bf16 or 128 codes). A tile (Q, or a K or V stage) is
// 128 rows x 128 columns: two boxes in bf16, one of codes.
constexpr uint32_t kBoxBytes = kBlockN * 128;
template <bool kFp8>
constexpr uint32_t kTileBytes = kFp8 ? kBoxBytes : 2 * kBoxBytes;
// Shared memory from a 1024-byte aligned base (the 128-byte swizzle repeats every 1024 bytes
// and wgmma's descriptors assume atoms that start on that boundary).
constexpr uint32_t kQOffset = 0;
template <bool kFp8>
constexpr uint32_t kKOffset = kTileBytes<kFp8>;
template <bool kFp8>
constexpr uint32_t kVOffset = kKOffset<kFp8> + kStages* kTileBytes<kFp8>;
// The epilogue stages O (bf16, 32 KB) in each warpgroup's own rows of the Q tile; the FP8 Q tile
// is half that, so FP8 stages it past the V stages (the other warpgroup may still read K and V).
template <bool kFp8>
constexpr uint32_t kOutOffset = kFp8 ? kVOffset<kFp8> + kStages* kTileBytes<kFp8> : kQOffset;
template <bool kFp8>
constexpr uint32_t kBarrierOffset =
    kFp8 ? kOutOffset<kFp8> + 2 * kBoxBytes : kVOffset<kFp8> + kStages* kTileBytes<kFp8>;
template <bool kFp8>  // 9 barriers, alignment slack
constexpr size_t kSmemBytes = kBarrierOffset<kFp8> + 128 + 1024;
// k-steps of the MMAs over a tile's 128 columns: 16 bf16 or 32 codes each.
template <bool kFp8>
constexpr int kKSteps = kFp8 ? 4 : 8;
// FP8 probabilities are coded as 2^kFp8ProbabilityShift p (the header's note).
constexpr float kFp8ProbabilityShift = 8.f;
// Named barriers 1 and 2: consumer warpgroup 1's and 2's turn to issue MMAs.
constexpr int kBarrierTurn = 1;
constexpr int kConsumerThreads = 256;

// ---- the kernel (accumulator layout: hopper_ptx.cuh) ----

struct ConsumerState {
  float o[64];
  float row_max[2], row_sum[2];
};

// Masks S (raw scores) where needed, folds the tile into the running max (in log2 units:
// scores times c, the tile's softmax scale times log2 e) and sum, leaves 2^shift times the
// probabilities in s and returns each row's rescale factor for O.
// row0: this thread's first query's position; Tk: the keys (the whole sequence's);
// document_first: the first key of each of its two rows' documents (0 without documents).
__device__ __forceinline__ void softmax_tile(float (&s)[64], ConsumerState& st, float (&alpha)[2],
                                             bool boundary, int row0, int k0, int t, int Tk,
                                             const AttentionForwardParams& p,
                                             const int (&document_first)[2], float c, float shift) {
  if (boundary) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = row0 + 8 * r;
      const int lo = max(p.window > 0 ? i - p.window + 1 : 0, document_first[r]) - k0 - 2 * t;
      const int hi = min(p.causal ? i : Tk - 1, Tk - 1) - k0 - 2 * t;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 8 * j + e;
          if (col < lo || col > hi) s[4 * j + 2 * r + e] = -INFINITY;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // Four partial maxima and sums: chains a quarter as long for the scheduler to interleave.
    float part[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 16; ++j) part[j % 4] = fmaxf(part[j % 4], fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
    float mx = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
    mx = fmaxf(mx, warp_shfl_xor(mx, 1));
    mx = fmaxf(mx, warp_shfl_xor(mx, 2));
    const float m = fmaxf(st.row_max[r], mx * c);  // c > 0: -inf stays -inf
    // A row with nothing visible so far keeps max -inf; 0 as the subtrahend makes its
    // exponents exp2(-inf) = 0 rather than NaN.
    const float m_sub = m == -INFINITY ? 0.f : m;
    alpha[r] = fast_exp2(st.row_max[r] - m_sub);
    st.row_max[r] = m;
#pragma unroll
    for (int k = 0; k < 4; ++k) part[k] = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pv = fast_exp2(fmaf(s[4 * j + 2 * r + e], c, shift - m_sub));
        s[4 * j + 2 * r + e] = pv;
        part[j % 4] += pv;
      }
    }
    const float sum = (part[0] + part[1]) + (part[2] + part[3]);
    // Partial sums per thread; the quad's are combined once, in the epilogue.
    st.row_sum[r] = st.row_sum[r] * alpha[r] + sum;
  }
}

// The FP8 codes of 8 stored bf16 values (as fp8_cast_transpose would write them from out) at
// dst, 8-byte aligned; returns max |value| as its float's bits.
template <DType kFormat>
__device__ __forceinline__ unsigned store_fp8(uint8_t* dst, const uint4& values, float scale) {
  const bf16* x = reinterpret_cast<const bf16*>(&values);
  alignas(8) uint8_t q[8];
  unsigned m = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float v = to_float(x[k]);
    m = max(m, __float_as_uint(fabsf(v)));
    q[k] = fp8_encode<kFormat>(v * scale);
  }
  store_codes<8>(dst, q);
  return m;
}

__device__ __forceinline__ void rescale(ConsumerState& st, const float (&alpha)[2]) {
#pragma unroll
  for (int c = 0; c < 16; ++c) {
    st.o[4 * c] *= alpha[0];
    st.o[4 * c + 1] *= alpha[0];
    st.o[4 * c + 2] *= alpha[1];
    st.o[4 * c + 3] *= alpha[1];
  }
}

// P (bf16) as the A fragments of the 8 k-steps of P V: keys 16 kk .. 16 kk + 15 are chunks
// 2 kk and 2 kk + 1 of S.
__device__ __forceinline__ void probabilities_to_a(uint32_t (&pa)[8][4], const float (&s)[64]) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    pa[kk][0] = pack_bf16(s[8 * kk], s[8 * kk + 1]);
    pa[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

__device__ __forceinline__ uint32_t pack_e4m3(float a, float b, float c, float d) {
  return static_cast<uint32_t>(fp8x2_encode<DType::E4M3>(a, b)) |
         static_cast<uint32_t>(fp8x2_encode<DType::E4M3>(c, d)) << 16;
}

// P (e4m3) as the A fragments of the 4 k-steps of P V. An FP8 fragment holds columns 4 t ..
// 4 t + 3 and 16 + 4 t .. of its rows where the accumulator holds 2 t, 2 t + 1 of each 8:
// so k-step kk's logical column 4 t + i is key 8 (i / 2) + 2 t + i % 2 of keys 32 kk .. (16 more
// for the second half), the order in which attention_fp8.cu writes V's transposed codes.
__device__ __forceinline__ void probabilities_to_e4m3_a(uint32_t (&pa)[4][4],
                                                        const float (&s)[64]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const float* x = s + 16 * kk;
    pa[kk][0] = pack_e4m3(x[0], x[1], x[4], x[5]);
    pa[kk][1] = pack_e4m3(x[2], x[3], x[6], x[7]);
    pa[kk][2] = pack_e4m3(x[8], x[9], x[12], x[13]);
    pa[kk][3] = pack_e4m3(x[10], x[11], x[14], x[15]);
  }
}

// kFp8: q_map and kv_map both read the query and key heads' codes, vt_map the value heads'
// transposed codes (attention_fp8.cu); otherwise vt_map is not read.
template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    attention_forward_hopper_kernel(const __grid_constant__ CUtensorMap q_map,
                                    const __grid_constant__ CUtensorMap kv_map,
                                    const __grid_constant__ CUtensorMap vt_map,
                                    const AttentionForwardParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr uint32_t kTile = kTileBytes<kFp8>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* const smem = smem_raw + (base - raw);
  const uint32_t sQ = base + kQOffset, sK = base + kKOffset<kFp8>, sV = base + kVOffset<kFp8>;
  const uint32_t bars = base + kBarrierOffset<kFp8>;
  const uint32_t full_q = bars;
  auto full_k = [&](int s) { return bars + 8 + 8 * s; };
  auto full_v = [&](int s) { return bars + 24 + 8 * s; };
  auto empty_k = [&](int s) { return bars + 40 + 8 * s; };
  auto empty_v = [&](int s) { return bars + 56 + 8 * s; };

  const int T = p.seq;  // this segment's rows: queries, out, lse
  const ContextSegments cs = context_segments(p.segments, p.segment, T);
  const int Tk = cs.keys(T);
  const int m_tile = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / p.group;
  const int batch = static_cast<int>(gridDim.z);
  const int u0 = m_tile * kBlockM;  // the tile's first row; q0, q_last: positions
  const int q0 = cs.position(u0);
  const int q_last = q0 + min(kBlockM, T - u0) - 1;
  // The document starts by position, over the whole sequence.
  const int32_t* const starts =
      p.document_starts ? p.document_starts + static_cast<int64_t>(b) * Tk : nullptr;
  const int last_start = document_start(starts, q_last, Tk);
  // Keys visible from some row of the tile (attention.cu's forward has the same range).
  const int kv_first = max(p.window > 0 ? max(0, q0 - p.window + 1) : 0, document_start(starts, q0, Tk));
  const int kv_end = p.causal ? q_last + 1 : Tk;
  const int n_begin = kv_first / kBlockN, n_end = (kv_end + kBlockN - 1) / kBlockN;

  if (threadIdx.x == 0) {
    mbar_init(full_q, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_k(s), 1);
      mbar_init(full_v(s), 1);
      mbar_init(empty_k(s), kConsumerWarps);
      mbar_init(empty_v(s), kConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int warp_group = threadIdx.x / 128;
  if (warp_group == 0) {
    release_registers<40>();
    if (threadIdx.x == 0) {
      const int q_col = h * kD, k_col = p.kv_col + kvh * kD, v_col = p.kv_col + (p.kv_heads + kvh) * kD;
      // A tile's boxes: 128 columns of codes in one, of bf16 in two.
      auto load_tile = [&](uint32_t dst, const CUtensorMap* map, uint32_t bar, int col, int row,
                           int plane) {
        tma_load(dst, map, bar, col, row, plane);
        if constexpr (!kFp8) tma_load(dst + kBoxBytes, map, bar, col + 64, row, plane);
      };
      mbar_expect_tx(full_q, kTile);
      load_tile(sQ, &q_map, full_q, q_col, u0, b);
      for (int n = n_begin, i = 0; n < n_end; ++n, ++i) {
        const int s = i % kStages;
        const uint32_t parity = ((i / kStages) & 1) ^ 1;
        const int2 k_row = cs.row_of(n * kBlockN);  // the segment and row holding the tile
        const int k0 = k_row.x, k_plane = k_row.y * batch + b;
        mbar_wait(empty_k(s), parity);
        mbar_expect_tx(full_k(s), kTile);
        load_tile(sK + s * kTile, &kv_map, full_k(s), k_col, k0, k_plane);
        mbar_wait(empty_v(s), parity);
        mbar_expect_tx(full_v(s), kTile);
        if constexpr (kFp8) {  // head kvh's dimensions are rows of its plane, keys its columns
          tma_load(sV + s * kTile, &vt_map, full_v(s), k0, 0, b * p.kv_heads + kvh);
        } else {
          load_tile(sV + s * kTile, &kv_map, full_v(s), v_col, k0, k_plane);
        }
      }
    }
    return;
  }
  claim_registers<232>();

  // Broadcast from lane 0 so that the compiler knows the warpgroup is warp-uniform: the
  // descriptors derived from it then live in uniform registers.
  const int consumer = __shfl_sync(0xffffffffu, warp_group - 1, 0);
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int local_row0 = consumer * 64 + warp * 16 + g;  // this thread's first row in the CTA
  const int row0 = q0 + local_row0;                      // its position
  const bool arrives = lane == 0;

  // Each operand's descriptor at its first k-step and stage; a later one adds its byte offset
  // >> 4 to the start-address field (bits 0-13), which never carries (shared memory is below
  // 256 KiB), so a tile's descriptors cost one addition of a constant each.
  // Q's k-step kk: 32 bytes per k-step inside the 128-byte row (in bf16 in 64-column box
  // kk / 4); this warpgroup's rows start 64 rows (8 KiB) into each box. K's likewise, from its
  // stage; so are V's transposed codes in FP8 (keys along the row).
  const uint64_t q_base = smem_desc(sQ + consumer * 64 * 128, 16, 1024);
  const uint64_t k_base = smem_desc(sK, 16, 1024);
  const uint64_t v_base = smem_desc(sV, kFp8 ? 16 : kBoxBytes, 1024);
  auto step_offset = [](int kk) { return (kk / 4) * kBoxBytes + (kk % 4) * 32; };
  auto q_desc = [&](int kk) { return q_base + (step_offset(kk) >> 4); };
  auto k_desc = [&](int s, int kk) { return k_base + ((s * kTile + step_offset(kk)) >> 4); };
  // bf16 V's k-step kk is keys 16 kk .. 16 kk + 15: 16 rows of 128 bytes further.
  auto v_desc = [&](int s, int kk) {
    return v_base + ((s * kTile + (kFp8 ? step_offset(kk) : kk * 16 * 128)) >> 4);
  };
  // The MMAs of one tile: S = Q K^T (overwritten) and O += P V.
  auto issue_scores = [&](float(&acc)[64], int s) {
#pragma unroll
    for (int kk = 0; kk < kKSteps<kFp8>; ++kk) {
      if constexpr (kFp8) {
        wgmma_m64n128_fp8_ss<Fp8Pair::E4m3E4m3>(acc, q_desc(kk), k_desc(s, kk), kk > 0);
      } else {
        wgmma_m64n128_ss(acc, q_desc(kk), k_desc(s, kk), kk > 0);
      }
    }
  };
  auto issue_values = [&](float(&o)[64], const uint32_t(&pa)[kKSteps<kFp8>][4], int s) {
#pragma unroll
    for (int kk = 0; kk < kKSteps<kFp8>; ++kk) {
      if constexpr (kFp8) {
        wgmma_m64n128_e4m3_rs(o, pa[kk], v_desc(s, kk));
      } else {
        wgmma_m64n128_rs(o, pa[kk], v_desc(s, kk));
      }
    }
  };
  auto to_a = [](uint32_t(&pa)[kKSteps<kFp8>][4], const float(&s)[64]) {
    if constexpr (kFp8) {
      probabilities_to_e4m3_a(pa, s);
    } else {
      probabilities_to_a(pa, s);
    }
  };
  // FP8: the descales of the CTA's query tile and of key and value tile n (attention_fp8.cu's
  // layout); the softmax scales a tile's scores by c(n) in log2 units.
  const int64_t head_tiles = static_cast<int64_t>(p.tiles);
  const float* const descale_q =
      kFp8 ? p.descales + (static_cast<int64_t>(b) * (p.heads + 2 * p.kv_heads) + h) * head_tiles
           : nullptr;
  const float* const descale_k = kFp8 ? descale_q + (p.heads - h + kvh) * head_tiles : nullptr;
  const float* const descale_v = kFp8 ? descale_k + p.kv_heads * head_tiles : nullptr;
  const float q_scale_log2 = kFp8 ? p.scale_log2 * descale_q[m_tile] : p.scale_log2;
  auto score_scale = [&](int n) { return kFp8 ? q_scale_log2 * descale_k[n] : p.scale_log2; };
  const float shift = kFp8 ? kFp8ProbabilityShift : 0.f;

  ConsumerState st;
#pragma unroll
  for (int i = 0; i < 64; ++i) st.o[i] = 0.f;
  st.row_max[0] = st.row_max[1] = -INFINITY;
  st.row_sum[0] = st.row_sum[1] = 0.f;

  // Read here, while Q and the first keys load: a tile's mask reading them from global memory
  // would wait on the load in the middle of its softmax (packed documents: every CTA's last
  // tile, the diagonal, and with short documents a CTA has only a few).
  const int document_first[2] = {document_start(starts, row0, Tk), document_start(starts, row0 + 8, Tk)};
  // The two warpgroups take turns to issue their MMAs (FlashAttention-3's ping-pong), so that
  // one's softmax runs while the tensor cores work on the other's: without turns they start
  // together and stay in step, and both softmaxes of the first tile and both epilogues leave
  // the tensor cores idle, which weighs on CTAs of a few tiles (short packed documents).
  // Consumer 0 goes first (consumer 1's arrival opens its barrier); each has tiles + 1 turns,
  // and consumer 0 takes one more at the end so that no arrival is left pending. (The barrier
  // ids are run-time values, so ptxas reserves all 16: harmless at one CTA an SM.)
  auto await_turn = [&] { named_barrier(kBarrierTurn + consumer, kConsumerThreads); };
  auto pass_turn = [&] { named_barrier_arrive(kBarrierTurn + (consumer ^ 1), kConsumerThreads); };
  if (consumer == 1) pass_turn();

  float s_acc[64];
  uint32_t pa[kKSteps<kFp8>][4];
  float alpha[2];
  mbar_wait(full_q, 0);

  // Tile n_begin: S, softmax, P.
  {
    const float c = score_scale(n_begin);
    mbar_wait(full_k(0), 0);
    await_turn();
    wgmma_fence();
    issue_scores(s_acc, 0);
    wgmma_commit();
    pass_turn();
    wgmma_wait<0>();
    fence_accumulators(s_acc);
    if (arrives) mbar_arrive(empty_k(0));
    const int k0 = n_begin * kBlockN;
    softmax_tile(s_acc, st, alpha,
                 tile_needs_mask(q0, q_last, k0, kBlockN, Tk, p.causal, p.window, last_start), row0,
                 k0, t, Tk, p, document_first, c, shift);
    to_a(pa, s_acc);
  }
  // Tile n: S of n is issued before P V of n - 1, so the tensor cores have the second while
  // the softmax of the first runs; O is rescaled only once P V of n - 1 has landed.
  for (int n = n_begin + 1, i = 1; n < n_end; ++n, ++i) {
    const int s = i % kStages, prev = (i - 1) % kStages;
    const uint32_t parity = (i / kStages) & 1, prev_parity = ((i - 1) / kStages) & 1;
    const float c = score_scale(n);
    // FP8: O moves from tile n - 1's value units to tile n's with the softmax's rescale. The
    // descales are powers of two, so the ratio is exact; O would overflow only after a value
    // tile whose amax is some 2^100 below an earlier one's (amaxes near 1e-28 in bf16 training).
    const float value_ratio = kFp8 ? __fdividef(descale_v[n - 1], descale_v[n]) : 1.f;
    mbar_wait(full_k(s), parity);
    mbar_wait(full_v(prev), prev_parity);
    await_turn();
    wgmma_fence();
    issue_scores(s_acc, s);
    wgmma_commit();
    fence_accumulators(st.o);
    wgmma_fence();
    issue_values(st.o, pa, prev);
    wgmma_commit();
    pass_turn();
    wgmma_wait<1>();
    fence_accumulators(s_acc);
    if (arrives) mbar_arrive(empty_k(s));
    const int k0 = n * kBlockN;
    softmax_tile(s_acc, st, alpha,
                 tile_needs_mask(q0, q_last, k0, kBlockN, Tk, p.causal, p.window, last_start), row0,
                 k0, t, Tk, p, document_first, c, shift);
    wgmma_wait<0>();
    fence_accumulators(st.o);
    if (arrives) mbar_arrive(empty_v(prev));
    if constexpr (kFp8) alpha[0] *= value_ratio, alpha[1] *= value_ratio;
    rescale(st, alpha);
    to_a(pa, s_acc);
  }
  // P V of the last tile. (The first tile's alpha was 0 against an O of zeros: nothing to rescale.)
  {
    const int last = n_end - 1 - n_begin;
    const int s = last % kStages;
    mbar_wait(full_v(s), (last / kStages) & 1);
    await_turn();
    wgmma_fence();
    fence_accumulators(st.o);
    issue_values(st.o, pa, s);
    wgmma_commit();
    pass_turn();
    wgmma_wait<0>();
    fence_accumulators(st.o);
  }
  if (consumer == 0) await_turn();

  // Epilogue: normalise, write lse, stage O (bf16) in this warp's own rows of a 128-row
  // swizzled tile (bf16: the Q tile; FP8: the staging tile at kOutOffset), then store 16-byte
  // chunks of whole rows.
  const int64_t stat_row = (static_cast<int64_t>(b) * p.heads + h) * T;
  // FP8: O is in the last value tile's units.
  const float value_descale = kFp8 ? descale_v[n_end - 1] : 1.f;
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = st.row_sum[r];
    l += warp_shfl_xor(l, 1);
    l += warp_shfl_xor(l, 2);
    inv[r] = l > 0.f ? value_descale / l : 0.f;
    const int i = u0 + local_row0 + 8 * r;
    if (t == 0 && i < T)
      p.lse[stat_row + i] = l > 0.f ? (st.row_max[r] + log2f(l) - shift) * kLn2 : -INFINITY;
  }
  // bf16 stages in the Q tile, last written by TMA and read by wgmma (the async proxy); these
  // generic writes reuse it. (FP8's staging tile is only ever written here.)
  fence_async_shared();
  auto staged = [&](int row, int col) { return swizzled_offset(kBlockM, row, col); };
#pragma unroll
  for (int c = 0; c < 16; ++c) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      *reinterpret_cast<uint32_t*>(smem + kOutOffset<kFp8> +
                                   staged(local_row0 + 8 * r, 8 * c + 2 * t)) =
          pack_bf16(st.o[4 * c + 2 * r] * inv[r], st.o[4 * c + 2 * r + 1] * inv[r]);
    }
  }
  __syncwarp();
  const int warp_row0 = consumer * 64 + warp * 16;
  const int64_t out_stride = static_cast<int64_t>(p.heads) * kD;
  const int64_t out_offset = (static_cast<int64_t>(b) * T + u0) * out_stride + h * kD;
  bf16* const out = p.out + out_offset;
  const float code_scale = p.codes != nullptr ? *p.code_scale : 0.f;
  unsigned code_amax = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int chunk = lane + 32 * k;  // 16 rows x 16 chunks of 8 columns
    const int row = warp_row0 + chunk / 16, col = (chunk % 16) * 8;
    if (u0 + row < T) {
      const uint4 values =
          *reinterpret_cast<const uint4*>(smem + kOutOffset<kFp8> + staged(row, col));
      *reinterpret_cast<uint4*>(out + row * out_stride + col) = values;
      if (p.codes != nullptr) {
        uint8_t* const codes = p.codes + out_offset + row * out_stride + col;
        code_amax =
            max(code_amax, p.codes_e5m2 ? store_fp8<DType::E5M2>(codes, values, code_scale)
                                        : store_fp8<DType::E4M3>(codes, values, code_scale));
      }
    }
  }
  // One atomic a warp (the CTA's two consumer warpgroups never meet again).
  if (p.code_amax != nullptr) {
    code_amax = warp_reduce_max(code_amax);
    if (lane == 0 && code_amax != 0) atomicMax(p.code_amax, code_amax);
  }
#else
  __trap();  // compiled without sm_90a; attention_hopper_available() said no
#endif
}

}  // namespace

bool attention_hopper_available(int64_t head_dim, int device) {
  return head_dim == kD && hopper::runs_on(device);
}

namespace {

template <bool kFp8>
void launch_forward(const CUtensorMap& q_map, const CUtensorMap& kv_map, const CUtensorMap& vt_map,
                    const AttentionForwardParams& p, cudaStream_t stream) {
  // Per device, and cheap: set on every launch as attention.cu's kernels do.
  TS_CUDA_CHECK(cudaFuncSetAttribute(attention_forward_hopper_kernel<kFp8>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(kSmemBytes<kFp8>)));
  const dim3 grid((p.seq + kBlockM - 1) / kBlockM, p.heads, p.batch);
  attention_forward_hopper_kernel<kFp8>
      <<<grid, kThreads, kSmemBytes<kFp8>, stream>>>(q_map, kv_map, vt_map, p);
  TS_CUDA_CHECK_LAUNCH("attention_forward_hopper_kernel");
}

}  // namespace

void attention_forward_hopper(const AttentionForwardParams& p, cudaStream_t stream) {
  // This segment's queries (batch planes); the keys and values of every segment (segments x
  // batch planes under context parallelism).
  const CUtensorMap q_map = row_map(p.qkv, p.width, p.seq, p.batch, kBlockN);
  const CUtensorMap kv_map =
      row_map(p.kv, p.kv_width, p.seq, int64_t{p.batch} * std::max(p.segments, 1), kBlockN);
  launch_forward<false>(q_map, kv_map, kv_map, p, stream);
}

void attention_forward_hopper_fp8(const AttentionForwardParams& p,
                                  const Fp8AttentionOperands& codes, cudaStream_t stream) {
  const int64_t width = int64_t{p.heads + p.kv_heads} * kD;
  const CUtensorMap qk_map = codes_map(codes.qk, width, p.seq, p.batch, kBlockN);
  const CUtensorMap vt_map =
      codes_map(codes.vt, codes.padded_seq, kD, int64_t{p.batch} * p.kv_heads, kBlockN);
  AttentionForwardParams q = p;
  q.kv_col = static_cast<int>(p.heads * kD);  // the key heads follow the query heads
  q.descales = codes.descales;
  q.tiles = codes.tiles;
  launch_forward<true>(qk_map, qk_map, vt_map, q, stream);
}

}  // namespace tessera::cuda
