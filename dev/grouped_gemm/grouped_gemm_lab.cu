// The grouped GEMM lab: grouped_matmul_hopper.cu's kinds against cuBLAS run once per group
// (the bf16 ones: the backend's other path; the FP8 ones: bf16 GEMMs of the codes' values),
// checked and timed on the same inputs. See README.md.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "tessera/backend/cuda/grouped_matmul_hopper.cuh"

using tessera::cuda::bf16;

#define CHECK_CUDA(x)                                                                \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      std::exit(2);                                                                  \
    }                                                                                \
  } while (0)
#define CHECK_CUBLAS(x)                                                             \
  do {                                                                              \
    cublasStatus_t e = (x);                                                         \
    if (e != CUBLAS_STATUS_SUCCESS) {                                               \
      std::fprintf(stderr, "%s:%d cublas status %d\n", __FILE__, __LINE__, int(e)); \
      std::exit(2);                                                                 \
    }                                                                               \
  } while (0)

namespace {

__device__ float as_float(bf16 x) {
  return __bfloat162float(x);
}
__device__ float as_float(float x) {
  return x;
}
__device__ void store(bf16* x, float v) {
  *x = __float2bfloat16(v);
}
__device__ void store(float* x, float v) {
  *x = v;
}

template <typename T>
__global__ void fill(T* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    store(x + i, (h & 0xFFFF) / 32768.f - 1.f);
  }
}

// result[0] = max |got - want| (bits; +inf for a non-finite got), result[1] = max |want|.
template <typename T>
__global__ void compare(const T* got, const T* want, int64_t n, unsigned* result) {
  unsigned diff = 0, scale = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float a = as_float(got[i]), b = as_float(want[i]);
    diff = max(diff, __float_as_uint(isfinite(a) ? fabsf(a - b) : INFINITY));
    scale = max(scale, __float_as_uint(fabsf(b)));
  }
  atomicMax(result, diff);
  atomicMax(result + 1, scale);
}

template <typename T>
struct Buffer {
  T* p = nullptr;
  int64_t n = 0;
  explicit Buffer(int64_t count) : n(count) {
    CHECK_CUDA(cudaMalloc(&p, std::max<int64_t>(count, 1) * sizeof(T)));
  }
  ~Buffer() { cudaFree(p); }
};

// max |got - want| / max |want|
template <typename T>
double relative_error(const Buffer<T>& got, const Buffer<T>& want) {
  Buffer<unsigned> result(2);
  CHECK_CUDA(cudaMemset(result.p, 0, 8));
  compare<<<528, 256>>>(got.p, want.p, got.n, result.p);
  unsigned host[2];
  CHECK_CUDA(cudaMemcpy(host, result.p, 8, cudaMemcpyDeviceToHost));
  float diff, scale;
  std::memcpy(&diff, &host[0], 4), std::memcpy(&scale, &host[1], 4);
  return scale > 0 ? diff / scale : diff;
}

struct Groups {
  std::vector<int32_t> offsets;
  int64_t R;
  Buffer<int32_t> device;
  Groups(const std::vector<int32_t>& sizes, int64_t extra_rows) : device(sizes.size() + 1) {
    offsets = {0};
    for (int32_t s : sizes) offsets.push_back(offsets.back() + s);
    R = offsets.back() + extra_rows;
    CHECK_CUDA(cudaMemcpy(device.p, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice));
  }
  int64_t G() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t used() const { return offsets.back(); }
};

template <typename F>
double time_ms(F&& run, int iters) {
  for (int i = 0; i < 3; ++i) run();
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  CHECK_CUDA(cudaEventRecord(start));
  for (int i = 0; i < iters; ++i) run();
  CHECK_CUDA(cudaEventRecord(stop));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  return ms / iters;
}

int failures = 0;
std::string only;  // --only: the cases whose name holds it (one launch each under a profiler)

void report(const char* kind, const std::string& name, double err, double tol, double flops,
            double ours_ms, double cublas_ms) {
  const bool ok = err <= tol;
  if (!ok) ++failures;
  std::printf("%-6s %-44s err %.2e %s", kind, name.c_str(), err, ok ? "ok  " : "FAIL");
  if (ours_ms > 0)
    std::printf(
        "  grouped %8.3f ms %6.1f TFLOP/s  cublas per group %8.3f ms %6.1f TFLOP/s  ratio %.3f",
        ours_ms, flops / ours_ms * 1e-9, cublas_ms, flops / cublas_ms * 1e-9, cublas_ms / ours_ms);
  std::printf("\n");
}

