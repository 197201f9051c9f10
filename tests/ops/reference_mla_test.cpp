// The references of multi-latent attention's ops (backend/cpu/reference.h): attention whose value
// heads are narrower than its query/key heads, against an explicit masked softmax and finite
// differences; generation's attention over such a cache against the full forward; and the
// packing of queries, keys and values with DeepSeek's interleaved RoPE, against Hugging Face's
// apply_rotary_pos_emb_interleave written out and finite differences.
#include <gtest/gtest.h>

#include <cmath>
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
using test::relative_error;

AttentionShape shape(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t Dv,
                     bool causal, int64_t window) {
  AttentionShape s{B, T, H, KV, D, causal, window, 1.0f / std::sqrt(static_cast<float>(D))};
  s.v_head_dim = Dv;
  return s;
}

TEST(ReferenceMla, AttentionWithNarrowerValuesMatchesExplicitSoftmax) {
  std::mt19937_64 rng(41);
  for (const AttentionShape& s :
       {shape(2, 6, 4, 4, 12, 8, true, 0), shape(1, 9, 4, 2, 10, 6, true, 4),
        shape(1, 5, 2, 1, 6, 10, false, 0)}) {
    SCOPED_TRACE(fmt::format("H={} KV={} D={} Dv={} causal={} window={}", s.heads, s.kv_heads,
                             s.head_dim, s.v_dim(), s.causal, s.window));
    const int64_t W = s.qkv_width(), H = s.heads, D = s.head_dim, Dv = s.v_dim(), T = s.seq;
    ASSERT_EQ(W, (H + s.kv_heads) * D + s.kv_heads * Dv);
    const std::vector<double> qkv = random_values(s.tokens() * W, rng, 2.0);
    std::vector<double> want(s.tokens() * H * Dv), want_lse(s.batch * H * T);
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t kv = h / (H / s.kv_heads);
        for (int64_t i = 0; i < T; ++i) {
          std::vector<double> e(T, 0.0);
          double z = 0;
          for (int64_t j = 0; j < T; ++j) {
            if ((s.causal && j > i) || (s.window > 0 && i - s.window >= j)) continue;
            double score = 0;
            for (int64_t d = 0; d < D; ++d)
              score += qkv[(b * T + i) * W + h * D + d] * qkv[(b * T + j) * W + (H + kv) * D + d];
            z += e[j] = std::exp(score * s.scale);
          }
          want_lse[(b * H + h) * T + i] = std::log(z);
          for (int64_t d = 0; d < Dv; ++d) {
            double o = 0;
            for (int64_t j = 0; j < T; ++j)
              o += e[j] / z * qkv[(b * T + j) * W + (H + s.kv_heads) * D + kv * Dv + d];
            want[(b * T + i) * H * Dv + h * Dv + d] = o;
          }
        }
      }
    std::vector<double> out = nan_values(want.size()), lse = nan_values(want_lse.size());
    ref::attention_forward(out.data(), lse.data(), qkv.data(), s);
    EXPECT_LT(relative_error(out, want), 1e-12);
    EXPECT_LT(relative_error(lse, want_lse), 1e-12);
  }
}

