#include "tessera/bench/gemm_bench.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <fmt/format.h>

#include "tessera/analysis/report_output.h"
#include "tessera/config/config.h"
#include "tessera/core/error.h"
#include "tessera/core/fp8.h"
#include "tessera/data/tokenizer.h"
#include "tessera/model/decoder_layer.h"
#include "tessera/ops/device_buffer.h"
#include "tessera/plan/memory_plan.h"

namespace tessera::bench {
namespace {

constexpr const char* kUsage =
    R"(usage: tessera bench gemm [--sizes 1024,2048,4096,8192,16384] [--layouts NN,NT,TN]
                          [--epilogues none,bias] [--dtypes bf16,fp8]
                          [--config EXPERIMENT [--key value ...]] [--gemm_autotune true|false]
                          [--device auto|cpu|cuda] [--gpu NAME] [--warmup 5] [--iters 20] [-o DIR]

Matmul through the op API in the run's compute dtype (bf16 on GPUs, fp32 on the CPU):
square sizes x layouts x epilogues (none, bias, residual), or with --config the GEMMs of one
training step of that experiment (e.g. --config llama3.1_8B-pretrain --micro_batch_size 1);
with the experiment's fp8 keys (--fp8 hybrid [--fp8_lm_head true]) its FP8 linears' GEMMs
run as training runs them: on K-major FP8 copies ("NT"), fast accumulation where the
fp8_gemm_*_split_accumulator keys ask for it (by default the forward only), e5m2 output
gradients in hybrid mode, fp32 weight gradients.
--dtypes fp8 adds, per square size, the FP8 GEMM of the fp8 training mode's forward: e4m3 x
e4m3, NT, bf16 output, fast accumulation. FP8 operands are cast once from random values with
scale 1 (the CPU backend emulates FP8 GEMMs); % of peak is then against the datasheet fp8
peak.
Each problem is checked (small case vs the CPU reference, sampled entries at full size)
before it is timed: median over --iters samples after --warmup calls, inputs rotated beyond
twice the L2. With the CPU backend the defaults are --sizes 256,512,1024 --warmup 2 --iters 7
(its fp32 GEMMs take seconds each at 16384^3). Columns: TFLOP/s (2MNK), GB/s (operands once + output), FLOPs/byte, % of the
datasheet peak of --gpu (default: the visible GPU). --gemm_autotune false times cuBLASLt's
heuristic's first algorithm instead of the fastest of its candidates (the training key of
the same name). -o DIR writes bench_gemm.csv and .md.
)";

constexpr int64_t kSmallM = 200, kSmallN = 136, kSmallK = 72;  // multiples of 8, not of tiles
constexpr int kSamples = 64;
constexpr float kAccumulateStart = 0.5f;  // what `out` holds before an accumulating call

// The tensors of one problem in one allocation, with random operands.
struct GemmTensors {
  DeviceBuffer buffer;
  Tensor a, b, out, bias, c;
};

