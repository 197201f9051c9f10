// Forward checks of the double reference against independent brute-force formulas written
// here from the op API's definitions (explicit transposes, explicit mask matrices, direct
// rotation angles, unshifted log-sum-exp, a textbook AdamW loop).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "op_test_util.h"
#include "tessera/backend/cpu/reference.h"
#include "tessera/core/fp8.h"
#include "tessera/core/random.h"

namespace tessera {
namespace {

using test::all_nonzero;
using test::random_values;
using test::relative_error;

constexpr double kTol = 1e-12;  // double against double: only summation order differs

TEST(ReferenceForward, MatmulMatchesExplicitProduct) {
  std::mt19937_64 rng(11);
  const int64_t M = 4, N = 3, K = 5;
  for (int flags = 0; flags < 16; ++flags) {
    const bool trans_a = flags & 1, trans_b = flags & 2, with_bias = flags & 4,
               c_is_out = flags & 8;
    SCOPED_TRACE(fmt::format("trans_a={} trans_b={} bias={} c_is_out={}", trans_a, trans_b,
                             with_bias, c_is_out));
    const std::vector<double> a = random_values(M * K, rng), b = random_values(K * N, rng);
    const std::vector<double> c = random_values(M * N, rng), bias = random_values(N, rng);
    ASSERT_TRUE(all_nonzero(a) && all_nonzero(b) && all_nonzero(c) && all_nonzero(bias));
    // op(a)[m][k] and op(b)[k][n], materialised from the stored layouts.
    std::vector<std::vector<double>> A(M, std::vector<double>(K)), B(K, std::vector<double>(N));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) A[m][k] = trans_a ? a[k * M + m] : a[m * K + k];
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) B[k][n] = trans_b ? b[n * K + k] : b[k * N + n];
    const double alpha = -1.3, beta = 0.6;
    std::vector<double> want(M * N);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k) acc += A[m][k] * B[k][n];
        want[m * N + n] = alpha * acc + beta * c[m * N + n] + (with_bias ? bias[n] : 0.0);
      }
    }
    std::vector<double> out = c_is_out ? c : test::nan_values(M * N);
    ref::matmul_forward(out.data(), a.data(), b.data(), c_is_out ? nullptr : c.data(),
                        with_bias ? bias.data() : nullptr, M, N, K, trans_a, trans_b, alpha, beta);
    EXPECT_LT(relative_error(out, want), kTol);
  }
}

TEST(ReferenceForward, MatmulBetaZeroIgnoresOut) {
  std::mt19937_64 rng(12);
  const std::vector<double> a = random_values(6, rng), b = random_values(6, rng);
  std::vector<double> out = test::nan_values(4);
  ref::matmul_forward(out.data(), a.data(), b.data(), static_cast<const double*>(nullptr),
                      static_cast<const double*>(nullptr), 2, 2, 3, false, false, 1.0, 0.0);
  for (double x : out) EXPECT_TRUE(std::isfinite(x));
}

// The mask rule of AttentionShape, written out on its own.
bool visible(const AttentionShape& s, int64_t i, int64_t j) {
  return (!s.causal || j <= i) && (s.window <= 0 || i - s.window < j);
}

