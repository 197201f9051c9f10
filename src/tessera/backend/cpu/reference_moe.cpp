// Reference implementations of the QK-norm and mixture-of-experts ops (reference.h), written
// after Megatron-Core's moe_utils.py and router.py: readable loops, sums in double.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tessera/backend/cpu/reference.h"

namespace tessera::ref {
namespace {

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// softmax of v (n) into out, in double.
template <class T>
void softmax(double* out, const T* v, int64_t n) {
  double max = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) max = std::max(max, static_cast<double>(v[i]));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += out[i] = std::exp(static_cast<double>(v[i]) - max);
  for (int64_t i = 0; i < n; ++i) out[i] /= sum;
}

// The k largest of score (n) among allowed ones (null: all), in decreasing order; ties go to
// the lower index (a strict comparison over ascending indices keeps the first maximum).
std::vector<int64_t> top_k(const std::vector<double>& score, int64_t k,
                           const std::vector<char>* allowed = nullptr) {
  const int64_t n = static_cast<int64_t>(score.size());
  std::vector<char> taken(n, 0);
  std::vector<int64_t> out;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; ++i) {
      if (taken[i] || (allowed && !(*allowed)[i])) continue;
      if (best < 0 || score[i] > score[best]) best = i;
    }
    taken[best] = 1;
    out.push_back(best);
  }
  return out;
}

// The experts one token is routed to (topk_softmax_with_capacity's choice, or round-robin).
std::vector<int64_t> choose_experts(const std::vector<double>& select, int64_t n,
                                    const MoeRouting& r) {
  const int64_t E = r.experts, K = r.topk;
  std::vector<int64_t> chosen;
  if (r.force_balance) {
    for (int64_t k = 0; k < K; ++k) chosen.push_back((n * K + k) % E);
    return chosen;
  }
  if (r.num_groups == 0) return top_k(select, K);
  // group_limited_topk: a group's score is the sum of its top (K / group_topk) scores.
  const int64_t groups = r.num_groups, per_group = E / groups, best_of = K / r.group_topk;
  std::vector<double> group_score(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const std::vector<double> members(select.begin() + g * per_group,
                                      select.begin() + (g + 1) * per_group);
    double sum = 0;
    for (int64_t i : top_k(members, best_of)) sum += members[i];
    group_score[g] = sum;
  }
  std::vector<char> allowed(E, 0);
  for (int64_t g : top_k(group_score, r.group_topk))
    std::fill(allowed.begin() + g * per_group, allowed.begin() + (g + 1) * per_group, 1);
  return top_k(select, K, &allowed);
}

// The unscaled routing weights u (K) of one token's chosen experts, and what the backward
// needs: p (E) the softmax over all experts (pre_softmax) or s (E) the sigmoids.
template <class T>
void routing_weights(double* u, std::vector<double>& all, const T* z, const int32_t* chosen,
                     const MoeRouting& r) {
  const int64_t E = r.experts, K = r.topk;
  all.assign(E, 0.0);
  if (r.sigmoid) {
    for (int64_t e = 0; e < E; ++e) all[e] = sigmoid(z[e]);
    double sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += u[k] = all[chosen[k]];
    if (K > 1)
      for (int64_t k = 0; k < K; ++k) u[k] /= sum + 1e-20;
  } else if (r.pre_softmax) {
    softmax(all.data(), z, E);
    for (int64_t k = 0; k < K; ++k) u[k] = all[chosen[k]];
  } else {
    std::vector<double> picked(K);
    for (int64_t k = 0; k < K; ++k) picked[k] = z[chosen[k]];
    softmax(u, picked.data(), K);
  }
}

double scaling_of(const MoeRouting& r) {
  return r.scaling != 0.0f ? r.scaling : 1.0;
}

// The router scores P (E) of one token that the load-balancing losses are taken over.
template <class T>
void aux_scores(double* P, const T* z, const MoeRouting& r) {
  const int64_t E = r.experts;
  if (!r.sigmoid) return softmax(P, z, E);
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += P[e] = sigmoid(z[e]);
  if (r.topk > 1)
    for (int64_t e = 0; e < E; ++e) P[e] /= sum + 1e-20;
}

