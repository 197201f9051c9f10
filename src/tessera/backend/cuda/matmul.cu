#include "tessera/backend/cuda/matmul.cuh"

#include <algorithm>
#include <mutex>
#include <string>

#include "tessera/backend/cuda/cuda_check.cuh"
#include "tessera/backend/cuda/kernel_utils.cuh"
#include "tessera/core/error.h"

namespace tessera::cuda {

void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  throw InternalError(std::string("cuBLASLt error at ") + file + ":" + std::to_string(line) + ": " +
                      call + " failed: " + cublasLtGetStatusName(status) + " (" +
                      cublasLtGetStatusString(status) + ")");
}

namespace {

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::F32:
      return CUDA_R_32F;
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::E4M3:
      return CUDA_R_8F_E4M3;
    case DType::E5M2:
      return CUDA_R_8F_E5M2;
    default:
      throw_unsupported_dtype("matmul", d);
  }
}

// Largest power of two (up to 256, cuBLASLt's default assumption) dividing the address.
int alignment_of(const void* p) {
  if (p == nullptr) return 256;
  const auto u = reinterpret_cast<uintptr_t>(p);
  return static_cast<int>(std::min<uintptr_t>(256, u & (~u + 1)));
}

// out[m, n] = (c ? beta * c[m, n] : 0) + (bias ? bias[n] : 0), for what cuBLASLt does not do:
// a bias it has no fused epilogue for (then c = out, beta = 1) and K = 0.
template <class TOut, class TBias>
__global__ void matmul_epilogue_kernel(TOut* out, const TOut* c, const TBias* bias, int64_t M,
                                       int64_t N, float beta) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= M * N) return;
  float v = c != nullptr ? beta * to_float(c[i]) : 0.0f;
  if (bias != nullptr) v += to_float(bias[i % N]);
  out[i] = from_float<TOut>(v);
}

void launch_epilogue(const MatmulProblem& p, const void* c, float beta, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t blocks = ceil_div(p.M * p.N, kThreads);
  check_grid("matmul epilogue", blocks);
  dispatch_float(p.out_dtype, "matmul", [&](auto out_tag) {
    using TOut = decltype(out_tag);
    dispatch_float(p.bias_dtype, "matmul bias", [&](auto bias_tag) {
      using TBias = decltype(bias_tag);
      matmul_epilogue_kernel<TOut, TBias>
          <<<blocks, kThreads, 0, stream>>>(static_cast<TOut*>(p.out), static_cast<const TOut*>(c),
                                            static_cast<const TBias*>(p.bias), p.M, p.N, beta);
    });
  });
  TS_CUDA_CHECK_LAUNCH("matmul_epilogue_kernel");
}

std::string describe(const MatmulProblem& p) {
  auto scaling = [](Fp8Scaling s) {
    return s == Fp8Scaling::Tile1x128 ? " 1x128" : s == Fp8Scaling::Block128x128 ? " 128x128" : "";
  };
  return format_message(
      "M={} N={} K={} trans_a={} trans_b={} a {}{} b {}{} out {} beta={} bias={}{}", p.M, p.N, p.K,
      p.trans_a, p.trans_b, dtype_name(p.a_dtype), scaling(p.a_scaling), dtype_name(p.b_dtype),
      scaling(p.b_scaling), dtype_name(p.out_dtype), p.beta,
      p.bias != nullptr ? dtype_name(p.bias_dtype) : "none", p.fast_accum ? " fast_accum" : "");
}

bool is_fp8_type(DType d) { return d == DType::E4M3 || d == DType::E5M2; }

// The block-scale modes came with cuBLAS 12.9; older headers do not name them.
#if CUBLAS_VERSION >= 120900
constexpr bool kHeadersHaveBlockScaling = true;

int32_t scale_mode(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::Tensor:
      return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case Fp8Scaling::Tile1x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case Fp8Scaling::Block128x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

// cuBLAS's A is our b: its scale mode is b's.
void set_scale_modes(cublasLtMatmulDesc_t desc, const MatmulProblem& p) {
  const int32_t a_mode = scale_mode(p.b_scaling), b_mode = scale_mode(p.a_scaling);
  TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode,
                                                 sizeof(a_mode)));
  TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode,
                                                 sizeof(b_mode)));
}
#else
constexpr bool kHeadersHaveBlockScaling = false;

