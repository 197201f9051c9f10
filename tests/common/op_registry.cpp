#include "common/op_registry.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/reference_backend.h"
#include "common/test_tensors.h"
#include "tessera/core/split_master.h"
#include "tessera/ops/device_buffer.h"
#include "tessera/ops/op_observer.h"

namespace tessera::test {
namespace {

// fp32 compute against the double reference on the same inputs: accumulated fp32 rounding,
// ~1e-7 per operation.
constexpr double kF32Tol = 1e-5;

// ---------------------------------------------------------------- harness

DType dtype_of(Kind kind, DType compute) {
  return kind == Kind::Act    ? compute
         : kind == Kind::F32  ? DType::F32
         : kind == Kind::BF16 ? DType::BF16
                              : DType::I32;
}

std::vector<float> host_values(const Spec& s, uint32_t seed, DType compute) {
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
  return dtype_of(s.kind, compute) == DType::BF16 ? round_bf16(v) : v;
}

// Host values of a tensor of any dtype the cases use.
std::vector<float> download_values(Backend& b, const Tensor& t) {
  if (t.dtype != DType::I32) return download_float(b, t);
  std::vector<int32_t> ints(static_cast<size_t>(t.numel()));
  b.download(ints.data(), t);
  return std::vector<float>(ints.begin(), ints.end());
}

struct Materialized {
  std::vector<std::unique_ptr<GuardedTensor>> storage;  // in the order of the case's specs
  Tensors tensors;
};

Materialized materialize(Backend& b, const OpCase& c, DType compute,
                         const std::map<std::string, std::vector<float>>& values) {
  Materialized m;
  for (const Spec& s : c.specs) {
    const DType dt = dtype_of(s.kind, compute);
    m.storage.push_back(std::make_unique<GuardedTensor>(b, dt, s.shape));
    const Tensor& t = m.storage.back()->t();
    m.tensors[s.name] = t;
    if (s.role == Role::Out) {
      if (dt != DType::I32) {
        poison(b, t);
      } else {  // ids no op writes, so that unwritten elements fail
        const std::vector<int32_t> sentinel(static_cast<size_t>(t.numel()), -123456789);
        b.upload(t, sentinel.data());
      }
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

// Sums the cost the op table gives each op a case runs (ops/op_table.h, OpCost): what the
// case's timing is measured against.
class CostTally final : public OpObserver {
 public:
  void op_begin(const char*, const OpArgs& args) override {
    for (const OpArg& a : args.items()) {
      if (std::string_view(a.key) == "op_flops") cost.flops += a.d;
      if (std::string_view(a.key) == "op_bytes") cost.bytes += a.d;
    }
  }
  void op_end() override {}
  void range_begin(const char*) override {}
  void range_end() override {}
  OpCost cost;
};

void time_case(const OpCase& c, Backend& b, const Tensors& tensors, const std::string& label) {
  CostTally tally;
  b.set_op_observer(&tally);
  c.run(b, tensors);
  b.set_op_observer(nullptr);
  std::vector<double> ms;
  for (int i = 0; i < 25; ++i) {
    b.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    c.run(b, tensors);
    b.synchronize();
    if (i >= 5)
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const double t = ms[ms.size() / 2];
  std::printf("[ perf     ] %-44s %9.3f ms %8.1f TFLOP/s %8.1f GB/s\n", label.c_str(), t,
              tally.cost.flops / t / 1e9, tally.cost.bytes / t / 1e6);
}

}  // namespace

void check_case(const OpCase& c, const BackendUnderTest& under_test) {
  const bool attention_case = c.name.starts_with("attention_");
  const std::string label = attention_case && !under_test.attention.empty()
                                ? c.name + " [" + under_test.attention + "]"
                                : c.name;
  SCOPED_TRACE(label + " on " + under_test.name);
  int64_t elements = 0;
  for (const Spec& s : c.specs) elements += s.shape.numel();
  if (elements > under_test.max_elements) {
    std::printf("[ skipped  ] %-44s %lld elements, more than %s takes\n", label.c_str(),
                static_cast<long long>(elements), under_test.name.c_str());
    return;
  }
  const std::unique_ptr<Backend> backend = under_test.make();
  ReferenceBackend reference;
  std::map<std::string, std::vector<float>> values;
  uint32_t seed = 1;
  for (const Spec& s : c.specs) {
    if (s.role == Role::Out) continue;
    values[s.name] = host_values(s, seed++, under_test.compute);
    if (s.kind != Kind::I32) ASSERT_TRUE(all_nonzero(values[s.name])) << s.name << ": a zero input";
  }
  const Materialized tested = materialize(*backend, c, under_test.compute, values);
  const Materialized expected = materialize(reference, c, DType::F32, values);
  c.run(*backend, tested.tensors);
  c.run(reference, expected.tensors);
  backend->synchronize();
  for (size_t i = 0; i < c.specs.size(); ++i) {
    const Spec& s = c.specs[i];
    const Tensor& t = tested.tensors.at(s.name);
    EXPECT_TRUE(tested.storage[i]->guards_intact()) << s.name << ": write outside the tensor";
    if (s.role == Role::In) {
      EXPECT_TRUE(download_values(*backend, t) == values.at(s.name)) << s.name << ": input changed";
      continue;
    }
    if (s.kind == Kind::I32) {  // ids (routing choices, rows, offsets) must match exactly
      const std::vector<float> got = download_values(*backend, t);
      const std::vector<float> want = download_values(reference, expected.tensors.at(s.name));
      size_t wrong = 0;
      for (size_t j = 0; j < got.size(); ++j) wrong += got[j] != want[j];
      EXPECT_EQ(wrong, 0u) << s.name << ": " << wrong << " of " << got.size() << " ids differ";
      std::printf("[ op       ] %-44s %-10s %zu of %zu ids differ\n", label.c_str(), s.name.c_str(),
                  wrong, got.size());
      continue;
    }
    // A tensor stored in bf16 (a gradient or optimizer state) rounds to bf16 on every backend:
    // where fp32 and the reference's double differ in a last bit, a value may round to the
    // other neighbour, so its own tolerance applies under fp32 compute too.
    const double tol = under_test.compute == DType::BF16 || s.kind == Kind::BF16
                           ? s.tol
                           : std::min(s.tol, kF32Tol);
    const std::vector<float> want = download_float(reference, expected.tensors.at(s.name));
    const double err = relative_error(download_float(*backend, t), want);
    EXPECT_LE(err, tol) << s.name << " relative error " << err;
    std::printf("[ op       ] %-44s %-10s rel err %.2e (tol %.0e)\n", label.c_str(), s.name.c_str(),
                err, tol);
  }
  if (std::getenv("TESSERA_OP_PERF")) time_case(c, *backend, tested.tensors, label);
}

// ---------------------------------------------------------------- cases

namespace {

// out = alpha * op(a) @ op(b) + beta * c (+ bias): c a separate tensor, out itself, or none.
enum class COperand { None, Separate, Out };

struct MatmulCase {
  int64_t M, N, K;
  bool ta, tb;
  bool fp32_out;
  float beta;
  bool separate_c, bias;
  float alpha = 1.0f;
};

OpCase matmul_case(std::string name, const MatmulCase& p) {
  OpCase c;
  c.name = std::move(name);
  const Kind out_kind = p.fp32_out ? Kind::F32 : Kind::Act;
  const double tol = p.fp32_out ? 1e-3 : 1e-2;
  const bool accumulate = p.beta != 0 && !p.separate_c;
  c.specs = {{"a", p.ta ? Shape{p.K, p.M} : Shape{p.M, p.K}, Kind::Act, Role::In, 0.5f},
             {"b", p.tb ? Shape{p.N, p.K} : Shape{p.K, p.N}, Kind::Act, Role::In, 0.5f},
             {"out", {p.M, p.N}, out_kind, accumulate ? Role::Accum : Role::Out, 1.0f, 0, 1, tol}};
  if (p.separate_c) c.specs.push_back({"c", {p.M, p.N}, out_kind, Role::In});
  if (p.bias) c.specs.push_back({"bias", {p.N}, out_kind, Role::In});
  c.run = [p](Backend& b, const Tensors& t) {
    MatmulArgs m;
    m.out = t.at("out");
    m.a = t.at("a");
    m.b = t.at("b");
    m.trans_a = p.ta;
    m.trans_b = p.tb;
    m.alpha = p.alpha;
    m.beta = p.beta;
    if (p.separate_c) m.c = t.at("c");
    if (p.bias) m.bias = t.at("bias");
    b.matmul(m);
  };
  return c;
}

std::vector<OpCase> matmul_cases() {
  std::vector<OpCase> cases;
  // The GEMMs of a model.
  for (const MatmulCase& p : std::vector<MatmulCase>{
           {64, 48, 32, false, true, false, 0, false, false},
           {129, 77, 200, false, true, false, 0, false, true},    // forward + bias
           {130, 96, 72, false, true, false, 1, true, false},     // residual via beta
           {257, 136, 96, false, false, false, 0, false, false},  // data gradient
           {96, 200, 333, true, false, true, 1, false, false},    // weight gradient
           {1024, 1024, 1024, false, true, false, 0, false, false}}) {
    cases.push_back(
        matmul_case(fmt::format("matmul M{} N{} K{} {}{}{}{}{}", p.M, p.N, p.K, p.ta ? "T" : "N",
                                p.tb ? "T" : "N", p.fp32_out ? " fp32-out" : "",
                                p.beta ? " beta" : "", p.bias ? " bias" : ""),
                    p));
  }
  // Every operand combination at odd sizes, with alpha and a negative beta.
  for (int flags = 0; flags < 8; ++flags) {
    for (COperand c : {COperand::None, COperand::Separate, COperand::Out}) {
      const bool ta = flags & 1, tb = flags & 2, bias = flags & 4;
      const float beta = c == COperand::None ? 0.0f : -0.5f;
      const MatmulCase p{33, 19, 29, ta, tb, false, beta, c == COperand::Separate, bias, 0.75f};
      const char* c_name = c == COperand::None       ? ""
                           : c == COperand::Separate ? " beta-0.5 c"
                                                     : " beta-0.5 c=out";
      cases.push_back(
          matmul_case(fmt::format("matmul M33 N19 K29 {}{} alpha0.75{}{}", ta ? "T" : "N",
                                  tb ? "T" : "N", c_name, bias ? " bias" : ""),
                      p));
    }
  }
  // Leading dimensions flatten into rows: x (B, T, C) @ w (N, C)^T.
  OpCase flat;
  flat.name = "matmul x(2,3,5) w(4,5) NT";
  flat.specs = {{"x", {2, 3, 5}, Kind::Act, Role::In, 0.5f},
                {"w", {4, 5}, Kind::Act, Role::In, 0.5f},
                {"out", {2, 3, 4}, Kind::Act, Role::Out, 1.0f, 0, 1, 1e-2}};
  flat.run = [](Backend& b, const Tensors& t) {
    MatmulArgs m;
    m.out = t.at("out");
    m.a = t.at("x");
    m.b = t.at("w");
    m.trans_b = true;
    b.matmul(m);
  };
  cases.push_back(flat);
  OpCase bias;
  bias.name = "bias_backward M333 N200";
  bias.specs = {{"dout", {333, 200}, Kind::Act},
                {"dbias", {200}, Kind::F32, Role::Accum, 1, 0, 1, 1e-4}};
  bias.run = [](Backend& b, const Tensors& t) { b.bias_backward(t.at("dbias"), t.at("dout")); };
  cases.push_back(bias);
  return cases;
}

std::vector<OpCase> norm_and_embedding_cases() {
  std::vector<OpCase> cases;
  // C 320 and 4096: the one-pass kernels on CUDA; 5120: the two-pass ones; 100: unaligned rows.
  for (auto [N, C] : {std::pair<int64_t, int64_t>{257, 320}, {33, 100}, {512, 4096}, {24, 5120}}) {
    OpCase f;
    f.name = fmt::format("rmsnorm_forward N{} C{}", N, C);
    f.specs = {{"x", {N, C}},
               {"w", {C}, Kind::Act, Role::In, 0.5f},
               {"out", {N, C}, Kind::Act, Role::Out, 1, 0, 1, 1e-2},
               {"rstd", {N}, Kind::F32, Role::Out, 1, 0, 1, 1e-5}};
    f.run = [](Backend& b, const Tensors& t) {
      b.rmsnorm_forward(t.at("out"), t.at("rstd"), t.at("x"), t.at("w"), 1e-5f);
    };
    cases.push_back(f);
    OpCase g;
    g.name = fmt::format("rmsnorm_backward N{} C{}", N, C);
    // rstd must be consistent with x for a meaningful backward: recompute it inside run.
    g.specs = {{"x", {N, C}},
               {"w", {C}, Kind::Act, Role::In, 0.5f},
               {"dout", {N, C}},
               {"rstd", {N}, Kind::F32, Role::Out, 1, 0, 1, 1e-5},
               {"y", {N, C}, Kind::Act, Role::Out, 1, 0, 1, 1e-2},
               {"dx", {N, C}, Kind::Act, Role::Accum, 1, 0, 1, 2e-2},
               {"dw", {C}, Kind::F32, Role::Accum, 1, 0, 1, 1e-3}};
    g.run = [](Backend& b, const Tensors& t) {
      b.rmsnorm_forward(t.at("y"), t.at("rstd"), t.at("x"), t.at("w"), 1e-5f);
      b.rmsnorm_backward(t.at("dx"), t.at("dw"), t.at("dout"), t.at("x"), t.at("w"), t.at("rstd"));
    };
    cases.push_back(g);
  }
  for (auto [V, N, C] :
       {std::tuple<int64_t, int64_t, int64_t>{1000, 333, 72}, {50, 64, 100}, {32000, 4096, 1024}}) {
    OpCase f;
    f.name = fmt::format("embedding_forward V{} N{} C{}", V, N, C);
    f.specs = {{"tokens", {N}, Kind::I32, Role::In, 1, 0, static_cast<int>(V)},
               {"table", {V, C}},
               {"out", {N, C}, Kind::Act, Role::Out, 1, 0, 1, 1e-6}};
    f.run = [](Backend& b, const Tensors& t) {
      b.embedding_forward(t.at("out"), t.at("tokens"), t.at("table"));
    };
    cases.push_back(f);
    OpCase g;
    g.name = fmt::format("embedding_backward V{} N{} C{}", V, N, C);
    g.specs = {{"tokens", {N}, Kind::I32, Role::In, 1, 0, static_cast<int>(V)},
               {"dout", {N, C}},
               {"dtable", {V, C}, Kind::F32, Role::Accum, 1, 0, 1, 1e-5}};
    g.run = [](Backend& b, const Tensors& t) {
      b.embedding_backward(t.at("dtable"), t.at("dout"), t.at("tokens"));
    };
    cases.push_back(g);
  }
  // A vocabulary shard: ids [first, first + V) of a vocabulary of 4V; tokens from all of it,
  // so most rows belong to other shards (zero rows, no gradient).
  for (auto [V, N, C, first] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{250, 333, 72, 500},
                                {16, 64, 100, 0},
                                {8000, 4096, 1024, 24000}}) {
    OpCase f;
    f.name =
        fmt::format("embedding_shard_forward V{} of {} first {} N{} C{}", V, 4 * V, first, N, C);
    f.specs = {{"tokens", {N}, Kind::I32, Role::In, 1, 0, static_cast<int>(4 * V)},
               {"table", {V, C}},
               {"out", {N, C}, Kind::Act, Role::Out, 1, 0, 1, 1e-6}};
    f.run = [first](Backend& b, const Tensors& t) {
      b.embedding_shard_forward(t.at("out"), t.at("tokens"), t.at("table"), first);
    };
    cases.push_back(f);
    OpCase g;
    g.name =
        fmt::format("embedding_shard_backward V{} of {} first {} N{} C{}", V, 4 * V, first, N, C);
    g.specs = {{"tokens", {N}, Kind::I32, Role::In, 1, 0, static_cast<int>(4 * V)},
               {"dout", {N, C}},
               {"dtable", {V, C}, Kind::F32, Role::Accum, 1, 0, 1, 1e-5}};
    g.run = [first](Backend& b, const Tensors& t) {
      b.embedding_shard_backward(t.at("dtable"), t.at("dout"), t.at("tokens"), first);
    };
    cases.push_back(g);
  }
  return cases;
}

AttentionShape attn(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t window,
                    bool causal = true) {
  AttentionShape s;
  s.batch = B, s.seq = T, s.heads = H, s.kv_heads = KV, s.head_dim = D, s.window = window,
  s.causal = causal;
  s.scale = 1.0f / std::sqrt(static_cast<float>(D));
  return s;
}

// Value heads of Dv beside query/key heads of D (multi-latent attention's shapes).
AttentionShape attn_v(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t Dv,
                      int64_t window, bool causal = true) {
  AttentionShape s = attn(B, T, H, KV, D, window, causal);
  s.v_head_dim = Dv;
  return s;
}

// " Dv<n>" in a case's name where the value heads differ from the query/key heads.
std::string v_dim_text(const AttentionShape& s) {
  return s.v_dim() != s.head_dim ? fmt::format(" Dv{}", s.v_dim()) : std::string();
}

// (T, D): row t holds cos(t * inv_freq) then sin(t * inv_freq), inv_freq[i] = 10000^(-2i/D).
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

std::vector<OpCase> mlp_and_loss_cases() {
  std::vector<OpCase> cases;
  // The decoder's slot maps: a residual add (in place too), a scale, the logit soft-cap and its
  // gradient, at odd and large sizes.
  for (int64_t n : {int64_t{1}, int64_t{1001}, int64_t{3000000}}) {
    OpCase add;
    add.name = fmt::format("add+scale n{}", n);
    add.specs = {{"a", {n}},
                 {"b", {n}},
                 {"out", {n}, Kind::Act, Role::Out, 1, 0, 1, 1e-2},
                 {"acc", {n}, Kind::Act, Role::Accum, 1, 0, 1, 1e-2},
                 {"scaled", {n}, Kind::Act, Role::Out, 1, 0, 1, 1e-2}};
    add.run = [](Backend& b, const Tensors& t) {
      b.add(t.at("out"), t.at("a"), t.at("b"));
      b.add(t.at("acc"), t.at("acc"), t.at("a"));  // in place: acc += a
      b.scale(t.at("scaled"), t.at("b"), 2.5f);
    };
    cases.push_back(add);
    OpCase cap;
    cap.name = fmt::format("softcap+backward n{}", n);
    cap.specs = {{"x", {n}, Kind::Act, Role::In, 20.0f},  // beyond the cap too
                 {"dy", {n}},
                 {"y", {n}, Kind::Act, Role::Out, 1, 0, 1, 1e-2},
                 {"dx", {n}, Kind::Act, Role::Out, 1, 0, 1, 2e-2}};
    cap.run = [](Backend& b, const Tensors& t) {
      b.softcap(t.at("y"), t.at("x"), 15.0f);
      b.softcap_backward(t.at("dx"), t.at("dy"), t.at("y"), 15.0f);
    };
    cases.push_back(cap);
  }
  for (auto [N, F] : {std::pair<int64_t, int64_t>{300, 700}, {4096, 14336}}) {
    OpCase f;
    f.name = fmt::format("swiglu_forward+backward N{} F{}", N, F);
    f.specs = {{"gu", {N, 2 * F}},
               {"dout", {N, F}},
               {"out", {N, F}, Kind::Act, Role::Out, 1, 0, 1, 1e-2},
               {"dgu", {N, 2 * F}, Kind::Act, Role::Out, 1, 0, 1, 1e-2}};
    f.run = [](Backend& b, const Tensors& t) {
      b.swiglu_forward(t.at("out"), t.at("gu"));
      b.swiglu_backward(t.at("dgu"), t.at("dout"), t.at("gu"));
    };
    cases.push_back(f);
  }
  for (auto [N, V] : {std::pair<int64_t, int64_t>{77, 1000}, {33, 32001}, {512, 128256}}) {
    for (bool with_grad : {false, true}) {
      OpCase c;
      c.name = fmt::format("cross_entropy N{} V{}{}", N, V, with_grad ? " +grad in place" : "");
      c.specs = {
          {"logits", {N, V}, Kind::Act, with_grad ? Role::InOut : Role::In, 2.0f, 0, 1, 2e-2},
          {"targets", {N}, Kind::I32, Role::In, 1, -1, static_cast<int>(V)},  // -1: ignored
          {"losses", {N}, Kind::F32, Role::Out, 1, 0, 1, 1e-4}};
      c.run = [with_grad](Backend& b, const Tensors& t) {
        b.cross_entropy(t.at("losses"), t.at("logits"), t.at("targets"),
                        with_grad ? t.at("logits") : Tensor{}, 0.01f);
      };
      cases.push_back(c);
    }
  }
  // Per-token log-probabilities and their gradient for per-token weights (a policy's loss),
  // in place over the logits and apart; some targets ignored.
  for (auto [N, V, in_place] : {std::tuple<int64_t, int64_t, bool>{77, 1000, false},
                                {33, 32001, true},
                                {512, 128256, true}}) {
    OpCase c;
    c.name =
        fmt::format("log_softmax_gather+backward N{} V{}{}", N, V, in_place ? " in place" : "");
    c.specs = {{"logits", {N, V}, Kind::Act, in_place ? Role::InOut : Role::In, 2.0f, 0, 1, 2e-2},
               {"targets", {N}, Kind::I32, Role::In, 1, -1, static_cast<int>(V)},  // -1: ignored
               {"dlogps", {N}, Kind::F32, Role::In, 0.5f},
               {"logps", {N}, Kind::F32, Role::Out, 1, 0, 1, 1e-4},
               {"lse", {N}, Kind::F32, Role::Out, 1, 0, 1, 1e-5}};
    if (!in_place) c.specs.push_back({"dlogits", {N, V}, Kind::Act, Role::Out, 1, 0, 1, 2e-2});
    c.run = [in_place](Backend& b, const Tensors& t) {
      b.log_softmax_gather(t.at("logps"), t.at("lse"), t.at("logits"), t.at("targets"));
      b.log_softmax_gather_backward(in_place ? t.at("logits") : t.at("dlogits"), t.at("dlogps"),
                                    t.at("logits"), t.at("lse"), t.at("targets"));
    };
    cases.push_back(c);
  }
  // Generation's draw: sampled (temperature 1 and 0.7, with min-p), greedy; a vocabulary below
  // the padded width; a Llama 3 vocabulary for 64 sequences.
  for (auto [B, V, vocab, temperature, min_p] :
       {std::tuple<int64_t, int64_t, int64_t, float, float>{4, 1000, 990, 1.0f, 0.0f},
        {3, 50000, 50000, 0.7f, 0.05f},
        {5, 777, 700, 0.0f, 0.0f},
        {64, 128256, 128256, 1.0f, 0.0f}}) {
    OpCase c;
    c.name = fmt::format("sample_tokens B{} V{} vocab {} temperature {} min_p {}", B, V, vocab, temperature, min_p);
    c.specs = {{"logits", {B, V}, Kind::Act, Role::In, 3.0f},
               {"streams", {B}, Kind::I32, Role::In, 1, 0, 100000},
               {"steps", {B}, Kind::I32, Role::In, 1, 0, 5000},
               {"tokens", {B}, Kind::I32, Role::Out},
               {"logps", {B}, Kind::F32, Role::Out, 1, 0, 1, 1e-4},
               {"entropy", {B}, Kind::F32, Role::Out, 1, 0, 1, 1e-4}};
    c.run = [vocab = vocab, temperature = temperature, min_p = min_p](Backend& b, const Tensors& t) {
      b.sample_tokens(t.at("tokens"), t.at("logps"), t.at("entropy"), t.at("logits"), t.at("streams"),
                      t.at("steps"), vocab, temperature, min_p, 1234);
    };
    cases.push_back(c);
  }
  // Vocabulary-parallel: the stats of two shards of V columns each (a vocabulary of 2V), then
  // shard 1's losses and gradient from both; targets anywhere in the vocabulary, some ignored.
  for (auto [N, V, with_grad] : {std::tuple<int64_t, int64_t, bool>{77, 500, true},
                                 {33, 16001, false},
                                 {512, 64128, true}}) {
    OpCase c;
    c.name = fmt::format("cross_entropy_shard_stats+cross_entropy_shard N{} V{} of {}{}", N, V,
                         2 * V, with_grad ? " +grad in place" : "");
    c.specs = {{"logits0", {N, V}, Kind::Act, Role::In, 2.0f},
               {"logits1", {N, V}, Kind::Act, with_grad ? Role::InOut : Role::In, 2.0f, 0, 1, 2e-2},
               {"targets", {N}, Kind::I32, Role::In, 1, -1, static_cast<int>(2 * V)},
               {"stats", {2, N, 2}, Kind::F32, Role::Out, 1, 0, 1, 1e-4},
               {"losses", {N}, Kind::F32, Role::Out, 1, 0, 1, 1e-4}};
    c.run = [N = N, V = V, with_grad = with_grad](Backend& b, const Tensors& t) {
      const Tensor& stats = t.at("stats");
      b.cross_entropy_shard_stats(stats.flat_range(0, 2 * N), t.at("logits0"), t.at("targets"), 0);
      b.cross_entropy_shard_stats(stats.flat_range(2 * N, 2 * N), t.at("logits1"), t.at("targets"),
                                  V);
      b.cross_entropy_shard(t.at("losses"), t.at("logits1"), t.at("targets"), stats, V,
                            with_grad ? t.at("logits1") : Tensor{}, 0.01f);
    };
    cases.push_back(c);
  }
  // The gradient into a tensor of its own; any negative target is ignored.
  OpCase c;
  c.name = "cross_entropy N77 V1000 +grad";
  c.specs = {{"logits", {77, 1000}, Kind::Act, Role::In, 2.0f},
             {"targets", {77}, Kind::I32, Role::In, 1, -100, 1000},
             {"losses", {77}, Kind::F32, Role::Out, 1, 0, 1, 1e-4},
             {"dlogits", {77, 1000}, Kind::Act, Role::Out, 1, 0, 1, 2e-2}};
  c.run = [](Backend& b, const Tensors& t) {
    b.cross_entropy(t.at("losses"), t.at("logits"), t.at("targets"), t.at("dlogits"), 0.37f);
  };
  cases.push_back(c);
  return cases;
}

// The storage of AdamW's state (Megatron's precision-aware optimizer): an fp32 master with a
// compute-dtype copy, or none (bf16 parameters updated in place); gradients and each moment
// The fp32 values of a split master's halves (core/split_master.h), joined on the host.
std::vector<float> joined_master(Backend& b, const Tensor& high, const Tensor& low) {
  std::vector<uint16_t> h(static_cast<size_t>(high.numel())), l(h.size());
  b.download(h.data(), high);
  b.download(l.data(), low);
  std::vector<float> out(h.size());
  join_master_values(h.data(), l.data(), out.data(), high.numel());
  return out;
}

// fp32 or bf16. The arithmetic is fp32 in every case. split: the master kept as the bf16
// parameters and its low halves (split master weights).
struct AdamWStorage {
  bool master = true;
  bool split = false;
  Kind grad = Kind::F32, exp_avg = Kind::F32, exp_avg_sq = Kind::F32;
  std::string name() const {
    auto k = [](Kind kind) { return kind == Kind::BF16 ? "bf16" : "fp32"; };
    return fmt::format(" master {} grad {} m {} v {}",
                       split ? "split" : master ? "fp32" : "none(bf16 params)",
                       k(grad), k(exp_avg), k(exp_avg_sq));
  }
};

OpCase adamw_case(int64_t P, float norm_sq, std::vector<ParamSegment> segments, const char* suffix,
                  const AdamWStorage& st = {}) {
  OpCase c;
  c.name = fmt::format(
      "adamw_step P{} grad_norm_sq {}{}{}", P, norm_sq, suffix,
      st.master && !st.split && st.grad == Kind::F32 && st.exp_avg == Kind::F32 &&
              st.exp_avg_sq == Kind::F32
          ? std::string()
          : st.name());
  // A bf16 output's elements may round to either neighbour where the reference's double and
  // the backend's fp32 arithmetic differ in the last fp32 bit: a few bf16 ulps in the norm.
  auto tol = [](Kind k, double fp32_tol) { return k == Kind::BF16 ? 1e-2 : fp32_tol; };
  if (st.split) {
    // The master goes in and comes out whole (split before the step, joined after it); its
    // high halves are the bf16 parameters.
    c.specs = {{"master", {P}, Kind::F32, Role::InOut, 0.1f, 0, 1, 1e-6},
               {"params", {P}, Kind::BF16, Role::Out, 1, 0, 1, 1e-2}};
  } else if (st.master) {
    c.specs = {{"master", {P}, Kind::F32, Role::InOut, 0.1f, 0, 1, 1e-6},
               {"params", {P}, Kind::Act, Role::Out, 1, 0, 1, 1e-2}};
  } else {
    c.specs = {{"params", {P}, Kind::BF16, Role::InOut, 0.1f, 0, 1, 1e-2}};
  }
  c.specs.push_back({"grad", {P}, st.grad, Role::In, 0.01f});
  c.specs.push_back({"m", {P}, st.exp_avg, Role::InOut, 0.01f, 0, 1, tol(st.exp_avg, 1e-6)});
  c.specs.push_back(
      {"v", {P}, st.exp_avg_sq, Role::InOut, 1e-4f, 0, 1, tol(st.exp_avg_sq, 1e-6), true});
  c.run = [norm_sq, segments, st](Backend& b, const Tensors& t) {
    DeviceBuffer nb(b, 4, "norm");
    const Tensor norm = nb.tensor(DType::F32, {1});
    b.upload(norm, &norm_sq);
    AdamWArgs a;
    DeviceBuffer lb(b, st.split ? static_cast<size_t>(t.at("master").numel()) * 2 : 0, "low halves");
    if (st.split) {
      a.master = lb.tensor(DType::U16, {t.at("master").numel()});
      b.split_master(t.at("params"), a.master, t.at("master"));
    } else if (st.master) {
      a.master = t.at("master");
    }
    a.grad = t.at("grad");
    a.exp_avg = t.at("m");
    a.exp_avg_sq = t.at("v");
    a.params = t.at("params");
    a.grad_norm_sq = norm;
    a.segments = segments;
    a.lr = 1e-3f, a.beta1 = 0.9f, a.beta2 = 0.95f, a.eps = 1e-8f, a.weight_decay = 0.1f;
    a.max_grad_norm = 1.0f;
    a.step = 7;
    // Skipped steps leave this copy as it was.
    if (st.master && !st.split) b.convert(t.at("params"), t.at("master"));
    b.adamw_step(a);
    if (st.split) b.upload(t.at("master"), joined_master(b, t.at("params"), a.master).data());
    b.synchronize();
  };
  return c;
}

std::vector<OpCase> reduction_and_optimizer_cases() {
  std::vector<OpCase> cases;
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{12345677}}) {
    for (bool squares : {false, true}) {
      for (bool accumulate : {false, true}) {
        OpCase c;
        c.name = fmt::format("{} n{}{}", squares ? "sum_squares" : "sum", n,
                             accumulate ? " accumulate" : "");
        c.specs = {{"x", {n}, Kind::F32},
                   {"out", {1}, Kind::F32, accumulate ? Role::Accum : Role::Out, 1, 0, 1, 1e-5}};
        c.run = [squares, accumulate](Backend& b, const Tensors& t) {
          if (squares)
            b.sum_squares(t.at("out"), t.at("x"), accumulate);
          else
            b.sum(t.at("out"), t.at("x"), accumulate);
        };
        cases.push_back(c);
      }
    }
  }
  // No clipping, clipping, skipped steps.
  const int64_t P = 100003;
  for (float norm_sq : {0.25f, 400.0f, std::nanf(""), std::numeric_limits<float>::infinity()})
    cases.push_back(adamw_case(
        P, norm_sq, {{0, 5000, false}, {5000, 90000, true}, {95000, P - 95000, false}}, ""));
  // Elements in no segment stay as they are.
  cases.push_back(adamw_case(50000, 400.0f,
                             {{0, 20000, true}, {20000, 100, false}, {20100, 28900, true}},
                             " tail in no segment"));
  // Every storage combination of the precision-aware optimizer, clipped, over segments that
  // start at odd offsets (the bf16 tensors' unaligned heads and tails); one skipped step with
  // the leanest storage.
  for (bool master : {true, false})
    for (Kind grad : {Kind::F32, Kind::BF16})
      for (Kind m : {Kind::F32, Kind::BF16})
        for (Kind v : {Kind::F32, Kind::BF16}) {
          if (master && grad == Kind::F32 && m == Kind::F32 && v == Kind::F32) continue;
          cases.push_back(adamw_case(20011, 400.0f,
                                     {{0, 3, false}, {3, 15000, true}, {15003, 5000, false}}, "",
                                     {master, false, grad, m, v}));
        }
  cases.push_back(adamw_case(20011, std::nanf(""), {{0, 20011, true}}, "",
                             {false, false, Kind::BF16, Kind::BF16, Kind::BF16}));
  // Split master weights with each moment storage, and a skipped step (both halves unchanged).
  for (Kind m : {Kind::F32, Kind::BF16})
    cases.push_back(adamw_case(20011, 400.0f, {{0, 3, false}, {3, 15000, true}, {15003, 5000, false}},
                               "", {true, true, Kind::BF16, m, m}));
  cases.push_back(adamw_case(20011, std::nanf(""), {{0, 20011, true}}, "",
                             {true, true, Kind::F32, Kind::BF16, Kind::BF16}));
  return cases;
}

// An FP8 linear as the model runs it: tensorwise scales from each operand's amax, casts
// (the weight's through its transpose, as in dgrad), then the FP8 GEMM. Every backend sees
// the same codes, so only the accumulation order and output rounding differ.
std::vector<OpCase> fp8_cases() {
  std::vector<OpCase> cases;
  struct P {
    int64_t M, N, K;
    DType a_format;
    bool fp32_out;
    float beta;
  };
  for (const P& p : std::vector<P>{{64, 48, 32, DType::E4M3, false, 0},
                                   {256, 160, 320, DType::E4M3, false, 1},   // forward + residual
                                   {128, 96, 256, DType::E5M2, false, 0},    // dgrad (e5m2 dY)
                                   {96, 208, 512, DType::E5M2, true, 1}}) {  // wgrad, fp32 +=
    OpCase c;
    c.name = fmt::format("fp8_cast_transpose+fp8_update_scales+matmul_fp8 M{} N{} K{} {}{}{}", p.M,
                         p.N, p.K, dtype_name(p.a_format), p.fp32_out ? " fp32-out" : "",
                         p.beta ? " beta" : "");
    const Kind out_kind = p.fp32_out ? Kind::F32 : Kind::Act;
    c.specs = {{"a", {p.M, p.K}, Kind::Act, Role::In, 0.5f},
               {"wt", {p.K, p.N}, Kind::Act, Role::In, 0.05f},
               {"out",
                {p.M, p.N},
                out_kind,
                p.beta ? Role::Accum : Role::Out,
                1.0f,
                0,
                1,
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
        if (i == 0)
          b.fp8_cast_transpose(Fp8CastArgs{src, qa, {}, scale, {}});
        else
          b.fp8_cast_transpose(Fp8CastArgs{src, {}, qb, scale, {}});  // wt (K, N) -> (N, K)
      }
      Fp8MatmulArgs m;
      m.out = t.at("out"), m.a = qa, m.b = qb, m.a_scale_inv = inv[0], m.b_scale_inv = inv[1];
      m.beta = p.beta;
      b.matmul_fp8(m);
    };
    cases.push_back(c);
  }
  // Blockwise scaling (fp8_recipe blockwise), the three GEMMs of an FP8 linear as the model runs
  // them: fprop x (1x128 tiles) by W (128x128 blocks), dgrad dY (e5m2, 1x128) by W^T (the
  // blocks transposed, from the cast's second output), wgrad dY^T by X^T, both cast
  // transposed in tiles along the tokens, accumulated into fp32. Codes and scales are exact
  // fp32 arithmetic (core/fp8.h), so every backend sees the same ones. Sizes are whole blocks
  // (what the GEMMs take) with more than one block along each dimension.
  enum class Gemm { Fprop, Dgrad, Wgrad };
  for (Gemm g : {Gemm::Fprop, Gemm::Dgrad, Gemm::Wgrad}) {
    const int64_t M = 256, N = 384, K = 512;
    OpCase c;
    const bool wgrad = g == Gemm::Wgrad;
    c.name = fmt::format("fp8_block_cast+matmul_fp8 M{} N{} K{} {}", M, N, K,
                         g == Gemm::Fprop   ? "fprop 1x128 x 128x128 +residual"
                         : g == Gemm::Dgrad ? "dgrad e5m2 1x128 x 128x128(transposed)"
                                            : "wgrad 1x128 x 1x128 (both transposed) fp32 +=");
    // The operands as the model holds them: fprop x (M, K) and W (N, K); dgrad dY (M, K) and
    // W (K, N); wgrad dY (K, M) and X (K, N), K being the tokens.
    const Shape a_shape = wgrad ? Shape{K, M} : Shape{M, K};
    const Shape b_shape = g == Gemm::Fprop ? Shape{N, K} : Shape{K, N};
    c.specs = {{"a", a_shape, Kind::Act, Role::In, 0.5f},
               {"b", b_shape, Kind::Act, Role::In, 0.05f},
               {"out",
                {M, N},
                wgrad ? Kind::F32 : Kind::Act,
                g == Gemm::Dgrad ? Role::Out : Role::Accum,
                1.0f,
                0,
                1,
                wgrad ? 1e-3 : 1e-2}};
    c.run = [g, M, N, K, wgrad](Backend& b, const Tensors& t) {
      const DType a_format = g == Gemm::Fprop ? DType::E4M3 : DType::E5M2;
      const Fp8Scaling b_scaling = wgrad ? Fp8Scaling::Tile1x128 : Fp8Scaling::Block128x128;
      const int64_t na = fp8_scale_count(Fp8Scaling::Tile1x128, M, K);
      const int64_t nb = fp8_scale_count(b_scaling, N, K);
      DeviceBuffer codes(b, M * K + N * K + 1024, "fp8 codes");
      DeviceBuffer scales(b, 4 * (na + nb) + 1024, "fp8 block scales");
      const Tensor qa = codes.tensor(a_format, {M, K});
      const Tensor qb = codes.tensor(DType::E4M3, {N, K}, (M * K + 255) / 256 * 256);
      const Tensor sa = scales.tensor(DType::F32, {na});
      const Tensor sb = scales.tensor(DType::F32, {nb}, (4 * na + 255) / 256 * 256);
      Fp8BlockCastArgs ca;
      ca.x = t.at("a");
      ca.scaling = Fp8Scaling::Tile1x128;
      (wgrad ? ca.out_t : ca.out) = qa;
      (wgrad ? ca.out_t_scale_inv : ca.out_scale_inv) = sa;
      b.fp8_block_cast(ca);
      Fp8BlockCastArgs cb;
      cb.x = t.at("b");
      cb.scaling = b_scaling;
      (g == Gemm::Fprop ? cb.out : cb.out_t) = qb;
      (g == Gemm::Fprop ? cb.out_scale_inv : cb.out_t_scale_inv) = sb;
      b.fp8_block_cast(cb);
      Fp8MatmulArgs m;
      m.out = t.at("out"), m.a = qa, m.b = qb, m.a_scale_inv = sa, m.b_scale_inv = sb;
      m.a_scaling = Fp8Scaling::Tile1x128;
      m.b_scaling = b_scaling;
      m.beta = g == Gemm::Dgrad ? 0.0f : 1.0f;
      b.matmul_fp8(m);
    };
    cases.push_back(c);
  }
  return cases;
}

// fp8_grouped_cast as the MoE block's FP8 experts run it. Its codes are exact (fp32 x * scale,
// rounded once), so each backend must write the reference's codes: they come back as ints (the
// code bytes) and are compared one by one. The codes sit in a buffer pre-filled with a pattern
// of finite codes, with 256 bytes on either side, all compared: a code the op leaves unwritten,
// or one it writes where it must not (padding rows past the groups, outside the outputs), shows.
struct GroupedCastCase {
  std::vector<int32_t> sizes;           // rows per group (offsets), or
  int64_t experts = 0, group_rows = 0;  // experts x group_rows rows (group_rows)
  int64_t padding = 0;                  // rows past the groups (offsets only)
  int64_t C = 0;
  DType format = DType::E4M3;
  bool out = true, out_t = true, amax = true;
  std::string what;
};

OpCase fp8_grouped_cast_case(const GroupedCastCase& p) {
  std::vector<int32_t> offsets = {0};
  for (int32_t size : p.sizes) offsets.push_back(offsets.back() + size);
  const bool by_offsets = p.group_rows == 0;
  const int64_t G = by_offsets ? static_cast<int64_t>(p.sizes.size()) : p.experts;
  const int64_t R = by_offsets ? offsets.back() + p.padding : p.experts * p.group_rows, C = p.C;
  // Activations have one scale and one amax, an expert stack one of each per expert.
  const int64_t scales = by_offsets ? 1 : G;
  constexpr int64_t kMargin = 256;
  const int64_t n = R * C, span = n + 2 * kMargin;
  OpCase c;
  c.name = fmt::format("fp8_grouped_cast {} R{} C{} {}{}{}{} {}",
                       by_offsets ? fmt::format("G{}", G) : fmt::format("E{}x{}", G, p.group_rows),
                       R, C, dtype_name(p.format), p.out ? " out" : "", p.out_t ? " out_t" : "",
                       p.amax ? " amax" : "", p.what);
  // Scales up to ~1000 for |x| ~ 0.5: some e4m3 codes saturate.
  c.specs = {{"x", {R, C}, Kind::Act, Role::In, 0.5f},
             {"scale", {scales}, Kind::F32, Role::In, 300.0f, 0, 1, 2e-2, true}};
  if (p.amax)  // pre-filled below most groups' |x|: the max must both keep and replace it
    c.specs.push_back({"amax", {scales}, Kind::F32, Role::Accum, 0.2f, 0, 1, 1e-9, true});
  if (p.out) c.specs.push_back({"codes", {span}, Kind::I32, Role::Out});
  if (p.out_t) c.specs.push_back({"codes_t", {span}, Kind::I32, Role::Out});
  c.run = [=](Backend& b, const Tensors& t) {
    DeviceBuffer buf(b, offsets.size() * 4 + 2 * span + 1024, "offsets and codes");
    std::vector<uint8_t> pattern(static_cast<size_t>(span));
    for (int64_t i = 0; i < span; ++i) pattern[i] = static_cast<uint8_t>((i * 37 + 11) % 0x70);
    const size_t codes_at = (offsets.size() * 4 + 255) / 256 * 256;
    const Tensor around[2] = {buf.tensor(p.format, {span}, codes_at),
                              buf.tensor(p.format, {span}, codes_at + (span + 255) / 256 * 256)};
    for (const Tensor& a : around) b.upload(a, pattern.data());
    Fp8GroupedCastArgs g;
    g.x = t.at("x");
    if (by_offsets) {
      g.offsets = buf.tensor(DType::I32, {G + 1});
      b.upload(g.offsets, offsets.data());
    } else {
      g.group_rows = p.group_rows;
    }
    if (p.out) g.out = around[0].flat_range(kMargin, n).view({R, C});
    if (p.out_t) g.out_t = around[1].flat_range(kMargin, n);
    g.scale = t.at("scale");
    if (p.amax) g.amax = t.at("amax");
    b.fp8_grouped_cast(g);
    for (int k = 0; k < 2; ++k) {
      const char* name = k == 0 ? "codes" : "codes_t";
      if (!t.contains(name)) continue;
      std::vector<uint8_t> codes(static_cast<size_t>(span));
      b.download(codes.data(), around[k]);
      const std::vector<int32_t> ints(codes.begin(), codes.end());
      b.upload(t.at(name), ints.data());
    }
    b.synchronize();
  };
  return c;
}

std::vector<OpCase> fp8_grouped_cast_cases() {
  std::vector<OpCase> cases;
  using P = GroupedCastCase;
  const DType e4m3 = DType::E4M3, e5m2 = DType::E5M2;
  for (const P& p : std::vector<P>{
           // Activations: groups of multiples of 16 rows (moe_permute's padding), empty groups,
           // padding rows past them; the output gradient in e5m2, the input's transposed
           // re-cast alone, an amax pass alone (scaling just in time).
           {{48, 0, 16, 112, 0, 32}, 0, 0, 16, 80, e4m3, true, false, true, "with empty groups"},
           {{48, 0, 16, 112, 0, 32}, 0, 0, 16, 80, e5m2, true, true, true, "with empty groups"},
           {{48, 0, 16, 112, 0, 32}, 0, 0, 16, 80, e4m3, false, true, false, "with empty groups"},
           {{48, 0, 16, 112, 0, 32}, 0, 0, 16, 80, e4m3, false, false, true, "with empty groups"},
           {{0, 0, 208, 0}, 0, 0, 32, 32, e5m2, true, true, true, "all rows in one group"},
           // Odd sizes and widths: transposed runs that cross groups, unaligned rows.
           {{3, 0, 17, 1, 0, 9, 130}, 0, 0, 5, 37, e4m3, true, true, true, "odd group sizes"},
           {{0, 0, 0}, 0, 0, 7, 24, e4m3, true, true, true, "no rows in any group"},
           // DeepSeek-V2-Lite's 64 experts at 128 rows each (its hidden size 2048): GPU-sized.
           {std::vector<int32_t>(64, 128), 0, 0, 64, 2048, e5m2, true, true, true, "64 experts"},
           // Expert stacks: one scale and amax per expert; codes, their transposes, or each.
           {{}, 5, 48, 0, 80, e4m3, true, true, true, "expert stack"},
           {{}, 5, 48, 0, 80, e4m3, true, false, false, "expert stack"},
           {{}, 5, 48, 0, 80, e4m3, false, true, false, "expert stack"},
           {{}, 5, 48, 0, 80, e4m3, false, false, true, "expert stack"},
           {{}, 3, 7, 0, 13, e4m3, true, true, true, "odd expert stack"},
           {{}, 4, 200, 0, 96, e4m3, true, true, true, "experts spanning tiles"}})
    cases.push_back(fp8_grouped_cast_case(p));
  return cases;
}

// Gradients kept in bf16 (main_grads_dtype bf16): every op that adds into a gradient adds its
// fp32 result into the bf16 values and rounds once; the norm reads bf16.
std::vector<OpCase> bf16_gradient_cases() {
  std::vector<OpCase> cases;
  OpCase w;
  w.name = "matmul M96 N200 K333 TN beta bf16-grad";  // dW += dY^T X into a bf16 gradient
  w.specs = {{"dy", {333, 96}, Kind::Act, Role::In, 0.5f},
             {"x", {333, 200}, Kind::Act, Role::In, 0.5f},
             {"dw", {96, 200}, Kind::BF16, Role::Accum, 1.0f, 0, 1, 1e-2}};
  w.run = [](Backend& b, const Tensors& t) {
    MatmulArgs m;
    m.out = t.at("dw");
    m.a = t.at("dy");
    m.trans_a = true;
    m.b = t.at("x");
    m.beta = 1.0f;
    b.matmul(m);
  };
  cases.push_back(w);
  OpCase bias;
  bias.name = "bias_backward M333 N200 bf16-grad";
  bias.specs = {{"dout", {333, 200}, Kind::Act},
                {"dbias", {200}, Kind::BF16, Role::Accum, 1, 0, 1, 1e-2}};
  bias.run = [](Backend& b, const Tensors& t) { b.bias_backward(t.at("dbias"), t.at("dout")); };
  cases.push_back(bias);
  OpCase norm;
  norm.name = "rmsnorm_backward N257 C320 bf16-grad";
  norm.specs = {{"x", {257, 320}},
                {"w", {320}, Kind::Act, Role::In, 0.5f},
                {"dout", {257, 320}},
                {"rstd", {257}, Kind::F32, Role::Out, 1, 0, 1, 1e-5},
                {"y", {257, 320}, Kind::Act, Role::Out, 1, 0, 1, 1e-2},
                {"dx", {257, 320}, Kind::Act, Role::Accum, 1, 0, 1, 2e-2},
                {"dw", {320}, Kind::BF16, Role::Accum, 1, 0, 1, 1e-2}};
  norm.run = [](Backend& b, const Tensors& t) {
    b.rmsnorm_forward(t.at("y"), t.at("rstd"), t.at("x"), t.at("w"), 1e-5f);
    b.rmsnorm_backward(t.at("dx"), t.at("dw"), t.at("dout"), t.at("x"), t.at("w"), t.at("rstd"));
  };
  cases.push_back(norm);
  OpCase emb;
  emb.name = "embedding_backward V1000 N333 C72 bf16-grad";
  emb.specs = {{"tokens", {333}, Kind::I32, Role::In, 1, 0, 1000},
               {"dout", {333, 72}},
               {"dtable", {1000, 72}, Kind::BF16, Role::Accum, 1, 0, 1, 1e-2}};
  emb.run = [](Backend& b, const Tensors& t) {
    b.embedding_backward(t.at("dtable"), t.at("dout"), t.at("tokens"));
  };
  cases.push_back(emb);
  OpCase shard;
  shard.name = "embedding_shard_backward V250 of 1000 first 500 N333 C72 bf16-grad";
  shard.specs = {{"tokens", {333}, Kind::I32, Role::In, 1, 0, 1000},
                 {"dout", {333, 72}},
                 {"dtable", {250, 72}, Kind::BF16, Role::Accum, 1, 0, 1, 1e-2}};
  shard.run = [](Backend& b, const Tensors& t) {
    b.embedding_shard_backward(t.at("dtable"), t.at("dout"), t.at("tokens"), 500);
  };
  cases.push_back(shard);
  for (int64_t n : {int64_t{1000}, int64_t{12345677}}) {
    OpCase sq;
    sq.name = fmt::format("sum_squares n{} bf16 accumulate", n);
    sq.specs = {{"x", {n}, Kind::BF16}, {"out", {1}, Kind::F32, Role::Accum, 1, 0, 1, 1e-5}};
    sq.run = [](Backend& b, const Tensors& t) { b.sum_squares(t.at("out"), t.at("x"), true); };
    cases.push_back(sq);
  }
  return cases;
}

// fill, convert and init_normal are exact: bit for bit on every backend.
std::vector<OpCase> init_and_conversion_cases() {
  std::vector<OpCase> cases;
  OpCase fill;
  fill.name = "fill n100003";
  fill.specs = {{"x", {100003}, Kind::Act, Role::Out, 1, 0, 1, 0}};
  fill.run = [](Backend& b, const Tensors& t) { b.fill(t.at("x"), -2.5f); };  // exact in bf16
  cases.push_back(fill);
  OpCase convert;
  convert.name = "convert n100003 fp32-bf16-fp32";
  convert.specs = {{"x", {100003}, Kind::F32, Role::In, 100.0f},
                   {"half", {100003}, Kind::BF16, Role::Out, 1, 0, 1, 0},
                   {"back", {100003}, Kind::F32, Role::Out, 1, 0, 1, 0}};
  convert.run = [](Backend& b, const Tensors& t) {
    b.convert(t.at("half"), t.at("x"));
    b.convert(t.at("back"), t.at("half"));
  };
  cases.push_back(convert);
  // The two halves of a split master, and the fp32 values joined from them (on the host) that
  // must be the input's, bit for bit.
  OpCase split;
  split.name = "split_master n100003";
  split.specs = {{"x", {100003}, Kind::F32, Role::In, 100.0f},
                 {"high", {100003}, Kind::BF16, Role::Out, 1, 0, 1, 0},
                 {"joined", {100003}, Kind::F32, Role::Out, 1, 0, 1, 0}};
  split.run = [](Backend& b, const Tensors& t) {
    const int64_t n = t.at("x").numel();
    DeviceBuffer lb(b, static_cast<size_t>(n) * 2, "low halves");
    const Tensor low = lb.tensor(DType::U16, {n});
    b.split_master(t.at("high"), low, t.at("x"));
    b.upload(t.at("joined"), joined_master(b, t.at("high"), low).data());
  };
  cases.push_back(split);
  OpCase init;
  init.name = "init_normal n1000003 first_index 1234";
  init.specs = {{"x", {1000003}, Kind::F32, Role::Out, 1, 0, 1, 0}};
  init.run = [](Backend& b, const Tensors& t) { b.init_normal(t.at("x"), 77, 1234, 0.1f, 0.02f); };
  cases.push_back(init);
  return cases;
}

// QK norm (Qwen3): every query and key head normalised, value heads copied; the backward
// into its own tensor and in place over dout.
std::vector<OpCase> qk_norm_cases() {
  std::vector<OpCase> cases;
  for (const AttentionShape& s :
       {attn(2, 13, 4, 2, 64, 0), attn(1, 33, 6, 3, 36, 0), attn(1, 8192, 32, 4, 128, 0)}) {
    for (bool in_place : {false, true}) {
      const int64_t N = s.tokens(), W = s.qkv_width(), D = s.head_dim;
      OpCase c;
      c.name = fmt::format("qk_norm_forward+backward N{} H{} KV{} D{}{}", N, s.heads, s.kv_heads, D,
                           in_place ? " in place" : "");
      c.specs = {{"qkv", {N, W}},
                 {"qw", {D}, Kind::Act, Role::In, 0.5f},
                 {"kw", {D}, Kind::Act, Role::In, 0.5f},
                 {"out", {N, W}, Kind::Act, Role::Out, 1, 0, 1, 1e-2},
                 {"rstd", {N, s.heads + s.kv_heads}, Kind::F32, Role::Out, 1, 0, 1, 1e-4},
                 {"dout", {N, W}, Kind::Act, in_place ? Role::InOut : Role::In, 1, 0, 1, 2e-2},
                 {"dqw", {D}, Kind::F32, Role::Accum, 1, 0, 1, 1e-3},
                 {"dkw", {D}, Kind::F32, Role::Accum, 1, 0, 1, 1e-3}};
      if (!in_place) c.specs.push_back({"dqkv", {N, W}, Kind::Act, Role::Out, 1, 0, 1, 2e-2});
      c.run = [s, in_place](Backend& b, const Tensors& t) {
        b.qk_norm_forward(t.at("out"), t.at("rstd"), t.at("qkv"), t.at("qw"), t.at("kw"), s, 1e-6f);
        b.qk_norm_backward(in_place ? t.at("dout") : t.at("dqkv"), t.at("dqw"), t.at("dkw"),
                           t.at("dout"), t.at("qkv"), t.at("qw"), t.at("kw"), t.at("rstd"), s);
      };
      cases.push_back(c);
    }
  }
  return cases;
}

// A routing as the op API takes it.
MoeRouting routing(int64_t E, int64_t K, bool sigmoid = false, bool pre_softmax = false,
                   int64_t groups = 0, int64_t group_topk = 0, float scaling = 0.0f,
                   bool force_balance = false) {
  MoeRouting r;
  r.experts = E, r.topk = K, r.sigmoid = sigmoid, r.pre_softmax = pre_softmax;
  r.num_groups = groups, r.group_topk = group_topk, r.scaling = scaling;
  r.force_balance = force_balance;
  return r;
}

std::string routing_name(const MoeRouting& r) {
  return fmt::format("E{} K{} {}{}{}{}{}", r.experts, r.topk, r.sigmoid ? "sigmoid" : "softmax",
                     r.pre_softmax ? " pre" : "",
                     r.num_groups ? fmt::format(" groups{}/{}", r.group_topk, r.num_groups) : "",
                     r.scaling != 0.0f ? fmt::format(" scale{}", r.scaling) : "",
                     r.force_balance ? " force-balance" : "");
}

// The router, forward then backward (the backward reads the forward's choices), with the
// expert bias where the scores are sigmoids; `hot_expert` >= 0 biases every token onto it.
OpCase router_case(int64_t N, const MoeRouting& r, int hot_expert = -1) {
  const int64_t E = r.experts, K = r.topk;
  OpCase c;
  c.name = fmt::format("moe_router_forward+backward N{} {}{}", N, routing_name(r),
                       hot_expert >= 0 ? fmt::format(" all to expert {}", hot_expert) : "");
  c.specs = {{"logits", {N, E}, Kind::Act, Role::In, 1.5f},
             {"indices", {N, K}, Kind::I32, Role::Out},
             {"weights", {N, K}, Kind::F32, Role::Out, 1, 0, 1, 1e-4},
             {"dweights", {N, K}, Kind::F32, Role::In},
             {"dlogits", {N, E}, Kind::F32, Role::Out, 1, 0, 1, 1e-4}};
  const bool bias = r.sigmoid;
  if (bias) c.specs.push_back({"bias", {E}, Kind::F32, Role::In, 0.1f});
  c.run = [r, bias, hot_expert, E](Backend& b, const Tensors& t) {
    Tensor expert_bias = bias ? t.at("bias") : Tensor{};
    DeviceBuffer hot(b, static_cast<size_t>(E) * 4, "hot expert bias");
    if (hot_expert >= 0) {  // a bias no score can overcome: every token's first choice
      std::vector<float> v(static_cast<size_t>(E), 0.0f);
      v[static_cast<size_t>(hot_expert)] = 10.0f;
      expert_bias = hot.tensor(DType::F32, {E});
      b.upload(expert_bias, v.data());
    }
    b.moe_router_forward(t.at("indices"), t.at("weights"), t.at("logits"), expert_bias, r);
    b.moe_router_backward(t.at("dlogits"), t.at("dweights"), t.at("logits"), t.at("indices"), r);
    b.synchronize();
  };
  return c;
}

// Random routing slots (N, K) over experts [lo, hi): the other experts get no token.
Spec slots(const char* name, int64_t N, int64_t K, int lo, int hi) {
  return {name, {N, K}, Kind::I32, Role::In, 1, lo, hi};
}

OpCase aux_loss_case(int64_t N, const MoeRouting& r, int64_t seq) {
  const int64_t E = r.experts, K = r.topk;
  OpCase c;
  c.name = fmt::format("moe_aux_loss N{} {} {}", N, routing_name(r),
                       seq ? fmt::format("seq_aux seq{}", seq) : "aux");
  c.specs = {{"logits", {N, E}, Kind::Act, Role::In, 1.5f},
             slots("indices", N, K, 0, static_cast<int>(E)),
             {"loss", {1}, Kind::F32, Role::Accum, 1, 0, 1, 1e-4},
             {"dlogits", {N, E}, Kind::F32, Role::Accum, 1, 0, 1, 1e-5}};
  c.run = [r, seq](Backend& b, const Tensors& t) {
    MoeAuxLossArgs a;
    a.logits = t.at("logits"), a.indices = t.at("indices"), a.routing = r, a.seq = seq;
    a.loss = t.at("loss"), a.dlogits = t.at("dlogits"), a.grad_scale = 3.0f;
    b.moe_aux_loss(a);
  };
  return c;
}

// Dispatch, combine and both backwards, in a layer's order: permute x, combine stand-in
// expert outputs yp with the routing weights, then the gradients back. lo/hi: the experts the
// slots may use (the others stay empty). capacity > 0: token dropping (by the weights, or by
// position), in a buffer sized for it.
OpCase permute_case(int64_t N, int64_t K, int64_t E, int64_t C, int64_t align, int lo, int hi,
                    int64_t capacity = 0, bool by_position = false) {
  const int64_t kept = capacity > 0 ? std::min(N * K, E * capacity) : N * K;
  const int64_t R = kept + E * (align - 1) + 5;  // 5 rows more than any routing can use
  OpCase c;
  c.name = fmt::format(
      "moe_permute+moe_unpermute+moe_unpermute_backward+moe_permute_backward N{} K{} E{} C{} "
      "align{} experts[{},{}){}",
      N, K, E, C, align, lo, hi,
      capacity > 0
          ? fmt::format(" capacity {} by {}", capacity, by_position ? "position" : "weight")
          : "");
  c.specs = {{"x", {N, C}},
             slots("indices", N, K, lo, hi),
             {"xp", {R, C}, Kind::Act, Role::Out, 1, 0, 1, 1e-6},
             {"rows", {N, K}, Kind::I32, Role::Out},
             {"offsets", {E + 1}, Kind::I32, Role::Out},
             {"yp", {R, C}},
             {"weights", {N, K}, Kind::F32, Role::In, 0.5f, 0, 1, 2e-2, /*positive=*/true},
             {"out", {N, C}, Kind::Act, Role::Accum, 1, 0, 1, 2e-2},
             {"dout", {N, C}},
             {"dyp", {R, C}, Kind::Act, Role::Out, 1, 0, 1, 1e-2},
             {"dweights", {N, K}, Kind::F32, Role::Out, 1, 0, 1, 2e-2},
             {"dxp", {R, C}},
             {"dx", {N, C}, Kind::Act, Role::Accum, 1, 0, 1, 2e-2}};
  if (capacity > 0) c.specs.push_back({"dropped", {1}, Kind::F32, Role::Out, 1, 0, 1, 1e-6});
  c.run = [align, capacity, by_position](Backend& b, const Tensors& t) {
    MoeCapacity cap;
    cap.capacity = capacity, cap.by_position = by_position, cap.weights = t.at("weights");
    if (capacity > 0) cap.dropped = t.at("dropped");
    b.moe_permute(t.at("xp"), t.at("rows"), t.at("offsets"), t.at("x"), t.at("indices"), align,
                  cap);
    b.moe_unpermute(t.at("out"), t.at("yp"), t.at("rows"), t.at("weights"));
    b.moe_unpermute_backward(t.at("dyp"), t.at("dweights"), t.at("dout"), t.at("yp"), t.at("rows"),
                             t.at("weights"));
    b.moe_permute_backward(t.at("dx"), t.at("dxp"), t.at("rows"));
  };
  return c;
}

// Grouped GEMMs over groups of the given sizes: forward (b transposed or not), and the weight
// gradient accumulating (beta 1) or overwriting; given the offsets on the host too, or only on
// the device (where the backend reads them there, or copies them).
std::vector<OpCase> grouped_matmul_cases(const std::vector<int32_t>& sizes, int64_t N, int64_t K,
                                         const std::string& what,
                                         const std::vector<int32_t>& weights = {},
                                         int64_t num_weights = 0, bool host_offsets = true) {
  const int64_t G = static_cast<int64_t>(sizes.size());
  const int64_t W = weights.empty() ? G : num_weights;
  std::vector<int32_t> offsets = {0};
  for (int32_t size : sizes) offsets.push_back(offsets.back() + size);
  const int64_t R = offsets.back() + 7;  // rows past the groups: zeroed by the forward
  const int64_t used = offsets.back();
  auto upload_offsets = [offsets](Backend& b, DeviceBuffer& buf) {
    const Tensor t = buf.tensor(DType::I32, {static_cast<int64_t>(offsets.size())});
    b.upload(t, offsets.data());
    return t;
  };
  std::vector<OpCase> cases;
  for (bool trans_b : {true, false}) {
    OpCase c;
    c.name = fmt::format("grouped_matmul G{} rows{} N{} K{} {} {}", G, used, N, K,
                         trans_b ? "NT" : "NN", what);
    c.specs = {{"a", {R, K}, Kind::Act, Role::In, 0.5f},
               {"b", trans_b ? Shape{W, N, K} : Shape{W, K, N}, Kind::Act, Role::In, 0.5f},
               {"out", {R, N}, Kind::Act, Role::Out, 1, 0, 1, 1e-2}};
    c.run = [=](Backend& b, const Tensors& t) {
      DeviceBuffer buf(b, offsets.size() * 4, "offsets");
      GroupedMatmulArgs g;
      g.out = t.at("out"), g.a = t.at("a"), g.b = t.at("b"), g.trans_b = trans_b;
      g.offsets = upload_offsets(b, buf);
      if (host_offsets) g.host_offsets = offsets;
      g.group_weights = weights;
      b.grouped_matmul(g);
      b.synchronize();
    };
    cases.push_back(c);
  }
  // Weight gradients overwritten, added to, and added to in bf16 (main_grads_dtype bf16).
  for (const auto& [beta, out_kind] :
       {std::pair{0.0f, Kind::F32}, std::pair{1.0f, Kind::F32}, std::pair{1.0f, Kind::BF16}}) {
    OpCase c;
    c.name =
        fmt::format("grouped_matmul_wgrad G{} rows{} M{} N{}{}{} {}", G, used, N, K,
                    beta != 0 ? " beta1" : "", out_kind == Kind::BF16 ? " bf16-grad" : "", what);
    c.specs = {{"a", {R, N}, Kind::Act, Role::In, 0.5f},
               {"b", {R, K}, Kind::Act, Role::In, 0.5f},
               {"out", {W, N, K}, out_kind, beta != 0 ? Role::Accum : Role::Out, 1, 0, 1, 1e-2}};
    c.run = [=, beta_ = beta](Backend& b, const Tensors& t) {
      DeviceBuffer buf(b, offsets.size() * 4, "offsets");
      GroupedMatmulWgradArgs g;
      g.out = t.at("out"), g.a = t.at("a"), g.b = t.at("b"), g.beta = beta_;
      g.offsets = upload_offsets(b, buf);
      if (host_offsets) g.host_offsets = offsets;
      g.group_weights = weights;
      b.grouped_matmul_wgrad(g);
      b.synchronize();
    };
    cases.push_back(c);
  }
  return cases;
}

// Tensorwise FP8 codes of src into `codes` as the model casts them: the scale from src's amax
// into scale_inv; out_t: the transposed layout (C, R) instead.
void cast_fp8_tensorwise(Backend& b, DeviceBuffer& state, size_t at, const Tensor& src,
                         const Tensor& codes, const Tensor& scale_inv, bool transposed = false) {
  const Tensor amax = state.tensor(DType::F32, {1, 1}, at);
  const Tensor scale = state.tensor(DType::F32, {1}, at + 256);
  b.fill(amax, 0.0f);
  b.fp8_cast_transpose(Fp8CastArgs{src, {}, {}, {}, amax.view({1})});
  Fp8ScaleUpdateArgs u;
  u.amax_history = amax, u.scale = scale, u.scale_inv = scale_inv;
  u.fp8_max = fp8_max(codes.dtype);
  u.most_recent = true, u.roll = false;
  b.fp8_update_scales(u);
  b.fp8_cast_transpose(
      Fp8CastArgs{src, transposed ? Tensor{} : codes, transposed ? codes : Tensor{}, scale, {}});
}

// A scale given, as delayed scaling gives it, in the first two slots of `state`: the scale at
// byte 0 and its inverse (the GEMMs') at 256.
struct GivenScale {
  Tensor scale, scale_inv;
};
GivenScale given_scale(Backend& b, const DeviceBuffer& state, float scale) {
  const GivenScale g{state.tensor(DType::F32, {1}), state.tensor(DType::F32, {1}, 256)};
  const float inv = 1.0f / scale;
  b.upload(g.scale, &scale);
  b.upload(g.scale_inv, &inv);
  return g;
}

// A *_forward_cast op as an FP8 linear's forward runs it: the producer writes its output
// `y` (M, K) and y's codes in one pass, the codes then multiplied by the weight's (cast
// tensorwise) when N > 0. The scale is given, as delayed scaling gives it. The GPU casts y as
// stored (bf16), the reference its fp32 value, so a few codes in a hundred land one FP8 step
// apart: the product's tolerance is 3e-2. K not a multiple of 8 takes the kernels' element
// path; the GEMM needs multiples of 16, so that case checks y and the amax only. y_tol: the
// producer's own tolerance.
OpCase forward_cast_case(const std::string& name, int64_t M, int64_t K, int64_t N,
                         std::vector<Spec> inputs,
                         std::function<void(Backend&, const Tensors&, const Fp8CastArgs&)> produce,
                         double y_tol = 1e-2) {
  OpCase c;
  c.name = fmt::format("{}{} M{} K{}{}", name, N ? "+matmul_fp8" : "", M, K,
                       N ? fmt::format(" N{}", N) : std::string());
  c.specs = std::move(inputs);
  c.specs.push_back({"y", {M, K}, Kind::Act, Role::Out, 1.0f, 0, 1, y_tol});
  // A small start, below max |y|: the op max-es into it.
  c.specs.push_back({"amax", {1}, Kind::F32, Role::InOut, 0.01f, 0, 1, 1e-2, true});
  if (N) {
    c.specs.push_back({"w", {N, K}, Kind::Act, Role::In, 0.05f});
    c.specs.push_back({"out", {M, N}, Kind::Act, Role::Out, 1.0f, 0, 1, 3e-2});
  }
  c.run = [M, K, N, produce](Backend& b, const Tensors& t) {
    DeviceBuffer codes(b, K * (M + N) + 1024, "fp8 codes");
    DeviceBuffer state(b, 8 * 256, "fp8 scales");
    const GivenScale y_scale = given_scale(b, state, 16.0f);
    Fp8CastArgs y;
    y.out = codes.tensor(DType::E4M3, {M, K});
    y.scale = y_scale.scale;
    y.amax = t.at("amax");
    produce(b, t, y);
    if (!N) return;
    const Tensor w = codes.tensor(DType::E4M3, {N, K}, (M * K + 255) / 256 * 256);
    const Tensor w_inv = state.tensor(DType::F32, {1}, 512);
    cast_fp8_tensorwise(b, state, 1024, t.at("w"), w, w_inv);
    Fp8MatmulArgs m;
    m.out = t.at("out"), m.a = y.out, m.b = w, m.a_scale_inv = y_scale.scale_inv;
    m.b_scale_inv = w_inv;
    b.matmul_fp8(m);
  };
  return c;
}

// The SwiGLU writing the down projection's codes, the pre-norm the QKV or gate_up
// projection's, and attention the output projection's (causal over a partial last tile of the
// warpgroup forward, and full attention over two sequences).
std::vector<OpCase> forward_cast_cases() {
  std::vector<OpCase> cases;
  struct P {
    int64_t M, K, N;
  };
  for (const P& p : std::vector<P>{{208, 112, 48}, {67, 36, 0}}) {
    cases.push_back(forward_cast_case("swiglu_forward_cast", p.M, p.K, p.N,
                                      {{"gate_up", {p.M, 2 * p.K}, Kind::Act, Role::In, 1.5f}},
                                      [](Backend& b, const Tensors& t, const Fp8CastArgs& y) {
                                        b.swiglu_forward_cast(t.at("y"), t.at("gate_up"), y);
                                      }));
  }
  for (const P& p : std::vector<P>{{144, 320, 96}, {33, 100, 0}, {48, 4096, 32}, {32, 5120, 32}}) {
    cases.push_back(forward_cast_case("rmsnorm_forward_cast", p.M, p.K, p.N,
                                      {{"x", {p.M, p.K}},
                                       {"norm_w", {p.K}, Kind::Act, Role::In, 0.5f},
                                       {"rstd", {p.M}, Kind::F32, Role::Out, 1, 0, 1, 1e-5}},
                                      [](Backend& b, const Tensors& t, const Fp8CastArgs& y) {
                                        b.rmsnorm_forward_cast(t.at("y"), t.at("rstd"), t.at("x"),
                                                               t.at("norm_w"), 1e-5f, y);
                                      }));
  }
  AttentionShape fp8 = attn(1, 208, 4, 2, 128, 0);
  fp8.fp8 = true;
  for (const AttentionShape& a :
       {attn(1, 208, 4, 2, 128, 0), attn(2, 72, 4, 2, 128, 0, false), fp8}) {
    cases.push_back(forward_cast_case(
        fmt::format("{}attention_forward_cast{}", a.fp8 ? "fp8_" : "", a.causal ? "" : " full"),
        a.tokens(), a.out_width(), 64,
        {{"qkv", {a.tokens(), a.qkv_width()}},
         {"lse", {a.batch, a.heads, a.seq}, Kind::F32, Role::Out, 1, 0, 1, 1e-3}},
        [a](Backend& b, const Tensors& t, const Fp8CastArgs& y) {
          b.attention_forward_cast(t.at("y"), t.at("lse"), t.at("qkv"), a, y);
        },
        2e-2));
  }
  return cases;
}

// swiglu_backward_cast as the gate_up projection's backward runs it: the gradient's codes in
// both layouts, then the data gradient's GEMM from the row-major codes and the weight
// gradient's from the transposed ones (x cast transposed). The gradient itself is never compared:
// the op may leave it unwritten. The GPU casts the bf16 gradient, the reference its fp32 value:
// tolerance 3e-2, as for the forward folds.
std::vector<OpCase> swiglu_backward_cast_cases() {
  const int64_t M = 144, F = 64, N = 48, C = 32;
  OpCase c;
  c.name = fmt::format("swiglu_backward_cast+matmul_fp8 M{} F{} N{} C{}", M, F, N, C);
  c.specs = {{"gate_up", {M, 2 * F}, Kind::Act, Role::In, 1.5f},
             {"dh", {M, F}, Kind::Act, Role::In, 0.05f},
             {"w", {N, 2 * F}, Kind::Act, Role::In, 0.05f},
             {"x", {M, C}},
             {"amax", {1}, Kind::F32, Role::InOut, 1e-4f, 0, 1, 1e-2, true},
             {"dx", {M, N}, Kind::Act, Role::Out, 1.0f, 0, 1, 3e-2},
             {"dw", {2 * F, C}, Kind::Act, Role::Out, 1.0f, 0, 1, 3e-2}};
  c.run = [=](Backend& b, const Tensors& t) {
    DeviceBuffer scratch(b, M * 2 * F * dtype_size(t.at("gate_up").dtype), "d(gate_up)");
    DeviceBuffer codes(b, 2 * M * 2 * F + N * 2 * F + C * M + 4096, "fp8 codes");
    DeviceBuffer state(b, 16 * 256, "fp8 scales");
    const GivenScale d_scale = given_scale(b, state, 512.0f);
    const Tensor& d_inv = d_scale.scale_inv;
    Fp8CastArgs d;
    d.out = codes.tensor(DType::E4M3, {M, 2 * F});
    d.out_t = codes.tensor(DType::E4M3, {2 * F, M}, M * 2 * F);
    d.scale = d_scale.scale;
    d.amax = t.at("amax");
    b.swiglu_backward_cast(scratch.tensor(t.at("gate_up").dtype, {M, 2 * F}), t.at("dh"),
                           t.at("gate_up"), d);
    // dx (M, N) = dgate_up @ w^T, w (N, 2F) standing for the weight's transposed codes.
    const Tensor w = codes.tensor(DType::E4M3, {N, 2 * F}, 2 * M * 2 * F);
    const Tensor w_inv = state.tensor(DType::F32, {1}, 512);
    cast_fp8_tensorwise(b, state, 1024, t.at("w"), w, w_inv);
    Fp8MatmulArgs dgrad;
    dgrad.out = t.at("dx"), dgrad.a = d.out, dgrad.b = w, dgrad.a_scale_inv = d_inv;
    dgrad.b_scale_inv = w_inv;
    b.matmul_fp8(dgrad);
    // dw (2F, C) = dgate_up^T @ x, both operands K-major (x cast transposed).
    const Tensor x_t = codes.tensor(DType::E4M3, {C, M}, 2 * M * 2 * F + N * 2 * F);
    const Tensor x_inv = state.tensor(DType::F32, {1}, 768);
    cast_fp8_tensorwise(b, state, 1536, t.at("x"), x_t, x_inv, true);
    Fp8MatmulArgs wgrad;
    wgrad.out = t.at("dw"), wgrad.a = d.out_t, wgrad.b = x_t, wgrad.a_scale_inv = d_inv;
    wgrad.b_scale_inv = x_inv;
    b.matmul_fp8(wgrad);
  };
  return {c};
}

// The pre-norm without its output, as a block whose first linear keeps its input as codes runs
// it: the forward's codes and statistics, later the transposed codes from the norm's input
// (rmsnorm_transposed_codes), and the linear's weight gradient from them (dy cast transposed):
// the tiles at 256 x 128 on the GPU, its element path at 144 x 96.
std::vector<OpCase> rmsnorm_transposed_codes_cases() {
  std::vector<OpCase> cases;
  for (const auto& [M, C] : std::vector<std::pair<int64_t, int64_t>>{{256, 128}, {144, 96}}) {
    const int64_t N = 48;
    OpCase c;
    c.name = fmt::format("rmsnorm_transposed_codes+matmul_fp8 M{} C{} N{}", M, C, N);
    c.specs = {{"x", {M, C}},
               {"norm_w", {C}, Kind::Act, Role::In, 0.5f},
               {"dy", {M, N}, Kind::Act, Role::In, 0.05f},
               {"rstd", {M}, Kind::F32, Role::Out, 1, 0, 1, 1e-5},
               {"dw", {N, C}, Kind::Act, Role::Out, 1.0f, 0, 1, 3e-2}};
    c.run = [M, C, N](Backend& b, const Tensors& t) {
      DeviceBuffer codes(b, 2 * M * C + M * N + 4096, "fp8 codes");
      DeviceBuffer state(b, 16 * 256, "fp8 scales");
      const GivenScale x_scale = given_scale(b, state, 16.0f);
      Fp8CastArgs rows;
      rows.out = codes.tensor(DType::E4M3, {M, C});
      rows.scale = x_scale.scale;
      b.rmsnorm_forward_cast({}, t.at("rstd"), t.at("x"), t.at("norm_w"), 1e-5f, rows);
      Fp8CastArgs transposed;
      transposed.out_t = codes.tensor(DType::E4M3, {C, M}, M * C);
      transposed.scale = x_scale.scale;
      b.rmsnorm_transposed_codes(transposed, t.at("x"), t.at("rstd"), t.at("norm_w"), 1e-5f);
      // dw (N, C) = dy^T @ norm(x), both operands K-major.
      const Tensor dy_t = codes.tensor(DType::E4M3, {N, M}, 2 * M * C);
      const Tensor dy_inv = state.tensor(DType::F32, {1}, 512);
      cast_fp8_tensorwise(b, state, 1024, t.at("dy"), dy_t, dy_inv, true);
      Fp8MatmulArgs wgrad;
      wgrad.out = t.at("dw"), wgrad.a = dy_t, wgrad.b = transposed.out_t;
      wgrad.a_scale_inv = dy_inv, wgrad.b_scale_inv = x_scale.scale_inv;
      b.matmul_fp8(wgrad);
    };
    cases.push_back(std::move(c));
  }
  return cases;
}

// The FP8 grouped GEMMs as the MoE block runs them under fp8: activations cast with one
// tensorwise scale (e5m2 for a gradient), every expert's weight with its own, the codes then
// multiplied per group; the weight gradient from both operands' transposed codes. Every
// backend sees the same codes. Group sizes are multiples of 16 rows, as moe_permute pads them
// and FP8 GEMMs need. with_host_offsets false: the ops get the device's offsets alone;
// fast_accum: the forward kinds with fast accumulation.
std::vector<OpCase> grouped_matmul_fp8_cases(const std::vector<int32_t>& sizes, int64_t N,
                                             int64_t K, const std::string& what,
                                             const std::vector<int32_t>& weights = {},
                                             int64_t num_weights = 0, bool with_host_offsets = true,
                                             bool fast_accum = false) {
  const int64_t G = static_cast<int64_t>(sizes.size());
  const int64_t W = weights.empty() ? G : num_weights;
  std::vector<int32_t> offsets = {0};
  for (int32_t size : sizes) offsets.push_back(offsets.back() + size);
  const int64_t used = offsets.back(), R = used + 16;  // rows past the groups: zeroed
  auto upload_offsets = [offsets](Backend& b, DeviceBuffer& buf) {
    const Tensor t = buf.tensor(DType::I32, {static_cast<int64_t>(offsets.size())});
    b.upload(t, offsets.data());
    return t;
  };
  std::vector<OpCase> cases;
  for (DType a_format : {DType::E4M3, DType::E5M2}) {  // forward, data gradient
    OpCase c;
    c.name = fmt::format("grouped_matmul_fp8 G{} rows{} N{} K{} {}{} {}", G, used, N, K,
                         dtype_name(a_format), fast_accum ? " fast" : "", what);
    c.specs = {{"a", {R, K}, Kind::Act, Role::In, 0.5f},
               {"b", {W, N, K}, Kind::Act, Role::In, 0.05f},
               {"out", {R, N}, Kind::Act, Role::Out, 1, 0, 1, 1e-2}};
    c.run = [=](Backend& b, const Tensors& t) {
      DeviceBuffer buf(b, offsets.size() * 4, "offsets");
      DeviceBuffer codes(b, R * K + W * N * K + 1024, "fp8 codes");
      DeviceBuffer state(b, (2 * W + 4) * 512 + 256, "fp8 scales");
      const Tensor qa = codes.tensor(a_format, {R, K});
      const Tensor qb = codes.tensor(DType::E4M3, {W, N, K}, (R * K + 255) / 256 * 256);
      const Tensor a_inv = state.tensor(DType::F32, {1});
      // The experts' scale_invs side by side, as the model keeps them (not 16-byte aligned).
      const Tensor b_inv = state.tensor(DType::F32, {W}, 256);
      cast_fp8_tensorwise(b, state, 512, t.at("a"), qa, a_inv);
      for (int64_t e = 0; e < W; ++e)
        cast_fp8_tensorwise(b, state, 1024 + 512 * e,
                            t.at("b").flat_range(e * N * K, N * K).view({N, K}),
                            qb.flat_range(e * N * K, N * K).view({N, K}), b_inv.flat_range(e, 1));
      GroupedFp8MatmulArgs g;
      g.out = t.at("out"), g.a = qa, g.b = qb, g.a_scale_inv = a_inv, g.b_scale_inv = b_inv;
      g.offsets = upload_offsets(b, buf);
      if (with_host_offsets) g.host_offsets = offsets;
      g.group_weights = weights;
      g.fast_accum = fast_accum;
      b.grouped_matmul_fp8(g);
      b.synchronize();
    };
    cases.push_back(c);
  }
  for (float beta : {0.0f, 1.0f}) {
    if (fast_accum) break;  // the weight gradients keep split accumulation
    OpCase c;
    c.name = fmt::format("grouped_matmul_fp8_wgrad G{} rows{} M{} N{}{} {}", G, used, N, K,
                         beta != 0 ? " beta1" : "", what);
    c.specs = {{"a", {R, N}, Kind::Act, Role::In, 0.5f},
               {"b", {R, K}, Kind::Act, Role::In, 0.5f},
               {"out", {W, N, K}, Kind::F32, beta != 0 ? Role::Accum : Role::Out, 1, 0, 1, 1e-3}};
    c.run = [=](Backend& b, const Tensors& t) {
      DeviceBuffer buf(b, offsets.size() * 4, "offsets");
      DeviceBuffer codes(b, R * (N + K) + 1024, "fp8 codes");
      DeviceBuffer state(b, 4 * 512, "fp8 scales");
      // The transposed codes of the output gradient and of the input, every row cast (the
      // rows past the groups too: the op must leave them out of its sums).
      const Tensor qa = codes.tensor(DType::E5M2, {N, R});
      const Tensor qb = codes.tensor(DType::E4M3, {K, R}, (R * N + 255) / 256 * 256);
      const Tensor a_inv = state.tensor(DType::F32, {1}),
                   b_inv = state.tensor(DType::F32, {1}, 256);
      cast_fp8_tensorwise(b, state, 512, t.at("a"), qa, a_inv, true);
      cast_fp8_tensorwise(b, state, 1536, t.at("b"), qb, b_inv, true);
      GroupedFp8MatmulWgradArgs g;
      g.out = t.at("out"), g.a_t = qa, g.b_t = qb, g.a_scale_inv = a_inv, g.b_scale_inv = b_inv;
      g.beta = beta;
      g.offsets = upload_offsets(b, buf);
      if (with_host_offsets) g.host_offsets = offsets;
      g.group_weights = weights;
      b.grouped_matmul_fp8_wgrad(g);
      b.synchronize();
    };
    cases.push_back(c);
  }
  return cases;
}

std::vector<OpCase> moe_cases() {
  std::vector<OpCase> cases;
  for (const MoeRouting& r :
       {routing(8, 2), routing(61, 3), routing(8, 2, false, true), routing(16, 1, true),
        routing(16, 4, true), routing(16, 4, true, false, 4, 2, 2.5f),
        routing(64, 6, false, true, 8, 3), routing(7, 3, false, false, 0, 0, 0.0f, true),
        routing(128, 8), routing(256, 8, true, false, 8, 4, 2.5f)}) {
    const int64_t N = r.experts >= 128 ? 4096 : 37;
    cases.push_back(router_case(N, r));
  }
  cases.push_back(router_case(33, routing(8, 1, true), 5));
  cases.push_back(router_case(33, routing(8, 2, true), 0));
  for (const auto& [r, seq] :
       std::vector<std::pair<MoeRouting, int64_t>>{{routing(8, 2), 0},
                                                   {routing(8, 2), 13},
                                                   {routing(16, 4, true), 0},
                                                   {routing(16, 1, true), 13},
                                                   {routing(128, 8), 0},
                                                   {routing(256, 8, true), 4096}})
    cases.push_back(aux_loss_case(r.experts >= 128 ? 8192 : 39, r, seq));
  for (auto [N, E] : {std::pair<int64_t, int64_t>{39, 8}, {8192, 128}}) {
    OpCase z;
    z.name = fmt::format("moe_z_loss N{} E{}", N, E);
    z.specs = {{"logits", {N, E}, Kind::Act, Role::In, 2.0f},
               {"loss", {1}, Kind::F32, Role::Accum, 1, 0, 1, 1e-4},
               {"dlogits", {N, E}, Kind::F32, Role::Accum, 1, 0, 1, 1e-5}};
    z.run = [](Backend& b, const Tensors& t) {
      b.moe_z_loss(t.at("loss"), t.at("dlogits"), t.at("logits"), 0.7f);
    };
    cases.push_back(z);
  }
  OpCase counts;
  counts.name = "moe_expert_counts N1000 K3 E17 (experts 15, 16 empty)";
  counts.specs = {slots("indices", 1000, 3, 0, 15),
                  {"counts", {17}, Kind::F32, Role::Accum, 1, 0, 1, 1e-7}};
  counts.run = [](Backend& b, const Tensors& t) {
    b.moe_expert_counts(t.at("counts"), t.at("indices"));
  };
  cases.push_back(counts);
  // Counts as a step leaves them (whole numbers), one expert exactly at the mean.
  OpCase bias_update;
  bias_update.name = "moe_expert_bias_update E9";
  bias_update.specs = {{"bias", {9}, Kind::F32, Role::Accum, 0.01f, 0, 1, 1e-7}};
  bias_update.run = [](Backend& b, const Tensors& t) {
    const std::vector<float> c = {3, 10, 4, 0, 7, 9, 5, 6, 1};  // mean 5
    DeviceBuffer buf(b, c.size() * 4, "counts");
    const Tensor counts = buf.tensor(DType::F32, {9});
    b.upload(counts, c.data());
    b.moe_expert_bias_update(t.at("bias"), counts, 1e-3f);
    b.synchronize();
  };
  cases.push_back(bias_update);
  cases.push_back(permute_case(37, 2, 8, 45, 1, 0, 8));
  cases.push_back(permute_case(37, 2, 8, 45, 16, 0, 5));  // experts 5..7 empty
  cases.push_back(permute_case(29, 1, 6, 64, 16, 3, 4));  // every token to expert 3
  cases.push_back(permute_case(31, 3, 5, 33, 8, 1, 3));   // only experts 1 and 2
  cases.push_back(permute_case(8192, 2, 8, 4096, 16, 0, 8));
  // Token dropping: a tight capacity, by weight and by position; every token to one expert;
  // a capacity no expert reaches (nothing dropped); many experts over a long batch.
  cases.push_back(permute_case(37, 2, 8, 45, 1, 0, 8, 7));
  cases.push_back(permute_case(37, 2, 8, 45, 16, 0, 8, 7, true));
  cases.push_back(permute_case(29, 1, 6, 64, 16, 3, 4, 5));
  cases.push_back(permute_case(31, 3, 5, 33, 8, 1, 3, 100));
  cases.push_back(permute_case(4096, 8, 64, 256, 16, 0, 64, 410));
  cases.push_back(permute_case(4096, 8, 64, 256, 16, 0, 64, 410, true));
  for (auto& c : grouped_matmul_cases({3, 0, 17, 1, 0, 9}, 37, 29, "with empty groups"))
    cases.push_back(std::move(c));
  for (auto& c : grouped_matmul_cases({0, 0, 40, 0}, 24, 16, "all rows in one group"))
    cases.push_back(std::move(c));
  // Expert parallelism's received rows: (source rank, expert) groups sharing 4 experts'
  // weights; expert 3 has no group, expert 1 only an empty one.
  for (auto& c :
       grouped_matmul_cases({3, 5, 0, 4, 7, 2}, 21, 19, "shared weights", {0, 2, 1, 0, 2, 0}, 4))
    cases.push_back(std::move(c));
  for (auto& c : grouped_matmul_cases({96, 96, 96, 96, 96, 96, 96, 96}, 256, 512, "8 experts"))
    cases.push_back(std::move(c));
  // Widths the Hopper grouped kernel takes (multiples of 8), with groups of any size and the
  // offsets on the device only; and shapes it does not take, whose GEMMs need the offsets on
  // the host (the backend copies them).
  for (auto& c :
       grouped_matmul_cases({37, 0, 300, 1, 150, 0}, 264, 200, "device offsets only", {}, 0, false))
    cases.push_back(std::move(c));
  for (auto& c : grouped_matmul_cases({3, 0, 17, 1, 0, 9}, 37, 29, "device offsets, odd widths", {},
                                      0, false))
    cases.push_back(std::move(c));
  for (auto& c : grouped_matmul_cases({3, 5, 0, 4, 7, 2}, 24, 16, "device offsets, shared weights",
                                      {0, 2, 1, 0, 2, 0}, 4, false))
    cases.push_back(std::move(c));
  for (auto& c : grouped_matmul_fp8_cases({48, 0, 16, 112, 0, 32}, 48, 80, "with empty groups"))
    cases.push_back(std::move(c));
  for (auto& c : grouped_matmul_fp8_cases({0, 0, 208, 0}, 32, 16, "all rows in one group"))
    cases.push_back(std::move(c));
  for (auto& c : grouped_matmul_fp8_cases({16, 48, 0, 32, 80, 16}, 16, 48, "shared weights",
                                          {0, 2, 1, 0, 2, 0}, 4))
    cases.push_back(std::move(c));
  for (auto& c : grouped_matmul_fp8_cases({96, 96, 96, 96, 96, 96, 96, 96}, 256, 512, "8 experts"))
    cases.push_back(std::move(c));
  // More experts than a GPU backend first keeps aligned scale slots for (256): they grow.
  std::vector<int32_t> many(300, 0);
  for (size_t e = 3; e < many.size(); e += 37) many[e] = 16;
  many.back() = 32;
  for (auto& c : grouped_matmul_fp8_cases(many, 32, 16, "300 experts"))
    cases.push_back(std::move(c));
  // The offsets on the device only: the Hopper grouped kernel's FP8 kinds (slices of 128 rows
  // or columns with tails of 16 to 112, two column tiles, groups of 0 to 512 rows), split and
  // fast accumulation; and shared weights, whose GEMMs copy the offsets to the host.
  for (bool fast : {false, true})
    for (auto& c : grouped_matmul_fp8_cases({160, 0, 320, 16, 48, 512}, 272, 400,
                                            "device offsets only", {}, 0, false, fast))
      cases.push_back(std::move(c));
  for (auto& c : grouped_matmul_fp8_cases({48, 0, 16, 112, 0, 32}, 48, 80,
                                          "device offsets, empty groups", {}, 0, false))
    cases.push_back(std::move(c));
  for (auto& c :
       grouped_matmul_fp8_cases({16, 48, 0, 32, 80, 16}, 16, 48, "device offsets, shared weights",
                                {0, 2, 1, 0, 2, 0}, 4, false))
    cases.push_back(std::move(c));
  return cases;
}

// rope_forward and rope_backward on the shape: a table row per position, or with `positions`
// (packed documents) a row per token at its position in its document.
OpCase rope_case(const std::string& shape, const AttentionShape& s, std::vector<int32_t> positions) {
  const int64_t N = s.tokens(), W = s.qkv_width();
  OpCase rope;
  rope.name = "rope_forward+backward " + shape;
  rope.specs = {{"qkv", {N, W}, Kind::Act, Role::InOut, 1, 0, 1, 1e-2},
                {"dqkv", {N, W}, Kind::Act, Role::InOut, 1, 0, 1, 1e-2}};
  rope.run = [s, positions](Backend& b, const Tensors& t) {
    const std::vector<float> table = rope_freqs(s.seq, s.head_dim);
    std::vector<float> rows;
    for (int32_t pos : positions)
      rows.insert(rows.end(), table.begin() + pos * s.head_dim,
                  table.begin() + (pos + 1) * s.head_dim);
    const std::vector<float>& freqs_rows = positions.empty() ? table : rows;
    DeviceBuffer f(b, freqs_rows.size() * 4, "freqs");
    const Tensor freqs =
        f.tensor(DType::F32, {static_cast<int64_t>(freqs_rows.size()) / s.head_dim, s.head_dim});
    b.upload(freqs, freqs_rows.data());
    AttentionShape rows_shape = s;
    rows_shape.rope_per_token = !positions.empty();
    b.rope_forward(t.at("qkv"), freqs, rows_shape);
    b.rope_backward(t.at("dqkv"), freqs, rows_shape);
    b.synchronize();
  };
  return rope;
}

// What an attention backward case reads (qkv, dout) and writes (out, lse by its forward; dqkv).
std::vector<Spec> attention_backward_specs(const AttentionShape& s) {
  const int64_t N = s.tokens(), W = s.qkv_width(), HD = s.out_width();
  return {{"qkv", {N, W}},
          {"dout", {N, HD}},
          {"out", {N, HD}, Kind::Act, Role::Out, 1, 0, 1, 2e-2},
          {"lse", {s.batch, s.heads, s.seq}, Kind::F32, Role::Out, 1, 0, 1, 1e-3},
          {"dqkv", {N, W}, Kind::Act, Role::Out, 1, 0, 1, 3e-2}};
}

// rope on the shape, then attention_forward and attention_backward.
void add_attention_cases(std::vector<OpCase>& cases, const AttentionShape& s) {
  const std::string shape =
      fmt::format("B{} T{} H{} KV{} D{}{} window{}{}", s.batch, s.seq, s.heads, s.kv_heads,
                  s.head_dim, v_dim_text(s), s.window, s.causal ? "" : " full");
  const int64_t N = s.tokens(), W = s.qkv_width(), HD = s.out_width();
  cases.push_back(rope_case(shape, s, {}));
  OpCase f;
  f.name = "attention_forward " + shape;
  f.specs = {{"qkv", {N, W}},
             {"out", {N, HD}, Kind::Act, Role::Out, 1, 0, 1, 2e-2},
             {"lse", {s.batch, s.heads, s.seq}, Kind::F32, Role::Out, 1, 0, 1, 1e-3}};
  f.run = [s](Backend& b, const Tensors& t) {
    b.attention_forward(t.at("out"), t.at("lse"), t.at("qkv"), s);
  };
  cases.push_back(f);
  OpCase g;
  g.name = "attention_backward " + shape;
  g.specs = attention_backward_specs(s);
  g.run = [s](Backend& b, const Tensors& t) {
    b.attention_forward(t.at("out"), t.at("lse"), t.at("qkv"), s);
    b.attention_backward(t.at("dqkv"), t.at("dout"), t.at("out"), t.at("lse"), t.at("qkv"), s);
  };
  cases.push_back(g);
}

// Packed documents (reset_position_ids, reset_attention_mask): rope with a row per token at its
// position in its document, attention within each document; the lengths of each sequence's
// documents, in order.
struct PackedAttention {
  AttentionShape s;
  std::vector<std::vector<int>> documents;
};

// Each token's document start (by position in its sequence of `seq` tokens) for sequences
// holding documents of these lengths, in order.
std::vector<int32_t> document_starts_of(const std::vector<std::vector<int>>& documents,
                                        int64_t seq) {
  std::vector<int32_t> starts;
  for (const auto& sequence : documents)
    for (int length : sequence)
      for (int k = 0; k < length; ++k)
        starts.push_back(static_cast<int32_t>(starts.size() % seq) - k);
  return starts;
}

void add_packed_attention_cases(std::vector<OpCase>& cases, const PackedAttention& p) {
  const AttentionShape& s = p.s;
  const std::vector<int32_t> starts = document_starts_of(p.documents, s.seq);
  std::vector<int32_t> positions;  // each token's place in its document
  for (size_t i = 0; i < starts.size(); ++i)
    positions.push_back(static_cast<int32_t>(i % s.seq) - starts[i]);
  const std::string shape = fmt::format("B{} T{} H{} KV{} D{}{} window{} packed", s.batch, s.seq,
                                        s.heads, s.kv_heads, s.head_dim, v_dim_text(s), s.window);
  cases.push_back(rope_case(shape, s, positions));
  OpCase g;
  g.name = "attention_forward+backward " + shape;
  g.specs = attention_backward_specs(s);
  g.run = [s, starts](Backend& b, const Tensors& t) {
    DeviceBuffer d(b, starts.size() * 4, "document starts");
    AttentionShape within = s;
    within.document_starts = d.tensor(DType::I32, {s.tokens()});
    b.upload(within.document_starts, starts.data());
    b.attention_forward(t.at("out"), t.at("lse"), t.at("qkv"), within);
    b.attention_backward(t.at("dqkv"), t.at("dout"), t.at("out"), t.at("lse"), t.at("qkv"), within);
    b.synchronize();
  };
  cases.push_back(g);
}

// FP8 attention (AttentionShape::fp8) against ref::attention_fp8_forward, which states its
// numerics; with `documents`, packed documents as add_packed_attention_cases lays them out.
// Named fp8_attention_* so that the bf16-only attention runs (fp32, cuDNN) leave them out.
OpCase fp8_attention_case(AttentionShape s, const std::vector<std::vector<int>>& documents = {}) {
  s.fp8 = true;
  const std::vector<int32_t> starts = document_starts_of(documents, s.seq);
  OpCase f;
  f.name = fmt::format("fp8_attention_forward B{} T{} H{} KV{} D{} window{}{}{}", s.batch, s.seq,
                       s.heads, s.kv_heads, s.head_dim, s.window, s.causal ? "" : " full",
                       starts.empty() ? "" : " packed");
  f.specs = {{"qkv", {s.tokens(), s.qkv_width()}},
             {"out", {s.tokens(), s.out_width()}, Kind::Act, Role::Out, 1, 0, 1, 2e-2},
             {"lse", {s.batch, s.heads, s.seq}, Kind::F32, Role::Out, 1, 0, 1, 1e-3}};
  f.run = [s, starts](Backend& b, const Tensors& t) {
    AttentionShape within = s;
    DeviceBuffer d(b, starts.size() * 4, "document starts");
    if (!starts.empty()) {
      within.document_starts = d.tensor(DType::I32, {s.tokens()});
      b.upload(within.document_starts, starts.data());
    }
    b.attention_forward(t.at("out"), t.at("lse"), t.at("qkv"), within);
    b.synchronize();
  };
  return f;
}

}  // namespace

std::vector<OpCase> attention_cases() {
  std::vector<OpCase> cases;
  for (const AttentionShape& s :
       {attn(2, 37, 4, 2, 64, 0), attn(1, 200, 4, 4, 128, 0), attn(1, 200, 8, 1, 64, 33),
        attn(2, 77, 4, 2, 128, 0, false), attn(1, 1024, 8, 2, 128, 0),
        attn(1, 1024, 8, 2, 128, 256), attn(1, 9, 6, 3, 64, 4, false),
        // Head dims the flash kernels do not take, and multi-latent attention's narrower value
        // heads: odd sizes, GQA, windows, full attention, and DeepSeek's 192 / 128.
        attn(1, 40, 2, 1, 80, 0), attn_v(2, 37, 4, 4, 24, 16, 0), attn_v(1, 53, 3, 3, 20, 12, 0),
        attn_v(1, 130, 4, 2, 48, 40, 17), attn_v(2, 65, 2, 2, 96, 64, 0, false),
        attn_v(1, 256, 16, 16, 192, 128, 0), attn_v(1, 1024, 8, 8, 192, 128, 0)}) {
    add_attention_cases(cases, s);
  }
  // Packed documents over many tiles of the flash kernels: documents that end inside a tile, on
  // a tile edge (128, 256), one of one token, one across several tiles; a sequence of one
  // document; and a window inside documents.
  for (const PackedAttention& p :
       {PackedAttention{attn(2, 40, 4, 2, 64, 0), {{7, 13, 20}, {1, 39}}},
        PackedAttention{attn(1, 200, 8, 1, 128, 0), {{50, 3, 100, 47}}},
        PackedAttention{attn(1, 100, 4, 2, 64, 16), {{30, 70}}},
        PackedAttention{attn_v(1, 64, 4, 4, 24, 16, 0), {{1, 1, 62}}},
        PackedAttention{attn(2, 700, 8, 2, 128, 0), {{128, 1, 127, 300, 144}, {700}}},
        PackedAttention{attn(1, 600, 4, 4, 64, 100), {{64, 64, 5, 331, 136}}}}) {
    add_packed_attention_cases(cases, p);
  }
  // FP8 attention: a partial last tile, GQA over two sequences without the causal mask, a window
  // across tiles, and packed documents ending inside and on tile edges.
  for (const AttentionShape& s : {attn(1, 200, 4, 4, 128, 0), attn(2, 77, 4, 2, 128, 0, false),
                                  attn(1, 1024, 8, 2, 128, 256)}) {
    cases.push_back(fp8_attention_case(s));
  }
  cases.push_back(fp8_attention_case(attn(2, 700, 8, 2, 128, 0), {{128, 1, 127, 300, 144}, {700}}));
  return cases;
}

std::vector<OpCase> wide_attention_cases() {
  std::vector<OpCase> cases;
  // 11 query tiles of 128 x 16 heads: 176 tiles, more than an H100 or H200 has SMs (132).
  for (const AttentionShape& s : {attn(1, 1300, 16, 4, 128, 0), attn(1, 1300, 16, 4, 128, 300)}) {
    add_attention_cases(cases, s);
  }
  cases.push_back(fp8_attention_case(attn(1, 1300, 16, 4, 128, 0)));
  // Query tiles that see one key tile (a document inside one tile) next to ones that see
  // several, documents on a tile edge and across tiles.
  add_packed_attention_cases(cases,
                             {attn(1, 1300, 16, 4, 128, 0), {{100, 1, 27, 128, 300, 5, 600, 139}}});
  return cases;
}

// Generation's attention over a KV cache: one new token per sequence at position pos (or at
// positions of their own up to it), the cache filled up to it (and beyond: later positions
// must not be read).
std::vector<OpCase> decode_cases() {
  std::vector<OpCase> cases;
  struct Decode {
    AttentionShape s;
    int64_t pos;
  };
  for (const Decode& d :
       {Decode{attn(1, 64, 4, 2, 64, 0), 0}, Decode{attn(2, 100, 8, 2, 128, 0), 99},
        Decode{attn(1, 300, 4, 1, 64, 33), 250}, Decode{attn(1, 2048, 8, 2, 128, 512), 2047},
        Decode{attn(3, 40, 4, 4, 128, 0), 17}, Decode{attn(1, 16, 2, 1, 256, 0), 9},
        Decode{attn(2, 33, 4, 2, 16, 0), 32}, Decode{attn(1, 70, 6, 3, 80, 8), 61},
        Decode{attn(1, 12, 2, 2, 200, 0), 5}, Decode{attn_v(1, 50, 4, 4, 24, 16, 0), 31},
        Decode{attn_v(2, 64, 8, 8, 192, 128, 0), 63},
        // The keys split over several blocks (few heads and sequences, a long cache), some
        // splits empty for the shorter sequences of a batch.
        Decode{attn(1, 1024, 32, 8, 128, 0), 700}, Decode{attn(3, 600, 8, 2, 128, 0), 599},
        // Query heads per KV head not a power of two (Qwen 2.5 7B's 7), the most (8), and a
        // generation batch of 64 sequences.
        Decode{attn(2, 300, 28, 4, 128, 0), 299}, Decode{attn(1, 200, 64, 8, 128, 0), 150},
        Decode{attn(64, 300, 32, 8, 128, 0), 280}}) {
    const AttentionShape& s = d.s;
    const int64_t QD = s.heads * s.head_dim, HD = s.out_width();
    const int64_t row = s.kv_heads * (s.head_dim + s.v_dim());
    OpCase c;
    c.name = fmt::format("attention_decode B{} S{} H{} KV{} D{}{} window{} pos{}", s.batch, s.seq,
                         s.heads, s.kv_heads, s.head_dim, v_dim_text(s), s.window, d.pos);
    c.specs = {{"q", {s.batch, QD}},
               {"kv", {s.batch, s.seq, row}},
               {"out", {s.batch, HD}, Kind::Act, Role::Out, 1, 0, 1, 2e-2}};
    c.run = [d](Backend& b, const Tensors& t) {
      b.attention_decode(t.at("out"), t.at("q"), t.at("kv"), {}, d.pos, d.s);
    };
    cases.push_back(c);
    if (s.batch == 1) continue;
    // Continuous batching: each sequence at a position of its own, at most pos.
    c.name += " positions";
    c.specs.push_back({"positions", {s.batch}, Kind::I32, Role::In, 1, 0, static_cast<int>(d.pos) + 1});
    c.run = [d](Backend& b, const Tensors& t) {
      b.attention_decode(t.at("out"), t.at("q"), t.at("kv"), t.at("positions"), d.pos, d.s);
    };
    cases.push_back(c);
  }
  for (auto [B, S, W, Ws, col] : {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{5, 40, 64, 192, 128},
                                  {3, 17, 13, 29, 7},
                                  {64, 300, 2048, 6144, 4096}}) {
    OpCase c;
    c.name = fmt::format("cache_write B{} S{} W{} from columns [{}, {}) of {}", B, S, W, col, col + W, Ws);
    c.specs = {{"src", {B, Ws}},
               {"positions", {B}, Kind::I32, Role::In, 1, 0, static_cast<int>(S)},
               {"cache", {B, S, W}, Kind::Act, Role::Accum, 1, 0, 1, 1e-6}};
    c.run = [col = col](Backend& b, const Tensors& t) {
      b.cache_write(t.at("cache"), t.at("src"), col, t.at("positions"));
    };
    cases.push_back(c);
  }
  return cases;
}

// Multi-latent attention's packing, forward and backward, with the queries in their own tensor
// (q_lora_rank set: q_b_proj's output) or beside the latents and the rope key in one fused
// projection output (DeepSeek-V2-Lite), whose other columns the backward must leave alone.
std::vector<OpCase> mla_cases() {
  std::vector<OpCase> cases;
  struct Mla {
    int64_t B, T, H, Dn, Dr, Dv, latent;
    bool fused;  // q and the rope key in one tensor with a latent of `latent` between them
  };
  for (const Mla& m :
       {Mla{2, 19, 3, 10, 6, 8, 0, false}, Mla{1, 37, 5, 12, 4, 14, 9, true},
        Mla{1, 64, 16, 128, 64, 128, 512, true}, Mla{2, 512, 16, 128, 64, 128, 0, false}}) {
    AttentionShape s = attn_v(m.B, m.T, m.H, m.H, m.Dn + m.Dr, m.Dv, 0);
    const int64_t N = s.tokens(), QW = m.H * s.head_dim, KVW = m.H * (m.Dn + m.Dv);
    const int64_t AW = QW + m.latent + m.Dr;  // fused: [q | latent | rope key]
    OpCase c;
    c.name = fmt::format("mla_qkv_forward+backward B{} T{} H{} Dn{} Dr{} Dv{}{}", m.B, m.T, m.H,
                         m.Dn, m.Dr, m.Dv, m.fused ? fmt::format(" fused latent{}", m.latent) : "");
    c.specs = {{"kv", {N, KVW}},
               {"freqs", {m.T, m.Dr}, Kind::F32},
               {"qkv", {N, s.qkv_width()}, Kind::Act, Role::Out, 1, 0, 1, 1e-2},
               {"dqkv", {N, s.qkv_width()}},
               {"dkv", {N, KVW}, Kind::Act, Role::Out, 1, 0, 1, 1e-2}};
    if (m.fused) {
      c.specs.push_back({"a", {N, AW}});
      c.specs.push_back({"da", {N, AW}, Kind::Act, Role::Accum, 1, 0, 1, 2e-2});
    } else {
      c.specs.push_back({"q", {N, QW}});
      c.specs.push_back({"k", {N, m.Dr}});
      c.specs.push_back({"dq", {N, QW}, Kind::Act, Role::Out, 1, 0, 1, 1e-2});
      c.specs.push_back({"dk", {N, m.Dr}, Kind::Act, Role::Out, 1, 0, 1, 2e-2});
    }
    c.run = [m, s](Backend& b, const Tensors& t) {
      MlaQkvArgs a;
      a.qkv = t.at("qkv"), a.kv = t.at("kv"), a.freqs = t.at("freqs");
      a.s = s, a.rope_dim = m.Dr;
      a.q = t.at(m.fused ? "a" : "q");
      a.k_rope = t.at(m.fused ? "a" : "k");
      a.k_col = m.fused ? m.H * s.head_dim + m.latent : 0;
      b.mla_qkv_forward(a);
      MlaQkvArgs g = a;
      g.qkv = t.at("dqkv"), g.kv = t.at("dkv");
      g.q = t.at(m.fused ? "da" : "dq");
      g.k_rope = t.at(m.fused ? "da" : "dk");
      b.mla_qkv_backward(g);
    };
    cases.push_back(c);
  }
  // The slices of fused projection outputs: an odd window, DeepSeek-V3's latent, context
  // parallelism's keys and values of a GQA qkv (whole 16-byte units) and a block of 4-byte units.
  for (auto [N, WS, WD, from, to, cols] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>{37, 29, 23, 5, 7, 11},
        {4096, 2112, 512, 1536, 0, 512}, {1024, 1536, 512, 1024, 0, 512},
        {64, 30, 18, 2, 4, 10}}) {
    OpCase c;
    c.name = fmt::format("copy_columns N{} [{}, {}) of {} to [{}, {}) of {}", N, from, from + cols,
                         WS, to, to + cols, WD);
    c.specs = {{"src", {N, WS}}, {"dst", {N, WD}, Kind::Act, Role::Accum, 1, 0, 1, 1e-6}};
    c.run = [=](Backend& b, const Tensors& t) {
      b.copy_columns(t.at("dst"), to, t.at("src"), from, cols);
    };
    cases.push_back(c);
  }
  // The output head's rows: a gather of every third row of an odd-sized matrix, and the
  // scatter of its results back (distinct rows, as the op requires), in the compute dtype and
  // in fp32 (per-row losses), at a Llama 3 8B width too.
  for (auto [N, C, kind] : {std::tuple<int64_t, int64_t, Kind>{97, 72, Kind::Act},
                            {97, 1, Kind::F32}, {8192, 4096, Kind::Act}}) {
    const int64_t K = (N + 2) / 3;
    // rows[i] = 3i + 1 wrapped to N, so distinct and in no contiguous run; the case writes them
    // before the op (so they are InOut: its random ids would repeat).
    const auto rows = [N, K](Backend& b, const Tensor& t) {
      std::vector<int32_t> r(static_cast<size_t>(K));
      for (int64_t i = 0; i < K; ++i) r[i] = static_cast<int32_t>((3 * i + 1) % N);
      b.upload(t, r.data());
    };
    OpCase gather;
    gather.name = fmt::format("copy_rows gather {} of N{} C{}{}", K, N, C, kind == Kind::F32 ? " fp32" : "");
    gather.specs = {{"rows", {K}, Kind::I32, Role::InOut, 1, 0, 1},
                    {"src", {N, C}, kind},
                    {"dst", {K, C}, kind, Role::Accum, 1, 0, 1, 1e-6}};
    gather.run = [=](Backend& b, const Tensors& t) {
      rows(b, t.at("rows"));
      b.copy_rows(t.at("dst"), Tensor{}, t.at("src"), t.at("rows"));
    };
    cases.push_back(gather);
    OpCase scatter;
    scatter.name = fmt::format("copy_rows scatter {} into N{} C{}{}", K, N, C, kind == Kind::F32 ? " fp32" : "");
    scatter.specs = {{"rows", {K}, Kind::I32, Role::InOut, 1, 0, 1},
                     {"src", {K, C}, kind},
                     {"dst", {N, C}, kind, Role::Accum, 1, 0, 1, 1e-6}};
    scatter.run = [=](Backend& b, const Tensors& t) {
      rows(b, t.at("rows"));
      b.copy_rows(t.at("dst"), t.at("rows"), t.at("src"), Tensor{});
    };
    cases.push_back(scatter);
  }
  return cases;
}

// Context parallelism's attention: segment `segment` of S holds the tokens of positions
// [c Tc, (c + 1) Tc) and [(2S - 1 - c) Tc, (2S - c) Tc) with Tc = T / 2 (Megatron's causal load
// balancing); its queries attend to every segment's keys.
std::vector<OpCase> gathered_attention_cases() {
  std::vector<OpCase> cases;
  struct Gathered {
    AttentionShape s;  // s.seq: tokens per segment and sequence
    int64_t segments, segment;
    // Packed documents: their lengths over each whole sequence of segments x s.seq tokens (the
    // same in every sequence); empty: none.
    std::vector<int> documents = {};
  };
  for (const Gathered& g :
       {Gathered{attn(2, 16, 4, 2, 64, 0), 2, 0}, Gathered{attn(2, 16, 4, 2, 64, 0), 2, 1},
        Gathered{attn(1, 24, 8, 2, 128, 20), 4, 2}, Gathered{attn(1, 512, 8, 8, 128, 0), 2, 1},
        // Chunks of whole tiles (the GPU's warpgroup kernels on Hopper): GQA over a batch, the
        // first and a middle segment, a window across chunks.
        Gathered{attn(2, 512, 8, 2, 128, 0), 2, 0}, Gathered{attn(1, 256, 4, 2, 128, 300), 4, 1},
        // Packed documents by position: ends inside a chunk, across chunks and segments, a
        // document of one token; small and in whole tiles.
        Gathered{attn(2, 16, 4, 2, 64, 0), 2, 1, {5, 1, 20, 6}},
        Gathered{attn(1, 512, 8, 2, 128, 0), 2, 0, {100, 1, 300, 130, 256, 237}},
        Gathered{attn(1, 256, 4, 2, 128, 0), 4, 2, {700, 1, 323}}}) {
    const AttentionShape s = g.s;
    const int64_t S = g.segments, N = s.tokens(), W = s.qkv_width(), KW = s.kv_width(),
                  HD = s.heads * s.head_dim;
    const std::string shape =
        fmt::format("S{} segment {} B{} T{} H{} KV{} D{} window{}{}", S, g.segment, s.batch, s.seq,
                    s.heads, s.kv_heads, s.head_dim, s.window, g.documents.empty() ? "" : " packed");
    std::vector<int32_t> starts;  // (B, S T) by position
    for (int64_t b = 0; b < s.batch && !g.documents.empty(); ++b)
      for (int length : g.documents)
        for (int k = 0; k < length; ++k)
          starts.push_back(static_cast<int32_t>(starts.size() % (S * s.seq)) - k);
    std::vector<int32_t> positions;
    const int64_t Tc = s.seq / 2;
    for (int64_t c = 0; c < S; ++c)
      for (int64_t t = 0; t < s.seq; ++t)
        positions.push_back(
            static_cast<int32_t>(t < Tc ? c * Tc + t : (2 * S - 1 - c) * Tc + t - Tc));
    auto run_forward = [s, positions, starts, segment = g.segment](Backend& b, const Tensors& t) {
      DeviceBuffer p(b, (positions.size() + starts.size()) * 4, "positions");
      const Tensor pos = p.tensor(DType::I32, {static_cast<int64_t>(positions.size())});
      b.upload(pos, positions.data());
      AttentionShape within = s;
      if (!starts.empty()) {
        within.document_starts =
            p.tensor(DType::I32, {static_cast<int64_t>(starts.size())}, positions.size() * 4);
        b.upload(within.document_starts, starts.data());
      }
      b.attention_gathered_forward(t.at("out"), t.at("lse"), t.at("qkv"), t.at("kv_all"), pos,
                                   segment, within);
      if (t.count("dkv_all"))
        b.attention_gathered_backward(t.at("dqkv"), t.at("dkv_all"), t.at("dout"), t.at("out"),
                                      t.at("lse"), t.at("qkv"), t.at("kv_all"), pos, segment,
                                      within);
      b.synchronize();
    };
    OpCase f;
    f.name = "attention_gathered_forward " + shape;
    f.specs = {{"qkv", {N, W}},
               {"kv_all", {S * N, KW}},
               {"out", {N, HD}, Kind::Act, Role::Out, 1, 0, 1, 2e-2},
               {"lse", {s.batch, s.heads, s.seq}, Kind::F32, Role::Out, 1, 0, 1, 1e-3}};
    f.run = run_forward;
    cases.push_back(f);
    OpCase b = f;
    b.name = "attention_gathered_backward " + shape;
    // dqkv's key and value columns are not the op's to write: they keep their values.
    b.specs = {{"qkv", {N, W}},
               {"kv_all", {S * N, KW}},
               {"dout", {N, HD}},
               {"out", {N, HD}, Kind::Act, Role::Out, 1, 0, 1, 2e-2},
               {"lse", {s.batch, s.heads, s.seq}, Kind::F32, Role::Out, 1, 0, 1, 1e-3},
               {"dqkv", {N, W}, Kind::Act, Role::InOut, 1, 0, 1, 3e-2},
               {"dkv_all", {S * N, KW}, Kind::Act, Role::Out, 1, 0, 1, 3e-2}};
    cases.push_back(b);
  }
  return cases;
}

std::vector<OpCase> all_cases() {
  std::vector<OpCase> all;
  for (auto fn : {matmul_cases, norm_and_embedding_cases, attention_cases, decode_cases, mla_cases,
                  gathered_attention_cases, mlp_and_loss_cases, qk_norm_cases, moe_cases,
                  reduction_and_optimizer_cases, bf16_gradient_cases, fp8_cases, forward_cast_cases,
                  swiglu_backward_cast_cases, rmsnorm_transposed_codes_cases,
                  fp8_grouped_cast_cases, init_and_conversion_cases})
    for (auto& c : fn()) all.push_back(std::move(c));
  return all;
}

}  // namespace tessera::test
