#include "tessera/backend/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/core/fp8.h"
#include "tessera/core/random.h"

namespace tessera::ref {

namespace {

// The simd reduction lets the compiler keep several partial sums (a fixed split for a given
// build, so still deterministic); a single double accumulator would be latency-bound, and this
// is the inner loop of attention.
template <class T>
double dot(const T* x, const T* y, int64_t n) {
  double acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(x[i]) * static_cast<double>(y[i]);
  return acc;
}

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

}  // namespace

// ---- linear algebra ----

template <class T>
void matmul_forward(T* out, const T* a, const T* b, const T* c, const T* bias, int64_t M, int64_t N,
                    int64_t K, bool trans_a, bool trans_b, T alpha, T beta) {
  if (c == nullptr) c = out;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) {
        const T a_mk = trans_a ? a[k * M + m] : a[m * K + k];
        const T b_kn = trans_b ? b[n * K + k] : b[k * N + n];
        acc += static_cast<double>(a_mk) * static_cast<double>(b_kn);
      }
      double value = static_cast<double>(alpha) * acc;
      if (beta != T(0)) value += static_cast<double>(beta) * static_cast<double>(c[m * N + n]);
      if (bias != nullptr) value += static_cast<double>(bias[n]);
      out[m * N + n] = static_cast<T>(value);
    }
  }
}

template <class T>
void matmul_backward(T* da, T* db, T* dbias, T* dc, const T* dout, const T* a, const T* b,
                     int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b, T alpha, T beta) {
  // d op(a) = alpha * dout @ op(b)^T and d op(b) = alpha * op(a)^T @ dout; a stored-transposed
  // operand receives the transpose of that. The trans flags absorb every transpose, so each
  // case is one matmul with beta = 1 (accumulate) and no operand is ever copied.
  if (da != nullptr) {
    if (!trans_a) {  // da (M, K) = alpha * dout @ op(b)^T
      matmul_forward<T>(da, dout, b, nullptr, nullptr, M, K, N, false, !trans_b, alpha, T(1));
    } else {  // da (K, M) = alpha * op(b) @ dout^T
      matmul_forward<T>(da, b, dout, nullptr, nullptr, K, M, N, trans_b, true, alpha, T(1));
    }
  }
  if (db != nullptr) {
    if (!trans_b) {  // db (K, N) = alpha * op(a)^T @ dout
      matmul_forward<T>(db, a, dout, nullptr, nullptr, K, N, M, !trans_a, false, alpha, T(1));
    } else {  // db (N, K) = alpha * dout^T @ op(a)
      matmul_forward<T>(db, dout, a, nullptr, nullptr, N, K, M, true, trans_a, alpha, T(1));
    }
  }
  if (dbias != nullptr) bias_backward(dbias, dout, M, N);
  if (dc != nullptr) {
    for (int64_t i = 0; i < M * N; ++i) dc[i] += beta * dout[i];
  }
}

template <class T>
void bias_backward(T* dbias, const T* dout, int64_t M, int64_t N) {
  for (int64_t n = 0; n < N; ++n) {
    double acc = 0;
    for (int64_t m = 0; m < M; ++m) acc += static_cast<double>(dout[m * N + n]);
    dbias[n] = static_cast<T>(static_cast<double>(dbias[n]) + acc);
  }
}

// ---- embedding ----

template <class T>
void embedding_forward(T* out, const int32_t* tokens, const T* table, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const T* row = table + static_cast<int64_t>(tokens[n]) * C;
    std::copy(row, row + C, out + n * C);
  }
}

template <class T>
void embedding_backward(T* dtable, const T* dout, const int32_t* tokens, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    T* row = dtable + static_cast<int64_t>(tokens[n]) * C;
    for (int64_t c = 0; c < C; ++c) row[c] += dout[n * C + c];
  }
}

template <class T>
void embedding_shard_forward(T* out, const int32_t* tokens, const T* table, int64_t N, int64_t C,
                             int64_t V, int64_t first_id) {
  for (int64_t n = 0; n < N; ++n) {
    const int64_t id = static_cast<int64_t>(tokens[n]) - first_id;
    if (id >= 0 && id < V)
      std::copy(table + id * C, table + (id + 1) * C, out + n * C);
    else
      std::fill(out + n * C, out + (n + 1) * C, T(0));
  }
}

template <class T>
void embedding_shard_backward(T* dtable, const T* dout, const int32_t* tokens, int64_t N, int64_t C,
                              int64_t V, int64_t first_id) {
  for (int64_t n = 0; n < N; ++n) {
    const int64_t id = static_cast<int64_t>(tokens[n]) - first_id;
    if (id < 0 || id >= V) continue;
    for (int64_t c = 0; c < C; ++c) dtable[id * C + c] += dout[n * C + c];
  }
}

// ---- RMSNorm ----

template <class T>
void rmsnorm_forward(T* out, T* rstd, const T* x, const T* weight, int64_t N, int64_t C, T eps) {
  for (int64_t n = 0; n < N; ++n) {
    const T* xn = x + n * C;
    const double r = 1.0 / std::sqrt(dot(xn, xn, C) / C + static_cast<double>(eps));
    rstd[n] = static_cast<T>(r);
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = static_cast<T>(xn[c] * r * weight[c]);
  }
}

