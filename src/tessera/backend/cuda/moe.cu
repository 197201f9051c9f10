#include "tessera/backend/cuda/moe.cuh"

#include <climits>
#include <cmath>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/backend/cuda/reduce.cuh"
#include "tessera/core/error.h"

namespace tessera::cuda {
namespace {

// The router, loss and dweights kernels give each token one warp; blocks hold a few warps.
constexpr int kWarps = 4;
constexpr int kWarpThreads = 32 * kWarps;
// Row kernels (permute, combine): one block of this many threads per row.
constexpr int kRowThreads = 128;

constexpr size_t align_up(size_t bytes, size_t to = 256) {
  return (bytes + to - 1) / to * to;
}

__device__ __forceinline__ double warp_sum_double(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += warp_shfl_xor(v, offset);
  return v;
}

__device__ __forceinline__ double warp_max_double(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmax(v, warp_shfl_xor(v, offset));
  return v;
}

// The (score, index) pair that wins across the warp: the larger score, ties to the lower
// index; a lane without a candidate passes index INT_MAX. Every lane receives the winner.
__device__ __forceinline__ void warp_argmax(double& score, int& index) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const double s = warp_shfl_xor(score, offset);
    const int i = warp_shfl_xor(index, offset);
    if (i != INT_MAX && (index == INT_MAX || s > score || (s == score && i < index))) {
      score = s;
      index = i;
    }
  }
}

__device__ __forceinline__ double sigmoid_d(double x) {
  return 1.0 / (1.0 + exp(-x));
}

template <class T>
__device__ __forceinline__ double load_d(const T* p) {
  return static_cast<double>(to_float(*p));
}

// Per-warp shared state of the router kernels: E selection scores, E flags for taken and
// allowed experts, G group scores and flags, the K chosen experts.
struct RouterSmem {
  double* select;
  double* group_score;
  int* chosen;
  char* taken;
  char* allowed;
  char* group_taken;
};

size_t router_smem_bytes_per_warp(int64_t E, int64_t G, int64_t K) {
  return align_up(E * 8, 16) + align_up(G * 8, 16) + align_up(K * 4, 16) + align_up(E, 16) * 2 +
         align_up(G, 16);
}

__device__ RouterSmem router_smem(char* base, int64_t E, int64_t G, int64_t K) {
  const size_t per_warp = align_up(E * 8, 16) + align_up(G * 8, 16) + align_up(K * 4, 16) +
                          align_up(E, 16) * 2 + align_up(G, 16);
  char* p = base + per_warp * (threadIdx.x / 32);
  RouterSmem s;
  s.select = reinterpret_cast<double*>(p);
  p += align_up(E * 8, 16);
  s.group_score = reinterpret_cast<double*>(p);
  p += align_up(G * 8, 16);
  s.chosen = reinterpret_cast<int*>(p);
  p += align_up(K * 4, 16);
  s.taken = p;
  p += align_up(E, 16);
  s.allowed = p;
  p += align_up(E, 16);
  s.group_taken = p;
  return s;
}

// The k largest of score[0..n) whose flag in `skip` is 0 (and `allowed` 1 where given), into
// out[0..k) in decreasing order; marks them in skip. Ties to the lower index.
__device__ void warp_top_k(const double* score, int n, int k, char* skip, const char* allowed,
                           int* out) {
  const int lane = threadIdx.x % 32;
  for (int j = 0; j < k; ++j) {
    double best = 0;
    int at = INT_MAX;
    for (int i = lane; i < n; i += 32) {
      if (skip[i] || (allowed && !allowed[i])) continue;
      if (at == INT_MAX || score[i] > best) best = score[i], at = i;  // ascending i: first max
    }
    warp_argmax(best, at);
    if (lane == 0) {
      out[j] = at;
      skip[at] = 1;
    }
    warp_sync();
  }
}

// Softmax denominators of one token's logits: every lane gets max and sum(exp(z - max)).
template <class T>
__device__ void warp_softmax_stats(const T* z, int E, double& max, double& sum) {
  const int lane = threadIdx.x % 32;
  double m = -INFINITY;
  for (int e = lane; e < E; e += 32) m = fmax(m, load_d(z + e));
  max = warp_max_double(m);
  double s = 0;
  for (int e = lane; e < E; e += 32) s += exp(load_d(z + e) - max);
  sum = warp_sum_double(s);
}

// The unscaled weights u (K, lane 0's registers into `u`) of the chosen experts.
template <class T>
__device__ void routing_weights(double* u, const T* z, const int* chosen, const MoeRouting& r,
                                double max, double sum) {
  const int K = static_cast<int>(r.topk);
  if (r.sigmoid) {
    double total = 0;
    for (int k = 0; k < K; ++k) total += u[k] = sigmoid_d(load_d(z + chosen[k]));
    if (K > 1)
      for (int k = 0; k < K; ++k) u[k] /= total + 1e-20;
  } else if (r.pre_softmax) {
    for (int k = 0; k < K; ++k) u[k] = exp(load_d(z + chosen[k]) - max) / sum;
  } else {
    double m = -INFINITY, total = 0;
    for (int k = 0; k < K; ++k) m = fmax(m, load_d(z + chosen[k]));
    for (int k = 0; k < K; ++k) total += u[k] = exp(load_d(z + chosen[k]) - m);
    for (int k = 0; k < K; ++k) u[k] /= total;
  }
}

