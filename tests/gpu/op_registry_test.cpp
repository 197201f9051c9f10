// The op-test registry: every op of the op API on the CUDA backend against the fp32 CPU
// reference, on random inputs at several shapes (odd sizes, GQA ratios, windows), forward
// and backward. Both backends get identical inputs (bf16-rounded values; the CPU computes in
// fp32 on them). Outputs are poisoned with NaN first so unwritten elements fail, and every
// GPU tensor sits between guard bytes that must stay untouched.
//
// Attention runs on each available implementation (attention_backend): Tessera's kernels in
// EveryOpMatchesTheCpuReference, cuDNN's fused SDPA in AttentionOnCudnnMatchesTheCpuReference
// (skipped, visibly, where cuDNN cannot be loaded).
//
// With TESSERA_OP_PERF=1 each case is also timed on the GPU (median of 20 after warm-up)
// and reported with the case's FLOP and byte counts.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>

#include <fmt/format.h>

#include "gpu_test_util.h"

namespace tessera::gpu_test {
namespace {

enum class Kind { Act, F32, I32 };           // Act: compute dtype (bf16 on GPU, fp32 on CPU)
enum class Role { In, Out, Accum, InOut };   // Accum: pre-filled, added to; InOut: read then overwritten

struct Spec {
  std::string name;
  Shape shape;
  Kind kind = Kind::Act;
  Role role = Role::In;
  float scale = 1.0f;     // normal(0, scale) values, or ints in [int_lo, int_hi) for I32
  int int_lo = 0, int_hi = 1;
  double tol = 2e-2;      // relative error allowed for outputs
  bool positive = false;  // absolute values (second moments)
};

using Tensors = std::map<std::string, Tensor>;

struct OpCase {
  std::string name;
  std::vector<Spec> specs;
  std::function<void(Backend&, const Tensors&)> run;
  double flops = 0, bytes = 0;  // per call, for perf mode
};

std::vector<float> host_values(const Spec& s, uint32_t seed) {
  const size_t n = static_cast<size_t>(s.shape.numel());
  if (s.kind == Kind::I32) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> d(s.int_lo, s.int_hi - 1);
    std::vector<float> v(n);
    for (auto& x : v) x = static_cast<float>(d(rng));
    return v;
  }
  std::vector<float> v = random_normal(n, seed, s.scale);
  if (s.positive)
    for (auto& x : v) x = std::abs(x);
  return s.kind == Kind::Act ? round_bf16(v) : v;
}

struct Materialized {
  std::vector<std::unique_ptr<GuardedTensor>> storage;
  Tensors tensors;
};

Materialized materialize(Backend& b, const OpCase& c, DType act, const std::map<std::string, std::vector<float>>& values) {
  Materialized m;
  for (const Spec& s : c.specs) {
    const DType dt = s.kind == Kind::I32 ? DType::I32 : s.kind == Kind::F32 ? DType::F32 : act;
    m.storage.push_back(std::make_unique<GuardedTensor>(b, dt, s.shape));
    const Tensor& t = m.storage.back()->t();
    m.tensors[s.name] = t;
    if (s.role == Role::Out) {
      if (dt != DType::I32) poison(b, t);
    } else if (dt == DType::I32) {
      const auto& v = values.at(s.name);
      std::vector<int32_t> ints(v.begin(), v.end());
      b.upload(t, ints.data());
    } else {
      upload_float(b, t, values.at(s.name));
    }
  }
  return m;
}

// The CPU reference and the GPU backend with the given attention implementation.
struct CaseBackends {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::unique_ptr<Backend> gpu;
};

const char* attention_name(AttentionBackend a) {
  return a == AttentionBackend::Cudnn ? "cudnn" : a == AttentionBackend::Tessera ? "tessera" : "auto";
}

void check_case(const OpCase& c, AttentionBackend attention = AttentionBackend::Tessera) {
  const bool attention_case = c.name.starts_with("attention_");
  const std::string label = attention_case ? c.name + " [" + attention_name(attention) + "]" : c.name;
  SCOPED_TRACE(label);
  CaseBackends be;
  BackendOptions options;
  options.attention = attention;
  be.gpu = make_backend(DeviceChoice::Cuda, 0, options);
  std::map<std::string, std::vector<float>> values;
  uint32_t seed = 1;
  for (const Spec& s : c.specs)
    if (s.role != Role::Out) values[s.name] = host_values(s, seed++);
  Materialized cpu = materialize(*be.cpu, c, DType::F32, values);
  Materialized gpu = materialize(*be.gpu, c, DType::BF16, values);
  c.run(*be.cpu, cpu.tensors);
  c.run(*be.gpu, gpu.tensors);
  be.gpu->synchronize();
  for (size_t i = 0; i < c.specs.size(); ++i) {
    const Spec& s = c.specs[i];
    EXPECT_TRUE(gpu.storage[i]->guards_intact()) << s.name << ": write outside the tensor";
    if (s.role == Role::In) continue;
    const std::vector<float> ref = download_float(*be.cpu, cpu.tensors.at(s.name));
    const std::vector<float> got = download_float(*be.gpu, gpu.tensors.at(s.name));
    const double err = relative_error(got, ref);
    EXPECT_LT(err, s.tol) << s.name << " relative error " << err;
    std::printf("[ op       ] %-44s %-10s rel err %.2e (tol %.0e)\n", label.c_str(), s.name.c_str(), err, s.tol);
  }
  if (std::getenv("TESSERA_OP_PERF") && c.flops + c.bytes > 0) {
    std::vector<double> ms;
    for (int i = 0; i < 25; ++i) {
      be.gpu->synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      c.run(*be.gpu, gpu.tensors);
      be.gpu->synchronize();
      if (i >= 5) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    const double t = ms[ms.size() / 2];
    std::printf("[ perf     ] %-44s %9.3f ms %8.1f TFLOP/s %8.1f GB/s\n", label.c_str(), t,
                c.flops / t / 1e9, c.bytes / t / 1e6);
  }
}

// ---------------------------------------------------------------- cases

std::vector<OpCase> matmul_cases() {
  std::vector<OpCase> cases;
  struct P { int64_t M, N, K; bool ta, tb; bool fp32_out; float beta; bool separate_c, bias; };
  for (const P& p : std::vector<P>{{64, 48, 32, false, true, false, 0, false, false},
                                   {129, 77, 200, false, true, false, 0, false, true},      // forward + bias
                                   {130, 96, 72, false, true, false, 1, true, false},        // residual via beta
                                   {257, 136, 96, false, false, false, 0, false, false},     // data gradient
                                   {96, 200, 333, true, false, true, 1, false, false},       // weight gradient
                                   {1024, 1024, 1024, false, true, false, 0, false, false}}) {
    OpCase c;
    c.name = fmt::format("matmul M{} N{} K{} {}{}{}{}{}", p.M, p.N, p.K, p.ta ? "T" : "N", p.tb ? "T" : "N",
                         p.fp32_out ? " fp32-out" : "", p.beta ? " beta" : "", p.bias ? " bias" : "");
    const Kind out_kind = p.fp32_out ? Kind::F32 : Kind::Act;
    const double tol = p.fp32_out ? 1e-3 : 1e-2;
    c.specs = {{"a", p.ta ? Shape{p.K, p.M} : Shape{p.M, p.K}, Kind::Act, Role::In, 0.5f},
               {"b", p.tb ? Shape{p.N, p.K} : Shape{p.K, p.N}, Kind::Act, Role::In, 0.5f},
               {"out", {p.M, p.N}, out_kind, p.beta && !p.separate_c ? Role::Accum : Role::Out, 1.0f, 0, 1, tol}};
    if (p.separate_c) c.specs.push_back({"c", {p.M, p.N}, out_kind, Role::In});
    if (p.bias) c.specs.push_back({"bias", {p.N}, out_kind, Role::In});
    c.run = [p](Backend& b, const Tensors& t) {
      MatmulArgs m;
      m.out = t.at("out");
      m.a = t.at("a");
      m.b = t.at("b");
      m.trans_a = p.ta;
      m.trans_b = p.tb;
      m.beta = p.beta;
      if (p.separate_c) m.c = t.at("c");
      if (p.bias) m.bias = t.at("bias");
      b.matmul(m);
    };
    c.flops = 2.0 * p.M * p.N * p.K;
    c.bytes = 2.0 * (p.M * p.K + p.N * p.K) + (p.fp32_out ? 4.0 : 2.0) * p.M * p.N;
    cases.push_back(c);
  }
  OpCase bias;
  bias.name = "bias_backward M333 N200";
  bias.specs = {{"dout", {333, 200}, Kind::Act}, {"dbias", {200}, Kind::F32, Role::Accum, 1, 0, 1, 1e-4}};
  bias.run = [](Backend& b, const Tensors& t) { b.bias_backward(t.at("dbias"), t.at("dout")); };
  cases.push_back(bias);
  return cases;
}

std::vector<OpCase> norm_and_embedding_cases() {
  std::vector<OpCase> cases;
  for (auto [N, C] : {std::pair<int64_t, int64_t>{257, 320}, {33, 100}, {512, 4096}}) {
    OpCase f;
    f.name = fmt::format("rmsnorm_forward N{} C{}", N, C);
    f.specs = {{"x", {N, C}}, {"w", {C}, Kind::Act, Role::In, 0.5f},
               {"out", {N, C}, Kind::Act, Role::Out, 1, 0, 1, 1e-2}, {"rstd", {N}, Kind::F32, Role::Out, 1, 0, 1, 1e-5}};
    f.run = [](Backend& b, const Tensors& t) { b.rmsnorm_forward(t.at("out"), t.at("rstd"), t.at("x"), t.at("w"), 1e-5f); };
    f.bytes = 2.0 * 2 * N * C;
    cases.push_back(f);
    OpCase g;
    g.name = fmt::format("rmsnorm_backward N{} C{}", N, C);
    // rstd must be consistent with x for a meaningful backward: recompute it inside run.
    g.specs = {{"x", {N, C}}, {"w", {C}, Kind::Act, Role::In, 0.5f}, {"dout", {N, C}},
               {"rstd", {N}, Kind::F32, Role::Out, 1, 0, 1, 1e-5}, {"y", {N, C}, Kind::Act, Role::Out, 1, 0, 1, 1e-2},
               {"dx", {N, C}, Kind::Act, Role::Accum, 1, 0, 1, 2e-2}, {"dw", {C}, Kind::F32, Role::Accum, 1, 0, 1, 1e-3}};
    g.run = [](Backend& b, const Tensors& t) {
      b.rmsnorm_forward(t.at("y"), t.at("rstd"), t.at("x"), t.at("w"), 1e-5f);
      b.rmsnorm_backward(t.at("dx"), t.at("dw"), t.at("dout"), t.at("x"), t.at("w"), t.at("rstd"));
    };
    g.bytes = 2.0 * 4 * N * C;
    cases.push_back(g);
  }
  for (auto [V, N, C] : {std::tuple<int64_t, int64_t, int64_t>{1000, 333, 72}, {50, 64, 100}, {32000, 4096, 1024}}) {
    OpCase f;
    f.name = fmt::format("embedding_forward V{} N{} C{}", V, N, C);
    f.specs = {{"tokens", {N}, Kind::I32, Role::In, 1, 0, static_cast<int>(V)}, {"table", {V, C}},
               {"out", {N, C}, Kind::Act, Role::Out, 1, 0, 1, 1e-6}};
    f.run = [](Backend& b, const Tensors& t) { b.embedding_forward(t.at("out"), t.at("tokens"), t.at("table")); };
    cases.push_back(f);
    OpCase g;
    g.name = fmt::format("embedding_backward V{} N{} C{}", V, N, C);
    g.specs = {{"tokens", {N}, Kind::I32, Role::In, 1, 0, static_cast<int>(V)}, {"dout", {N, C}},
               {"dtable", {V, C}, Kind::F32, Role::Accum, 1, 0, 1, 1e-5}};
    g.run = [](Backend& b, const Tensors& t) { b.embedding_backward(t.at("dtable"), t.at("dout"), t.at("tokens")); };
    g.bytes = 2.0 * N * C + 8.0 * V * C;
    cases.push_back(g);
  }
  return cases;
}

AttentionShape attn(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t window, bool causal = true) {
  AttentionShape s;
  s.batch = B, s.seq = T, s.heads = H, s.kv_heads = KV, s.head_dim = D, s.window = window, s.causal = causal;
  s.scale = 1.0f / std::sqrt(static_cast<float>(D));
  return s;
}

std::vector<float> rope_freqs(int64_t T, int64_t D) {
  std::vector<float> f(T * D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < D / 2; ++i) {
      const double a = t * std::pow(10000.0, -2.0 * i / D);
      f[t * D + i] = static_cast<float>(std::cos(a));
      f[t * D + D / 2 + i] = static_cast<float>(std::sin(a));
    }
  return f;
}

std::vector<OpCase> attention_cases() {
  std::vector<OpCase> cases;
  for (const AttentionShape& s : {attn(2, 37, 4, 2, 64, 0), attn(1, 200, 4, 4, 128, 0), attn(1, 200, 8, 1, 64, 33),
                                  attn(2, 77, 4, 2, 128, 0, false), attn(1, 1024, 8, 2, 128, 0),
                                  attn(1, 1024, 8, 2, 128, 256)}) {
    const std::string shape = fmt::format("B{} T{} H{} KV{} D{} window{}{}", s.batch, s.seq, s.heads, s.kv_heads,
                                          s.head_dim, s.window, s.causal ? "" : " full");
    const int64_t N = s.tokens(), W = s.qkv_width(), HD = s.heads * s.head_dim;
    const double causal_frac = s.causal ? 0.5 : 1.0;
    const double fwd_flops = 4.0 * s.batch * s.heads * s.seq * s.seq * s.head_dim * causal_frac;
    OpCase rope;
    rope.name = "rope_forward+backward " + shape;
    rope.specs = {{"qkv", {N, W}, Kind::Act, Role::InOut, 1, 0, 1, 1e-2}, {"dqkv", {N, W}, Kind::Act, Role::InOut, 1, 0, 1, 1e-2}};
    rope.run = [s](Backend& b, const Tensors& t) {
      DeviceBuffer f(b, s.seq * s.head_dim * 4, "freqs");
      const Tensor freqs = f.tensor(DType::F32, {s.seq, s.head_dim});
      b.upload(freqs, rope_freqs(s.seq, s.head_dim).data());
      b.rope_forward(t.at("qkv"), freqs, s);
      b.rope_backward(t.at("dqkv"), freqs, s);
      b.synchronize();
    };
    cases.push_back(rope);
    OpCase f;
    f.name = "attention_forward " + shape;
    f.specs = {{"qkv", {N, W}}, {"out", {N, HD}, Kind::Act, Role::Out, 1, 0, 1, 2e-2},
               {"lse", {s.batch, s.heads, s.seq}, Kind::F32, Role::Out, 1, 0, 1, 1e-3}};
    f.run = [s](Backend& b, const Tensors& t) { b.attention_forward(t.at("out"), t.at("lse"), t.at("qkv"), s); };
    f.flops = fwd_flops;
    cases.push_back(f);
    OpCase g;
    g.name = "attention_backward " + shape;
    g.specs = {{"qkv", {N, W}}, {"dout", {N, HD}}, {"out", {N, HD}, Kind::Act, Role::Out, 1, 0, 1, 2e-2},
               {"lse", {s.batch, s.heads, s.seq}, Kind::F32, Role::Out, 1, 0, 1, 1e-3},
               {"dqkv", {N, W}, Kind::Act, Role::Out, 1, 0, 1, 3e-2}};
    g.run = [s](Backend& b, const Tensors& t) {
      b.attention_forward(t.at("out"), t.at("lse"), t.at("qkv"), s);
      b.attention_backward(t.at("dqkv"), t.at("dout"), t.at("out"), t.at("lse"), t.at("qkv"), s);
    };
    g.flops = 3.5 * fwd_flops;
    cases.push_back(g);
  }
  return cases;
}

std::vector<OpCase> mlp_and_loss_cases() {
  std::vector<OpCase> cases;
  for (auto [N, F] : {std::pair<int64_t, int64_t>{300, 700}, {4096, 14336}}) {
    OpCase f;
    f.name = fmt::format("swiglu_forward+backward N{} F{}", N, F);
    f.specs = {{"gu", {N, 2 * F}}, {"dout", {N, F}}, {"out", {N, F}, Kind::Act, Role::Out, 1, 0, 1, 1e-2},
               {"dgu", {N, 2 * F}, Kind::Act, Role::Out, 1, 0, 1, 1e-2}};
    f.run = [](Backend& b, const Tensors& t) {
      b.swiglu_forward(t.at("out"), t.at("gu"));
      b.swiglu_backward(t.at("dgu"), t.at("dout"), t.at("gu"));
    };
    f.bytes = 2.0 * (2 * N * F + N * F + N * F + 2 * N * F + 2 * N * F);
    cases.push_back(f);
  }
  for (auto [N, V] : {std::pair<int64_t, int64_t>{77, 1000}, {33, 32001}, {512, 128256}}) {
    for (bool with_grad : {false, true}) {
      OpCase c;
      c.name = fmt::format("cross_entropy N{} V{}{}", N, V, with_grad ? " +grad in place" : "");
      c.specs = {{"logits", {N, V}, Kind::Act, with_grad ? Role::InOut : Role::In, 2.0f, 0, 1, 2e-2},
                 {"targets", {N}, Kind::I32, Role::In, 1, -1, static_cast<int>(V)},  // -1: ignored
                 {"losses", {N}, Kind::F32, Role::Out, 1, 0, 1, 1e-4}};
      c.run = [with_grad](Backend& b, const Tensors& t) {
        b.cross_entropy(t.at("losses"), t.at("logits"), t.at("targets"), with_grad ? t.at("logits") : Tensor{}, 0.01f);
      };
      c.bytes = (with_grad ? 4.0 : 2.0) * N * V;
      cases.push_back(c);
    }
  }
  return cases;
}

std::vector<OpCase> reduction_and_optimizer_cases() {
  std::vector<OpCase> cases;
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{12345677}}) {
    for (bool squares : {false, true}) {
      for (bool accumulate : {false, true}) {
        OpCase c;
        c.name = fmt::format("{} n{}{}", squares ? "sum_squares" : "sum", n, accumulate ? " accumulate" : "");
        c.specs = {{"x", {n}, Kind::F32}, {"out", {1}, Kind::F32, accumulate ? Role::Accum : Role::Out, 1, 0, 1, 1e-5}};
        c.run = [squares, accumulate](Backend& b, const Tensors& t) {
          if (squares) b.sum_squares(t.at("out"), t.at("x"), accumulate);
          else b.sum(t.at("out"), t.at("x"), accumulate);
        };
        c.bytes = 4.0 * n;
        cases.push_back(c);
      }
    }
  }
  for (float norm_sq : {0.25f, 400.0f, std::nanf("")}) {  // no clipping, clipping, skipped step
    const int64_t P = 100003;
    OpCase c;
    c.name = fmt::format("adamw_step P{} grad_norm_sq {}", P, norm_sq);
    c.specs = {{"master", {P}, Kind::F32, Role::InOut, 0.1f, 0, 1, 1e-6}, {"grad", {P}, Kind::F32, Role::In, 0.01f},
               {"m", {P}, Kind::F32, Role::InOut, 0.01f, 0, 1, 1e-6}, {"v", {P}, Kind::F32, Role::InOut, 1e-4f, 0, 1, 1e-6, true},
               {"params", {P}, Kind::Act, Role::Out, 1, 0, 1, 1e-2}};
    c.run = [P, norm_sq](Backend& b, const Tensors& t) {
      std::vector<ParamSegment> segs = {{0, 5000, false}, {5000, 90000, true}, {95000, P - 95000, false}};
      DeviceBuffer nb(b, 4, "norm");
      const Tensor norm = nb.tensor(DType::F32, {1});
      b.upload(norm, &norm_sq);
      AdamWArgs a;
      a.master = t.at("master");
      a.grad = t.at("grad");
      a.exp_avg = t.at("m");
      a.exp_avg_sq = t.at("v");
      a.params = t.at("params");
      a.grad_norm_sq = norm;
      a.segments = segs;
      a.lr = 1e-3f, a.beta1 = 0.9f, a.beta2 = 0.95f, a.eps = 1e-8f, a.weight_decay = 0.1f;
      a.max_grad_norm = 1.0f;
      a.step = 7;
      b.convert(t.at("params"), t.at("master"));  // skipped steps leave this copy as it was
      b.adamw_step(a);
      b.synchronize();
    };
    c.bytes = 4.0 * P * 7;
    cases.push_back(c);
  }
  return cases;
}

