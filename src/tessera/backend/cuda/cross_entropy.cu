#include "tessera/backend/cuda/cross_entropy.cuh"

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"

namespace tessera::cuda {
namespace {

// One block of 512 threads per row, two resident per SM. Pass 1 streams the row once,
// keeping a running (max, sum of exp) per thread (online softmax); a block reduction gives the
// row's log-sum-exp. With a gradient, pass 2 needs the row again: pass 1 copies the first
// ~112 KiB of it into shared memory (half an SM's, so two rows stay in flight and one row's
// start-up and reduction overlap the other's streaming), and pass 2 re-reads only the rest
// from global memory, first and in reverse order, while those lines are the most recently
// loaded ones in L2. Measured on H200 at (4096 x 128256) bf16: loss only 0.26 ms (4.0 TB/s,
// the HBM limit), with the gradient 0.82 ms, where DRAM moves the ideal 1.05 GB read +
// 1.05 GB written and the two exponentials per logit make the special-function unit the
// limit (ncu: XU pipe ~70% busy in pass 1 alone). Next step if it matters: compute part of
// pass 2's exponentials with a polynomial on the FMA pipe (FlashAttention-3's trick).
constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread

struct MaxSum {
  float max, sum;
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.sum * __expf(a.max - m) + b.sum * __expf(b.max - m)};
}

// Block-wide (max, sum) in a fixed order; the result is computed once by thread 0 and
// broadcast, so every thread normalises with the same bits.
__device__ MaxSum block_max_sum(MaxSum v, MaxSum* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const MaxSum other{warp_shfl_down(v.max, offset), warp_shfl_down(v.sum, offset)};
    v = combine(v, other);
  }
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    MaxSum total = shared[0];
    for (int w = 1; w < kThreads / 32; ++w) total = combine(total, shared[w]);
    shared[0] = total;
  }
  __syncthreads();
  return shared[0];
}

constexpr float kLog2e = 1.4426950408889634f;

// exp(x - m) is computed as 2^(x log2e - m log2e) with exp2_approx (the vendor header's: one
// MUFU.EX2 on CUDA), one FFMA and one MUFU per logit: at two exponentials per logit the SFU
// rate (16 per clock per SM) is as much a limit as HBM, so every instruction counts.

// Tree reductions of a pack: depth log2(VEC) instead of a chain of VEC dependent operations.
template <int N>
__device__ __forceinline__ float tree_max(const float* v) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    return fmaxf(tree_max<N / 2>(v), tree_max<N / 2>(v + N / 2));
  }
}

template <int N>
__device__ __forceinline__ float tree_sum(const float* v) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    return tree_sum<N / 2>(v) + tree_sum<N / 2>(v + N / 2);
  }
}

