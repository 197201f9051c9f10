#include "tessera/backend/cuda/attention_rowwise.cuh"

#include <algorithm>
#include <cmath>
#include <string>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/core/error.h"

namespace tessera::cuda {
namespace {

constexpr int kWarps = 4;  // rows per block

struct RowwiseParams {
  int64_t seq = 0, heads = 0, kv_heads = 0, group = 1, width = 0;
  int D = 0, Dv = 0;
  bool causal = true;
  int64_t window = 0;
  float scale = 0.0f;
  const int32_t* document_starts = nullptr;  // (B, T): packed documents; null: none
};

RowwiseParams params_of(const AttentionShape& s) {
  RowwiseParams p;
  p.seq = s.seq;
  p.heads = s.heads;
  p.kv_heads = s.kv_heads;
  p.group = s.heads / s.kv_heads;
  p.width = s.qkv_width();
  p.D = static_cast<int>(s.head_dim);
  p.Dv = static_cast<int>(s.v_dim());
  p.causal = s.causal;
  p.window = s.window;
  p.scale = s.scale;
  if (s.document_starts.defined())
    p.document_starts = static_cast<const int32_t*>(s.document_starts.data);
  return p;
}

// The op API's masks (reference.h, visible_keys): query i of sequence b sees key j iff j <= i
// when causal, i - window < j when window > 0, and j >= the first token of i's document with
// document starts. Keys of query i, and queries of key j, are one range each: documents start
// in order, so the queries that see key j end where the next document starts.
__device__ __forceinline__ void keys_of(const RowwiseParams& p, int64_t b, int64_t i,
                                        int64_t& first, int64_t& last) {
  first = p.window > 0 ? (i - p.window + 1 > 0 ? i - p.window + 1 : 0) : 0;
  if (p.document_starts) {
    const int64_t start = p.document_starts[b * p.seq + i];
    first = start > first ? start : first;
  }
  last = p.causal ? i : p.seq - 1;
}

__device__ __forceinline__ void queries_of(const RowwiseParams& p, int64_t b, int64_t j,
                                           int64_t& first, int64_t& last) {
  first = p.causal ? j : 0;
  last = p.window > 0 ? (j + p.window - 1 < p.seq - 1 ? j + p.window - 1 : p.seq - 1) : p.seq - 1;
  if (p.document_starts) {  // causal (op check): the last query of j's document, by bisection
    const int32_t* starts = p.document_starts + b * p.seq;
    int64_t lo = first, hi = last;  // starts[first] <= j: query j is in j's document
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (starts[mid] <= j) lo = mid;
      else hi = mid - 1;
    }
    last = lo;
  }
}

// Lane-strided row values in registers: element d = lane + 32 k, zero past n.
template <class T, int PER_LANE>
__device__ __forceinline__ void load_row(float (&r)[PER_LANE], const T* row, int n, int lane,
                                         float scale = 1.0f) {
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) {
    const int d = lane + 32 * k;
    r[k] = d < n ? to_float(row[d]) * scale : 0.0f;
  }
}

template <class T, int PER_LANE>
__device__ __forceinline__ float dot_row(const float (&r)[PER_LANE], const T* row, int n,
                                         int lane) {
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) {
    const int d = lane + 32 * k;
    if (d < n) acc += r[k] * to_float(row[d]);
  }
  return warp_sum(acc);
}

// One warp per (query row i, head h, sequence b): an online softmax over the visible keys.
template <class T, int PER_LANE>
__global__ void attention_rowwise_forward_kernel(T* out, float* lse, const T* qkv,
                                                 RowwiseParams p) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t i = blockIdx.x * int64_t{kWarps} + warp, h = blockIdx.y, b = blockIdx.z;
  if (i >= p.seq) return;
  const int64_t kv = h / p.group;
  const T* base = qkv + b * p.seq * p.width;
  const T* keys = base + p.heads * p.D + kv * p.D;
  const T* values = base + (p.heads + p.kv_heads) * p.D + kv * p.Dv;
  float q[PER_LANE], acc[PER_LANE];
  load_row<T, PER_LANE>(q, base + i * p.width + h * p.D, p.D, lane, p.scale);
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) acc[k] = 0.0f;
  int64_t first, last;
  keys_of(p, b, i, first, last);
  float m = -INFINITY, l = 0.0f;
  for (int64_t j = first; j <= last; ++j) {
    const float score = dot_row<T, PER_LANE>(q, keys + j * p.width, p.D, lane);
    const float m_new = fmaxf(m, score);
    const float correction = __expf(m - m_new), pj = __expf(score - m_new);
    l = l * correction + pj;
    const T* v = values + j * p.width;
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
      const int d = lane + 32 * k;
      if (d < p.Dv) acc[k] = acc[k] * correction + pj * to_float(v[d]);
    }
    m = m_new;
  }
  T* o = out + ((b * p.seq + i) * p.heads + h) * p.Dv;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) {
    const int d = lane + 32 * k;
    if (d < p.Dv) o[d] = from_float<T>(acc[k] * inv);
  }
  if (lane == 0) lse[(b * p.heads + h) * p.seq + i] = l > 0.0f ? m + logf(l) : -INFINITY;
}

