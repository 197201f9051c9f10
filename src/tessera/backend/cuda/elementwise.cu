#include "tessera/backend/cuda/elementwise.cuh"

#include <cstring>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/core/error.h"
#include "tessera/core/random.h"

namespace tessera::cuda {
namespace {

// Flat kernels: one thread per pack of VEC elements, the last thread also doing the ragged
// tail. 256 threads x 16 bytes per thread keeps 8 resident blocks (2048 threads) per SM
// with 32 KiB of loads in flight, enough to cover HBM latency on H100/H200.
constexpr int kThreads = 256;

template <int VEC>
int64_t flat_blocks(const char* op, int64_t n) {
  const int64_t blocks = ceil_div(ceil_div(n, VEC), kThreads);
  check_grid(op, blocks);
  return blocks;
}

__device__ __forceinline__ int64_t flat_index(int vec) {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * vec;
}

// Word is the element's bit pattern (uint16_t for bf16, uint32_t for fp32 and int32).
template <class Word, int VEC>
__global__ void fill_kernel(Word* dst, int64_t n, Word value) {
  const int64_t i = flat_index(VEC);
  if (i + VEC <= n) {
    Pack<Word, VEC> pack;
#pragma unroll
    for (int k = 0; k < VEC; ++k) pack.v[k] = value;
    store_pack<Word, VEC>(dst + i, pack);
  } else {
    for (int64_t j = i; j < n; ++j) dst[j] = value;
  }
}

template <class Word>
void launch_fill(Word* dst, int64_t n, Word value, cudaStream_t stream) {
  constexpr int kVec = kVec16<Word>;
  if (is_aligned(dst, 16)) {
    fill_kernel<Word, kVec><<<flat_blocks<kVec>("fill", n), kThreads, 0, stream>>>(dst, n, value);
  } else {
    fill_kernel<Word, 1><<<flat_blocks<1>("fill", n), kThreads, 0, stream>>>(dst, n, value);
  }
  TS_CUDA_CHECK_LAUNCH("fill_kernel");
}

template <class Dst, class Src, int VEC>
__global__ void convert_kernel(Dst* dst, const Src* src, int64_t n) {
  const int64_t i = flat_index(VEC);
  if (i + VEC <= n) {
    float v[VEC];
    load_floats<Src, VEC>(src + i, v);
    store_floats<Dst, VEC>(dst + i, v);
  } else {
    for (int64_t j = i; j < n; ++j) dst[j] = from_float<Dst>(to_float(src[j]));
  }
}

template <class Dst, class Src>
void launch_convert(Dst* dst, const Src* src, int64_t n, cudaStream_t stream) {
  constexpr int kVec = 8;  // one 16-byte bf16 access, two fp32 ones
  if (is_aligned(dst, 16) && is_aligned(src, 16)) {
    convert_kernel<Dst, Src, kVec>
        <<<flat_blocks<kVec>("convert", n), kThreads, 0, stream>>>(dst, src, n);
  } else {
    convert_kernel<Dst, Src, 1><<<flat_blocks<1>("convert", n), kThreads, 0, stream>>>(dst, src, n);
  }
  TS_CUDA_CHECK_LAUNCH("convert_kernel");
}

// fmaf, not mean + std * z: ref::init_normal uses std::fma so that both sides round once.
template <class T, int VEC>
__global__ void init_normal_kernel(T* dst, int64_t n, uint64_t seed, uint64_t first_index,
                                   float mean, float std) {
  const int64_t i = flat_index(VEC);
  if (i + VEC <= n) {
    float v[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      v[k] = fmaf(std, random_normal(seed, first_index + static_cast<uint64_t>(i + k)), mean);
    }
    store_floats<T, VEC>(dst + i, v);
  } else {
    for (int64_t j = i; j < n; ++j) {
      dst[j] = from_float<T>(
          fmaf(std, random_normal(seed, first_index + static_cast<uint64_t>(j)), mean));
    }
  }
}

// out = f(a, b) elementwise in fp32, stored in T; b may be null for one-input maps. Inputs are
// read before the output is written, so out may alias either.
template <class T, int VEC, class F>
__global__ void map_kernel(T* out, const T* a, const T* b, int64_t n, F f) {
  const int64_t i = flat_index(VEC);
  if (i + VEC <= n) {
    float x[VEC], y[VEC] = {};
    load_floats<T, VEC>(a + i, x);
    if (b != nullptr) load_floats<T, VEC>(b + i, y);
#pragma unroll
    for (int k = 0; k < VEC; ++k) x[k] = f(x[k], y[k]);
    store_floats<T, VEC>(out + i, x);
  } else {
    for (int64_t j = i; j < n; ++j)
      out[j] = from_float<T>(f(to_float(a[j]), b != nullptr ? to_float(b[j]) : 0.0f));
  }
}

template <class F>
void launch_map(const char* op, void* out, const void* a, const void* b, int64_t n, DType dtype,
                cudaStream_t stream, F f) {
  NvtxRange range(op);
  if (n == 0) return;
  dispatch_float(dtype, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = kVec16<T>;
    if (is_aligned(out, 16) && is_aligned(a, 16) && (b == nullptr || is_aligned(b, 16))) {
      map_kernel<T, kVec><<<flat_blocks<kVec>(op, n), kThreads, 0, stream>>>(
          static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), n, f);
    } else {
      map_kernel<T, 1><<<flat_blocks<1>(op, n), kThreads, 0, stream>>>(
          static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), n, f);
    }
    TS_CUDA_CHECK_LAUNCH(op);
  });
}