template <class T>
void rmsnorm_backward(T* dx, T* dweight, const T* dout, const T* x, const T* weight, const T* rstd,
                      int64_t N, int64_t C) {
  // y = x r w with r = (mean(x^2) + eps)^-1/2, dr/dx_c = -r^3 x_c / C, hence
  // dx_c = r (w_c g_c - x_c r^2 mean(g w x)).
  for (int64_t n = 0; n < N; ++n) {
    const T* xn = x + n * C;
    const T* gn = dout + n * C;
    const double r = rstd[n];
    double gwx = 0;
    for (int64_t c = 0; c < C; ++c) gwx += static_cast<double>(gn[c]) * weight[c] * xn[c];
    const double coef = r * r * gwx / C;
    for (int64_t c = 0; c < C; ++c) {
      dx[n * C + c] += static_cast<T>(r * (static_cast<double>(weight[c]) * gn[c] - xn[c] * coef));
    }
  }
  if (dweight == nullptr) return;
  for (int64_t c = 0; c < C; ++c) {
    double acc = 0;
    for (int64_t n = 0; n < N; ++n)
      acc += static_cast<double>(dout[n * C + c]) * x[n * C + c] * rstd[n];
    dweight[c] = static_cast<T>(dweight[c] + acc);
  }
}

// ---- rotary embedding ----

namespace {

// Rotates the query and key heads of every token by +angle (sign 1) or -angle (sign -1).
template <class T>
void rope_rotate(T* qkv, const T* freqs, const AttentionShape& s, T sign) {
  const int64_t D = s.head_dim, half = D / 2, width = s.qkv_width();
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t t = 0; t < s.seq; ++t) {
      const T* cos_t = freqs + (s.rope_per_token ? b * s.seq + t : t) * D;
      const T* sin_t = cos_t + half;
      T* row = qkv + (b * s.seq + t) * width;
      for (int64_t head = 0; head < s.heads + s.kv_heads; ++head) {
        T* x = row + head * D;
        for (int64_t i = 0; i < half; ++i) {
          const T x1 = x[i], x2 = x[i + half], sine = sign * sin_t[i];
          x[i] = x1 * cos_t[i] - x2 * sine;
          x[i + half] = x2 * cos_t[i] + x1 * sine;
        }
      }
    }
  }
}

}  // namespace

template <class T>
void rope_forward(T* qkv, const T* freqs, const AttentionShape& s) {
  rope_rotate(qkv, freqs, s, T(1));
}

template <class T>
void rope_backward(T* dqkv, const T* freqs, const AttentionShape& s) {
  rope_rotate(dqkv, freqs, s, T(-1));
}

// ---- attention ----

KeyRange visible_keys(const AttentionShape& s, int64_t i, int64_t b) {
  int64_t first = s.window > 0 ? std::max<int64_t>(0, i - s.window + 1) : 0;
  if (s.document_starts.defined())
    first = std::max<int64_t>(first, static_cast<const int32_t*>(s.document_starts.data)[b * s.seq + i]);
  return {first, s.causal ? i : s.seq - 1};
}

template <class T>
void attention_head_forward(T* out, T* lse, const T* qkv, const AttentionShape& s, int64_t b,
                            int64_t h, double* scratch) {
  const int64_t seq = s.seq, D = s.head_dim, Dv = s.v_dim(), H = s.heads, width = s.qkv_width();
  const int64_t kv = h / (H / s.kv_heads), out_width = s.out_width();
  const double scale = s.scale;
  const T* q_rows = qkv + b * seq * width + h * D;
  const T* k_rows = qkv + b * seq * width + (H + kv) * D;
  const T* v_rows = qkv + b * seq * width + (H + s.kv_heads) * D + kv * Dv;
  T* out_rows = out + b * seq * out_width + h * Dv;
  T* lse_row = lse + (b * H + h) * seq;
  double* p = scratch;          // (seq) probabilities of the visible keys
  double* acc = scratch + seq;  // (Dv) output row

  for (int64_t i = 0; i < seq; ++i) {
    const T* q = q_rows + i * width;
    T* o = out_rows + i * out_width;
    const KeyRange keys = visible_keys(s, i, b);
    if (keys.first > keys.last) {
      std::fill(o, o + Dv, T(0));
      lse_row[i] = -std::numeric_limits<T>::infinity();
      continue;
    }
    double max = -std::numeric_limits<double>::infinity();
    for (int64_t j = keys.first; j <= keys.last; ++j) {
      p[j] = scale * dot(q, k_rows + j * width, D);
      max = std::max(max, p[j]);
    }
    double denom = 0;
    for (int64_t j = keys.first; j <= keys.last; ++j) {
      p[j] = std::exp(p[j] - max);
      denom += p[j];
    }
    std::fill(acc, acc + Dv, 0.0);
    for (int64_t j = keys.first; j <= keys.last; ++j) {
      const T* v = v_rows + j * width;
      for (int64_t d = 0; d < Dv; ++d) acc[d] += p[j] * v[d];
    }
    for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<T>(acc[d] / denom);
    lse_row[i] = static_cast<T>(max + std::log(denom));
  }
}