size_t aligned(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

size_t set_bytes(const GemmProblem& p, DType in, DType out) {
  return aligned(p.m * p.k * dtype_size(in)) + aligned(p.k * p.n * dtype_size(in)) +
         aligned(p.m * p.n * dtype_size(out)) +
         (p.epilogue == Epilogue::Bias ? aligned(p.n * dtype_size(in)) : 0) +
         (p.epilogue == Epilogue::Residual ? aligned(p.m * p.n * dtype_size(out)) : 0);
}

// The epilogue's random bias (N) or residual C (M, N), from take(dtype, shape).
template <class Take>
void take_epilogue_operands(Backend& b, const GemmProblem& p, DType bias_dtype, DType c_dtype,
                            uint64_t seed, Take& take, Tensor& bias, Tensor& c) {
  if (p.epilogue == Epilogue::Bias) {
    bias = take(bias_dtype, {p.n});
    b.init_normal(bias, seed + 2, 0, 0.0f, 1.0f);
  }
  if (p.epilogue == Epilogue::Residual) {
    c = take(c_dtype, {p.m, p.n});
    b.init_normal(c, seed + 3, 0, 0.0f, 1.0f);
  }
}

GemmTensors allocate(Backend& b, const GemmProblem& p, DType in, DType out, uint64_t seed) {
  GemmTensors t;
  t.buffer = DeviceBuffer(b, set_bytes(p, in, out), "gemm benchmark operands");
  size_t at = 0;
  auto take = [&](DType dt, Shape shape) {
    const Tensor x = t.buffer.tensor(dt, shape, at);
    at += aligned(x.nbytes());
    return x;
  };
  t.a = take(in, p.trans_a ? Shape{p.k, p.m} : Shape{p.m, p.k});
  t.b = take(in, p.trans_b ? Shape{p.n, p.k} : Shape{p.k, p.n});
  t.out = take(out, {p.m, p.n});
  b.init_normal(t.a, seed, 0, 0.0f, 1.0f);
  b.init_normal(t.b, seed + 1, 0, 0.0f, 1.0f);
  b.fill(t.out, kAccumulateStart);
  take_epilogue_operands(b, p, in, out, seed, take, t.bias, t.c);
  return t;
}

// beta of the epilogue: residual and accumulation read C (or out) once.
float epilogue_beta(const GemmProblem& p) {
  return p.epilogue == Epilogue::Residual || p.epilogue == Epilogue::Accumulate ? 1.0f : 0.0f;
}

MatmulArgs matmul_args(const GemmProblem& p, const GemmTensors& t) {
  MatmulArgs m;
  m.out = t.out;
  m.a = t.a;
  m.b = t.b;
  m.trans_a = p.trans_a;
  m.trans_b = p.trans_b;
  m.beta = epilogue_beta(p);
  m.c = t.c;
  m.bias = t.bias;
  return m;
}

DType out_dtype(const BenchContext& ctx, const GemmProblem& p) {
  return p.fp32_out ? DType::F32 : ctx.dtype;
}

DType in_dtype(const BenchContext& ctx, const GemmProblem& p) {
  return p.fp8 ? DType::E4M3 : ctx.dtype;
}

// FP8 operands: a (M, K) in p.fp8_a and b (N, K) e4m3, codes of N(0, 1) values, their scale
// inverses (1: the values are in range), the output and the epilogue's bias or residual in
// the output's dtype.
struct Fp8Tensors {
  DeviceBuffer buffer;
  Tensor a, b, out, a_scale_inv, b_scale_inv, bias, c;
};

Fp8Tensors allocate_fp8(Backend& b, const GemmProblem& p, DType out, uint64_t seed) {
  Fp8Tensors t;
  const size_t staging = aligned(std::max(p.m, p.n) * p.k * sizeof(float));
  const size_t out_bytes = aligned(p.m * p.n * dtype_size(out));
  t.buffer = DeviceBuffer(b,
                          aligned(p.m * p.k) + aligned(p.n * p.k) + out_bytes +
                              (p.epilogue == Epilogue::Residual ? out_bytes : 0) +
                              aligned(p.n * dtype_size(out)) + 3 * 256 + staging,
                          "fp8 gemm benchmark operands");
  size_t at = 0;
  auto take = [&](DType dt, Shape shape) {
    const Tensor x = t.buffer.tensor(dt, shape, at);
    at += aligned(x.nbytes());
    return x;
  };
  t.a = take(p.fp8_a, {p.m, p.k});
  t.b = take(DType::E4M3, {p.n, p.k});
  t.out = take(out, {p.m, p.n});
  take_epilogue_operands(b, p, out, out, seed, take, t.bias, t.c);
  t.a_scale_inv = take(DType::F32, {1});
  t.b_scale_inv = take(DType::F32, {1});
  const Tensor one = take(DType::F32, {1});
  for (const Tensor& s : {t.a_scale_inv, t.b_scale_inv, one}) b.fill(s, 1.0f);
  const DType staging_dtype = b.default_compute_dtype();
  for (int i = 0; i < 2; ++i) {
    const Tensor& codes = i == 0 ? t.a : t.b;
    const Tensor values = t.buffer.tensor(staging_dtype, codes.shape, at);
    b.init_normal(values, seed + i, 0, 0.0f, 1.0f);
    Fp8CastArgs cast;
    cast.x = values;
    cast.out = codes;
    cast.scale = one;
    b.fp8_cast_transpose(cast);
  }
  b.fill(t.out, kAccumulateStart);
  return t;
}

Fp8MatmulArgs fp8_args(const GemmProblem& p, const Fp8Tensors& t) {
  Fp8MatmulArgs m;
  m.out = t.out;
  m.a = t.a;
  m.b = t.b;
  m.a_scale_inv = t.a_scale_inv;
  m.b_scale_inv = t.b_scale_inv;
  m.beta = epilogue_beta(p);
  m.c = t.c;
  m.bias = t.bias;
  m.fast_accum = p.fast_accum;
  return m;
}

// The host values of FP8 codes on a device.
std::vector<float> download_fp8(Backend& b, const Tensor& codes) {
  std::vector<uint8_t> bits(static_cast<size_t>(codes.numel()));
  b.download(bits.data(), codes);
  std::vector<float> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = fp8_bits_to_float(bits[i], codes.dtype);
  return v;
}

// A copy of the device tensor's values in a new fp32 tensor on the reference backend.
Tensor mirror(Backend& device, Backend& ref, const Tensor& t, std::vector<DeviceBuffer>& keep) {
  if (!t.defined()) return {};
  keep.emplace_back(ref, t.numel() * sizeof(float), "gemm reference operand");
  const Tensor r = keep.back().tensor(DType::F32, t.shape);
  upload_floats(ref, r, download_floats(device, t));
  return r;
}

// Median time of `p` over rotated input sets, into r.
void time_gemm(BenchContext& ctx, const GemmProblem& p, GemmResult& r) {
  const DType out = out_dtype(ctx, p);
  const int sets = rotation_sets(set_bytes(p, in_dtype(ctx, p), out), ctx.cache_bytes, ctx.budget_bytes);
  if (p.fp8) {
    std::vector<Fp8Tensors> tensors;
    std::vector<Fp8MatmulArgs> calls;
    for (int s = 0; s < sets; ++s)
      tensors.push_back(allocate_fp8(*ctx.device, p, out, 100 + 10 * s));
    for (const Fp8Tensors& f : tensors) calls.push_back(fp8_args(p, f));
    r.timing = measure(
        *ctx.device, [&](int i) { ctx.device->matmul_fp8(calls[i % sets]); }, ctx.warmup,
        ctx.iters);
    r.tflops = p.flops() / (r.timing.median_ms * 1e-3) / 1e12;
    r.gbps = p.bytes(DType::E4M3, out) / (r.timing.median_ms * 1e-3) / 1e9;
    return;
  }
  std::vector<GemmTensors> tensors;
  std::vector<MatmulArgs> calls;
  for (int s = 0; s < sets; ++s)
    tensors.push_back(allocate(*ctx.device, p, ctx.dtype, out, 100 + 10 * s));
  for (const GemmTensors& g : tensors) calls.push_back(matmul_args(p, g));
  r.timing = measure(
      *ctx.device, [&](int i) { ctx.device->matmul(calls[i % sets]); }, ctx.warmup, ctx.iters);
  r.tflops = p.flops() / (r.timing.median_ms * 1e-3) / 1e12;
  r.gbps = p.bytes(ctx.dtype, out) / (r.timing.median_ms * 1e-3) / 1e9;
}

}  // namespace

