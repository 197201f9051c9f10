// Fused flash attention for Hopper (sm_90a): the FlashAttention-2 algorithm on warp-level
// tensor-core MMAs (mma.sync m16n8k16, bf16 operands, fp32 accumulators), cp.async double
// buffering and swizzled shared memory.
//
// These are the kernels of every architecture the build targets and of head_dim 64; on sm_90a
// at head_dim 128 the entry points below hand the forward and the default (atomic-dQ)
// backward to the warpgroup kernels of attention_hopper.cu and attention_hopper_backward.cu,
// about twice as fast. The deterministic dQ kernel stays here.
//
// Kernels (grid order: the heaviest tiles under a causal mask start first;
// heaviest_first_grid in attention_common.cuh says why the key-block kernels order them over
// all heads):
//   attention_forward_kernel              CTA = 128 query rows of one (batch, head); loops
//                                         over the visible 64- (or 32-) key tiles; online
//                                         softmax.
//   attention_backward_preprocess_kernel  delta = rowsum(dout * out), lse2 = lse * log2(e).
//   attention_backward_dkdv_kernel        CTA = 128 keys of one (batch, kv head); loops over
//                                         every query head of its group and every visible
//                                         64-row query tile; dK, dV stay in registers, so
//                                         the GQA sum is deterministic and needs no scratch.
//   attention_backward_dq_kernel          CTA = 128 query rows; loops over key tiles (the
//                                         deterministic dQ, AttentionOptions::deterministic).
//   attention_backward_dq_convert_kernel  fp32 atomic dQ accumulator -> bf16 (the other mode).
//
// Masking. Query i sees key j iff j < T, j <= i when causal, j > i - window when window > 0,
// and, for packed documents (causal), j >= start[i], the first token of i's document. Every
// row sees at least itself, so no valid row is ever empty. Each kernel computes the tile
// range that contains visible pairs and never visits the rest (for the window, key tiles
// below q0 - window + 1; for documents, key tiles below the first row's document and query
// tiles past the last key's document; for causal, key tiles past the last row), so packed
// documents cost the visible pairs, not the whole triangle;
// element masks are applied only on tiles where some pair of the tile is invisible or out
// of range (the `boundary` flags below), so interior tiles pay nothing for masking.
#include "tessera/backend/cuda/attention.cuh"
#include "tessera/backend/cuda/attention_common.cuh"

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/error.h"

namespace tessera::cuda {

namespace {

// ---- PTX wrappers ----

// 16-byte global->shared copy that bypasses L1; src_size 0 zero-fills (rows past T), so the
// tile math never sees garbage and never needs a separate zeroing pass.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ldmatrix x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; register i receives
// matrix i with lane l holding row l/4, columns 2(l%4), 2(l%4)+1 (transposed with .trans).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// c += a * b for one 16x8x16 tile. Fragments (g = lane/4, t = lane%4):
//   a[0] = A[g][2t..2t+1]  a[1] = A[g+8][2t..]  a[2] = A[g][2t+8..]  a[3] = A[g+8][2t+8..]
//   b0 = B[2t..2t+1][g]    b1 = B[2t+8..2t+9][g]
//   c[0..1] = C[g][2t..2t+1]   c[2..3] = C[g+8][2t..2t+1]
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- end of PTX wrappers ----

// bf16 -> fp32 is a 16-bit shift: the low and high element of a bf16x2 word.
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// An A fragment of the next GEMM from two C fragments of this one (C columns 16kk..16kk+15
// become A columns 0..15): how P and dS feed the MMA without leaving registers.
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4],
                                       const float (&c1)[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

// ---- shared-memory tiles ----
//
// A tile row of kCols bf16 is kCols/8 16-byte chunks (8 or 16 for D = 64, 128; 8 for the
// 64-column dS tile). ldmatrix reads one chunk column of 8 consecutive rows; unswizzled, rows
// 128 or 256 bytes apart hit the same 4 banks (8-way conflict). Storing logical chunk c of
// row r at chunk c ^ (r % 8) puts those 8 reads in 8 different bank groups; cp.async writes
// (consecutive chunks of a row) and the epilogue's fragment stores stay conflict-free too.
// Every tile starts at a 128-byte aligned shared address (the kernels align the dynamic
// base themselves), so the XOR can be applied to absolute addresses below.
template <int kCols>
__device__ __forceinline__ uint32_t swizzle(int row, int col) {
  static_assert(kCols % 64 == 0, "swizzle needs rows of at least 8 chunks");
  return static_cast<uint32_t>(row * kCols * 2 + ((((col >> 3) ^ (row & 7))) << 4) +
                               ((col & 7) << 1));
}

// ldmatrix x4 addresses. A 16x16 block is four 8x8 matrices; the lanes name their rows in
// one of two orders:
//   kRowMajor16: lanes 0-15 rows 0-15 of chunk 0, lanes 16-31 rows 0-15 of chunk 1
//                (A from [m][k]; B from [k][n] with .trans)
//   kRowPairs8:  lanes 0-7 rows 0-7 chunk 0, 8-15 rows 0-7 chunk 1, 16-23 rows 8-15 chunk 0,
//                24-31 rows 8-15 chunk 1 (B from [n][k]; A from [k][m] with .trans)
// With r = the lane's row in the block and b its chunk bit, the block at (row0, chunk pair
// cp) of a swizzled tile is at row0 * rowbytes + (r * rowbytes + 16 ((2 cp + b) ^ (r % 8))).
// Since row0 % 8 == 0, the XOR splits: bit 0 = b ^ r0, bits 1-2 = cp ^ (r >> 1), bit 3 = cp's
// bit 2. So each lane keeps one base = tile + r * rowbytes + 16 (b ^ r0) + 32 ((r >> 1) & 3)
// and a block address is (base ^ 32 (cp & 3)) + 128 (cp >> 2) + row0 * rowbytes: one LOP3
// and an immediate instead of a register per block.
enum class LdsmOrder { kRowMajor16, kRowPairs8 };

template <int kCols, LdsmOrder kOrder>
__device__ __forceinline__ uint32_t ldsm_base(uint32_t tile, int lane) {
  const int r = kOrder == LdsmOrder::kRowMajor16 ? (lane & 15) : (lane & 7) + ((lane >> 4) << 3);
  const int b = kOrder == LdsmOrder::kRowMajor16 ? (lane >> 4) : ((lane >> 3) & 1);
  return tile + static_cast<uint32_t>(r * kCols * 2 + ((b ^ (r & 1)) << 4) + (((r >> 1) & 3) << 5));
}

// The 16x16 block whose first row is row0 (a multiple of 16) and first column 16 * cp.
template <int kCols>
__device__ __forceinline__ uint32_t ldsm_block(uint32_t base, int row0, int cp) {
  return (base ^ static_cast<uint32_t>((cp & 3) << 5)) +
         static_cast<uint32_t>(row0 * kCols * 2 + ((cp >> 2) << 7));
}

// The dynamic shared-memory base rounded up to 128 bytes (launches ask for 128 extra bytes).
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw) {
  const uint32_t a = smem_addr(raw);
  return raw + (((a + 127u) & ~127u) - a);
}
constexpr size_t kSmemAlignSlack = 128;

// Ask for the tile rows [0, kRows) of a row-major global matrix (row stride `stride`
// elements); rows >= rows_valid are zero-filled. Consecutive threads take consecutive
// 16-byte chunks, so each row is one coalesced 128/256-byte segment.
template <int kRows, int kCols, int kThreads>
__device__ __forceinline__ void load_tile(uint32_t dst, const bf16* src, int64_t stride,
                                          int rows_valid, int tid) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "tile must split evenly over the threads");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = tid + i * kThreads;
    const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    const bool valid = row < rows_valid;
    cp_async_16(dst + swizzle<kCols>(row, col), src + (valid ? row : 0) * stride + col, valid);
  }
}