template <class T>
__global__ void moe_router_forward_kernel(int32_t* indices, float* weights, const T* logits,
                                          const float* bias, int64_t N, MoeRouting r) {
  extern __shared__ __align__(16) char smem[];
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (n >= N) return;  // whole warps leave together
  const int E = static_cast<int>(r.experts), K = static_cast<int>(r.topk);
  const int G = static_cast<int>(r.num_groups);
  const int lane = threadIdx.x % 32;
  RouterSmem s = router_smem(smem, E, G, K);
  const T* z = logits + n * E;
  double max = 0, sum = 1;
  if (r.pre_softmax) warp_softmax_stats(z, E, max, sum);
  if (r.force_balance) {
    if (lane == 0)
      for (int k = 0; k < K; ++k) s.chosen[k] = static_cast<int>((n * K + k) % E);
  } else {
    for (int e = lane; e < E; e += 32) {
      const double v = load_d(z + e);
      s.select[e] = r.sigmoid       ? sigmoid_d(v) + (bias ? static_cast<double>(bias[e]) : 0.0)
                    : r.pre_softmax ? exp(v - max) / sum
                                    : v;
      s.taken[e] = 0;
      s.allowed[e] = 1;
    }
    warp_sync();
    if (G > 0) {
      // group_limited_topk: a group's score is the sum of its top (K / group_topk) scores.
      const int per_group = E / G, best_of = K / static_cast<int>(r.group_topk);
      for (int g = lane; g < G; g += 32) {
        double total = 0;
        for (int j = 0; j < best_of; ++j) {
          int at = -1;
          for (int i = g * per_group; i < (g + 1) * per_group; ++i)
            if (!s.taken[i] && (at < 0 || s.select[i] > s.select[at])) at = i;
          s.taken[at] = 1;
          total += s.select[at];
        }
        for (int i = g * per_group; i < (g + 1) * per_group; ++i) s.taken[i] = 0;
        s.group_score[g] = total;
        s.group_taken[g] = 0;
      }
      warp_sync();
      int* kept = s.chosen;  // scratch for the chosen groups; overwritten below
      warp_top_k(s.group_score, G, static_cast<int>(r.group_topk), s.group_taken, nullptr, kept);
      for (int e = lane; e < E; e += 32) s.allowed[e] = s.group_taken[e / per_group];
      warp_sync();
    }
    warp_top_k(s.select, E, K, s.taken, G > 0 ? s.allowed : nullptr, s.chosen);
  }
  warp_sync();
  if (lane == 0) {
    double u[kMaxRouterTopk];
    routing_weights(u, z, s.chosen, r, max, sum);
    const double scale = r.scaling != 0.0f ? r.scaling : 1.0;
    for (int k = 0; k < K; ++k) {
      indices[n * K + k] = s.chosen[k];
      weights[n * K + k] = static_cast<float>(u[k] * scale);
    }
  }
}

template <class T>
__global__ void moe_router_backward_kernel(float* dlogits, const float* dweights, const T* logits,
                                           const int32_t* indices, int64_t N, MoeRouting r) {
  __shared__ double ds[kWarps][kMaxRouterTopk];  // d/d(selected logit or score), per slot
  __shared__ double gp_shared[kWarps];
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (n >= N) return;
  const int E = static_cast<int>(r.experts), K = static_cast<int>(r.topk);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const T* z = logits + n * E;
  const int32_t* chosen = indices + n * K;
  double max = 0, sum = 1;
  if (r.pre_softmax) warp_softmax_stats(z, E, max, sum);
  if (lane == 0) {
    double u[kMaxRouterTopk], g[kMaxRouterTopk];
    int c[kMaxRouterTopk];
    for (int k = 0; k < K; ++k) c[k] = chosen[k];
    routing_weights(u, z, c, r, max, sum);
    const double scale = r.scaling != 0.0f ? r.scaling : 1.0;
    double gu = 0;
    for (int k = 0; k < K; ++k) {
      g[k] = scale * dweights[n * K + k];
      gu += g[k] * u[k];
    }
    if (r.sigmoid) {
      double S = 0, gs = 0;
      for (int k = 0; k < K; ++k) {
        const double sk = sigmoid_d(load_d(z + c[k]));
        S += sk;
        gs += g[k] * sk;
      }
      const double denom = S + 1e-20;
      for (int k = 0; k < K; ++k) {
        const double sk = sigmoid_d(load_d(z + c[k]));
        const double dsk = K > 1 ? g[k] / denom - gs / (denom * denom) : g[k];
        ds[warp][k] = dsk * sk * (1.0 - sk);
      }
    } else if (r.pre_softmax) {
      for (int k = 0; k < K; ++k) ds[warp][k] = g[k];
      gp_shared[warp] = gu;
    } else {
      for (int k = 0; k < K; ++k) ds[warp][k] = u[k] * (g[k] - gu);
    }
  }
  warp_sync();
  for (int e = lane; e < E; e += 32) {
    double v = 0;
    if (r.pre_softmax) {
      double ge = 0;
      for (int k = 0; k < K; ++k)
        if (chosen[k] == e) ge += ds[warp][k];
      v = exp(load_d(z + e) - max) / sum * (ge - gp_shared[warp]);
    } else {
      for (int k = 0; k < K; ++k)
        if (chosen[k] == e) v += ds[warp][k];
    }
    dlogits[n * E + e] = static_cast<float>(v);
  }
}

// The load-balancing scores P of one token (aux_scores in the reference), into `P` (E).
template <class T>
__device__ void warp_aux_scores(double* P, const T* z, const MoeRouting& r) {
  const int E = static_cast<int>(r.experts), lane = threadIdx.x % 32;
  if (!r.sigmoid) {
    double max, sum;
    warp_softmax_stats(z, E, max, sum);
    for (int e = lane; e < E; e += 32) P[e] = exp(load_d(z + e) - max) / sum;
  } else {
    double local = 0;
    for (int e = lane; e < E; e += 32) local += P[e] = sigmoid_d(load_d(z + e));
    const double total = warp_sum_double(local);
    if (r.topk > 1)
      for (int e = lane; e < E; e += 32) P[e] /= total + 1e-20;
  }
  warp_sync();
}