struct AddOp {
  __device__ float operator()(float x, float y) const { return x + y; }
};
struct ScaleOp {
  float alpha;
  __device__ float operator()(float x, float) const { return alpha * x; }
};
struct SoftcapOp {
  float cap;
  __device__ float operator()(float x, float) const { return cap * tanhf(x / cap); }
};
// x is dy, y the capped value.
struct SoftcapBackwardOp {
  float cap;
  __device__ float operator()(float dy, float y) const {
    const float t = y / cap;
    return dy * (1.0f - t * t);
  }
};

// One thread per Word of a copied row; a row is whole Words (16 bytes where the rows and
// pointers allow it, so that each access is one vector load or store).
template <class Word>
__global__ void copy_rows_kernel(Word* dst, const int32_t* dst_rows, const Word* src,
                                 const int32_t* src_rows, int64_t count, int64_t row_words) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w >= count * row_words) return;
  const int64_t i = w / row_words, c = w % row_words;
  const int64_t to = dst_rows ? dst_rows[i] : i, from = src_rows ? src_rows[i] : i;
  dst[to * row_words + c] = src[from * row_words + c];
}

}  // namespace

void fill(void* dst, int64_t n, float value, DType dtype, cudaStream_t stream) {
  NvtxRange range("fill");
  if (n == 0) return;
  switch (dtype) {
    case DType::F32: {
      uint32_t bits;
      static_assert(sizeof(bits) == sizeof(value));
      std::memcpy(&bits, &value, sizeof(bits));
      return launch_fill(static_cast<uint32_t*>(dst), n, bits, stream);
    }
    case DType::BF16:
      return launch_fill(static_cast<uint16_t*>(dst), n, float_to_bf16_bits(value), stream);
    case DType::I32: {
      const int32_t i = static_cast<int32_t>(value);
      uint32_t bits;
      std::memcpy(&bits, &i, sizeof(bits));
      return launch_fill(static_cast<uint32_t*>(dst), n, bits, stream);
    }
    default:
      throw_unsupported_dtype("fill", dtype);
  }
}

void convert(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n,
             cudaStream_t stream) {
  NvtxRange range("convert");
  if (n == 0) return;
  if (dst_dtype == src_dtype) {
    TS_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * dtype_size(dst_dtype),
                                  cudaMemcpyDeviceToDevice, stream));
  } else if (dst_dtype == DType::BF16 && src_dtype == DType::F32) {
    launch_convert(static_cast<bf16*>(dst), static_cast<const float*>(src), n, stream);
  } else if (dst_dtype == DType::F32 && src_dtype == DType::BF16) {
    launch_convert(static_cast<float*>(dst), static_cast<const bf16*>(src), n, stream);
  } else {
    throw_unsupported_dtype("convert", dst_dtype == DType::F32 ? src_dtype : dst_dtype);
  }
}

void init_normal(void* dst, int64_t n, uint64_t seed, uint64_t first_index, float mean, float std,
                 DType dtype, cudaStream_t stream) {
  NvtxRange range("init_normal");
  if (n == 0) return;
  dispatch_float(dtype, "init_normal", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = kVec16<T>;
    T* p = static_cast<T*>(dst);
    if (is_aligned(p, 16)) {
      init_normal_kernel<T, kVec><<<flat_blocks<kVec>("init_normal", n), kThreads, 0, stream>>>(
          p, n, seed, first_index, mean, std);
    } else {
      init_normal_kernel<T, 1><<<flat_blocks<1>("init_normal", n), kThreads, 0, stream>>>(
          p, n, seed, first_index, mean, std);
    }
    TS_CUDA_CHECK_LAUNCH("init_normal_kernel");
  });
}

void add(void* out, const void* a, const void* b, int64_t n, DType dtype, cudaStream_t stream) {
  launch_map("add", out, a, b, n, dtype, stream, AddOp{});
}

void scale(void* out, const void* x, float alpha, int64_t n, DType dtype, cudaStream_t stream) {
  launch_map("scale", out, x, nullptr, n, dtype, stream, ScaleOp{alpha});
}

void softcap(void* out, const void* x, float cap, int64_t n, DType dtype, cudaStream_t stream) {
  launch_map("softcap", out, x, nullptr, n, dtype, stream, SoftcapOp{cap});
}

void softcap_backward(void* dx, const void* dy, const void* y, float cap, int64_t n, DType dtype,
                      cudaStream_t stream) {
  launch_map("softcap_backward", dx, dy, y, n, dtype, stream, SoftcapBackwardOp{cap});
}

void copy_rows(void* dst, const int32_t* dst_rows, const void* src, const int32_t* src_rows,
               int64_t count, size_t row_bytes, cudaStream_t stream) {
  NvtxRange range("copy_rows");
  if (count == 0 || row_bytes == 0) return;
  auto launch = [&](auto word) {
    using Word = decltype(word);
    const int64_t row_words = static_cast<int64_t>(row_bytes / sizeof(Word));
    const int64_t blocks = ceil_div(count * row_words, kThreads);
    check_grid("copy_rows", blocks);
    copy_rows_kernel<Word><<<blocks, kThreads, 0, stream>>>(static_cast<Word*>(dst), dst_rows,
                                                            static_cast<const Word*>(src), src_rows,
                                                            count, row_words);
    TS_CUDA_CHECK_LAUNCH("copy_rows_kernel");
  };
  if (row_bytes % 16 == 0 && is_aligned(dst, 16) && is_aligned(src, 16)) return launch(uint4{});
  if (row_bytes % 4 == 0 && is_aligned(dst, 4) && is_aligned(src, 4)) return launch(uint32_t{});
  TS_CHECK(row_bytes % 2 == 0, "copy_rows: rows of {} bytes", row_bytes);
  launch(uint16_t{});
}

}  // namespace tessera::cuda
