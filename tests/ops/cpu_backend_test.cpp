// CpuBackend (fp32) against the double reference on random inputs, for every op. Outputs are
// poisoned with NaN first so that unwritten elements fail, and every tensor sits between guard
// regions of sentinel bytes that must survive the op (ggml test-backend-ops rules). Also:
// determinism across thread counts, memory accounting and errors.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "op_test_util.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/backend/cpu/reference.h"

namespace tessera {
namespace {

using test::all_nonzero;
using test::nan_values;
using test::random_ids;
using test::random_values;
using test::relative_error;

// float against the double reference: rounding of inputs is excluded (they are float
// values), leaving accumulated float rounding, ~1e-7 per operation.
constexpr double kTol = 1e-5;

// A tensor allocated through the backend with kGuardBytes of sentinel on either side; the
// destructor fails the test if an op wrote into them.
class GuardedTensor {
 public:
  static constexpr size_t kGuardBytes = 64;
  static constexpr unsigned char kSentinel = 0xA5;

  GuardedTensor(Backend& backend, DType dtype, Shape shape, std::string name)
      : backend_(&backend), name_(std::move(name)) {
    tensor_.dtype = dtype;
    tensor_.shape = shape;
    tensor_.device = backend.device();
    base_ = static_cast<unsigned char*>(
        backend.allocate(tensor_.nbytes() + 2 * kGuardBytes, name_.c_str()));
    std::memset(base_, kSentinel, tensor_.nbytes() + 2 * kGuardBytes);
    tensor_.data = base_ + kGuardBytes;
  }
  GuardedTensor(GuardedTensor&& o) noexcept
      : backend_(o.backend_),
        base_(std::exchange(o.base_, nullptr)),
        tensor_(o.tensor_),
        name_(std::move(o.name_)) {}
  GuardedTensor(const GuardedTensor&) = delete;
  GuardedTensor& operator=(const GuardedTensor&) = delete;
  ~GuardedTensor() {
    if (base_ == nullptr) return;
    EXPECT_TRUE(guards_intact()) << "guard bytes around " << name_ << " were overwritten";
    backend_->release(base_);
  }

  const Tensor& t() const { return tensor_; }
  operator const Tensor&() const { return tensor_; }

  void set(const std::vector<double>& values) {
    EXPECT_EQ(static_cast<int64_t>(values.size()), tensor_.numel());
    for (size_t i = 0; i < values.size(); ++i)
      tensor_.as<float>()[i] = static_cast<float>(values[i]);
  }
  void set_ids(const std::vector<int32_t>& ids) {
    std::memcpy(tensor_.data, ids.data(), ids.size() * sizeof(int32_t));
  }
  std::vector<double> get() const {
    const float* p = tensor_.as<float>();
    return std::vector<double>(p, p + tensor_.numel());
  }
  bool guards_intact() const {
    const unsigned char* after = base_ + kGuardBytes + tensor_.nbytes();
    for (size_t i = 0; i < kGuardBytes; ++i)
      if (base_[i] != kSentinel || after[i] != kSentinel) return false;
    return true;
  }

 private:
  Backend* backend_;
  unsigned char* base_;
  Tensor tensor_;
  std::string name_;
};

class CpuBackendTest : public ::testing::Test {
 protected:
  GuardedTensor input(Shape shape, const std::vector<double>& values, const char* name) {
    GuardedTensor g(*backend, DType::F32, shape, name);
    g.set(values);
    return g;
  }
  GuardedTensor ids(const std::vector<int32_t>& values, const char* name) {
    GuardedTensor g(*backend, DType::I32, Shape{static_cast<int64_t>(values.size())}, name);
    g.set_ids(values);
    return g;
  }
  GuardedTensor poisoned(Shape shape, const char* name) {
    return input(shape, nan_values(shape.numel()), name);
  }
  std::vector<double> random(int64_t n, double scale = 1.0) {
    std::vector<double> v = random_values(n, rng, scale);
    EXPECT_TRUE(all_nonzero(v));
    return v;
  }