__global__ void count_sequence_experts_kernel(int32_t* counts, const int32_t* indices,
                                              int64_t slots, int64_t slots_per_seq, int64_t E) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < slots) atomicAdd(&counts[(i / slots_per_seq) * E + indices[i]], 1);
}

// One warp per token: its share of the loss into partial[n], its gradient into dlogits.
template <class T>
__global__ void moe_aux_loss_kernel(float* partial, float* dlogits, const T* logits,
                                    const int32_t* counts, int64_t N, int64_t seq_len, MoeRouting r,
                                    double coef, float grad_scale) {
  extern __shared__ __align__(16) double P_all[];
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (n >= N) return;
  const int E = static_cast<int>(r.experts), lane = threadIdx.x % 32;
  double* P = P_all + static_cast<int64_t>(threadIdx.x / 32) * E;
  const T* z = logits + n * E;
  const int32_t* f = counts + (n / seq_len) * E;
  warp_aux_scores(P, z, r);
  double local = 0;
  for (int e = lane; e < E; e += 32) local += coef * f[e] * P[e];
  const double share = warp_sum_double(local);
  if (lane == 0 && partial) partial[n] = static_cast<float>(share);
  if (!dlogits) return;
  // g_e = coef f_e, then through the scores (aux_scores_backward in the reference).
  if (!r.sigmoid) {
    const double gp = share;  // sum_e g_e P_e
    for (int e = lane; e < E; e += 32)
      dlogits[n * E + e] += static_cast<float>(grad_scale * P[e] * (coef * f[e] - gp));
    return;
  }
  double s_sum = 0, gs = 0;
  for (int e = lane; e < E; e += 32) {
    const double s = sigmoid_d(load_d(z + e));
    s_sum += s;
    gs += coef * f[e] * s;
  }
  s_sum = warp_sum_double(s_sum);
  gs = warp_sum_double(gs);
  const double denom = s_sum + 1e-20;
  for (int e = lane; e < E; e += 32) {
    const double s = sigmoid_d(load_d(z + e)), g = coef * f[e];
    const double d = r.topk > 1 ? g / denom - gs / (denom * denom) : g;
    dlogits[n * E + e] += static_cast<float>(grad_scale * d * s * (1.0 - s));
  }
}

template <class T>
__global__ void moe_z_loss_kernel(float* partial, float* dlogits, const T* logits, int64_t N,
                                  int64_t E, float grad_scale) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (n >= N) return;
  const int lane = threadIdx.x % 32;
  const T* z = logits + n * E;
  double max, sum;
  warp_softmax_stats(z, static_cast<int>(E), max, sum);
  const double lse = max + log(sum);
  if (lane == 0 && partial) partial[n] = static_cast<float>(lse * lse / N);
  if (!dlogits) return;
  for (int e = lane; e < E; e += 32)
    dlogits[n * E + e] += static_cast<float>(grad_scale * 2.0 * lse * exp(load_d(z + e) - lse) / N);
}

__global__ void moe_expert_counts_kernel(float* counts, const int32_t* indices, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // Whole numbers below 2^24 add exactly in any order.
  if (i < n) atomicAdd(&counts[indices[i]], 1.0f);
}

// ---- dispatch ----

constexpr int kPlanThreads = 1024;

// Block e counts the slots routed to expert e.
__global__ void count_expert_slots_kernel(int32_t* counts, const int32_t* indices, int64_t slots) {
  __shared__ float shared[32];
  const int e = blockIdx.x;
  float local = 0;
  for (int64_t i = threadIdx.x; i < slots; i += blockDim.x) local += indices[i] == e ? 1.0f : 0.0f;
  const float total = block_sum(local, shared);
  if (threadIdx.x == 0) counts[e] = static_cast<int32_t>(total);
}

// Block e: its group's offset, then the rows of its slots in slot order (a block-wide prefix
// count over the slots, in chunks), and the inverse map src[row] = slot.
__global__ void plan_expert_rows_kernel(int32_t* rows, int32_t* offsets, int32_t* src,
                                        const int32_t* counts, const int32_t* indices,
                                        int64_t slots, int64_t E, int64_t align) {
  __shared__ int warp_total[32];
  __shared__ int base_shared;
  const int e = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    int64_t offset = 0;
    for (int j = 0; j < e; ++j) offset += (counts[j] + align - 1) / align * align;
    offsets[e] = static_cast<int32_t>(offset);
    if (e == E - 1)
      offsets[E] = static_cast<int32_t>(offset + (counts[e] + align - 1) / align * align);
    base_shared = static_cast<int>(offset);
  }
  __syncthreads();
  int base = base_shared;
  for (int64_t start = 0; start < slots; start += blockDim.x) {
    const int64_t i = start + threadIdx.x;
    const bool mine = i < slots && indices[i] == e;
    const unsigned ballot = warp_ballot(mine);
    if (lane == 0) warp_total[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, chunk = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) {
      if (w < warp) before += warp_total[w];
      chunk += warp_total[w];
    }
    if (mine) {
      const int row = base + before + __popc(ballot & ((1u << lane) - 1u));
      rows[i] = row;
      src[row] = static_cast<int32_t>(i);
    }
    base += chunk;
    __syncthreads();  // warp_total is rewritten by the next chunk
  }
}