// delta (B, H, T) = dout_i . out_i per query row and head.
template <class T, int PER_LANE>
__global__ void attention_rowwise_delta_kernel(float* delta, const T* dout, const T* out,
                                               RowwiseParams p) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t i = blockIdx.x * int64_t{kWarps} + warp, h = blockIdx.y, b = blockIdx.z;
  if (i >= p.seq) return;
  const int64_t at = ((b * p.seq + i) * p.heads + h) * p.Dv;
  float g[PER_LANE];
  load_row<T, PER_LANE>(g, dout + at, p.Dv, lane);
  const float d = dot_row<T, PER_LANE>(g, out + at, p.Dv, lane);
  if (lane == 0) delta[(b * p.heads + h) * p.seq + i] = d;
}

// With p_ij = exp(scale q_i . k_j - lse_i) and ds_ij = p_ij (dout_i . v_j - delta_i):
// dq_i = scale sum_j ds_ij k_j, one warp per query row.
template <class T, int PER_LANE>
__global__ void attention_rowwise_dq_kernel(T* dqkv, const T* qkv, const T* dout, const float* lse,
                                            const float* delta, RowwiseParams p) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t i = blockIdx.x * int64_t{kWarps} + warp, h = blockIdx.y, b = blockIdx.z;
  if (i >= p.seq) return;
  const int64_t kv = h / p.group, stat = (b * p.heads + h) * p.seq + i;
  const T* base = qkv + b * p.seq * p.width;
  const T* keys = base + p.heads * p.D + kv * p.D;
  const T* values = base + (p.heads + p.kv_heads) * p.D + kv * p.Dv;
  float q[PER_LANE], g[PER_LANE], dq[PER_LANE];
  load_row<T, PER_LANE>(q, base + i * p.width + h * p.D, p.D, lane, p.scale);
  load_row<T, PER_LANE>(g, dout + ((b * p.seq + i) * p.heads + h) * p.Dv, p.Dv, lane);
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) dq[k] = 0.0f;
  const float lse_i = lse[stat], delta_i = delta[stat];
  int64_t first, last;
  keys_of(p, b, i, first, last);
  if (isfinite(lse_i)) {
    for (int64_t j = first; j <= last; ++j) {
      const T* k_row = keys + j * p.width;
      const float pj = __expf(dot_row<T, PER_LANE>(q, k_row, p.D, lane) - lse_i);
      const float ds = pj * (dot_row<T, PER_LANE>(g, values + j * p.width, p.Dv, lane) - delta_i);
#pragma unroll
      for (int k = 0; k < PER_LANE; ++k) {
        const int d = lane + 32 * k;
        if (d < p.D) dq[k] += ds * to_float(k_row[d]);
      }
    }
  }
  T* out_row = dqkv + (b * p.seq + i) * p.width + h * p.D;
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) {
    const int d = lane + 32 * k;
    if (d < p.D) out_row[d] = from_float<T>(dq[k] * p.scale);
  }
}

// dk_j = scale sum_(h, i) ds_ij q_i and dv_j = sum_(h, i) p_ij dout_i over the query heads of
// key/value head kv and the queries that see key j, one warp per key row.
template <class T, int PER_LANE>
__global__ void attention_rowwise_dkdv_kernel(T* dqkv, const T* qkv, const T* dout,
                                              const float* lse, const float* delta,
                                              RowwiseParams p) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t j = blockIdx.x * int64_t{kWarps} + warp, kv = blockIdx.y, b = blockIdx.z;
  if (j >= p.seq) return;
  const T* base = qkv + b * p.seq * p.width;
  float k_row[PER_LANE], v_row[PER_LANE], dk[PER_LANE], dv[PER_LANE];
  load_row<T, PER_LANE>(k_row, base + j * p.width + (p.heads + kv) * p.D, p.D, lane);
  load_row<T, PER_LANE>(v_row, base + j * p.width + (p.heads + p.kv_heads) * p.D + kv * p.Dv, p.Dv,
                        lane);
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) dk[k] = dv[k] = 0.0f;
  int64_t first, last;
  queries_of(p, b, j, first, last);
  for (int64_t h = kv * p.group; h < (kv + 1) * p.group; ++h) {
    for (int64_t i = first; i <= last; ++i) {
      const int64_t stat = (b * p.heads + h) * p.seq + i;
      const float lse_i = lse[stat];
      if (!isfinite(lse_i)) continue;
      const T* q = base + i * p.width + h * p.D;
      const T* g = dout + ((b * p.seq + i) * p.heads + h) * p.Dv;
      const float pj = __expf(p.scale * dot_row<T, PER_LANE>(k_row, q, p.D, lane) - lse_i);
      const float ds = pj * (dot_row<T, PER_LANE>(v_row, g, p.Dv, lane) - delta[stat]);
#pragma unroll
      for (int k = 0; k < PER_LANE; ++k) {
        const int d = lane + 32 * k;
        if (d < p.D) dk[k] += ds * to_float(q[d]);
        if (d < p.Dv) dv[k] += pj * to_float(g[d]);
      }
    }
  }
  T* row = dqkv + (b * p.seq + j) * p.width;
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) {
    const int d = lane + 32 * k;
    if (d < p.D) row[(p.heads + kv) * p.D + d] = from_float<T>(dk[k] * p.scale);
    if (d < p.Dv) row[(p.heads + p.kv_heads) * p.D + kv * p.Dv + d] = from_float<T>(dv[k]);
  }
}

