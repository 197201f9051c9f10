#include "tessera/backend/cuda/attention_gathered.cuh"

#include <cmath>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/core/error.h"

namespace tessera::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxHeadDim = 256;
constexpr int kDimsPerThread = kMaxHeadDim / kThreads;

struct Shape {
  int64_t B, T, H, KV, D, width, kv_width;  // of qkv's rows and kv_all's
  bool causal;
  int64_t window;
  float scale;
  // (B, segments x T): the first position of each position's document; null: none.
  const int32_t* document_starts;
  int64_t keys;  // segments x T
};

Shape shape_of(const AttentionShape& s, int64_t segments) {
  return {s.batch,
          s.seq,
          s.heads,
          s.kv_heads,
          s.head_dim,
          s.qkv_width(),
          s.kv_width(),
          s.causal,
          s.window,
          s.scale,
          s.document_starts.defined() ? s.document_starts.as<int32_t>() : nullptr,
          segments * s.seq};
}

// Positions `query` and `key` of sequence b.
__device__ __forceinline__ bool visible(const Shape& s, int64_t b, int64_t query, int64_t key) {
  if (s.document_starts && key < s.document_starts[b * s.keys + query]) return false;
  return (!s.causal || key <= query) && (s.window == 0 || query - s.window < key);
}

// Max over a block whose size is a multiple of 32; every thread receives it. shared: 32 floats.
__device__ __forceinline__ float block_max(float v, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, warp_shfl_xor(v, offset));
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : -INFINITY;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, warp_shfl_xor(v, offset));
  __syncthreads();
  return v;
}

template <class T>
__device__ __forceinline__ float dot_row(const float* a, const T* b, int64_t D) {
  float acc = 0.0f;
  for (int64_t d = 0; d < D; ++d) acc = fmaf(a[d], to_float(b[d]), acc);
  return acc;
}

// Row (batch b, token u) of this segment's qkv.
__device__ __forceinline__ int64_t qkv_row(const Shape& s, int64_t b, int64_t u) {
  return (b * s.T + u) * s.width;
}

// Key j's row of kv_all (of sequence b): its key heads, then its value heads.
__device__ __forceinline__ int64_t key_row(const Shape& s, int64_t b, int64_t j) {
  return ((j / s.T * s.B + b) * s.T + j % s.T) * s.kv_width;
}

// One block per (query i, batch b, head h): the visible keys in tiles of kThreads, one score
// per thread, with a running max and sum (online softmax); each thread accumulates its
// kDimsPerThread output dimensions.
template <class T>
__global__ void __launch_bounds__(kThreads)
    gathered_forward_kernel(T* out, float* lse, const T* qkv, const T* kv_all,
                            const int32_t* positions, int64_t segments, int64_t segment, Shape s) {
  __shared__ float q[kMaxHeadDim];
  __shared__ float p[kThreads];
  __shared__ float reduce[32];
  const int64_t i = blockIdx.x, b = blockIdx.y / s.H, h = blockIdx.y % s.H;
  const int64_t kv = h / (s.H / s.KV), keys = segments * s.T;
  const T* q_row = qkv + qkv_row(s, b, i) + h * s.D;
  for (int64_t d = threadIdx.x; d < s.D; d += kThreads) q[d] = to_float(q_row[d]);
  __syncthreads();
  const int64_t qpos = positions[segment * s.T + i];
  float m = -INFINITY, l = 0.0f, acc[kDimsPerThread] = {};
  for (int64_t j0 = 0; j0 < keys; j0 += kThreads) {
    const int64_t j = j0 + threadIdx.x;
    float score = -INFINITY;
    if (j < keys && visible(s, b, qpos, positions[j]))
      score = s.scale * dot_row(q, kv_all + key_row(s, b, j) + kv * s.D, s.D);
    const float tile_max = block_max(score, reduce);
    if (tile_max == -INFINITY) continue;  // the same on every thread
    const float new_m = fmaxf(m, tile_max);
    const float correction = m == -INFINITY ? 0.0f : __expf(m - new_m);
    const float e = score == -INFINITY ? 0.0f : __expf(score - new_m);
    p[threadIdx.x] = e;
    l = l * correction + block_sum(e, reduce);  // its barrier publishes p
#pragma unroll
    for (int c = 0; c < kDimsPerThread; ++c) acc[c] *= correction;
    const int64_t n = keys - j0 < kThreads ? keys - j0 : kThreads;
    for (int64_t jj = 0; jj < n; ++jj) {
      if (p[jj] == 0.0f) continue;
      const int64_t key = j0 + jj;
      const T* v = kv_all + key_row(s, b, key) + (s.KV + kv) * s.D;
#pragma unroll
      for (int c = 0; c < kDimsPerThread; ++c) {
        const int64_t d = threadIdx.x + c * kThreads;
        if (d < s.D) acc[c] = fmaf(p[jj], to_float(v[d]), acc[c]);
      }
    }
    m = new_m;
    __syncthreads();  // p is rewritten by the next tile
  }
  T* o = out + ((b * s.T + i) * s.H + h) * s.D;
#pragma unroll
  for (int c = 0; c < kDimsPerThread; ++c) {
    const int64_t d = threadIdx.x + c * kThreads;
    if (d < s.D) o[d] = from_float<T>(l > 0.0f ? acc[c] / l : 0.0f);
  }
  if (threadIdx.x == 0) lse[(b * s.H + h) * s.T + i] = l > 0.0f ? m + logf(l) : -INFINITY;
}

