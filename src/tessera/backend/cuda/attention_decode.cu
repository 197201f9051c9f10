#include "tessera/backend/cuda/attention_decode.cuh"

#include <algorithm>
#include <cmath>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"

namespace tessera::cuda {
namespace {

// One block per (query head, sequence, split of its keys). Decoding reads every visible key
// and value once and does two multiply-adds per element read, so the kernel is bound by
// memory latency and bandwidth, not by math: each warp walks its share of the split's keys
// with an online softmax, its lanes holding D/32 of the head dimensions. A key's score is a
// reduction over the warp, a chain of shuffles: a warp takes kKeysPerStep keys at once so
// that their loads and chains overlap. The warps' partial results are combined at the end of
// the block, the splits' by attention_decode_combine_kernel. Splits keep the GPU busy when
// there are few (head, sequence) pairs (one sequence: a head per block would use a quarter
// of an H100's SMs); each split takes an equal share of its sequence's visible keys, so the
// split count, fixed by the shapes, holds however long the sequences grow (a captured step
// replays it). PER_LANE is the register count fixed at compile time (D up to 32 x PER_LANE);
// a head dimension that is not a multiple of 32 leaves the last lanes idle in their last
// slot. Values may be narrower than keys (Dv < D: multi-latent attention); PER_LANE covers
// the wider of the two.
constexpr int kWarps = 8;
constexpr int kKeysPerStep = 4;
constexpr int kMaxHeadDim = 256;
// Splits aim for this many blocks in all; a split keeps at least kMinSplitKeys of a full cache.
constexpr int64_t kTargetBlocks = 512, kMinSplitKeys = 128;

// A split's result when there are several: its running max and sum, and its unnormalised
// output (Dv), per (sequence, head, split).
struct SplitHeader {
  float m, l;
};

template <class T, int PER_LANE>
__global__ void __launch_bounds__(kWarps * 32)
    attention_decode_kernel(T* out, SplitHeader* headers, float* partial, const T* q, const T* kv,
                            const int32_t* positions, int64_t S, int64_t H, int64_t KV, int D, int Dv,
                            int64_t pos, int64_t window, float scale) {
  const int64_t h = blockIdx.x, b = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // The visible keys: the op API's rule (reference.h, visible_keys) for query row `last`;
  // this split's equal share of them.
  const int64_t last = positions ? positions[b] : pos;
  const int64_t first = window > 0 ? max(int64_t{0}, last - window + 1) : 0;
  const int64_t keys = last - first + 1, share = (keys + splits - 1) / splits;
  const int64_t begin = first + split * share, end = min(last + 1, begin + share);
  const int64_t row = KV * (D + Dv);  // elements per cached position
  const T* key_rows = kv + b * S * row + (h / (H / KV)) * D;
  const T* value_rows = kv + b * S * row + KV * D + (h / (H / KV)) * Dv;

  float qd[PER_LANE], acc[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int d = lane + 32 * i;
    qd[i] = d < D ? to_float(q[(b * H + h) * D + d]) * scale : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int64_t j0 = begin + warp * kKeysPerStep; j0 < end; j0 += kWarps * kKeysPerStep) {
    float score[kKeysPerStep];
#pragma unroll
    for (int k = 0; k < kKeysPerStep; ++k) {
      float dot = 0.0f;
      if (j0 + k < end) {
        const T* key = key_rows + (j0 + k) * row;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i)
          if (lane + 32 * i < D) dot += qd[i] * to_float(key[lane + 32 * i]);
      }
      score[k] = dot;
    }
#pragma unroll
    for (int k = 0; k < kKeysPerStep; ++k) score[k] = j0 + k < end ? warp_sum(score[k]) : -INFINITY;
    float m_new = m;
#pragma unroll
    for (int k = 0; k < kKeysPerStep; ++k) m_new = fmaxf(m_new, score[k]);
    const float correction = __expf(m - m_new);
    float p[kKeysPerStep];
    l *= correction;
#pragma unroll
    for (int k = 0; k < kKeysPerStep; ++k) p[k] = __expf(score[k] - m_new), l += p[k];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      if (lane + 32 * i >= Dv) continue;
      float a = acc[i] * correction;
#pragma unroll
      for (int k = 0; k < kKeysPerStep; ++k)
        if (j0 + k < end) a += p[k] * to_float(value_rows[(j0 + k) * row + lane + 32 * i]);
      acc[i] = a;
    }
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
  const int64_t slot = (b * H + h) * splits + split;
  if (splits > 1 && threadIdx.x == 0) headers[slot] = {m_all, l_all};
  for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < kWarps; ++w)
      if (warp_l[w] > 0.0f) o += warp_acc[w][d] * __expf(warp_m[w] - m_all);
    if (splits > 1)
      partial[slot * Dv + d] = o;
    else
      out[(b * H + h) * Dv + d] = from_float<T>(o / l_all);
  }
}