// dz (E) += scale * d/dz of sum_e g_e P_e, for P = aux_scores(z).
template <class T>
void aux_scores_backward(T* dz, const double* g, const T* z, const MoeRouting& r, double scale) {
  const int64_t E = r.experts;
  std::vector<double> P(E);
  aux_scores(P.data(), z, r);
  if (!r.sigmoid) {
    double gp = 0;
    for (int64_t e = 0; e < E; ++e) gp += g[e] * P[e];
    for (int64_t e = 0; e < E; ++e) dz[e] = static_cast<T>(dz[e] + scale * P[e] * (g[e] - gp));
    return;
  }
  std::vector<double> s(E), ds(E);
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += s[e] = sigmoid(z[e]);
  if (r.topk > 1) {  // P = s / (S + eps): dP_e/ds_j = [e == j] / (S + eps) - s_e / (S + eps)^2
    const double denom = sum + 1e-20;
    double gs = 0;
    for (int64_t e = 0; e < E; ++e) gs += g[e] * s[e];
    for (int64_t j = 0; j < E; ++j) ds[j] = g[j] / denom - gs / (denom * denom);
  } else {
    for (int64_t j = 0; j < E; ++j) ds[j] = g[j];
  }
  for (int64_t j = 0; j < E; ++j)
    dz[j] = static_cast<T>(dz[j] + scale * ds[j] * s[j] * (1.0 - s[j]));
}

}  // namespace

// ---- QK norm ----

template <class T>
void qk_norm_forward(T* out, T* rstd, const T* qkv, const T* q_weight, const T* k_weight,
                     const AttentionShape& s, T eps) {
  const int64_t D = s.head_dim, W = s.qkv_width(), normed = s.heads + s.kv_heads;
  for (int64_t n = 0; n < s.tokens(); ++n) {
    for (int64_t h = 0; h < normed; ++h) {
      const T* x = qkv + n * W + h * D;
      const T* w = h < s.heads ? q_weight : k_weight;
      double sq = 0;
      for (int64_t d = 0; d < D; ++d) sq += static_cast<double>(x[d]) * x[d];
      const double r = 1.0 / std::sqrt(sq / D + static_cast<double>(eps));
      rstd[n * normed + h] = static_cast<T>(r);
      for (int64_t d = 0; d < D; ++d) out[n * W + h * D + d] = static_cast<T>(x[d] * r * w[d]);
    }
    std::copy(qkv + n * W + normed * D, qkv + (n + 1) * W, out + n * W + normed * D);
  }
}

template <class T>
void qk_norm_backward(T* dqkv, T* dq_weight, T* dk_weight, const T* dout, const T* qkv,
                      const T* q_weight, const T* k_weight, const T* rstd,
                      const AttentionShape& s) {
  const int64_t D = s.head_dim, W = s.qkv_width(), normed = s.heads + s.kv_heads;
  std::vector<double> dq(D, 0.0), dk(D, 0.0);
  for (int64_t n = 0; n < s.tokens(); ++n) {
    for (int64_t h = 0; h < normed; ++h) {
      const T* x = qkv + n * W + h * D;
      const T* g = dout + n * W + h * D;
      const T* w = h < s.heads ? q_weight : k_weight;
      std::vector<double>& dw = h < s.heads ? dq : dk;
      const double r = rstd[n * normed + h];
      // As rmsnorm_backward: dx_d = r (w_d g_d - x_d r^2 mean(g w x)). Each element is read
      // before it is written, so dqkv may be dout.
      double gwx = 0;
      for (int64_t d = 0; d < D; ++d) {
        gwx += static_cast<double>(g[d]) * w[d] * x[d];
        dw[d] += static_cast<double>(g[d]) * x[d] * r;
      }
      const double coef = r * r * gwx / D;
      for (int64_t d = 0; d < D; ++d)
        dqkv[n * W + h * D + d] =
            static_cast<T>(r * (static_cast<double>(w[d]) * g[d] - x[d] * coef));
    }
    if (dqkv != dout)
      std::copy(dout + n * W + normed * D, dout + (n + 1) * W, dqkv + n * W + normed * D);
  }
  for (int64_t d = 0; d < D; ++d) {
    dq_weight[d] = static_cast<T>(dq_weight[d] + dq[d]);
    dk_weight[d] = static_cast<T>(dk_weight[d] + dk[d]);
  }
}

// ---- router ----

template <class T>
void moe_router_forward(int32_t* indices, T* weights, const T* logits, const T* bias, int64_t N,
                        const MoeRouting& r, int64_t first_token) {
  const int64_t E = r.experts, K = r.topk;
  std::vector<double> select(E), all, u(K);
  for (int64_t n = 0; n < N; ++n) {
    const T* z = logits + n * E;
    if (r.sigmoid) {
      for (int64_t e = 0; e < E; ++e)
        select[e] = sigmoid(z[e]) + (bias ? static_cast<double>(bias[e]) : 0.0);
    } else if (r.pre_softmax) {
      softmax(select.data(), z, E);
    } else {
      for (int64_t e = 0; e < E; ++e) select[e] = z[e];
    }
    const std::vector<int64_t> chosen = choose_experts(select, first_token + n, r);
    for (int64_t k = 0; k < K; ++k) indices[n * K + k] = static_cast<int32_t>(chosen[k]);
    routing_weights(u.data(), all, z, indices + n * K, r);
    for (int64_t k = 0; k < K; ++k) weights[n * K + k] = static_cast<T>(u[k] * scaling_of(r));
  }
}