// Query gradients, one block per (query i, batch b, head h): D_i = dout_i . out_i (kept for the
// key gradients), then dq_i = scale sum_j p_ij (dout_i . v_j - D_i) k_j over the visible keys.
template <class T>
__global__ void __launch_bounds__(kThreads)
    gathered_dq_kernel(T* dqkv, float* row_dot, const T* dout, const T* out, const float* lse,
                       const T* qkv, const T* kv_all, const int32_t* positions, int64_t segments,
                       int64_t segment, Shape s) {
  __shared__ float q[kMaxHeadDim], g[kMaxHeadDim];
  __shared__ float ds[kThreads];
  __shared__ float reduce[32];
  const int64_t i = blockIdx.x, b = blockIdx.y / s.H, h = blockIdx.y % s.H;
  const int64_t kv = h / (s.H / s.KV), keys = segments * s.T;
  const T* q_row = qkv + qkv_row(s, b, i) + h * s.D;
  const int64_t at = ((b * s.T + i) * s.H + h) * s.D;
  float part = 0.0f;
  for (int64_t d = threadIdx.x; d < s.D; d += kThreads) {
    q[d] = to_float(q_row[d]);
    g[d] = to_float(dout[at + d]);
    part = fmaf(g[d], to_float(out[at + d]), part);
  }
  const float D_i = block_sum(part, reduce);  // its barrier publishes q and g
  const float lse_i = lse[(b * s.H + h) * s.T + i];
  if (threadIdx.x == 0) row_dot[(b * s.H + h) * s.T + i] = D_i;
  const int64_t qpos = positions[segment * s.T + i];
  float acc[kDimsPerThread] = {};
  if (lse_i != -INFINITY) {
    for (int64_t j0 = 0; j0 < keys; j0 += kThreads) {
      const int64_t j = j0 + threadIdx.x;
      float d_s = 0.0f;
      if (j < keys && visible(s, b, qpos, positions[j])) {
        const T* k_row = kv_all + key_row(s, b, j);
        const float prob = __expf(s.scale * dot_row(q, k_row + kv * s.D, s.D) - lse_i);
        d_s = prob * (dot_row(g, k_row + (s.KV + kv) * s.D, s.D) - D_i);
      }
      ds[threadIdx.x] = d_s;
      __syncthreads();
      const int64_t n = keys - j0 < kThreads ? keys - j0 : kThreads;
      for (int64_t jj = 0; jj < n; ++jj) {
        if (ds[jj] == 0.0f) continue;
        const int64_t key = j0 + jj;
        const T* k = kv_all + key_row(s, b, key) + kv * s.D;
#pragma unroll
        for (int c = 0; c < kDimsPerThread; ++c) {
          const int64_t d = threadIdx.x + c * kThreads;
          if (d < s.D) acc[c] = fmaf(ds[jj], to_float(k[d]), acc[c]);
        }
      }
      __syncthreads();
    }
  }
  T* dq = dqkv + qkv_row(s, b, i) + h * s.D;
#pragma unroll
  for (int c = 0; c < kDimsPerThread; ++c) {
    const int64_t d = threadIdx.x + c * kThreads;
    if (d < s.D) dq[d] = from_float<T>(s.scale * acc[c]);
  }
}