std::string GemmProblem::layout() const {
  return std::string(trans_a ? "T" : "N") + (trans_b ? "T" : "N");
}

double GemmProblem::bytes(DType in, DType out) const {
  const double read_out = epilogue == Epilogue::None || epilogue == Epilogue::Bias ? 0 : 1;
  return static_cast<double>(m * k + k * n) * dtype_size(in) +
         (1 + read_out) * static_cast<double>(m * n) * dtype_size(out) +
         (epilogue == Epilogue::Bias ? static_cast<double>(n) * dtype_size(in) : 0);
}

std::string_view epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::None:
      return "none";
    case Epilogue::Bias:
      return "bias";
    case Epilogue::Residual:
      return "residual";
    case Epilogue::Accumulate:
      return "accumulate";
  }
  return "?";
}

std::vector<GemmProblem> model_gemms(const ModelSpec& s, const ModelRuntime& rt) {
  const int64_t T = rt.micro_batch * rt.seq_length, C = s.hidden, V = s.vocab_size;
  const int64_t chunk = std::min(T, rt.cross_entropy_chunk_tokens);
  const int64_t chunks = (T + chunk - 1) / chunk;
  // The decoder layers' linear layers as their mixers declare them (Mixer::linear_gemms), the
  // same GEMM of every layer counted once with its calls, in the order the forward first runs
  // them; then the output head over its token chunks.
  struct Linear {
    LinearGemm gemm;
    int64_t rows, calls;
  };
  std::vector<Linear> linears;
  for (int64_t l = 0; l < s.num_layers; ++l)
    for (const LinearGemm& g : make_decoder_layer(s, l)->linear_gemms()) {
      const int64_t rows = T * g.share_num / g.share_den;
      auto same = std::find_if(linears.begin(), linears.end(), [&](const Linear& x) {
        return x.gemm.name == g.name && x.gemm.out_features == g.out_features &&
               x.gemm.in_features == g.in_features && x.rows == rows;
      });
      if (same != linears.end())
        same->calls += g.count;
      else
        linears.push_back({g, rows, g.count});
    }
  const bool fp8 = rt.fp8.enabled();
  auto is_fp8 = [&](const LinearGemm& g) {
    switch (g.fp8) {
      case LinearGemm::Fp8::Linear:
        return fp8;
      case LinearGemm::Fp8::Expert:
        return fp8 && rt.fp8.recipe != Fp8Recipe::Blockwise;
      case LinearGemm::Fp8::Never:
        return false;
    }
    return false;
  };
  linears.push_back({{.name = "lm_head",
                      .out_features = V,
                      .in_features = C,
                      .fp8 = rt.fp8.lm_head ? LinearGemm::Fp8::Linear : LinearGemm::Fp8::Never},
                     chunk,
                     chunks});

  std::vector<GemmProblem> g;
  // FP8 linears take both operands K-major (transposed copies where bf16 uses a trans flag).
  auto as_fp8 = [&](GemmProblem p, bool on, DType a_format, bool fast_accum) {
    if (!on) return p;
    p.fp8 = true;
    p.trans_a = false, p.trans_b = true;
    p.fp8_a = a_format;
    p.fast_accum = fast_accum;
    return p;
  };
  const DType grad_format = rt.fp8.grad_format();
  // Forward: out (rows, out_features) = in @ W^T.
  for (const Linear& x : linears) {
    const Epilogue e = x.gemm.residual ? Epilogue::Residual
                       : x.gemm.bias   ? Epilogue::Bias
                                       : Epilogue::None;
    g.push_back(as_fp8({x.gemm.name + " forward", x.rows, x.gemm.out_features,
                        x.gemm.in_features, false, true, e, false, x.calls},
                       is_fp8(x.gemm), DType::E4M3, rt.fp8.fast_accum_fprop));
  }
  // The backward runs them in reverse. Data gradient: din (rows, in_features) = dout @ W.
  for (auto x = linears.rbegin(); x != linears.rend(); ++x)
    g.push_back(as_fp8({x->gemm.name + " dgrad", x->rows, x->gemm.in_features,
                        x->gemm.out_features, false, false, Epilogue::None, false, x->calls},
                       is_fp8(x->gemm), grad_format, rt.fp8.fast_accum_dgrad));
  // Weight gradient: dW (out_features, in_features) += dout^T @ in, in fp32.
  for (auto x = linears.rbegin(); x != linears.rend(); ++x)
    g.push_back(as_fp8({x->gemm.name + " wgrad", x->gemm.out_features, x->gemm.in_features,
                        x->rows, true, false, Epilogue::Accumulate, true, x->calls},
                       is_fp8(x->gemm), grad_format, rt.fp8.fast_accum_wgrad));
  return g;
}