// An FP8 linear as the model runs it: tensorwise scales from each operand's amax, casts
// (the weight's through its transpose, as in dgrad), then the FP8 GEMM. Both backends see
// the same codes, so only the accumulation order and output rounding differ.
std::vector<OpCase> fp8_cases() {
  std::vector<OpCase> cases;
  struct P { int64_t M, N, K; DType a_format; bool fp32_out; float beta; };
  for (const P& p : std::vector<P>{{64, 48, 32, DType::E4M3, false, 0},
                                   {256, 160, 320, DType::E4M3, false, 1},    // forward + residual
                                   {128, 96, 256, DType::E5M2, false, 0},     // dgrad (e5m2 dY)
                                   {96, 208, 512, DType::E5M2, true, 1}}) {   // wgrad, fp32 += 
    OpCase c;
    c.name = fmt::format("matmul_fp8 M{} N{} K{} {}{}{}", p.M, p.N, p.K, dtype_name(p.a_format),
                         p.fp32_out ? " fp32-out" : "", p.beta ? " beta" : "");
    const Kind out_kind = p.fp32_out ? Kind::F32 : Kind::Act;
    c.specs = {{"a", {p.M, p.K}, Kind::Act, Role::In, 0.5f},
               {"wt", {p.K, p.N}, Kind::Act, Role::In, 0.05f},
               {"out", {p.M, p.N}, out_kind, p.beta ? Role::Accum : Role::Out, 1.0f, 0, 1,
                p.fp32_out ? 1e-3 : 1e-2}};
    c.run = [p](Backend& b, const Tensors& t) {
      DeviceBuffer codes(b, 2 * (p.M * p.K + p.N * p.K) + 1024, "fp8 codes");
      DeviceBuffer state(b, 8 * 256, "fp8 scales");
      const Tensor qa = codes.tensor(p.a_format, {p.M, p.K});
      const Tensor qb = codes.tensor(DType::E4M3, {p.N, p.K}, (p.M * p.K + 255) / 256 * 256);
      Tensor inv[2];
      for (int i = 0; i < 2; ++i) {
        const Tensor amax = state.tensor(DType::F32, {1, 1}, 3 * i * 256);
        const Tensor scale = state.tensor(DType::F32, {1}, (3 * i + 1) * 256);
        inv[i] = state.tensor(DType::F32, {1}, (3 * i + 2) * 256);
        const Tensor& src = i == 0 ? t.at("a") : t.at("wt");
        b.fill(amax, 0.0f);
        b.fp8_cast_transpose(Fp8CastArgs{src, {}, {}, {}, amax.view({1})});
        Fp8ScaleUpdateArgs u;
        u.amax_history = amax, u.scale = scale, u.scale_inv = inv[i];
        u.fp8_max = i == 0 && p.a_format == DType::E5M2 ? 57344.0f : 448.0f;
        u.most_recent = true, u.roll = false;
        b.fp8_update_scales(u);
        if (i == 0) b.fp8_cast_transpose(Fp8CastArgs{src, qa, {}, scale, {}});
        else b.fp8_cast_transpose(Fp8CastArgs{src, {}, qb, scale, {}});  // wt (K, N) -> (N, K)
      }
      Fp8MatmulArgs m;
      m.out = t.at("out"), m.a = qa, m.b = qb, m.a_scale_inv = inv[0], m.b_scale_inv = inv[1];
      m.beta = p.beta;
      b.matmul_fp8(m);
    };
    c.flops = 2.0 * p.M * p.N * p.K;
    c.bytes = 1.0 * (p.M * p.K + p.N * p.K) + (p.fp32_out ? 4.0 : 2.0) * p.M * p.N;
    cases.push_back(c);
  }
  return cases;
}