  std::unique_ptr<Backend> backend = make_cpu_backend();
  std::mt19937_64 rng{2024};
};

void expect_close(const GuardedTensor& got, const std::vector<double>& want, const char* what,
                  double tol = kTol) {
  EXPECT_LT(relative_error(got.get(), want), tol) << what;
}

TEST_F(CpuBackendTest, Matmul) {
  const int64_t M = 33, N = 19, K = 29;
  // beta == 0 with out poisoned; beta with a separate c; beta with c = out.
  enum class COperand { kNone, kSeparate, kOut };
  for (int flags = 0; flags < 8; ++flags) {
    for (COperand c_mode : {COperand::kNone, COperand::kSeparate, COperand::kOut}) {
      const bool trans_a = flags & 1, trans_b = flags & 2, with_bias = flags & 4;
      SCOPED_TRACE(fmt::format("trans_a={} trans_b={} bias={} c={}", trans_a, trans_b, with_bias,
                               static_cast<int>(c_mode)));
      const std::vector<double> a = random(M * K), b = random(K * N), c = random(M * N);
      const std::vector<double> bias = random(N);
      const float alpha = 0.75f, beta = c_mode == COperand::kNone ? 0.0f : -0.5f;
      GuardedTensor ta = input(trans_a ? Shape{K, M} : Shape{M, K}, a, "a");
      GuardedTensor tb = input(trans_b ? Shape{N, K} : Shape{K, N}, b, "b");
      GuardedTensor tc = input({M, N}, c, "c");
      GuardedTensor tbias = input({N}, bias, "bias");
      GuardedTensor out =
          c_mode == COperand::kOut ? input({M, N}, c, "out") : poisoned({M, N}, "out");
      MatmulArgs args;
      args.out = out;
      args.a = ta;
      args.b = tb;
      args.trans_a = trans_a;
      args.trans_b = trans_b;
      args.alpha = alpha;
      args.beta = beta;
      if (c_mode == COperand::kSeparate) args.c = tc;
      if (with_bias) args.bias = tbias;
      backend->matmul(args);
      std::vector<double> want(M * N);
      ref::matmul_forward(want.data(), a.data(), b.data(), c.data(),
                          with_bias ? bias.data() : nullptr, M, N, K, trans_a, trans_b,
                          static_cast<double>(alpha), static_cast<double>(beta));
      expect_close(out, want, "out");
      expect_close(tc, c, "c is read only");
    }
  }
}

TEST_F(CpuBackendTest, MatmulFlattensLeadingDimensions) {
  const int64_t B = 2, T = 3, C = 5, N = 4;
  const std::vector<double> x = random(B * T * C), w = random(N * C);
  GuardedTensor tx = input({B, T, C}, x, "x"), tw = input({N, C}, w, "w");
  GuardedTensor out = poisoned({B, T, N}, "out");
  MatmulArgs args;
  args.out = out;
  args.a = tx;
  args.b = tw;
  args.trans_b = true;
  backend->matmul(args);
  std::vector<double> want(B * T * N);
  ref::matmul_forward(want.data(), x.data(), w.data(), static_cast<const double*>(nullptr),
                      static_cast<const double*>(nullptr), B * T, N, C, false, true, 1.0, 0.0);
  expect_close(out, want, "out");
}

TEST_F(CpuBackendTest, BiasBackward) {
  const int64_t M = 37, N = 45;
  const std::vector<double> dout = random(M * N), dbias0 = random(N);
  GuardedTensor tdout = input({M, N}, dout, "dout"), dbias = input({N}, dbias0, "dbias");
  backend->bias_backward(dbias, tdout);
  std::vector<double> want = dbias0;
  ref::bias_backward(want.data(), dout.data(), M, N);
  expect_close(dbias, want, "dbias");
}

TEST_F(CpuBackendTest, Embedding) {
  const int64_t V = 11, C = 37, N = 29;
  const std::vector<int32_t> tokens = random_ids(N, V, rng);
  const std::vector<double> table = random(V * C), dout = random(N * C), dtable0 = random(V * C);
  GuardedTensor ttokens = ids(tokens, "tokens"), ttable = input({V, C}, table, "table");
  GuardedTensor out = poisoned({N, C}, "out");
  backend->embedding_forward(out, ttokens, ttable);
  std::vector<double> want(N * C);
  ref::embedding_forward(want.data(), tokens.data(), table.data(), N, C);
  expect_close(out, want, "out");

  GuardedTensor tdout = input({N, C}, dout, "dout"), dtable = input({V, C}, dtable0, "dtable");
  backend->embedding_backward(dtable, tdout, ttokens);
  std::vector<double> want_dtable = dtable0;
  ref::embedding_backward(want_dtable.data(), dout.data(), tokens.data(), N, C);
  expect_close(dtable, want_dtable, "dtable");
}

TEST_F(CpuBackendTest, RmsNorm) {
  const int64_t N = 13, C = 70;
  const float eps = 1e-5f;
  const std::vector<double> x = random(N * C), w = random(C), dout = random(N * C);
  const std::vector<double> dx0 = random(N * C), dw0 = random(C);
  GuardedTensor tx = input({N, C}, x, "x"), tw = input({C}, w, "weight");
  GuardedTensor out = poisoned({N, C}, "out"), rstd = poisoned({N}, "rstd");
  backend->rmsnorm_forward(out, rstd, tx, tw, eps);
  std::vector<double> want(N * C), want_rstd(N);
  ref::rmsnorm_forward(want.data(), want_rstd.data(), x.data(), w.data(), N, C,
                       static_cast<double>(eps));
  expect_close(out, want, "out");
  expect_close(rstd, want_rstd, "rstd");

  const std::vector<double> rstd_in = rstd.get();  // both sides take the same saved statistic
  GuardedTensor tdout = input({N, C}, dout, "dout");
  GuardedTensor dx = input({N, C}, dx0, "dx"), dw = input({C}, dw0, "dweight");
  backend->rmsnorm_backward(dx, dw, tdout, tx, tw, rstd);
  std::vector<double> want_dx = dx0, want_dw = dw0;
  ref::rmsnorm_backward(want_dx.data(), want_dw.data(), dout.data(), x.data(), w.data(),
                        rstd_in.data(), N, C);
  expect_close(dx, want_dx, "dx");
  expect_close(dw, want_dw, "dweight");
}

std::vector<double> rope_freqs(int64_t seq, int64_t D) {
  std::vector<double> f(seq * D);
  for (int64_t t = 0; t < seq; ++t) {
    for (int64_t i = 0; i < D / 2; ++i) {
      const double angle = t * std::pow(10000.0, -2.0 * i / D);
      f[t * D + i] = static_cast<float>(std::cos(angle));
      f[t * D + D / 2 + i] = static_cast<float>(std::sin(angle));
    }
  }
  return f;
}

TEST_F(CpuBackendTest, Rope) {
  for (AttentionShape s : {AttentionShape{2, 7, 4, 2, 16}, AttentionShape{1, 5, 2, 2, 8}}) {
    SCOPED_TRACE(fmt::format("H={} KV={} D={}", s.heads, s.kv_heads, s.head_dim));
    const int64_t W = s.qkv_width();
    const std::vector<double> freqs = rope_freqs(s.seq, s.head_dim), qkv = random(s.tokens() * W);
    GuardedTensor tfreqs = input({s.seq, s.head_dim}, freqs, "freqs");
    GuardedTensor tqkv = input({s.batch, s.seq, W}, qkv, "qkv");
    backend->rope_forward(tqkv, tfreqs, s);
    std::vector<double> want = qkv;
    ref::rope_forward(want.data(), freqs.data(), s);
    expect_close(tqkv, want, "rope_forward");

    GuardedTensor tdqkv = input({s.batch, s.seq, W}, qkv, "dqkv");
    backend->rope_backward(tdqkv, tfreqs, s);
    want = qkv;
    ref::rope_backward(want.data(), freqs.data(), s);
    expect_close(tdqkv, want, "rope_backward");
  }
}

struct AttentionCase {
  int64_t B, T, H, KV, D;
  bool causal;
  int64_t window;
};

const AttentionCase kAttentionCases[] = {
    {2, 19, 4, 2, 16, true, 0}, {1, 23, 4, 1, 8, true, 5}, {2, 17, 2, 2, 16, false, 0},
    {1, 21, 4, 4, 8, true, 6},  {1, 9, 6, 3, 8, false, 4},
};

TEST_F(CpuBackendTest, Attention) {
  for (const AttentionCase& c : kAttentionCases) {
    const AttentionShape s{c.B, c.T,      c.H,      c.KV,
                           c.D, c.causal, c.window, 1.0f / std::sqrt(static_cast<float>(c.D))};
    SCOPED_TRACE(fmt::format("B={} T={} H={} KV={} D={} causal={} window={}", c.B, c.T, c.H, c.KV,
                             c.D, c.causal, c.window));
    const int64_t W = s.qkv_width(), HD = c.H * c.D;
    const std::vector<double> qkv = random(s.tokens() * W, 1.5), dout = random(s.tokens() * HD);
    GuardedTensor tqkv = input({c.B, c.T, W}, qkv, "qkv");
    GuardedTensor out = poisoned({c.B, c.T, HD}, "out"), lse = poisoned({c.B, c.H, c.T}, "lse");
    backend->attention_forward(out, lse, tqkv, s);
    std::vector<double> want(s.tokens() * HD), want_lse(c.B * c.H * c.T);
    ref::attention_forward(want.data(), want_lse.data(), qkv.data(), s);
    expect_close(out, want, "out");
    expect_close(lse, want_lse, "lse");

    const std::vector<double> out_in = out.get(), lse_in = lse.get();
    GuardedTensor tdout = input({c.B, c.T, HD}, dout, "dout");
    GuardedTensor dqkv = poisoned({c.B, c.T, W}, "dqkv");
    backend->attention_backward(dqkv, tdout, out, lse, tqkv, s);
    std::vector<double> want_dqkv(qkv.size());
    ref::attention_backward(want_dqkv.data(), dout.data(), out_in.data(), lse_in.data(), qkv.data(),
                            s);
    expect_close(dqkv, want_dqkv, "dqkv");
  }
}

TEST_F(CpuBackendTest, SwiGLU) {
  const int64_t N = 9, F = 37;
  const std::vector<double> gate_up = random(N * 2 * F, 4.0), dout = random(N * F);
  GuardedTensor tgu = input({N, 2 * F}, gate_up, "gate_up"), out = poisoned({N, F}, "out");
  backend->swiglu_forward(out, tgu);
  std::vector<double> want(N * F);
  ref::swiglu_forward(want.data(), gate_up.data(), N, F);
  expect_close(out, want, "out");

  GuardedTensor tdout = input({N, F}, dout, "dout"), dgu = poisoned({N, 2 * F}, "dgate_up");
  backend->swiglu_backward(dgu, tdout, tgu);
  std::vector<double> want_dgu(N * 2 * F);
  ref::swiglu_backward(want_dgu.data(), dout.data(), gate_up.data(), N, F);
  expect_close(dgu, want_dgu, "dgate_up");
}

TEST_F(CpuBackendTest, CrossEntropy) {
  const int64_t N = 13, V = 50;
  const float grad_scale = 0.37f;
  std::vector<int32_t> targets = random_ids(N, V, rng);
  targets[2] = -1;
  targets[7] = -100;
  const std::vector<double> logits = random(N * V, 4.0);
  std::vector<double> want_losses(N), want_dlogits(N * V);
  ref::cross_entropy(want_losses.data(), want_dlogits.data(), logits.data(), targets.data(), N, V,
                     static_cast<double>(grad_scale));
  GuardedTensor ttargets = ids(targets, "targets");
  for (int mode = 0; mode < 3; ++mode) {  // no dlogits, separate dlogits, dlogits = logits
    SCOPED_TRACE(fmt::format("mode {}", mode));
    GuardedTensor tlogits = input({N, V}, logits, "logits");
    GuardedTensor dlogits = poisoned({N, V}, "dlogits"), losses = poisoned({N}, "losses");
    const Tensor d = mode == 0 ? Tensor{} : mode == 1 ? dlogits.t() : tlogits.t();
    backend->cross_entropy(losses, tlogits, ttargets, d, grad_scale);
    expect_close(losses, want_losses, "losses");
    if (mode == 1) expect_close(dlogits, want_dlogits, "dlogits");
    if (mode == 2) expect_close(tlogits, want_dlogits, "dlogits in place");
    if (mode != 2) expect_close(tlogits, logits, "logits are read only");
  }
}

TEST_F(CpuBackendTest, SumAndSumSquares) {
  const int64_t n = 100003;  // several reduction chunks and a remainder
  const std::vector<double> x = random(n);
  GuardedTensor tx = input({n}, x, "x");
  for (bool squares : {false, true}) {
    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(fmt::format("squares={} accumulate={}", squares, accumulate));
      const double start = 1.25;
      GuardedTensor out = accumulate ? input({1}, {start}, "out") : poisoned({1}, "out");
      double want = start;
      if (squares) {
        backend->sum_squares(out, tx, accumulate);
        ref::sum_squares(&want, x.data(), n, accumulate);
      } else {
        backend->sum(out, tx, accumulate);
        ref::sum(&want, x.data(), n, accumulate);
      }
      expect_close(out, {want}, "out");
    }
  }
}

TEST_F(CpuBackendTest, AdamW) {
  const int64_t P = 50000;  // the first segment spans several chunks
  const std::vector<ParamSegment> segments = {
      {0, 20000, true}, {20000, 100, false}, {20100, 28900, true}};  // [49000, P) in none
  std::vector<double> master = random(P), m(P), v(P), params = random(P);
  GuardedTensor tmaster = input({P}, master, "master"), tparams = input({P}, params, "params");
  GuardedTensor tm = input({P}, std::vector<double>(P, 0.0), "exp_avg");
  GuardedTensor tv = input({P}, std::vector<double>(P, 0.0), "exp_avg_sq");
  GuardedTensor tgrad = input({P}, std::vector<double>(P, 0.0), "grad");
  GuardedTensor tnorm = input({1}, {0.0}, "grad_norm_sq");
  AdamWArgs args{tmaster, tgrad, tm, tv, tparams, tnorm, segments};
  args.lr = 1e-3f;
  args.beta1 = 0.9f;
  args.beta2 = 0.95f;
  args.weight_decay = 0.1f;
  args.max_grad_norm = 1.0f;
  const ref::AdamWSettings settings = ref::AdamWSettings::from(args);
  for (int64_t step = 1; step <= 3; ++step) {
    const std::vector<double> grad = random(P, 0.01 * step);
    tgrad.set(grad);
    double norm_sq = 0;
    ref::sum_squares(&norm_sq, grad.data(), P, false);
    norm_sq = static_cast<float>(norm_sq);  // the device holds it in fp32
    tnorm.set({norm_sq});
    args.step = step;
    ref::AdamWSettings s = settings;
    s.step = step;
    backend->adamw_step(args);
    ref::adamw_step(master.data(), params.data(), m.data(), v.data(), grad.data(), norm_sq,
                    segments, s);
    expect_close(tmaster, master, "master");
    expect_close(tparams, params, "params");
    expect_close(tm, m, "exp_avg");
    expect_close(tv, v, "exp_avg_sq");
  }
  // A non-finite norm leaves every tensor bit for bit as it was.
  for (double bad :
       {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    const std::vector<double> before = tmaster.get(), m_before = tm.get(), p_before = tparams.get();
    tnorm.set({bad});
    backend->adamw_step(args);
    EXPECT_EQ(tmaster.get(), before);
    EXPECT_EQ(tm.get(), m_before);
    EXPECT_EQ(tparams.get(), p_before);
  }
}

TEST_F(CpuBackendTest, InitNormalFillConvertCopy) {
  const int64_t n = 40000;
  GuardedTensor a = poisoned({n}, "a"), shard = poisoned({n - 12345}, "shard");
  backend->init_normal(a, 7, 0, 0.1f, 0.02f);
  backend->init_normal(shard, 7, 12345, 0.1f, 0.02f);
  std::vector<float> want(n);
  ref::init_normal(want.data(), n, 7, 0, 0.1f, 0.02f);
  const std::vector<double> got = a.get(), got_shard = shard.get();
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], want[i]) << i;
  for (int64_t i = 12345; i < n; ++i) ASSERT_EQ(got_shard[i - 12345], want[i]) << i;

