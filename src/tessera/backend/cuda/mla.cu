#include "tessera/backend/cuda/mla.cuh"

#include <algorithm>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"

namespace tessera::cuda {
namespace {

struct MlaDims {
  int64_t seq = 0, H = 0, D = 0, Dn = 0, Dr = 0, Dv = 0, width = 0;
};

MlaDims dims_of(const MlaQkvView& a) {
  MlaDims d;
  d.seq = a.s.seq;
  d.H = a.s.heads;
  d.D = a.s.head_dim;
  d.Dr = a.rope_dim;
  d.Dn = d.D - d.Dr;
  d.Dv = a.s.v_dim();
  d.width = a.s.qkv_width();
  return d;
}

// DeepSeek's rope of an interleaved vector x into the rotate-half layout, element i of the
// output (ops/backend.h, MlaQkvArgs).
template <class T>
__device__ __forceinline__ float rope_out(const T* x, const float* freqs_t, int64_t half,
                                          int64_t i) {
  const int64_t f = i < half ? i : i - half;
  const float c = freqs_t[f], s = freqs_t[half + f];
  const float even = to_float(x[2 * f]), odd = to_float(x[2 * f + 1]);
  return i < half ? c * even - s * odd : s * even + c * odd;
}

// Its transpose: element e of the interleaved input's gradient from g (rotate-half layout).
__device__ __forceinline__ float rope_grad(float g_lo, float g_hi, const float* freqs_t,
                                           int64_t half, int64_t e) {
  const int64_t f = e / 2;
  const float c = freqs_t[f], s = freqs_t[half + f];
  return e % 2 == 0 ? c * g_lo + s * g_hi : -s * g_lo + c * g_hi;
}

// One block per token over its qkv row: query heads, key heads, value heads.
template <class T>
__global__ void mla_qkv_forward_kernel(T* qkv, const T* q, int64_t q_stride, const T* k_rope,
                                       int64_t k_stride, const T* kv, const float* freqs,
                                       MlaDims m) {
  const int64_t n = blockIdx.x;
  const float* freqs_t = freqs + (n % m.seq) * m.Dr;
  const T* q_row = q + n * q_stride;
  const T* k_row = k_rope + n * k_stride;
  const T* kv_row = kv + n * m.H * (m.Dn + m.Dv);
  T* row = qkv + n * m.width;
  const int64_t half = m.Dr / 2, heads = m.H * m.D;
  for (int64_t c = threadIdx.x; c < m.width; c += blockDim.x) {
    float v;
    if (c < heads) {  // query head h
      const int64_t h = c / m.D, d = c % m.D;
      v = d < m.Dn ? to_float(q_row[h * m.D + d])
                   : rope_out(q_row + h * m.D + m.Dn, freqs_t, half, d - m.Dn);
    } else if (c < 2 * heads) {  // key head h: its nope part, then the shared rope key
      const int64_t h = (c - heads) / m.D, d = (c - heads) % m.D;
      v = d < m.Dn ? to_float(kv_row[h * (m.Dn + m.Dv) + d])
                   : rope_out(k_row, freqs_t, half, d - m.Dn);
    } else {  // value head h
      const int64_t h = (c - 2 * heads) / m.Dv, d = (c - 2 * heads) % m.Dv;
      v = to_float(kv_row[h * (m.Dn + m.Dv) + m.Dn + d]);
    }
    row[c] = from_float<T>(v);
  }
}

// One block per token. The rope key's gradient sums the heads' in head order (shared memory,
// Dr floats), then rotates back.
template <class T>
__global__ void mla_qkv_backward_kernel(T* dq, int64_t q_stride, T* dk_rope, int64_t k_stride,
                                        T* dkv, const T* dqkv, const float* freqs, MlaDims m) {
  extern __shared__ float k_sum[];  // (Dr)
  const int64_t n = blockIdx.x;
  const float* freqs_t = freqs + (n % m.seq) * m.Dr;
  const T* g = dqkv + n * m.width;
  T* dq_row = dq + n * q_stride;
  T* dkv_row = dkv + n * m.H * (m.Dn + m.Dv);
  const int64_t half = m.Dr / 2, heads = m.H * m.D;
  for (int64_t c = threadIdx.x; c < heads; c += blockDim.x) {
    const int64_t h = c / m.D, d = c % m.D;
    const T* gq = g + h * m.D + m.Dn;
    dq_row[c] = d < m.Dn ? g[c]
                         : from_float<T>(rope_grad(to_float(gq[(d - m.Dn) / 2]),
                                                   to_float(gq[half + (d - m.Dn) / 2]), freqs_t,
                                                   half, d - m.Dn));
  }
  for (int64_t c = threadIdx.x; c < m.H * (m.Dn + m.Dv); c += blockDim.x) {
    const int64_t h = c / (m.Dn + m.Dv), d = c % (m.Dn + m.Dv);
    dkv_row[c] = d < m.Dn ? g[heads + h * m.D + d] : g[2 * heads + h * m.Dv + d - m.Dn];
  }
  for (int64_t j = threadIdx.x; j < m.Dr; j += blockDim.x) {
    float sum = 0.0f;
    for (int64_t h = 0; h < m.H; ++h) sum += to_float(g[heads + h * m.D + m.Dn + j]);
    k_sum[j] = sum;
  }
  __syncthreads();
  T* dk_row = dk_rope + n * k_stride;
  for (int64_t e = threadIdx.x; e < m.Dr; e += blockDim.x)
    dk_row[e] = from_float<T>(rope_grad(k_sum[e / 2], k_sum[half + e / 2], freqs_t, half, e));
}

template <class T>
__global__ void copy_columns_kernel(T* dst, int64_t dst_width, const T* src, int64_t src_width,
                                    int64_t rows, int64_t cols) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= rows * cols) return;
  const int64_t r = i / cols, c = i % cols;
  dst[r * dst_width + c] = src[r * src_width + c];
}