std::vector<OpCase> all_cases() {
  std::vector<OpCase> all;
  for (auto fn : {matmul_cases, norm_and_embedding_cases, attention_cases, mlp_and_loss_cases,
                  reduction_and_optimizer_cases, fp8_cases})
    for (auto& c : fn()) all.push_back(std::move(c));
  return all;
}

TEST(GpuOps, EveryOpMatchesTheCpuReference) {
  TS_REQUIRE_GPU();
  for (const OpCase& c : all_cases()) check_case(c, AttentionBackend::Tessera);
}

// attention_backend cudnn never falls back: every attention case runs on cuDNN or fails.
TEST(GpuOps, AttentionOnCudnnMatchesTheCpuReference) {
  TS_REQUIRE_GPU();
  BackendOptions options;
  options.attention = AttentionBackend::Cudnn;
  try {
    const std::unique_ptr<Backend> probe = make_backend(DeviceChoice::Cuda, 0, options);
    std::printf("[ op       ] attention on %s\n", probe->description().c_str());
  } catch (const ConfigError& e) {
    GTEST_SKIP() << "skipped: cuDNN attention unavailable: " << e.what();
  }
  int cases = 0;
  for (const OpCase& c : attention_cases()) {
    if (!c.name.starts_with("attention_")) continue;
    try {  // a refused shape throws ConfigError naming cuDNN's reason; go on with the next
      check_case(c, AttentionBackend::Cudnn);
    } catch (const std::exception& e) {
      ADD_FAILURE() << c.name << " [cudnn]: " << e.what();
    }
    ++cases;
  }
  EXPECT_GT(cases, 0);
}