template <class T>
void attention_head_backward(T* dqkv, T* dk, T* dv, int64_t dkv_stride, const T* dout, const T* out,
                             const T* lse, const T* qkv, const AttentionShape& s, int64_t b,
                             int64_t h, double* scratch) {
  // With p_ij = exp(s_ij - lse_i), dp_ij = dout_i . v_j and D_i = sum_j p_ij dp_ij = dout_i .
  // out_i, the score gradient is ds_ij = p_ij (dp_ij - D_i); then dq_i = scale sum_j ds_ij k_j,
  // dk_j += scale ds_ij q_i, dv_j += p_ij dout_i.
  const int64_t seq = s.seq, D = s.head_dim, Dv = s.v_dim(), H = s.heads, width = s.qkv_width();
  const int64_t kv = h / (H / s.kv_heads), out_width = s.out_width();
  const double scale = s.scale;
  const T* q_rows = qkv + b * seq * width + h * D;
  const T* k_rows = qkv + b * seq * width + (H + kv) * D;
  const T* v_rows = qkv + b * seq * width + (H + s.kv_heads) * D + kv * Dv;
  const T* dout_rows = dout + b * seq * out_width + h * Dv;
  const T* out_rows = out + b * seq * out_width + h * Dv;
  const T* lse_row = lse + (b * H + h) * seq;
  T* dq_rows = dqkv + b * seq * width + h * D;
  double* dq = scratch;  // (D)

  for (int64_t i = 0; i < seq; ++i) {
    const T* q = q_rows + i * width;
    const T* g = dout_rows + i * out_width;
    const double lse_i = lse_row[i];
    const double D_i = dot(g, out_rows + i * out_width, Dv);
    std::fill(dq, dq + D, 0.0);
    const KeyRange keys = visible_keys(s, i, b);
    for (int64_t j = keys.first; j <= keys.last; ++j) {
      const T* k = k_rows + j * width;
      const T* v = v_rows + j * width;
      const double p = std::exp(scale * dot(q, k, D) - lse_i);
      const double ds = p * (dot(g, v, Dv) - D_i);
      T* dk_j = dk + j * dkv_stride;
      T* dv_j = dv + j * dkv_stride;
      for (int64_t d = 0; d < D; ++d) {
        dq[d] += ds * k[d];
        dk_j[d] += static_cast<T>(scale * ds * q[d]);
      }
      for (int64_t d = 0; d < Dv; ++d) dv_j[d] += static_cast<T>(p * g[d]);
    }
    T* dq_i = dq_rows + i * width;
    for (int64_t d = 0; d < D; ++d) dq_i[d] = static_cast<T>(scale * dq[d]);
  }
}

template <class T>
void attention_forward(T* out, T* lse, const T* qkv, const AttentionShape& s) {
  std::vector<double> scratch(s.seq + s.v_dim());
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      attention_head_forward(out, lse, qkv, s, b, h, scratch.data());
    }
  }
}

template <class T>
void attention_fp8_forward(T* out, T* lse, const T* qkv, const AttentionShape& s) {
  const int64_t B = s.batch, seq = s.seq, D = s.head_dim, H = s.heads, KV = s.kv_heads;
  TS_CHECK(s.v_dim() == D, "FP8 attention: value heads of {} beside key heads of {}", s.v_dim(), D);
  constexpr int64_t kTile = 128;
  constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
  constexpr float kProbabilityShift = 8.f;  // probabilities are coded as 2^8 p
  const int64_t width = s.qkv_width(), slots = H + 2 * KV, tiles = (seq + kTile - 1) / kTile;
  // The codes' values (exact in float) in qkv's layout, and each tile's descale.
  std::vector<float> codes(static_cast<size_t>(B * seq * width));
  std::vector<float> descale(static_cast<size_t>(B * slots * tiles));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t slot = 0; slot < slots; ++slot)
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t t0 = tile * kTile, t1 = std::min(seq, t0 + kTile);
        auto at = [&](int64_t t, int64_t d) { return (b * seq + t) * width + slot * D + d; };
        float amax = 0.f;
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t d = 0; d < D; ++d)
            amax = std::max(amax, std::fabs(static_cast<float>(qkv[at(t, d)])));
        const float scale = fp8_block_scale(amax, fp8_max(DType::E4M3));
        descale[static_cast<size_t>((b * slots + slot) * tiles + tile)] = 1.f / scale;
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t d = 0; d < D; ++d)
            codes[static_cast<size_t>(at(t, d))] =
                round_to_fp8(static_cast<float>(qkv[at(t, d)]) * scale, DType::E4M3);
      }
  const float scale_log2 = s.scale * kLog2e;
#pragma omp parallel for schedule(static)
  for (int64_t pair = 0; pair < B * H; ++pair) {
    const int64_t b = pair / H, h = pair % H, kv = h / (H / KV);
    const float* descale_q = descale.data() + (b * slots + h) * tiles;
    const float* descale_k = descale.data() + (b * slots + H + kv) * tiles;
    const float* descale_v = descale_k + KV * tiles;
    const float* rows = codes.data() + b * seq * width;
    std::vector<double> acc(static_cast<size_t>(D));
    std::vector<float> raw(static_cast<size_t>(kTile));
    for (int64_t i = 0; i < seq; ++i) {
      T* o = out + (b * seq + i) * H * D + h * D;
      T* lse_i = lse + (b * H + h) * seq + i;
      const KeyRange keys = visible_keys(s, i, b);
      if (keys.first > keys.last) {
        std::fill(o, o + D, T(0));
        *lse_i = -std::numeric_limits<T>::infinity();
        continue;
      }
      const float* q = rows + i * width + h * D;
      const float q_scale_log2 = scale_log2 * descale_q[i / kTile];
      float m = -std::numeric_limits<float>::infinity();
      double l = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t n = keys.first / kTile; n <= keys.last / kTile; ++n) {
        const int64_t j0 = std::max(keys.first, n * kTile),
                      j1 = std::min(keys.last, n * kTile + kTile - 1);
        const float c = q_scale_log2 * descale_k[n];
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = j0; j <= j1; ++j) {
          raw[j - j0] = static_cast<float>(dot(q, rows + j * width + (H + kv) * D, D));
          mx = std::max(mx, raw[j - j0]);
        }
        const float m_new = std::max(m, mx * c);
        const float alpha = std::exp2(m - m_new);  // 0 at the first tile (m = -inf)
        m = m_new;
        l *= alpha;
        for (double& a : acc) a *= alpha;
        for (int64_t j = j0; j <= j1; ++j) {
          const float p = std::exp2(std::fma(raw[j - j0], c, kProbabilityShift - m));
          l += p;
          const double weight = static_cast<double>(round_to_fp8(p, DType::E4M3)) * descale_v[n];
          const float* v = rows + j * width + (H + KV + kv) * D;
          for (int64_t d = 0; d < D; ++d) acc[static_cast<size_t>(d)] += weight * v[d];
        }
      }
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[static_cast<size_t>(d)] / l);
      *lse_i = static_cast<T>((static_cast<double>(m) + std::log2(l) - kProbabilityShift) * kLn2);
    }
  }
}

