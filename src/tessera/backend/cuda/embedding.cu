#include "tessera/backend/cuda/embedding.cuh"

#include <cub/device/device_radix_sort.cuh>

#include <cmath>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"

namespace tessera::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per pack of VEC channels of one output row: a flat grid keeps every load and
// store a coalesced 16-byte access, whatever C is.
// SHARD: the table holds the rows of ids [first_id, first_id + V) of a vocabulary split over
// ranks, and a token outside them (another shard's) gets a zero row; otherwise first_id is 0
// and a token outside the table is bad data.
template <class T, int VEC, bool SHARD>
__global__ void embedding_forward_kernel(T* out, const int32_t* tokens, const T* table, int64_t N,
                                         int64_t C, int64_t V, int64_t first_id) {
  const int64_t packs_per_row = C / VEC;
  const int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= N * packs_per_row) return;
  const int64_t n = p / packs_per_row, c = (p % packs_per_row) * VEC;
  const int64_t id = SHARD ? static_cast<int64_t>(tokens[n]) - first_id : tokens[n];
  Pack<T, VEC> pack;
  if (id >= 0 && id < V) {
    pack = load_pack<T, VEC>(table + id * C + c);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) pack.v[k] = from_float<T>(SHARD ? 0.0f : NAN);
  }
  store_pack<T, VEC>(out + n * C + c, pack);
}

// ids[i] = tokens[i] - first_id: another shard's tokens fall outside [0, V), where the
// backward's unsigned sort puts them after every row of the shard.
__global__ void shift_ids_kernel(int32_t* ids, const int32_t* tokens, int64_t n, int64_t first_id) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) ids[i] = static_cast<int32_t>(tokens[i] - first_id);
}

__global__ void iota_kernel(int32_t* out, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = static_cast<int32_t>(i);
}

// After a stable sort of (token, position) pairs, the positions of each distinct token form
// one contiguous run, in token order. Block (x = i, y = channel chunk) owns the run starting
// at sorted index i (blocks that are not at a run start exit at once): it sums that run's
// dout rows into registers, starting from the table row, and writes the row back once. One
// writer per (row, channel) and a fixed summation order make the result deterministic
// without atomics; the sequence of fp32 additions is exactly the CPU reference's.
template <class T, class TD, int VEC>
__global__ void embedding_backward_kernel(TD* dtable, const T* dout, const uint32_t* sorted_ids,
                                          const int32_t* sorted_pos, int64_t N, int64_t C,
                                          int64_t V) {
  const int64_t i = blockIdx.x;
  const uint32_t id = sorted_ids[i];
  if ((i > 0 && sorted_ids[i - 1] == id) || id >= V) return;
  int64_t end = i + 1;
  while (end < N && sorted_ids[end] == id) ++end;

  const int64_t c = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * VEC;
  if (c >= C) return;
  TD* row = dtable + static_cast<int64_t>(id) * C + c;
  float acc[VEC];
  load_floats<TD, VEC>(row, acc);
#pragma unroll 4
  for (int64_t k = i; k < end; ++k) {
    float g[VEC];
    load_floats<T, VEC>(dout + static_cast<int64_t>(sorted_pos[k]) * C + c, g);
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] += g[v];
  }
  store_floats<TD, VEC>(row, acc);
}

constexpr size_t kScratchAlign = 256;

size_t align_up(size_t bytes) {
  return (bytes + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
}

size_t sort_temp_bytes(int64_t N) {
  size_t bytes = 0;
  TS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(N)));
  return bytes;
}

template <bool SHARD>
void launch_embedding_forward(void* out, const int32_t* tokens, const void* table, int64_t N,
                              int64_t C, int64_t V, int64_t first_id, DType dtype,
                              cudaStream_t stream) {
  if (N == 0 || C == 0) return;
  dispatch_float(dtype, "embedding_forward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = kVec16<T>;
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const int64_t blocks = ceil_div(N * (C / VEC), kThreads);
      check_grid("embedding_forward", blocks);
      embedding_forward_kernel<T, VEC, SHARD><<<blocks, kThreads, 0, stream>>>(
          static_cast<T*>(out), tokens, static_cast<const T*>(table), N, C, V, first_id);
    };
    if (C % kVec == 0 && is_aligned(out, 16) && is_aligned(table, 16)) {
      launch(std::integral_constant<int, kVec>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
    TS_CUDA_CHECK_LAUNCH("embedding_forward_kernel");
  });
}