// Block e: which of expert e's pairs stay within its capacity (MoeCapacity): kept[i] = e for
// those, -1 for the dropped ones; slots of other experts are left to their blocks. By
// position the first `capacity` pairs stay; by weight (weights >= 0, so their bit patterns
// order like the values) the `capacity` largest, found by a bitwise search for the
// capacity-th largest pattern, ties at it kept in slot order.
__global__ void capacity_keep_kernel(int32_t* kept, float* dropped, const int32_t* indices,
                                     const float* weights, int64_t slots, int64_t capacity,
                                     bool by_position) {
  __shared__ float shared[32];
  __shared__ int warp_total[32];
  const int e = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warps = static_cast<int>(blockDim.x / 32);
  // Pairs of e whose weight pattern is >= x (bits > x when strict).
  auto count_from = [&](uint32_t x, bool strict) {
    float local = 0;
    for (int64_t i = threadIdx.x; i < slots; i += blockDim.x) {
      if (indices[i] != e) continue;
      const uint32_t b = __float_as_uint(weights[i]);
      local += (strict ? b > x : b >= x) ? 1.0f : 0.0f;
    }
    return static_cast<int64_t>(block_sum(local, shared));
  };
  float local = 0;
  for (int64_t i = threadIdx.x; i < slots; i += blockDim.x) local += indices[i] == e ? 1.0f : 0.0f;
  const int64_t count = static_cast<int64_t>(block_sum(local, shared));
  // Every pair stays under capacity; by weight, those above the threshold pattern always do
  // and `ties` of those at it (in slot order).
  uint32_t threshold = 0;
  int64_t ties = capacity;
  const bool all = count <= capacity;
  if (dropped != nullptr && !all && threadIdx.x == 0)
    atomicAdd(dropped, static_cast<float>(count - capacity));
  if (!all && !by_position) {
    for (int bit = 31; bit >= 0; --bit) {  // the largest x with count_from(x) >= capacity
      const uint32_t candidate = threshold | (1u << bit);
      if (count_from(candidate, false) >= capacity) threshold = candidate;
    }
    ties = capacity - count_from(threshold, true);
  }
  int base = 0;
  for (int64_t start = 0; start < slots; start += blockDim.x) {
    const int64_t i = start + threadIdx.x;
    const bool mine = i < slots && indices[i] == e;
    uint32_t b = 0;
    if (mine && !by_position) b = __float_as_uint(weights[i]);
    // The pairs that compete for the remaining places, counted in slot order.
    const bool queued = mine && (all ? false : by_position ? true : b == threshold);
    const unsigned ballot = warp_ballot(queued);
    if (lane == 0) warp_total[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, chunk = 0;
    for (int w = 0; w < warps; ++w) {
      if (w < warp) before += warp_total[w];
      chunk += warp_total[w];
    }
    if (mine) {
      bool keep = all || (!by_position && b > threshold);
      if (queued) keep = base + before + __popc(ballot & ((1u << lane) - 1u)) < ties;
      kept[i] = keep ? e : -1;
    }
    base += chunk;
    __syncthreads();  // warp_total is rewritten by the next chunk
  }
}

// Row `row` of out (R, C): source row src[row] / K of in (a token) scaled by nothing, or zero.
template <class T, int VEC>
__global__ void gather_token_rows_kernel(T* out, const T* in, const int32_t* src, int64_t K,
                                         int64_t C) {
  const int64_t row = blockIdx.x;
  const int32_t slot = src[row];
  T* dst = out + row * C;
  for (int64_t c = threadIdx.x * VEC; c < C; c += kRowThreads * VEC) {
    float v[VEC];
    if (slot < 0) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = 0.0f;
    } else {
      load_floats<T, VEC>(in + (slot / K) * C + c, v);
    }
    store_floats<T, VEC>(dst + c, v);
  }
}

// dyp row: weights[slot] * dout[slot / K], or zero for rows that hold no token.
template <class T, int VEC>
__global__ void scatter_grad_rows_kernel(T* dyp, const T* dout, const float* weights,
                                         const int32_t* src, int64_t K, int64_t C) {
  const int64_t row = blockIdx.x;
  const int32_t slot = src[row];
  const float w = slot < 0 ? 0.0f : weights[slot];
  for (int64_t c = threadIdx.x * VEC; c < C; c += kRowThreads * VEC) {
    float v[VEC];
    if (slot < 0) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = 0.0f;
    } else {
      load_floats<T, VEC>(dout + (slot / K) * C + c, v);
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] *= w;
    }
    store_floats<T, VEC>(dyp + row * C + c, v);
  }
}

__global__ void invert_rows_kernel(int32_t* src, const int32_t* rows, int64_t slots) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < slots && rows[i] >= 0) src[rows[i]] = static_cast<int32_t>(i);
}

// Token n: out[n] += sum_k w[n, k] * yp[rows[n, k]] (w = null: weight 1), slots in order.
template <class T, int VEC>
__global__ void combine_rows_kernel(T* out, const T* yp, const int32_t* rows, const float* weights,
                                    int64_t K, int64_t C) {
  const int64_t n = blockIdx.x;
  for (int64_t c = threadIdx.x * VEC; c < C; c += kRowThreads * VEC) {
    float acc[VEC], v[VEC];
    load_floats<T, VEC>(out + n * C + c, acc);
    float sum[VEC] = {};
    for (int64_t k = 0; k < K; ++k) {
      const int32_t row = rows[n * K + k];
      if (row < 0) continue;  // a dropped pair
      const float w = weights ? weights[n * K + k] : 1.0f;
      load_floats<T, VEC>(yp + static_cast<int64_t>(row) * C + c, v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum[j] += w * v[j];
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] += sum[j];
    store_floats<T, VEC>(out + n * C + c, acc);
  }
}

// dweights[n, k] = dout[n] . yp[rows[n, k]]: one block per token, a block sum per slot.
template <class T>
__global__ void slot_dots_kernel(float* dweights, const T* dout, const T* yp, const int32_t* rows,
                                 int64_t K, int64_t C) {
  __shared__ float shared[32];
  const int64_t n = blockIdx.x;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t row = rows[n * K + k];
    if (row < 0) {  // a dropped pair (the same branch for the whole block)
      if (threadIdx.x == 0) dweights[n * K + k] = 0.0f;
      continue;
    }
    const T* y = yp + static_cast<int64_t>(row) * C;
    float local = 0;
    for (int64_t c = threadIdx.x; c < C; c += kRowThreads)
      local += to_float(dout[n * C + c]) * to_float(y[c]);
    const float total = block_sum(local, shared);
    if (threadIdx.x == 0) dweights[n * K + k] = total;
  }
}

