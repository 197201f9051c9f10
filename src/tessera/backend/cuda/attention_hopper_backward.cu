// Flash-attention backward for Hopper (sm_90a, head_dim 128): dK and dV of one block of 128
// keys per CTA, dQ added to an fp32 buffer, in FlashAttention-3's structure. A producer
// warpgroup loads the block's K and V once (TMA), then for every query head of the GQA group
// and every query tile of 64 rows that sees a key of the block, Q and dO (TMA) and lse2 and
// delta (plain loads) into a two-stage ring; a second producer warp adds each tile's dQ to an
// fp32 buffer with TMA reductions. Two consumer warpgroups own 64 keys each and per query tile
// run, as warpgroup MMAs:
//   S^T = K Q^T, dP^T = V dO^T          (64 keys x 64 queries, shared x shared)
//   P^T = exp2(S^T scale log2e - lse2), dS^T = P^T (dP^T - delta)     (registers)
//   dV += P^T dO, dK += dS^T Q          (64 keys x 128, P^T and dS^T straight from registers;
//                                        dV issued once P^T is known, so it runs while dP^T
//                                        finishes and dS^T is formed)
//   dQ[:, 64 w .. 64 w + 63] = dS K     (dS^T of both warpgroups through shared memory)
// and hand their half of dQ to the reducing warp through shared memory (so the sum over key
// blocks varies in order run to run, as in FlashAttention and cuDNN's default; attention.cu's
// deterministic mode stays on its own kernels). dS^T is double-buffered, so one barrier
// between the consumer warpgroups per tile suffices (both halves written before dQ reads
// them). The transposed S^T and dP^T are what let P and dS feed dV and dK without a trip
// through shared memory. dK, dV stay in registers for the whole group, so GQA's sum over query
// heads is exact and needs no scratch.
//
// Masks are the forward's (attention_common.cuh) seen from the key side: query tiles with no
// visible pair are never visited, element masks only where a tile holds an invisible pair.
// Under context parallelism (p.segments > 1) a CTA owns a block of keys of any rank, found by
// position in the gathered keys and values (p.kv), and visits this rank's query tiles that see
// it; its dK and dV go to that rank's rows of p.dkv, for the reduce-scatter.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "tessera/backend/cuda/attention_common.cuh"
#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/hopper_ptx.cuh"

