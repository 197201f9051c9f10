#pragma once
// What the two families of flash-attention kernels share: the launch parameters, the masking
// rules (which tiles need element masks, where a row's document starts and ends) and the few
// PTX helpers both use. attention.cu holds the FlashAttention-2 kernels on warp MMAs (every
// architecture the build targets, head_dim 64 and 128); attention_hopper.cu and
// attention_hopper_backward.cu the forward and backward on warpgroup MMAs fed by TMA (sm_90a,
// head_dim 128). Include from .cu files only.
#include <cstdint>

// vendor.h first: document_search.h's functions are host-and-device only where it has defined
// TS_HOST_DEVICE.
#include "tessera/backend/cuda/vendor.h"

#include "tessera/backend/cuda/document_search.h"
#include "tessera/backend/cuda/hopper_ptx.cuh"
#include "tessera/ops/backend.h"

namespace tessera::cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct AttentionForwardParams {
  const bf16* qkv;
  bf16* out;
  float* lse;
  int64_t width;  // elements per token of qkv: (H + 2 KV) D
  // The keys and values: rows of kv_width elements whose first key head is at column kv_col.
  // qkv itself (kv_col = H D), or under context parallelism every segment's key and value
  // heads, (segments x B, T, 2 KV D) with kv_col = 0 (the warpgroup kernels only).
  const bf16* kv;
  int64_t kv_width;
  int kv_col;
  const int32_t* document_starts;  // (B, T) packed documents (causal only); null: none
  int seq, heads, kv_heads, group, window, batch;
  bool causal;
  float scale, scale_log2;
  // Context parallelism on the warpgroup kernels (ContextSegments): segments > 1 reads kv as
  // every segment's and takes this segment's queries from qkv; 0 or 1: none.
  int segments, segment;
  // Non-null (the warpgroup forward only): out's FP8 codes in out's layout, e5m2 when
  // codes_e5m2 else e4m3, of the stored values times *code_scale, and max |out| max-ed into
  // *code_amax (its float's bits; when non-null): the output projection's forward cast.
  uint8_t* codes;
  const float* code_scale;
  unsigned* code_amax;
  bool codes_e5m2;
  // FP8 attention (attention_fp8.cu; the warpgroup forward only): the descale of each 128-token
  // tile of every query, key and value head, (B, H + 2 KV, tiles) fp32, whose codes the
  // kernel's tensor maps read; null in bf16 attention.
  const float* descales;
  int tiles;
};

struct AttentionBackwardParams {
  const bf16* qkv;
  const bf16* dout;
  const float* lse2;   // (B, H, T) lse * log2(e)
  const float* delta;  // (B, H, T) rowsum(dout * out)
  bf16* dqkv;
  float* dq_accum;  // (B, T, H, D) fp32, atomic dQ mode only
  int64_t width;
  const bf16* kv;  // as AttentionForwardParams'
  bf16* dkv;       // dK and dV, in kv's layout (dqkv itself without context parallelism)
  int64_t kv_width;
  int kv_col;
  const int32_t* document_starts;  // (B, T) packed documents (causal only); null: none
  int seq, heads, kv_heads, group, window, batch;
  bool causal;
  float scale, scale_log2;
  int segments, segment;  // as AttentionForwardParams'
};

// Megatron's causal load balancing of context parallelism, as the warpgroup kernels see it: a
// sequence of `segments` x T tokens is cut into 2 x segments chunks of T / 2, and segment c's
// T rows hold chunks c and 2 segments - 1 - c (model/parallel_layers.h). Queries are this
// segment's rows; keys are every segment's, found by their position in the whole sequence.
// A segment's rows run in increasing position, so the rows that see a key are a contiguous
// run of rows. The kernels take chunks of a multiple of 128 tokens: a tile never straddles two.
// segments <= 1: one segment, position = row.
struct ContextSegments {
  int segments, segment, half;
  __device__ __forceinline__ bool split() const { return segments > 1; }
  // Tokens in the whole sequence (the keys).
  __device__ __forceinline__ int keys(int T) const { return split() ? segments * T : T; }
  // The position of this segment's row u.
  __device__ __forceinline__ int position(int u) const {
    if (!split()) return u;
    return u < half ? segment * half + u : (2 * segments - 1 - segment) * half + u - half;
  }
  // The segment holding position `pos` (.y) and its row there (.x).
  __device__ __forceinline__ int2 row_of(int pos) const {
    if (!split()) return make_int2(pos, 0);
    const int chunk = pos / half;
    return chunk < segments ? make_int2(pos - chunk * half, chunk)
                            : make_int2(half + pos - chunk * half, 2 * segments - 1 - chunk);
  }
  // The first row of this segment at position `pos` or later (T: none).
  __device__ __forceinline__ int first_row_from(int pos, int T) const {
    if (!split()) return min(pos, T);
    const int first = segment * half, second = (2 * segments - 1 - segment) * half;
    if (pos <= first) return 0;
    if (pos < first + half) return pos - first;
    if (pos <= second) return half;
    return min(T, half + pos - second);
  }
};