TEST(ReferenceMla, AttentionWithNarrowerValuesGradients) {
  std::mt19937_64 rng(42);
  for (const AttentionShape& s :
       {shape(2, 5, 3, 3, 10, 6, true, 0), shape(1, 7, 4, 2, 8, 12, true, 3),
        shape(1, 6, 2, 2, 12, 4, false, 0)}) {
    SCOPED_TRACE(fmt::format("H={} KV={} D={} Dv={}", s.heads, s.kv_heads, s.head_dim, s.v_dim()));
    std::vector<double> qkv = random_values(s.tokens() * s.qkv_width(), rng, 1.5);
    const std::vector<double> G = random_values(s.tokens() * s.out_width(), rng);
    std::vector<double> out(G.size()), lse(s.batch * s.heads * s.seq);
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

// A new token's attention over a cache of KV keys (D) then KV values (Dv) per position equals the
// last row of the full forward.
TEST(ReferenceMla, DecodeWithNarrowerValuesMatchesTheForwardsLastRow) {
  std::mt19937_64 rng(43);
  const AttentionShape s = shape(1, 9, 4, 4, 12, 8, true, 0);
  const int64_t W = s.qkv_width(), H = s.heads, D = s.head_dim, Dv = s.v_dim(), T = s.seq;
  const std::vector<double> qkv = random_values(s.tokens() * W, rng, 2.0);
  std::vector<double> out(s.tokens() * H * Dv), lse(H * T);
  ref::attention_forward(out.data(), lse.data(), qkv.data(), s);
  std::vector<double> q(qkv.begin() + (T - 1) * W, qkv.begin() + (T - 1) * W + H * D);
  std::vector<double> cache;  // per position: the key heads, then the value heads
  for (int64_t t = 0; t < T; ++t)
    cache.insert(cache.end(), qkv.begin() + t * W + H * D, qkv.begin() + (t + 1) * W);
  std::vector<double> got = nan_values(H * Dv);
  ref::attention_decode(got.data(), q.data(), cache.data(), nullptr, T - 1, s);
  const std::vector<double> want(out.end() - H * Dv, out.end());
  EXPECT_LT(relative_error(got, want), 1e-12);
}

// Hugging Face's apply_rotary_pos_emb_interleave on one vector: x viewed as (Dr/2, 2),
// transposed to (2, Dr/2) and flattened (evens, then odds), then x cos + rotate_half(x) sin.
std::vector<double> hf_interleaved_rope(const double* x, const double* freqs_t, int64_t Dr) {
  std::vector<double> y(Dr), out(Dr);
  for (int64_t i = 0; i < Dr / 2; ++i) y[i] = x[2 * i], y[Dr / 2 + i] = x[2 * i + 1];
  for (int64_t i = 0; i < Dr; ++i) {
    const double c = freqs_t[i % (Dr / 2)], s = freqs_t[Dr / 2 + i % (Dr / 2)];
    const double rotated = i < Dr / 2 ? -y[Dr / 2 + i] : y[i - Dr / 2];
    out[i] = y[i] * c + rotated * s;
  }
  return out;
}

struct MlaCase {
  int64_t B, T, H, Dn, Dr, Dv;
  int64_t q_width, q_col, k_width, k_col;  // windows of q and the rope key in their tensors
};

TEST(ReferenceMla, QkvPackingIsHuggingFacesDeepSeekAttention) {
  std::mt19937_64 rng(44);
  const MlaCase m{2, 3, 3, 5, 4, 6, 30, 2, 7, 3};
  AttentionShape s = shape(m.B, m.T, m.H, m.H, m.Dn + m.Dr, m.Dv, true, 0);
  const int64_t N = s.tokens(), D = s.head_dim, W = s.qkv_width();
  const std::vector<double> q = random_values(N * m.q_width, rng);
  const std::vector<double> k = random_values(N * m.k_width, rng);
  const std::vector<double> kv = random_values(N * m.H * (m.Dn + m.Dv), rng);
  const std::vector<double> freqs = random_values(m.T * m.Dr, rng);  // any cos/sin pairs
  std::vector<double> qkv = nan_values(N * W);
  ref::mla_qkv_forward(qkv.data(), q.data() + m.q_col, m.q_width, k.data() + m.k_col, m.k_width,
                       kv.data(), freqs.data(), s, m.Dr, 0, N);
  for (int64_t n = 0; n < N; ++n) {
    const double* f = freqs.data() + (n % m.T) * m.Dr;
    const std::vector<double> k_rot = hf_interleaved_rope(&k[n * m.k_width + m.k_col], f, m.Dr);
    for (int64_t h = 0; h < m.H; ++h) {
      const double* qh = &q[n * m.q_width + m.q_col + h * D];
      const double* kvh = &kv[(n * m.H + h) * (m.Dn + m.Dv)];
      const std::vector<double> q_rot = hf_interleaved_rope(qh + m.Dn, f, m.Dr);
      for (int64_t d = 0; d < D; ++d) {
        const double want_q = d < m.Dn ? qh[d] : q_rot[d - m.Dn];
        const double want_k = d < m.Dn ? kvh[d] : k_rot[d - m.Dn];
        EXPECT_NEAR(qkv[n * W + h * D + d], want_q, 1e-14) << n << " " << h << " " << d;
        EXPECT_NEAR(qkv[n * W + (m.H + h) * D + d], want_k, 1e-14) << n << " " << h << " " << d;
      }
      for (int64_t d = 0; d < m.Dv; ++d)
        EXPECT_EQ(qkv[n * W + 2 * m.H * D + h * m.Dv + d], kvh[m.Dn + d]);
    }
  }
}

TEST(ReferenceMla, QkvPackingGradients) {
  std::mt19937_64 rng(45);
  // Separate tensors; and q and the rope key as windows of one fused tensor, whose other
  // columns the backward must leave as they were.
  for (const MlaCase& m :
       {MlaCase{1, 4, 2, 3, 4, 5, 14, 0, 4, 0}, MlaCase{2, 3, 3, 2, 6, 4, 35, 0, 35, 29}}) {
    SCOPED_TRACE(fmt::format("H={} Dn={} Dr={} Dv={} q_col={} k_col={}", m.H, m.Dn, m.Dr, m.Dv,
                             m.q_col, m.k_col));
    AttentionShape s = shape(m.B, m.T, m.H, m.H, m.Dn + m.Dr, m.Dv, true, 0);
    const int64_t N = s.tokens(), QW = m.H * s.head_dim;
    const bool fused = m.q_width == m.k_width && m.k_col > 0;
    std::vector<double> q = random_values(N * m.q_width, rng);
    std::vector<double> k = fused ? std::vector<double>() : random_values(N * m.k_width, rng);
    std::vector<double> kv = random_values(N * m.H * (m.Dn + m.Dv), rng);
    const std::vector<double> freqs = random_values(m.T * m.Dr, rng);
    const std::vector<double> G = random_values(N * s.qkv_width(), rng);
    std::vector<double> qkv(G.size());
    auto loss = [&] {
      const double* kp = fused ? q.data() : k.data();
      ref::mla_qkv_forward(qkv.data(), q.data() + m.q_col, m.q_width, kp + m.k_col, m.k_width,
                           kv.data(), freqs.data(), s, m.Dr, 0, N);
      return dot(qkv, G);
    };
    // The backward overwrites only the windows: start from sentinels elsewhere.
    std::vector<double> dq = random_values(q.size(), rng), dk = random_values(k.size(), rng);
    const std::vector<double> dq_before = dq;
    std::vector<double> dkv = nan_values(kv.size());
    double* dkp = fused ? dq.data() : dk.data();
    ref::mla_qkv_backward(dq.data() + m.q_col, m.q_width, dkp + m.k_col, m.k_width, dkv.data(),
                          G.data(), freqs.data(), s, m.Dr, 0, N);
    std::vector<double> numeric_q = numerical_gradient(q, loss);
    std::vector<double> base_q(q.size(), 0.0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < m.q_width; ++c) {
        const bool in_q = c >= m.q_col && c < m.q_col + QW;
        const bool in_k = fused && c >= m.k_col && c < m.k_col + m.Dr;
        if (!in_q && !in_k) base_q[n * m.q_width + c] = dq_before[n * m.q_width + c];
      }
    expect_gradient(dq, base_q, numeric_q, fused ? "d(fused q and rope key)" : "dq");
    if (!fused) expect_gradient(dk, numerical_gradient(k, loss), "dk_rope");
    expect_gradient(dkv, numerical_gradient(kv, loss), "dkv");
  }
}

}  // namespace
}  // namespace tessera