// Copy kRows tile rows (bf16, swizzled) starting at tile row `row0` to global rows
// dst + r * stride, skipping rows r >= rows_valid; 16-byte coalesced stores. Called by one
// warp on rows only it wrote, so a __syncwarp before it is enough.
template <int kRows, int kCols>
__device__ __forceinline__ void store_rows(bf16* dst, int64_t stride, const uint8_t* tile,
                                           int row0, int rows_valid, int lane) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % 32 == 0, "rows must split evenly over a warp");
#pragma unroll
  for (int i = 0; i < kChunks / 32; ++i) {
    const int c = lane + i * 32;
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    if (r < rows_valid) {
      *reinterpret_cast<uint4*>(dst + r * stride + col) =
          *reinterpret_cast<const uint4*>(tile + swizzle<kCols>(row0 + r, col));
    }
  }
}

__device__ __forceinline__ void store_pair(uint8_t* tile_byte, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(tile_byte) = pack_bf16(lo, hi);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Forward. CTA: kBlockM = 128 query rows of one (b, h), kWarps warps owning kBlockM/kWarps
// consecutive rows each. Per key tile (kBlockN = 64 or 32 keys): S = Q K^T in registers, mask if
// boundary, online softmax (fp32, exp2 of log2(e)-prescaled scores), O += P V with P fed
// from the S registers. Shared memory: Q (kept for the whole loop, re-read per tile with
// ldmatrix: at D = 128 the 32-row warp's Q fragments would cost 64 more registers) and two
// stages of K and V; the copy of tile n+1 runs while tile n is computed.
//   D=128, 4 warps: Q 32 KB + K 2x16 KB + V 2x16 KB = 96 KB -> 2 CTAs (8 warps) per SM;
//   per thread O 128 + S 64 fp32 registers. 32 rows per warp halve the K/V shared-memory
//   reads per MMA compared with 16 rows (26 vs 16 FLOP per byte), which keeps the 128 B/clk
//   shared-memory port from capping the tensor cores.
// ---------------------------------------------------------------------------------------
template <int kD, int kBlockM, int kBlockN, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 2)
    attention_forward_kernel(const AttentionForwardParams p) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kRows = kBlockM / kWarps;  // query rows per warp
  constexpr int kMT = kRows / 16;          // m16 tiles per warp
  constexpr int kNT = kBlockN / 8;         // n8 tiles of S
  constexpr int kDT = kD / 8;              // n8 tiles of O
  constexpr uint32_t kQBytes = kBlockM * kD * 2, kKVBytes = kBlockN * kD * 2;
  static_assert(kRows % 16 == 0 && kBlockN % 16 == 0 && kD % 64 == 0, "tile shape");

  extern __shared__ uint8_t smem_raw[];
  uint8_t* const sQ = aligned_smem(smem_raw);
  const uint32_t sQa = smem_addr(sQ);
  const uint32_t sKa = sQa + kQBytes;
  const uint32_t sVa = sKa + 2 * kKVBytes;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int T = p.seq;
  const int m_tile = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / p.group;
  const int q0 = m_tile * kBlockM;
  const int q_last = min(q0 + kBlockM, T) - 1;
  const int32_t* const starts = p.document_starts ? p.document_starts + static_cast<int64_t>(b) * T : nullptr;
  const int last_start = document_start(starts, q_last, T);
  // Keys visible from some row of the tile: [max(q0 - window + 1, the first row's document
  // start), q_last] (causal, windowed, packed).
  const int kv_first = max(p.window > 0 ? max(0, q0 - p.window + 1) : 0, document_start(starts, q0, T));
  const int kv_end = p.causal ? q_last + 1 : T;
  const int n_begin = kv_first / kBlockN, n_end = (kv_end + kBlockN - 1) / kBlockN;

  const bf16* const base = p.qkv + static_cast<int64_t>(b) * T * p.width;
  const bf16* const k_g = base + static_cast<int64_t>(p.heads + kvh) * kD;
  const bf16* const v_g = base + static_cast<int64_t>(p.heads + p.kv_heads + kvh) * kD;

  load_tile<kBlockM, kD, kThreads>(sQa, base + static_cast<int64_t>(q0) * p.width + h * kD,
                                   p.width, T - q0, tid);
  {
    const int k0 = n_begin * kBlockN;
    load_tile<kBlockN, kD, kThreads>(sKa, k_g + k0 * p.width, p.width, T - k0, tid);
    load_tile<kBlockN, kD, kThreads>(sVa, v_g + k0 * p.width, p.width, T - k0, tid);
  }
  cp_async_commit();

  const int warp_row0 = warp * kRows;
  const uint32_t q_frag = ldsm_base<kD, LdsmOrder::kRowMajor16>(sQa + warp_row0 * kD * 2, lane);
  const uint32_t k_frag = ldsm_base<kD, LdsmOrder::kRowPairs8>(sKa, lane);
  const uint32_t v_frag = ldsm_base<kD, LdsmOrder::kRowMajor16>(sVa, lane);
  float o[kMT][kDT][4];
  float row_max[kMT][2], row_sum[kMT][2];  // rows g and g + 8 of each m16 tile
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi) {
#pragma unroll
    for (int di = 0; di < kDT; ++di) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mi][di][e] = 0.f;
    }
    row_max[mi][0] = row_max[mi][1] = -INFINITY;
    row_sum[mi][0] = row_sum[mi][1] = 0.f;
  }

  for (int n = n_begin; n < n_end; ++n) {
    const int stage = (n - n_begin) & 1;
    if (n + 1 < n_end) {
      const int k1 = (n + 1) * kBlockN;
      load_tile<kBlockN, kD, kThreads>(sKa + (stage ^ 1) * kKVBytes, k_g + k1 * p.width,
                                       p.width, T - k1, tid);
      load_tile<kBlockN, kD, kThreads>(sVa + (stage ^ 1) * kKVBytes, v_g + k1 * p.width,
                                       p.width, T - k1, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint32_t sK = k_frag + stage * kKVBytes, sV = v_frag + stage * kKVBytes;
    const int k0 = n * kBlockN;

    // S = Q K^T. K tile rows are keys ([n][k] storage), i.e. B in "col" layout: plain ldmatrix.
    float s[kMT][kNT][4];
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi) {
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][ni][e] = 0.f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t qa[kMT][4];
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi) {
        ldsm_x4(qa[mi], ldsm_block<kD>(q_frag, mi * 16, kk));
      }
#pragma unroll
      for (int nj = 0; nj < kNT / 2; ++nj) {
        uint32_t kb[4];
        ldsm_x4(kb, ldsm_block<kD>(sK, nj * 16, kk));
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi) {
          mma_bf16(s[mi][2 * nj], qa[mi], kb[0], kb[1]);
          mma_bf16(s[mi][2 * nj + 1], qa[mi], kb[2], kb[3]);
        }
      }
    }

    // Element masks only where the tile holds an invisible or out-of-range pair: past T, above
    // the diagonal (a key beyond the tile's first row), or left of the band (a key at or below
    // the last row's i - window). Rows past T are never stored; they only must not make NaN.
    const bool boundary = tile_needs_mask(q0, q_last, k0, kBlockN, T, p.causal, p.window, last_start);
    if (boundary) {
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          // Row i sees keys [lo, hi]; compared as column offsets from this thread's first one,
          // so each element costs two compares against a compile-time column.
          const int i = q0 + warp_row0 + mi * 16 + g + 8 * r;
          const int lo = max(p.window > 0 ? i - p.window + 1 : 0, document_start(starts, i, T)) - k0 - 2 * t;
          const int hi = min(p.causal ? i : T - 1, T - 1) - k0 - 2 * t;
#pragma unroll
          for (int ni = 0; ni < kNT; ++ni) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int c = ni * 8 + e;
              if (c < lo || c > hi) s[mi][ni][2 * r + e] = -INFINITY;
            }
          }
        }
      }
    }

    // Online softmax. The max is kept in raw score units and each exponent is one FFMA:
    // exp2(s * scale * log2e - max * scale * log2e). A row with nothing visible so far has
    // max -inf; it uses 0 as the subtrahend so that its exponents are exp2(-inf) = 0, not NaN.
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[mi][r];
#pragma unroll
        for (int ni = 0; ni < kNT; ++ni) {
          mx = fmaxf(mx, fmaxf(s[mi][ni][2 * r], s[mi][ni][2 * r + 1]));
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
        const float alpha = fast_exp2(row_max[mi][r] * p.scale_log2 - m_scaled);
        row_max[mi][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int ni = 0; ni < kNT; ++ni) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = fast_exp2(fmaf(s[mi][ni][2 * r + e], p.scale_log2, -m_scaled));
            s[mi][ni][2 * r + e] = pv;
            sum += pv;
          }
        }
        // Each thread keeps a partial sum over its own columns; alpha is uniform across the
        // quad, so the partials are combined once, after the loop.
        row_sum[mi][r] = row_sum[mi][r] * alpha + sum;