TEST(ReferenceForward, AttentionMatchesExplicitMaskedSoftmax) {
  std::mt19937_64 rng(13);
  struct Case {
    int64_t B, T, H, KV, D;
    bool causal;
    int64_t window;
  };
  for (Case c : {Case{2, 6, 4, 2, 8, true, 0}, Case{1, 9, 4, 1, 16, true, 4},
                 Case{1, 5, 2, 2, 8, false, 0}, Case{1, 7, 6, 3, 8, false, 3},
                 Case{1, 8, 4, 2, 8, true, 8}, Case{1, 5, 2, 1, 8, true, 100}}) {
    const AttentionShape s{c.B, c.T, c.H, c.KV, c.D, c.causal, c.window, 0.3f};
    SCOPED_TRACE(fmt::format("B={} T={} H={} KV={} D={} causal={} window={}", c.B, c.T, c.H, c.KV,
                             c.D, c.causal, c.window));
    const int64_t W = s.qkv_width();
    const std::vector<double> qkv = random_values(s.tokens() * W, rng, 2.0);
    ASSERT_TRUE(all_nonzero(qkv));
    std::vector<double> want_out(s.tokens() * c.H * c.D), want_lse(c.B * c.H * c.T);
    for (int64_t b = 0; b < c.B; ++b) {
      for (int64_t h = 0; h < c.H; ++h) {
        const int64_t kv = h / (c.H / c.KV);
        auto q = [&](int64_t t, int64_t d) { return qkv[(b * c.T + t) * W + h * c.D + d]; };
        auto k = [&](int64_t t, int64_t d) {
          return qkv[(b * c.T + t) * W + (c.H + kv) * c.D + d];
        };
        auto v = [&](int64_t t, int64_t d) {
          return qkv[(b * c.T + t) * W + (c.H + c.KV + kv) * c.D + d];
        };
        for (int64_t i = 0; i < c.T; ++i) {
          std::vector<double> e(c.T, 0.0);  // unnormalised probabilities, 0 where masked
          double z = 0;
          for (int64_t j = 0; j < c.T; ++j) {
            if (!visible(s, i, j)) continue;
            double score = 0;
            for (int64_t d = 0; d < c.D; ++d) score += q(i, d) * k(j, d);
            e[j] = std::exp(score * static_cast<double>(s.scale));
            z += e[j];
          }
          want_lse[(b * c.H + h) * c.T + i] = std::log(z);
          for (int64_t d = 0; d < c.D; ++d) {
            double o = 0;
            for (int64_t j = 0; j < c.T; ++j) o += e[j] / z * v(j, d);
            want_out[(b * c.T + i) * c.H * c.D + h * c.D + d] = o;
          }
        }
      }
    }
    std::vector<double> out = test::nan_values(want_out.size()),
                        lse = test::nan_values(want_lse.size());
    ref::attention_forward(out.data(), lse.data(), qkv.data(), s);
    EXPECT_LT(relative_error(out, want_out), kTol);
    EXPECT_LT(relative_error(lse, want_lse), kTol);
  }
}

TEST(ReferenceForward, AttentionWindowOneCopiesValues) {
  std::mt19937_64 rng(14);
  const AttentionShape s{1, 5, 2, 1, 8, true, 1, 0.35f};
  const std::vector<double> qkv = random_values(s.tokens() * s.qkv_width(), rng);
  std::vector<double> out(s.tokens() * 2 * 8), lse(2 * 5);
  ref::attention_forward(out.data(), lse.data(), qkv.data(), s);
  for (int64_t t = 0; t < 5; ++t)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t d = 0; d < 8; ++d)
        EXPECT_DOUBLE_EQ(out[t * 16 + h * 8 + d], qkv[t * s.qkv_width() + 3 * 8 + d]);
}

// FP8 attention (ref::attention_fp8_forward): with one visible key a row's probability is
// 1 (its code 256; the row sum 256 to within the fp32 rounding of its score), so the output is
// the value's code times its tile's descale: the value rounded to e4m3 on its tile's scale.
TEST(ReferenceForward, Fp8AttentionOfOneKeyReturnsTheValueOnItsTilesFp8Grid) {
  std::mt19937_64 rng(15);
  AttentionShape s{1, 300, 2, 1, 128, true, 1, 0.125f};
  s.fp8 = true;
  const int64_t W = s.qkv_width(), D = 128;
  std::vector<double> qkv = random_values(s.tokens() * W, rng, 3.0);
  std::vector<double> out(s.tokens() * 2 * D), lse(2 * s.seq);
  ref::attention_fp8_forward(out.data(), lse.data(), qkv.data(), s);
  const int64_t v_col = 3 * D;  // 2 query heads, 1 key head, then the value head
  for (int64_t tile = 0; tile < 3; ++tile) {
    const int64_t t0 = 128 * tile, t1 = std::min<int64_t>(s.seq, t0 + 128);
    float amax = 0;
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t d = 0; d < D; ++d)
        amax = std::max(amax, std::fabs(static_cast<float>(qkv[t * W + v_col + d])));
    const float scale = fp8_block_scale(amax, 448.f);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const float coded =
              round_to_fp8(static_cast<float>(qkv[t * W + v_col + d]) * scale, DType::E4M3);
          const double want = static_cast<double>(coded) / scale;  // e4m3 steps are 6% apart
          ASSERT_NEAR(out[t * 2 * D + h * D + d], want, 1e-5 * std::fabs(want))
              << "token " << t << " head " << h << " dim " << d;
        }
  }
}

