#include "tessera/backend/cuda/reduce.cuh"

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"

namespace tessera::cuda {
namespace {

// ---- column sums of partials ----

// Block (32 columns x 8 row lanes): lane y sums rows y, y + 8, ... of its column, then lane 0
// adds the 8 lane sums in lane order. 32 consecutive columns per warp keep the loads
// coalesced; 8 independent accumulations per column keep enough loads in flight even when
// there are only a few thousand columns (C = 4096 gives 128 blocks).
constexpr int kColumnLanes = 8;

template <class TD>
__global__ void column_sums_accumulate_kernel(TD* dst, const float* partial, int64_t rows,
                                              int64_t cols) {
  __shared__ float lane_sums[kColumnLanes][32];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float acc = 0.0f;
  if (col < cols) {
#pragma unroll 4
    for (int64_t r = threadIdx.y; r < rows; r += kColumnLanes) acc += partial[r * cols + col];
  }
  lane_sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || col >= cols) return;
  float total = lane_sums[0][threadIdx.x];
#pragma unroll
  for (int y = 1; y < kColumnLanes; ++y) total += lane_sums[y][threadIdx.x];
  dst[col] = from_float<TD>(to_float(dst[col]) + total);
}

// ---- whole-tensor sums ----

// Block b reduces elements [b * kSumChunk, (b + 1) * kSumChunk): 256 threads x 16 packs of
// 4 floats, all 16 loads of a thread independent. The chunk size is a constant, so the
// partial sums (and the final bits) are the same on any GPU. Sums accumulate in double, like
// the CPU reference: a loss sum or a sum with cancellation then loses nothing to fp32
// rounding, and the double adds hide under the loads (this is memory-bound).
constexpr int kSumThreads = 256;
constexpr int kSumPacks = 16;
constexpr int64_t kSumChunk = int64_t{kSumThreads} * kSumPacks * 4;
constexpr int kFinalThreads = 1024;

template <bool kSquare>
__device__ __forceinline__ double term(float v) {
  const double d = v;
  return kSquare ? d * d : d;
}

__device__ __forceinline__ double warp_sum_double(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += warp_shfl_xor(v, offset);
  return v;
}

// The block's total, valid in thread 0. shared: 32 doubles.
__device__ __forceinline__ double block_sum_double(double v, double* shared) {
  v = warp_sum_double(v);
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x >= 32) return 0.0;
  return warp_sum_double(threadIdx.x < blockDim.x / 32 ? shared[threadIdx.x] : 0.0);
}

template <bool kSquare, class T, int VEC>
__global__ void sum_partial_kernel(double* partial, const T* x, int64_t n) {
  __shared__ double shared[32];
  constexpr int kSteps = kSumChunk / (kSumThreads * VEC);
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kSumChunk;
  double acc = 0.0;
  if (base + kSumChunk <= n) {  // every block but maybe the last: no bounds checks, all loads
                                // of the unrolled loop can be in flight together
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      float v[VEC];
      load_floats<T, VEC>(x + base + (static_cast<int64_t>(j) * kSumThreads + threadIdx.x) * VEC,
                          v);
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc += term<kSquare>(v[k]);
    }
  } else {
    for (int j = 0; j < kSteps; ++j) {
      const int64_t i = base + (static_cast<int64_t>(j) * kSumThreads + threadIdx.x) * VEC;
      for (int64_t e = i; e < min(n, i + VEC); ++e) acc += term<kSquare>(to_float(x[e]));
    }
  }
  acc = block_sum_double(acc, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// One block adds the partials in a fixed order and writes or accumulates the result, like
// the CPU reference: out = float(double(out) + total).
__global__ void sum_final_kernel(float* out, const double* partial, int64_t count,
                                 bool accumulate) {
  __shared__ double shared[32];
  double acc = 0.0;
#pragma unroll 8
  for (int64_t i = threadIdx.x; i < count; i += kFinalThreads) acc += partial[i];
  acc = block_sum_double(acc, shared);
  if (threadIdx.x == 0)
    *out = static_cast<float>((accumulate ? static_cast<double>(*out) : 0.0) + acc);
}

template <bool kSquare, class T>
void launch_sum(const char* name, float* out, const T* x, int64_t n, bool accumulate, void* scratch,
                size_t scratch_bytes, cudaStream_t stream) {
  NvtxRange range(name);
  const int64_t blocks = ceil_div(n, kSumChunk);
  check_grid(name, blocks);
  if (scratch_bytes < sum_scratch_bytes(n)) {
    throw_cuda_error(cudaErrorInvalidValue, "sum: scratch too small", __FILE__, __LINE__);
  }
  auto* partial = static_cast<double*>(scratch);
  if (blocks > 0) {
    if (is_aligned(x, 4 * sizeof(T))) {
      sum_partial_kernel<kSquare, T, 4><<<blocks, kSumThreads, 0, stream>>>(partial, x, n);
    } else {
      sum_partial_kernel<kSquare, T, 1><<<blocks, kSumThreads, 0, stream>>>(partial, x, n);
    }
    TS_CUDA_CHECK_LAUNCH("sum_partial_kernel");
  }
  sum_final_kernel<<<1, kFinalThreads, 0, stream>>>(out, partial, blocks, accumulate);
  TS_CUDA_CHECK_LAUNCH("sum_final_kernel");
}

// ---- bias gradient ----

// Block (x = column chunk of 256 packs, y = group of kBiasRows rows): thread t sums its pack
// of columns over the group's rows; the partials (M / kBiasRows, N) are then added by
// column_sums_accumulate. Fixed group size: device-independent bits.
constexpr int kBiasThreads = 256;
constexpr int64_t kBiasRows = 64;

template <class T, int VEC>
__global__ void bias_partial_kernel(float* partial, const T* dout, int64_t M, int64_t N) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kBiasThreads + threadIdx.x) * VEC;
  if (c >= N) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBiasRows;
  const int64_t r1 = min(M, r0 + kBiasRows);
  float acc[VEC] = {};
