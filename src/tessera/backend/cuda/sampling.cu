#include "tessera/backend/cuda/sampling.cuh"

#include <cmath>
#include <type_traits>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/core/error.h"
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

// A row of a 128k vocabulary is too much for one block: a single SM takes ~0.4 ms over it (the
// noise of every logit is a hash and two logarithms). Each row is split into chunks of
// kChunkColumns, one block each, in three kernels: the chunks' maxima; each chunk's softmax
// sums against its row's maxima and its best candidate; one warp per row combining them.
constexpr int64_t kChunkColumns = 4096;

struct ChunkDraw {
  float sum, weighted;  // of exp(l - row max) and exp(l - row max) (l - row max)
  float key;
  int32_t id;  // the chunk's best candidate, -1 if none
};

int64_t chunks_of(int64_t V) { return (V + kChunkColumns - 1) / kChunkColumns; }

template <class T>
__global__ void __launch_bounds__(kThreads)
    chunk_maxima_kernel(float2* maxima, const T* logits, int64_t V, int64_t vocab, int64_t chunks) {
  __shared__ float floats[kThreads / 32];
  const int64_t row = blockIdx.y, begin = blockIdx.x * kChunkColumns, end = min(V, begin + kChunkColumns);
  const T* x = logits + row * V;
  const auto max_of = [](float a, float b) { return fmaxf(a, b); };
  float max_all = -INFINITY, max_vocab = -INFINITY;
  for (int64_t v = begin + threadIdx.x; v < end; v += kThreads) {
    const float l = to_float(x[v]);
    max_all = fmaxf(max_all, l);
    if (v < vocab) max_vocab = fmaxf(max_vocab, l);
  }
  max_all = block_reduce(max_all, max_of, floats);
  max_vocab = block_reduce(max_vocab, max_of, floats);
  if (threadIdx.x == 0) maxima[row * chunks + blockIdx.x] = make_float2(max_all, max_vocab);
}

// The row's maxima from its chunks' (every thread reads them: a few dozen floats).
__device__ __forceinline__ float2 row_maxima(const float2* maxima, int64_t row, int64_t chunks) {
  float2 m = make_float2(-INFINITY, -INFINITY);
  for (int64_t c = 0; c < chunks; ++c) {
    const float2 x = maxima[row * chunks + c];
    m.x = fmaxf(m.x, x.x), m.y = fmaxf(m.y, x.y);
  }
  return m;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    chunk_draw_kernel(ChunkDraw* draws, const float2* maxima, const T* logits, const int32_t* streams,
                      const int32_t* steps, int64_t V, int64_t vocab, int64_t chunks, float temperature,
                      float min_p, uint64_t seed) {
  __shared__ float floats[kThreads / 32];
  __shared__ Candidate candidates[kThreads / 32];
  const int64_t row = blockIdx.y, begin = blockIdx.x * kChunkColumns, end = min(V, begin + kChunkColumns);
  const T* x = logits + row * V;
  const float2 m = row_maxima(maxima, row, chunks);
  const float max_all = m.x, max_vocab = m.y;
  const auto sum_of = [](float a, float b) { return a + b; };
  const bool sampled = temperature > 0;
  const double floor = sampled && min_p > 0 ? log(static_cast<double>(min_p)) : -INFINITY;
  const int32_t stream = streams[row], step = steps[row];
  float sum = 0, weighted = 0;
  Candidate best{0.0f, -1};
  for (int64_t v = begin + threadIdx.x; v < end; v += kThreads) {
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
  if (threadIdx.x == 0) draws[row * chunks + blockIdx.x] = {sum, weighted, best.key, static_cast<int32_t>(best.id)};
}

// One warp per row: the chunks' sums added, their candidates compared (in chunk order, so the
// lower id wins a tie as in one pass).
template <class T>
__global__ void finish_draw_kernel(int32_t* tokens, float* logps, float* entropy, const ChunkDraw* draws,
                                   const float2* maxima, const T* logits, int64_t V, int64_t chunks) {
  const int64_t row = blockIdx.x;
  const int lane = threadIdx.x;
  float sum = 0, weighted = 0;
  Candidate best{0.0f, -1};
  for (int64_t c = lane; c < chunks; c += 32) {
    const ChunkDraw d = draws[row * chunks + c];
    sum += d.sum;
    weighted += d.weighted;
    best = better(best, Candidate{d.key, d.id});
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    sum += __shfl_down_sync(0xffffffffu, sum, offset);
    weighted += __shfl_down_sync(0xffffffffu, weighted, offset);
    Candidate other;
    other.key = __shfl_down_sync(0xffffffffu, best.key, offset);
    other.id = __shfl_down_sync(0xffffffffu, best.id, offset);
    best = better(best, other);
  }
  if (lane != 0) return;
  const float max_all = row_maxima(maxima, row, chunks).x;
  tokens[row] = static_cast<int32_t>(best.id);
  logps[row] = to_float(logits[row * V + best.id]) - max_all - logf(sum);
  entropy[row] = logf(sum) - weighted / sum;
}

}  // namespace

size_t sample_tokens_scratch_bytes(int64_t B, int64_t V) {
  return static_cast<size_t>(B * chunks_of(V)) * (sizeof(float2) + sizeof(ChunkDraw));
}

void sample_tokens(int32_t* tokens, float* logps, float* entropy, const void* logits,
                   const int32_t* streams, const int32_t* steps, int64_t B, int64_t V, int64_t vocab,
                   float temperature, float min_p, uint64_t seed, DType dtype, void* scratch,
                   size_t scratch_bytes, cudaStream_t stream) {
  NvtxRange range("sample_tokens");
  if (B == 0) return;
  check_grid("sample_tokens", B);
  const int64_t chunks = chunks_of(V);
  if (scratch_bytes < sample_tokens_scratch_bytes(B, V))
    throw InternalError("sample_tokens: scratch too small");
  auto* maxima = static_cast<float2*>(scratch);
  auto* draws = reinterpret_cast<ChunkDraw*>(maxima + B * chunks);
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(B));
  dispatch_float(dtype, "sample_tokens", [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(logits);
    chunk_maxima_kernel<T><<<grid, kThreads, 0, stream>>>(maxima, x, V, vocab, chunks);
    TS_CUDA_CHECK_LAUNCH("chunk_maxima_kernel");
    chunk_draw_kernel<T><<<grid, kThreads, 0, stream>>>(draws, maxima, x, streams, steps, V, vocab, chunks,
                                                        temperature, min_p, seed);
    TS_CUDA_CHECK_LAUNCH("chunk_draw_kernel");
    finish_draw_kernel<T><<<static_cast<unsigned>(B), 32, 0, stream>>>(tokens, logps, entropy, draws, maxima, x, V,
                                                                         chunks);
    TS_CUDA_CHECK_LAUNCH("finish_draw_kernel");
  });
}

}  // namespace tessera::cuda