template <class T>
void attention_decode(T* out, const T* q, const T* kv, const int32_t* positions, int64_t pos,
                      const AttentionShape& s) {
  const int64_t D = s.head_dim, Dv = s.v_dim(), H = s.heads, KV = s.kv_heads, group = H / KV;
  const int64_t row = KV * (D + Dv);  // one cached position: KV keys, then KV values
  std::vector<double> p;
  std::vector<double> acc(static_cast<size_t>(Dv));
  for (int64_t b = 0; b < s.batch; ++b) {
    const KeyRange keys = visible_keys(s, positions ? positions[b] : pos);
    p.resize(static_cast<size_t>(keys.last - keys.first + 1));
    for (int64_t h = 0; h < H; ++h) {
      const T* qh = q + (b * H + h) * D;
      const T* k_rows = kv + b * s.seq * row + (h / group) * D;
      const T* v_rows = kv + b * s.seq * row + KV * D + (h / group) * Dv;
      double max = -std::numeric_limits<double>::infinity();
      for (int64_t j = keys.first; j <= keys.last; ++j) {
        p[j - keys.first] = s.scale * dot(qh, k_rows + j * row, D);
        max = std::max(max, p[j - keys.first]);
      }
      double denom = 0;
      for (double& x : p) denom += (x = std::exp(x - max));
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = keys.first; j <= keys.last; ++j) {
        const T* v = v_rows + j * row;
        for (int64_t d = 0; d < Dv; ++d) acc[d] += p[j - keys.first] * v[d];
      }
      T* o = out + (b * H + h) * Dv;
      for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<T>(acc[d] / denom);
    }
  }
}

template <class T>
void attention_backward(T* dqkv, const T* dout, const T* out, const T* lse, const T* qkv,
                        const AttentionShape& s) {
  const int64_t D = s.head_dim, Dv = s.v_dim(), width = s.qkv_width();
  for (int64_t row = 0; row < s.tokens(); ++row) {  // dk, dv accumulate below: zero them
    std::fill(dqkv + row * width + s.heads * D, dqkv + (row + 1) * width, T(0));
  }
  std::vector<double> scratch(D);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t kv = h / (s.heads / s.kv_heads);
      T* dk = dqkv + b * s.seq * width + (s.heads + kv) * D;
      T* dv = dqkv + b * s.seq * width + (s.heads + s.kv_heads) * D + kv * Dv;
      attention_head_backward(dqkv, dk, dv, width, dout, out, lse, qkv, s, b, h, scratch.data());
    }
  }
}

namespace {

// Of sequence b, whose document starts (by position, over the whole sequence of `keys`
// tokens) s.document_starts holds when defined.
bool visible(const AttentionShape& s, int64_t b, int64_t keys, int64_t query, int64_t key) {
  if (s.document_starts.defined() &&
      key < static_cast<const int32_t*>(s.document_starts.data)[b * keys + query])
    return false;
  return (!s.causal || key <= query) && (s.window == 0 || query - s.window < key);
}

}  // namespace

template <class T>
void attention_gathered_head_forward(T* out, T* lse, const T* qkv, const T* kv_all,
                                     const int32_t* positions, int64_t segments, int64_t segment,
                                     const AttentionShape& s, int64_t b, int64_t h) {
  const int64_t B = s.batch, T_ = s.seq, D = s.head_dim, H = s.heads, KV = s.kv_heads;
  const int64_t keys = segments * T_, kv = h / (H / KV), width = s.qkv_width();
  // Key j's row of kv_all: its key heads, then its value heads.
  auto key_row = [&](int64_t j) { return kv_all + ((j / T_ * B + b) * T_ + j % T_) * s.kv_width(); };
  std::vector<double> p(static_cast<size_t>(keys)), acc(static_cast<size_t>(D));
  for (int64_t i = 0; i < T_; ++i) {
    const T* q = qkv + (b * T_ + i) * width + h * D;
    const int64_t qpos = positions[segment * T_ + i];
    double max = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < keys; ++j) {
      if (!visible(s, b, keys, qpos, positions[j])) continue;
      p[j] = s.scale * dot(q, key_row(j) + kv * D, D);
      max = std::max(max, p[j]);
    }
    T* o = out + ((b * T_ + i) * H + h) * D;
    if (max == -std::numeric_limits<double>::infinity()) {
      std::fill(o, o + D, T(0));
      lse[(b * H + h) * T_ + i] = -std::numeric_limits<T>::infinity();
      continue;
    }
    double denom = 0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t j = 0; j < keys; ++j) {
      if (!visible(s, b, keys, qpos, positions[j])) continue;
      const double e = std::exp(p[j] - max);
      denom += e;
      const T* v = key_row(j) + (KV + kv) * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += e * v[d];
    }
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] / denom);
    lse[(b * H + h) * T_ + i] = static_cast<T>(max + std::log(denom));
  }
}