  backend->fill(a, -2.5f);
  EXPECT_EQ(a.get(), std::vector<double>(n, -2.5));

  // fp32 -> bf16 rounds to nearest even (as dtype.h's host conversion) and bf16 -> fp32 is exact.
  std::vector<double> values = random(n, 100.0);
  values[0] = std::numeric_limits<float>::infinity();
  values[1] =
      bf16_bits_to_float(0x3f81) + 0.5 * (bf16_bits_to_float(0x3f82) - bf16_bits_to_float(0x3f81));
  GuardedTensor src = input({n}, values, "src"), back = poisoned({n}, "back");
  GuardedTensor half(*backend, DType::BF16, Shape{n}, "half");
  backend->convert(half, src);
  backend->convert(back, half);
  const uint16_t* bits = half.t().as<uint16_t>();
  EXPECT_EQ(bits[1], 0x3f82);  // a tie goes to the even mantissa
  const std::vector<double> round_trip = back.get();
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(bits[i], float_to_bf16_bits(static_cast<float>(values[i]))) << i;
    ASSERT_EQ(round_trip[i], round_to_bf16(static_cast<float>(values[i]))) << i;
  }

  GuardedTensor dst = poisoned({n}, "dst");
  backend->copy(dst, src);
  EXPECT_EQ(dst.get(), src.get());
  std::vector<float> host(n);
  backend->download(host.data(), src);
  for (int64_t i = 0; i < n; ++i) host[i] *= 2;
  backend->upload(dst, host.data());
  EXPECT_EQ(dst.get()[5], 2 * values[5]);

  const Tensor empty{nullptr, DType::F32, Shape{0, 8}, Device{}};  // a zero-byte DeviceBuffer
  EXPECT_NO_THROW(backend->upload(empty, host.data()));
  EXPECT_NO_THROW(backend->download(host.data(), empty));
  EXPECT_NO_THROW(backend->copy(empty, empty));
}