// Against exact attention over the same inputs the FP8 form stays within its codes' error
// (e4m3 keeps 3 mantissa bits: up to 2^-4 relative a value; full attention's outputs, averages
// over many keys, are small beside it), and does differ: the codes are used.
TEST(ReferenceForward, Fp8AttentionStaysNearAttention) {
  std::mt19937_64 rng(16);
  for (AttentionShape s : {AttentionShape{2, 300, 4, 2, 128, true, 0, 0.0884f},
                           AttentionShape{1, 260, 2, 2, 128, false, 0, 0.0884f},
                           AttentionShape{1, 400, 2, 1, 128, true, 150, 0.0884f}}) {
    SCOPED_TRACE(fmt::format("T={} causal={} window={}", s.seq, s.causal, s.window));
    const std::vector<double> qkv = random_values(s.tokens() * s.qkv_width(), rng, 2.0);
    std::vector<double> out(s.tokens() * s.out_width()), lse(s.batch * s.heads * s.seq);
    std::vector<double> out8 = out, lse8 = lse;
    ref::attention_forward(out.data(), lse.data(), qkv.data(), s);
    s.fp8 = true;
    ref::attention_fp8_forward(out8.data(), lse8.data(), qkv.data(), s);
    EXPECT_LT(relative_error(out8, out), 0.08);
    EXPECT_GT(relative_error(out8, out), 1e-3);
    EXPECT_LT(relative_error(lse8, lse), 0.01);
  }
}

TEST(ReferenceForward, RopeMatchesExplicitRotation) {
  std::mt19937_64 rng(15);
  const AttentionShape s{2, 6, 4, 2, 16};
  const double base = 10000.0;
  const int64_t D = s.head_dim, W = s.qkv_width();
  std::vector<double> freqs(s.seq * D);
  for (int64_t t = 0; t < s.seq; ++t) {
    for (int64_t i = 0; i < D / 2; ++i) {
      freqs[t * D + i] = std::cos(t * std::pow(base, -2.0 * i / D));
      freqs[t * D + D / 2 + i] = std::sin(t * std::pow(base, -2.0 * i / D));
    }
  }
  const std::vector<double> qkv = random_values(s.tokens() * W, rng);
  ASSERT_TRUE(all_nonzero(qkv));
  std::vector<double> want = qkv;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t t = 0; t < s.seq; ++t) {
      for (int64_t head = 0; head < s.heads + s.kv_heads; ++head) {  // values stay as they are
        const double* x = &qkv[(b * s.seq + t) * W + head * D];
        double* y = &want[(b * s.seq + t) * W + head * D];
        for (int64_t i = 0; i < D / 2; ++i) {  // HF rotate_half: x * cos + rotate_half(x) * sin
          const double theta = t / std::pow(base, 2.0 * i / D);
          y[i] = x[i] * std::cos(theta) - x[i + D / 2] * std::sin(theta);
          y[i + D / 2] = x[i + D / 2] * std::cos(theta) + x[i] * std::sin(theta);
        }
      }
    }
  }
  std::vector<double> got = qkv;
  ref::rope_forward(got.data(), freqs.data(), s);
  EXPECT_LT(relative_error(got, want), kTol);
  ref::rope_backward(got.data(), freqs.data(), s);  // a rotation's transpose is its inverse
  EXPECT_LT(relative_error(got, qkv), kTol);
}

TEST(ReferenceForward, CrossEntropyMatchesLogSumExp) {
  std::mt19937_64 rng(16);
  const int64_t N = 5, V = 9;
  const std::vector<int32_t> targets = {2, 8, -1, 0, 4};
  const std::vector<double> logits = random_values(N * V, rng, 5.0);
  std::vector<double> losses(N), dlogits(N * V);
  ref::cross_entropy(losses.data(), dlogits.data(), logits.data(), targets.data(), N, V, 1.0);
  for (int64_t n = 0; n < N; ++n) {
    double z = 0;
    for (int64_t v = 0; v < V; ++v) z += std::exp(logits[n * V + v]);
    if (targets[n] < 0) {
      EXPECT_EQ(losses[n], 0.0);
      for (int64_t v = 0; v < V; ++v) EXPECT_EQ(dlogits[n * V + v], 0.0);
      continue;
    }
    EXPECT_NEAR(losses[n], std::log(z) - logits[n * V + targets[n]], 1e-12);
    double row_sum = 0;
    for (int64_t v = 0; v < V; ++v) row_sum += dlogits[n * V + v];
    EXPECT_NEAR(row_sum, 0.0, 1e-12);
  }
}

