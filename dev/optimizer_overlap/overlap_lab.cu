// Can AdamW's update hide behind the next step's forward GEMMs? The update is memory-bound
// (26 bytes a parameter with a split master, bf16 gradients and fp32 moments: a Mixtral
// 8x7B proxy's 6.06 B parameters are 158 GB, ~40 ms at 4 TB/s) and the forward is
// compute-bound, so in principle they share the GPU; in practice a GEMM's CTAs fill every SM
// (their registers and shared memory), so the two only overlap where the SMs are split
// between them. This lab times, on one GPU:
//   - the GEMMs alone and the update alone (Tessera's adamw_step kernel), then one after the
//     other on one stream;
//   - both at once on two streams of the primary context (the GEMMs' at high priority);
//   - both at once in two green contexts that split the SMs: S SMs update, the rest run the
//     GEMMs, with cuBLASLt's heuristic told the SM count it gets (SM_COUNT_TARGET);
//   - an 8192^3 GEMM run back to back for 8 seconds: its rate in the first sample and over
//     the last second (the rate a long training step's GEMMs are held to as the GPU clocks
//     down, against the short bursts bench gemm measures).
// Before timing, the update on a green context is checked bit for bit against the same update
// on the primary context (green contexts read the memory the primary context allocated).
//
// Build and run: dev/optimizer_overlap/README.md.
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tessera/backend/cuda/adamw.cuh"

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void check(CUresult e, const char* what) {
  if (e != CUDA_SUCCESS) {
    const char* s = nullptr;
    cuGetErrorString(e, &s);
    std::fprintf(stderr, "%s: %s\n", what, s ? s : "?");
    std::exit(1);
  }
}
void check(cublasStatus_t e, const char* what) {
  if (e != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: cublas status %d\n", what, static_cast<int>(e));
    std::exit(1);
  }
}

// Deterministic values in [lo, hi): the GEMMs' power draw (and so their clocks) depends on
// the bits they multiply, which zeros would understate.
template <class T>
__global__ void fill_kernel(T* p, int64_t n, uint32_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = static_cast<T>(lo + (hi - lo) * (static_cast<float>(h & 0xffffff) / 16777216.0f));
  }
}

template <class T>
void fill(void* p, int64_t n, uint32_t seed, float lo, float hi) {
  fill_kernel<T><<<1024, 256>>>(static_cast<T*>(p), n, seed, lo, hi);
  check(cudaGetLastError(), "fill");
}

// The optimizer state of `n` parameters as Tessera keeps it under the split master with bf16
// gradients: bf16 parameters (the master's high halves), the low halves, bf16 gradients, fp32
// moments.
struct OptimizerState {
  int64_t n = 0;
  void *params = nullptr, *low = nullptr, *grad = nullptr, *m = nullptr, *v = nullptr;
  float* norm_sq = nullptr;
  tessera::cuda::AdamWChunk* chunks = nullptr;
  int64_t chunk_count = 0;