// The grouped kernel, for keys and values whose widths are multiples of 8 (every Llama, Qwen
// and DeepSeek shape): one block per (KV head, sequence, split of its keys), whose G = H / KV
// query heads share each key and value row it reads (the per-query-head kernel above reads
// them G times, once per block). A row is spread over LPK lanes of 8 contiguous elements each
// (one 16-byte load in bf16), so a warp takes 32 / LPK keys at once and kUnroll of those
// steps are in flight; each group of LPK lanes keeps its own online softmax per query head,
// and the block combines its groups at the end. GMAX is G rounded up to a power of two.
constexpr int kGroupedWarps = 4, kUnroll = 2, kMaxGroupHeads = 8;

template <class T, int LPK, int GMAX>
__global__ void __launch_bounds__(kGroupedWarps * 32)
    attention_decode_grouped_kernel(T* out, SplitHeader* headers, float* partial, const T* q,
                                    const T* kv, const int32_t* positions, int64_t S, int64_t H,
                                    int64_t KV, int D, int Dv, int64_t pos, int64_t window,
                                    float scale) {
  constexpr int kKeysPerWarp = 32 / LPK, kGroups = kGroupedWarps * kKeysPerWarp;
  const int64_t kvh = blockIdx.x, b = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int G = static_cast<int>(H / KV);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int group = warp * kKeysPerWarp + lane / LPK, d0 = (lane % LPK) * 8;
  const bool has_k = d0 < D, has_v = d0 < Dv;
  const int64_t last = positions ? positions[b] : pos;
  const int64_t first = window > 0 ? max(int64_t{0}, last - window + 1) : 0;
  const int64_t keys = last - first + 1, share = (keys + splits - 1) / splits;
  const int64_t begin = first + split * share, end = min(last + 1, begin + share);
  const int64_t row = KV * (D + Dv);
  const T* key_rows = kv + b * S * row + kvh * D + d0;
  const T* value_rows = kv + b * S * row + KV * D + kvh * Dv + d0;

  float qd[GMAX][8], acc[GMAX][8], m[GMAX], l[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (has_k && g < G) {
      load_floats<T, 8>(q + (b * H + kvh * G + g) * D + d0, qd[g]);
#pragma unroll
      for (int i = 0; i < 8; ++i) qd[g][i] *= scale;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) qd[g][i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
    m[g] = -INFINITY, l[g] = 0.0f;
  }
  // Warp-uniform steps (the shuffles need every lane); a lane past the keys skips the update.
  for (int64_t j0 = begin + warp * kKeysPerWarp; j0 < end; j0 += kUnroll * kGroups) {
    float kf[kUnroll][8], vf[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + u * kGroups + lane / LPK;
      if (j < end && has_k) {
        load_floats<T, 8>(key_rows + j * row, kf[u]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) kf[u][i] = 0.0f;
      }
      if (j < end && has_v) {
        load_floats<T, 8>(value_rows + j * row, vf[u]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) vf[u][i] = 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool valid = j0 + u * kGroups + lane / LPK < end;
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) dot += qd[g][i] * kf[u][i];
#pragma unroll
        for (int offset = LPK / 2; offset > 0; offset /= 2)
          dot += warp_shfl_xor(dot, offset);
        if (!valid || g >= G) continue;
        const float m_new = fmaxf(m[g], dot);
        const float correction = __expf(m[g] - m_new), p = __expf(dot - m_new);
        l[g] = l[g] * correction + p;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = acc[g][i] * correction + p * vf[u][i];
        m[g] = m_new;
      }
    }
  }

  __shared__ float group_m[kGroups][GMAX], group_l[kGroups][GMAX];
  __shared__ float group_acc[kGroups][GMAX][LPK * 8];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (lane % LPK == 0) group_m[group][g] = m[g], group_l[group][g] = l[g];
    if (has_v) {
#pragma unroll
      for (int i = 0; i < 8; ++i) group_acc[group][g][d0 + i] = acc[g][i];
    }
  }
  __syncthreads();
  for (int at = threadIdx.x; at < G * Dv; at += blockDim.x) {
    const int g = at / Dv, d = at % Dv;
    float m_all = -INFINITY;
    for (int k = 0; k < kGroups; ++k)
      if (group_l[k][g] > 0.0f) m_all = fmaxf(m_all, group_m[k][g]);
    float l_all = 0.0f, o = 0.0f;
    for (int k = 0; k < kGroups; ++k)
      if (group_l[k][g] > 0.0f) {
        const float w = __expf(group_m[k][g] - m_all);
        l_all += group_l[k][g] * w;
        o += group_acc[k][g][d] * w;
      }
    const int64_t h = kvh * G + g, slot = (b * H + h) * splits + split;
    if (splits == 1) {
      out[(b * H + h) * Dv + d] = from_float<T>(o / l_all);
      continue;
    }
    if (d == 0) headers[slot] = {m_all, l_all};
    partial[slot * Dv + d] = o;
  }
}

