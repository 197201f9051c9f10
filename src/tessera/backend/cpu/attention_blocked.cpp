#include "tessera/backend/cpu/attention_blocked.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "tessera/backend/cpu/reference.h"

namespace tessera::cpu {
namespace {

constexpr int64_t kQueryBlock = 64;

// The query head's and its key/value head's rows inside the packed qkv of batch b.
struct HeadView {
  const float* q;
  const float* k;
  const float* v;
  int64_t width;  // row stride of qkv
};

HeadView head_view(const float* qkv, const AttentionShape& s, int64_t b, int64_t h) {
  const int64_t width = s.qkv_width(), D = s.head_dim, kv = h / (s.heads / s.kv_heads);
  const float* base = qkv + b * s.seq * width;
  return {base + h * D, base + (s.heads + kv) * D,
          base + (s.heads + s.kv_heads) * D + kv * s.v_dim(), width};
}

// Keys any row of [r0, r1) of sequence b can see; visible ranges move monotonically with the
// row (documents start in order).
ref::KeyRange block_keys(const AttentionShape& s, int64_t b, int64_t r0, int64_t r1) {
  return {ref::visible_keys(s, r0, b).first, ref::visible_keys(s, r1 - 1, b).last};
}

// scores (rows, n) = scale * q[r0:r1] k[lo:lo+n]^T
void block_scores(float* scores, const HeadView& hv, const AttentionShape& s, int64_t r0, int64_t rows,
                  int64_t lo, int64_t n) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), static_cast<int>(n),
              static_cast<int>(s.head_dim), s.scale, hv.q + r0 * hv.width, static_cast<int>(hv.width),
              hv.k + lo * hv.width, static_cast<int>(hv.width), 0.0f, scores, static_cast<int>(n));
}

}  // namespace

void attention_head_forward_blocked(float* out, float* lse, const float* qkv, const AttentionShape& s,
                                    int64_t b, int64_t h, std::vector<float>& scratch) {
  const HeadView hv = head_view(qkv, s, b, h);
  const int64_t T = s.seq, Dv = s.v_dim(), HD = s.out_width();
  for (int64_t r0 = 0; r0 < T; r0 += kQueryBlock) {
    const int64_t r1 = std::min(T, r0 + kQueryBlock), rows = r1 - r0;
    const ref::KeyRange keys = block_keys(s, b, r0, r1);
    const int64_t lo = keys.first, n = std::max<int64_t>(0, keys.last - keys.first + 1);
    float* out_rows = out + (b * T + r0) * HD + h * Dv;
    float* lse_rows = lse + (b * s.heads + h) * T + r0;
    if (n == 0) {
      for (int64_t i = 0; i < rows; ++i) {
        std::fill(out_rows + i * HD, out_rows + i * HD + Dv, 0.0f);
        lse_rows[i] = -std::numeric_limits<float>::infinity();
      }
      continue;
    }
    scratch.resize(rows * n);
    float* p = scratch.data();
    block_scores(p, hv, s, r0, rows, lo, n);
    for (int64_t i = 0; i < rows; ++i) {
      const ref::KeyRange vis = ref::visible_keys(s, r0 + i, b);
      float* row = p + i * n;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = vis.first; j <= vis.last; ++j) mx = std::max(mx, row[j - lo]);
      double sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t key = lo + j;
        row[j] = key < vis.first || key > vis.last ? 0.0f : std::exp(row[j] - mx);
        sum += row[j];
      }
      const float inv = sum > 0 ? static_cast<float>(1.0 / sum) : 0.0f;
      for (int64_t j = 0; j < n; ++j) row[j] *= inv;
      lse_rows[i] = sum > 0 ? mx + static_cast<float>(std::log(sum)) : -std::numeric_limits<float>::infinity();
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows),
                static_cast<int>(Dv), static_cast<int>(n), 1.0f, p, static_cast<int>(n),
                hv.v + lo * hv.width, static_cast<int>(hv.width), 0.0f, out_rows,
                static_cast<int>(HD));
  }
}

void attention_head_backward_blocked(float* dqkv, float* dk, float* dv, int64_t dk_stride,
                                     int64_t dv_stride, const float* dout, const float* out,
                                     const float* lse, const float* qkv, const AttentionShape& s,
                                     int64_t b, int64_t h, std::vector<float>& scratch) {
  const HeadView hv = head_view(qkv, s, b, h);
  const int64_t T = s.seq, D = s.head_dim, Dv = s.v_dim(), HD = s.out_width(), W = hv.width;
  for (int64_t r0 = 0; r0 < T; r0 += kQueryBlock) {
    const int64_t r1 = std::min(T, r0 + kQueryBlock), rows = r1 - r0;
    const ref::KeyRange keys = block_keys(s, b, r0, r1);
    const int64_t lo = keys.first, n = std::max<int64_t>(0, keys.last - keys.first + 1);
    float* dq_rows = dqkv + (b * T + r0) * W + h * D;
    const float* dout_rows = dout + (b * T + r0) * HD + h * Dv;
    const float* out_rows = out + (b * T + r0) * HD + h * Dv;
    const float* lse_rows = lse + (b * s.heads + h) * T + r0;
    if (n == 0) {
      for (int64_t i = 0; i < rows; ++i) std::fill(dq_rows + i * W, dq_rows + i * W + D, 0.0f);
      continue;
    }
    scratch.resize(2 * rows * n);
    float* p = scratch.data();
    float* ds = p + rows * n;
    block_scores(p, hv, s, r0, rows, lo, n);
    // dP = dout v^T, then dS = P * (dP - delta), delta_i = dout_i . out_i.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                static_cast<int>(n), static_cast<int>(Dv), 1.0f, dout_rows, static_cast<int>(HD),
                hv.v + lo * W, static_cast<int>(W), 0.0f, ds, static_cast<int>(n));
    for (int64_t i = 0; i < rows; ++i) {
      const ref::KeyRange vis = ref::visible_keys(s, r0 + i, b);
      double delta = 0;
      for (int64_t d = 0; d < Dv; ++d)
        delta += static_cast<double>(dout_rows[i * HD + d]) * out_rows[i * HD + d];
      float* prow = p + i * n;
      float* dsrow = ds + i * n;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t key = lo + j;
        const bool visible = key >= vis.first && key <= vis.last && std::isfinite(lse_rows[i]);
        prow[j] = visible ? std::exp(prow[j] - lse_rows[i]) : 0.0f;
        dsrow[j] = prow[j] * (dsrow[j] - static_cast<float>(delta));
      }
    }
    // dq = scale * dS k; dk += scale * dS^T q; dv += P^T dout.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), static_cast<int>(D),
                static_cast<int>(n), s.scale, ds, static_cast<int>(n), hv.k + lo * W, static_cast<int>(W),
                0.0f, dq_rows, static_cast<int>(W));
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(n), static_cast<int>(D),
                static_cast<int>(rows), s.scale, ds, static_cast<int>(n), hv.q + r0 * W,
                static_cast<int>(W), 1.0f, dk + lo * dk_stride, static_cast<int>(dk_stride));
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(n), static_cast<int>(Dv),
                static_cast<int>(rows), 1.0f, p, static_cast<int>(n), dout_rows,
                static_cast<int>(HD), 1.0f, dv + lo * dv_stride, static_cast<int>(dv_stride));
  }
}

}  // namespace tessera::cpu