namespace tessera::cuda {

namespace {

using namespace hopper;

constexpr int kD = 128;
constexpr int kBlockN = 128;  // keys per CTA: 64 per consumer warpgroup
constexpr int kBlockM = 64;   // query rows per tile
constexpr int kStages = 2;
constexpr int kThreads = 384;  // warpgroup 0 produces, 1 and 2 consume
constexpr int kConsumerThreads = 256;
constexpr int kConsumerWarps = 8;
constexpr uint32_t kKVBytes = kBlockN * kD * 2;  // K or V: 32 KiB, two 64-column blocks
constexpr uint32_t kQBytes = kBlockM * kD * 2;   // a Q or dO stage: 16 KiB
constexpr uint32_t kQBlockBytes = kBlockM * 128;  // one 64-column block of a Q or dO stage
constexpr uint32_t kKVBlockBytes = kBlockN * 128;
// Shared memory from a 1024-byte aligned base.
constexpr uint32_t kKOffset = 0;
constexpr uint32_t kVOffset = kKOffset + kKVBytes;
constexpr uint32_t kQOffset = kVOffset + kKVBytes;
constexpr uint32_t kDOOffset = kQOffset + kStages * kQBytes;
constexpr uint32_t kDSBytes = kBlockN * kBlockM * 2;  // dS^T: 128 keys x 64 queries, bf16
constexpr uint32_t kDSOffset = kDOOffset + kStages * kQBytes;  // two buffers
// dQ of a tile, fp32, per consumer warpgroup: 64 rows x its 64 columns as two 32-column boxes
// of the reduction's tensor map (128-byte swizzled rows).
constexpr uint32_t kDQBoxBytes = kBlockM * 128;
constexpr uint32_t kDQOffset = kDSOffset + 2 * kDSBytes;
constexpr uint32_t kStatsOffset = kDQOffset + 2 * 2 * kDQBoxBytes;  // lse2, delta per stage
constexpr uint32_t kBarrierOffset = kStatsOffset + kStages * 2 * kBlockM * 4;
// 9 barriers, then (from byte 80) the block's document facts; alignment slack.
constexpr size_t kSmemBytes = kBarrierOffset + 128 + 1024;
// The loading warp's 32 lanes publish lse2 and delta, its first lane also the TMA bytes: 33
// arrivals complete a stage.
constexpr uint32_t kStageArrivals = 33;
constexpr int kBarrierDsWritten = 1;  // named barrier of the consumers

// An operand's descriptor `bytes` further on (a later k-step or stage): the byte offset >> 4
// added to the start-address field (bits 0-13), which never carries (shared memory is below
// 256 KiB), so a tile's descriptors cost one addition of a constant each.
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

// A 64 x 64 accumulator (keys x queries: P^T or dS^T) as the A fragments of the four k-steps
// of an MMA that sums over its queries: queries 16 kq .. 16 kq + 15 are chunks 2 kq, 2 kq + 1.
__device__ __forceinline__ void to_a_fragments(uint32_t (&a)[4][4], const float (&x)[32]) {
#pragma unroll
  for (int kq = 0; kq < 4; ++kq) {
#pragma unroll
    for (int q = 0; q < 4; ++q) a[kq][q] = pack_bf16(x[8 * kq + 2 * q], x[8 * kq + 2 * q + 1]);
  }
}

// d (64 keys x 128) += A (64 keys x 64 queries, registers) B (the tile's 64 queries of Q or
// dO, read MN-major: descriptor b of the first stage, the stage `stage` bytes on), issued as
// one group.
__device__ __forceinline__ void accumulate_over_queries(float (&d)[64], const uint32_t (&a)[4][4], uint64_t b,
                                                        uint32_t stage) {
  wgmma_fence();
#pragma unroll
  for (int kq = 0; kq < kBlockM / 16; ++kq) wgmma_m64n128_rs(d, a[kq], desc_at(b, stage + kq * 16 * 128));
  wgmma_commit();
}

__global__ void __launch_bounds__(kThreads, 1)
    attention_backward_hopper_kernel(const __grid_constant__ CUtensorMap q_map,
                                     const __grid_constant__ CUtensorMap kv_map,
                                     const __grid_constant__ CUtensorMap dout_map,
                                     const __grid_constant__ CUtensorMap dq_map,
                                     const AttentionBackwardParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* const smem = smem_raw + (base - raw);
  const uint32_t sK = base + kKOffset, sV = base + kVOffset;
  auto sDS = [&](int it) { return base + kDSOffset + (it & 1) * kDSBytes; };
  auto sDQ = [&](int w) { return base + kDQOffset + w * 2 * kDQBoxBytes; };
  auto sQ = [&](int s) { return base + kQOffset + s * kQBytes; };
  auto sDO = [&](int s) { return base + kDOOffset + s * kQBytes; };
  float* const stats = reinterpret_cast<float*>(smem + kStatsOffset);  // [stage][lse2 | delta][64]
  const uint32_t bars = base + kBarrierOffset;
  const uint32_t full_kv = bars;
  auto full_q = [&](int s) { return bars + 8 + 8 * s; };
  auto empty_q = [&](int s) { return bars + 24 + 8 * s; };
  auto dq_full = [&](int w) { return bars + 40 + 8 * w; };   // a warpgroup's dQ is staged
  auto dq_empty = [&](int w) { return bars + 56 + 8 * w; };  // the reduction has read it

  const int T = p.seq;  // this segment's rows: queries, dO, dQ
  const ContextSegments cs = context_segments(p.segments, p.segment, T);
  const int Tk = cs.keys(T);  // the keys: every segment's, by position
  const auto [n_tile, kvh, b] = grid_key_block((Tk + kBlockN - 1) / kBlockN, p.kv_heads);
  const int k0 = n_tile * kBlockN;  // positions
  const int k_last = min(k0 + kBlockN, Tk) - 1;
  const int2 k_row = cs.row_of(k0);  // the segment and row holding the block
  // The document starts by position, over the whole sequence.
  const int32_t* const starts =
      p.document_starts ? p.document_starts + static_cast<int64_t>(b) * Tk : nullptr;
  // Query tiles are this segment's rows (64 each), in increasing position.
  const int m_begin = p.causal ? cs.first_row_from(k0, T) / kBlockM : 0;

  // Packed documents: which of the block's keys start a document (a 128-bit mask, from one
  // coalesced load) and where the document of its last key ends (a warp's 32-way search):
  // every key's document end follows, without a bisection of dependent loads per thread.
  int* const documents = reinterpret_cast<int*>(smem + kBarrierOffset + 80);  // mask words, end
  if (starts != nullptr) {
    if (threadIdx.x < kBlockN) {
      const int i = k0 + static_cast<int>(threadIdx.x);
      const unsigned mask = __ballot_sync(0xffffffffu, i > k0 && i < Tk && starts[i] == i);
      if (threadIdx.x % 32 == 0) documents[threadIdx.x / 32] = static_cast<int>(mask);
    } else if (threadIdx.x < kBlockN + 32) {
      const int end = document_end_warp(starts, k_last, Tk);
      if (threadIdx.x == kBlockN) documents[4] = end;
    }
  }
  if (threadIdx.x == 0) {
    mbar_init(full_kv, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_q(s), kStageArrivals);
      mbar_init(empty_q(s), kConsumerWarps);
    }
    for (int w = 0; w < 2; ++w) {
      mbar_init(dq_full(w), 128);
      mbar_init(dq_empty(w), 1);
    }
    mbar_init_fence();
  }
  __syncthreads();
  // One past the last query of key j's document (j a key of the block): the next document start
  // after j among the block's keys, else after its last key.
  auto key_document_end = [&](int j) {
    if (starts == nullptr) return Tk;
    const int at = j - k0;
    for (int w = at / 32; w < kBlockN / 32; ++w) {
      unsigned later = static_cast<unsigned>(documents[w]);
      if (w == at / 32) later &= at % 32 == 31 ? 0u : ~0u << (at % 32 + 1);
      if (later != 0) return k0 + 32 * w + __ffs(static_cast<int>(later)) - 1;
    }
    return documents[4];
  };
  // Queries that see a key of the block: up to the last key's window edge and document end.
  const int q_end = min(p.window > 0 ? min(Tk, k_last + p.window) : Tk, key_document_end(k_last));
  const int m_count = (cs.first_row_from(q_end, T) + kBlockM - 1) / kBlockM - m_begin;
  const int iters = p.group * m_count;

