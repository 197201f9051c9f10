#pragma once
// `tessera bench gemm`: matmul throughput through the op API, for square sweeps or for the
// exact GEMMs one training step of a model config runs (forward NT, data-gradient NN,
// weight-gradient TN into fp32), with the epilogues the model uses (bias, residual via beta,
// accumulation). Every problem is checked before it is timed: a small case of the same kind
// against the CPU reference, then sampled entries of the full-size result against host dot
// products.
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/bench/measure.h"
#include "tessera/model/model.h"

namespace tessera::bench {

enum class Epilogue {
  None,        // out = A B
  Bias,        // out = A B + bias (broadcast over rows)
  Residual,    // out = A B + C (beta = 1, C separate: the model's residual adds)
  Accumulate,  // out += A B (beta = 1 into out: weight-gradient accumulation)
};

struct GemmProblem {
  std::string name;  // "8192^3", "qkv forward", ...
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  Epilogue epilogue = Epilogue::None;
  bool fp32_out = false;       // weight gradients are fp32
  int64_t calls_per_step = 1;  // model mode: how often one training step runs it
  // FP8 operands with per-tensor scales, both K-major ("NT", the only FP8 layout of Hopper's
  // tensor cores): a in fp8_a (e5m2 for hybrid training's output gradients), b in e4m3.
  bool fp8 = false;
  DType fp8_a = DType::E4M3;
  bool fast_accum = true;  // as training's forward GEMMs by default (Fp8Options)

  std::string layout() const;  // "NT": op(A) then op(B), T = transposed
  double flops() const { return 2.0 * m * n * k; }
  double bytes(DType in, DType out) const;  // operands read once, output written (and read)
};

std::string_view epilogue_name(Epilogue e);

// The GEMMs of one forward + backward of the model (full recompute would add the forward
// ones again per recomputed layer; they are listed once). With runtime.fp8 enabled, the FP8
// linears' GEMMs are listed as training runs them: on transposed FP8 copies, fast
// accumulation per GEMM kind as runtime.fp8 says, output gradients in the mode's gradient
// format.
std::vector<GemmProblem> model_gemms(const ModelSpec& spec, const ModelRuntime& runtime);

struct GemmCheck {
  bool ok = false;
  double small_rel_err = 0;  // small case vs the CPU reference, relative L2
  std::string failure;
};

// Checks `p` on ctx.device: the same kind at a small size against ctx.reference, then the
// full size by sampling.
GemmCheck check_gemm(BenchContext& ctx, const GemmProblem& p);

struct GemmResult {
  GemmCheck check;
  Timing timing;      // only when check.ok
  double tflops = 0;  // 2MNK / median time
  double gbps = 0;    // bytes(in, out) / median time
};

// check_gemm, then (if it passed) the median time over rotated input sets. An error of the
// backend (no cuBLASLt algorithm, out of memory) is reported as a failed check.
GemmResult run_gemm(BenchContext& ctx, const GemmProblem& p);

int gemm_bench_command(const std::vector<std::string>& args);

}  // namespace tessera::bench