// This thread's (max, sum of exp) over its packs of a row (every kThreads-th pack from its
// index), streamed once with the sum rescaled whenever the max grows.
template <class T, int VEC>
__device__ __forceinline__ MaxSum thread_max_sum(const T* x, int packs) {
  MaxSum acc{-INFINITY, 0.0f};
  for (int q = threadIdx.x; q < packs; q += kThreads) {
    const Pack<T, VEC> pack = load_pack<T, VEC>(x + q * VEC);
    float v[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = to_float(pack.v[k]);
    const float pack_max = tree_max<VEC>(v);
    if (pack_max > acc.max) {
      acc.sum *= exp2_approx((acc.max - pack_max) * kLog2e);
      acc.max = pack_max;
    }
    const float max_log2 = acc.max * kLog2e;
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = exp2_approx(fmaf(v[k], kLog2e, -max_log2));
    acc.sum += tree_sum<VEC>(v);
  }
  return acc;
}

template <class T, int VEC>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(float* losses, T* dlogits, const T* logits, const int32_t* targets,
                         int64_t V, float grad_scale, int cached_packs) {
  extern __shared__ __align__(16) unsigned char smem[];
  auto* cache = reinterpret_cast<Pack<T, VEC>*>(smem);
  __shared__ MaxSum reduce[kThreads / 32];

  const int64_t row = blockIdx.x;
  const T* x = logits + row * V;
  T* dx = dlogits != nullptr ? dlogits + row * V : nullptr;
  const int32_t target = targets[row];
  const int packs = static_cast<int>(V / VEC);  // in-row indices fit in 32 bits

  if (target < 0) {  // ignored position: loss 0, zero gradient, logits never read
    if (threadIdx.x == 0) losses[row] = 0.0f;
    if (dx != nullptr) {
      Pack<T, VEC> zero;
#pragma unroll
      for (int k = 0; k < VEC; ++k) zero.v[k] = from_float<T>(0.0f);
      for (int q = threadIdx.x; q < packs; q += kThreads) store_pack<T, VEC>(dx + q * VEC, zero);
    }
    return;
  }
  const bool valid = target < V;
  // Read before the barrier inside block_max_sum: no thread writes dx (which may be x) before.
  const float x_target = valid ? to_float(x[target]) : NAN;

  // Each thread loads kUnroll packs before it uses any.
  MaxSum acc{-INFINITY, 0.0f};
  for (int q0 = threadIdx.x; q0 < packs; q0 += kThreads * kUnroll) {
    Pack<T, VEC> pack[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int q = q0 + j * kThreads;
      if (q < packs) pack[j] = load_pack<T, VEC>(x + q * VEC);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int q = q0 + j * kThreads;
      if (q >= packs) break;
      if (q < cached_packs) cache[q] = pack[j];
      float v[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = to_float(pack[j].v[k]);
      const float pack_max = tree_max<VEC>(v);
      if (pack_max > acc.max) {  // rescale the running sum once per pack, not per logit
        acc.sum *= exp2_approx((acc.max - pack_max) * kLog2e);
        acc.max = pack_max;
      }
      const float max_log2 = acc.max * kLog2e;
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = exp2_approx(fmaf(v[k], kLog2e, -max_log2));
      acc.sum += tree_sum<VEC>(v);
    }
  }
  const MaxSum total = block_max_sum(acc, reduce);
  if (threadIdx.x == 0) losses[row] = total.max + logf(total.sum) - x_target;
  if (dx == nullptr) return;

  // A target >= V (invalid) turns the whole gradient row into NaN through the scale.
  const float scale = valid ? grad_scale / total.sum : NAN;
  const float max_log2 = total.max * kLog2e;
  const int target_pack = valid ? target / VEC : -1, target_lane = target % VEC;
  for (int i0 = threadIdx.x; i0 < packs; i0 += kThreads * kUnroll) {
    Pack<T, VEC> pack[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int q = packs - 1 - (i0 + j * kThreads);
      if (q >= 0) pack[j] = q < cached_packs ? cache[q] : load_pack<T, VEC>(x + q * VEC);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int q = packs - 1 - (i0 + j * kThreads);
      if (q < 0) break;
      float g[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        g[k] = exp2_approx(fmaf(to_float(pack[j].v[k]), kLog2e, -max_log2)) * scale;
      }
      if (q == target_pack) {
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          if (k == target_lane) g[k] -= grad_scale;
      }
      store_floats<T, VEC>(dx + static_cast<int64_t>(q) * VEC, g);
    }
  }
}

// Vocabulary-parallel cross-entropy, step 1: each row's (max, sum of exp) over this shard,
// streamed once as in cross_entropy_kernel's first pass, then the row's log-sum-exp and the
// target's logit (when the target lies in the shard). One block per row.
template <class T, int VEC>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_shard_stats_kernel(float* stats, const T* logits, const int32_t* targets,
                                     int64_t V, int64_t first_id) {
  __shared__ MaxSum reduce[kThreads / 32];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * V;
  const int packs = static_cast<int>(V / VEC);
  const MaxSum total = block_max_sum(thread_max_sum<T, VEC>(x, packs), reduce);
  if (threadIdx.x != 0) return;
  const int64_t t = static_cast<int64_t>(targets[row]) - first_id;
  stats[2 * row] = total.max + logf(total.sum);
  stats[2 * row + 1] = targets[row] >= 0 && t >= 0 && t < V ? to_float(x[t]) : 0.0f;
}

// Step 2, after the stats of every shard (S, N, 2) are gathered: the row's log-sum-exp over
// the shards and its target logit, combined by thread 0 in shard order (every shard gets the
// same bits), its loss, and the gradient over this shard's columns. One block per row.
template <class T, int VEC>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_shard_kernel(float* losses, T* dlogits, const T* logits, const int32_t* targets,
                               const float* all_stats, int64_t S, int64_t N, int64_t V,
                               int64_t first_id, float grad_scale) {
  __shared__ float lse_shared;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * V;
  T* dx = dlogits != nullptr ? dlogits + row * V : nullptr;
  const int packs = static_cast<int>(V / VEC);
  const int32_t target = targets[row];
  if (target < 0) {
    if (threadIdx.x == 0) losses[row] = 0.0f;
    if (dx != nullptr) {
      float zero[VEC] = {};
      for (int q = threadIdx.x; q < packs; q += kThreads)
        store_floats<T, VEC>(dx + static_cast<int64_t>(q) * VEC, zero);
    }
    return;
  }
  if (threadIdx.x == 0) {
    float max = all_stats[2 * row];
    for (int64_t s = 1; s < S; ++s) max = fmaxf(max, all_stats[(s * N + row) * 2]);
    float sum = 0.0f, target_logit = 0.0f;
    for (int64_t s = 0; s < S; ++s) {
      sum += expf(all_stats[(s * N + row) * 2] - max);
      target_logit += all_stats[(s * N + row) * 2 + 1];
    }
    lse_shared = max + logf(sum);
    losses[row] = lse_shared - target_logit;
  }
  __syncthreads();
  if (dx == nullptr) return;
  const float lse_log2 = lse_shared * kLog2e;
  const int64_t t = static_cast<int64_t>(target) - first_id;
  for (int q = threadIdx.x; q < packs; q += kThreads) {
    const Pack<T, VEC> pack = load_pack<T, VEC>(x + q * VEC);
    float g[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      g[k] = exp2_approx(fmaf(to_float(pack.v[k]), kLog2e, -lse_log2)) * grad_scale;
      if (static_cast<int64_t>(q) * VEC + k == t) g[k] -= grad_scale;
    }
    store_floats<T, VEC>(dx + static_cast<int64_t>(q) * VEC, g);
  }
}

// Per-token log-probabilities: each row's log-sum-exp streamed once (cross_entropy_kernel's
// first pass), then logp = the target's logit - lse. One block per row.
template <class T, int VEC>
__global__ void __launch_bounds__(kThreads)
    log_softmax_gather_kernel(float* logps, float* lse, const T* logits, const int32_t* targets,
                              int64_t V) {
  __shared__ MaxSum reduce[kThreads / 32];
  const int64_t row = blockIdx.x;
  const int32_t target = targets[row];
  if (target < 0) {
    if (threadIdx.x == 0) logps[row] = lse[row] = 0.0f;
    return;
  }
  const T* x = logits + row * V;
  const int packs = static_cast<int>(V / VEC);
  const MaxSum total = block_max_sum(thread_max_sum<T, VEC>(x, packs), reduce);
  if (threadIdx.x != 0) return;
  const float row_lse = total.max + logf(total.sum);
  lse[row] = row_lse;
  // A target >= V (invalid) gives a NaN log-probability, as cross_entropy's loss.
  logps[row] = target < V ? to_float(x[target]) - row_lse : NAN;
}

// Its gradient: dlogits = dlogp (onehot - exp(x - lse)), one pass over the row (which dlogits
// may be: each pack is read before it is written). One block per row.
template <class T, int VEC>
__global__ void __launch_bounds__(kThreads)
    log_softmax_gather_backward_kernel(T* dlogits, const float* dlogps, const T* logits,
                                       const float* lse, const int32_t* targets, int64_t V) {
  const int64_t row = blockIdx.x;
  const int32_t target = targets[row];
  const T* x = logits + row * V;
  T* dx = dlogits + row * V;
  const int packs = static_cast<int>(V / VEC);
  const float g = target < 0 ? 0.0f : dlogps[row];
  const float lse_log2 = target < 0 ? 0.0f : lse[row] * kLog2e;
  for (int q = threadIdx.x; q < packs; q += kThreads) {
    float out[VEC];
    if (target < 0) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) out[k] = 0.0f;
    } else {
      const Pack<T, VEC> pack = load_pack<T, VEC>(x + q * VEC);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float p = exp2_approx(fmaf(to_float(pack.v[k]), kLog2e, -lse_log2));
        out[k] = g * ((static_cast<int64_t>(q) * VEC + k == target ? 1.0f : 0.0f) - p);
      }
    }
    store_floats<T, VEC>(dx + static_cast<int64_t>(q) * VEC, out);
  }
}