TEST(ReferenceForward, CrossEntropyIsStableForLargeLogits) {
  std::mt19937_64 rng(17);
  const int64_t N = 3, V = 6;
  const std::vector<int32_t> targets = {1, 5, 0};
  const std::vector<double> logits = random_values(N * V, rng, 3.0);
  std::vector<float> shifted(N * V), small(N * V);
  for (size_t i = 0; i < logits.size(); ++i) {
    small[i] = static_cast<float>(logits[i]);
    shifted[i] = static_cast<float>(logits[i] + 1e4);  // exp would overflow without the max
  }
  std::vector<float> want(N), got(N), dwant(N * V), dgot(N * V);
  ref::cross_entropy(want.data(), dwant.data(), small.data(), targets.data(), N, V, 1.0f);
  ref::cross_entropy(got.data(), dgot.data(), shifted.data(), targets.data(), N, V, 1.0f);
  for (int64_t n = 0; n < N; ++n) EXPECT_NEAR(got[n], want[n], 2e-3f);  // 1e4 + x loses ~1e-3
  for (size_t i = 0; i < dgot.size(); ++i) EXPECT_NEAR(dgot[i], dwant[i], 2e-3f);
}

TEST(ReferenceForward, RmsNormSwiGLUEmbeddingSums) {
  std::mt19937_64 rng(18);
  const int64_t N = 3, C = 7;
  const std::vector<double> x = random_values(N * C, rng), w = random_values(C, rng);
  std::vector<double> out(N * C), rstd(N);
  ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6);
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += x[n * C + c] * x[n * C + c] / C;
    EXPECT_NEAR(rstd[n], 1.0 / std::sqrt(ms + 1e-6), 1e-12);
    for (int64_t c = 0; c < C; ++c)
      EXPECT_NEAR(out[n * C + c], x[n * C + c] / std::sqrt(ms + 1e-6) * w[c], 1e-12);
  }

  const int64_t F = 4;
  const std::vector<double> gate_up = random_values(N * 2 * F, rng, 6.0);
  std::vector<double> act(N * F);
  ref::swiglu_forward(act.data(), gate_up.data(), N, F);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t f = 0; f < F; ++f) {
      const double g = gate_up[n * 2 * F + f], u = gate_up[n * 2 * F + F + f];
      EXPECT_NEAR(act[n * F + f], g / (1.0 + std::exp(-g)) * u, 1e-12);
    }
  }

  const std::vector<int32_t> tokens = {2, 0, 2};
  const std::vector<double> table = random_values(3 * C, rng);
  std::vector<double> rows(3 * C);
  ref::embedding_forward(rows.data(), tokens.data(), table.data(), 3, C);
  for (int64_t n = 0; n < 3; ++n)
    for (int64_t c = 0; c < C; ++c) EXPECT_EQ(rows[n * C + c], table[tokens[n] * C + c]);

  double total = 0, squares = 0;
  for (double v : x) {
    total += v;
    squares += v * v;
  }
  double s = 0;
  ref::sum(&s, x.data(), N * C, false);
  EXPECT_NEAR(s, total, 1e-12);
  ref::sum(&s, x.data(), N * C, true);
  EXPECT_NEAR(s, 2 * total, 1e-12);
  ref::sum_squares(&s, x.data(), N * C, false);
  EXPECT_NEAR(s, squares, 1e-12);
  ref::sum_squares(&s, x.data(), N * C, true);
  EXPECT_NEAR(s, 2 * squares, 1e-12);
}

TEST(ReferenceForward, InitNormalUsesTheCounterStream) {
  const int64_t n = 1000;
  std::vector<float> full(n), shard(n - 300);
  ref::init_normal(full.data(), n, 42, 0, 0.5f, 0.02f);
  ref::init_normal(shard.data(), n - 300, 42, 300, 0.5f, 0.02f);  // a shard of the same stream
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(full[i], std::fma(0.02f, random_normal(42, i), 0.5f));
  for (int64_t i = 300; i < n; ++i) EXPECT_EQ(shard[i - 300], full[i]);
  double mean = 0;
  for (float v : full) mean += v / n;
  EXPECT_NEAR(mean, 0.5, 0.02 * 4 / std::sqrt(n));
}

// AdamW as in the PyTorch documentation, one scalar at a time, with clipping and skipping as
// the op API specifies.
struct TextbookAdamW {
  double lr, beta1, beta2, eps, wd, max_norm;