// ---- determinism ----

class ThreadCount {
 public:
  explicit ThreadCount(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ThreadCount() { omp_set_num_threads(saved_); }

 private:
  int saved_;
};

// Runs op with 1 and with 2 OpenMP threads and expects bitwise-equal outputs.
template <class Op>
void expect_thread_count_invariant(const GuardedTensor& out, Op op) {
  std::vector<double> results[2];
  for (int threads : {1, 2}) {
    ThreadCount scope(threads);
    op();
    results[threads - 1] = out.get();
  }
  EXPECT_EQ(std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(double)),
            0);
}

TEST_F(CpuBackendTest, ReductionsAreDeterministicAcrossThreadCounts) {
  const int64_t n = (int64_t{1} << 20) + 7;
  GuardedTensor x = input({n}, random(n), "x"), out = poisoned({1}, "out");
  expect_thread_count_invariant(out, [&] { backend->sum(out, x, false); });
  expect_thread_count_invariant(out, [&] { backend->sum_squares(out, x, false); });

  const int64_t M = 300, N = 70;
  GuardedTensor dout = input({M, N}, random(M * N), "dout"), dbias = poisoned({N}, "dbias");
  expect_thread_count_invariant(dbias, [&] {
    backend->fill(dbias, 0.5f);
    backend->bias_backward(dbias, dout);
  });
  GuardedTensor tokens = ids(random_ids(M, 13, rng), "tokens"),
                dtable = poisoned({13, N}, "dtable");
  expect_thread_count_invariant(dtable, [&] {
    backend->fill(dtable, 0.5f);
    backend->embedding_backward(dtable, dout, tokens);
  });
  GuardedTensor x2 = input({M, N}, random(M * N), "x"), w = input({N}, random(N), "w");
  GuardedTensor rstd = input({M}, random(M), "rstd"), dx = poisoned({M, N}, "dx");
  GuardedTensor dw = poisoned({N}, "dweight");
  expect_thread_count_invariant(dw, [&] {
    backend->fill(dx, 0.0f);
    backend->fill(dw, 0.0f);
    backend->rmsnorm_backward(dx, dw, dout, x2, w, rstd);
  });
}

