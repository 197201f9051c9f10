// FP8 ops of the CPU backend: emulation with the fp32 reference of core/fp8.h. Codes are
// computed exactly as the GPU's satfinite conversion does (fp32 x * scale, then round to
// nearest even), so a GPU run can be compared with the CPU code for code; the GEMM then
// multiplies the dequantised values in fp32, as the tensor cores do.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/core/fp8.h"
#include "tessera/ops/op_checks.h"

namespace tessera {
namespace {

// The values of a K-major fp8 operand (rows, K) times its dequantisation scales.
std::vector<float> dequantize(const Tensor& t, const Tensor& scale_inv, Fp8Scaling scaling) {
  const auto [rows, K] = matrix_dims(t);
  std::vector<float> v(static_cast<size_t>(t.numel()));
  const uint8_t* q = t.as<uint8_t>();
  const float* s = scale_inv.as<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k)
      v[r * K + k] =
          fp8_bits_to_float(q[r * K + k], t.dtype) * s[fp8_scale_index(scaling, rows, K, r, k)];
  return v;
}

}  // namespace

void CpuBackend::do_fp8_cast_transpose(const Fp8CastArgs& args) {
  const auto [R, C] = matrix_dims(args.x);
  const float* x = args.x.as<float>();
  if (args.amax.defined()) {
    // NaN compares false, so it is tracked apart: a NaN anywhere makes the amax NaN.
    float m = *args.amax.as<float>();
    for (int64_t i = 0; i < R * C && !std::isnan(m); ++i) {
      const float a = std::fabs(x[i]);
      if (std::isnan(a) || a > m) m = a;
    }
    *args.amax.as<float>() = m;
  }
  if (!args.out.defined() && !args.out_t.defined()) return;
  const float scale = *args.scale.as<float>();
  const DType format = args.out.defined() ? args.out.dtype : args.out_t.dtype;
  uint8_t* out = args.out.defined() ? args.out.as<uint8_t>() : nullptr;
  uint8_t* out_t = args.out_t.defined() ? args.out_t.as<uint8_t>() : nullptr;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t q = float_to_fp8_bits(x[r * C + c] * scale, format);
      if (out) out[r * C + c] = q;
      if (out_t) out_t[c * R + r] = q;
    }
  }
}

// Group by group, as the per-group casts it replaces: the amax of the group's rows, then each
// element's code into its row-major place and its transposed place (x's transpose with
// offsets, the group's transposed block with group_rows).
void CpuBackend::do_fp8_grouped_cast(const Fp8GroupedCastArgs& args) {
  const OpChecks check("cpu", DeviceKind::CPU, "fp8_grouped_cast");
  const auto [R, C] = matrix_dims(args.x);
  // Group bounds o_0 .. o_G.
  std::vector<int64_t> o;
  if (args.group_rows > 0) {
    for (int64_t r = 0; r <= R; r += args.group_rows) o.push_back(r);
  } else {
    const int32_t* offsets = args.offsets.as<int32_t>();
    o.assign(offsets, offsets + args.offsets.numel());
    for (size_t g = 0; g + 1 < o.size(); ++g)
      check.that(o[g] <= o[g + 1], "offsets decrease at group {} ({} > {})", g, o[g], o[g + 1]);
    check.that(o.front() == 0 && o.back() <= R, "offsets [{}, {}] are not inside the {} rows",
               o.front(), o.back(), R);
  }
  const int64_t G = static_cast<int64_t>(o.size()) - 1;
  const float* x = args.x.as<float>();
  const bool cast = args.out.defined() || args.out_t.defined();
  const DType format = args.out.defined() ? args.out.dtype : args.out_t.dtype;
  uint8_t* out = args.out.defined() ? args.out.as<uint8_t>() : nullptr;
  uint8_t* out_t = args.out_t.defined() ? args.out_t.as<uint8_t>() : nullptr;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t begin = o[g], rows = o[g + 1] - begin;
    if (args.amax.defined()) {
      // NaN compares false, so it is tracked apart: a NaN anywhere makes the amax NaN.
      float& amax = args.amax.as<float>()[args.amax.numel() == 1 ? 0 : g];
      for (int64_t i = begin * C; i < (begin + rows) * C && !std::isnan(amax); ++i) {
        const float a = std::fabs(x[i]);
        if (std::isnan(a) || a > amax) amax = a;
      }
    }
    if (!cast) continue;
    const float scale = args.scale.as<float>()[args.scale.numel() == 1 ? 0 : g];
    // Element (r, c) of the group's block_t (C, rows) at block_t[c * pitch + r].
    uint8_t* block_t = nullptr;
    int64_t pitch = R;
    if (out_t != nullptr && args.group_rows > 0) {
      block_t = out_t + begin * C, pitch = rows;
    } else if (out_t != nullptr) {
      block_t = out_t + begin;
    }
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < C; ++c) {
        const uint8_t q = float_to_fp8_bits(x[(begin + r) * C + c] * scale, format);
        if (out) out[(begin + r) * C + c] = q;
        if (block_t) block_t[c * pitch + r] = q;
      }
    }
  }
}