template <class T>
void attention_gathered_head_backward(T* dqkv, T* dkv_all, const T* dout, const T* out,
                                      const T* lse, const T* qkv, const T* kv_all,
                                      const int32_t* positions, int64_t segments, int64_t segment,
                                      const AttentionShape& s, int64_t b, int64_t h) {
  // As attention_head_backward: p_ij = exp(s_ij - lse_i), ds_ij = p_ij (dout_i . v_j - D_i).
  const int64_t B = s.batch, T_ = s.seq, D = s.head_dim, H = s.heads, KV = s.kv_heads;
  const int64_t keys = segments * T_, kv = h / (H / KV), width = s.qkv_width();
  auto key_at = [&](int64_t j) { return ((j / T_ * B + b) * T_ + j % T_) * s.kv_width(); };
  std::vector<double> dq(static_cast<size_t>(D));
  for (int64_t i = 0; i < T_; ++i) {
    const T* q = qkv + (b * T_ + i) * width + h * D;
    const T* g = dout + ((b * T_ + i) * H + h) * D;
    const double lse_i = lse[(b * H + h) * T_ + i];
    const double D_i = dot(g, out + ((b * T_ + i) * H + h) * D, D);
    const int64_t qpos = positions[segment * T_ + i];
    std::fill(dq.begin(), dq.end(), 0.0);
    for (int64_t j = 0; j < keys; ++j) {
      if (!visible(s, b, keys, qpos, positions[j])) continue;
      const int64_t at = key_at(j);
      const T* k = kv_all + at + kv * D;
      const T* v = kv_all + at + (KV + kv) * D;
      const double p = std::exp(s.scale * dot(q, k, D) - lse_i);
      const double ds = p * (dot(g, v, D) - D_i);
      T* dk = dkv_all + at + kv * D;
      T* dv = dkv_all + at + (KV + kv) * D;
      for (int64_t d = 0; d < D; ++d) {
        dq[d] += ds * k[d];
        dk[d] += static_cast<T>(s.scale * ds * q[d]);
        dv[d] += static_cast<T>(p * g[d]);
      }
    }
    T* dq_i = dqkv + (b * T_ + i) * width + h * D;
    for (int64_t d = 0; d < D; ++d) dq_i[d] = static_cast<T>(s.scale * dq[d]);
  }
}

template <class T>
void attention_gathered_forward(T* out, T* lse, const T* qkv, const T* kv_all,
                                const int32_t* positions, int64_t segments, int64_t segment,
                                const AttentionShape& s) {
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads; ++h)
      attention_gathered_head_forward(out, lse, qkv, kv_all, positions, segments, segment, s, b, h);
}

template <class T>
void attention_gathered_backward(T* dqkv, T* dkv_all, const T* dout, const T* out, const T* lse,
                                 const T* qkv, const T* kv_all, const int32_t* positions,
                                 int64_t segments, int64_t segment, const AttentionShape& s) {
  std::fill(dkv_all, dkv_all + segments * s.tokens() * s.kv_width(), T(0));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads; ++h)
      attention_gathered_head_backward(dqkv, dkv_all, dout, out, lse, qkv, kv_all, positions,
                                       segments, segment, s, b, h);
}

// ---- multi-latent attention ----

namespace {

// DeepSeek's RoPE of one interleaved vector x (Dr) into the rotate-half layout (ops/backend.h,
// MlaQkvArgs): out[i] = c x[2i] - s x[2i+1], out[half + i] = s x[2i] + c x[2i+1].
template <class T>
void mla_rope_rotate(T* out, const T* x, const T* freqs_t, int64_t Dr) {
  const int64_t half = Dr / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double c = freqs_t[i], sn = freqs_t[half + i];
    const double even = x[2 * i], odd = x[2 * i + 1];
    out[i] = static_cast<T>(c * even - sn * odd);
    out[half + i] = static_cast<T>(sn * even + c * odd);
  }
}

// Its transpose, the gradient: dx[2i] = c g[i] + s g[half + i], dx[2i+1] = -s g[i] + c g[half + i].
template <class G, class T>
void mla_rope_rotate_backward(double* dx, const G* g, const T* freqs_t, int64_t Dr) {
  const int64_t half = Dr / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double c = freqs_t[i], sn = freqs_t[half + i];
    dx[2 * i] = c * g[i] + sn * g[half + i];
    dx[2 * i + 1] = -sn * g[i] + c * g[half + i];
  }
}

}  // namespace

template <class T>
void mla_qkv_forward(T* qkv, const T* q, int64_t q_stride, const T* k_rope, int64_t k_stride,
                     const T* kv, const T* freqs, const AttentionShape& s, int64_t rope_dim,
                     int64_t first_token, int64_t tokens) {
  const int64_t H = s.heads, D = s.head_dim, Dr = rope_dim, Dn = D - Dr, Dv = s.v_dim();
  const int64_t width = s.qkv_width(), kv_width = H * (Dn + Dv);
  std::vector<T> k_rot(static_cast<size_t>(Dr));
  for (int64_t n = first_token; n < first_token + tokens; ++n) {
    const T* freqs_t = freqs + (n % s.seq) * Dr;
    T* row = qkv + n * width;
    const T* q_row = q + n * q_stride;
    const T* kv_row = kv + n * kv_width;
    mla_rope_rotate(k_rot.data(), k_rope + n * k_stride, freqs_t, Dr);
    for (int64_t h = 0; h < H; ++h) {
      T* qh = row + h * D;
      T* kh = row + (H + h) * D;
      T* vh = row + 2 * H * D + h * Dv;
      std::copy(q_row + h * D, q_row + h * D + Dn, qh);
      mla_rope_rotate(qh + Dn, q_row + h * D + Dn, freqs_t, Dr);
      std::copy(kv_row + h * (Dn + Dv), kv_row + h * (Dn + Dv) + Dn, kh);
      std::copy(k_rot.begin(), k_rot.end(), kh + Dn);
      std::copy(kv_row + h * (Dn + Dv) + Dn, kv_row + (h + 1) * (Dn + Dv), vh);
    }
  }
}