#pragma unroll
        for (int di = 0; di < kDT; ++di) {
          o[mi][di][2 * r] *= alpha;
          o[mi][di][2 * r + 1] *= alpha;
        }
      }
    }

    // O += P V. V rows are keys ([k][n] storage for this GEMM): B fragments need ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t pa[kMT][4];
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi) c_to_a(pa[mi], s[mi][2 * kk], s[mi][2 * kk + 1]);
#pragma unroll
      for (int dj = 0; dj < kD / 16; ++dj) {
        uint32_t vb[4];
        ldsm_x4_trans(vb, ldsm_block<kD>(sV, kk * 16, dj));
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi) {
          mma_bf16(o[mi][2 * dj], pa[mi], vb[0], vb[1]);
          mma_bf16(o[mi][2 * dj + 1], pa[mi], vb[2], vb[3]);
        }
      }
    }
    __syncthreads();  // all warps are done with this stage before it is refilled
  }
  cp_async_wait<0>();  // (only matters if the range were empty; it never is)

  // Epilogue: normalise, write lse, stage O (bf16) into this warp's own Q rows (no other warp
  // reads them) and store 16-byte coalesced rows.
  const int64_t stat_row = (static_cast<int64_t>(b) * p.heads + h) * T;
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[mi][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int row = warp_row0 + mi * 16 + g + 8 * r;
#pragma unroll
      for (int di = 0; di < kDT; ++di) {
        store_pair(sQ + swizzle<kD>(row, di * 8 + 2 * t), o[mi][di][2 * r] * inv,
                   o[mi][di][2 * r + 1] * inv);
      }
      if (t == 0 && q0 + row < T) {
        p.lse[stat_row + q0 + row] =
            l > 0.f ? row_max[mi][r] * p.scale + logf(l) : -INFINITY;
      }
    }
  }
  __syncwarp();
  const int64_t out_stride = static_cast<int64_t>(p.heads) * kD;
  store_rows<kRows, kD>(
      p.out + (static_cast<int64_t>(b) * T + q0 + warp_row0) * out_stride + h * kD, out_stride,
      sQ, warp_row0, T - q0 - warp_row0, lane);
}

// ---------------------------------------------------------------------------------------
// Backward preprocessing: delta_i = dout_i . out_i (the sum_j p_ij dp_ij of the softmax
// gradient) and lse2 = lse * log2(e), both (B, H, T). kD/8 threads per (token, head) row.
// ---------------------------------------------------------------------------------------
template <int kD>
__global__ void attention_backward_preprocess_kernel(const bf16* dout, const bf16* out,
                                                     const float* lse, float* lse2,
                                                     float* delta, int T, int H,
                                                     int64_t rows) {
  constexpr int kLanes = kD / 8;
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes;
  const int part = threadIdx.x % kLanes;
  const bool valid = r < rows;
  float acc = 0.f;
  if (valid) {
    const uint4 a = *reinterpret_cast<const uint4*>(dout + r * kD + part * 8);
    const uint4 c = *reinterpret_cast<const uint4*>(out + r * kD + part * 8);
    const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, cw[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc = fmaf(bf16_lo(aw[i]), bf16_lo(cw[i]), acc);
      acc = fmaf(bf16_hi(aw[i]), bf16_hi(cw[i]), acc);
    }
  }
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (valid && part == 0) {  // r = (b T + t) H + h
    const int64_t h = r % H, bt = r / H, tt = bt % T, bb = bt / T;
    const int64_t idx = (bb * H + h) * T + tt;
    delta[idx] = acc;
    lse2[idx] = lse[idx] * kLog2e;
  }
}

