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
#include "tessera/backend/op_checks.h"
#include "tessera/core/fp8.h"
#include "tessera/ops/op_observer.h"

namespace tessera {
namespace {

constexpr std::string_view kBackend = "cpu";

void expect_cpu(const Tensor& t, const char* op, const char* what) {
  expect_on(kBackend, t, DeviceKind::CPU, op, what);
}

void expect_scalar_f32(const Tensor& t, const char* op, const char* what) {
  expect_cpu(t, op, what);
  TS_CHECK(t.dtype == DType::F32 && t.numel() == 1, "cpu {}: {} must be one fp32 value, got {} {}",
           op, what, dtype_name(t.dtype), t.shape.str());
}

// The values of an fp8 tensor times its dequantisation scale.
std::vector<float> dequantize(const Tensor& t, float scale_inv) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  const uint8_t* q = t.as<uint8_t>();
  for (size_t i = 0; i < v.size(); ++i) v[i] = fp8_bits_to_float(q[i], t.dtype) * scale_inv;
  return v;
}

}  // namespace

void CpuBackend::fp8_cast_transpose(const Fp8CastArgs& args) {
  const ObservedOp observed(op_observer_, "fp8_cast_transpose",
                            [&] { return op_args::rows_cols(args.x); });
  const char* op = "fp8_cast_transpose";
  expect_cpu(args.x, op, "x");
  TS_CHECK(args.x.dtype == DType::F32, "cpu {}: x has dtype {}, expected fp32", op,
           dtype_name(args.x.dtype));
  const auto [R, C] = matrix_dims(args.x);
  const float* x = args.x.as<float>();
  if (args.amax.defined()) {
    expect_scalar_f32(args.amax, op, "amax");
    // NaN compares false, so it is tracked apart: a NaN anywhere makes the amax NaN.
    float m = *args.amax.as<float>();
    for (int64_t i = 0; i < R * C && !std::isnan(m); ++i) {
      const float a = std::fabs(x[i]);
      if (std::isnan(a) || a > m) m = a;
    }
    *args.amax.as<float>() = m;
  }
  if (!args.out.defined() && !args.out_t.defined()) return;
  expect_scalar_f32(args.scale, op, "scale");
  const float scale = *args.scale.as<float>();
  const DType format = args.out.defined() ? args.out.dtype : args.out_t.dtype;
  TS_CHECK(is_fp8(format), "cpu {}: output dtype {} is not fp8", op, dtype_name(format));
  if (args.out.defined()) {
    expect_cpu(args.out, op, "out");
    TS_CHECK(args.out.numel() == R * C, "cpu {}: out {} is not ({}, {})", op, args.out.shape.str(), R, C);
  }
  if (args.out_t.defined()) {
    expect_cpu(args.out_t, op, "out_t");
    TS_CHECK(args.out_t.dtype == format && args.out_t.numel() == R * C,
             "cpu {}: out_t {} {} is not ({}, {}) {}", op, dtype_name(args.out_t.dtype),
             args.out_t.shape.str(), C, R, dtype_name(format));
  }
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

void CpuBackend::matmul_fp8(const Fp8MatmulArgs& args) {
  const ObservedOp observed(op_observer_, "matmul_fp8", [&] { return op_args::matmul_fp8(args); });
  const char* op = "matmul_fp8";
  expect_cpu(args.out, op, "out");
  expect_cpu(args.a, op, "a");
  expect_cpu(args.b, op, "b");
  TS_CHECK(args.out.dtype == DType::F32, "cpu {}: out has dtype {}, expected fp32", op,
           dtype_name(args.out.dtype));
  TS_CHECK(is_fp8(args.a.dtype) && is_fp8(args.b.dtype), "cpu {}: a {} and b {} must be fp8", op,
           dtype_name(args.a.dtype), dtype_name(args.b.dtype));
  TS_CHECK(!(args.a.dtype == DType::E5M2 && args.b.dtype == DType::E5M2),
           "cpu {}: e5m2 x e5m2 is not an FP8 GEMM the GPU has", op);
  expect_scalar_f32(args.a_scale_inv, op, "a_scale_inv");
  expect_scalar_f32(args.b_scale_inv, op, "b_scale_inv");
  const auto [M, N] = matrix_dims(args.out);
  const auto [a_rows, K] = matrix_dims(args.a);
  const auto [b_rows, b_cols] = matrix_dims(args.b);
  TS_CHECK(a_rows == M && b_rows == N && b_cols == K, "cpu {}: a {} and b {} do not give out {}",
           op, args.a.shape.str(), args.b.shape.str(), args.out.shape.str());
  const std::vector<float> a = dequantize(args.a, *args.a_scale_inv.as<float>());
  const std::vector<float> b = dequantize(args.b, *args.b_scale_inv.as<float>());
  float* out = args.out.as<float>();
  if (args.c.defined() && args.c.data != args.out.data && args.beta != 0.0f) {
    expect_cpu(args.c, op, "c");
    TS_CHECK(args.c.dtype == DType::F32 && args.c.numel() == M * N, "cpu {}: c {} is not ({}, {}) fp32",
             op, args.c.shape.str(), M, N);
    std::memcpy(out, args.c.data, args.out.nbytes());  // sgemm scales its output in place
  }
  if (M == 0 || N == 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(K), args.alpha, a.data(), static_cast<int>(std::max<int64_t>(1, K)),
              b.data(), static_cast<int>(std::max<int64_t>(1, K)), args.beta, out,
              static_cast<int>(N));
  if (args.bias.defined()) {
    expect_cpu(args.bias, op, "bias");
    TS_CHECK(args.bias.dtype == DType::F32 && args.bias.numel() == N, "cpu {}: bias {} is not ({}) fp32",
             op, args.bias.shape.str(), N);
    const float* bias = args.bias.as<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) out[m * N + n] += bias[n];
  }
}

void CpuBackend::fp8_update_scales(const Fp8ScaleUpdateArgs& args) {
  const ObservedOp observed(op_observer_, "fp8_update_scales",
                            [&] { return op_args::elements(args.amax_history); });
  const char* op = "fp8_update_scales";
  expect_cpu(args.amax_history, op, "amax_history");
  const auto [H, S] = matrix_dims(args.amax_history);
  TS_CHECK(args.amax_history.dtype == DType::F32 && args.scale.numel() == S &&
               args.scale_inv.numel() == S && args.scale.dtype == DType::F32 &&
               args.scale_inv.dtype == DType::F32,
           "cpu {}: history {} needs fp32 scale and scale_inv of {} elements", op,
           args.amax_history.shape.str(), S);
  Fp8ScalingParams p;
  p.fp8_max = args.fp8_max;
  p.margin = args.margin;
  p.most_recent = args.most_recent;
  p.roll = args.roll;
  const int64_t bad = fp8_update_scales_reference(args.amax_history.as<float>(), H, S,
                                                  args.scale.as<float>(), args.scale_inv.as<float>(), p);
  if (bad > 0 && args.nonfinite.defined()) {
    expect_scalar_f32(args.nonfinite, op, "nonfinite");
    *args.nonfinite.as<float>() = NAN;
  }
}

}  // namespace tessera