// One block: the mean in double (counts are whole numbers, summed exactly in any order), then
// each expert's step.
__global__ void moe_expert_bias_update_kernel(float* bias, const float* counts, int64_t E,
                                              float rate) {
  __shared__ double partial[kRowThreads];
  double local = 0;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) local += counts[e];
  partial[threadIdx.x] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int i = 0; i < kRowThreads; ++i) total += partial[i];
    partial[0] = total;
  }
  __syncthreads();
  const double mean = partial[0] / static_cast<double>(E);
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    const double offset = mean - static_cast<double>(counts[e]);
    const double sign = offset > 0 ? 1.0 : offset < 0 ? -1.0 : 0.0;
    bias[e] = static_cast<float>(static_cast<double>(bias[e]) + sign * rate);
  }
}

__global__ void scale_floats_kernel(float* x, int64_t n, float factor) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= factor;
}

// Calls launch(T{}, VEC) with 16-byte packs when C and every pointer allow them.
template <class Launch>
void launch_rows(const char* name, int64_t C, DType dtype,
                 std::initializer_list<const void*> pointers, Launch&& launch) {
  dispatch_float(dtype, name, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = kVec16<T>;
    bool vec = C % kVec == 0;
    for (const void* p : pointers) vec = vec && is_aligned(p, 16);
    if (vec) {
      launch(T{}, std::integral_constant<int, kVec>{});
    } else {
      launch(T{}, std::integral_constant<int, 1>{});
    }
  });
}

int64_t token_warp_blocks(int64_t N) {
  return ceil_div(N, kWarps);
}

void check_router(const MoeRouting& r) {
  if (r.experts > kMaxRouterExperts || r.topk > kMaxRouterTopk)
    throw InternalError("cuda moe router: at most " + std::to_string(kMaxRouterExperts) +
                        " experts and top-" + std::to_string(kMaxRouterTopk) + ", got " +
                        std::to_string(r.experts) + " and top-" + std::to_string(r.topk));
}

}  // namespace

void moe_router_forward(int32_t* indices, float* weights, const void* logits, DType dtype,
                        const float* bias, int64_t N, const MoeRouting& r, cudaStream_t stream) {
  NvtxRange range("moe_router_forward");
  if (N == 0) return;
  check_router(r);
  const size_t smem = router_smem_bytes_per_warp(r.experts, r.num_groups, r.topk) * kWarps;
  dispatch_float(dtype, "moe_router_forward", [&](auto tag) {
    using T = decltype(tag);
    auto kernel = moe_router_forward_kernel<T>;
    if (smem > 48 * 1024)
      TS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
    const int64_t blocks = token_warp_blocks(N);
    check_grid("moe_router_forward", blocks);
    kernel<<<blocks, kWarpThreads, smem, stream>>>(indices, weights, static_cast<const T*>(logits),
                                                   bias, N, r);
  });
  TS_CUDA_CHECK_LAUNCH("moe_router_forward_kernel");
}

void moe_router_backward(float* dlogits, const float* dweights, const void* logits, DType dtype,
                         const int32_t* indices, int64_t N, const MoeRouting& r,
                         cudaStream_t stream) {
  NvtxRange range("moe_router_backward");
  if (N == 0) return;
  check_router(r);
  dispatch_float(dtype, "moe_router_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t blocks = token_warp_blocks(N);
    check_grid("moe_router_backward", blocks);
    moe_router_backward_kernel<T><<<blocks, kWarpThreads, 0, stream>>>(
        dlogits, dweights, static_cast<const T*>(logits), indices, N, r);
  });
  TS_CUDA_CHECK_LAUNCH("moe_router_backward_kernel");
}

size_t moe_loss_scratch_bytes(int64_t N, int64_t E, int64_t B) {
  return align_up(static_cast<size_t>(B * E) * sizeof(int32_t)) +
         align_up(static_cast<size_t>(N) * sizeof(float)) + sum_scratch_bytes(N);
}

void moe_aux_loss(float* loss, float* dlogits, const void* logits, DType dtype,
                  const int32_t* indices, int64_t N, const MoeRouting& r, int64_t seq,
                  float grad_scale, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  NvtxRange range("moe_aux_loss");
  if (N == 0) return;
  const int64_t E = r.experts, K = r.topk, T_len = seq > 0 ? seq : N, B = N / T_len;
  if (scratch_bytes < moe_loss_scratch_bytes(N, E, B))
    throw_cuda_error(cudaErrorInvalidValue, "moe_aux_loss: scratch too small", __FILE__, __LINE__);
  auto* counts = static_cast<int32_t*>(scratch);
  auto* partial = reinterpret_cast<float*>(static_cast<char*>(scratch) +
                                           align_up(static_cast<size_t>(B * E) * sizeof(int32_t)));
  void* sum_scratch = reinterpret_cast<char*>(partial) + align_up(static_cast<size_t>(N) * 4);
  TS_CUDA_CHECK(cudaMemsetAsync(counts, 0, static_cast<size_t>(B * E) * sizeof(int32_t), stream));
  const int64_t slots = N * K;
  count_sequence_experts_kernel<<<ceil_div(slots, 256), 256, 0, stream>>>(counts, indices, slots,
                                                                          T_len * K, E);
  TS_CUDA_CHECK_LAUNCH("count_sequence_experts_kernel");
  const double coef = seq > 0
                          ? static_cast<double>(E) / (static_cast<double>(T_len) * K * T_len * B)
                          : static_cast<double>(E) / (static_cast<double>(K) * N * N);
  const size_t smem = static_cast<size_t>(kWarps * E) * sizeof(double);
  dispatch_float(dtype, "moe_aux_loss", [&](auto tag) {
    using T = decltype(tag);
    auto kernel = moe_aux_loss_kernel<T>;
    if (smem > 48 * 1024)
      TS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
    kernel<<<token_warp_blocks(N), kWarpThreads, smem, stream>>>(
        loss ? partial : nullptr, dlogits, static_cast<const T*>(logits), counts, N, T_len, r, coef,
        grad_scale);
  });
  TS_CUDA_CHECK_LAUNCH("moe_aux_loss_kernel");
  if (loss) sum(loss, partial, N, /*accumulate=*/true, sum_scratch, sum_scratch_bytes(N), stream);
}