// ---------------------------------------------------------------------------------------
// Backward dK/dV. CTA: kBlockN = 128 keys of one (b, kv head), kBlockN/16 = 8 warps; warp w
// owns keys 16w..16w+15. It computes the transposed tiles S^T = K Q^T and dP^T = V dO^T
// (16 keys x 64 queries per warp), so that P^T and dS^T come out of the MMA with key rows and
// feed dV += P^T dO and dK += dS^T Q straight from registers (FA2 writes P and dS to shared
// memory for this). lse2/delta are per column here and are read from shared memory.
// The loop runs over every query head of the GQA group, then every query tile that sees a
// key of this tile (causal: from the tile's first key; window: up to k_last + window - 1),
// so the group's sum accumulates in registers in a fixed order.
// Shared memory (D=128): K, V 32 KB each (resident), Q, dO 2 stages x 16 KB each, lse2/delta
// 2 x 2 x 256 B, dS^T 16 KB in atomic-dQ mode: 129 / 145 KB -> one CTA (8 warps) per SM.
// Registers: dK, dV 64 + 64, S^T, dP^T 32 + 32 fp32 per thread.
// Atomic-dQ mode: dS^T (bf16) goes to shared memory, then dQ_tile = dS K (64 x D) split over
// the 8 warps (16 rows x D/2 each) is added to an fp32 buffer with 8-byte atomics.
// ---------------------------------------------------------------------------------------
template <int kD, int kBlockN, int kBlockM, bool kAtomicDq>
__global__ void __launch_bounds__(kBlockN / 16 * 32, 1)
    attention_backward_dkdv_kernel(const AttentionBackwardParams p) {
  constexpr int kWarps = kBlockN / 16, kThreads = kWarps * 32;
  constexpr int kMT = kBlockM / 8;  // n8 tiles of S^T (query columns)
  constexpr int kDT = kD / 8;
  constexpr uint32_t kKVBytes = kBlockN * kD * 2, kQBytes = kBlockM * kD * 2;
  constexpr uint32_t kOffV = kKVBytes, kOffQ = 2 * kKVBytes, kOffdO = kOffQ + 2 * kQBytes;
  constexpr uint32_t kOffL = kOffdO + 2 * kQBytes, kOffDelta = kOffL + 2 * kBlockM * 4;
  constexpr uint32_t kOffdS = kOffDelta + 2 * kBlockM * 4;
  static_assert(2 * kBlockM <= kThreads, "one thread per lse2/delta element");
  static_assert(kBlockM % 64 == 0 && kD % 64 == 0, "tile shape");

  extern __shared__ uint8_t smem_raw[];
  uint8_t* const smem = aligned_smem(smem_raw);
  const uint32_t s0 = smem_addr(smem);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int T = p.seq;
  const auto [n_tile, kvh, b] = grid_key_block((T + kBlockN - 1) / kBlockN, p.kv_heads);
  const int k0 = n_tile * kBlockN;
  const int k_last = min(k0 + kBlockN, T) - 1;
  const int32_t* const starts = p.document_starts ? p.document_starts + static_cast<int64_t>(b) * T : nullptr;
  const int m_begin = p.causal ? k0 / kBlockM : 0;
  // Queries that see a key of the tile: up to the last key's window edge and document end.
  const int q_end = min(p.window > 0 ? min(T, k_last + p.window) : T, document_end(starts, k_last, T));
  const int m_count = (q_end + kBlockM - 1) / kBlockM - m_begin;
  const int iters = p.group * m_count;

  const bf16* const base = p.qkv + static_cast<int64_t>(b) * T * p.width;
  const int64_t do_stride = static_cast<int64_t>(p.heads) * kD;
  load_tile<kBlockN, kD, kThreads>(
      s0, base + static_cast<int64_t>(k0) * p.width + static_cast<int64_t>(p.heads + kvh) * kD,
      p.width, T - k0, tid);
  load_tile<kBlockN, kD, kThreads>(
      s0 + kOffV,
      base + static_cast<int64_t>(k0) * p.width +
          static_cast<int64_t>(p.heads + p.kv_heads + kvh) * kD,
      p.width, T - k0, tid);

  auto load_query_tile = [&](int it, int stage) {
    const int h = kvh * p.group + it / m_count;
    const int q0 = (m_begin + it % m_count) * kBlockM;
    load_tile<kBlockM, kD, kThreads>(s0 + kOffQ + stage * kQBytes,
                                     base + static_cast<int64_t>(q0) * p.width + h * kD,
                                     p.width, T - q0, tid);
    load_tile<kBlockM, kD, kThreads>(
        s0 + kOffdO + stage * kQBytes,
        p.dout + (static_cast<int64_t>(b) * T + q0) * do_stride + h * kD, do_stride, T - q0,
        tid);
    const int64_t stat = (static_cast<int64_t>(b) * p.heads + h) * T + q0;
    if (tid < kBlockM) {
      const bool ok = q0 + tid < T;
      cp_async_4(s0 + kOffL + (stage * kBlockM + tid) * 4, p.lse2 + stat + (ok ? tid : 0), ok);
    } else if (tid < 2 * kBlockM) {
      const int r = tid - kBlockM;
      const bool ok = q0 + r < T;
      cp_async_4(s0 + kOffDelta + (stage * kBlockM + r) * 4, p.delta + stat + (ok ? r : 0), ok);
    }
  };
  load_query_tile(0, 0);
  cp_async_commit();

  float dk[kDT][4], dv[kDT][4];
#pragma unroll
  for (int di = 0; di < kDT; ++di) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[di][e] = dv[di][e] = 0.f;
  }
  const int warp_key0 = warp * 16;
  const uint32_t kv_frag = ldsm_base<kD, LdsmOrder::kRowMajor16>(s0 + warp_key0 * kD * 2, lane);
  // The last query that sees each of this thread's two key rows, by window and document.
  int key_last_query[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = k0 + warp_key0 + g + 8 * r;
    key_last_query[r] = j < T ? min(p.window > 0 ? j + p.window - 1 : T - 1, document_end(starts, j, T) - 1) : -1;
  }
  const uint32_t q_frag = ldsm_base<kD, LdsmOrder::kRowPairs8>(s0 + kOffQ, lane);
  const uint32_t qt_frag = ldsm_base<kD, LdsmOrder::kRowMajor16>(s0 + kOffQ, lane);

  for (int it = 0; it < iters; ++it) {
    const int stage = it & 1;
    if (it + 1 < iters) {
      load_query_tile(it + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int h = kvh * p.group + it / m_count;
    const int q0 = (m_begin + it % m_count) * kBlockM;
    // Q and dO of this stage, in the two ldmatrix lane orders (dO is kOffdO - kOffQ further).
    const uint32_t sQ = q_frag + stage * kQBytes, sdO = sQ + (kOffdO - kOffQ);
    const uint32_t sQt = qt_frag + stage * kQBytes, sdOt = sQt + (kOffdO - kOffQ);

    // S^T = K Q^T and dP^T = V dO^T: A = this warp's 16 key rows, B = query rows ([n][k]).
    float st[kMT][4], dpt[kMT][4];
#pragma unroll
    for (int ni = 0; ni < kMT; ++ni) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[ni][e] = dpt[ni][e] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t ka[4], va[4];
      ldsm_x4(ka, ldsm_block<kD>(kv_frag, 0, kk));
      ldsm_x4(va, ldsm_block<kD>(kv_frag + kOffV, 0, kk));
#pragma unroll
      for (int nj = 0; nj < kMT / 2; ++nj) {
        uint32_t qb[4], ob[4];
        ldsm_x4(qb, ldsm_block<kD>(sQ, nj * 16, kk));
        ldsm_x4(ob, ldsm_block<kD>(sdO, nj * 16, kk));
        mma_bf16(st[2 * nj], ka, qb[0], qb[1]);
        mma_bf16(st[2 * nj + 1], ka, qb[2], qb[3]);
        mma_bf16(dpt[2 * nj], va, ob[0], ob[1]);
        mma_bf16(dpt[2 * nj + 1], va, ob[2], ob[3]);
      }
    }

    // P^T = exp2(S^T scale log2e - lse2[query]) and dS^T = P^T (dP^T - delta[query]).
    // Masked (and out-of-range) pairs get P = 0 by assignment, so an overflowing exponent of
    // a masked pair cannot leak.
    // Query rows past T feed the key gradients, so they are masked too.
    const bool boundary =
        q0 + kBlockM > T || tile_needs_mask(q0, q0 + kBlockM - 1, k0, kBlockN, T, p.causal, p.window,
                                            document_start(starts, q0 + kBlockM - 1, T));
    const float* sL = reinterpret_cast<const float*>(smem + kOffL) + stage * kBlockM;
    const float* sDelta = reinterpret_cast<const float*>(smem + kOffDelta) + stage * kBlockM;
    // Key j (a row here) is seen by queries [j if causal, key_last_query]; as column offsets
    // from this thread's first column. A key past T is seen by nobody.
    int lo[2], hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int j = k0 + warp_key0 + g + 8 * r;
      lo[r] = (p.causal ? j : 0) - q0 - 2 * t;
      hi[r] = key_last_query[r] - q0 - 2 * t;
    }
#pragma unroll
    for (int ni = 0; ni < kMT; ++ni) {
      const int col = ni * 8 + 2 * t;
      const float2 lse2 = *reinterpret_cast<const float2*>(sL + col);
      const float2 dl = *reinterpret_cast<const float2*>(sDelta + col);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float pv = fast_exp2(fmaf(st[ni][e], p.scale_log2, -((e & 1) ? lse2.y : lse2.x)));
        const int c = ni * 8 + (e & 1);
        if (boundary && (c < lo[e >> 1] || c > hi[e >> 1])) pv = 0.f;
        st[ni][e] = pv;
        dpt[ni][e] = pv * (dpt[ni][e] - ((e & 1) ? dl.y : dl.x));
      }
    }

    // dV += P^T dO and dK += dS^T Q: B = query rows as [k][n] -> ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      uint32_t pa[4], da[4];
      c_to_a(pa, st[2 * kk], st[2 * kk + 1]);
      c_to_a(da, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
      for (int dj = 0; dj < kD / 16; ++dj) {
        uint32_t ob[4], qb[4];
        ldsm_x4_trans(ob, ldsm_block<kD>(sdOt, kk * 16, dj));
        ldsm_x4_trans(qb, ldsm_block<kD>(sQt, kk * 16, dj));
        mma_bf16(dv[2 * dj], pa, ob[0], ob[1]);
        mma_bf16(dv[2 * dj + 1], pa, ob[2], ob[3]);
        mma_bf16(dk[2 * dj], da, qb[0], qb[1]);
        mma_bf16(dk[2 * dj + 1], da, qb[2], qb[3]);
      }
    }

    if constexpr (kAtomicDq) {
      // dS^T tile [key][query] in shared memory (bf16), then dQ = dS K with A read through
      // ldmatrix.trans (stored [k][m]) and B = K as [k][n] (ldmatrix.trans).
      uint8_t* const sdS = smem + kOffdS;
#pragma unroll
      for (int ni = 0; ni < kMT; ++ni) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          store_pair(sdS + swizzle<kBlockM>(warp_key0 + g + 8 * r, ni * 8 + 2 * t),
                     dpt[ni][2 * r], dpt[ni][2 * r + 1]);
        }
      }
      __syncthreads();
      constexpr int kWarpsM = kBlockM / 16, kWarpsD = kWarps / kWarpsM;
      constexpr int kSlice = kD / kWarpsD, kST = kSlice / 8;
      static_assert(kWarps % kWarpsM == 0 && kSlice % 16 == 0, "dQ warp tiling");
      const int wm = warp % kWarpsM, wd = warp / kWarpsM;
      float acc[kST][4];