// One block per (query head, sequence): its splits' outputs weighed by their sums.
template <class T>
__global__ void attention_decode_combine_kernel(T* out, const SplitHeader* headers, const float* partial,
                                                int64_t H, int64_t splits, int Dv) {
  const int64_t h = blockIdx.x, b = blockIdx.y, first = (b * H + h) * splits;
  float m_all = -INFINITY;
  for (int64_t s = 0; s < splits; ++s)
    if (headers[first + s].l > 0.0f) m_all = fmaxf(m_all, headers[first + s].m);
  float l_all = 0.0f;
  for (int64_t s = 0; s < splits; ++s)
    if (headers[first + s].l > 0.0f) l_all += headers[first + s].l * __expf(headers[first + s].m - m_all);
  for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
    float o = 0.0f;
    for (int64_t s = 0; s < splits; ++s)
      if (headers[first + s].l > 0.0f) o += partial[(first + s) * Dv + d] * __expf(headers[first + s].m - m_all);
    out[(b * H + h) * Dv + d] = from_float<T>(o / l_all);
  }
}

// Whether the grouped kernel runs these shapes: widths in whole 8-element lanes, at most 256,
// at most kMaxGroupHeads query heads per KV head.
bool grouped(const AttentionShape& s) {
  return s.head_dim % 8 == 0 && s.v_dim() % 8 == 0 && std::max(s.head_dim, s.v_dim()) <= kMaxHeadDim &&
         s.heads % s.kv_heads == 0 && s.heads / s.kv_heads <= kMaxGroupHeads;
}

// The splits of each block's keys: enough blocks to fill the GPU, none with fewer than
// kMinSplitKeys of the cache's capacity. From the shapes only, never from positions. The
// grouped kernel's blocks each take a KV head, and are half the size: twice as many, half
// the keys.
int64_t splits_for(const AttentionShape& s, bool grouped_blocks) {
  const int64_t pairs = (grouped_blocks ? s.kv_heads : s.heads) * s.batch;
  const int64_t target = grouped_blocks ? 2 * kTargetBlocks : kTargetBlocks;
  const int64_t min_keys = grouped_blocks ? kMinSplitKeys / 2 : kMinSplitKeys;
  const int64_t capacity = s.window > 0 ? std::min(s.seq, s.window) : s.seq;
  const int64_t wanted = (target + pairs - 1) / pairs;
  return std::clamp<int64_t>(std::min(wanted, capacity / min_keys), 1, 64);
}

template <class T>
void launch_combine(void* out, const SplitHeader* headers, const float* partial, const AttentionShape& s,
                    int64_t splits, cudaStream_t stream) {
  if (splits == 1) return;
  attention_decode_combine_kernel<T><<<dim3(static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch)), 128, 0,
                                       stream>>>(static_cast<T*>(out), headers, partial, s.heads, splits,
                                                 static_cast<int>(s.v_dim()));
  TS_CUDA_CHECK_LAUNCH("attention_decode_combine_kernel");
}

template <class T, int PER_LANE>
void launch(void* out, const void* q, const void* kv, const int32_t* positions, int64_t pos,
            const AttentionShape& s, void* scratch, cudaStream_t stream) {
  const int64_t splits = splits_for(s, false), Dv = s.v_dim();
  auto* headers = static_cast<SplitHeader*>(scratch);
  auto* partial = reinterpret_cast<float*>(headers + s.batch * s.heads * splits);
  const dim3 grid(static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch), static_cast<unsigned>(splits));
  attention_decode_kernel<T, PER_LANE><<<grid, kWarps * 32, 0, stream>>>(
      static_cast<T*>(out), headers, partial, static_cast<const T*>(q), static_cast<const T*>(kv), positions, s.seq,
      s.heads, s.kv_heads, static_cast<int>(s.head_dim), static_cast<int>(Dv), pos, s.window, s.scale);
  TS_CUDA_CHECK_LAUNCH("attention_decode_kernel");
  launch_combine<T>(out, headers, partial, s, splits, stream);
}

