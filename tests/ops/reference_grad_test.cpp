// Gradient checks of the double reference (backend/cpu/reference.h) against central finite
// differences. Every check uses the scalar loss L = sum(out * G) with random G, so that every
// output element matters, and differentiates with respect to every input. Gradients that the
// op API declares "accumulates" start from random contents, which must be added to; the
// others start as NaN, which must be overwritten.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "op_test_util.h"
#include "tessera/backend/cpu/reference.h"

namespace tessera {
namespace {

using test::all_nonzero;
using test::dot;
using test::expect_gradient;
using test::nan_values;
using test::numerical_gradient;
using test::random_values;

// freqs (T, D) as the model builds it: row t = cos(t * inv_freq) then sin(t * inv_freq).
std::vector<double> rope_freqs(int64_t seq, int64_t D, double base) {
  std::vector<double> f(seq * D);
  for (int64_t t = 0; t < seq; ++t) {
    for (int64_t i = 0; i < D / 2; ++i) {
      const double angle = t * std::pow(base, -2.0 * i / D);
      f[t * D + i] = std::cos(angle);
      f[t * D + D / 2 + i] = std::sin(angle);
    }
  }
  return f;
}

TEST(ReferenceGrad, Matmul) {
  std::mt19937_64 rng(1);
  struct Dims {
    int64_t M, N, K;
  };
  for (Dims d : {Dims{3, 5, 4}, Dims{6, 1, 7}, Dims{1, 9, 2}}) {
    for (int flags = 0; flags < 8; ++flags) {
      const bool trans_a = flags & 1, trans_b = flags & 2, with_bias = flags & 4;
      SCOPED_TRACE(fmt::format("M={} N={} K={} trans_a={} trans_b={} bias={}", d.M, d.N, d.K,
                               trans_a, trans_b, with_bias));
      const double alpha = 0.7, beta = 0.3;
      std::vector<double> a = random_values(d.M * d.K, rng), b = random_values(d.K * d.N, rng);
      std::vector<double> c = random_values(d.M * d.N, rng), bias = random_values(d.N, rng);
      const std::vector<double> G = random_values(d.M * d.N, rng);
      ASSERT_TRUE(all_nonzero(a) && all_nonzero(b) && all_nonzero(c) && all_nonzero(bias));
      auto loss = [&] {
        std::vector<double> out(d.M * d.N);
        ref::matmul_forward(out.data(), a.data(), b.data(), c.data(),
                            with_bias ? bias.data() : nullptr, d.M, d.N, d.K, trans_a, trans_b,
                            alpha, beta);
        return dot(out, G);
      };
      const std::vector<double> da0 = random_values(a.size(), rng),
                                db0 = random_values(b.size(), rng);
      const std::vector<double> dc0 = random_values(c.size(), rng),
                                dbias0 = random_values(d.N, rng);
      std::vector<double> da = da0, db = db0, dc = dc0, dbias = dbias0;
      ref::matmul_backward(da.data(), db.data(), with_bias ? dbias.data() : nullptr, dc.data(),
                           G.data(), a.data(), b.data(), d.M, d.N, d.K, trans_a, trans_b, alpha,
                           beta);
      expect_gradient(da, da0, numerical_gradient(a, loss), "da");
      expect_gradient(db, db0, numerical_gradient(b, loss), "db");
      expect_gradient(dc, dc0, numerical_gradient(c, loss), "dc");
      if (with_bias) expect_gradient(dbias, dbias0, numerical_gradient(bias, loss), "dbias");
    }
  }
}

TEST(ReferenceGrad, BiasBackward) {
  std::mt19937_64 rng(2);
  const int64_t M = 7, N = 5;
  std::vector<double> bias = random_values(N, rng);
  const std::vector<double> x = random_values(M * N, rng), G = random_values(M * N, rng);
  ASSERT_TRUE(all_nonzero(bias) && all_nonzero(x));
  auto loss = [&] {  // out = x + bias broadcast over rows
    double l = 0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) l += (x[m * N + n] + bias[n]) * G[m * N + n];
    return l;
  };
  const std::vector<double> dbias0 = random_values(N, rng);
  std::vector<double> dbias = dbias0;
  ref::bias_backward(dbias.data(), G.data(), M, N);
  expect_gradient(dbias, dbias0, numerical_gradient(bias, loss), "dbias");
}

TEST(ReferenceGrad, Embedding) {
  std::mt19937_64 rng(3);
  const int64_t V = 5, C = 3, N = 11;
  const std::vector<int32_t> tokens = {0, 3, 3, 1, 4, 0, 3, 2, 2, 0, 1};  // with repeats
  std::vector<double> table = random_values(V * C, rng);
  const std::vector<double> G = random_values(N * C, rng);
  ASSERT_TRUE(all_nonzero(table));
  auto loss = [&] {
    std::vector<double> out(N * C);
    ref::embedding_forward(out.data(), tokens.data(), table.data(), N, C);
    return dot(out, G);
  };
  const std::vector<double> dtable0 = random_values(V * C, rng);
  std::vector<double> dtable = dtable0;
  ref::embedding_backward(dtable.data(), G.data(), tokens.data(), N, C);
  expect_gradient(dtable, dtable0, numerical_gradient(table, loss), "dtable");
}

TEST(ReferenceGrad, RmsNorm) {
  std::mt19937_64 rng(4);
  for (auto [N, C] : {std::pair<int64_t, int64_t>{3, 5}, {2, 8}, {1, 17}}) {
    SCOPED_TRACE(fmt::format("N={} C={}", N, C));
    const double eps = 1e-5;
    std::vector<double> x = random_values(N * C, rng), w = random_values(C, rng);
    const std::vector<double> G = random_values(N * C, rng);
    ASSERT_TRUE(all_nonzero(x) && all_nonzero(w));
    std::vector<double> out(N * C), rstd(N);
    auto loss = [&] {
      ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
      return dot(out, G);
    };
    loss();  // rstd at the point of differentiation
    const std::vector<double> rstd_at_x = rstd;
    const std::vector<double> dx0 = random_values(N * C, rng), dw0 = random_values(C, rng);
    std::vector<double> dx = dx0, dw = dw0;
    ref::rmsnorm_backward(dx.data(), dw.data(), G.data(), x.data(), w.data(), rstd_at_x.data(), N,
                          C);
    expect_gradient(dx, dx0, numerical_gradient(x, loss), "dx");
    expect_gradient(dw, dw0, numerical_gradient(w, loss), "dweight");
  }
}

TEST(ReferenceGrad, Rope) {
  std::mt19937_64 rng(5);
  for (AttentionShape s : {AttentionShape{2, 3, 2, 1, 8}, AttentionShape{1, 5, 4, 2, 16},
                           AttentionShape{1, 4, 2, 2, 8}}) {
    SCOPED_TRACE(
        fmt::format("B={} T={} H={} KV={} D={}", s.batch, s.seq, s.heads, s.kv_heads, s.head_dim));
    const std::vector<double> freqs = rope_freqs(s.seq, s.head_dim, 100.0);
    std::vector<double> qkv = random_values(s.tokens() * s.qkv_width(), rng);
    const std::vector<double> G = random_values(qkv.size(), rng);
    ASSERT_TRUE(all_nonzero(qkv));
    auto loss = [&] {
      std::vector<double> rotated = qkv;
      ref::rope_forward(rotated.data(), freqs.data(), s);
      return dot(rotated, G);
    };
    std::vector<double> dqkv = G;  // the gradient flowing into the in-place op
    ref::rope_backward(dqkv.data(), freqs.data(), s);
    expect_gradient(dqkv, numerical_gradient(qkv, loss), "dqkv");
  }
}

struct AttentionCase {
  int64_t B, T, H, KV, D;
  bool causal;
  int64_t window;
};

TEST(ReferenceGrad, Attention) {
  std::mt19937_64 rng(6);
  const AttentionCase cases[] = {
      {2, 5, 4, 2, 8, true, 0},   // GQA 2:1, causal
      {1, 7, 4, 1, 16, true, 3},  // MQA, sliding window < T
      {1, 6, 2, 2, 8, false, 0},  // MHA, full
      {2, 6, 4, 4, 8, false, 2},  // MHA, full with a window
      {1, 9, 4, 2, 16, true, 4},  // GQA, window, odd T
      {1, 4, 2, 1, 8, true, 1},   // window 1: each query sees only itself
  };
  for (const AttentionCase& c : cases) {
    AttentionShape s{c.B, c.T,      c.H,      c.KV,
                     c.D, c.causal, c.window, 1.0f / std::sqrt(static_cast<float>(c.D))};
    SCOPED_TRACE(fmt::format("B={} T={} H={} KV={} D={} causal={} window={}", c.B, c.T, c.H, c.KV,
                             c.D, c.causal, c.window));
    std::vector<double> qkv = random_values(s.tokens() * s.qkv_width(), rng, 1.5);
    const std::vector<double> G = random_values(s.tokens() * c.H * c.D, rng);
    ASSERT_TRUE(all_nonzero(qkv));
    std::vector<double> out(G.size()), lse(c.B * c.H * c.T);
    auto loss = [&] {
      ref::attention_forward(out.data(), lse.data(), qkv.data(), s);
      return dot(out, G);
    };
    loss();
    const std::vector<double> out_at_x = out, lse_at_x = lse;
    std::vector<double> dqkv = nan_values(qkv.size());
    ref::attention_backward(dqkv.data(), G.data(), out_at_x.data(), lse_at_x.data(), qkv.data(), s);
    expect_gradient(dqkv, numerical_gradient(qkv, loss), "dqkv");
  }
}

TEST(ReferenceGrad, SwiGLU) {
  std::mt19937_64 rng(7);
  for (auto [N, F] : {std::pair<int64_t, int64_t>{3, 5}, {1, 8}, {4, 1}}) {
    SCOPED_TRACE(fmt::format("N={} F={}", N, F));
    std::vector<double> gate_up = random_values(N * 2 * F, rng, 4.0);
    const std::vector<double> G = random_values(N * F, rng);
    ASSERT_TRUE(all_nonzero(gate_up));
    auto loss = [&] {
      std::vector<double> out(N * F);
      ref::swiglu_forward(out.data(), gate_up.data(), N, F);
      return dot(out, G);
    };
    std::vector<double> dgate_up = nan_values(gate_up.size());
    ref::swiglu_backward(dgate_up.data(), G.data(), gate_up.data(), N, F);
    expect_gradient(dgate_up, numerical_gradient(gate_up, loss), "dgate_up");
  }
}

// dlogits is grad_scale times the gradient of sum(losses), a single scalar weight, so here the
// loss is grad_scale * sum(losses) rather than a random weighting of the outputs.
TEST(ReferenceGrad, CrossEntropy) {
  std::mt19937_64 rng(8);
  const int64_t N = 6, V = 7;
  const double grad_scale = 0.37;
  const std::vector<int32_t> targets = {3, -1, 0, 6, -100, 3};  // two ignored rows
  std::vector<double> logits = random_values(N * V, rng, 3.0);
  ASSERT_TRUE(all_nonzero(logits));
  auto loss = [&] {
    std::vector<double> losses(N);
    ref::cross_entropy(losses.data(), static_cast<double*>(nullptr), logits.data(), targets.data(),
                       N, V, grad_scale);
    double l = 0;
    for (double x : losses) l += x;
    return grad_scale * l;
  };
  const std::vector<double> numeric = numerical_gradient(logits, loss);

  std::vector<double> losses(N), dlogits = nan_values(logits.size());
  ref::cross_entropy(losses.data(), dlogits.data(), logits.data(), targets.data(), N, V,
                     grad_scale);
  expect_gradient(dlogits, numeric, "dlogits");

  std::vector<double> in_place = logits;  // dlogits aliasing logits
  std::vector<double> losses_in_place(N);
  ref::cross_entropy(losses_in_place.data(), in_place.data(), in_place.data(), targets.data(), N, V,
                     grad_scale);
  expect_gradient(in_place, numeric, "dlogits in place");
  EXPECT_EQ(losses_in_place, losses);
}

}  // namespace
}  // namespace tessera