#pragma unroll
      for (int si = 0; si < kST; ++si) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[si][e] = 0.f;
      }
      // Column blocks wm (of dS^T) and wd * kSlice / 16 + sj (of K) are run-time here; their
      // addresses are loop-invariant and computed once.
      const uint32_t ds_frag = ldsm_block<kBlockM>(
          ldsm_base<kBlockM, LdsmOrder::kRowPairs8>(s0 + kOffdS, lane), 0, wm);
      const uint32_t kt_frag = ldsm_base<kD, LdsmOrder::kRowMajor16>(s0, lane);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t a[4];
        ldsm_x4_trans(a, ds_frag + kk * 16 * kBlockM * 2);
#pragma unroll
        for (int sj = 0; sj < kST / 2; ++sj) {
          uint32_t kb[4];
          ldsm_x4_trans(kb, ldsm_block<kD>(kt_frag, kk * 16, wd * (kSlice / 16) + sj));
          mma_bf16(acc[2 * sj], a, kb[0], kb[1]);
          mma_bf16(acc[2 * sj + 1], a, kb[2], kb[3]);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int query = q0 + wm * 16 + g + 8 * r;
        if (query < T) {
          float* row = p.dq_accum + ((static_cast<int64_t>(b) * T + query) * p.heads + h) * kD +
                       wd * kSlice + 2 * t;
#pragma unroll
          for (int si = 0; si < kST; ++si) {
            atomicAdd(reinterpret_cast<float2*>(row + si * 8),
                      make_float2(acc[si][2 * r], acc[si][2 * r + 1]));
          }
        }
      }
    }
    __syncthreads();  // this stage (and dS^T) are free to be refilled
  }
  cp_async_wait<0>();
  __syncthreads();  // (the loop always runs; kept so an empty range could not race on K/V)

  // Epilogue: dK carries the softmax scale (s = scale q.k); stage dK into this warp's K rows
  // and dV into its V rows, then 16-byte coalesced stores into dqkv.
#pragma unroll
  for (int dj = 0; dj < kDT; ++dj) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t off = swizzle<kD>(warp_key0 + g + 8 * r, dj * 8 + 2 * t);
      store_pair(smem + off, dk[dj][2 * r] * p.scale, dk[dj][2 * r + 1] * p.scale);
      store_pair(smem + kOffV + off, dv[dj][2 * r], dv[dj][2 * r + 1]);
    }
  }
  __syncwarp();
  bf16* const row0 = p.dqkv + (static_cast<int64_t>(b) * T + k0 + warp_key0) * p.width;
  store_rows<16, kD>(row0 + static_cast<int64_t>(p.heads + kvh) * kD, p.width, smem, warp_key0,
                     T - k0 - warp_key0, lane);
  store_rows<16, kD>(row0 + static_cast<int64_t>(p.heads + p.kv_heads + kvh) * kD, p.width,
                     smem + kOffV, warp_key0, T - k0 - warp_key0, lane);
}

// ---------------------------------------------------------------------------------------
// Backward dQ (deterministic mode). CTA: kBlockM = 128 query rows of one (b, h), 8 warps of
// 16 rows. Per visible key tile (64 keys): S = Q K^T and dP = dO V^T, P from lse2, dS =
// P (dP - delta), dQ += dS K with dS fed from registers; lse2/delta are per row, so each
// thread keeps its two rows' values in registers. This recomputes S and dP (7 tile GEMMs in
// all instead of 5) but needs no atomics and no fp32 dQ buffer.
// Shared memory (D=128): Q, dO 32 KB each, K, V 2 stages x 16 KB each = 128 KB.
// ---------------------------------------------------------------------------------------
template <int kD, int kBlockM, int kBlockN, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 1)
    attention_backward_dq_kernel(const AttentionBackwardParams p) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kNT = kBlockN / 8, kDT = kD / 8;
  constexpr uint32_t kQBytes = kBlockM * kD * 2, kKVBytes = kBlockN * kD * 2;
  constexpr uint32_t kOffdO = kQBytes, kOffK = 2 * kQBytes, kOffV = kOffK + 2 * kKVBytes;
  static_assert(kBlockM == 16 * kWarps && kBlockN % 16 == 0 && kD % 64 == 0, "tile shape");

  extern __shared__ uint8_t smem_raw[];
  uint8_t* const smem = aligned_smem(smem_raw);
  const uint32_t s0 = smem_addr(smem);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int T = p.seq;
  const int m_tile = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / p.group;
  const int q0 = m_tile * kBlockM;
  const int q_last = min(q0 + kBlockM, T) - 1;
  const int32_t* const starts = p.document_starts ? p.document_starts + static_cast<int64_t>(b) * T : nullptr;
  const int kv_first = max(p.window > 0 ? max(0, q0 - p.window + 1) : 0, document_start(starts, q0, T));
  const int kv_end = p.causal ? q_last + 1 : T;
  const int n_begin = kv_first / kBlockN, n_end = (kv_end + kBlockN - 1) / kBlockN;

  const bf16* const base = p.qkv + static_cast<int64_t>(b) * T * p.width;
  const bf16* const k_g = base + static_cast<int64_t>(p.heads + kvh) * kD;
  const bf16* const v_g = base + static_cast<int64_t>(p.heads + p.kv_heads + kvh) * kD;
  const int64_t do_stride = static_cast<int64_t>(p.heads) * kD;

  load_tile<kBlockM, kD, kThreads>(s0, base + static_cast<int64_t>(q0) * p.width + h * kD,
                                   p.width, T - q0, tid);
  load_tile<kBlockM, kD, kThreads>(
      s0 + kOffdO, p.dout + (static_cast<int64_t>(b) * T + q0) * do_stride + h * kD, do_stride,
      T - q0, tid);
  {
    const int k0 = n_begin * kBlockN;
    load_tile<kBlockN, kD, kThreads>(s0 + kOffK, k_g + k0 * p.width, p.width, T - k0, tid);
    load_tile<kBlockN, kD, kThreads>(s0 + kOffV, v_g + k0 * p.width, p.width, T - k0, tid);
  }
  cp_async_commit();

  const int warp_row0 = warp * 16;
  const uint32_t q_frag = ldsm_base<kD, LdsmOrder::kRowMajor16>(s0 + warp_row0 * kD * 2, lane);
  const uint32_t k_frag = ldsm_base<kD, LdsmOrder::kRowPairs8>(s0 + kOffK, lane);
  const uint32_t kt_frag = ldsm_base<kD, LdsmOrder::kRowMajor16>(s0 + kOffK, lane);
  float row_lse2[2], row_delta[2];
  {
    const int64_t stat = (static_cast<int64_t>(b) * p.heads + h) * T;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = q0 + warp_row0 + g + 8 * r;
      row_lse2[r] = i < T ? p.lse2[stat + i] : 0.f;
      row_delta[r] = i < T ? p.delta[stat + i] : 0.f;
    }
  }
  float dq[kDT][4];