template <class T>
void mla_qkv_backward(T* dq, int64_t q_stride, T* dk_rope, int64_t k_stride, T* dkv, const T* dqkv,
                      const T* freqs, const AttentionShape& s, int64_t rope_dim,
                      int64_t first_token, int64_t tokens) {
  const int64_t H = s.heads, D = s.head_dim, Dr = rope_dim, Dn = D - Dr, Dv = s.v_dim();
  const int64_t width = s.qkv_width(), kv_width = H * (Dn + Dv);
  std::vector<double> rot(static_cast<size_t>(Dr)), k_sum(static_cast<size_t>(Dr));
  for (int64_t n = first_token; n < first_token + tokens; ++n) {
    const T* freqs_t = freqs + (n % s.seq) * Dr;
    const T* row = dqkv + n * width;
    T* dq_row = dq + n * q_stride;
    T* dkv_row = dkv + n * kv_width;
    std::fill(k_sum.begin(), k_sum.end(), 0.0);
    for (int64_t h = 0; h < H; ++h) {
      const T* gq = row + h * D;
      const T* gk = row + (H + h) * D;
      const T* gv = row + 2 * H * D + h * Dv;
      std::copy(gq, gq + Dn, dq_row + h * D);
      mla_rope_rotate_backward(rot.data(), gq + Dn, freqs_t, Dr);
      for (int64_t i = 0; i < Dr; ++i) dq_row[h * D + Dn + i] = static_cast<T>(rot[i]);
      std::copy(gk, gk + Dn, dkv_row + h * (Dn + Dv));
      std::copy(gv, gv + Dv, dkv_row + h * (Dn + Dv) + Dn);
      // The rope key is shared: its gradient sums the heads' (in head order), then rotates back.
      for (int64_t i = 0; i < Dr; ++i) k_sum[i] += gk[Dn + i];
    }
    mla_rope_rotate_backward(rot.data(), k_sum.data(), freqs_t, Dr);
    for (int64_t i = 0; i < Dr; ++i) dk_rope[n * k_stride + i] = static_cast<T>(rot[i]);
  }
}

// ---- SwiGLU ----

template <class T>
void swiglu_forward(T* out, const T* gate_up, int64_t N, int64_t F) {
  for (int64_t n = 0; n < N; ++n) {
    const T* gate = gate_up + n * 2 * F;
    const T* up = gate + F;
    for (int64_t f = 0; f < F; ++f) {
      const double g = gate[f];
      out[n * F + f] = static_cast<T>(g * sigmoid(g) * up[f]);
    }
  }
}

template <class T>
void swiglu_backward(T* dgate_up, const T* dout, const T* gate_up, int64_t N, int64_t F) {
  // silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))).
  for (int64_t n = 0; n < N; ++n) {
    const T* gate = gate_up + n * 2 * F;
    const T* up = gate + F;
    T* dgate = dgate_up + n * 2 * F;
    T* dup = dgate + F;
    for (int64_t f = 0; f < F; ++f) {
      const double g = gate[f], sig = sigmoid(g), grad = dout[n * F + f];
      dgate[f] = static_cast<T>(grad * up[f] * sig * (1.0 + g * (1.0 - sig)));
      dup[f] = static_cast<T>(grad * g * sig);
    }
  }
}

// ---- elementwise ----

template <class T>
void add(T* out, const T* a, const T* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

template <class T>
void scale(T* out, const T* x, T alpha, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = alpha * x[i];
}

template <class T>
void softcap(T* out, const T* x, T cap, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = cap * std::tanh(x[i] / cap);
}

template <class T>
void softcap_backward(T* dx, const T* dy, const T* y, T cap, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T t = y[i] / cap;
    dx[i] = dy[i] * (T(1) - t * t);
  }
}

// ---- loss ----

template <class T>
void cross_entropy(T* losses, T* dlogits, const T* logits, const int32_t* targets, int64_t N,
                   int64_t V, T grad_scale) {
  for (int64_t n = 0; n < N; ++n) {
    const T* x = logits + n * V;
    T* dx = dlogits != nullptr ? dlogits + n * V : nullptr;
    const int32_t target = targets[n];
    if (target < 0) {
      losses[n] = T(0);
      if (dx != nullptr) std::fill(dx, dx + V, T(0));
      continue;
    }
    // dx may be the logits row itself: x[target] is read before anything is written, and dx
    // holds exp(x - max) between the two passes, so that each logit costs one exp (in T).
    const double x_target = x[target];
    T max = x[0];
    for (int64_t v = 1; v < V; ++v) max = std::max(max, x[v]);
    double denom = 0;
    for (int64_t v = 0; v < V; ++v) {
      const T e = std::exp(x[v] - max);
      if (dx != nullptr) dx[v] = e;
      denom += e;
    }
    losses[n] = static_cast<T>(max + std::log(denom) - x_target);
    if (dx == nullptr) continue;
    const double scale = static_cast<double>(grad_scale) / denom, one = grad_scale;
    for (int64_t v = 0; v < V; ++v)
      dx[v] = static_cast<T>(scale * dx[v] - (v == target ? one : 0.0));
  }
}