// kSamples entries of the M x N output `got`, at the same pseudo-random positions on every
// run, against expected(i, j) in double within tolerance(expected): the first miss as a
// message, or empty.
template <class Expected, class Tolerance>
std::string first_sampled_mismatch(const GemmProblem& p, const std::vector<float>& got,
                                   Expected expected, Tolerance tolerance) {
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&](int64_t bound) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<int64_t>((state >> 33) % static_cast<uint64_t>(bound));
  };
  for (int s = 0; s < kSamples; ++s) {
    const int64_t i = next(p.m), j = next(p.n);
    const double ref = expected(i, j);
    if (!(std::fabs(got[i * p.n + j] - ref) <= tolerance(ref)))
      return fmt::format("full size: out[{}, {}] = {} but the host computes {:.6g}", i, j,
                         got[i * p.n + j], ref);
  }
  return "";
}

// The value of out[i, j] the epilogue adds to the product (bias, residual or what out held).
double epilogue_term(const GemmProblem& p, const std::vector<float>& bias,
                     const std::vector<float>& c, int64_t i, int64_t j) {
  switch (p.epilogue) {
    case Epilogue::Bias:
      return bias[j];
    case Epilogue::Residual:
      return c[i * p.n + j];
    case Epilogue::Accumulate:
      return kAccumulateStart;
    case Epilogue::None:
      break;
  }
  return 0;
}