// The backward of either lookup into dtable (fp32, or bf16: table_dtype). With `shard` the rows
// are indexed by tokens - first_id (computed into the scratch); ids outside [0, V) are skipped.
void launch_embedding_backward(void* dtable, DType table_dtype, const void* dout,
                               const int32_t* tokens, int64_t N, int64_t C, int64_t V,
                               int64_t first_id, bool shard, DType dout_dtype, void* scratch,
                               size_t scratch_bytes, cudaStream_t stream) {
  if (N == 0 || C == 0) return;
  check_grid("embedding_backward", N);
  char* base = static_cast<char*>(scratch);
  const size_t ids_bytes = align_up(static_cast<size_t>(N) * 4);
  auto* sorted_ids = reinterpret_cast<uint32_t*>(base);
  auto* positions = reinterpret_cast<int32_t*>(base + ids_bytes);
  auto* sorted_pos = reinterpret_cast<int32_t*>(base + 2 * ids_bytes);
  auto* shifted = reinterpret_cast<int32_t*>(base + 3 * ids_bytes);
  void* temp = base + 4 * ids_bytes;
  size_t temp_bytes = sort_temp_bytes(N);
  if (scratch_bytes < 4 * ids_bytes + temp_bytes) {
    throw_cuda_error(cudaErrorInvalidValue, "embedding_backward: scratch too small", __FILE__,
                     __LINE__);
  }

  iota_kernel<<<ceil_div(N, kThreads), kThreads, 0, stream>>>(positions, N);
  TS_CUDA_CHECK_LAUNCH("iota_kernel");
  const int32_t* ids = tokens;
  if (shard) {
    shift_ids_kernel<<<ceil_div(N, kThreads), kThreads, 0, stream>>>(shifted, tokens, N, first_id);
    TS_CUDA_CHECK_LAUNCH("shift_ids_kernel");
    ids = shifted;
  }
  // Ids as unsigned and all 32 bits sorted: ids outside [0, V) (negative ones included) land
  // after every valid id, in runs of their own, and are skipped.
  TS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      temp, temp_bytes, reinterpret_cast<const uint32_t*>(ids), sorted_ids, positions, sorted_pos,
      static_cast<int>(N), 0, 32, stream));

  dispatch_float(dout_dtype, "embedding_backward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_float(table_dtype, "embedding_backward table", [&](auto table_tag) {
      using TD = decltype(table_tag);
      constexpr int kVec = 8;  // one 16-byte bf16 load, two fp32 ones; the row summed in fp32
      constexpr int kBackwardThreads = 128;
      auto launch = [&](auto vec_tag) {
        constexpr int VEC = decltype(vec_tag)::value;
        const dim3 grid(static_cast<unsigned>(N),
                        static_cast<unsigned>(ceil_div(C, kBackwardThreads * VEC)));
        embedding_backward_kernel<T, TD, VEC><<<grid, kBackwardThreads, 0, stream>>>(
            static_cast<TD*>(dtable), static_cast<const T*>(dout), sorted_ids, sorted_pos, N, C, V);
      };
      if (C % kVec == 0 && is_aligned(dout, 16) && is_aligned(dtable, 16)) {
        launch(std::integral_constant<int, kVec>{});
      } else {
        launch(std::integral_constant<int, 1>{});
      }
      TS_CUDA_CHECK_LAUNCH("embedding_backward_kernel");
    });
  });
}

}  // namespace

void embedding_forward(void* out, const int32_t* tokens, const void* table, int64_t N, int64_t C,
                       int64_t V, DType dtype, cudaStream_t stream) {
  NvtxRange range("embedding_forward");
  launch_embedding_forward<false>(out, tokens, table, N, C, V, 0, dtype, stream);
}

void embedding_shard_forward(void* out, const int32_t* tokens, const void* table, int64_t N,
                             int64_t C, int64_t V, int64_t first_id, DType dtype,
                             cudaStream_t stream) {
  NvtxRange range("embedding_shard_forward");
  launch_embedding_forward<true>(out, tokens, table, N, C, V, first_id, dtype, stream);
}

size_t embedding_backward_scratch_bytes(int64_t N) {
  return 4 * align_up(static_cast<size_t>(N) * 4) + align_up(sort_temp_bytes(N));
}

void embedding_backward(void* dtable, DType table_dtype, const void* dout, const int32_t* tokens,
                        int64_t N, int64_t C, int64_t V, DType dout_dtype, void* scratch,
                        size_t scratch_bytes, cudaStream_t stream) {
  NvtxRange range("embedding_backward");
  launch_embedding_backward(dtable, table_dtype, dout, tokens, N, C, V, 0, false, dout_dtype,
                            scratch, scratch_bytes, stream);
}

void embedding_shard_backward(void* dtable, DType table_dtype, const void* dout,
                              const int32_t* tokens, int64_t N, int64_t C, int64_t V,
                              int64_t first_id, DType dout_dtype, void* scratch,
                              size_t scratch_bytes, cudaStream_t stream) {
  NvtxRange range("embedding_shard_backward");
  launch_embedding_backward(dtable, table_dtype, dout, tokens, N, C, V, first_id, true, dout_dtype,
                            scratch, scratch_bytes, stream);
}

}  // namespace tessera::cuda