  explicit OptimizerState(int64_t count) : n(count) {
    check(cudaMalloc(&params, n * 2), "params");
    check(cudaMalloc(&low, n * 2), "low");
    check(cudaMalloc(&grad, n * 2), "grad");
    check(cudaMalloc(&m, n * 4), "m");
    check(cudaMalloc(&v, n * 4), "v");
    check(cudaMalloc(&norm_sq, 4), "norm");
    reset();
    const tessera::ParamSegment whole{0, n, true};
    const std::vector<tessera::cuda::AdamWChunk> host = tessera::cuda::adamw_chunks({&whole, 1});
    chunk_count = static_cast<int64_t>(host.size());
    check(cudaMalloc(&chunks, host.size() * sizeof(host[0])), "chunks");
    check(cudaMemcpy(chunks, host.data(), host.size() * sizeof(host[0]), cudaMemcpyHostToDevice), "chunks");
  }
  OptimizerState(const OptimizerState&) = delete;
  OptimizerState& operator=(const OptimizerState&) = delete;
  ~OptimizerState() {
    for (void* p : {params, low, grad, m, v, static_cast<void*>(norm_sq), static_cast<void*>(chunks)}) cudaFree(p);
  }
  // A trained model's state: small parameters and gradients, first moments of either sign,
  // second moments positive; the low halves any bits.
  void reset() {
    fill<__nv_bfloat16>(params, n, 1, -0.05f, 0.05f);
    fill<uint16_t>(low, n, 2, 0.0f, 65536.0f);
    fill<__nv_bfloat16>(grad, n, 3, -1e-3f, 1e-3f);
    fill<float>(m, n, 4, -1e-4f, 1e-4f);
    fill<float>(v, n, 5, 1e-9f, 1e-6f);
    const float one = 1.0f;
    check(cudaMemcpy(norm_sq, &one, 4, cudaMemcpyHostToDevice), "norm");
  }
  double bytes() const { return 26.0 * static_cast<double>(n); }
  void step(cudaStream_t stream) const {
    tessera::cuda::AdamWBuffers b;
    b.master = low;
    b.master_dtype = tessera::DType::U16;
    b.params = params;
    b.params_dtype = tessera::DType::BF16;
    b.grad = grad;
    b.grad_dtype = tessera::DType::BF16;
    b.exp_avg = m;
    b.exp_avg_dtype = tessera::DType::F32;
    b.exp_avg_sq = v;
    b.exp_avg_sq_dtype = tessera::DType::F32;
    tessera::cuda::AdamWScalars s;
    s.c = tessera::ref::adamw_scalars<float>(tessera::ref::AdamWSettings{3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 10},
                                             true, 1.0);
    s.max_grad_norm = 1.0;
    tessera::cuda::adamw_step(b, norm_sq, chunks, chunk_count, s, stream);
  }
};

// D = A B for bf16 row-major A (M, K) and B (K, N), fp32 accumulation, through cuBLASLt with
// the heuristic's first algorithm for `sms` SMs (0: the device's). Plans of one shape share
// its operands.
struct Gemm {
  int64_t m, n, k;
  void *a = nullptr, *b = nullptr, *d = nullptr;
  cublasLtMatmulDesc_t desc{};
  cublasLtMatrixLayout_t la{}, lb{}, ld{};
  cublasLtMatmulAlgo_t algo{};
  double flops() const { return 2.0 * m * n * k; }
};

struct GemmRunner {
  cublasLtHandle_t lt{};
  void* workspace = nullptr;
  size_t workspace_bytes = size_t{64} << 20;
  std::vector<Gemm> operands;  // one per shape: its a, b and d
  GemmRunner() {
    check(cublasLtCreate(&lt), "cublasLtCreate");
    check(cudaMalloc(&workspace, workspace_bytes), "workspace");
  }
  // Column-major view: D^T (N, M) = B^T (N, K) A^T (K, M).
  Gemm make(int64_t m, int64_t n, int64_t k, int sms) {
    Gemm g{m, n, k};
    const auto same = std::find_if(operands.begin(), operands.end(),
                                   [&](const Gemm& o) { return o.m == m && o.n == n && o.k == k; });
    if (same != operands.end()) {
      g.a = same->a, g.b = same->b, g.d = same->d;
    } else {
      check(cudaMalloc(&g.a, m * k * 2), "A");
      check(cudaMalloc(&g.b, k * n * 2), "B");
      check(cudaMalloc(&g.d, m * n * 2), "D");
      fill<__nv_bfloat16>(g.a, m * k, 11, -1.0f, 1.0f);
      fill<__nv_bfloat16>(g.b, k * n, 12, -1.0f, 1.0f);
      operands.push_back(g);
    }
    check(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
    const int32_t target = sms;
    check(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &target, sizeof(target)),
          "sm count target");
    check(cublasLtMatrixLayoutCreate(&g.lb, CUDA_R_16BF, n, k, n), "layout B");
    check(cublasLtMatrixLayoutCreate(&g.la, CUDA_R_16BF, k, m, k), "layout A");
    check(cublasLtMatrixLayoutCreate(&g.ld, CUDA_R_16BF, n, m, n), "layout D");
    cublasLtMatmulPreference_t pref{};
    check(cublasLtMatmulPreferenceCreate(&pref), "pref");
    check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                               sizeof(workspace_bytes)),
          "pref workspace");
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    check(cublasLtMatmulAlgoGetHeuristic(lt, g.desc, g.lb, g.la, g.ld, g.ld, pref, 1, &result, &found), "heuristic");
    if (found == 0) {
      std::fprintf(stderr, "no cuBLASLt algorithm for %lld x %lld x %lld\n", static_cast<long long>(m),
                   static_cast<long long>(n), static_cast<long long>(k));
      std::exit(1);
    }
    g.algo = result.algo;
    cublasLtMatmulPreferenceDestroy(pref);
    return g;
  }
  void run(const Gemm& g, cudaStream_t stream) {
    const float one = 1.0f, zero = 0.0f;
    check(cublasLtMatmul(lt, g.desc, &one, g.b, g.lb, g.a, g.la, &zero, g.d, g.ld, g.d, g.ld, &g.algo, workspace,
                         workspace_bytes, stream),
          "cublasLtMatmul");
  }
};