int threads_for(int64_t work) {
  return static_cast<int>(std::min<int64_t>(512, ceil_div(std::max<int64_t>(work, 1), 32) * 32));
}

}  // namespace

void mla_qkv_forward(const MlaQkvView& a, DType dtype, cudaStream_t stream) {
  NvtxRange range("mla_qkv_forward");
  const int64_t rows = a.s.tokens();
  if (rows == 0) return;
  check_grid("mla_qkv_forward", rows);
  const MlaDims m = dims_of(a);
  dispatch_float(dtype, "mla_qkv_forward", [&](auto tag) {
    using T = decltype(tag);
    mla_qkv_forward_kernel<T><<<rows, threads_for(m.width), 0, stream>>>(
        static_cast<T*>(a.qkv), static_cast<const T*>(a.q), a.q_stride,
        static_cast<const T*>(a.k_rope), a.k_stride, static_cast<const T*>(a.kv), a.freqs, m);
    TS_CUDA_CHECK_LAUNCH("mla_qkv_forward_kernel");
  });
}

void mla_qkv_backward(const MlaQkvView& g, DType dtype, cudaStream_t stream) {
  NvtxRange range("mla_qkv_backward");
  const int64_t rows = g.s.tokens();
  if (rows == 0) return;
  check_grid("mla_qkv_backward", rows);
  const MlaDims m = dims_of(g);
  dispatch_float(dtype, "mla_qkv_backward", [&](auto tag) {
    using T = decltype(tag);
    mla_qkv_backward_kernel<T><<<rows, threads_for(m.H * m.D), m.Dr * sizeof(float), stream>>>(
        static_cast<T*>(g.q), g.q_stride, static_cast<T*>(g.k_rope), g.k_stride,
        static_cast<T*>(g.kv), static_cast<const T*>(g.qkv), g.freqs, m);
    TS_CUDA_CHECK_LAUNCH("mla_qkv_backward_kernel");
  });
}

void copy_columns(void* dst, int64_t dst_width, int64_t dst_col, const void* src, int64_t src_width,
                  int64_t src_col, int64_t rows, int64_t cols, size_t element_bytes,
                  cudaStream_t stream) {
  NvtxRange range("copy_columns");
  if (rows * cols == 0) return;
  // The widest unit (16 bytes down to one element) that every row's block starts on and that
  // divides the widths and the block: a quarter of the time of element copies for bf16 blocks
  // of whole heads (context parallelism's keys and values).
  const auto d = reinterpret_cast<uintptr_t>(static_cast<char*>(dst) + dst_col * element_bytes);
  const auto s = reinterpret_cast<uintptr_t>(static_cast<const char*>(src) + src_col * element_bytes);
  const uint64_t widths = (dst_width | src_width | cols) * element_bytes;
  size_t unit = 16;
  while (unit > element_bytes && ((d | s | widths) % unit) != 0) unit /= 2;
  const int64_t per_unit = static_cast<int64_t>(unit / element_bytes);
  const int64_t units = rows * (cols / per_unit);
  const int64_t blocks = ceil_div(units, 256);
  check_grid("copy_columns", blocks);
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    copy_columns_kernel<T><<<blocks, 256, 0, stream>>>(
        reinterpret_cast<T*>(d), dst_width / per_unit, reinterpret_cast<const T*>(s),
        src_width / per_unit, rows, cols / per_unit);
    TS_CUDA_CHECK_LAUNCH("copy_columns_kernel");
  };
  switch (unit) {
    case 1:
      return launch(uint8_t{});
    case 2:
      return launch(uint16_t{});
    case 4:
      return launch(uint32_t{});
    case 8:
      return launch(uint64_t{});
    default:
      return launch(uint4{});
  }
}

}  // namespace tessera::cuda