void set_scale_modes(cublasLtMatmulDesc_t, const MatmulProblem& p) {
  TS_CHECK(p.a_scaling == Fp8Scaling::Tensor && p.b_scaling == Fp8Scaling::Tensor,
           "FP8 block scales: this build's cuBLAS headers predate 12.9");
}
#endif

// cuBLAS's A is our b and its B our a (see plan_for), so their scales swap too.
void set_fp8_scales(cublasLtMatmulDesc_t desc, const MatmulProblem& p) {
  TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                 &p.b_scale, sizeof(p.b_scale)));
  TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                 &p.a_scale, sizeof(p.a_scale)));
}

}  // namespace

std::string lt_version_string() {
  const size_t v = cublasLtGetVersion();  // e.g. 130100 = 13.1.0
  return std::to_string(v / 10000) + "." + std::to_string((v / 100) % 100) + "." +
         std::to_string(v % 100);
}

bool lt_block_scaling_available() {
  return kHeadersHaveBlockScaling && cublasLtGetVersion() >= 120900;
}

struct LtMatmul::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  // The heuristic's algorithms, best first; `chosen` is the fastest when tuned, else the
  // first that ran (some FP8 combinations are offered by the heuristic but refused by
  // cublasLtMatmul). Up to 32: the heuristic's order is a model's guess, and timing more
  // of its candidates costs only the first call of each shape.
  static constexpr int kMaxAlgos = 32;
  cublasLtMatmulAlgo_t algos[kMaxAlgos] = {};
  int algo_count = 0, chosen = 0;
  bool bias_in_epilogue = false;
  bool tuned = false;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {  // destroy calls cannot fail for valid descriptors; errors are ignored here
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

LtMatmul::LtMatmul(void* workspace, size_t workspace_bytes, bool autotune)
    : workspace_(workspace), workspace_bytes_(workspace_bytes), autotune_(autotune) {
  TS_CUBLAS_CHECK(cublasLtCreate(&handle_));
}

LtMatmul::~LtMatmul() {
  plans_.clear();
  if (handle_) cublasLtDestroy(handle_);
}

// cuBLASLt is column-major. A row-major (r, c) matrix is the column-major (c, r) matrix over
// the same memory, so out^T = op(b)^T op(a)^T is computed with b as cuBLAS's "A" and a as its
// "B": no copy, only swapped operands and leading dimensions.
LtMatmul::Plan& LtMatmul::plan_for(const MatmulProblem& p, const Key& key) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;

  auto plan = std::make_unique<Plan>();
  const cudaDataType_t a_type = cuda_type(p.a_dtype), b_type = cuda_type(p.b_dtype);
  const cudaDataType_t out = cuda_type(p.out_dtype);
  const bool fp8 = is_fp8_type(p.a_dtype);
  const uint64_t M = p.M, N = p.N, K = p.K;
  // cuBLAS A = our b: stored (N, K) col-major when not transposed, else (K, N).
  const int64_t ldb = p.ldb > 0 ? p.ldb : static_cast<int64_t>(p.trans_b ? K : N);
  TS_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan->a, b_type, p.trans_b ? K : N, p.trans_b ? N : K, ldb));
  // cuBLAS B = our a: stored (K, M) col-major when not transposed, else (M, K).
  const int64_t lda = p.lda > 0 ? p.lda : static_cast<int64_t>(p.trans_a ? M : K);
  TS_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan->b, a_type, p.trans_a ? M : K, p.trans_a ? K : M, lda));
  TS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, out, N, M, static_cast<int64_t>(N)));
  TS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->d, out, N, M, static_cast<int64_t>(N)));

  cublasLtMatmulPreference_t pref = nullptr;
  TS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = workspace_bytes_;
  TS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t align[4] = {static_cast<uint32_t>(std::get<10>(key)),  // cuBLAS A = b
                             static_cast<uint32_t>(std::get<9>(key)),   // cuBLAS B = a
                             static_cast<uint32_t>(std::get<11>(key)),
                             static_cast<uint32_t>(std::get<12>(key))};
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    TS_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &align[i], sizeof(align[i])));
  }

  // First with the bias fused into the epilogue; if no algorithm supports that combination
  // (e.g. some fp32-output cases), without it, and launch_epilogue adds the bias.
  int found = 0;
  cublasLtMatmulHeuristicResult_t results[Plan::kMaxAlgos] = {};
  for (int attempt = p.bias != nullptr ? 0 : 1; attempt < 2 && found == 0; ++attempt) {
    if (plan->desc) TS_CUBLAS_CHECK(cublasLtMatmulDescDestroy(plan->desc));
    plan->desc = nullptr;
    TS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const int32_t trans_a = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const int32_t trans_b = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                   &trans_a, sizeof(trans_a)));
    TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                   &trans_b, sizeof(trans_b)));
    if (fp8) {
      set_fp8_scales(plan->desc, p);
      if (p.a_scaling != Fp8Scaling::Tensor || p.b_scaling != Fp8Scaling::Tensor)
        set_scale_modes(plan->desc, p);
      const int8_t fast_accum = p.fast_accum ? 1 : 0;
      TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                     &fast_accum, sizeof(fast_accum)));
    }
    plan->bias_in_epilogue = attempt == 0;
    if (plan->bias_in_epilogue) {
      const uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      const int32_t bias_type = cuda_type(p.bias_dtype);
      TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                     &epilogue, sizeof(epilogue)));
      TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
          plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
      // The heuristic reads the pointer's alignment (part of the key), not its contents.
      TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &p.bias, sizeof(p.bias)));
    }
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        handle_, plan->desc, plan->a, plan->b, plan->c, plan->d, pref, Plan::kMaxAlgos, results, &found);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED)
      found = 0;
    else if (status != CUBLAS_STATUS_SUCCESS) {
      cublasLtMatmulPreferenceDestroy(pref);
      TS_CUBLAS_CHECK(status);
    }
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (found == 0) {
    throw InternalError("cuBLASLt has no algorithm for matmul " + describe(p));
  }
  for (int i = 0; i < found; ++i)
    if (results[i].state == CUBLAS_STATUS_SUCCESS) plan->algos[plan->algo_count++] = results[i].algo;
  if (plan->algo_count == 0) throw InternalError("cuBLASLt has no algorithm for matmul " + describe(p));
  return *plans_.emplace(key, std::move(plan)).first->second;
}