void moe_z_loss(float* loss, float* dlogits, const void* logits, DType dtype, int64_t N, int64_t E,
                float grad_scale, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  NvtxRange range("moe_z_loss");
  if (N == 0) return;
  if (scratch_bytes < moe_loss_scratch_bytes(N, E, 0))
    throw_cuda_error(cudaErrorInvalidValue, "moe_z_loss: scratch too small", __FILE__, __LINE__);
  auto* partial = static_cast<float*>(scratch);
  void* sum_scratch = static_cast<char*>(scratch) + align_up(static_cast<size_t>(N) * 4);
  dispatch_float(dtype, "moe_z_loss", [&](auto tag) {
    using T = decltype(tag);
    moe_z_loss_kernel<T><<<token_warp_blocks(N), kWarpThreads, 0, stream>>>(
        loss ? partial : nullptr, dlogits, static_cast<const T*>(logits), N, E, grad_scale);
  });
  TS_CUDA_CHECK_LAUNCH("moe_z_loss_kernel");
  if (loss) sum(loss, partial, N, /*accumulate=*/true, sum_scratch, sum_scratch_bytes(N), stream);
}

void moe_expert_counts(float* counts, const int32_t* indices, int64_t n, cudaStream_t stream) {
  NvtxRange range("moe_expert_counts");
  if (n == 0) return;
  moe_expert_counts_kernel<<<ceil_div(n, 256), 256, 0, stream>>>(counts, indices, n);
  TS_CUDA_CHECK_LAUNCH("moe_expert_counts_kernel");
}

void moe_expert_bias_update(float* bias, const float* counts, int64_t E, float rate,
                            cudaStream_t stream) {
  NvtxRange range("moe_expert_bias_update");
  if (E == 0) return;
  moe_expert_bias_update_kernel<<<1, kRowThreads, 0, stream>>>(bias, counts, E, rate);
  TS_CUDA_CHECK_LAUNCH("moe_expert_bias_update_kernel");
}

size_t moe_permute_scratch_bytes(int64_t R, int64_t E, int64_t slots, int64_t capacity) {
  return align_up(static_cast<size_t>(E) * sizeof(int32_t)) +
         align_up(static_cast<size_t>(R) * sizeof(int32_t)) +
         (capacity > 0 ? align_up(static_cast<size_t>(slots) * sizeof(int32_t)) : 0);
}

void moe_permute(void* xp, int32_t* rows, int32_t* offsets, const void* x, const int32_t* indices,
                 int64_t N, int64_t K, int64_t C, int64_t E, int64_t R, int64_t align,
                 int64_t capacity, bool by_position, const float* weights, float* dropped,
                 DType dtype, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  NvtxRange range("moe_permute");
  const int64_t slots = N * K;
  if (scratch_bytes < moe_permute_scratch_bytes(R, E, slots, capacity))
    throw_cuda_error(cudaErrorInvalidValue, "moe_permute: scratch too small", __FILE__, __LINE__);
  auto* counts = static_cast<int32_t*>(scratch);
  auto* src = reinterpret_cast<int32_t*>(static_cast<char*>(scratch) +
                                         align_up(static_cast<size_t>(E) * sizeof(int32_t)));
  TS_CUDA_CHECK(cudaMemsetAsync(src, 0xff, static_cast<size_t>(R) * sizeof(int32_t), stream));
  check_grid("moe_permute", E);
  if (capacity > 0) {
    // The pairs that stay: the rest get row -1 and no place in a group.
    auto* kept = reinterpret_cast<int32_t*>(reinterpret_cast<char*>(src) +
                                            align_up(static_cast<size_t>(R) * sizeof(int32_t)));
    if (dropped != nullptr) TS_CUDA_CHECK(cudaMemsetAsync(dropped, 0, sizeof(float), stream));
    capacity_keep_kernel<<<E, kPlanThreads, 0, stream>>>(kept, dropped, indices, weights, slots,
                                                         capacity, by_position);
    TS_CUDA_CHECK_LAUNCH("capacity_keep_kernel");
    TS_CUDA_CHECK(
        cudaMemsetAsync(rows, 0xff, static_cast<size_t>(slots) * sizeof(int32_t), stream));
    indices = kept;
  }
  count_expert_slots_kernel<<<E, kPlanThreads, 0, stream>>>(counts, indices, slots);
  TS_CUDA_CHECK_LAUNCH("count_expert_slots_kernel");
  plan_expert_rows_kernel<<<E, kPlanThreads, 0, stream>>>(rows, offsets, src, counts, indices,
                                                          slots, E, align);
  TS_CUDA_CHECK_LAUNCH("plan_expert_rows_kernel");
  if (R == 0 || C == 0) return;
  check_grid("moe_permute", R);
  launch_rows("moe_permute", C, dtype, {xp, x}, [&](auto tag, auto vec_tag) {
    using T = decltype(tag);
    constexpr int VEC = decltype(vec_tag)::value;
    gather_token_rows_kernel<T, VEC>
        <<<R, kRowThreads, 0, stream>>>(static_cast<T*>(xp), static_cast<const T*>(x), src, K, C);
  });
  TS_CUDA_CHECK_LAUNCH("gather_token_rows_kernel");
}