#pragma unroll
  for (int di = 0; di < kDT; ++di) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[di][e] = 0.f;
  }

  for (int n = n_begin; n < n_end; ++n) {
    const int stage = (n - n_begin) & 1;
    if (n + 1 < n_end) {
      const int k1 = (n + 1) * kBlockN;
      load_tile<kBlockN, kD, kThreads>(s0 + kOffK + (stage ^ 1) * kKVBytes, k_g + k1 * p.width,
                                       p.width, T - k1, tid);
      load_tile<kBlockN, kD, kThreads>(s0 + kOffV + (stage ^ 1) * kKVBytes, v_g + k1 * p.width,
                                       p.width, T - k1, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint32_t sK = k_frag + stage * kKVBytes, sV = sK + (kOffV - kOffK);
    const uint32_t sKt = kt_frag + stage * kKVBytes;
    const int k0 = n * kBlockN;

    float s[kNT][4], dp[kNT][4];
#pragma unroll
    for (int ni = 0; ni < kNT; ++ni) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[ni][e] = dp[ni][e] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t qa[4], oa[4];
      ldsm_x4(qa, ldsm_block<kD>(q_frag, 0, kk));
      ldsm_x4(oa, ldsm_block<kD>(q_frag + kOffdO, 0, kk));
#pragma unroll
      for (int nj = 0; nj < kNT / 2; ++nj) {
        uint32_t kb[4], vb[4];
        ldsm_x4(kb, ldsm_block<kD>(sK, nj * 16, kk));
        ldsm_x4(vb, ldsm_block<kD>(sV, nj * 16, kk));
        mma_bf16(s[2 * nj], qa, kb[0], kb[1]);
        mma_bf16(s[2 * nj + 1], qa, kb[2], kb[3]);
        mma_bf16(dp[2 * nj], oa, vb[0], vb[1]);
        mma_bf16(dp[2 * nj + 1], oa, vb[2], vb[3]);
      }
    }

    // Query rows past T feed the key gradients, so they are masked too.
    const bool boundary =
        q0 + kBlockM > T || tile_needs_mask(q0, q0 + kBlockM - 1, k0, kBlockN, T, p.causal, p.window,
                                            document_start(starts, q0 + kBlockM - 1, T));
    // Row i sees keys [lo, hi] (as in the forward); rows past T are never stored.
    int lo[2], hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = q0 + warp_row0 + g + 8 * r;
      lo[r] = max(p.window > 0 ? i - p.window + 1 : 0, document_start(starts, i, T)) - k0 - 2 * t;
      hi[r] = min(p.causal ? i : T - 1, T - 1) - k0 - 2 * t;
    }
#pragma unroll
    for (int ni = 0; ni < kNT; ++ni) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float pv = fast_exp2(fmaf(s[ni][e], p.scale_log2, -row_lse2[e >> 1]));
        const int c = ni * 8 + (e & 1);
        if (boundary && (c < lo[e >> 1] || c > hi[e >> 1])) pv = 0.f;
        s[ni][e] = pv * (dp[ni][e] - row_delta[e >> 1]);  // dS
      }
    }

    // dQ += dS K: K rows are keys = the k dimension here ([k][n] storage) -> ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[4];
      c_to_a(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int dj = 0; dj < kD / 16; ++dj) {
        uint32_t kb[4];
        ldsm_x4_trans(kb, ldsm_block<kD>(sKt, kk * 16, dj));
        mma_bf16(dq[2 * dj], a, kb[0], kb[1]);
        mma_bf16(dq[2 * dj + 1], a, kb[2], kb[3]);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  // Epilogue: dQ carries the softmax scale; stage into this warp's own Q rows.
#pragma unroll
  for (int dj = 0; dj < kDT; ++dj) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      store_pair(smem + swizzle<kD>(warp_row0 + g + 8 * r, dj * 8 + 2 * t),
                 dq[dj][2 * r] * p.scale, dq[dj][2 * r + 1] * p.scale);
    }
  }
  __syncwarp();
  store_rows<16, kD>(
      p.dqkv + (static_cast<int64_t>(b) * T + q0 + warp_row0) * p.width + h * kD, p.width, smem,
      warp_row0, T - q0 - warp_row0, lane);
}

// dQ (atomic mode): dqkv query heads = bf16(scale * dq_accum); dq_accum (B, T, H, D) fp32.
// One thread per 8 elements.
template <int kD>
__global__ void attention_backward_dq_convert_kernel(bf16* dqkv, const float* dq_accum,
                                                     int64_t width, int H, float scale,
                                                     int64_t rows) {
  constexpr int kChunks = kD / 8;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t r = i / kChunks;  // (token, head)
  if (r >= rows) return;
  const int c = static_cast<int>(i % kChunks) * 8;
  const float4 x = *reinterpret_cast<const float4*>(dq_accum + r * kD + c);
  const float4 y = *reinterpret_cast<const float4*>(dq_accum + r * kD + c + 4);
  uint4 v;
  v.x = pack_bf16(x.x * scale, x.y * scale);
  v.y = pack_bf16(x.z * scale, x.w * scale);
  v.z = pack_bf16(y.x * scale, y.y * scale);
  v.w = pack_bf16(y.z * scale, y.w * scale);
  *reinterpret_cast<uint4*>(dqkv + (r / H) * width + (r % H) * kD + c) = v;
}

// ---------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------
namespace {

constexpr int kForwardBlockM = 128;
constexpr int kDkdvBlockN = 128, kDkdvBlockM = 64;
constexpr int kDqBlockM = 128, kDqBlockN = 64, kDqWarps = 8;

void check_shape(const AttentionShape& s) {
  auto fail = [&](const std::string& why) {
    throw InternalError("attention: unsupported shape (B=" + std::to_string(s.batch) +
                        " T=" + std::to_string(s.seq) + " H=" + std::to_string(s.heads) +
                        " KV=" + std::to_string(s.kv_heads) + " D=" +
                        std::to_string(s.head_dim) + " window=" + std::to_string(s.window) +
                        "): " + why);
  };
  if (s.head_dim != 64 && s.head_dim != 128) fail("head_dim must be 64 or 128");
  if (s.heads <= 0 || s.kv_heads <= 0 || s.heads % s.kv_heads != 0) {
    fail("heads must be a positive multiple of kv_heads");
  }
  if (s.batch < 0 || s.seq < 0 || s.seq > (INT_MAX / 2)) fail("sequence length out of range");
  if (s.heads > 65535 || s.batch > 65535) fail("heads and batch must be <= 65535 (grid)");
  // The key-block kernels' flat grids hold one CTA per 128 keys, KV head and sequence.
  if ((s.seq + 127) / 128 * s.kv_heads * s.batch > INT_MAX) fail("more than 2^31 - 1 key blocks (grid)");
  if (s.window < 0) fail("window must be >= 0");
  if (s.document_starts.defined() && !s.causal) fail("packed documents must be causal");
  if (!(s.scale > 0.f) || !std::isfinite(s.scale)) fail("scale must be positive and finite");
}

// A window of T or more hides nothing: i - window < 0 <= j.
int effective_window(const AttentionShape& s) {
  return s.window > 0 && s.window < s.seq ? static_cast<int>(s.window) : 0;
}

template <class Params>
Params make_params(const AttentionShape& s) {
  Params p{};
  p.width = s.qkv_width();
  p.kv_width = p.width;
  p.kv_col = static_cast<int>(s.heads * s.head_dim);
  p.batch = static_cast<int>(s.batch);
  p.seq = static_cast<int>(s.seq);
  p.heads = static_cast<int>(s.heads);
  p.kv_heads = static_cast<int>(s.kv_heads);
  p.group = static_cast<int>(s.heads / s.kv_heads);
  p.window = effective_window(s);
  p.document_starts = s.document_starts.defined() ? s.document_starts.as<int32_t>() : nullptr;
  p.causal = s.causal;
  p.scale = s.scale;
  p.scale_log2 = s.scale * kLog2e;
  return p;
}

template <class Kernel>
void prepare(Kernel kernel, size_t smem_bytes) {
  // Above 48 KB a kernel must opt in; the attribute is cheap to set and per device, so it
  // is set on every launch rather than cached.
  if (smem_bytes > 48 * 1024) {
    TS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem_bytes)));
  }
}