// Key and value gradients, one block per (key j of any segment, batch b, key/value head kv):
// over the group's query heads and the segment's queries that see key j, in tiles,
// dk_j = scale sum_i ds_ij q_i and dv_j = sum_i p_ij dout_i, into dkv_all.
template <class T>
__global__ void __launch_bounds__(kThreads)
    gathered_dkv_kernel(T* dkv_all, const float* row_dot, const T* dout, const float* lse,
                        const T* qkv, const T* kv_all, const int32_t* positions, int64_t segment,
                        Shape s) {
  __shared__ float k[kMaxHeadDim], v[kMaxHeadDim];
  __shared__ float p[kThreads], ds[kThreads];
  const int64_t j = blockIdx.x, b = blockIdx.y / s.KV, kv = blockIdx.y % s.KV;
  const int64_t group = s.H / s.KV, row = key_row(s, b, j);
  for (int64_t d = threadIdx.x; d < s.D; d += kThreads) {
    k[d] = to_float(kv_all[row + kv * s.D + d]);
    v[d] = to_float(kv_all[row + (s.KV + kv) * s.D + d]);
  }
  __syncthreads();
  const int64_t kpos = positions[j];
  float dk[kDimsPerThread] = {}, dv[kDimsPerThread] = {};
  for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
    for (int64_t i0 = 0; i0 < s.T; i0 += kThreads) {
      const int64_t i = i0 + threadIdx.x;
      float prob = 0.0f, d_s = 0.0f;
      if (i < s.T && visible(s, b, positions[segment * s.T + i], kpos)) {
        const float lse_i = lse[(b * s.H + h) * s.T + i];
        if (lse_i != -INFINITY) {
          const T* q_row = qkv + qkv_row(s, b, i) + h * s.D;
          const T* g_row = dout + ((b * s.T + i) * s.H + h) * s.D;
          float qk = 0.0f, gv = 0.0f;
          for (int64_t d = 0; d < s.D; ++d) {
            qk = fmaf(to_float(q_row[d]), k[d], qk);
            gv = fmaf(to_float(g_row[d]), v[d], gv);
          }
          prob = __expf(s.scale * qk - lse_i);
          d_s = prob * (gv - row_dot[(b * s.H + h) * s.T + i]);
        }
      }
      p[threadIdx.x] = prob;
      ds[threadIdx.x] = d_s;
      __syncthreads();
      const int64_t n = s.T - i0 < kThreads ? s.T - i0 : kThreads;
      for (int64_t ii = 0; ii < n; ++ii) {
        if (p[ii] == 0.0f) continue;
        const int64_t q_i = i0 + ii;
        const T* q_row = qkv + qkv_row(s, b, q_i) + h * s.D;
        const T* g_row = dout + ((b * s.T + q_i) * s.H + h) * s.D;
#pragma unroll
        for (int c = 0; c < kDimsPerThread; ++c) {
          const int64_t d = threadIdx.x + c * kThreads;
          if (d < s.D) {
            dk[c] = fmaf(ds[ii], to_float(q_row[d]), dk[c]);
            dv[c] = fmaf(p[ii], to_float(g_row[d]), dv[c]);
          }
        }
      }
      __syncthreads();
    }
  }