  const int warp_group = threadIdx.x / 128;
  if (warp_group == 0) {
    release_registers<24>();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 0) {  // loads: K and V once, then Q, dO, lse2, delta per tile
      if (lane == 0) {
        const int k_col = p.kv_col + kvh * kD, v_col = p.kv_col + (p.kv_heads + kvh) * kD;
        mbar_expect_tx(full_kv, 2 * kKVBytes);
        for (int half = 0; half < 2; ++half) {
          for (int rows = 0; rows < 2; ++rows) {
            const uint32_t at = half * kKVBlockBytes + rows * kQBlockBytes;
            const int row = k_row.x + kBlockM * rows, plane = k_row.y * p.batch + b;
            tma_load(sK + at, &kv_map, full_kv, k_col + 64 * half, row, plane);
            tma_load(sV + at, &kv_map, full_kv, v_col + 64 * half, row, plane);
          }
        }
      }
      for (int it = 0; it < iters; ++it) {
        const int s = it % kStages;
        const int h = kvh * p.group + it / m_count;
        const int m0 = (m_begin + it % m_count) * kBlockM;
        mbar_wait(empty_q(s), ((it / kStages) & 1) ^ 1);
        if (lane == 0) {
          mbar_expect_tx(full_q(s), 2 * kQBytes);
          for (int half = 0; half < 2; ++half) {
            tma_load(sQ(s) + half * kQBlockBytes, &q_map, full_q(s), h * kD + 64 * half, m0, b);
            tma_load(sDO(s) + half * kQBlockBytes, &dout_map, full_q(s), h * kD + 64 * half, m0, b);
          }
        }
        // lse2 and delta of the tile's rows; rows past T read as 0 (their Q and dO are zeros
        // too, so they contribute nothing).
        const int64_t stat_row = (static_cast<int64_t>(b) * p.heads + h) * T;
        for (int k = lane; k < 2 * kBlockM; k += 32) {
          const int row = m0 + k % kBlockM;
          const float* const src = k < kBlockM ? p.lse2 : p.delta;
          stats[s * 2 * kBlockM + k] = row < T ? src[stat_row + row] : 0.f;
        }
        mbar_arrive(full_q(s));
      }
    } else if (warp == 1 && lane == 0) {  // reduces each consumer warpgroup's dQ into dq_accum
      for (int it = 0; it < iters; ++it) {
        const int h = kvh * p.group + it / m_count;
        const int m0 = (m_begin + it % m_count) * kBlockM;
        for (int w = 0; w < 2; ++w) {
          mbar_wait(dq_full(w), it & 1);
          for (int box = 0; box < 2; ++box) {
            tma_reduce_add(&dq_map, sDQ(w) + box * kDQBoxBytes, h * kD + 64 * w + 32 * box, m0, b);
          }
          bulk_commit();
        }
        for (int w = 0; w < 2; ++w) {
          bulk_wait_read();
          mbar_arrive(dq_empty(w));
        }
      }
      bulk_wait();
    }
    return;
  }
  claim_registers<240>();