// A Mixtral-like forward's GEMMs (gate_up, then down, over 16,384 routed rows; the attention
// projections), about as many FLOPs as one layer of the proxy's forward.
std::vector<Gemm> forward_gemms(GemmRunner& r, int sms) {
  return {r.make(16384, 28672, 4096, sms), r.make(16384, 4096, 14336, sms), r.make(8192, 6144, 4096, sms),
          r.make(8192, 4096, 4096, sms)};
}

double total_flops(const std::vector<Gemm>& gemms) {
  double f = 0;
  for (const Gemm& g : gemms) f += g.flops();
  return f;
}

// Milliseconds from the start (recorded on the GEMMs' stream, which the update's waits for)
// to each stream's end, medians of `reps` runs after one warm-up run.
struct Timing {
  double gemm_ms = 0, adamw_ms = 0, both_ms = 0;
};

Timing time_pair(GemmRunner& r, const std::vector<Gemm>& gemms, int gemm_rounds, const OptimizerState* state,
                 cudaStream_t gemm_stream, cudaStream_t adamw_stream, int reps) {
  std::vector<double> g_ms, a_ms, b_ms;
  cudaEvent_t start, g_end, a_end;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&g_end), "event");
  check(cudaEventCreate(&a_end), "event");
  for (int rep = 0; rep < reps + 1; ++rep) {
    check(cudaDeviceSynchronize(), "sync");
    check(cudaEventRecord(start, gemm_stream), "record");
    if (adamw_stream != gemm_stream) check(cudaStreamWaitEvent(adamw_stream, start), "wait");
    if (state) state->step(adamw_stream);
    for (int round = 0; round < gemm_rounds; ++round)
      for (const Gemm& g : gemms) r.run(g, gemm_stream);
    check(cudaEventRecord(g_end, gemm_stream), "record");
    check(cudaEventRecord(a_end, adamw_stream), "record");
    check(cudaDeviceSynchronize(), "sync");
    if (rep == 0) continue;
    float g = 0, a = 0;
    check(cudaEventElapsedTime(&g, start, g_end), "elapsed");
    check(cudaEventElapsedTime(&a, start, a_end), "elapsed");
    g_ms.push_back(g);
    a_ms.push_back(a);
    b_ms.push_back(std::max(g, a));
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  return {median(g_ms), median(a_ms), median(b_ms)};
}

// A green context of about `wanted` SMs (as the split rounds it) for the update and one of the
// rest for the GEMMs, each with a stream.
struct SmSplit {
  int optimizer_sms = 0, gemm_sms = 0;
  cudaStream_t optimizer_stream{}, gemm_stream{};
};