void moe_permute_backward(void* dx, const void* dxp, const int32_t* rows, int64_t N, int64_t K,
                          int64_t C, DType dtype, cudaStream_t stream) {
  NvtxRange range("moe_permute_backward");
  if (N == 0 || C == 0) return;
  check_grid("moe_permute_backward", N);
  launch_rows("moe_permute_backward", C, dtype, {dx, dxp}, [&](auto tag, auto vec_tag) {
    using T = decltype(tag);
    constexpr int VEC = decltype(vec_tag)::value;
    combine_rows_kernel<T, VEC><<<N, kRowThreads, 0, stream>>>(
        static_cast<T*>(dx), static_cast<const T*>(dxp), rows, nullptr, K, C);
  });
  TS_CUDA_CHECK_LAUNCH("combine_rows_kernel");
}

void moe_unpermute(void* out, const void* yp, const int32_t* rows, const float* weights, int64_t N,
                   int64_t K, int64_t C, DType dtype, cudaStream_t stream) {
  NvtxRange range("moe_unpermute");
  if (N == 0 || C == 0) return;
  check_grid("moe_unpermute", N);
  launch_rows("moe_unpermute", C, dtype, {out, yp}, [&](auto tag, auto vec_tag) {
    using T = decltype(tag);
    constexpr int VEC = decltype(vec_tag)::value;
    combine_rows_kernel<T, VEC><<<N, kRowThreads, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(yp), rows, weights, K, C);
  });
  TS_CUDA_CHECK_LAUNCH("combine_rows_kernel");
}

size_t moe_unpermute_backward_scratch_bytes(int64_t R) {
  return align_up(static_cast<size_t>(R) * sizeof(int32_t));
}

void moe_unpermute_backward(void* dyp, float* dweights, const void* dout, const void* yp,
                            const int32_t* rows, const float* weights, int64_t N, int64_t K,
                            int64_t C, int64_t R, DType dtype, void* scratch, size_t scratch_bytes,
                            cudaStream_t stream) {
  NvtxRange range("moe_unpermute_backward");
  if (scratch_bytes < moe_unpermute_backward_scratch_bytes(R))
    throw_cuda_error(cudaErrorInvalidValue, "moe_unpermute_backward: scratch too small", __FILE__,
                     __LINE__);
  auto* src = static_cast<int32_t*>(scratch);
  TS_CUDA_CHECK(cudaMemsetAsync(src, 0xff, static_cast<size_t>(R) * sizeof(int32_t), stream));
  const int64_t slots = N * K;
  if (slots > 0) {
    invert_rows_kernel<<<ceil_div(slots, 256), 256, 0, stream>>>(src, rows, slots);
    TS_CUDA_CHECK_LAUNCH("invert_rows_kernel");
  }
  if (R > 0 && C > 0) {
    check_grid("moe_unpermute_backward", R);
    launch_rows("moe_unpermute_backward", C, dtype, {dyp, dout}, [&](auto tag, auto vec_tag) {
      using T = decltype(tag);
      constexpr int VEC = decltype(vec_tag)::value;
      scatter_grad_rows_kernel<T, VEC><<<R, kRowThreads, 0, stream>>>(
          static_cast<T*>(dyp), static_cast<const T*>(dout), weights, src, K, C);
    });
    TS_CUDA_CHECK_LAUNCH("scatter_grad_rows_kernel");
  }
  if (N == 0) return;
  check_grid("moe_unpermute_backward", N);
  dispatch_float(dtype, "moe_unpermute_backward", [&](auto tag) {
    using T = decltype(tag);
    slot_dots_kernel<T><<<N, kRowThreads, 0, stream>>>(dweights, static_cast<const T*>(dout),
                                                       static_cast<const T*>(yp), rows, K, C);
  });
  TS_CUDA_CHECK_LAUNCH("slot_dots_kernel");
}

void scale_floats(float* x, int64_t n, float factor, cudaStream_t stream) {
  if (n == 0) return;
  scale_floats_kernel<<<ceil_div(n, 256), 256, 0, stream>>>(x, n, factor);
  TS_CUDA_CHECK_LAUNCH("scale_floats_kernel");
}

// ---- QK norm ----