  // Broadcast from lane 0 so that the compiler knows the warpgroup is warp-uniform: what is
  // derived from it (the descriptors) then lives in uniform registers.
  const int consumer = __shfl_sync(0xffffffffu, warp_group - 1, 0);
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int key_row0 = consumer * 64 + warp * 16 + g;  // this thread's first key in the block
  const bool arrives = lane == 0;

  // Each operand's descriptor at its first k-step and stage (later ones: desc_at).
  // S^T = K Q^T, dP^T = V dO^T: A = this warpgroup's 64 keys of K or V, B = the Q or dO tile,
  // both K-major; k-step kk = columns 16 kk.. of 64-column block kk / 4.
  auto k_step = [](int kk, uint32_t block_bytes) { return (kk / 4) * block_bytes + (kk % 4) * 32; };
  const uint64_t k_desc = smem_desc(sK + consumer * kQBlockBytes, 16, 1024);
  const uint64_t v_desc = smem_desc(sV + consumer * kQBlockBytes, 16, 1024);
  const uint64_t q_desc = smem_desc(sQ(0), 16, 1024);
  const uint64_t do_desc = smem_desc(sDO(0), 16, 1024);
  // dV += P^T dO, dK += dS^T Q: B = dO or Q read MN-major; k-step kq = query rows 16 kq...
  const uint64_t q_mn_desc = smem_desc(sQ(0), kQBlockBytes, 1024);
  const uint64_t do_mn_desc = smem_desc(sDO(0), kQBlockBytes, 1024);
  // dQ = dS K: A = dS^T read MN-major (rows are keys), B = K's 64-column block of this
  // warpgroup read MN-major; k-step kk = keys 16 kk...
  const uint64_t ds_desc = smem_desc(sDS(0), kQBlockBytes, 1024);
  const uint64_t k_mn_desc = smem_desc(sK + consumer * kKVBlockBytes, kKVBlockBytes, 1024);

  // The queries this thread's keys see, [lo, lo + span), empty for a key past T. A tile takes
  // element masks only where it holds an invisible pair for a key of this warpgroup; the
  // bounds run monotonically with the key, so the warpgroup's first and last keys decide.
  int lo[2], span[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = k0 + key_row0 + 8 * r;
    lo[r] = p.causal ? j : 0;
    const int hi = min(p.window > 0 ? min(Tk, j + p.window) : Tk, key_document_end(min(j, k_last)));
    span[r] = j < Tk ? hi - lo[r] : 0;
  }
  const int wg_key0 = k0 + consumer * 64;
  const int interior_first = p.causal ? wg_key0 + 63 : 0;  // masks below this query
  const int interior_end = wg_key0 + 64 > Tk ? -1
                           : min(p.window > 0 ? min(Tk, wg_key0 + p.window) : Tk,
                                 key_document_end(wg_key0));  // and from this one on
  // Per-thread bases of the swizzled stores (hopper_ptx.cuh): a row's 16-byte chunk c lands
  // at c ^ (row % 8), and row % 8 = g here, so chunk c of a row is the base XOR (c << 4).
  // dS^T (128 keys x 64 queries, bf16): key rows key_row0 (+ 8), queries 16 kq + 8 h + 2 t.
  const uint32_t ds_store = static_cast<uint32_t>(key_row0 * 128 + (g << 4) + 4 * t);
  // dQ staging (64 query rows x this warpgroup's 64 columns as two 32-column fp32 boxes): rows
  // 16 warp + g (+ 8), columns 8 c + 2 t: chunk 2 (c % 4) + t / 2 of box c / 4.
  // A half-warp's rows g and g ^ 1 would put their 8-byte stores on one pair of chunks (two
  // passes): odd rows store 8-column block c ^ 2 where even rows store c, so the four rows of a
  // half-warp cover all eight chunks.
  const bool odd_row = (g & 1) != 0;
  const uint32_t dq_store = static_cast<uint32_t>((warp * 16 + g) * 128 + (((t / 2) ^ g ^ (odd_row ? 4 : 0)) << 4) + (t % 2) * 8);
  uint8_t* const dq_tile = smem + kDQOffset + consumer * 2 * kDQBoxBytes;