template <int kD, int kWarps, int kBlockN>
void launch_forward(const AttentionForwardParams& p, int batch, cudaStream_t stream) {
  auto kernel = attention_forward_kernel<kD, kForwardBlockM, kBlockN, kWarps>;
  constexpr size_t smem = (kForwardBlockM + 4 * kBlockN) * kD * 2 + kSmemAlignSlack;
  prepare(kernel, smem);
  const dim3 grid((p.seq + kForwardBlockM - 1) / kForwardBlockM, p.heads, batch);
  kernel<<<grid, kWarps * 32, smem, stream>>>(p);
  TS_CUDA_CHECK_LAUNCH("attention_forward_kernel");
}

// dQ from the fp32 atomic accumulator to bf16 in dqkv, times the softmax scale.
template <int kD>
void launch_dq_convert(const AttentionBackwardParams& p, int batch, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(batch) * p.seq * p.heads;
  const int64_t threads = rows * (kD / 8);
  attention_backward_dq_convert_kernel<kD>
      <<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
          p.dqkv, p.dq_accum, p.width, p.heads, p.scale, rows);
  TS_CUDA_CHECK_LAUNCH("attention_backward_dq_convert_kernel");
}

template <int kD>
void launch_backward(const AttentionBackwardParams& p, int batch, bool deterministic,
                     cudaStream_t stream) {
  if (deterministic) {
    auto kernel = attention_backward_dkdv_kernel<kD, kDkdvBlockN, kDkdvBlockM, false>;
    constexpr size_t smem =
        (2 * kDkdvBlockN + 4 * kDkdvBlockM) * kD * 2 + 4 * kDkdvBlockM * 4 + kSmemAlignSlack;
    prepare(kernel, smem);
    const dim3 grid = heaviest_first_grid((p.seq + kDkdvBlockN - 1) / kDkdvBlockN, p.kv_heads, batch);
    kernel<<<grid, kDkdvBlockN / 16 * 32, smem, stream>>>(p);
    TS_CUDA_CHECK_LAUNCH("attention_backward_dkdv_kernel");

    auto dq_kernel = attention_backward_dq_kernel<kD, kDqBlockM, kDqBlockN, kDqWarps>;
    constexpr size_t dq_smem = (2 * kDqBlockM + 4 * kDqBlockN) * kD * 2 + kSmemAlignSlack;
    prepare(dq_kernel, dq_smem);
    const dim3 dq_grid((p.seq + kDqBlockM - 1) / kDqBlockM, p.heads, batch);
    dq_kernel<<<dq_grid, kDqWarps * 32, dq_smem, stream>>>(p);
    TS_CUDA_CHECK_LAUNCH("attention_backward_dq_kernel");
  } else {
    auto kernel = attention_backward_dkdv_kernel<kD, kDkdvBlockN, kDkdvBlockM, true>;
    constexpr size_t smem = (2 * kDkdvBlockN + 4 * kDkdvBlockM) * kD * 2 + 4 * kDkdvBlockM * 4 +
                            kDkdvBlockN * kDkdvBlockM * 2 + kSmemAlignSlack;
    prepare(kernel, smem);
    const dim3 grid = heaviest_first_grid((p.seq + kDkdvBlockN - 1) / kDkdvBlockN, p.kv_heads, batch);
    kernel<<<grid, kDkdvBlockN / 16 * 32, smem, stream>>>(p);
    TS_CUDA_CHECK_LAUNCH("attention_backward_dkdv_kernel");

    launch_dq_convert<kD>(p, batch, stream);
  }
}

size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

// lse2 = lse log2(e) and delta = rowsum(dout * out), and dQ's accumulator (when there is one)
// zeroed.
void preprocess_backward(const AttentionShape& s, const void* dout, const void* out,
                         const float* lse, float* lse2, float* delta, float* dq_accum,
                         cudaStream_t stream) {
  const int64_t rows = s.batch * s.seq * s.heads;
  if (dq_accum != nullptr) {
    TS_CUDA_CHECK(cudaMemsetAsync(dq_accum, 0,
                                  static_cast<size_t>(rows * s.head_dim) * sizeof(float), stream));
  }
  const int64_t threads = rows * (s.head_dim / 8);
  const unsigned blocks = static_cast<unsigned>((threads + 255) / 256);
  const int T = static_cast<int>(s.seq), H = static_cast<int>(s.heads);
  if (s.head_dim == 64) {
    attention_backward_preprocess_kernel<64><<<blocks, 256, 0, stream>>>(
        static_cast<const bf16*>(dout), static_cast<const bf16*>(out), lse, lse2, delta, T, H, rows);
  } else {
    attention_backward_preprocess_kernel<128><<<blocks, 256, 0, stream>>>(
        static_cast<const bf16*>(dout), static_cast<const bf16*>(out), lse, lse2, delta, T, H, rows);
  }
  TS_CUDA_CHECK_LAUNCH("attention_backward_preprocess_kernel");
}

// TMA reads its tensors from 16-byte aligned addresses.
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The warpgroup kernels on the device the launches go to (the current one).
bool warpgroup_kernels_run(int64_t head_dim) {
  int device = 0;
  TS_CUDA_CHECK(cudaGetDevice(&device));
  return attention_hopper_available(head_dim, device);
}

}  // namespace

void attention_forward(void* out, float* lse, const void* qkv, const AttentionShape& s,
                       cudaStream_t stream, const AttentionOptions& options) {
  NvtxRange range("attention_forward");
  check_shape(s);
  if ((options.forward_warps != 4 && options.forward_warps != 8) ||
      (options.forward_block_n != 32 && options.forward_block_n != 64)) {
    throw InternalError("attention: forward_warps must be 4 or 8, forward_block_n 32 or 64");
  }
  if (s.batch == 0 || s.seq == 0) return;
  auto p = make_params<AttentionForwardParams>(s);
  p.qkv = p.kv = static_cast<const bf16*>(qkv);
  p.out = static_cast<bf16*>(out);
  p.lse = lse;
  const int batch = static_cast<int>(s.batch);
  if (options.forward_warpgroup && aligned16(qkv) &&
      warpgroup_kernels_run(s.head_dim)) {
    attention_forward_hopper(p, stream);
    return;
  }
  const bool wide = options.forward_block_n == 64;
  if (s.head_dim == 64) {
    if (options.forward_warps == 4) {
      wide ? launch_forward<64, 4, 64>(p, batch, stream) : launch_forward<64, 4, 32>(p, batch, stream);
    } else {
      wide ? launch_forward<64, 8, 64>(p, batch, stream) : launch_forward<64, 8, 32>(p, batch, stream);
    }
  } else {
    if (options.forward_warps == 4) {
      wide ? launch_forward<128, 4, 64>(p, batch, stream)
           : launch_forward<128, 4, 32>(p, batch, stream);
    } else {
      wide ? launch_forward<128, 8, 64>(p, batch, stream)
           : launch_forward<128, 8, 32>(p, batch, stream);
    }
  }
}

size_t attention_backward_scratch_bytes(const AttentionShape& s, const AttentionOptions& options) {
  const size_t stats = static_cast<size_t>(s.batch * s.heads * s.seq) * sizeof(float);
  size_t bytes = 2 * align_up(stats);  // lse2, delta
  if (!options.deterministic) {
    bytes += align_up(static_cast<size_t>(s.batch * s.seq * s.heads * s.head_dim) * sizeof(float));
  }
  return bytes;
}