template <class T>
void moe_router_backward(T* dlogits, const T* dweights, const T* logits, const int32_t* indices,
                         int64_t N, const MoeRouting& r) {
  const int64_t E = r.experts, K = r.topk;
  std::vector<double> all, u(K), g(K);
  for (int64_t n = 0; n < N; ++n) {
    const T* z = logits + n * E;
    const int32_t* chosen = indices + n * K;
    T* dz = dlogits + n * E;
    std::fill(dz, dz + E, T(0));
    routing_weights(u.data(), all, z, chosen, r);
    for (int64_t k = 0; k < K; ++k) g[k] = scaling_of(r) * dweights[n * K + k];  // d/du
    if (r.sigmoid) {
      // u_k = s_k / (S + eps) over the chosen (K > 1), else u = s.
      std::vector<double> ds(K);
      if (K > 1) {
        double S = 0, gs = 0;
        for (int64_t k = 0; k < K; ++k) S += all[chosen[k]], gs += g[k] * all[chosen[k]];
        const double denom = S + 1e-20;
        for (int64_t k = 0; k < K; ++k) ds[k] = g[k] / denom - gs / (denom * denom);
      } else {
        ds[0] = g[0];
      }
      for (int64_t k = 0; k < K; ++k) {
        const double sk = all[chosen[k]];
        dz[chosen[k]] = static_cast<T>(dz[chosen[k]] + ds[k] * sk * (1.0 - sk));
      }
    } else if (r.pre_softmax) {
      // u_k = p_{chosen k}, p = softmax(z): dz_e = p_e (g_e - sum_k p_k g_k).
      std::vector<double> ge(E, 0.0);
      double gp = 0;
      for (int64_t k = 0; k < K; ++k) ge[chosen[k]] += g[k], gp += g[k] * u[k];
      for (int64_t e = 0; e < E; ++e) dz[e] = static_cast<T>(all[e] * (ge[e] - gp));
    } else {
      // u = softmax over the chosen logits.
      double gu = 0;
      for (int64_t k = 0; k < K; ++k) gu += g[k] * u[k];
      for (int64_t k = 0; k < K; ++k)
        dz[chosen[k]] = static_cast<T>(dz[chosen[k]] + u[k] * (g[k] - gu));
    }
  }
}

// ---- load-balancing losses ----

template <class T>
void moe_aux_loss(T* loss, T* dlogits, const T* logits, const int32_t* indices, int64_t N,
                  const MoeRouting& r, int64_t seq, T grad_scale) {
  const int64_t E = r.experts, K = r.topk;
  // Sequences: one of N tokens for aux_loss, N / seq of seq tokens for seq_aux_loss.
  const int64_t T_len = seq > 0 ? seq : N, B = N / T_len;
  // d L / d P_ne = coef * f_e within a sequence; L = sum coef * f_e * P_ne.
  const double coef = seq > 0
                          ? static_cast<double>(E) / (static_cast<double>(T_len) * K * T_len * B)
                          : static_cast<double>(E) / (static_cast<double>(K) * N * N);
  double total = 0;
  std::vector<double> f(E), P(E), g(E);
  for (int64_t b = 0; b < B; ++b) {
    std::fill(f.begin(), f.end(), 0.0);
    for (int64_t i = b * T_len * K; i < (b + 1) * T_len * K; ++i) f[indices[i]] += 1;
    for (int64_t n = b * T_len; n < (b + 1) * T_len; ++n) {
      const T* z = logits + n * E;
      aux_scores(P.data(), z, r);
      for (int64_t e = 0; e < E; ++e) {
        total += coef * f[e] * P[e];
        g[e] = coef * f[e];
      }
      if (dlogits) aux_scores_backward(dlogits + n * E, g.data(), z, r, grad_scale);
    }
  }
  if (loss) *loss = static_cast<T>(*loss + total);
}