  float dk[64], dv[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.f;

  mbar_wait(full_kv, 0);
  const int m_first = m_begin * kBlockM, m_end = (m_begin + m_count) * kBlockM;
  int m0 = m_first;
  for (int it = 0; it < iters; ++it) {
    const int s = it % kStages;
    const uint32_t stage = s * kQBytes, ds_buffer = (it & 1) * kDSBytes;
    const int g0 = cs.position(m0);  // the tile's first query's position
    mbar_wait(full_q(s), (it / kStages) & 1);

    float st[32], dpt[32];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      wgmma_m64n64_ss<0, 0>(st, desc_at(k_desc, k_step(kk, kKVBlockBytes)),
                            desc_at(q_desc, stage + k_step(kk, kQBlockBytes)), kk > 0);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      wgmma_m64n64_ss<0, 0>(dpt, desc_at(v_desc, k_step(kk, kKVBlockBytes)),
                            desc_at(do_desc, stage + k_step(kk, kQBlockBytes)), kk > 0);
    }
    wgmma_commit();

    // P^T while dP^T is still in flight. Element (r, c, e): key key_row0 + 8 r of the block,
    // query m0 + 8 c + 2 t + e.
    const float* const lse2 = stats + (s * 2) * kBlockM;
    const float* const delta = lse2 + kBlockM;
    wgmma_wait<1>();
    fence_accumulators(st);
#pragma unroll
    for (int c = 0; c < 8; ++c) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float l2 = lse2[8 * c + 2 * t + e];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          st[4 * c + 2 * r + e] = fast_exp2(fmaf(st[4 * c + 2 * r + e], p.scale_log2, -l2));
        }
      }
    }
    if (g0 < interior_first || g0 + kBlockM > interior_end) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int first = g0 + 2 * t - lo[r];
#pragma unroll
        for (int c = 0; c < 8; ++c) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (static_cast<unsigned>(first + 8 * c + e) >= static_cast<unsigned>(span[r])) {
              st[4 * c + 2 * r + e] = 0.f;
            }
          }
        }
      }
    }
    // dV += P^T dO runs while dP^T finishes and dS^T is formed.
    uint32_t pa[4][4], dsa[4][4];
    to_a_fragments(pa, st);
    accumulate_over_queries(dv, pa, do_mn_desc, stage);
    wgmma_wait<1>();
    fence_accumulators(dpt);
#pragma unroll
    for (int c = 0; c < 8; ++c) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float dl = delta[8 * c + 2 * t + e];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          dpt[4 * c + 2 * r + e] = st[4 * c + 2 * r + e] * (dpt[4 * c + 2 * r + e] - dl);
        }
      }
    }
    to_a_fragments(dsa, dpt);
    accumulate_over_queries(dk, dsa, q_mn_desc, stage);

    // dS^T to shared memory (the buffer's previous tile, two back, was read before both
    // warpgroups passed the last tile's barrier), then dQ once both halves are there.
    uint8_t* const ds_tile = smem + kDSOffset + ds_buffer;