bool split_sms(CUdevice dev, int wanted, SmSplit& out) {
  CUdevResource all{};
  check(cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM), "device SMs");
  CUdevResource part{}, rest{};
  unsigned groups = 1;
  if (cuDevSmResourceSplitByCount(&part, &groups, &all, &rest, 0, static_cast<unsigned>(wanted)) != CUDA_SUCCESS ||
      groups != 1)
    return false;
  CUdevResourceDesc part_desc{}, rest_desc{};
  check(cuDevResourceGenerateDesc(&part_desc, &part, 1), "desc");
  check(cuDevResourceGenerateDesc(&rest_desc, &rest, 1), "desc");
  CUgreenCtx part_ctx{}, rest_ctx{};
  check(cuGreenCtxCreate(&part_ctx, part_desc, dev, CU_GREEN_CTX_DEFAULT_STREAM), "green context");
  check(cuGreenCtxCreate(&rest_ctx, rest_desc, dev, CU_GREEN_CTX_DEFAULT_STREAM), "green context");
  CUstream a{}, g{};
  check(cuGreenCtxStreamCreate(&a, part_ctx, CU_STREAM_NON_BLOCKING, 0), "stream");
  check(cuGreenCtxStreamCreate(&g, rest_ctx, CU_STREAM_NON_BLOCKING, 0), "stream");
  out.optimizer_sms = static_cast<int>(part.sm.smCount);
  out.gemm_sms = static_cast<int>(rest.sm.smCount);
  out.optimizer_stream = reinterpret_cast<cudaStream_t>(a);
  out.gemm_stream = reinterpret_cast<cudaStream_t>(g);
  return true;
}

// The update of a small state on `stream` equals the primary context's, bit for bit.
bool same_update(cudaStream_t stream) {
  const int64_t n = int64_t{1} << 22;
  OptimizerState ref(n), other(n);
  ref.step(nullptr);
  other.step(stream);
  check(cudaDeviceSynchronize(), "sync");
  std::vector<uint8_t> x(n * 4), y(n * 4);
  bool same = true;
  const std::pair<void*, void*> tensors[] = {{ref.params, other.params}, {ref.low, other.low}, {ref.m, other.m},
                                             {ref.v, other.v}};
  const size_t sizes[] = {static_cast<size_t>(n) * 2, static_cast<size_t>(n) * 2, static_cast<size_t>(n) * 4,
                          static_cast<size_t>(n) * 4};
  for (int t = 0; t < 4; ++t) {
    check(cudaMemcpy(x.data(), tensors[t].first, sizes[t], cudaMemcpyDeviceToHost), "download");
    check(cudaMemcpy(y.data(), tensors[t].second, sizes[t], cudaMemcpyDeviceToHost), "download");
    same = same && std::memcmp(x.data(), y.data(), sizes[t]) == 0;
  }
  return same;
}

void sustained_rate(GemmRunner& r) {
  const Gemm g = r.make(8192, 8192, 8192, 0);
  cudaStream_t s{};
  check(cudaStreamCreate(&s), "stream");
  const int per_sample = 20;
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "event");
  check(cudaEventCreate(&b), "event");
  std::printf("\n8192^3 bf16 GEMM back to back (TFLOP/s of samples of %d calls):\n", per_sample);
  double elapsed = 0, first = 0, last_sum = 0;
  int last_count = 0;
  std::vector<std::pair<double, double>> samples;  // (time since start, TFLOP/s)
  while (elapsed < 8000) {
    check(cudaEventRecord(a, s), "record");
    for (int i = 0; i < per_sample; ++i) r.run(g, s);
    check(cudaEventRecord(b, s), "record");
    check(cudaEventSynchronize(b), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "elapsed");
    elapsed += ms;
    samples.emplace_back(elapsed, per_sample * g.flops() / (ms * 1e-3) / 1e12);
  }
  for (const auto& [t, rate] : samples) {
    if (first == 0) first = rate;
    if (t > elapsed - 1000) {
      last_sum += rate;
      ++last_count;
    }
  }
  double peak = 0;
  for (const auto& [t, rate] : samples) peak = std::max(peak, rate);
  std::printf("  first sample (%.0f ms): %.1f; best sample: %.1f; mean of the last second: %.1f (%.1f%% of the best)\n",
              samples.front().first, first, peak, last_sum / last_count, 100.0 * last_sum / last_count / peak);
}

}  // namespace