template <class T>
void moe_z_loss(T* loss, T* dlogits, const T* logits, int64_t N, int64_t E, T grad_scale) {
  double total = 0;
  std::vector<double> p(E);
  for (int64_t n = 0; n < N; ++n) {
    const T* z = logits + n * E;
    double max = -std::numeric_limits<double>::infinity();
    for (int64_t e = 0; e < E; ++e) max = std::max(max, static_cast<double>(z[e]));
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(z[e]) - max);
    const double lse = max + std::log(sum);
    total += lse * lse;
    if (!dlogits) continue;
    // d lse^2 / dz_e = 2 lse softmax_e, and the mean's 1/N.
    for (int64_t e = 0; e < E; ++e) {
      const double softmax_e = std::exp(static_cast<double>(z[e]) - lse);
      dlogits[n * E + e] = static_cast<T>(dlogits[n * E + e] + static_cast<double>(grad_scale) *
                                                                   2.0 * lse * softmax_e / N);
    }
  }
  if (loss) *loss = static_cast<T>(*loss + total / N);
}

template <class T>
void moe_expert_counts(T* counts, const int32_t* indices, int64_t n, int64_t E) {
  std::vector<double> c(E, 0.0);
  for (int64_t i = 0; i < n; ++i) c[indices[i]] += 1;
  for (int64_t e = 0; e < E; ++e) counts[e] = static_cast<T>(counts[e] + c[e]);
}

template <class T>
void moe_expert_bias_update(T* bias, const T* counts, int64_t E, T rate) {
  double total = 0;
  for (int64_t e = 0; e < E; ++e) total += counts[e];
  const double mean = total / static_cast<double>(E);
  for (int64_t e = 0; e < E; ++e) {
    const double offset = mean - static_cast<double>(counts[e]);
    const double sign = offset > 0 ? 1.0 : offset < 0 ? -1.0 : 0.0;
    bias[e] = static_cast<T>(static_cast<double>(bias[e]) + sign * static_cast<double>(rate));
  }
}

// ---- dispatch and combine ----

std::vector<char> moe_capacity_keep(const int32_t* indices, const double* weights, int64_t N,
                                    int64_t K, int64_t E, int64_t capacity, bool by_position) {
  std::vector<char> keep(static_cast<size_t>(N * K), 1);
  if (capacity <= 0) return keep;
  std::vector<std::vector<int64_t>> pairs(E);  // each expert's pairs, in (n, k) order
  for (int64_t i = 0; i < N * K; ++i) pairs[indices[i]].push_back(i);
  for (std::vector<int64_t>& p : pairs) {
    if (static_cast<int64_t>(p.size()) <= capacity) continue;
    if (!by_position)
      std::stable_sort(p.begin(), p.end(),
                       [&](int64_t a, int64_t b) { return weights[a] > weights[b]; });
    for (size_t j = static_cast<size_t>(capacity); j < p.size(); ++j) keep[p[j]] = 0;
  }
  return keep;
}

void moe_dispatch_plan(int32_t* rows, int32_t* offsets, const int32_t* indices, int64_t N,
                       int64_t K, int64_t E, int64_t align, const char* keep) {
  std::vector<int64_t> count(E, 0), cursor(E, 0);
  for (int64_t i = 0; i < N * K; ++i)
    if (!keep || keep[i]) ++count[indices[i]];
  offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e)
    offsets[e + 1] = static_cast<int32_t>(offsets[e] + (count[e] + align - 1) / align * align);
  for (int64_t i = 0; i < N * K; ++i) {
    const int32_t e = indices[i];
    rows[i] = keep && !keep[i] ? -1 : static_cast<int32_t>(offsets[e] + cursor[e]++);
  }
}

template <class T>
void moe_permute(T* xp, int64_t R, const T* x, const int32_t* rows, int64_t N, int64_t K,
                 int64_t C) {
  std::fill(xp, xp + R * C, T(0));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      if (rows[n * K + k] >= 0) std::copy(x + n * C, x + (n + 1) * C, xp + rows[n * K + k] * C);
}

template <class T>
void moe_permute_backward(T* dx, const T* dxp, const int32_t* rows, int64_t N, int64_t K,
                          int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) {
      double acc = dx[n * C + c];
      for (int64_t k = 0; k < K; ++k)
        if (rows[n * K + k] >= 0) acc += dxp[rows[n * K + k] * C + c];
      dx[n * C + c] = static_cast<T>(acc);
    }
  }
}

template <class T>
void moe_unpermute(T* out, const T* yp, const int32_t* rows, const T* weights, int64_t N, int64_t K,
                   int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k)
        if (rows[n * K + k] >= 0)
          acc += static_cast<double>(weights[n * K + k]) * yp[rows[n * K + k] * C + c];
      out[n * C + c] = static_cast<T>(out[n * C + c] + acc);
    }
  }
}