// Runs both paths once, checks ours against cuBLAS's within tol and, when timed, times both
// (iters launches each) and reports the line.
template <typename T, typename Ours, typename Cublas>
void check_and_time(const char* kind, const std::string& name, const Buffer<T>& ours,
                    const Buffer<T>& ref, Ours&& run_ours, Cublas&& run_cublas, double flops,
                    double tol, bool timed, int iters) {
  run_ours(), run_cublas();
  CHECK_CUDA(cudaDeviceSynchronize());
  const double err = relative_error(ours, ref);
  double t_ours = 0, t_cublas = 0;
  if (timed) t_ours = time_ms(run_ours, iters), t_cublas = time_ms(run_cublas, iters);
  report(kind, name, err, tol, flops, t_ours, t_cublas);
}

// out[rows_g] = a[rows_g] @ op(b[g]) through both paths.
void forward_case(cublasHandle_t h, const std::string& name, const std::vector<int32_t>& sizes,
                  int64_t N, int64_t K, bool trans_b, bool timed) {
  if (name.find(only) == std::string::npos) return;
  Groups g(sizes, 5);
  const int64_t G = g.G();
  Buffer<bf16> a(g.R * K), b(G * N * K), ours(g.R * N), ref(g.R * N);
  fill<<<264, 256>>>(a.p, a.n, 1), fill<<<264, 256>>>(b.p, b.n, 2);
  fill<<<264, 256>>>(ours.p, ours.n, 3);  // rows past the groups must come back zero
  CHECK_CUDA(cudaMemset(ref.p, 0, ref.n * 2));
  const float one = 1, zero = 0;
  auto run_ours = [&] {
    tessera::cuda::grouped_matmul_hopper(ours.p, a.p, b.p, g.device.p, G, g.R, N, K, trans_b,
                                         nullptr);
  };
  // Column-major view: out^T (N x M_g) = op(b)^T-as-stored x a^T.
  auto run_cublas = [&] {
    for (int64_t i = 0; i < G; ++i) {
      const int64_t rows = g.offsets[i + 1] - g.offsets[i];
      if (rows == 0) continue;
      CHECK_CUBLAS(cublasGemmEx(
          h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, N, rows, K, &one, b.p + i * N * K,
          CUDA_R_16BF, trans_b ? K : N, a.p + g.offsets[i] * K, CUDA_R_16BF, K, &zero,
          ref.p + g.offsets[i] * N, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
  };
  check_and_time(trans_b ? "fwd" : "dgrad", name, ours, ref, run_ours, run_cublas,
                 2.0 * g.used() * N * K, 1e-2, timed, 20);
}

// out[g] = beta out[g] + a[rows_g]^T b[rows_g] through both paths.
template <typename Out>
void wgrad_case(cublasHandle_t h, const std::string& name, const std::vector<int32_t>& sizes,
                int64_t M, int64_t N, float beta, bool timed) {
  if (name.find(only) == std::string::npos) return;
  Groups g(sizes, 3);
  const int64_t G = g.G();
  constexpr bool fp32 = std::is_same_v<Out, float>;
  Buffer<bf16> a(g.R * M), b(g.R * N);
  Buffer<Out> ours(G * M * N), ref(G * M * N);
  fill<<<264, 256>>>(a.p, a.n, 4), fill<<<264, 256>>>(b.p, b.n, 5);
  fill<<<264, 256>>>(ours.p, ours.n, 6);  // beta 0 must not read it
  CHECK_CUDA(cudaMemcpy(ref.p, ours.p, ours.n * sizeof(Out), cudaMemcpyDeviceToDevice));
  auto run_ours = [&] {
    tessera::cuda::grouped_matmul_wgrad_hopper(ours.p, fp32, a.p, b.p, g.device.p, G, g.R, M, N,
                                               beta, nullptr);
  };
  const float one = 1;
  // Column-major: out^T (N x M) = b^T (N x rows) a (rows x M).
  auto run_cublas = [&] {
    for (int64_t i = 0; i < G; ++i) {
      const int64_t rows = g.offsets[i + 1] - g.offsets[i];
      CHECK_CUBLAS(cublasGemmEx(
          h, CUBLAS_OP_N, CUBLAS_OP_T, N, M, rows, &one, b.p + g.offsets[i] * N, CUDA_R_16BF, N,
          a.p + g.offsets[i] * M, CUDA_R_16BF, M, &beta, ref.p + i * M * N,
          fp32 ? CUDA_R_32F : CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
  };
  // beta 1 accumulates on every repeat: time only overwriting cases.
  check_and_time("wgrad", name + (fp32 ? " fp32" : " bf16") + (beta != 0 ? " beta1" : ""), ours,
                 ref, run_ours, run_cublas, 2.0 * g.used() * M * N, fp32 ? 1e-4 : 1e-2,
                 timed && beta == 0, 10);
}

// Random finite FP8 codes of magnitude about 0.25-2 (exponents around the bias), so that
// sums over thousands of products stay far from overflow; and their values in bf16, which
// holds every e4m3 and e5m2 value exactly.
__global__ void fill_codes(uint8_t* x, int64_t n, uint32_t seed, bool e5m2) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    const uint32_t sign = (h >> 8) & 0x80;
    x[i] = static_cast<uint8_t>(e5m2 ? sign | ((13 + (h & 3)) << 2) | ((h >> 2) & 3)
                                     : sign | ((5 + (h & 3)) << 3) | ((h >> 2) & 7));
  }
}
__global__ void decode_codes(const uint8_t* x, bf16* out, int64_t n, bool e5m2) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    __nv_fp8_storage_t c = x[i];
    const __half_raw h = __nv_cvt_fp8_to_halfraw(c, e5m2 ? __NV_E5M2 : __NV_E4M3);
    out[i] = __float2bfloat16(__half2float(__half(h)));
  }
}

// FP8 codes on the device with their bf16 values.
struct Codes {
  Buffer<uint8_t> codes;
  Buffer<bf16> values;
  Codes(int64_t n, uint32_t seed, bool e5m2) : codes(n), values(n) {
    fill_codes<<<264, 256>>>(codes.p, n, seed, e5m2);
    decode_codes<<<264, 256>>>(codes.p, values.p, n, e5m2);
  }
};

// The FP8 forward (and data gradient, the same kind over transposed weight codes): out[rows_g]
// = a[rows_g] b[g]^T x a_scale x b_scale[g], against cuBLAS bf16 GEMMs of the codes' values
// with the scales as alpha (the products are exact in both; only the sums' order differs).
void fp8_forward_case(cublasHandle_t h, const std::string& name, const std::vector<int32_t>& sizes,
                      int64_t N, int64_t K, bool a_e5m2, bool split, bool timed) {
  if (name.find(only) == std::string::npos) return;
  Groups g(sizes, 16);
  const int64_t G = g.G();
  Codes a(g.R * K, 7, a_e5m2), b(G * N * K, 8, false);
  Buffer<bf16> ours(g.R * N), ref(g.R * N);
  Buffer<float> scales(G + 1);
  std::vector<float> host(G + 1);
  for (int64_t i = 0; i <= G; ++i) host[i] = i == 0 ? 0.5f : 0.25f + 0.01f * static_cast<float>(i);
  CHECK_CUDA(cudaMemcpy(scales.p, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  fill<<<264, 256>>>(ours.p, ours.n, 3);
  CHECK_CUDA(cudaMemset(ref.p, 0, ref.n * 2));
  auto run_ours = [&] {
    tessera::cuda::grouped_matmul_fp8_hopper(ours.p, a.codes.p, a_e5m2, b.codes.p, scales.p,
                                             scales.p + 1, g.device.p, G, g.R, N, K, split,
                                             nullptr);
  };
  const float zero = 0;
  auto run_cublas = [&] {
    for (int64_t i = 0; i < G; ++i) {
      const int64_t rows = g.offsets[i + 1] - g.offsets[i];
      if (rows == 0) continue;
      const float alpha = host[0] * host[i + 1];
      CHECK_CUBLAS(cublasGemmEx(
          h, CUBLAS_OP_T, CUBLAS_OP_N, N, rows, K, &alpha, b.values.p + i * N * K, CUDA_R_16BF, K,
          a.values.p + g.offsets[i] * K, CUDA_R_16BF, K, &zero, ref.p + g.offsets[i] * N,
          CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
  };
  check_and_time(split ? "f8fwd+" : "f8fwd", name + (a_e5m2 ? " e5m2" : " e4m3"), ours, ref,
                 run_ours, run_cublas, 2.0 * g.used() * N * K, 1e-2, timed, 20);
}

// The FP8 weight gradient: out[g] = beta out[g] + a_t[:, rows_g] b_t[:, rows_g]^T x both
// scales, over the activations' transposed codes (M, R) and (N, R), fp32 out. The tensor cores
// keep about 14 bits of an FP8 sum (measured here: 1.2-2.5e-4 of the largest output with split
// accumulation, whatever the depth), so the tolerance is 1e-3, not fp32's; without split
// accumulation (fast) the error grows with the rows an expert sums.
void fp8_wgrad_case(cublasHandle_t h, const std::string& name, const std::vector<int32_t>& sizes,
                    int64_t M, int64_t N, float beta, bool split, bool timed) {
  if (name.find(only) == std::string::npos) return;
  Groups g(sizes, 16);
  const int64_t G = g.G();
  Codes a(M * g.R, 9, true), b(N * g.R, 10, false);  // the gradient's e5m2, the input's e4m3
  Buffer<float> ours(G * M * N), ref(G * M * N), scales(2);
  const float host[2] = {0.5f, 0.125f};
  CHECK_CUDA(cudaMemcpy(scales.p, host, 8, cudaMemcpyHostToDevice));
  fill<<<264, 256>>>(ours.p, ours.n, 6);
  CHECK_CUDA(cudaMemcpy(ref.p, ours.p, ours.n * 4, cudaMemcpyDeviceToDevice));
  auto run_ours = [&] {
    tessera::cuda::grouped_matmul_fp8_wgrad_hopper(ours.p, true, a.codes.p, true, b.codes.p,
                                                   scales.p, scales.p + 1, g.device.p, G, g.R, M, N,
                                                   beta, split, nullptr);
  };
  const float alpha = host[0] * host[1];
  // Column-major: out^T (N x M) = b_t's columns (rows x N)^T a_t's columns (rows x M).
  auto run_cublas = [&] {
    for (int64_t i = 0; i < G; ++i) {
      const int64_t rows = g.offsets[i + 1] - g.offsets[i];
      CHECK_CUBLAS(
          cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, rows, &alpha, b.values.p + g.offsets[i],
                       CUDA_R_16BF, g.R, a.values.p + g.offsets[i], CUDA_R_16BF, g.R, &beta,
                       ref.p + i * M * N, CUDA_R_32F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
  };
  check_and_time(split ? "f8wgr+" : "f8wgrad", name + (beta != 0 ? " beta1" : ""), ours, ref,
                 run_ours, run_cublas, 2.0 * g.used() * M * N, split ? 1e-3 : 1e-2,
                 timed && beta == 0, 10);
}

}  // namespace

int main(int argc, char** argv) {
  bool bench = true;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--no-bench") bench = false;
    if (std::string(argv[i]) == "--only" && i + 1 < argc) only = argv[++i];
  }
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  Buffer<bf16> probe(8);
  if (!tessera::cuda::grouped_matmul_hopper_takes(device, 1, 2, {8}, {probe.p})) {
    std::printf("grouped_matmul_hopper does not run on this device\n");
    return 1;
  }
  cublasHandle_t h;
  CHECK_CUBLAS(cublasCreate(&h));

  // Correctness at awkward shapes: empty groups, groups of 1 row, rows not multiples of 16,
  // N and K not multiples of the tiles.
  const std::vector<int32_t> odd = {37, 0, 300, 1, 150, 0};
  for (bool trans_b : {true, false}) {
    forward_case(h, "odd groups N264 K200", odd, 264, 200, trans_b, false);
    forward_case(h, "one group N512 K64", {0, 0, 1000, 0}, 512, 64, trans_b, false);
    forward_case(h, "all empty N64 K64", {0, 0}, 64, 64, trans_b, false);
  }
  for (float beta : {0.f, 1.f}) {
    wgrad_case<float>(h, "odd groups M264 N200", odd, 264, 200, beta, false);
    wgrad_case<bf16>(h, "odd groups M264 N200", odd, 264, 200, beta, false);
    wgrad_case<float>(h, "rows 8 24 40 M136 N72", {8, 24, 40}, 136, 72, beta, false);
  }

  // The Mixtral 8x7B proxy's experts (seq 8192, top 2, balanced: 2048 rows each), routed
  // unevenly, and 64 small experts (DeepSeek-like widths).
  const std::vector<int32_t> mixtral(8, 2048);
  const std::vector<int32_t> uneven = {3008, 1008, 2496, 1504, 2048, 2048, 1792, 2480};
  const std::vector<int32_t> small(64, 512);
  const std::vector<int32_t> qwen3(128, 512);  // Qwen3-30B-A3B: 128 experts top-8
  const bool t = bench;
  forward_case(h, "mixtral gate_up N28672 K4096", mixtral, 28672, 4096, true, t);
  forward_case(h, "mixtral down N4096 K14336", mixtral, 4096, 14336, true, t);
  forward_case(h, "mixtral uneven gate_up", uneven, 28672, 4096, true, t);
  forward_case(h, "64 experts N2816 K2048", small, 2816, 2048, true, t);
  forward_case(h, "qwen3 128 experts gate_up N1536 K2048", qwen3, 1536, 2048, true, t);
  forward_case(h, "qwen3 128 experts down N2048 K768", qwen3, 2048, 768, true, t);
  forward_case(h, "qwen3 128 experts down dgrad N768 K2048", qwen3, 768, 2048, false, t);
  forward_case(h, "mixtral gate_up dgrad N4096 K28672", mixtral, 4096, 28672, false, t);
  forward_case(h, "mixtral down dgrad N14336 K4096", mixtral, 14336, 4096, false, t);
  forward_case(h, "64 experts dgrad N2048 K2816", small, 2048, 2816, false, t);
  wgrad_case<float>(h, "mixtral gate_up M28672 N4096", mixtral, 28672, 4096, 0.f, t);
  wgrad_case<float>(h, "mixtral down M4096 N14336", mixtral, 4096, 14336, 0.f, t);
  wgrad_case<bf16>(h, "mixtral gate_up M28672 N4096", mixtral, 28672, 4096, 0.f, t);
  wgrad_case<float>(h, "mixtral uneven gate_up", uneven, 28672, 4096, 0.f, t);
  wgrad_case<float>(h, "64 experts M2816 N2048", small, 2816, 2048, 0.f, t);

  // The FP8 kinds (split accumulation marked +): groups of whole 16s (FP8's rule), empty ones,
  // tails of slices, two column tiles; then the proxies' shapes, timed against cuBLAS bf16
  // GEMMs per group.
  const std::vector<int32_t> odd16 = {160, 0, 320, 16, 48, 512};
  for (bool split : {false, true}) {
    fp8_forward_case(h, "odd groups N272 K400", odd16, 272, 400, split, split, false);
    fp8_forward_case(h, "one group N512 K64", {0, 0, 1008, 0}, 512, 64, false, split, false);
  }
  for (float beta : {0.f, 1.f})
    fp8_wgrad_case(h, "odd groups M272 N400", odd16, 272, 400, beta, true, false);
  fp8_forward_case(h, "mixtral gate_up N28672 K4096", mixtral, 28672, 4096, false, false, t);
  fp8_forward_case(h, "mixtral down dgrad N4096 K14336", mixtral, 4096, 14336, true, true, t);
  fp8_forward_case(h, "qwen3 128 experts gate_up N1536 K2048", qwen3, 1536, 2048, false, false, t);
  fp8_forward_case(h, "qwen3 128 experts gate_up dgrad N2048 K1536", qwen3, 2048, 1536, true, true,
                   t);
  for (bool split : {true, false}) {
    fp8_wgrad_case(h, "mixtral gate_up M28672 N4096", mixtral, 28672, 4096, 0.f, split, t);
    fp8_wgrad_case(h, "qwen3 128 experts gate_up M1536 N2048", qwen3, 1536, 2048, 0.f, split, t);
  }
  std::printf("%s: %d failing\n", failures ? "FAILED" : "PASSED", failures);
  cublasDestroy(h);
  return failures ? 1 : 0;
}