__device__ __forceinline__ ContextSegments context_segments(int segments, int segment, int T) {
  return {segments, segment, T / 2};
}

// Under a causal mask the key blocks of one (batch, kv head) differ in work by up to the
// sequence's tile count: the first is seen by every query, the last by one tile. The backward
// kernels that own a key block have few CTAs (1,024 at T = 8192, 8 KV heads, batch 2: under 8
// waves), and a grid ordered head by head started some heads' heaviest blocks in the last wave
// (11% of the causal backward lost to the tail). Their grid is flat and block-major instead:
// every head's heaviest block starts before any lighter one (longest-first list scheduling).
// The kernels that own a query tile keep a head-major grid, heaviest tile first within a head:
// they have many CTAs, whose tail is short, and a head's tiles that run together share its
// keys and values in L2 (the full-attention forward ran 10% slower block-major).
inline dim3 heaviest_first_grid(int64_t blocks, int64_t kv_heads, int64_t batch) {
  return dim3(static_cast<unsigned>(blocks * kv_heads * batch));
}

struct GridBlock {
  int block, kv_head, batch;
};

// This CTA's key block of `blocks` per (batch, kv head) in heaviest_first_grid's order.
__device__ __forceinline__ GridBlock grid_key_block(int blocks, int kv_heads) {
  const int pairs = static_cast<int>(gridDim.x) / blocks;
  const int pair = static_cast<int>(blockIdx.x) % pairs;
  return {static_cast<int>(blockIdx.x) / pairs, pair % kv_heads, pair / kv_heads};
}

// The forward on warpgroup MMAs (attention_hopper.cu): same contract as the FA2 forward.
void attention_forward_hopper(const AttentionForwardParams& p, cudaStream_t stream);
// FP8 attention's operands (attention_fp8.cu), cast from a bf16 qkv into the scratch
// (attention_fp8_scratch_bytes): qk (B, T, (H + KV) 128) the query and key heads' e4m3 codes,
// vt (B, KV, 128, padded_seq) the value heads' transposed codes, descales (B, H + 2 KV, tiles)
// each 128-token tile's.
struct Fp8AttentionOperands {
  const uint8_t* qk = nullptr;
  const uint8_t* vt = nullptr;
  const float* descales = nullptr;
  int tiles = 0;
  int64_t padded_seq = 0;
};
Fp8AttentionOperands cast_fp8_attention_operands(const bf16* qkv, const AttentionShape& s,
                                                 void* scratch, cudaStream_t stream);
// The warpgroup forward over those codes (p.descales and p.tiles taken from them).
void attention_forward_hopper_fp8(const AttentionForwardParams& p,
                                  const Fp8AttentionOperands& codes, cudaStream_t stream);
// The backward's dK, dV (written to p.dkv) and dQ (added to p.dq_accum, fp32, zeroed by the
// caller, which converts it after) on warpgroup MMAs, from the preprocessed p.lse2 and p.delta.
void attention_backward_hopper(const AttentionBackwardParams& p, cudaStream_t stream);

__device__ __forceinline__ float fast_exp2(float x) {  // exp2(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Whether the tile of queries [q0, q_last] x keys [k0, k0 + block_n) holds a pair that must be
// masked: a key past T, a key above the first query's diagonal, a key at or left of the last
// query's window edge, or a key before the last query's document (`last_start`: the first
// token of it, 0 without documents). Tiles entirely inside the visible band skip element masks.
__device__ __forceinline__ bool tile_needs_mask(int q0, int q_last, int k0, int block_n, int T,
                                                bool causal, int window, int last_start) {
  return k0 + block_n > T || (causal && k0 + block_n - 1 > q0) ||
         (window > 0 && k0 <= q_last - window) || k0 < last_start;
}

// The first key query i sees for its document: starts[i] (this sequence's document starts,
// null without documents), for i < T; a row past T takes row T - 1's, so it stays finite.
__device__ __forceinline__ int document_start(const int32_t* starts, int i, int T) {
  return starts ? starts[min(i, T - 1)] : 0;
}

// One past the last query of key j's document (T without documents): the first i > j whose
// document starts after j. Starts never decrease along the sequence, so it is a bisection.
__device__ __forceinline__ int document_end(const int32_t* starts, int j, int T) {
  if (!starts) return T;
  int lo = j + 1, hi = T;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (starts[mid] > j) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// document_end for a whole warp with the same j: document_search.h's 32-way search, a lane a
// probe.
__device__ __forceinline__ int document_end_warp(const int32_t* starts, int j, int T) {
  if (!starts) return T;
  const int lane = static_cast<int>(threadIdx.x % 32);
  return document_end_search(j, T, [&](int lo, int step, int hi) {
    const int at = lo + lane * step;
    return __ballot_sync(0xffffffffu, at < hi && starts[at] > j);
  });
}

}  // namespace tessera::cuda