namespace {

// AttentionShape's sizes as device code reads them.
struct QkShape {
  int64_t tokens, heads, kv_heads, head_dim, width;
};

QkShape qk_shape(const AttentionShape& s) {
  return {s.tokens(), s.heads, s.kv_heads, s.head_dim, s.qkv_width()};
}

// One block per token; warp w normalises heads w, w + kWarps, ...; the block copies the
// value heads.
template <class T>
__global__ void qk_norm_forward_kernel(T* out, float* rstd, const T* qkv, const T* q_weight,
                                       const T* k_weight, QkShape s, float eps) {
  const int64_t n = blockIdx.x, D = s.head_dim, W = s.width;
  const int64_t normed = s.heads + s.kv_heads;
  const int lane = threadIdx.x % 32;
  for (int64_t h = threadIdx.x / 32; h < normed; h += kWarps) {
    const T* x = qkv + n * W + h * D;
    const T* w = h < s.heads ? q_weight : k_weight;
    float sq = 0;
    for (int64_t d = lane; d < D; d += 32) {
      const float v = to_float(x[d]);
      sq += v * v;
    }
    const float r = rsqrtf(warp_sum(sq) / static_cast<float>(D) + eps);
    if (lane == 0) rstd[n * normed + h] = r;
    for (int64_t d = lane; d < D; d += 32)
      out[n * W + h * D + d] = from_float<T>(to_float(x[d]) * r * to_float(w[d]));
  }
  for (int64_t i = normed * D + threadIdx.x; i < W; i += blockDim.x)
    out[n * W + i] = qkv[n * W + i];
}

constexpr int kQkRowsPerBlock = 16;

// kQkRowsPerBlock tokens per block; each warp accumulates its heads' weight-gradient terms in
// its own shared row (no races), and the block writes the warps' sum as its partial row.
template <class T>
__global__ void qk_norm_backward_kernel(T* dqkv, float* partial_q, float* partial_k, const T* dout,
                                        const T* qkv, const T* q_weight, const T* k_weight,
                                        const float* rstd, QkShape s) {
  extern __shared__ float acc[];  // (kWarps, 2, D)
  const int64_t D = s.head_dim, W = s.width, N = s.tokens;
  const int64_t normed = s.heads + s.kv_heads;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t i = threadIdx.x; i < kWarps * 2 * D; i += blockDim.x) acc[i] = 0.0f;
  __syncthreads();
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kQkRowsPerBlock;
  const int64_t n1 = min(N, n0 + kQkRowsPerBlock);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t h = warp; h < normed; h += kWarps) {
      const T* x = qkv + n * W + h * D;
      const T* g = dout + n * W + h * D;
      const T* w = h < s.heads ? q_weight : k_weight;
      float* dw = acc + (warp * 2 + (h < s.heads ? 0 : 1)) * D;
      const float r = rstd[n * normed + h];
      float gwx = 0;
      for (int64_t d = lane; d < D; d += 32) {
        const float gv = to_float(g[d]), xv = to_float(x[d]);
        gwx += gv * to_float(w[d]) * xv;
        dw[d] += gv * xv * r;
      }
      const float coef = r * r * warp_sum(gwx) / static_cast<float>(D);
      // Each lane writes only the elements it read: dqkv may be dout.
      for (int64_t d = lane; d < D; d += 32) {
        const float gv = to_float(g[d]), xv = to_float(x[d]);
        dqkv[n * W + h * D + d] = from_float<T>(r * (to_float(w[d]) * gv - xv * coef));
      }
    }
    if (dqkv != dout)
      for (int64_t i = normed * D + threadIdx.x; i < W; i += blockDim.x)
        dqkv[n * W + i] = dout[n * W + i];
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float q = 0, k = 0;
    for (int w = 0; w < kWarps; ++w) {
      q += acc[(w * 2) * D + d];
      k += acc[(w * 2 + 1) * D + d];
    }
    partial_q[blockIdx.x * D + d] = q;
    partial_k[blockIdx.x * D + d] = k;
  }
}

}  // namespace

void qk_norm_forward(void* out, float* rstd, const void* qkv, const void* q_weight,
                     const void* k_weight, const AttentionShape& s, float eps, DType dtype,
                     cudaStream_t stream) {
  NvtxRange range("qk_norm_forward");
  const int64_t N = s.tokens();
  if (N == 0) return;
  check_grid("qk_norm_forward", N);
  dispatch_float(dtype, "qk_norm_forward", [&](auto tag) {
    using T = decltype(tag);
    qk_norm_forward_kernel<T><<<N, kWarpThreads, 0, stream>>>(
        static_cast<T*>(out), rstd, static_cast<const T*>(qkv), static_cast<const T*>(q_weight),
        static_cast<const T*>(k_weight), qk_shape(s), eps);
  });
  TS_CUDA_CHECK_LAUNCH("qk_norm_forward_kernel");
}

size_t qk_norm_backward_scratch_bytes(const AttentionShape& s) {
  return 2 * align_up(static_cast<size_t>(ceil_div(s.tokens(), kQkRowsPerBlock) * s.head_dim) *
                      sizeof(float));
}

void qk_norm_backward(void* dqkv, void* dq_weight, void* dk_weight, DType grad_dtype,
                      const void* dout, const void* qkv, const void* q_weight, const void* k_weight,
                      const float* rstd, const AttentionShape& s, DType dtype, void* scratch,
                      size_t scratch_bytes, cudaStream_t stream) {
  NvtxRange range("qk_norm_backward");
  const int64_t N = s.tokens(), D = s.head_dim;
  if (N == 0) return;
  if (scratch_bytes < qk_norm_backward_scratch_bytes(s))
    throw_cuda_error(cudaErrorInvalidValue, "qk_norm_backward: scratch too small", __FILE__,
                     __LINE__);
  const int64_t blocks = ceil_div(N, kQkRowsPerBlock);
  auto* partial_q = static_cast<float*>(scratch);
  auto* partial_k = reinterpret_cast<float*>(
      static_cast<char*>(scratch) + align_up(static_cast<size_t>(blocks * D) * sizeof(float)));
  const size_t smem = static_cast<size_t>(kWarps * 2 * D) * sizeof(float);
  dispatch_float(dtype, "qk_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    qk_norm_backward_kernel<T><<<blocks, kWarpThreads, smem, stream>>>(
        static_cast<T*>(dqkv), partial_q, partial_k, static_cast<const T*>(dout),
        static_cast<const T*>(qkv), static_cast<const T*>(q_weight),
        static_cast<const T*>(k_weight), rstd, qk_shape(s));
  });
  TS_CUDA_CHECK_LAUNCH("qk_norm_backward_kernel");
  column_sums_accumulate(dq_weight, grad_dtype, partial_q, blocks, D, stream);
  column_sums_accumulate(dk_weight, grad_dtype, partial_k, blocks, D, stream);
}

}  // namespace tessera::cuda
