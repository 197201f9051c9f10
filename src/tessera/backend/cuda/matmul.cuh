#pragma once
// Row-major GEMM through cuBLASLt: out = alpha * op(a) @ op(b) + beta * c (+ bias), in bf16
// or fp32, or with FP8 operands and per-tensor dequantisation scales.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "tessera/backend/cuda/vendor.h"
#include "tessera/core/dtype.h"
#include "tessera/core/fp8.h"

namespace tessera::cuda {

// Throws InternalError naming the cuBLASLt call that failed, file:line and cuBLASLt's message.
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file,
                                     int line);

#define TS_CUBLAS_CHECK(call)                                                     \
  do {                                                                            \
    const cublasStatus_t ts_status_ = (call);                                     \
    if (ts_status_ != CUBLAS_STATUS_SUCCESS)                                      \
      ::tessera::cuda::throw_cublas_error(ts_status_, #call, __FILE__, __LINE__); \
  } while (0)

// One GEMM in the op API's row-major terms (MatmulArgs without tensors).
struct MatmulProblem {
  void* out = nullptr;  // (M, N)
  DType out_dtype = DType::BF16;
  const void* a = nullptr;       // (M, K), or (K, M) when trans_a
  const void* b = nullptr;       // (K, N), or (N, K) when trans_b
  DType a_dtype = DType::BF16;   // a and b share it, except FP8 (e5m2 x e4m3)
  DType b_dtype = DType::BF16;
  const void* c = nullptr;       // (M, N) in out_dtype, read when beta != 0; null: out itself
  const void* bias = nullptr;    // (N) or null
  DType bias_dtype = DType::BF16;
  int64_t M = 0, N = 0, K = 0;
  // Elements from one row of a (b) to the next as stored; 0: packed (its stored width). A
  // wider stride reads a block of columns of a larger matrix (an expert's rows of the
  // transposed activations).
  int64_t lda = 0, ldb = 0;
  bool trans_a = false, trans_b = false;
  float alpha = 1.0f, beta = 0.0f;
  // FP8 operands only: device fp32 scalars that multiply a and b (their scale_inv), and
  // cuBLASLt's fast accumulation. Hopper takes FP8 only as "TN": trans_b and not trans_a.
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  bool fast_accum = false;
  // Time the candidates of a new shape (with the LtMatmul's autotune). Off for a grouped
  // GEMM's per-expert calls: routed row counts change every call, so each would be a new
  // shape timed once and never seen again (7x slower steps on the Mixtral proxy).
  bool tune = true;
  // How a_scale and b_scale scale their operands (core/fp8.h): one value each, or 1x128 tiles
  // and 128x128 blocks (cuBLASLt's VEC128_32F and BLK128x128_32F scale modes).
  Fp8Scaling a_scaling = Fp8Scaling::Tensor;
  Fp8Scaling b_scaling = Fp8Scaling::Tensor;
};

// The cuBLASLt this process loaded, "13.1.0".
std::string lt_version_string();
// Whether FP8 GEMMs can take 1x128 / 128x128 block scales: the loaded cuBLASLt is 12.9 or
// newer and this build's headers name the scale modes.
bool lt_block_scaling_available();

// The cuBLASLt handle, the workspace it may use and the plans (descriptors + chosen
// algorithm) of every problem shape seen so far. A training step issues the same few dozen
// shapes every iteration, so the heuristic query and descriptor setup happen once per shape
// and later calls only set the bias pointer and launch.
//
// Autotuning: the heuristic's first algorithm is not always the fastest (on H200 the Llama
// proxy's step GEMMs ran 1.5% and 0.4% faster tuned in two runs, docs/performance.md), so
// with `autotune` the first call of a shape whose output is not also an input times every
// candidate on the call's own operands and keeps the fastest. The choice is shared by every
// LtMatmul of the process on that device, so two backends (or a recompute and a plain run)
// compute with the same algorithms and give the same bits. Accumulating calls (beta != 0
// into the output itself) are not re-run and use the heuristic's choice.
class LtMatmul {
 public:
  // workspace: device memory owned by the caller, used by every launch on one stream.
  LtMatmul(void* workspace, size_t workspace_bytes, bool autotune);
  ~LtMatmul();
  LtMatmul(const LtMatmul&) = delete;
  LtMatmul& operator=(const LtMatmul&) = delete;

  void run(const MatmulProblem& p, cudaStream_t stream);

  // (M, N, K, trans_a, trans_b, a dtype, out dtype, bias dtype or -1, beta != 0,
  //  alignment of a, b, c, out, bias, b dtype, fast accumulation, a and b scalings):
  //  everything the heuristic's answer depends on.
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int, int, int, bool, int, int, int,
                         int, int, int, bool, int, int, int64_t, int64_t>;

 private:
  struct Plan;
  Plan& plan_for(const MatmulProblem& p, const Key& key);
  // Launches algorithm `algo` of `plan`; CUBLAS_STATUS_NOT_SUPPORTED is returned, other
  // failures throw.
  cublasStatus_t launch(const Plan& plan, int algo, const MatmulProblem& p, const void* c,
                        cudaStream_t stream);
  // Sets plan.chosen to the fastest candidate (see the class comment).
  void tune(Plan& plan, const MatmulProblem& p, const Key& key, const void* c, cudaStream_t stream);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  bool autotune_ = false;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace tessera::cuda