// The widest pack the row length and the pointers allow.
template <class T, class Launch>
void launch_with_pack(int64_t V, std::initializer_list<const void*> pointers, Launch launch) {
  constexpr int kVec = kVec16<T>;
  bool aligned = V % kVec == 0;
  for (const void* p : pointers) aligned = aligned && (p == nullptr || is_aligned(p, 16));
  if (aligned) {
    launch(std::integral_constant<int, kVec>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

}  // namespace

void cross_entropy_shard_stats(float* stats, const void* logits, const int32_t* targets, int64_t N,
                               int64_t V, int64_t first_id, DType dtype, cudaStream_t stream) {
  NvtxRange range("cross_entropy_shard_stats");
  if (N == 0) return;
  check_grid("cross_entropy_shard_stats", N);
  dispatch_float(dtype, "cross_entropy_shard_stats", [&](auto tag) {
    using T = decltype(tag);
    launch_with_pack<T>(V, {logits}, [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      cross_entropy_shard_stats_kernel<T, VEC>
          <<<N, kThreads, 0, stream>>>(stats, static_cast<const T*>(logits), targets, V, first_id);
    });
    TS_CUDA_CHECK_LAUNCH("cross_entropy_shard_stats_kernel");
  });
}

void cross_entropy_shard(float* losses, void* dlogits, const void* logits, const int32_t* targets,
                         const float* all_stats, int64_t S, int64_t N, int64_t V, int64_t first_id,
                         float grad_scale, DType dtype, cudaStream_t stream) {
  NvtxRange range("cross_entropy_shard");
  if (N == 0) return;
  check_grid("cross_entropy_shard", N);
  dispatch_float(dtype, "cross_entropy_shard", [&](auto tag) {
    using T = decltype(tag);
    launch_with_pack<T>(V, {logits, dlogits}, [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      cross_entropy_shard_kernel<T, VEC><<<N, kThreads, 0, stream>>>(
          losses, static_cast<T*>(dlogits), static_cast<const T*>(logits), targets, all_stats, S, N,
          V, first_id, grad_scale);
    });
    TS_CUDA_CHECK_LAUNCH("cross_entropy_shard_kernel");
  });
}

void cross_entropy(float* losses, void* dlogits, const void* logits, const int32_t* targets,
                   int64_t N, int64_t V, float grad_scale, DType dtype, cudaStream_t stream) {
  NvtxRange range("cross_entropy");
  if (N == 0) return;
  check_grid("cross_entropy", N);
  int device = 0, smem_per_sm = 0;
  TS_CUDA_CHECK(cudaGetDevice(&device));
  TS_CUDA_CHECK(
      cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  // Two blocks per SM; each also needs 1 KiB reserved by the system and its static shared
  // memory (the reduction buffer).
  const int64_t cache_bytes = smem_per_sm / 2 - 2048;
  dispatch_float(dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = kVec16<T>;
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      constexpr int64_t kPackBytes = sizeof(Pack<T, VEC>);
      // Without a gradient there is no second pass to feed.
      const int64_t cached =
          dlogits != nullptr ? std::min<int64_t>(V / VEC, cache_bytes / kPackBytes) : 0;
      const size_t smem = static_cast<size_t>(cached * kPackBytes);
      auto kernel = cross_entropy_kernel<T, VEC>;
      TS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
      kernel<<<N, kThreads, smem, stream>>>(losses, static_cast<T*>(dlogits),
                                            static_cast<const T*>(logits), targets, V, grad_scale,
                                            static_cast<int>(cached));
    };
    if (V % kVec == 0 && is_aligned(logits, 16) &&
        (dlogits == nullptr || is_aligned(dlogits, 16))) {
      launch(std::integral_constant<int, kVec>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
    TS_CUDA_CHECK_LAUNCH("cross_entropy_kernel");
  });
}

void log_softmax_gather(float* logps, float* lse, const void* logits, const int32_t* targets,
                        int64_t N, int64_t V, DType dtype, cudaStream_t stream) {
  NvtxRange range("log_softmax_gather");
  if (N == 0) return;
  check_grid("log_softmax_gather", N);
  dispatch_float(dtype, "log_softmax_gather", [&](auto tag) {
    using T = decltype(tag);
    launch_with_pack<T>(V, {logits}, [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      log_softmax_gather_kernel<T, VEC>
          <<<N, kThreads, 0, stream>>>(logps, lse, static_cast<const T*>(logits), targets, V);
    });
    TS_CUDA_CHECK_LAUNCH("log_softmax_gather_kernel");
  });
}

void log_softmax_gather_backward(void* dlogits, const float* dlogps, const void* logits,
                                 const float* lse, const int32_t* targets, int64_t N, int64_t V,
                                 DType dtype, cudaStream_t stream) {
  NvtxRange range("log_softmax_gather_backward");
  if (N == 0) return;
  check_grid("log_softmax_gather_backward", N);
  dispatch_float(dtype, "log_softmax_gather_backward", [&](auto tag) {
    using T = decltype(tag);
    launch_with_pack<T>(V, {logits, dlogits}, [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      log_softmax_gather_backward_kernel<T, VEC><<<N, kThreads, 0, stream>>>(
          static_cast<T*>(dlogits), dlogps, static_cast<const T*>(logits), lse, targets, V);
    });
    TS_CUDA_CHECK_LAUNCH("log_softmax_gather_backward_kernel");
  });
}

}  // namespace tessera::cuda