namespace {

// Carves the backward's scratch (attention_backward_scratch_bytes): lse2 and delta, then dQ's
// fp32 sums unless the dQ is deterministic; and fills them from dout, out and lse.
void prepare_backward(AttentionBackwardParams& p, const AttentionShape& s, const void* dout,
                      const void* out, const float* lse, void* scratch, bool deterministic,
                      cudaStream_t stream) {
  const size_t stats = align_up(static_cast<size_t>(s.batch * s.heads * s.seq) * sizeof(float));
  uint8_t* const bytes = static_cast<uint8_t*>(scratch);
  float* const lse2 = reinterpret_cast<float*>(bytes);
  float* const delta = reinterpret_cast<float*>(bytes + stats);
  p.lse2 = lse2;
  p.delta = delta;
  p.dq_accum = deterministic ? nullptr : reinterpret_cast<float*>(bytes + 2 * stats);
  p.dout = static_cast<const bf16*>(dout);
  preprocess_backward(s, dout, out, lse, lse2, delta, p.dq_accum, stream);
}

}  // namespace

void attention_backward(void* dqkv, const void* dout, const void* out, const float* lse,
                        const void* qkv, const AttentionShape& s, void* scratch,
                        cudaStream_t stream, const AttentionOptions& options) {
  NvtxRange range("attention_backward");
  check_shape(s);
  if (s.batch == 0 || s.seq == 0) return;
  auto p = make_params<AttentionBackwardParams>(s);
  p.qkv = p.kv = static_cast<const bf16*>(qkv);
  p.dqkv = p.dkv = static_cast<bf16*>(dqkv);
  prepare_backward(p, s, dout, out, lse, scratch, options.deterministic, stream);

  const int batch = static_cast<int>(s.batch);
  if (!options.deterministic && options.backward_warpgroup && aligned16(qkv) && aligned16(dout) &&
      warpgroup_kernels_run(s.head_dim)) {
    attention_backward_hopper(p, stream);
    launch_dq_convert<128>(p, batch, stream);
    return;
  }
  if (s.head_dim == 64) {
    launch_backward<64>(p, batch, options.deterministic, stream);
  } else {
    launch_backward<128>(p, batch, options.deterministic, stream);
  }
}

void attention_forward(void* out, float* lse, const void* qkv, const AttentionShape& s,
                       cudaStream_t stream) {
  attention_forward(out, lse, qkv, s, stream, AttentionOptions{});
}

namespace {

// The warpgroup forward's parameters with its outputs: out, lse and, with codes non-null, out's
// FP8 codes (attention_forward_cast's).
AttentionForwardParams forward_params(void* out, float* lse, const AttentionShape& s, void* codes,
                                      DType format, const float* scale, float* amax) {
  auto p = make_params<AttentionForwardParams>(s);
  p.out = static_cast<bf16*>(out);
  p.lse = lse;
  p.codes = static_cast<uint8_t*>(codes);
  p.code_scale = scale;
  p.code_amax = reinterpret_cast<unsigned*>(amax);
  p.codes_e5m2 = format == DType::E5M2;
  return p;
}

}  // namespace

bool attention_forward_cast(void* out, float* lse, const void* qkv, const AttentionShape& s,
                            void* codes, DType format, const float* scale, float* amax,
                            cudaStream_t stream) {
  NvtxRange range("attention_forward_cast");
  check_shape(s);
  TS_CHECK(format == DType::E4M3 || format == DType::E5M2, "attention_forward_cast: codes dtype {}",
           dtype_name(format));
  if (!aligned16(qkv) || !aligned16(codes) || !warpgroup_kernels_run(s.head_dim)) return false;
  if (s.batch == 0 || s.seq == 0) return true;
  auto p = forward_params(out, lse, s, codes, format, scale, amax);
  p.qkv = p.kv = static_cast<const bf16*>(qkv);
  attention_forward_hopper(p, stream);
  return true;
}

bool attention_forward_fp8(void* out, float* lse, const void* qkv, const AttentionShape& s,
                           void* scratch, void* codes, DType format, const float* scale,
                           float* amax, cudaStream_t stream) {
  NvtxRange range("attention_forward_fp8");
  check_shape(s);
  if (s.head_dim != 128 || s.v_dim() != 128 || !aligned16(qkv) ||
      (codes != nullptr && !aligned16(codes)) || !warpgroup_kernels_run(s.head_dim)) {
    return false;
  }
  if (s.batch == 0 || s.seq == 0) return true;
  const AttentionForwardParams p = forward_params(out, lse, s, codes, format, scale, amax);
  const Fp8AttentionOperands operands =
      cast_fp8_attention_operands(static_cast<const bf16*>(qkv), s, scratch, stream);
  attention_forward_hopper_fp8(p, operands, stream);
  return true;
}

void attention_backward(void* dqkv, const void* dout, const void* out, const float* lse,
                        const void* qkv, const AttentionShape& s, void* scratch,
                        cudaStream_t stream) {
  attention_backward(dqkv, dout, out, lse, qkv, s, scratch, stream, AttentionOptions{});
}

size_t attention_backward_scratch_bytes(const AttentionShape& s) {
  return attention_backward_scratch_bytes(s, AttentionOptions{});
}

namespace {

// Context parallelism takes the warpgroup kernels for causal bf16 attention of head dim 128
// (packed documents too), when each segment's two chunks are whole tiles (T a multiple of 256).
bool gathered_on_warpgroups(const void* qkv, const void* kv_all, int64_t segments,
                            const AttentionShape& s) {
  return s.tokens() > 0 && segments > 1 && s.head_dim == 128 && s.v_dim() == 128 && s.causal && s.seq % 256 == 0 &&
         aligned16(qkv) && aligned16(kv_all) && warpgroup_kernels_run(s.head_dim);
}

// The parameters both passes share: this segment's queries in qkv, every segment's keys and
// values in kv_all, the window against the whole sequence's tokens (effective_window's, for
// every segment's).
template <class Params>
Params gathered_params(const void* qkv, const void* kv_all, int64_t segments, int64_t segment,
                       const AttentionShape& s) {
  auto p = make_params<Params>(s);
  p.window = s.window > 0 && s.window < segments * s.seq ? static_cast<int>(s.window) : 0;
  p.qkv = static_cast<const bf16*>(qkv);
  p.kv = static_cast<const bf16*>(kv_all);
  p.kv_width = s.kv_width();
  p.kv_col = 0;
  p.segments = static_cast<int>(segments);
  p.segment = static_cast<int>(segment);
  return p;
}

}  // namespace

bool attention_gathered_forward_warpgroup(void* out, float* lse, const void* qkv,
                                          const void* kv_all, int64_t segments, int64_t segment,
                                          const AttentionShape& s, cudaStream_t stream) {
  if (!gathered_on_warpgroups(qkv, kv_all, segments, s)) return false;
  auto p = gathered_params<AttentionForwardParams>(qkv, kv_all, segments, segment, s);
  p.out = static_cast<bf16*>(out);
  p.lse = lse;
  attention_forward_hopper(p, stream);
  return true;
}

bool attention_gathered_backward_warpgroup(void* dqkv, void* dkv_all, const void* dout,
                                           const void* out, const float* lse, const void* qkv,
                                           const void* kv_all, int64_t segments, int64_t segment,
                                           const AttentionShape& s, void* scratch,
                                           cudaStream_t stream) {
  if (!gathered_on_warpgroups(qkv, kv_all, segments, s) || !aligned16(dout)) return false;
  auto p = gathered_params<AttentionBackwardParams>(qkv, kv_all, segments, segment, s);
  p.dqkv = static_cast<bf16*>(dqkv);
  p.dkv = static_cast<bf16*>(dkv_all);
  prepare_backward(p, s, dout, out, lse, scratch, false, stream);
  attention_backward_hopper(p, stream);  // dK, dV of every segment's rows
  launch_dq_convert<128>(p, p.batch, stream);
  return true;
}

}  // namespace tessera::cuda