#pragma unroll
    for (int kq = 0; kq < 4; ++kq) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // dsa[kq][2 h + r]: key row key_row0 + 8 r, queries 16 kq + 8 h + 2 t (+1).
        const uint32_t chunk = ds_store ^ ((2 * kq + h) << 4);
        *reinterpret_cast<uint32_t*>(ds_tile + chunk) = dsa[kq][2 * h];
        *reinterpret_cast<uint32_t*>(ds_tile + chunk + 8 * 128) = dsa[kq][2 * h + 1];
      }
    }
    fence_async_shared();
    named_barrier(kBarrierDsWritten, kConsumerThreads);
    float dq[32];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      wgmma_m64n64_ss<1, 1>(dq, desc_at(ds_desc, ds_buffer + kk * 16 * 128), desc_at(k_mn_desc, kk * 16 * 128), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulators(dq);
    fence_accumulators(dk);
    fence_accumulators(dv);
    if (arrives) mbar_arrive(empty_q(s));

    // This warpgroup's 64 columns of dQ to its staging boxes, once the reduction has read the
    // previous tile's.
    mbar_wait(dq_empty(consumer), (it & 1) ^ 1);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const uint32_t at_chunk = (dq_store ^ ((2 * (c % 4)) << 4)) + (c / 4) * kDQBoxBytes + r * 8 * 128;
        *reinterpret_cast<float2*>(dq_tile + at_chunk) =
            odd_row ? make_float2(dq[4 * (c ^ 2) + 2 * r], dq[4 * (c ^ 2) + 2 * r + 1])
                    : make_float2(dq[4 * c + 2 * r], dq[4 * c + 2 * r + 1]);
      }
    }
    fence_async_shared();
    mbar_arrive(dq_full(consumer));
    m0 = m0 + kBlockM == m_end ? m_first : m0 + kBlockM;
  }

  // dK (times the softmax scale, which S^T's exponent carried but dS^T Q does not) and dV.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = k0 + key_row0 + 8 * r;
    if (j >= Tk) continue;
    const int64_t plane = static_cast<int64_t>(k_row.y) * p.batch + b;
    bf16* const row = p.dkv + (plane * T + k_row.x + key_row0 + 8 * r) * p.kv_width + p.kv_col;
    bf16* const dk_row = row + static_cast<int64_t>(kvh) * kD;
    bf16* const dv_row = row + static_cast<int64_t>(p.kv_heads + kvh) * kD;
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      const int col = 8 * c + 2 * t;
      *reinterpret_cast<uint32_t*>(dk_row + col) =
          pack_bf16(dk[4 * c + 2 * r] * p.scale, dk[4 * c + 2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(dv_row + col) = pack_bf16(dv[4 * c + 2 * r], dv[4 * c + 2 * r + 1]);
    }
  }
#else
  __trap();  // compiled without sm_90a; attention_hopper_available() said no
#endif
}

}  // namespace

void attention_backward_hopper(const AttentionBackwardParams& p, cudaStream_t stream) {
  // This segment's queries and dO (batch planes); the keys and values of every segment
  // (segments x batch planes under context parallelism).
  const int segments = std::max(p.segments, 1);
  const CUtensorMap q_map = row_map(p.qkv, p.width, p.seq, p.batch, kBlockM);
  const CUtensorMap kv_map = row_map(p.kv, p.kv_width, p.seq, int64_t{p.batch} * segments, kBlockM);
  const int64_t dout_width = int64_t{p.heads} * kD;
  const CUtensorMap dout_map = row_map(p.dout, dout_width, p.seq, p.batch, kBlockM);
  // dq_accum (B, T, H D) fp32, boxes of 64 rows x 32 columns.
  const uint64_t dq_dims[3] = {static_cast<uint64_t>(dout_width), static_cast<uint64_t>(p.seq),
                               static_cast<uint64_t>(p.batch)};
  const uint64_t dq_strides[2] = {static_cast<uint64_t>(dout_width) * 4,
                                  static_cast<uint64_t>(dout_width) * 4 * static_cast<uint64_t>(p.seq)};
  const uint32_t dq_box[3] = {32, kBlockM, 1};
  const CUtensorMap dq_map = tensor_map(p.dq_accum, 4, dq_dims, dq_strides, dq_box);
  TS_CUDA_CHECK(cudaFuncSetAttribute(attention_backward_hopper_kernel,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(kSmemBytes)));
  const int64_t keys = static_cast<int64_t>(p.seq) * segments;
  const dim3 grid = heaviest_first_grid((keys + kBlockN - 1) / kBlockN, p.kv_heads, p.batch);
  attention_backward_hopper_kernel<<<grid, kThreads, kSmemBytes, stream>>>(q_map, kv_map,
                                                                            dout_map, dq_map, p);
  TS_CUDA_CHECK_LAUNCH("attention_backward_hopper_kernel");
}

}  // namespace tessera::cuda
