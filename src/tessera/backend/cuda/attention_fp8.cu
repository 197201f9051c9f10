// FP8 attention's forward (AttentionShape::fp8, fp8_dot_product_attention): the operands' cast,
// then attention_hopper.cu's forward over the codes. The numerics are the contract of
// ops/op_table.inc's attention_forward, which the CPU backend computes too.
//
// Scaling is per tile of 128 tokens of one head (the kernel's query and key tiles), so one pass
// over qkv casts it: a CTA reads its tile, takes the amax, and writes the codes and the
// descale (core/fp8.h's block scale: a power of two). Query and key heads keep qkv's row layout;
// value heads are transposed, (B, KV, 128, padded_seq), because FP8 MMAs read K-major operands
// only, with the keys of each 32 permuted as the kernel's probabilities sit in its registers
// (key_of_column).
#include <cstdint>

#include "tessera/backend/cuda/attention.cuh"
#include "tessera/backend/cuda/attention_common.cuh"
#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/fp8_cast.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/core/error.h"

namespace tessera::cuda {

namespace {

constexpr int kD = 128;
constexpr int kTileTokens = 128;
constexpr int kCastThreads = 256;  // 16 threads a token row, 8 values each
constexpr size_t kAlign = 256;

size_t aligned(size_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

struct Fp8AttentionScratch {
  int64_t tiles = 0, padded_seq = 0;
  size_t qk_bytes = 0, vt_bytes = 0, descale_bytes = 0;
};

Fp8AttentionScratch scratch_layout(const AttentionShape& s) {
  Fp8AttentionScratch l;
  l.tiles = (s.seq + kTileTokens - 1) / kTileTokens;
  l.padded_seq = l.tiles * kTileTokens;
  l.qk_bytes = aligned(static_cast<size_t>(s.tokens() * (s.heads + s.kv_heads) * kD));
  l.vt_bytes = aligned(static_cast<size_t>(s.batch * s.kv_heads * kD * l.padded_seq));
  l.descale_bytes =
      aligned(static_cast<size_t>(s.batch * (s.heads + 2 * s.kv_heads) * l.tiles) * sizeof(float));
  return l;
}

// Column j of a 32-key group of V's transposed codes holds key key_of_column(j) of the group:
// attention_hopper.cu's probabilities_to_e4m3_a gives logical column 4 t + i of each half the
// key 8 (i / 2) + 2 t + i % 2 of that half.
__device__ __forceinline__ int key_of_column(int j) {
  const int i = j % 4, t = (j % 16) / 4;
  return 16 * (j / 16) + 8 * (i / 2) + 2 * t + i % 2;
}

// One CTA a (tile, head slot, sequence): slots 0..H-1 query heads, H..H+KV-1 key heads, then
// value heads.
__global__ void __launch_bounds__(kCastThreads)
    attention_fp8_cast_kernel(const bf16* __restrict__ qkv, uint8_t* __restrict__ qk,
                              uint8_t* __restrict__ vt, float* __restrict__ descales, int T, int H,
                              int KV, int tiles, int64_t padded_seq) {
  // A value tile's codes, tokens x dims (4-byte stores); 4 bytes of padding a row move each
  // row's column by a bank, which eases the transposing column reads' conflicts.
  __shared__ alignas(16) uint8_t value_codes[kTileTokens][kD + 4];
  __shared__ unsigned warp_amax[kCastThreads / 32];
  const int tile = static_cast<int>(blockIdx.x), slot = static_cast<int>(blockIdx.y);
  const int b = static_cast<int>(blockIdx.z), slots = H + 2 * KV;
  const int chunk = static_cast<int>(threadIdx.x) % 16, row0 = static_cast<int>(threadIdx.x) / 16;
  const int64_t width = int64_t{slots} * kD;

  uint4 values[8];
  unsigned amax = 0;  // max |x| as its float's bits (non-negative floats order as integers)
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int token = tile * kTileTokens + row0 + 16 * k;
    values[k] = make_uint4(0, 0, 0, 0);
    if (token < T) {
      values[k] = *reinterpret_cast<const uint4*>(qkv + (int64_t{b} * T + token) * width +
                                                  int64_t{slot} * kD + 8 * chunk);
    }
    const bf16* x = reinterpret_cast<const bf16*>(&values[k]);
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = max(amax, __float_as_uint(fabsf(to_float(x[e]))));
  }
  amax = warp_reduce_max(amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kCastThreads / 32; ++w) amax = max(amax, warp_amax[w]);
  // A power of two: x * scale and the codes times its inverse are exact.
  const float scale = fp8_block_scale_on_device(__uint_as_float(amax), 448.f);
  if (threadIdx.x == 0) descales[(int64_t{b} * slots + slot) * tiles + tile] = 1.f / scale;

  auto codes_of = [&](const uint4& v, uint8_t(&q)[8]) {
    const bf16* x = reinterpret_cast<const bf16*>(&v);
#pragma unroll
    for (int e = 0; e < 8; ++e) q[e] = fp8_encode<DType::E4M3>(to_float(x[e]) * scale);
  };
  if (slot < H + KV) {
    const int64_t qk_width = int64_t{H + KV} * kD;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int token = tile * kTileTokens + row0 + 16 * k;
      if (token >= T) continue;
      alignas(8) uint8_t q[8];
      codes_of(values[k], q);
      store_codes<8>(qk + (int64_t{b} * T + token) * qk_width + int64_t{slot} * kD + 8 * chunk, q);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {  // tokens past T are zeros, so are their codes
    alignas(8) uint8_t q[8];
    codes_of(values[k], q);
    uint32_t* dst = reinterpret_cast<uint32_t*>(&value_codes[row0 + 16 * k][8 * chunk]);
    dst[0] = *reinterpret_cast<const uint32_t*>(q);
    dst[1] = *reinterpret_cast<const uint32_t*>(q + 4);
  }
  __syncthreads();
  const int kv_head = slot - H - KV;
  uint8_t* const plane =
      vt + (int64_t{b} * KV + kv_head) * kD * padded_seq + int64_t{tile} * kTileTokens;
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // 128 dims x 8 chunks of 16 columns
    const int job = static_cast<int>(threadIdx.x) + kCastThreads * k;
    const int d = job / 8, column0 = 16 * (job % 8);
    alignas(16) uint8_t q[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const int column = column0 + e;
      q[e] = value_codes[32 * (column / 32) + key_of_column(column % 32)][d];
    }
    *reinterpret_cast<uint4*>(plane + int64_t{d} * padded_seq + column0) =
        *reinterpret_cast<const uint4*>(q);
  }
}

}  // namespace

size_t attention_fp8_scratch_bytes(const AttentionShape& s) {
  const Fp8AttentionScratch l = scratch_layout(s);
  return l.qk_bytes + l.vt_bytes + l.descale_bytes;
}

Fp8AttentionOperands cast_fp8_attention_operands(const bf16* qkv, const AttentionShape& s,
                                                 void* scratch, cudaStream_t stream) {
  const Fp8AttentionScratch l = scratch_layout(s);
  uint8_t* const qk = static_cast<uint8_t*>(scratch);
  uint8_t* const vt = qk + l.qk_bytes;
  float* const descales = reinterpret_cast<float*>(vt + l.vt_bytes);
  const dim3 grid(static_cast<unsigned>(l.tiles), static_cast<unsigned>(s.heads + 2 * s.kv_heads),
                  static_cast<unsigned>(s.batch));
  attention_fp8_cast_kernel<<<grid, kCastThreads, 0, stream>>>(
      qkv, qk, vt, descales, static_cast<int>(s.seq), static_cast<int>(s.heads),
      static_cast<int>(s.kv_heads), static_cast<int>(l.tiles), l.padded_seq);
  TS_CUDA_CHECK_LAUNCH("attention_fp8_cast_kernel");
  return {qk, vt, descales, static_cast<int>(l.tiles), l.padded_seq};
}

}  // namespace tessera::cuda