TEST(GpuOps, InitNormalAndConvertAreBitwiseLikeTheCpu) {
  TS_REQUIRE_GPU();
  Backends be;
  const int64_t n = 1000003;
  DeviceBuffer cb(*be.cpu, n * 4, "cpu"), gb(*be.gpu, n * 4, "gpu"), gh(*be.gpu, n * 2, "gpu bf16");
  be.cpu->init_normal(cb.tensor(DType::F32, {n}), 77, 1234, 0.0f, 0.02f);
  be.gpu->init_normal(gb.tensor(DType::F32, {n}), 77, 1234, 0.0f, 0.02f);
  const std::vector<float> c = download_float(*be.cpu, cb.tensor(DType::F32, {n}));
  const std::vector<float> g = download_float(*be.gpu, gb.tensor(DType::F32, {n}));
  int64_t mismatches = 0;
  for (int64_t i = 0; i < n; ++i) mismatches += c[i] != g[i];
  EXPECT_EQ(mismatches, 0);
  be.gpu->convert(gh.tensor(DType::BF16, {n}), gb.tensor(DType::F32, {n}));
  const std::vector<float> h = download_float(*be.gpu, gh.tensor(DType::BF16, {n}));
  for (int64_t i = 0; i < n; i += 997) EXPECT_EQ(h[i], round_to_bf16(c[i])) << i;
}

TEST(GpuOps, OutOfMemoryIsAClearError) {
  TS_REQUIRE_GPU();
  Backends be;
  try {
    be.gpu->allocate(size_t{1} << 50, "an absurd buffer");
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("an absurd buffer"), std::string::npos) << e.what();
  }
  DeviceBuffer ok(*be.gpu, 1 << 20, "after the failure");  // the device still works
  be.gpu->fill(ok.tensor(DType::F32, {1 << 18}), 1.0f);
  be.gpu->synchronize();
}

}  // namespace
}  // namespace tessera::gpu_test
