#include "tessera/backend/cuda/rope.cuh"

#include <algorithm>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"

namespace tessera::cuda {
namespace {

// One block per token: its threads cover (rotated head, pack of VEC pairs); at H + KV = 40,
// D = 128 that is 40 x 8 = 320 threads, each doing two 16-byte loads and stores of the head
// and two pairs of fp32 loads of the (L2-resident) cos/sin row.
template <class T, int VEC>
__global__ void rope_kernel(T* qkv, const float* freqs, int64_t seq, int64_t rotated_heads,
                            int64_t width, int64_t head_dim, float sign) {
  const int64_t row = blockIdx.x;
  const int64_t half = head_dim / 2, packs = half / VEC;
  const float* cos_t = freqs + (row % seq) * head_dim;
  const float* sin_t = cos_t + half;
  T* token = qkv + row * width;
  for (int64_t p = threadIdx.x; p < rotated_heads * packs; p += blockDim.x) {
    const int64_t head = p / packs, i = (p % packs) * VEC;
    T* x = token + head * head_dim + i;
    float x1[VEC], x2[VEC], c[VEC], s[VEC];
    load_floats<T, VEC>(x, x1);
    load_floats<T, VEC>(x + half, x2);
    load_floats<float, VEC>(cos_t + i, c);
    load_floats<float, VEC>(sin_t + i, s);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float sine = sign * s[k];
      const float a = x1[k] * c[k] - x2[k] * sine;
      const float b = x2[k] * c[k] + x1[k] * sine;
      x1[k] = a;
      x2[k] = b;
    }
    store_floats<T, VEC>(x, x1);
    store_floats<T, VEC>(x + half, x2);
  }
}

void launch_rope(const char* name, void* qkv, const float* freqs, const RopeShape& s, DType dtype,
                 float sign, cudaStream_t stream) {
  NvtxRange range(name);
  const int64_t rows = s.batch * s.seq;
  if (rows == 0) return;
  check_grid(name, rows);
  const int64_t width = s.width;
  const int64_t rotated = s.heads + s.kv_heads;
  dispatch_float(dtype, name, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = kVec16<T>;
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const int64_t work = rotated * (s.head_dim / 2 / VEC);
      const int threads = static_cast<int>(std::min<int64_t>(1024, ceil_div(work, 32) * 32));
      rope_kernel<T, VEC><<<rows, threads, 0, stream>>>(static_cast<T*>(qkv), freqs, s.seq, rotated,
                                                        width, s.head_dim, sign);
    };
    if ((s.head_dim / 2) % kVec == 0 && is_aligned(qkv, 16) && is_aligned(freqs, 16)) {
      launch(std::integral_constant<int, kVec>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
    TS_CUDA_CHECK_LAUNCH("rope_kernel");
  });
}

}  // namespace

void rope_forward(void* qkv, const float* freqs, const RopeShape& s, DType dtype,
                  cudaStream_t stream) {
  launch_rope("rope_forward", qkv, freqs, s, dtype, 1.0f, stream);
}

void rope_backward(void* dqkv, const float* freqs, const RopeShape& s, DType dtype,
                   cudaStream_t stream) {
  launch_rope("rope_backward", dqkv, freqs, s, dtype, -1.0f, stream);
}

}  // namespace tessera::cuda