TEST_F(CpuBackendTest, AttentionIsDeterministicAcrossThreadCounts) {
  for (int64_t kv : {2, 4}) {
    const AttentionShape s{2, 64, 4, kv, 16, true, 0, 0.25f};
    const int64_t W = s.qkv_width();
    GuardedTensor qkv = input({2, 64, W}, random(s.tokens() * W), "qkv");
    GuardedTensor out = poisoned({2, 64, 64}, "out"), lse = poisoned({2, 4, 64}, "lse");
    GuardedTensor dout = input({2, 64, 64}, random(s.tokens() * 64), "dout");
    GuardedTensor dqkv = poisoned({2, 64, W}, "dqkv");
    expect_thread_count_invariant(out, [&] { backend->attention_forward(out, lse, qkv, s); });
    expect_thread_count_invariant(
        dqkv, [&] { backend->attention_backward(dqkv, dout, out, lse, qkv, s); });
  }
}

// ---- memory and errors ----

TEST_F(CpuBackendTest, MemoryAccounting) {
  backend->reset_peak_memory();
  const MemoryStats before = backend->memory_stats();
  void* a = backend->allocate(1 << 20, "a");
  void* b = backend->allocate(3000, "b");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 64, 0u);
  EXPECT_EQ(backend->memory_stats().allocated_bytes, before.allocated_bytes + (1 << 20) + 3000);
  backend->release(a);
  const MemoryStats after = backend->memory_stats();
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes + 3000);
  EXPECT_EQ(after.peak_bytes, before.allocated_bytes + (1 << 20) + 3000);
  backend->reset_peak_memory();
  EXPECT_EQ(backend->memory_stats().peak_bytes, after.allocated_bytes);
  backend->release(b);
  EXPECT_GT(after.device_total_bytes, 0u);
  EXPECT_GT(after.device_free_bytes, 0u);
  EXPECT_LE(after.device_free_bytes, after.device_total_bytes);
}

