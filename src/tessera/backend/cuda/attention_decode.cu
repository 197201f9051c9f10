#include "tessera/backend/cuda/attention_decode.cuh"

#include <algorithm>
#include <cmath>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"

namespace tessera::cuda {
namespace {

// One block per (query head, sequence). Decoding reads every visible key and value once and
// does two multiply-adds per element read, so the kernel is bound by memory latency and
// bandwidth, not by math: each warp walks its share of the keys (key j goes to warp
// j % kWarps) with an online softmax, its lanes holding D/32 of the head dimensions, and the
// warps' partial results are combined once at the end. Reading a key is one coalesced load
// of D contiguous elements by the warp. PER_LANE is the register count fixed at compile time
// (D up to 32 x PER_LANE); a head dimension that is not a multiple of 32 leaves the last
// lanes idle in their last slot. Values may be narrower than keys (Dv < D: multi-latent
// attention); PER_LANE covers the wider of the two.
constexpr int kWarps = 8;
constexpr int kMaxHeadDim = 256;

template <class T, int PER_LANE>
__global__ void attention_decode_kernel(T* out, const T* q, const T* kv, const int32_t* positions,
                                        int64_t S, int64_t H, int64_t KV, int D, int Dv,
                                        int64_t pos, int64_t window, float scale) {
  const int64_t h = blockIdx.x, b = blockIdx.y;
  // The visible keys: the op API's rule (reference.h, visible_keys) for query row `last`.
  const int64_t last = positions ? positions[b] : pos;
  const int64_t first = window > 0 ? max(int64_t{0}, last - window + 1) : 0;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row = KV * (D + Dv);  // elements per cached position
  const T* keys = kv + b * S * row + (h / (H / KV)) * D;
  const T* values = kv + b * S * row + KV * D + (h / (H / KV)) * Dv;

  float qd[PER_LANE], acc[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int d = lane + 32 * i;
    qd[i] = d < D ? to_float(q[(b * H + h) * D + d]) * scale : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int64_t j = first + warp; j <= last; j += kWarps) {
    const T* k = keys + j * row;
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
      if (lane + 32 * i < D) dot += qd[i] * to_float(k[lane + 32 * i]);
    const float score = warp_sum(dot);
    const float m_new = fmaxf(m, score);
    const float correction = __expf(m - m_new), p = __expf(score - m_new);
    l = l * correction + p;
    const T* v = values + j * row;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
      if (lane + 32 * i < Dv) acc[i] = acc[i] * correction + p * to_float(v[lane + 32 * i]);
    m = m_new;
  }

  __shared__ float warp_m[kWarps], warp_l[kWarps];
  __shared__ float warp_acc[kWarps][32 * PER_LANE];
  if (lane == 0) warp_m[warp] = m, warp_l[warp] = l;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) warp_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  float m_all = -INFINITY;
  for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, warp_m[w]);
  float l_all = 0.0f;
  for (int w = 0; w < kWarps; ++w)
    if (warp_l[w] > 0.0f) l_all += warp_l[w] * __expf(warp_m[w] - m_all);
  for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < kWarps; ++w)
      if (warp_l[w] > 0.0f) o += warp_acc[w][d] * __expf(warp_m[w] - m_all);
    out[(b * H + h) * Dv + d] = from_float<T>(o / l_all);
  }
}

template <class T, int PER_LANE>
void launch(void* out, const void* q, const void* kv, const int32_t* positions, int64_t pos,
            const AttentionShape& s, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch));
  attention_decode_kernel<T, PER_LANE><<<grid, kWarps * 32, 0, stream>>>(
      static_cast<T*>(out), static_cast<const T*>(q), static_cast<const T*>(kv), positions, s.seq,
      s.heads, s.kv_heads, static_cast<int>(s.head_dim), static_cast<int>(s.v_dim()), pos, s.window,
      s.scale);
  TS_CUDA_CHECK_LAUNCH("attention_decode_kernel");
}

// One thread per 16 bytes of a row where the row's width and both addresses allow, else per
// element: the copy is a few kilobytes per sequence, bound by the launch.
template <class V>
__global__ void cache_write_kernel(V* cache, int64_t S, int64_t W, const V* src, int64_t src_cols,
                                   int64_t src_col, const int32_t* positions) {
  const int64_t b = blockIdx.y;
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= W) return;
  cache[(b * S + positions[b]) * W + j] = src[b * src_cols + src_col + j];
}

template <class V>
void launch_cache_write(void* cache, int64_t B, int64_t S, int64_t W, const void* src,
                        int64_t src_cols, int64_t src_col, const int32_t* positions,
                        cudaStream_t stream) {
  constexpr int kThreads = 128;
  const dim3 grid(static_cast<unsigned>((W + kThreads - 1) / kThreads), static_cast<unsigned>(B));
  cache_write_kernel<V><<<grid, kThreads, 0, stream>>>(static_cast<V*>(cache), S, W,
                                                       static_cast<const V*>(src), src_cols, src_col,
                                                       positions);
  TS_CUDA_CHECK_LAUNCH("cache_write_kernel");
}

}  // namespace

void cache_write(void* cache, int64_t B, int64_t S, int64_t W, const void* src, int64_t src_cols,
                 int64_t src_col, const int32_t* positions, size_t element_bytes,
                 cudaStream_t stream) {
  NvtxRange range("cache_write");
  if (B == 0 || W == 0) return;
  const auto aligned = [&](size_t unit) {
    return (W * element_bytes) % unit == 0 && (src_cols * element_bytes) % unit == 0 &&
           (src_col * element_bytes) % unit == 0 && reinterpret_cast<uintptr_t>(cache) % unit == 0 &&
           reinterpret_cast<uintptr_t>(src) % unit == 0;
  };
  if (aligned(16)) {
    const int64_t k = 16 / static_cast<int64_t>(element_bytes);
    return launch_cache_write<int4>(cache, B, S, W / k, src, src_cols / k, src_col / k, positions, stream);
  }
  if (element_bytes == 2)
    return launch_cache_write<uint16_t>(cache, B, S, W, src, src_cols, src_col, positions, stream);
  if (element_bytes == 4)
    return launch_cache_write<uint32_t>(cache, B, S, W, src, src_cols, src_col, positions, stream);
  throw InternalError("cache_write: elements of " + std::to_string(element_bytes) + " bytes");
}

void attention_decode(void* out, const void* q, const void* kv, const int32_t* positions,
                      int64_t pos, const AttentionShape& s, DType dtype, cudaStream_t stream) {
  NvtxRange range("attention_decode");
  const int64_t widest = std::max(s.head_dim, s.v_dim());
  dispatch_float(dtype, "attention_decode", [&](auto tag) {
    using T = decltype(tag);
    if (widest <= 32) return launch<T, 1>(out, q, kv, positions, pos, s, stream);
    if (widest <= 64) return launch<T, 2>(out, q, kv, positions, pos, s, stream);
    if (widest <= 128) return launch<T, 4>(out, q, kv, positions, pos, s, stream);
    if (widest <= kMaxHeadDim) return launch<T, 8>(out, q, kv, positions, pos, s, stream);
    throw InternalError("attention_decode: head_dim " + std::to_string(widest) + " (at most " +
                        std::to_string(kMaxHeadDim) + " on CUDA)");
  });
}

}  // namespace tessera::cuda