int main(int argc, char** argv) {
  double params = 1.45e9;  // one Mixtral 8x7B layer
  int reps = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--params" && i + 1 < argc) params = std::atof(argv[++i]);
    else if (arg == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: overlap_lab [--params N] [--reps R]\n");
      return 2;
    }
  }
  check(cuInit(0), "cuInit");
  check(cudaSetDevice(0), "device");
  check(cudaFree(nullptr), "context");
  CUdevice dev{};
  check(cuDeviceGet(&dev, 0), "device");
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "SMs");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  std::printf("%s, %d SMs\n", prop.name, sms);

  GemmRunner runner;
  OptimizerState state(static_cast<int64_t>(params));
  const std::vector<Gemm> full = forward_gemms(runner, 0);
  const int rounds = 2;
  const double flops = rounds * total_flops(full);
  std::printf("update of %.3g parameters (%.1f GB); GEMMs: %.2f TFLOP\n", params, state.bytes() / 1e9, flops / 1e12);

  int lo = 0, hi = 0;
  check(cudaDeviceGetStreamPriorityRange(&lo, &hi), "priorities");
  cudaStream_t main_stream{}, high{}, low{};
  check(cudaStreamCreate(&main_stream), "stream");
  check(cudaStreamCreateWithPriority(&high, cudaStreamNonBlocking, hi), "stream");
  check(cudaStreamCreateWithPriority(&low, cudaStreamNonBlocking, lo), "stream");

  std::printf("\n| run | SMs update / GEMMs | GEMMs end ms | update end ms | both ms | GEMM TFLOP/s | update TB/s |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  auto row = [&](const char* name, const std::string& split, const Timing& t, bool gemms, bool update) {
    std::printf("| %s | %s | %.2f | %.2f | %.2f | %s | %s |\n", name, split.c_str(), gemms ? t.gemm_ms : 0.0,
                update ? t.adamw_ms : 0.0, t.both_ms,
                gemms ? std::to_string(static_cast<int>(flops / (t.gemm_ms * 1e-3) / 1e12)).c_str() : "",
                update ? std::to_string(state.bytes() / (t.adamw_ms * 1e-3) / 1e12).substr(0, 4).c_str() : "");
  };
  const std::string all = std::to_string(sms);
  const Timing g_alone = time_pair(runner, full, rounds, nullptr, main_stream, main_stream, reps);
  row("GEMMs alone", "- / " + all, g_alone, true, false);
  const Timing a_alone = time_pair(runner, full, 0, &state, main_stream, main_stream, reps);
  row("update alone", all + " / -", a_alone, false, true);
  const Timing serial = time_pair(runner, full, rounds, &state, main_stream, main_stream, reps);
  row("one stream, update first", all + " / " + all, serial, true, true);
  const Timing naive = time_pair(runner, full, rounds, &state, high, low, reps);
  row("two streams, GEMMs at high priority", "shared", naive, true, true);

  for (int wanted : {8, 16, 24, 32, 48}) {
    SmSplit split;
    if (!split_sms(dev, wanted, split)) {
      std::printf("| green contexts | %d SMs not split off | | | | | |\n", wanted);
      continue;
    }
    if (!same_update(split.optimizer_stream)) {
      std::printf("the update in a green context differs from the primary context's\n");
      return 1;
    }
    const std::vector<Gemm> part = forward_gemms(runner, split.gemm_sms);
    const std::string label = std::to_string(split.optimizer_sms) + " / " + std::to_string(split.gemm_sms);
    row("green contexts: update alone", label, time_pair(runner, part, 0, &state, split.optimizer_stream,
                                                         split.optimizer_stream, reps), false, true);
    row("green contexts: GEMMs alone", label, time_pair(runner, part, rounds, nullptr, split.gemm_stream,
                                                        split.gemm_stream, reps), true, false);
    row("green contexts: both", label, time_pair(runner, part, rounds, &state, split.gemm_stream,
                                                 split.optimizer_stream, reps), true, true);
  }
  sustained_rate(runner);
  return 0;
}