template <class T>
void log_softmax_gather(T* logps, T* lse, const T* logits, const int32_t* targets, int64_t N,
                        int64_t V) {
  for (int64_t n = 0; n < N; ++n) {
    const T* x = logits + n * V;
    if (targets[n] < 0) {
      logps[n] = lse[n] = T(0);
      continue;
    }
    const T max = *std::max_element(x, x + V);
    double denom = 0;
    for (int64_t v = 0; v < V; ++v) denom += std::exp(x[v] - max);
    const double row_lse = max + std::log(denom);
    lse[n] = static_cast<T>(row_lse);
    logps[n] = static_cast<T>(x[targets[n]] - row_lse);
  }
}

template <class T>
void sample_tokens(int32_t* tokens, T* logps, T* entropy, const T* logits, const int32_t* streams,
                   const int32_t* steps, int64_t B, int64_t V, int64_t vocab, T temperature, T min_p,
                   uint64_t seed) {
  for (int64_t b = 0; b < B; ++b) {
    const T* x = logits + b * V;
    const T max = *std::max_element(x, x + V);
    double sum = 0, weighted = 0;
    for (int64_t v = 0; v < V; ++v) {
      const double e = std::exp(static_cast<double>(x[v] - max));
      sum += e;
      weighted += e * static_cast<double>(x[v] - max);
    }
    const T top = *std::max_element(x, x + vocab);
    // min_p: exp((x - top) / temperature) >= min_p, at temperature 0 only the top itself.
    const double floor = min_p > 0 && temperature > 0 ? std::log(static_cast<double>(min_p)) : -INFINITY;
    int64_t best = -1;
    T best_key = T(0);
    for (int64_t v = 0; v < vocab; ++v) {
      if (temperature > 0 && static_cast<double>(x[v] - top) / temperature < floor) continue;
      const T key = temperature > 0 ? x[v] / temperature + static_cast<T>(gumbel_noise(seed, streams[b], steps[b], vocab, v))
                                    : x[v];
      if (best < 0 || key > best_key) best = v, best_key = key;
    }
    tokens[b] = static_cast<int32_t>(best);
    logps[b] = static_cast<T>(static_cast<double>(x[best] - max) - std::log(sum));
    entropy[b] = static_cast<T>(std::log(sum) - weighted / sum);
  }
}

template <class T>
void log_softmax_gather_backward(T* dlogits, const T* dlogps, const T* logits, const T* lse,
                                 const int32_t* targets, int64_t N, int64_t V) {
  for (int64_t n = 0; n < N; ++n) {
    const T* x = logits + n * V;
    T* dx = dlogits + n * V;
    const int32_t target = targets[n];
    if (target < 0) {
      std::fill(dx, dx + V, T(0));
      continue;
    }
    // dx may be the row of logits: each element is read before it is written.
    const double g = dlogps[n];
    for (int64_t v = 0; v < V; ++v)
      dx[v] = static_cast<T>(g * ((v == target ? 1.0 : 0.0) - std::exp(x[v] - lse[n])));
  }
}

template <class T>
void cross_entropy_shard_stats(T* stats, const T* logits, const int32_t* targets, int64_t N,
                               int64_t V, int64_t first_id) {
  for (int64_t n = 0; n < N; ++n) {
    const T* x = logits + n * V;
    T max = x[0];
    for (int64_t v = 1; v < V; ++v) max = std::max(max, x[v]);
    double denom = 0;
    for (int64_t v = 0; v < V; ++v) denom += std::exp(x[v] - max);
    const int64_t t = static_cast<int64_t>(targets[n]) - first_id;
    stats[2 * n] = static_cast<T>(max + std::log(denom));
    stats[2 * n + 1] = targets[n] >= 0 && t >= 0 && t < V ? x[t] : T(0);
  }
}

template <class T>
void cross_entropy_shard(T* losses, T* dlogits, const T* logits, const int32_t* targets,
                         const T* all_stats, int64_t S, int64_t N, int64_t V, int64_t first_id,
                         T grad_scale) {
  for (int64_t n = 0; n < N; ++n) {
    T* dx = dlogits != nullptr ? dlogits + n * V : nullptr;
    if (targets[n] < 0) {
      losses[n] = T(0);
      if (dx != nullptr) std::fill(dx, dx + V, T(0));
      continue;
    }
    // Shards in order, so every shard combines the same values the same way.
    T max = all_stats[2 * n];
    for (int64_t s = 1; s < S; ++s) max = std::max(max, all_stats[(s * N + n) * 2]);
    double denom = 0, target_logit = 0;
    for (int64_t s = 0; s < S; ++s) {
      denom += std::exp(all_stats[(s * N + n) * 2] - max);
      target_logit += all_stats[(s * N + n) * 2 + 1];
    }
    const double lse = max + std::log(denom);
    losses[n] = static_cast<T>(lse - target_logit);
    if (dx == nullptr) continue;
    const T* x = logits + n * V;
    const int64_t t = static_cast<int64_t>(targets[n]) - first_id;
    for (int64_t v = 0; v < V; ++v)
      dx[v] = static_cast<T>(static_cast<double>(grad_scale) * std::exp(x[v] - lse) -
                             (v == t ? static_cast<double>(grad_scale) : 0.0));
  }
}

// ---- reductions ----

template <class T>
void sum(T* out, const T* x, int64_t n, bool accumulate) {
  double acc = accumulate ? static_cast<double>(*out) : 0.0;
  for (int64_t i = 0; i < n; ++i) acc += x[i];
  *out = static_cast<T>(acc);
}

template <class T>
void sum_squares(T* out, const T* x, int64_t n, bool accumulate) {
  *out = static_cast<T>((accumulate ? static_cast<double>(*out) : 0.0) + dot(x, x, n));
}