// FP8: a small case on the device against the CPU backend's emulation of the same codes and
// epilogue operands, then sampled entries of the full size against host dot products of the
// decoded codes.
GemmCheck check_fp8_gemm(BenchContext& ctx, const GemmProblem& p) {
  Backend& dev = *ctx.device;
  GemmCheck r;
  const DType out = out_dtype(ctx, p);
  {
    GemmProblem small = p;
    // Multiples of what the backend's FP8 GEMMs need (13, 9 and 5 of them), not of tiles.
    const int64_t multiple = dev.fp8_gemm_multiple();
    small.m = 13 * multiple, small.n = 9 * multiple, small.k = 5 * multiple;
    const Fp8Tensors d = allocate_fp8(dev, small, out, 11);
    dev.matmul_fp8(fp8_args(small, d));
    Fp8Tensors ref = allocate_fp8(*ctx.reference, small, DType::F32, 11);
    for (const Tensor* codes : {&d.a, &d.b}) {
      std::vector<uint8_t> bits(static_cast<size_t>(codes->numel()));
      dev.download(bits.data(), *codes);
      ctx.reference->upload(codes == &d.a ? ref.a : ref.b, bits.data());
    }
    if (d.bias.defined()) upload_floats(*ctx.reference, ref.bias, download_floats(dev, d.bias));
    if (d.c.defined()) upload_floats(*ctx.reference, ref.c, download_floats(dev, d.c));
    ctx.reference->matmul_fp8(fp8_args(small, ref));
    r.small_rel_err =
        relative_error(download_floats(dev, d.out), download_floats(*ctx.reference, ref.out));
    if (!(r.small_rel_err <= 1e-2)) {
      r.failure = fmt::format(
          "small case {}x{}x{}: relative error {:.3g} > 1e-2 against the CPU emulation of the "
          "same codes", small.m, small.n, small.k, r.small_rel_err);
      return r;
    }
  }
  const Fp8Tensors d = allocate_fp8(dev, p, out, 21);
  dev.matmul_fp8(fp8_args(p, d));
  const std::vector<float> a = download_fp8(dev, d.a), b = download_fp8(dev, d.b);
  const std::vector<float> got = download_floats(dev, d.out);
  const std::vector<float> bias =
      d.bias.defined() ? download_floats(dev, d.bias) : std::vector<float>{};
  const std::vector<float> c = d.c.defined() ? download_floats(dev, d.c) : std::vector<float>{};
  r.failure = first_sampled_mismatch(
      p, got,
      [&](int64_t i, int64_t j) {
        double ref = epilogue_term(p, bias, c, i, j);
        for (int64_t kk = 0; kk < p.k; ++kk) ref += double(a[i * p.k + kk]) * b[j * p.k + kk];
        return ref;
      },
      // Fast accumulation keeps partial sums in lower precision inside the tensor cores.
      [&](double ref) {
        return 1e-2 * std::fabs(ref) + 4e-3 * std::sqrt(static_cast<double>(p.k)) + 1e-2;
      });
  if (!r.failure.empty()) return r;
  r.ok = true;
  return r;
}