#pragma unroll 4
  for (int64_t r = r0; r < r1; ++r) {
    float v[VEC];
    load_floats<T, VEC>(dout + r * N + c, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] += v[k];
  }
  store_floats<float, VEC>(partial + static_cast<int64_t>(blockIdx.y) * N + c, acc);
}

}  // namespace

void column_sums_accumulate(void* dst, DType dst_dtype, const float* partial, int64_t rows,
                            int64_t cols, cudaStream_t stream) {
  if (cols == 0) return;
  const int64_t blocks = ceil_div(cols, 32);
  check_grid("column_sums_accumulate", blocks);
  dispatch_float(dst_dtype, "column_sums_accumulate", [&](auto tag) {
    using TD = decltype(tag);
    column_sums_accumulate_kernel<TD>
        <<<blocks, dim3(32, kColumnLanes), 0, stream>>>(static_cast<TD*>(dst), partial, rows, cols);
  });
  TS_CUDA_CHECK_LAUNCH("column_sums_accumulate_kernel");
}

size_t sum_scratch_bytes(int64_t n) {
  return static_cast<size_t>(ceil_div(n, kSumChunk)) * sizeof(double);
}

void sum(float* out, const float* x, int64_t n, bool accumulate, void* scratch,
         size_t scratch_bytes, cudaStream_t stream) {
  launch_sum<false>("sum", out, x, n, accumulate, scratch, scratch_bytes, stream);
}

void sum_squares(float* out, const void* x, DType x_dtype, int64_t n, bool accumulate,
                 void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  dispatch_float(x_dtype, "sum_squares", [&](auto tag) {
    using T = decltype(tag);
    launch_sum<true>("sum_squares", out, static_cast<const T*>(x), n, accumulate, scratch,
                     scratch_bytes, stream);
  });
}

size_t bias_backward_scratch_bytes(int64_t M, int64_t N) {
  return static_cast<size_t>(ceil_div(M, kBiasRows)) * static_cast<size_t>(N) * sizeof(float);
}

void bias_backward(void* dbias, DType dbias_dtype, const void* dout, int64_t M, int64_t N,
                   DType dtype, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  NvtxRange range("bias_backward");
  if (M == 0 || N == 0) return;
  if (scratch_bytes < bias_backward_scratch_bytes(M, N)) {
    throw_cuda_error(cudaErrorInvalidValue, "bias_backward: scratch too small", __FILE__, __LINE__);
  }
  auto* partial = static_cast<float*>(scratch);
  const int64_t groups = ceil_div(M, kBiasRows);
  if (groups > 65535) {
    throw_cuda_error(cudaErrorInvalidConfiguration, "bias_backward: too many rows", __FILE__,
                     __LINE__);
  }
  dispatch_float(dtype, "bias_backward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 8;  // one 16-byte bf16 load per row; partials written as 2 x 16 bytes
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const dim3 grid(static_cast<unsigned>(ceil_div(N, kBiasThreads * VEC)),
                      static_cast<unsigned>(groups));
      bias_partial_kernel<T, VEC>
          <<<grid, kBiasThreads, 0, stream>>>(partial, static_cast<const T*>(dout), M, N);
    };
    if (N % kVec == 0 && is_aligned(dout, 16)) {
      launch(std::integral_constant<int, kVec>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
    TS_CUDA_CHECK_LAUNCH("bias_partial_kernel");
  });
  column_sums_accumulate(dbias, dbias_dtype, partial, groups, N, stream);
}

}  // namespace tessera::cuda