#pragma unroll
  for (int c = 0; c < kDimsPerThread; ++c) {
    const int64_t d = threadIdx.x + c * kThreads;
    if (d >= s.D) continue;
    dkv_all[row + kv * s.D + d] = from_float<T>(s.scale * dk[c]);
    dkv_all[row + (s.KV + kv) * s.D + d] = from_float<T>(dv[c]);
  }
}

void check_shape(const AttentionShape& s, const char* op) {
  TS_CHECK(s.head_dim <= kMaxHeadDim, "cuda {}: head_dim {} above {}", op, s.head_dim, kMaxHeadDim);
  TS_CHECK(s.batch * s.heads <= 65535, "cuda {}: {} batch x heads above 65535", op,
           s.batch * s.heads);
}

}  // namespace

void attention_gathered_forward(void* out, float* lse, const void* qkv, const void* kv_all,
                                const int32_t* positions, int64_t segments, int64_t segment,
                                const AttentionShape& s, DType dtype, cudaStream_t stream) {
  NvtxRange range("attention_gathered_forward");
  if (s.tokens() == 0) return;
  check_shape(s, "attention_gathered_forward");
  check_grid("attention_gathered_forward", s.seq);
  dispatch_float(dtype, "attention_gathered_forward", [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(static_cast<unsigned>(s.seq), static_cast<unsigned>(s.batch * s.heads));
    gathered_forward_kernel<T><<<grid, kThreads, 0, stream>>>(
        static_cast<T*>(out), lse, static_cast<const T*>(qkv), static_cast<const T*>(kv_all),
        positions, segments, segment, shape_of(s, segments));
    TS_CUDA_CHECK_LAUNCH("gathered_forward_kernel");
  });
}

size_t attention_gathered_backward_scratch_bytes(const AttentionShape& s) {
  return static_cast<size_t>(s.batch * s.heads * s.seq) * sizeof(float);
}

void attention_gathered_backward(void* dqkv, void* dkv_all, const void* dout, const void* out,
                                 const float* lse, const void* qkv, const void* kv_all,
                                 const int32_t* positions, int64_t segments, int64_t segment,
                                 const AttentionShape& s, DType dtype, void* scratch,
                                 size_t scratch_bytes, cudaStream_t stream) {
  NvtxRange range("attention_gathered_backward");
  if (s.tokens() == 0) return;
  check_shape(s, "attention_gathered_backward");
  check_grid("attention_gathered_backward", segments * s.seq);
  TS_CHECK(scratch_bytes >= attention_gathered_backward_scratch_bytes(s),
           "cuda attention_gathered_backward: scratch of {} bytes", scratch_bytes);
  auto* row_dot = static_cast<float*>(scratch);
  dispatch_float(dtype, "attention_gathered_backward", [&](auto tag) {
    using T = decltype(tag);
    const Shape sh = shape_of(s, segments);
    const dim3 queries(static_cast<unsigned>(s.seq), static_cast<unsigned>(s.batch * s.heads));
    gathered_dq_kernel<T><<<queries, kThreads, 0, stream>>>(
        static_cast<T*>(dqkv), row_dot, static_cast<const T*>(dout), static_cast<const T*>(out),
        lse, static_cast<const T*>(qkv), static_cast<const T*>(kv_all), positions, segments,
        segment, sh);
    TS_CUDA_CHECK_LAUNCH("gathered_dq_kernel");
    const dim3 keys(static_cast<unsigned>(segments * s.seq),
                    static_cast<unsigned>(s.batch * s.kv_heads));
    gathered_dkv_kernel<T><<<keys, kThreads, 0, stream>>>(
        static_cast<T*>(dkv_all), row_dot, static_cast<const T*>(dout), lse,
        static_cast<const T*>(qkv), static_cast<const T*>(kv_all), positions, segment, sh);
    TS_CUDA_CHECK_LAUNCH("gathered_dkv_kernel");
  });
}

}  // namespace tessera::cuda