void CpuBackend::do_matmul_fp8(const Fp8MatmulArgs& args) {
  const auto [M, N] = matrix_dims(args.out);
  const int64_t K = matrix_dims(args.a).cols;
  const std::vector<float> a = dequantize(args.a, args.a_scale_inv, args.a_scaling);
  const std::vector<float> b = dequantize(args.b, args.b_scale_inv, args.b_scaling);
  float* out = args.out.as<float>();
  if (args.c.defined() && args.c.data != args.out.data && args.beta != 0.0f) {
    std::memcpy(out, args.c.data, args.out.nbytes());  // sgemm scales its output in place
  }
  if (M == 0 || N == 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(K), args.alpha, a.data(), static_cast<int>(std::max<int64_t>(1, K)),
              b.data(), static_cast<int>(std::max<int64_t>(1, K)), args.beta, out,
              static_cast<int>(N));
  if (args.bias.defined()) {
    const float* bias = args.bias.as<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) out[m * N + n] += bias[n];
  }
}

// The grouped GEMMs dequantise each group's operands and multiply them in fp32, like
// do_matmul_fp8, one sgemm per group with rows.
void CpuBackend::do_grouped_matmul_fp8(const GroupedFp8MatmulArgs& args) {
  const auto [R, N] = matrix_dims(args.out);
  const int64_t K = args.b.dim(2);
  const std::vector<float> a = dequantize(args.a, args.a_scale_inv, Fp8Scaling::Tensor);
  const uint8_t* b = args.b.as<uint8_t>();
  const float* b_scale_inv = args.b_scale_inv.as<float>();
  float* out = args.out.as<float>();
  std::vector<int32_t> storage;
  const std::span<const int32_t> offsets =
      host_group_offsets(args.offsets, args.host_offsets, storage);
  const int64_t G = static_cast<int64_t>(offsets.size()) - 1;
  std::vector<float> w(static_cast<size_t>(N * K));
  for (int64_t g = 0; g < G; ++g) {
    const int64_t begin = offsets[g], rows = offsets[g + 1] - begin;
    const int64_t e = args.group_weights.empty() ? g : args.group_weights[g];
    if (rows == 0) continue;
    for (int64_t i = 0; i < N * K; ++i)
      w[i] = fp8_bits_to_float(b[e * N * K + i], args.b.dtype) * b_scale_inv[e];
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                static_cast<int>(N), static_cast<int>(K), 1.0f, a.data() + begin * K,
                static_cast<int>(std::max<int64_t>(1, K)), w.data(),
                static_cast<int>(std::max<int64_t>(1, K)), 0.0f, out + begin * N,
                static_cast<int>(std::max<int64_t>(1, N)));
  }
  std::fill(out + static_cast<int64_t>(offsets.back()) * N, out + R * N, 0.0f);
}

void CpuBackend::do_grouped_matmul_fp8_wgrad(const GroupedFp8MatmulWgradArgs& args) {
  const int64_t W = args.out.dim(0), M = args.out.dim(1), N = args.out.dim(2);
  const int64_t R = matrix_dims(args.a_t).cols;
  const std::vector<float> a = dequantize(args.a_t, args.a_scale_inv, Fp8Scaling::Tensor);
  const std::vector<float> b = dequantize(args.b_t, args.b_scale_inv, Fp8Scaling::Tensor);
  float* out = args.out.as<float>();
  std::vector<int32_t> storage;
  const std::span<const int32_t> offsets =
      host_group_offsets(args.offsets, args.host_offsets, storage);
  // A weight's first group applies beta, later ones add; BLAS is never called with K = 0.
  std::vector<char> started(static_cast<size_t>(W), 0);
  const int64_t G = static_cast<int64_t>(offsets.size()) - 1;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t begin = offsets[g], rows = offsets[g + 1] - begin;
    const int64_t e = args.group_weights.empty() ? g : args.group_weights[g];
    if (rows == 0) continue;
    // Group g's columns of a_t (M, R) and b_t (N, R).
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(N),
                static_cast<int>(rows), 1.0f, a.data() + begin, static_cast<int>(R),
                b.data() + begin, static_cast<int>(R), started[e] ? 1.0f : args.beta,
                out + e * M * N, static_cast<int>(N));
    started[e] = 1;
  }
  for (int64_t e = 0; e < W; ++e) {
    if (started[e]) continue;
    float* o = out + e * M * N;
    for (int64_t i = 0; i < M * N; ++i) o[i] = args.beta == 0.0f ? 0.0f : args.beta * o[i];
  }
}

void CpuBackend::do_fp8_block_cast(const Fp8BlockCastArgs& args) {
  const auto [R, C] = matrix_dims(args.x);
  const DType format = args.out.defined() ? args.out.dtype : args.out_t.dtype;
  const bool bad =
      fp8_block_cast_reference(args.x.as<float>(), R, C, args.scaling, format,
                               args.out.defined() ? args.out.as<uint8_t>() : nullptr,
                               args.out.defined() ? args.out_scale_inv.as<float>() : nullptr,
                               args.out_t.defined() ? args.out_t.as<uint8_t>() : nullptr,
                               args.out_t.defined() ? args.out_t_scale_inv.as<float>() : nullptr);
  if (bad && args.nonfinite.defined()) {
    *args.nonfinite.as<float>() = NAN;
  }
}

void CpuBackend::do_fp8_update_scales(const Fp8ScaleUpdateArgs& args) {
  const auto [H, S] = matrix_dims(args.amax_history);
  Fp8ScalingParams p;
  p.fp8_max = args.fp8_max;
  p.margin = args.margin;
  p.most_recent = args.most_recent;
  p.roll = args.roll;
  const int64_t bad = fp8_update_scales_reference(
      args.amax_history.as<float>(), H, S, args.scale.as<float>(), args.scale_inv.as<float>(), p);
  if (bad > 0 && args.nonfinite.defined()) {
    *args.nonfinite.as<float>() = NAN;
  }
}

}  // namespace tessera