void check_shape(const AttentionShape& s) {
  const int64_t widest = std::max(s.head_dim, s.v_dim());
  if (widest > kRowwiseMaxHeadDim || s.heads > 65535 || s.batch > 65535 ||
      s.heads % s.kv_heads != 0)
    throw InternalError(
        "attention (row-wise kernels): unsupported shape H=" + std::to_string(s.heads) +
        " KV=" + std::to_string(s.kv_heads) + " B=" + std::to_string(s.batch) +
        " D=" + std::to_string(s.head_dim) + " Dv=" + std::to_string(s.v_dim()) +
        " (heads and batch at most 65535, "
        "head dims at most " +
        std::to_string(kRowwiseMaxHeadDim) + ")");
}

// Calls f(T{}, PER_LANE constant) for the dtype and the wider head.
template <class F>
void dispatch(const AttentionShape& s, DType dtype, const char* op, F&& f) {
  const int64_t widest = std::max(s.head_dim, s.v_dim());
  dispatch_float(dtype, op, [&](auto tag) {
    if (widest <= 32) return f(tag, std::integral_constant<int, 1>{});
    if (widest <= 64) return f(tag, std::integral_constant<int, 2>{});
    if (widest <= 128) return f(tag, std::integral_constant<int, 4>{});
    return f(tag, std::integral_constant<int, 8>{});
  });
}

dim3 rows_grid(const AttentionShape& s, int64_t heads) {
  return dim3(static_cast<unsigned>(ceil_div(s.seq, kWarps)), static_cast<unsigned>(heads),
              static_cast<unsigned>(s.batch));
}

}  // namespace

void attention_rowwise_forward(void* out, float* lse, const void* qkv, const AttentionShape& s,
                               DType dtype, cudaStream_t stream) {
  NvtxRange range("attention_forward");
  check_shape(s);
  if (s.tokens() == 0) return;
  const RowwiseParams p = params_of(s);
  dispatch(s, dtype, "attention_forward", [&](auto tag, auto per_lane) {
    using T = decltype(tag);
    constexpr int PER_LANE = decltype(per_lane)::value;
    attention_rowwise_forward_kernel<T, PER_LANE>
        <<<rows_grid(s, s.heads), kWarps * 32, 0, stream>>>(static_cast<T*>(out), lse,
                                                            static_cast<const T*>(qkv), p);
    TS_CUDA_CHECK_LAUNCH("attention_rowwise_forward_kernel");
  });
}

size_t attention_rowwise_backward_scratch_bytes(const AttentionShape& s) {
  return static_cast<size_t>(s.batch * s.heads * s.seq) * sizeof(float);
}

void attention_rowwise_backward(void* dqkv, const void* dout, const void* out, const float* lse,
                                const void* qkv, const AttentionShape& s, void* scratch,
                                DType dtype, cudaStream_t stream) {
  NvtxRange range("attention_backward");
  check_shape(s);
  if (s.tokens() == 0) return;
  const RowwiseParams p = params_of(s);
  float* delta = static_cast<float*>(scratch);
  dispatch(s, dtype, "attention_backward", [&](auto tag, auto per_lane) {
    using T = decltype(tag);
    constexpr int PER_LANE = decltype(per_lane)::value;
    const T* g = static_cast<const T*>(dout);
    const T* x = static_cast<const T*>(qkv);
    T* dx = static_cast<T*>(dqkv);
    attention_rowwise_delta_kernel<T, PER_LANE><<<rows_grid(s, s.heads), kWarps * 32, 0, stream>>>(
        delta, g, static_cast<const T*>(out), p);
    TS_CUDA_CHECK_LAUNCH("attention_rowwise_delta_kernel");
    attention_rowwise_dq_kernel<T, PER_LANE>
        <<<rows_grid(s, s.heads), kWarps * 32, 0, stream>>>(dx, x, g, lse, delta, p);
    TS_CUDA_CHECK_LAUNCH("attention_rowwise_dq_kernel");
    attention_rowwise_dkdv_kernel<T, PER_LANE>
        <<<rows_grid(s, s.kv_heads), kWarps * 32, 0, stream>>>(dx, x, g, lse, delta, p);
    TS_CUDA_CHECK_LAUNCH("attention_rowwise_dkdv_kernel");
  });
}

}  // namespace tessera::cuda