TEST_F(CpuBackendTest, AbsurdAllocationThrowsOutOfMemory) {
  const size_t bytes = size_t{1} << 62;
  try {
    backend->allocate(bytes, "activation stash");
    FAIL() << "no exception";
  } catch (const OutOfMemoryError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(std::to_string(bytes)), std::string::npos) << message;
    EXPECT_NE(message.find("activation stash"), std::string::npos) << message;
    EXPECT_NE(message.find("available"), std::string::npos) << message;
  }
  EXPECT_EQ(backend->memory_stats().allocated_bytes, 0u);
}

TEST_F(CpuBackendTest, RejectsNonFp32AndBadIds) {
  GuardedTensor x(*backend, DType::BF16, Shape{2, 4}, "x");
  GuardedTensor w = input({4}, random(4), "w"), out = poisoned({2, 4}, "out");
  GuardedTensor rstd = poisoned({2}, "rstd");
  try {
    backend->rmsnorm_forward(out, rstd, x, w, 1e-5f);
    FAIL() << "no exception";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("bf16"), std::string::npos) << e.what();
  }
  GuardedTensor table = input({3, 4}, random(12), "table");
  GuardedTensor tokens = ids({0, 3}, "tokens");
  EXPECT_THROW(backend->embedding_forward(out, tokens, table), InternalError);
  GuardedTensor logits = input({2, 3}, random(6), "logits"), targets = ids({1, 3}, "targets");
  EXPECT_THROW(backend->cross_entropy(rstd, logits, targets, Tensor{}, 1.0f), InternalError);
}

TEST_F(CpuBackendTest, Description) {
  EXPECT_EQ(backend->description(),
            fmt::format("cpu (OpenBLAS, {} threads)", omp_get_max_threads()));
  EXPECT_EQ(backend->device().kind, DeviceKind::CPU);
}

}  // namespace
}  // namespace tessera