cublasStatus_t LtMatmul::launch(const Plan& plan, int algo, const MatmulProblem& p, const void* c,
                                cudaStream_t stream) {
  const cublasStatus_t status =
      cublasLtMatmul(handle_, plan.desc, &p.alpha, p.b, plan.a, p.a, plan.b, &p.beta, c, plan.c,
                     p.out, plan.d, &plan.algos[algo], workspace_, workspace_bytes_, stream);
  if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED)
    throw_cublas_error(status, ("cublasLtMatmul for matmul " + describe(p)).c_str(), __FILE__,
                       __LINE__);
  return status;
}

namespace {

// The algorithm (an index into the heuristic's list, which is the same for the same key on
// the same device) chosen for each (device, key), for every LtMatmul of the process.
struct TunedChoices {
  std::mutex mutex;
  std::map<std::pair<int, LtMatmul::Key>, int> chosen;
};

TunedChoices& tuned_choices() {
  static TunedChoices choices;
  return choices;
}

}  // namespace

void LtMatmul::tune(Plan& plan, const MatmulProblem& p, const Key& key, const void* c,
                    cudaStream_t stream) {
  plan.tuned = true;
  int device = 0;
  TS_CUDA_CHECK(cudaGetDevice(&device));
  const std::pair<int, Key> id{device, key};
  TunedChoices& shared = tuned_choices();
  {
    const std::lock_guard lock(shared.mutex);
    if (auto it = shared.chosen.find(id); it != shared.chosen.end() && it->second < plan.algo_count) {
      plan.chosen = it->second;
      return;
    }
  }
  // One untimed call per candidate (first-launch costs, and refusals), then kReps timed ones.
  constexpr int kReps = 3;
  cudaEvent_t start = nullptr, end = nullptr;
  TS_CUDA_CHECK(cudaEventCreate(&start));
  TS_CUDA_CHECK(cudaEventCreate(&end));
  float best_ms = 0;
  int best = -1;
  try {
    for (int i = plan.chosen; i < plan.algo_count; ++i) {
      if (launch(plan, i, p, c, stream) != CUBLAS_STATUS_SUCCESS) continue;
      TS_CUDA_CHECK(cudaEventRecord(start, stream));
      for (int r = 0; r < kReps; ++r) launch(plan, i, p, c, stream);
      TS_CUDA_CHECK(cudaEventRecord(end, stream));
      TS_CUDA_CHECK(cudaEventSynchronize(end));
      float ms = 0;
      TS_CUDA_CHECK(cudaEventElapsedTime(&ms, start, end));
      if (best < 0 || ms < best_ms) best = i, best_ms = ms;
    }
  } catch (...) {
    cudaEventDestroy(start);
    cudaEventDestroy(end);
    throw;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  if (best < 0) return;  // every candidate refused: run() reports it
  plan.chosen = best;
  const std::lock_guard lock(shared.mutex);
  shared.chosen.emplace(id, best);
}

void LtMatmul::run(const MatmulProblem& p, cudaStream_t stream) {
  NvtxRange range("matmul");
  if (p.M == 0 || p.N == 0) return;
  const void* c = p.c != nullptr ? p.c : p.out;
  if (p.K == 0) {  // out = beta * c + bias; cuBLASLt rejects an empty inner dimension
    launch_epilogue(p, p.beta != 0.0f ? c : nullptr, p.beta, stream);
    return;
  }
  const Key key{p.M,
                p.N,
                p.K,
                p.trans_a,
                p.trans_b,
                static_cast<int>(p.a_dtype),
                static_cast<int>(p.out_dtype),
                p.bias != nullptr ? static_cast<int>(p.bias_dtype) : -1,
                p.beta != 0.0f,
                alignment_of(p.a),
                alignment_of(p.b),
                alignment_of(c),
                alignment_of(p.out),
                alignment_of(p.bias),
                static_cast<int>(p.b_dtype),
                p.fast_accum,
                static_cast<int>(p.a_scaling),
                static_cast<int>(p.b_scaling),
                p.lda,
                p.ldb};
  if (is_fp8_type(p.a_dtype)) {
    TS_CHECK(is_fp8_type(p.b_dtype) && !(p.a_dtype == DType::E5M2 && p.b_dtype == DType::E5M2),
             "cuBLASLt FP8 matmul takes e4m3 x e4m3 or e4m3 x e5m2 operands: {}", describe(p));
    TS_CHECK(!p.trans_a && p.trans_b, "cuBLASLt FP8 matmul needs both operands K-major: {}",
             describe(p));
    TS_CHECK(p.a_scale != nullptr && p.b_scale != nullptr, "FP8 matmul without scales: {}",
             describe(p));
  } else {
    TS_CHECK(p.a_dtype == p.b_dtype, "matmul of {} x {} operands", dtype_name(p.a_dtype),
             dtype_name(p.b_dtype));
  }
  Plan& plan = plan_for(p, key);
  if (plan.bias_in_epilogue) {
    TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                   &p.bias, sizeof(p.bias)));
  }
  if (is_fp8_type(p.a_dtype)) set_fp8_scales(plan.desc, p);
  const bool output_is_input = p.beta != 0.0f && c == p.out;
  if (autotune_ && p.tune && !plan.tuned && !output_is_input) tune(plan, p, key, c, stream);
  for (;; ++plan.chosen) {
    if (plan.chosen == plan.algo_count)
      throw InternalError("cuBLASLt refused every algorithm its heuristic offered for matmul " +
                          describe(p));
    if (launch(plan, plan.chosen, p, c, stream) == CUBLAS_STATUS_SUCCESS) break;
  }
  if (p.bias != nullptr && !plan.bias_in_epilogue) launch_epilogue(p, p.out, 1.0f, stream);
}

}  // namespace tessera::cuda