  void step(std::vector<double>& p, std::vector<double>& m, std::vector<double>& v,
            const std::vector<double>& g, const std::vector<bool>& decays,
            const std::vector<bool>& covered, int64_t t, double norm_sq) const {
    if (std::isnan(norm_sq) || std::isinf(norm_sq)) return;
    double clip = 1;
    if (max_norm > 0 && max_norm / (std::sqrt(norm_sq) + 1e-6) < 1)
      clip = max_norm / (std::sqrt(norm_sq) + 1e-6);
    for (size_t i = 0; i < p.size(); ++i) {
      if (!covered[i]) continue;
      const double gi = g[i] * clip;
      if (decays[i]) p[i] -= lr * wd * p[i];
      m[i] = beta1 * m[i] + (1 - beta1) * gi;
      v[i] = beta2 * v[i] + (1 - beta2) * gi * gi;
      const double m_hat = m[i] / (1 - std::pow(beta1, t));
      const double v_hat = v[i] / (1 - std::pow(beta2, t));
      p[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
  }
};

TEST(ReferenceForward, AdamWMatchesTextbookLoop) {
  std::mt19937_64 rng(19);
  const int64_t P = 40;
  // [0, 15) decays, [15, 22) does not, [22, 24) is in no segment, [24, 40) decays.
  const std::vector<ParamSegment> segments = {{0, 15, true}, {15, 7, false}, {24, 16, true}};
  std::vector<bool> decays(P, false), covered(P, false);
  for (const ParamSegment& seg : segments) {
    for (int64_t i = seg.offset; i < seg.offset + seg.count; ++i) {
      covered[i] = true;
      decays[i] = seg.decay;
    }
  }
  ref::AdamWSettings settings;
  settings.lr = 0.01f;
  settings.beta1 = 0.8f;
  settings.beta2 = 0.95f;
  settings.eps = 1e-6f;
  settings.weight_decay = 0.1f;
  const TextbookAdamW textbook{settings.lr,  settings.beta1,        settings.beta2,
                               settings.eps, settings.weight_decay, 0.0};

  for (double max_norm : {0.0, 0.5, 1e3}) {  // clipping off, active, configured but inactive
    SCOPED_TRACE(fmt::format("max_grad_norm={}", max_norm));
    settings.max_grad_norm = static_cast<float>(max_norm);
    TextbookAdamW want_opt = textbook;
    want_opt.max_norm = settings.max_grad_norm;
    std::vector<double> p = random_values(P, rng), m(P, 0.0), v(P, 0.0);
    std::vector<double> want_p = p, want_m = m, want_v = v, params = test::nan_values(P);
    int64_t t = 0;
    for (int iter = 0; iter < 6; ++iter) {
      const std::vector<double> g = random_values(P, rng);
      // Non-finite norms (iterations 2 and 4) must leave everything as it was.
      double norm_sq = test::dot(g, g);
      if (iter == 2) norm_sq = std::numeric_limits<double>::quiet_NaN();
      if (iter == 4) norm_sq = std::numeric_limits<double>::infinity();
      if (std::isfinite(norm_sq)) ++t;
      settings.step = std::max<int64_t>(t, 1);
      const std::vector<double> before = p, params_before = params;
      ref::adamw_step(p.data(), params.data(), m.data(), v.data(), g.data(), norm_sq, segments,
                      settings);
      want_opt.step(want_p, want_m, want_v, g, decays, covered, settings.step, norm_sq);
      if (!std::isfinite(norm_sq)) {
        EXPECT_EQ(p, before);
        for (int64_t i = 0; i < P; ++i) {
          EXPECT_TRUE(std::isnan(params[i]) == std::isnan(params_before[i]));
        }
      }
      EXPECT_LT(relative_error(p, want_p), 1e-12);
      EXPECT_LT(relative_error(m, want_m), 1e-12);
      EXPECT_LT(relative_error(v, want_v), 1e-12);
    }
    for (int64_t i = 0; i < P; ++i) {
      if (covered[i]) {
        EXPECT_EQ(params[i], p[i]) << i;
      } else {
        EXPECT_TRUE(std::isnan(params[i])) << "uncovered element " << i << " was written";
      }
    }
  }
}

TEST(ReferenceForward, AdamWGradScale) {
  EXPECT_EQ(ref::adamw_grad_scale(4.0, 0.0), 1.0);
  EXPECT_EQ(ref::adamw_grad_scale(4.0, 3.0), 1.0);
  EXPECT_NEAR(*ref::adamw_grad_scale(4.0, 1.0), 1.0 / (2.0 + 1e-6), 1e-15);
  EXPECT_FALSE(ref::adamw_grad_scale(std::numeric_limits<double>::quiet_NaN(), 1.0).has_value());
  EXPECT_FALSE(ref::adamw_grad_scale(std::numeric_limits<double>::infinity(), 0.0).has_value());
}

}  // namespace
}  // namespace tessera