GemmCheck check_gemm(BenchContext& ctx, const GemmProblem& p) {
  if (p.fp8) return check_fp8_gemm(ctx, p);
  Backend& dev = *ctx.device;
  GemmCheck r;
  const DType out = out_dtype(ctx, p);
  {  // A small problem of the same kind against the CPU reference.
    GemmProblem small = p;
    small.m = kSmallM, small.n = kSmallN, small.k = kSmallK;
    const GemmTensors d = allocate(dev, small, ctx.dtype, out, 11);
    dev.matmul(matmul_args(small, d));
    std::vector<DeviceBuffer> keep;
    GemmTensors ref;
    ref.a = mirror(dev, *ctx.reference, d.a, keep);
    ref.b = mirror(dev, *ctx.reference, d.b, keep);
    ref.bias = mirror(dev, *ctx.reference, d.bias, keep);
    ref.c = mirror(dev, *ctx.reference, d.c, keep);
    keep.emplace_back(*ctx.reference, small.m * small.n * sizeof(float), "gemm reference out");
    ref.out = keep.back().tensor(DType::F32, {small.m, small.n});
    ctx.reference->fill(ref.out, kAccumulateStart);
    ctx.reference->matmul(matmul_args(small, ref));
    r.small_rel_err =
        relative_error(download_floats(dev, d.out), download_floats(*ctx.reference, ref.out));
    // bf16 outputs round to 8 significant bits; fp32 outputs differ only in summation order.
    const double tol = out == DType::BF16 ? 1e-2 : 1e-4;
    if (!(r.small_rel_err <= tol)) {
      r.failure = fmt::format(
          "small case {}x{}x{}: relative error {:.3g} > {:.0e} against the "
          "CPU reference",
          small.m, small.n, small.k, r.small_rel_err, tol);
      return r;
    }
  }
  // The full size: sampled entries against dot products on the host, in double.
  const GemmTensors d = allocate(dev, p, ctx.dtype, out, 21);
  dev.matmul(matmul_args(p, d));
  const std::vector<float> a = download_floats(dev, d.a), b = download_floats(dev, d.b);
  const std::vector<float> got = download_floats(dev, d.out);
  const std::vector<float> bias =
      d.bias.defined() ? download_floats(dev, d.bias) : std::vector<float>{};
  const std::vector<float> c = d.c.defined() ? download_floats(dev, d.c) : std::vector<float>{};
  r.failure = first_sampled_mismatch(
      p, got,
      [&](int64_t i, int64_t j) {
        double ref = 0;
        for (int64_t kk = 0; kk < p.k; ++kk) {
          const double x = a[p.trans_a ? kk * p.m + i : i * p.k + kk];
          const double y = b[p.trans_b ? j * p.k + kk : kk * p.n + j];
          ref += x * y;
        }
        return ref + epilogue_term(p, bias, c, i, j);
      },
      [&](double ref) {
        return (out == DType::BF16 ? 8e-3 : 1e-5) * std::fabs(ref) +
               2e-3 * std::sqrt(static_cast<double>(p.k)) + 1e-2;
      });
  if (!r.failure.empty()) return r;
  r.ok = true;
  return r;
}

GemmResult run_gemm(BenchContext& ctx, const GemmProblem& p) {
  GemmResult r;
  try {
    r.check = check_gemm(ctx, p);
    if (r.check.ok) time_gemm(ctx, p, r);
  } catch (const Error& e) {
    r.check.ok = false;
    r.check.failure = e.what();
  }
  return r;
}