template <class T>
void moe_unpermute_backward(T* dyp, int64_t R, T* dweights, const T* dout, const T* yp,
                            const int32_t* rows, const T* weights, int64_t N, int64_t K,
                            int64_t C) {
  std::fill(dyp, dyp + R * C, T(0));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t row = rows[n * K + k];
      double dot = 0;
      for (int64_t c = 0; c < C && row >= 0; ++c) {
        dot += static_cast<double>(dout[n * C + c]) * yp[row * C + c];
        dyp[row * C + c] =
            static_cast<T>(static_cast<double>(weights[n * K + k]) * dout[n * C + c]);
      }
      dweights[n * K + k] = static_cast<T>(dot);
    }
  }
}

// ---- grouped GEMMs ----

template <class T>
void grouped_matmul(T* out, const T* a, const T* b, const int32_t* offsets, int64_t G, int64_t R,
                    int64_t N, int64_t K, bool trans_b, const int32_t* weights) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t begin = offsets[g], rows = offsets[g + 1] - offsets[g];
    const int64_t w = weights ? weights[g] : g;
    matmul_forward<T>(out + begin * N, a + begin * K, b + w * N * K, nullptr, nullptr, rows, N, K,
                      false, trans_b, T(1), T(0));
  }
  std::fill(out + static_cast<int64_t>(offsets[G]) * N, out + R * N, T(0));
}

template <class T>
void grouped_matmul_wgrad(T* out, const T* a, const T* b, const int32_t* offsets, int64_t G,
                          int64_t M, int64_t N, T beta, int64_t W, const int32_t* weights) {
  if (W < 0) W = G;
  // A weight's first group applies beta, later ones add; a weight without groups is scaled by
  // beta alone.
  std::vector<char> started(static_cast<size_t>(W), 0);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t begin = offsets[g], rows = offsets[g + 1] - offsets[g];
    const int64_t w = weights ? weights[g] : g;
    matmul_forward<T>(out + w * M * N, a + begin * M, b + begin * N, nullptr, nullptr, M, N, rows,
                      true, false, T(1), started[w] ? T(1) : beta);
    started[w] = 1;
  }
  for (int64_t w = 0; w < W; ++w)
    if (!started[w])
      for (int64_t i = 0; i < M * N; ++i)
        out[w * M * N + i] = beta == T(0) ? T(0) : beta * out[w * M * N + i];
}

// ---- instantiations ----

#define TESSERA_REF_MOE_INSTANTIATE(T)                                                            \
  template void qk_norm_forward<T>(T*, T*, const T*, const T*, const T*, const AttentionShape&,   \
                                   T);                                                            \
  template void qk_norm_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, \
                                    const AttentionShape&);                                       \
  template void moe_router_forward<T>(int32_t*, T*, const T*, const T*, int64_t,                  \
                                      const MoeRouting&, int64_t);                                \
  template void moe_router_backward<T>(T*, const T*, const T*, const int32_t*, int64_t,           \
                                       const MoeRouting&);                                        \
  template void moe_aux_loss<T>(T*, T*, const T*, const int32_t*, int64_t, const MoeRouting&,     \
                                int64_t, T);                                                      \
  template void moe_z_loss<T>(T*, T*, const T*, int64_t, int64_t, T);                             \
  template void moe_expert_counts<T>(T*, const int32_t*, int64_t, int64_t);                       \
  template void moe_expert_bias_update<T>(T*, const T*, int64_t, T);                              \
  template void moe_permute<T>(T*, int64_t, const T*, const int32_t*, int64_t, int64_t, int64_t); \
  template void moe_permute_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t); \
  template void moe_unpermute<T>(T*, const T*, const int32_t*, const T*, int64_t, int64_t,        \
                                 int64_t);                                                        \
  template void moe_unpermute_backward<T>(T*, int64_t, T*, const T*, const T*, const int32_t*,    \
                                          const T*, int64_t, int64_t, int64_t);                   \
  template void grouped_matmul<T>(T*, const T*, const T*, const int32_t*, int64_t, int64_t,       \
                                  int64_t, int64_t, bool, const int32_t*);                        \
  template void grouped_matmul_wgrad<T>(T*, const T*, const T*, const int32_t*, int64_t, int64_t, \
                                        int64_t, T, int64_t, const int32_t*);

TESSERA_REF_MOE_INSTANTIATE(float)
TESSERA_REF_MOE_INSTANTIATE(double)
#undef TESSERA_REF_MOE_INSTANTIATE

}  // namespace tessera::ref
