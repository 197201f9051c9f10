#include "tessera/backend/cuda/sampling.cuh"

#include <cmath>
#include <type_traits>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/core/random.h"

namespace tessera::cuda {
namespace {

constexpr int kThreads = 256;

// A candidate of the draw: its key and id; the larger key wins, ties to the lower id.
struct Candidate {
  float key;
  int64_t id;
};

__device__ __forceinline__ Candidate better(Candidate a, Candidate b) {
  if (a.id < 0) return b;
  if (b.id < 0) return a;
  return b.key > a.key || (b.key == a.key && b.id < a.id) ? b : a;
}

// Block-wide reductions over kThreads threads; every thread gets the result.
template <class T, class Op>
__device__ T block_reduce(T v, Op op, T* shared) {
  for (int offset = 16; offset > 0; offset /= 2) {
    T other;
    if constexpr (std::is_same_v<T, Candidate>) {
      other.key = __shfl_down_sync(0xffffffffu, v.key, offset);
      other.id = __shfl_down_sync(0xffffffffu, v.id, offset);
    } else {
      other = __shfl_down_sync(0xffffffffu, v, offset);
    }
    v = op(v, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    T total = shared[0];
    for (int w = 1; w < kThreads / 32; ++w) total = op(total, shared[w]);
    shared[0] = total;
  }
  __syncthreads();
  const T out = shared[0];
  __syncthreads();  // shared may be reused by the next reduction
  return out;
}

// One block per row: the row's maxima, then its softmax sums and the draw in one pass.
template <class T>
__global__ void __launch_bounds__(kThreads)
    sample_tokens_kernel(int32_t* tokens, float* logps, float* entropy, const T* logits,
                         const int32_t* streams, const int32_t* steps, int64_t V, int64_t vocab,
                         float temperature, float min_p, uint64_t seed) {
  __shared__ float floats[kThreads / 32];
  __shared__ Candidate candidates[kThreads / 32];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * V;
  const auto max_of = [](float a, float b) { return fmaxf(a, b); };
  const auto sum_of = [](float a, float b) { return a + b; };
  float max_all = -INFINITY, max_vocab = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += kThreads) {
    const float l = to_float(x[v]);
    max_all = fmaxf(max_all, l);
    if (v < vocab) max_vocab = fmaxf(max_vocab, l);
  }
  max_all = block_reduce(max_all, max_of, floats);
  max_vocab = block_reduce(max_vocab, max_of, floats);
  const bool sampled = temperature > 0;
  const double floor = sampled && min_p > 0 ? log(static_cast<double>(min_p)) : -INFINITY;
  const int32_t stream = streams[row], step = steps[row];
  float sum = 0, weighted = 0;
  Candidate best{0.0f, -1};
  for (int64_t v = threadIdx.x; v < V; v += kThreads) {
    const float l = to_float(x[v]);
    const float e = expf(l - max_all);
    sum += e;
    weighted += e * (l - max_all);
    if (v >= vocab) continue;
    if (sampled && static_cast<double>(l - max_vocab) / temperature < floor) continue;
    const float key = sampled ? l / temperature + gumbel_noise(seed, stream, step, vocab, v) : l;
    best = better(best, Candidate{key, v});
  }
  sum = block_reduce(sum, sum_of, floats);
  weighted = block_reduce(weighted, sum_of, floats);
  best = block_reduce(best, [](Candidate a, Candidate b) { return better(a, b); }, candidates);
  if (threadIdx.x != 0) return;
  tokens[row] = static_cast<int32_t>(best.id);
  logps[row] = to_float(x[best.id]) - max_all - logf(sum);
  entropy[row] = logf(sum) - weighted / sum;
}

}  // namespace

void sample_tokens(int32_t* tokens, float* logps, float* entropy, const void* logits,
                   const int32_t* streams, const int32_t* steps, int64_t B, int64_t V, int64_t vocab,
                   float temperature, float min_p, uint64_t seed, DType dtype, cudaStream_t stream) {
  NvtxRange range("sample_tokens");
  if (B == 0) return;
  check_grid("sample_tokens", B);
  dispatch_float(dtype, "sample_tokens", [&](auto tag) {
    using T = decltype(tag);
    sample_tokens_kernel<T><<<B, kThreads, 0, stream>>>(tokens, logps, entropy, static_cast<const T*>(logits),
                                                        streams, steps, V, vocab, temperature, min_p, seed);
    TS_CUDA_CHECK_LAUNCH("sample_tokens_kernel");
  });
}

}  // namespace tessera::cuda