int gemm_bench_command(const std::vector<std::string>& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    fmt::print("{}", kUsage);
    return 0;
  }
  std::set<std::string> valued = kCommonOptions;
  valued.insert({"sizes", "layouts", "epilogues", "dtypes", "config", "gemm_autotune"});
  const CommandArgs a(args, valued, {}, true);
  if (!a.unknown().empty() && !a.has("config"))
    throw ConfigError("command line", a.unknown().front(), "",
                      "an option of bench gemm (experiment keys need --config)");
  BenchContext ctx = make_context(context_options(a));
  // The CPU backend's fp32 reference runs a 16384^3 GEMM in minutes: its default sweep stops
  // where a CPU's GEMM rate has levelled off, with fewer samples, so that it ends in seconds.
  const bool cpu = ctx.device->device().kind == DeviceKind::CPU;
  if (cpu && !a.has("warmup")) ctx.warmup = 2;
  if (cpu && !a.has("iters")) ctx.iters = 7;

  std::vector<GemmProblem> problems;
  const bool model = a.has("config");
  if (model && a.has("dtypes"))
    throw ConfigError("command line", "dtypes", a.get("dtypes", ""),
                      "no --dtypes with --config (a config's GEMMs run in its own precision)");
  if (model) {
    LoadOptions lo;
    lo.config_path = a.get("config", "");
    lo.cli_overrides = a.unknown();
    const Experiment e = load_experiment(lo);
    const RunSetup setup = make_run_setup(e, {1, ctx.dtype}, [&] {
      return make_tokenizer(e.data, e.model_config.vocab_size)->vocab_size();
    });
    problems = model_gemms(setup.spec, setup.runtime);
  } else {
    const std::vector<int64_t> sizes =
        a.get_int_list("sizes", cpu ? std::vector<int64_t>{256, 512, 1024}
                                    : std::vector<int64_t>{1024, 2048, 4096, 8192, 16384});
    for (int64_t n : sizes)
      for (const std::string& layout : a.get_list("layouts", {"NN", "NT", "TN"})) {
        if (layout.size() != 2 || layout.find_first_not_of("NT") != std::string::npos)
          throw ConfigError("command line", "layouts", layout, "NN, NT, TN or TT");
        for (const std::string& ep : a.get_list("epilogues", {"none", "bias"})) {
          GemmProblem p{fmt::format("{}^3", n), n, n, n, layout[0] == 'T', layout[1] == 'T'};
          if (ep == "bias")
            p.epilogue = Epilogue::Bias;
          else if (ep == "residual")
            p.epilogue = Epilogue::Residual;
          else if (ep != "none")
            throw ConfigError("command line", "epilogues", ep, "none, bias or residual");
          problems.push_back(p);
        }
      }
    for (const std::string& dtype : a.get_list("dtypes", {"bf16"})) {
      if (dtype == "bf16") continue;  // the compute dtype's problems above
      if (dtype != "fp8") throw ConfigError("command line", "dtypes", dtype, "bf16 and/or fp8");
      for (int64_t n : sizes) {
        const int64_t multiple = ctx.device->fp8_gemm_multiple();
        if (n % multiple != 0)
          throw ConfigError("command line", "sizes", std::to_string(n),
                            fmt::format("multiples of {} with --dtypes fp8 (the FP8 GEMMs of {} "
                                        "need them)",
                                        multiple, ctx.description));
        GemmProblem p{fmt::format("{}^3", n), n, n, n, false, true};
        p.fp8 = true;
        problems.push_back(p);
      }
    }
  }

  const double peak = ctx.spec ? analysis::peak_tflops(*ctx.spec, dtype_name(ctx.dtype)) : 0;
  const double fp8_peak = ctx.spec ? analysis::peak_tflops(*ctx.spec, "fp8") : 0;
  analysis::Table t;
  t.name = "bench_gemm";
  t.title = fmt::format("GEMM on {}", ctx.description);
  t.note = fmt::format(
      "{} operands (rows marked fp8: e4m3 x e4m3, fp8 e5m2: e5m2 x e4m3, % of the fp8 peak); "
      "median of {} samples after {} "
      "warm-up calls; TFLOP/s = 2MNK / time; GB/s counts operands once and the output (read "
      "too with residual/accumulate); {}.",
      dtype_name(ctx.dtype), ctx.iters, ctx.warmup,
      peak_note(ctx, peak, std::string(dtype_name(ctx.dtype)) + " peak", "TFLOP/s"));
  t.columns = {{"gemm", true},     {"layout", true}, {"m", true},       {"n", true}, {"k", true},
               {"epilogue", true}, {"out_dtype"},    {"median_ms"},     {"tflops"},  {"gbps"},
               {"flops_per_byte"}, {"pct_of_peak"},  {"check_rel_err"}, {"status"}};
  if (model) t.columns.insert(t.columns.begin() + 6, {{"calls_per_step"}, {"ms_per_step"}});

  // Said before the first check, so that a long sweep is not silent where no status line shows.
  fmt::print(
      "bench gemm on {}: {} problems, each checked against the CPU reference, then timed "
      "({} warm-up calls, median of {} samples)\n",
      ctx.description, problems.size(), ctx.warmup, ctx.iters);
  std::fflush(stdout);
  analysis::StatusLine status(static_cast<int>(problems.size()));
  int failures = 0;
  double step_ms = 0, step_flops = 0;
  for (const GemmProblem& p : problems) {
    const DType out = out_dtype(ctx, p);
    status.step(fmt::format("{} {} {}x{}x{} {}", p.name, p.layout(), p.m, p.n, p.k,
                            epilogue_name(p.epilogue)));
    const std::string fp8_mark = p.fp8_a == DType::E5M2 ? " fp8 e5m2" : " fp8";
    std::vector<analysis::Cell> row = {p.fp8 ? p.name + fp8_mark : p.name,
                                       p.layout(),
                                       p.m,
                                       p.n,
                                       p.k,
                                       std::string(epilogue_name(p.epilogue)),
                                       std::string(dtype_name(out))};
    if (model) row.insert(row.begin() + 6, {p.calls_per_step, analysis::Cell{}});
    const GemmResult r = run_gemm(ctx, p);
    if (!r.check.ok) {
      ++failures;
      row.insert(row.end(),
                 {analysis::Cell{}, analysis::Cell{}, analysis::Cell{}, analysis::Cell{},
                  analysis::Cell{}, r.check.small_rel_err, "FAILED: " + r.check.failure});
      t.rows.push_back(row);
      continue;
    }
    const double ms = r.timing.median_ms;
    if (model) {
      row[7] = ms * p.calls_per_step;
      step_ms += ms * p.calls_per_step;
      step_flops += p.flops() * p.calls_per_step;
    }
    const double row_peak = p.fp8 ? fp8_peak : peak;
    row.insert(row.end(), {ms, r.tflops, r.gbps, p.flops() / p.bytes(in_dtype(ctx, p), out),
                           analysis::cell_or_empty(percent_of(r.tflops, row_peak)),
                           r.check.small_rel_err, std::string("ok")});
    t.rows.push_back(row);
  }
  const double seconds = status.finish();

  std::string md = analysis::markdown_table(t);
  std::string summary =
      fmt::format("{} GEMM problems checked and timed in {:.1f} s", problems.size(), seconds);
  if (model && step_ms > 0)
    summary += fmt::format("; one training step's GEMMs: {:.2f} ms at {:.1f} TFLOP/s", step_ms,
                           step_flops / (step_ms * 1e-3) / 1e12);
  if (failures) summary += fmt::format("; {} FAILED their check (no timing reported)", failures);
  md += "\n" + summary + ".\n";
  analysis::print_and_write(a.get("output", ""), {t}, "bench_gemm.md", md);
  return failures ? kExitRuntimeFailure : 0;
}

}  // namespace tessera::bench