// ---- optimizer and init ----

AdamWSettings AdamWSettings::from(const AdamWArgs& a) {
  return {a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.max_grad_norm, a.step};
}

template <class T>
void init_normal(T* dst, int64_t n, uint64_t seed, uint64_t first_index, T mean, T std) {
  for (int64_t i = 0; i < n; ++i) {
    const T z = static_cast<T>(random_normal(seed, first_index + static_cast<uint64_t>(i)));
    dst[i] = std::fma(std, z, mean);
  }
}

// ---- instantiations ----

#define TESSERA_REF_INSTANTIATE(T)                                                                 \
  template void matmul_forward<T>(T*, const T*, const T*, const T*, const T*, int64_t, int64_t,    \
                                  int64_t, bool, bool, T, T);                                      \
  template void matmul_backward<T>(T*, T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t, \
                                   int64_t, bool, bool, T, T);                                     \
  template void bias_backward<T>(T*, const T*, int64_t, int64_t);                                  \
  template void embedding_forward<T>(T*, const int32_t*, const T*, int64_t, int64_t);              \
  template void embedding_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t);             \
  template void rmsnorm_forward<T>(T*, T*, const T*, const T*, int64_t, int64_t, T);               \
  template void rmsnorm_backward<T>(T*, T*, const T*, const T*, const T*, const T*, int64_t,       \
                                    int64_t);                                                      \
  template void rope_forward<T>(T*, const T*, const AttentionShape&);                              \
  template void rope_backward<T>(T*, const T*, const AttentionShape&);                             \
  template void attention_forward<T>(T*, T*, const T*, const AttentionShape&);                     \
  template void attention_fp8_forward<T>(T*, T*, const T*, const AttentionShape&);                 \
  template void mla_qkv_forward<T>(T*, const T*, int64_t, const T*, int64_t, const T*, const T*,   \
                                   const AttentionShape&, int64_t, int64_t, int64_t);              \
  template void mla_qkv_backward<T>(T*, int64_t, T*, int64_t, T*, const T*, const T*,              \
                                    const AttentionShape&, int64_t, int64_t, int64_t);             \
  template void attention_backward<T>(T*, const T*, const T*, const T*, const T*,                  \
                                      const AttentionShape&);                                      \
  template void attention_head_forward<T>(T*, T*, const T*, const AttentionShape&, int64_t,        \
                                          int64_t, double*);                                       \
  template void attention_head_backward<T>(T*, T*, T*, int64_t, const T*, const T*, const T*,      \
                                           const T*, const AttentionShape&, int64_t, int64_t,      \
                                           double*);                                               \
  template void attention_decode<T>(T*, const T*, const T*, const int32_t*, int64_t,               \
                                    const AttentionShape&);                                        \
  template void swiglu_forward<T>(T*, const T*, int64_t, int64_t);                                 \
  template void swiglu_backward<T>(T*, const T*, const T*, int64_t, int64_t);                      \
  template void cross_entropy<T>(T*, T*, const T*, const int32_t*, int64_t, int64_t, T);           \
  template void attention_gathered_forward<T>(T*, T*, const T*, const T*, const int32_t*, int64_t, \
                                              int64_t, const AttentionShape&);                     \
  template void attention_gathered_head_forward<T>(T*, T*, const T*, const T*, const int32_t*,     \
                                                   int64_t, int64_t, const AttentionShape&,        \
                                                   int64_t, int64_t);                              \
  template void attention_gathered_head_backward<T>(                                               \
      T*, T*, const T*, const T*, const T*, const T*, const T*, const int32_t*, int64_t, int64_t,  \
      const AttentionShape&, int64_t, int64_t);                                                    \
  template void attention_gathered_backward<T>(T*, T*, const T*, const T*, const T*, const T*,     \
                                               const T*, const int32_t*, int64_t, int64_t,         \
                                               const AttentionShape&);                             \
  template void embedding_shard_forward<T>(T*, const int32_t*, const T*, int64_t, int64_t,         \
                                           int64_t, int64_t);                                      \
  template void embedding_shard_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t,        \
                                            int64_t, int64_t);                                     \
  template void add<T>(T*, const T*, const T*, int64_t);                                           \
  template void scale<T>(T*, const T*, T, int64_t);                                                \
  template void softcap<T>(T*, const T*, T, int64_t);                                              \
  template void softcap_backward<T>(T*, const T*, const T*, T, int64_t);                           \
  template void log_softmax_gather<T>(T*, T*, const T*, const int32_t*, int64_t, int64_t);         \
  template void sample_tokens<T>(int32_t*, T*, T*, const T*, const int32_t*, const int32_t*,       \
                                 int64_t, int64_t, int64_t, T, T, uint64_t);                       \
  template void log_softmax_gather_backward<T>(T*, const T*, const T*, const T*, const int32_t*,   \
                                               int64_t, int64_t);                                  \
  template void cross_entropy_shard_stats<T>(T*, const T*, const int32_t*, int64_t, int64_t,       \
                                             int64_t);                                             \
  template void cross_entropy_shard<T>(T*, T*, const T*, const int32_t*, const T*, int64_t,        \
                                       int64_t, int64_t, int64_t, T);                              \
  template void sum<T>(T*, const T*, int64_t, bool);                                               \
  template void sum_squares<T>(T*, const T*, int64_t, bool);                                       \
  template void init_normal<T>(T*, int64_t, uint64_t, uint64_t, T, T);

TESSERA_REF_INSTANTIATE(float)
TESSERA_REF_INSTANTIATE(double)
#undef TESSERA_REF_INSTANTIATE

}  // namespace tessera::ref