template <class T, int LPK, int GMAX>
void launch_grouped(void* out, const void* q, const void* kv, const int32_t* positions, int64_t pos,
                    const AttentionShape& s, void* scratch, cudaStream_t stream) {
  const int64_t splits = splits_for(s, true);
  auto* headers = static_cast<SplitHeader*>(scratch);
  auto* partial = reinterpret_cast<float*>(headers + s.batch * s.heads * splits);
  const dim3 grid(static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch), static_cast<unsigned>(splits));
  attention_decode_grouped_kernel<T, LPK, GMAX><<<grid, kGroupedWarps * 32, 0, stream>>>(
      static_cast<T*>(out), headers, partial, static_cast<const T*>(q), static_cast<const T*>(kv), positions, s.seq,
      s.heads, s.kv_heads, static_cast<int>(s.head_dim), static_cast<int>(s.v_dim()), pos, s.window, s.scale);
  TS_CUDA_CHECK_LAUNCH("attention_decode_grouped_kernel");
  launch_combine<T>(out, headers, partial, s, splits, stream);
}

template <class T, int LPK>
void launch_grouped_heads(void* out, const void* q, const void* kv, const int32_t* positions, int64_t pos,
                          const AttentionShape& s, void* scratch, cudaStream_t stream) {
  const int64_t G = s.heads / s.kv_heads;
  if (G <= 1) return launch_grouped<T, LPK, 1>(out, q, kv, positions, pos, s, scratch, stream);
  if (G <= 2) return launch_grouped<T, LPK, 2>(out, q, kv, positions, pos, s, scratch, stream);
  if (G <= 4) return launch_grouped<T, LPK, 4>(out, q, kv, positions, pos, s, scratch, stream);
  return launch_grouped<T, LPK, 8>(out, q, kv, positions, pos, s, scratch, stream);
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

// Either kernel's: which one runs also depends on the tensors' alignment.
size_t attention_decode_scratch_bytes(const AttentionShape& s) {
  int64_t splits = splits_for(s, false);
  if (grouped(s)) splits = std::max(splits, splits_for(s, true));
  if (splits == 1) return 0;
  return static_cast<size_t>(s.batch * s.heads * splits) * (sizeof(SplitHeader) + s.v_dim() * sizeof(float));
}

void attention_decode(void* out, const void* q, const void* kv, const int32_t* positions,
                      int64_t pos, const AttentionShape& s, DType dtype, void* scratch,
                      size_t scratch_bytes, cudaStream_t stream) {
  NvtxRange range("attention_decode");
  if (scratch_bytes < attention_decode_scratch_bytes(s)) throw InternalError("attention_decode: scratch too small");
  const int64_t widest = std::max(s.head_dim, s.v_dim());
  const bool aligned = reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(kv) % 16 == 0;
  dispatch_float(dtype, "attention_decode", [&](auto tag) {
    using T = decltype(tag);
    if (grouped(s) && aligned) {
      if (widest <= 64) return launch_grouped_heads<T, 8>(out, q, kv, positions, pos, s, scratch, stream);
      if (widest <= 128) return launch_grouped_heads<T, 16>(out, q, kv, positions, pos, s, scratch, stream);
      return launch_grouped_heads<T, 32>(out, q, kv, positions, pos, s, scratch, stream);
    }
    if (widest <= 32) return launch<T, 1>(out, q, kv, positions, pos, s, scratch, stream);
    if (widest <= 64) return launch<T, 2>(out, q, kv, positions, pos, s, scratch, stream);
    if (widest <= 128) return launch<T, 4>(out, q, kv, positions, pos, s, scratch, stream);
    if (widest <= kMaxHeadDim) return launch<T, 8>(out, q, kv, positions, pos, s, scratch, stream);
    throw InternalError("attention_decode: head_dim " + std::to_string(widest) + " (at most " +
                        std::to_string(kMaxHeadDim) + " on CUDA)");
  });
}

}  // namespace tessera::cuda
