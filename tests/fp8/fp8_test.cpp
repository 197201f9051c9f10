// FP8 on the CPU: the quantisation reference bit by bit, the delayed-scaling arithmetic, the
// CPU backend's emulated ops, the model's FP8 linear layers against its fp32 ones, the
// configuration keys and the checkpointed scaling state.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/ckpt/checkpoint.h"
#include "tessera/config/config.h"
#include "tessera/core/fp8.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/fp8_linears.h"
#include "tessera/model/init.h"
#include "tessera/model/lora_model.h"
#include "tessera/obs/logger.h"
#include "tessera/ops/device_buffer.h"
#include "tessera/ops/op_observer.h"
#include "tessera/train/trainer.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

// Every finite value of a format with its code, ascending.
std::vector<std::pair<float, uint8_t>> finite_values(DType f) {
  std::vector<std::pair<float, uint8_t>> v;
  for (int b = 0; b < 256; ++b) {
    const float x = fp8_bits_to_float(static_cast<uint8_t>(b), f);
    if (std::isfinite(x) && !(x == 0 && std::signbit(x))) v.push_back({x, static_cast<uint8_t>(b)});
  }
  std::sort(v.begin(), v.end());
  return v;
}

// The nearest finite value by brute force, ties to the even code (even mantissa), clamped.
float nearest_by_search(float x, DType f) {
  const auto values = finite_values(f);
  const float a = std::fabs(x);
  if (a >= values.back().first) return std::copysign(values.back().first, x);
  float best = 0;
  double best_d = INFINITY;
  uint8_t best_code = 0;
  for (const auto& [v, code] : values) {
    if (v < 0) continue;
    const double d = std::fabs(static_cast<double>(v) - a);
    if (d < best_d || (d == best_d && (code & 1) == 0 && (best_code & 1) == 1)) {
      best = v, best_d = d, best_code = code;
    }
  }
  return std::copysign(best, x);
}

class Fp8Format : public ::testing::TestWithParam<DType> {};

TEST_P(Fp8Format, Every256CodeRoundTrips) {
  const DType f = GetParam();
  int nan_codes = 0, inf_codes = 0;
  for (int b = 0; b < 256; ++b) {
    const uint8_t code = static_cast<uint8_t>(b);
    const float v = fp8_bits_to_float(code, f);
    if (std::isnan(v)) {
      ++nan_codes;
      EXPECT_EQ(float_to_fp8_bits(v, f), 0x7F) << "code " << b;
    } else if (std::isinf(v)) {
      ++inf_codes;  // E5M2 only: a saturating cast maps Inf to the largest finite value
      EXPECT_EQ(float_to_fp8_bits(v, f), (code & 0x80) | 0x7B) << "code " << b;
    } else {
      EXPECT_EQ(float_to_fp8_bits(v, f), code) << "code " << b << " value " << v;
    }
  }
  EXPECT_EQ(nan_codes, f == DType::E4M3 ? 2 : 6);
  EXPECT_EQ(inf_codes, f == DType::E4M3 ? 0 : 2);
}

TEST_P(Fp8Format, RoundsToNearestEvenAgainstABruteForceSearch) {
  const DType f = GetParam();
  const auto values = finite_values(f);
  std::vector<float> xs;
  for (size_t i = 0; i + 1 < values.size(); ++i) {  // every midpoint (the ties) and near it
    const float mid = (values[i].first + values[i + 1].first) / 2;
    xs.insert(xs.end(), {mid, std::nextafter(mid, -INFINITY), std::nextafter(mid, INFINITY)});
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> e(-20.0f, 17.0f);
  for (int i = 0; i < 20000; ++i) xs.push_back(std::exp2(e(rng)) * (i % 2 ? 1.0f : -1.0f));
  for (const float x : xs) {
    const float got = round_to_fp8(x, f);
    const float want = nearest_by_search(x, f);
    ASSERT_EQ(got, want) << "x = " << x << " (" << dtype_name(f) << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(Fp8, Fp8Format, ::testing::Values(DType::E4M3, DType::E5M2),
                         [](const auto& info) { return std::string(dtype_name(info.param)).substr(4); });

TEST(Fp8Reference, KnownCodesSubnormalsAndSaturation) {
  EXPECT_EQ(fp8_max(DType::E4M3), 448.0f);
  EXPECT_EQ(fp8_max(DType::E5M2), 57344.0f);
  EXPECT_EQ(float_to_fp8_bits(1.0f, DType::E4M3), 0x38);
  EXPECT_EQ(float_to_fp8_bits(1.0f, DType::E5M2), 0x3C);
  EXPECT_EQ(float_to_fp8_bits(448.0f, DType::E4M3), 0x7E);
  EXPECT_EQ(float_to_fp8_bits(-448.0f, DType::E4M3), 0xFE);
  EXPECT_EQ(float_to_fp8_bits(std::ldexp(1.0f, -6), DType::E4M3), 0x08);  // min normal
  EXPECT_EQ(float_to_fp8_bits(std::ldexp(1.0f, -9), DType::E4M3), 0x01);  // min subnormal
  EXPECT_EQ(float_to_fp8_bits(std::ldexp(7.0f, -9), DType::E4M3), 0x07);  // max subnormal
  EXPECT_EQ(float_to_fp8_bits(std::ldexp(1.0f, -16), DType::E5M2), 0x01);
  EXPECT_EQ(float_to_fp8_bits(std::ldexp(1.0f, -14), DType::E5M2), 0x04);
  // Ties to even: halfway below the smallest subnormal is 0, 1.5 subnormals is 2.
  EXPECT_EQ(float_to_fp8_bits(std::ldexp(1.0f, -10), DType::E4M3), 0x00);
  EXPECT_EQ(float_to_fp8_bits(std::ldexp(3.0f, -10), DType::E4M3), 0x02);
  EXPECT_EQ(round_to_fp8(1.0625f, DType::E4M3), 1.0f);
  EXPECT_EQ(round_to_fp8(1.1875f, DType::E4M3), 1.25f);
  EXPECT_EQ(float_to_fp8_bits(-0.0f, DType::E4M3), 0x80);
  EXPECT_EQ(float_to_fp8_bits(1e-30f, DType::E4M3), 0x00);
  for (float big : {449.0f, 464.0f, 480.0f, 1e10f, FLT_MAX, INFINITY})
    EXPECT_EQ(float_to_fp8_bits(big, DType::E4M3), 0x7E) << big;
  EXPECT_EQ(float_to_fp8_bits(-INFINITY, DType::E4M3), 0xFE);
  for (float big : {57345.0f, 61440.0f, 1e9f, INFINITY})
    EXPECT_EQ(float_to_fp8_bits(big, DType::E5M2), 0x7B) << big;
  EXPECT_TRUE(std::isnan(round_to_fp8(NAN, DType::E4M3)));
  EXPECT_TRUE(std::isnan(round_to_fp8(NAN, DType::E5M2)));
}

TEST(Fp8Reference, DelayedScalingUsesMaxOrMostRecentAndMargin) {
  // Two tensors, history of 3 steps; row 0 is this step's amax.
  std::vector<float> h = {2.0f, 8.0f,   // row 0
                          4.0f, 1.0f,   // row 1
                          1.0f, 16.0f}; // row 2
  std::vector<float> scale = {1, 1}, inv = {0, 0};
  Fp8ScalingParams p;
  p.fp8_max = 448.0f;
  EXPECT_EQ(fp8_update_scales_reference(h.data(), 3, 2, scale.data(), inv.data(), p), 0);
  EXPECT_EQ(scale[0], 448.0f / 4.0f);
  EXPECT_EQ(scale[1], 448.0f / 16.0f);
  EXPECT_EQ(inv[1], 16.0f / 448.0f);
  // torch.roll(h, -1, 0) then h[0] = 0: rows move up, the old row 0 goes last.
  EXPECT_EQ(h, (std::vector<float>{0.0f, 0.0f, 1.0f, 16.0f, 2.0f, 8.0f}));

  std::vector<float> h2 = {2.0f, 4.0f, 100.0f, 100.0f};
  p.most_recent = true;
  p.margin = 2;
  fp8_update_scales_reference(h2.data(), 2, 2, scale.data(), inv.data(), p);
  EXPECT_EQ(scale[0], 448.0f / 2.0f / 4.0f);
  EXPECT_EQ(scale[1], 448.0f / 4.0f / 4.0f);
}

TEST(Fp8Reference, ZeroAndNonFiniteAmaxesKeepTheScale) {
  std::vector<float> h = {0.0f, NAN, INFINITY, 1e-44f, 0.0f, 0.0f, 0.0f, 0.0f};
  std::vector<float> scale = {3, 5, 7, 1}, inv(4);
  Fp8ScalingParams p;
  p.fp8_max = 57344.0f;
  EXPECT_EQ(fp8_update_scales_reference(h.data(), 2, 4, scale.data(), inv.data(), p), 2);
  EXPECT_EQ(scale[0], 3.0f);  // amax 0: no information
  EXPECT_EQ(scale[1], 5.0f);  // NaN: reported, previous scale
  EXPECT_EQ(scale[2], 7.0f);  // Inf: reported, previous scale
  EXPECT_EQ(scale[3], FLT_MAX);  // fp8_max / tiny overflows
  EXPECT_EQ(inv[1], 1.0f / 5.0f);
  for (float v : h) EXPECT_TRUE(std::isfinite(v)) << "a non-finite amax stayed in the history";
  // Without roll (a just-in-time scale), the history is left as it is.
  std::vector<float> one = {4.0f};
  std::vector<float> s1 = {1}, i1 = {1};
  p.roll = false;
  p.fp8_max = 448.0f;
  fp8_update_scales_reference(one.data(), 1, 1, s1.data(), i1.data(), p);
  EXPECT_EQ(one[0], 4.0f);
  EXPECT_EQ(s1[0], 112.0f);
}

// ---------------------------------------------------------------- CPU backend ops

struct CpuOps : ::testing::Test {
  std::unique_ptr<Backend> b = make_cpu_backend();
  DeviceBuffer buf{*b, 1 << 20, "fp8 test"};
  size_t used = 0;
  Tensor make(DType t, Shape s) {
    Tensor x = buf.tensor(t, s, used);
    used += (x.nbytes() + 255) / 256 * 256;
    return x;
  }
  Tensor scalar(float v) {
    Tensor t = make(DType::F32, {1});
    b->upload(t, &v);
    return t;
  }
  float value(const Tensor& t) {
    float v;
    b->download(&v, t);
    return v;
  }
  std::vector<float> values(const Tensor& t) {
    std::vector<float> v(t.numel());
    b->download(v.data(), t);
    return v;
  }
  // A norm's input (R, C) and weight (C), fixed values of either sign.
  std::pair<Tensor, Tensor> norm_inputs(int64_t R, int64_t C) {
    std::vector<float> x(R * C), w(C);
    for (size_t i = 0; i < x.size(); ++i) x[i] = 3.0f * std::sin(1.3f * static_cast<float>(i));
    for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5f + 0.25f * static_cast<float>(i);
    const Tensor xt = make(DType::F32, {R, C}), wt = make(DType::F32, {C});
    b->upload(xt, x.data());
    b->upload(wt, w.data());
    return {xt, wt};
  }
  std::vector<uint8_t> codes(const Tensor& t) {
    std::vector<uint8_t> c(t.numel());
    b->download(c.data(), t);
    return c;
  }
  // A producer with its output's cast folded in writes what the producer then the cast write:
  // `produce(out, codes)` writes out (R, F) with its plain op (codes null) or its
  // *_forward_cast; then its output, codes and amax are compared.
  void expect_cast_folded_in(
      int64_t R, int64_t F, const std::function<void(const Tensor&, const Fp8CastArgs*)>& produce) {
    const Tensor out = make(DType::F32, {R, F}), out_fused = make(DType::F32, {R, F});
    produce(out, nullptr);
    const Tensor scale = scalar(37.0f);
    const Fp8CastArgs cast{out, make(DType::E4M3, {R, F}), {}, scale, scalar(0.0f)};
    b->fp8_cast_transpose(cast);
    const Fp8CastArgs fused{{}, make(DType::E4M3, {R, F}), {}, scale, scalar(0.0f)};
    produce(out_fused, &fused);
    EXPECT_EQ(values(out), values(out_fused));
    EXPECT_EQ(codes(cast.out), codes(fused.out));
    EXPECT_GT(value(cast.amax), 0.0f);
    EXPECT_EQ(value(fused.amax), value(cast.amax));
  }
};

TEST_F(CpuOps, CastTransposeWritesCodesTransposeAndAmax) {
  const int64_t R = 5, C = 7;
  std::vector<float> x(R * C);
  for (int64_t i = 0; i < R * C; ++i) x[i] = std::sin(0.7f * i) * (i + 1);
  const Tensor xt = make(DType::F32, {R, C});
  b->upload(xt, x.data());
  const Tensor out = make(DType::E5M2, {R, C}), out_t = make(DType::E5M2, {C, R});
  const float scale = 3.0f;
  Fp8CastArgs a{xt, out, out_t, scalar(scale), scalar(0.0f)};
  b->fp8_cast_transpose(a);
  std::vector<uint8_t> q(R * C), qt(R * C);
  b->download(q.data(), out);
  b->download(qt.data(), out_t);
  float amax = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      EXPECT_EQ(q[r * C + c], float_to_fp8_bits(x[r * C + c] * scale, DType::E5M2));
      EXPECT_EQ(qt[c * R + r], q[r * C + c]);
      amax = std::max(amax, std::fabs(x[r * C + c]));
    }
  EXPECT_EQ(value(a.amax), amax);
  x[11] = NAN;  // a NaN makes the amax NaN (and is not lost behind a larger value)
  x[12] = 1e30f;
  b->upload(xt, x.data());
  b->fp8_cast_transpose(Fp8CastArgs{xt, {}, {}, {}, a.amax});
  EXPECT_TRUE(std::isnan(value(a.amax)));
  x[11] = -INFINITY;
  b->upload(xt, x.data());
  const Tensor amax2 = scalar(0.0f);
  b->fp8_cast_transpose(Fp8CastArgs{xt, out, {}, a.scale, amax2});
  EXPECT_EQ(value(amax2), INFINITY);
  b->download(q.data(), out);
  EXPECT_EQ(q[11], 0xFB) << "-Inf saturates to -max in the cast; the amax reports it";
}

// The SwiGLU with its cast on the way writes what swiglu_forward then the cast write: h, its
// codes and its amax.
TEST_F(CpuOps, SwigluForwardCastIsSwigluThenTheCast) {
  const int64_t R = 6, F = 5;
  std::vector<float> x(R * 2 * F);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 3.0f * std::sin(1.3f * static_cast<float>(i));
  const Tensor gate_up = make(DType::F32, {R, 2 * F});
  b->upload(gate_up, x.data());
  expect_cast_folded_in(R, F, [&](const Tensor& h, const Fp8CastArgs* codes) {
    if (codes) return b->swiglu_forward_cast(h, gate_up, *codes);
    b->swiglu_forward(h, gate_up);
  });
}

// Without h the SwiGLU writes h's codes in either layout or both, and the amax, as the cast of
// the h swiglu_forward writes: the transposed codes a down projection keeps in h's place.
TEST_F(CpuOps, SwigluForwardCastWritesEitherLayoutWithoutH) {
  const int64_t R = 6, F = 5;
  std::vector<float> x(R * 2 * F);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 3.0f * std::sin(1.3f * static_cast<float>(i));
  const Tensor gate_up = make(DType::F32, {R, 2 * F}), h = make(DType::F32, {R, F});
  b->upload(gate_up, x.data());
  b->swiglu_forward(h, gate_up);
  const Tensor scale = scalar(37.0f);
  const Fp8CastArgs cast{h, make(DType::E4M3, {R, F}), make(DType::E4M3, {F, R}), scale,
                         scalar(0.0f)};
  b->fp8_cast_transpose(cast);
  for (const bool rows : {true, false}) {
    const Fp8CastArgs folded{{},
                             rows ? make(DType::E4M3, {R, F}) : Tensor{},
                             make(DType::E4M3, {F, R}),
                             scale,
                             scalar(0.0f)};
    b->swiglu_forward_cast({}, gate_up, folded);
    if (rows) EXPECT_EQ(codes(folded.out), codes(cast.out));
    EXPECT_EQ(codes(folded.out_t), codes(cast.out_t));
    EXPECT_EQ(value(folded.amax), value(cast.amax));
  }
}

// The pre-norm with its cast on the way writes what rmsnorm_forward then the cast write: the
// normed rows, their statistics, the codes and the amax.
TEST_F(CpuOps, RmsnormForwardCastIsTheNormThenTheCast) {
  const int64_t R = 6, C = 5;
  const auto [xt, wt] = norm_inputs(R, C);
  const Tensor rstd = make(DType::F32, {R}), rstd_fused = make(DType::F32, {R});
  expect_cast_folded_in(R, C, [&](const Tensor& out, const Fp8CastArgs* codes) {
    if (codes) return b->rmsnorm_forward_cast(out, rstd_fused, xt, wt, 1e-5f, *codes);
    b->rmsnorm_forward(out, rstd, xt, wt, 1e-5f);
  });
  EXPECT_EQ(values(rstd), values(rstd_fused));
}

// Without its output the pre-norm writes the codes and its statistics alone, and
// rmsnorm_transposed_codes writes, from the norm's input, the transposed codes the cast of that
// output writes: the gate_up and QKV projections' weight-gradient codes where ln is not kept.
TEST_F(CpuOps, RmsnormCodesWithoutItsOutputAreTheCastOfIt) {
  const int64_t R = 6, C = 5;
  const auto [xt, wt] = norm_inputs(R, C);
  const Tensor out = make(DType::F32, {R, C}), rstd = make(DType::F32, {R});
  b->rmsnorm_forward(out, rstd, xt, wt, 1e-5f);
  const Tensor scale = scalar(37.0f);
  const Fp8CastArgs cast{out, make(DType::E4M3, {R, C}), make(DType::E4M3, {C, R}), scale,
                         scalar(0.0f)};
  b->fp8_cast_transpose(cast);
  const Tensor rstd_folded = make(DType::F32, {R});
  const Fp8CastArgs rows{{}, make(DType::E4M3, {R, C}), {}, scale, scalar(0.0f)};
  b->rmsnorm_forward_cast({}, rstd_folded, xt, wt, 1e-5f, rows);
  EXPECT_EQ(codes(rows.out), codes(cast.out));
  EXPECT_EQ(value(rows.amax), value(cast.amax));
  EXPECT_EQ(values(rstd_folded), values(rstd));
  const Fp8CastArgs transposed{{}, {}, make(DType::E4M3, {C, R}), scale, {}};
  b->rmsnorm_transposed_codes(transposed, xt, rstd, wt, 1e-5f);
  EXPECT_EQ(codes(transposed.out_t), codes(cast.out_t));
}

// The SwiGLU backward with its gradient's cast writes what swiglu_backward then the cast write
// (both layouts and the amax).
TEST_F(CpuOps, SwigluBackwardCastIsTheBackwardThenTheCast) {
  const int64_t R = 6, F = 5;
  std::vector<float> x(R * 2 * F), d(R * F);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 3.0f * std::sin(1.3f * static_cast<float>(i));
  for (size_t i = 0; i < d.size(); ++i) d[i] = 0.1f * std::cos(0.7f * static_cast<float>(i));
  const Tensor gate_up = make(DType::F32, {R, 2 * F}), dh = make(DType::F32, {R, F});
  b->upload(gate_up, x.data());
  b->upload(dh, d.data());
  const Tensor dgate_up = make(DType::F32, {R, 2 * F}), scratch = make(DType::F32, {R, 2 * F});
  b->swiglu_backward(dgate_up, dh, gate_up);
  const Tensor scale = scalar(300.0f);
  const Fp8CastArgs cast{dgate_up, make(DType::E5M2, {R, 2 * F}), make(DType::E5M2, {2 * F, R}),
                         scale, scalar(0.0f)};
  b->fp8_cast_transpose(cast);
  const Fp8CastArgs folded{
      {}, make(DType::E5M2, {R, 2 * F}), make(DType::E5M2, {2 * F, R}), scale, scalar(0.0f)};
  b->swiglu_backward_cast(scratch, dh, gate_up, folded);
  EXPECT_EQ(codes(folded.out), codes(cast.out));
  EXPECT_EQ(codes(folded.out_t), codes(cast.out_t));
  EXPECT_GT(value(cast.amax), 0.0f);
  EXPECT_EQ(value(folded.amax), value(cast.amax));
}

// Codes that do not fit the producer's output, or a layout the ops do not write, are refused
// before anything is written, naming the op and the argument.
TEST_F(CpuOps, ForwardCastsRefuseCodesThatAreNotTheirOutputs) {
  const int64_t R = 4, F = 8;
  const Tensor gate_up = make(DType::F32, {R, 2 * F}), h = make(DType::F32, {R, F});
  const Tensor weight = make(DType::F32, {F}), rstd = make(DType::F32, {R});
  b->fill(gate_up, 1.0f);
  b->fill(weight, 1.0f);
  const Tensor scale = scalar(2.0f);
  const std::vector<std::pair<std::string, std::function<void(const Fp8CastArgs&)>>> ops = {
      {"swiglu_forward_cast", [&](const Fp8CastArgs& c) { b->swiglu_forward_cast(h, gate_up, c); }},
      {"rmsnorm_forward_cast", [&](const Fp8CastArgs& c) {
         b->rmsnorm_forward_cast(h, rstd, gate_up.flat_range(0, R * F).view({R, F}), weight, 1e-5f,
                                 c);
       }}};
  for (const auto& [op, run] : ops) {
    b->fill(h, -3.0f);
    auto refused = [&](const Fp8CastArgs& codes, const char* what) {
      try {
        run(codes);
        ADD_FAILURE() << op << " accepted: " << what;
      } catch (const InternalError& e) {
        EXPECT_NE(std::string(e.what()).find(op), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      }
    };
    refused({{}, make(DType::E4M3, {R, F - 1}), {}, scale, {}}, "codes.out");
    refused({{}, {}, {}, scale, {}}, "codes.out");
    // The SwiGLU writes a transposed layout too (swiglu_forward_cast), of out's shape only.
    refused({{}, make(DType::E4M3, {R, F}), make(DType::E4M3, {F, R - 1}), scale, {}},
            "codes.out_t");
    refused({{}, make(DType::E4M3, {R, F}), {}, {}, {}}, "codes.scale");
    std::vector<float> untouched(R * F);
    b->download(untouched.data(), h);
    EXPECT_EQ(untouched, std::vector<float>(R * F, -3.0f))
        << op << ": output written by a refused call";
  }
}

// The backward's codes must be both layouts of d(gate_up), with a scale; anything else is
// refused before anything is written, naming the op and the argument.
TEST_F(CpuOps, SwigluBackwardCastRefusesCodesThatAreNotTheGradients) {
  const int64_t R = 4, F = 8;
  const Tensor gate_up = make(DType::F32, {R, 2 * F}), dh = make(DType::F32, {R, F});
  const Tensor dgate_up = make(DType::F32, {R, 2 * F});
  b->fill(gate_up, 1.0f);
  b->fill(dh, 1.0f);
  b->fill(dgate_up, -3.0f);
  const Tensor scale = scalar(2.0f);
  const Tensor codes = make(DType::E5M2, {R, 2 * F}), codes_t = make(DType::E5M2, {2 * F, R});
  auto refused = [&](const Fp8CastArgs& c, const char* what) {
    try {
      b->swiglu_backward_cast(dgate_up, dh, gate_up, c);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const InternalError& e) {
      EXPECT_NE(std::string(e.what()).find("swiglu_backward_cast"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused({{}, codes, {}, scale, {}}, "codes.out_t");
  refused({{}, make(DType::E5M2, {R, F}), codes_t, scale, {}}, "codes.out");
  refused({dgate_up, codes, codes_t, scale, {}}, "codes.x");
  refused({{}, codes, codes_t, {}, {}}, "codes.scale");
  std::vector<float> untouched(R * 2 * F);
  b->download(untouched.data(), dgate_up);
  EXPECT_EQ(untouched, std::vector<float>(R * 2 * F, -3.0f)) << "written by a refused call";
}

// The norm's transposed codes are all the op writes: a row-major layout, an amax (recorded in
// the forward) or codes of another shape are refused by name before anything is written.
TEST_F(CpuOps, RmsnormTransposedCodesRefusesCodesThatAreNotTheTransposedOutput) {
  const int64_t R = 4, C = 8;
  const auto [xt, wt] = norm_inputs(R, C);
  const Tensor rstd = make(DType::F32, {R});
  b->rmsnorm_forward(make(DType::F32, {R, C}), rstd, xt, wt, 1e-5f);
  const Tensor codes_t = make(DType::E4M3, {C, R}), scale = scalar(2.0f);
  const std::vector<uint8_t> before = codes(codes_t);
  auto refused = [&](const Fp8CastArgs& c, const char* what) {
    try {
      b->rmsnorm_transposed_codes(c, xt, rstd, wt, 1e-5f);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const InternalError& e) {
      EXPECT_NE(std::string(e.what()).find("rmsnorm_transposed_codes"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused({{}, make(DType::E4M3, {R, C}), codes_t, scale, {}}, "codes.out");
  refused({{}, {}, codes_t, scale, scalar(0.0f)}, "codes.amax");
  refused({{}, {}, make(DType::E4M3, {C, R - 1}), scale, {}}, "codes.out_t");
  refused({{}, {}, codes_t, {}, {}}, "codes.scale");
  EXPECT_EQ(codes(codes_t), before) << "written by a refused call";
}

// The FP8 weight gradient takes its operands as the activations' transposes, (M, rows) and
// (N, rows): one in the old per-group layout (flat rows x M) is refused by name, nothing
// written; the right shapes run from the device's offsets alone and from the host's alike.
TEST_F(CpuOps, Fp8GroupedWeightGradientTakesTransposedOperands) {
  const Tensor offsets = make(DType::I32, {3});
  const int32_t host[3] = {0, 16, 48};
  b->upload(offsets, host);
  GroupedFp8MatmulWgradArgs w;
  w.out = make(DType::F32, {2, 16, 32});
  w.a_t = make(DType::E4M3, {64 * 16});
  w.b_t = make(DType::E4M3, {32, 64});
  w.a_scale_inv = scalar(0.5f);
  w.b_scale_inv = scalar(2.0f);
  w.offsets = offsets;
  b->fill(w.out, 7.0f);
  try {
    b->grouped_matmul_fp8_wgrad(w);
    ADD_FAILURE() << "a flat a_t accepted";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("grouped_matmul_fp8_wgrad"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("are not (16, rows) and (32, rows)"), std::string::npos)
        << e.what();
  }
  for (float v : values(w.out)) ASSERT_EQ(v, 7.0f) << "written by a refused call";
  w.a_t = make(DType::E4M3, {16, 64});
  std::vector<uint8_t> codes(64 * 32);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>((i * 29 + 3) % 0x70);
  b->upload(w.a_t, codes.data());
  b->upload(w.b_t, codes.data());
  b->grouped_matmul_fp8_wgrad(w);
  const std::vector<float> device_offsets = values(w.out);
  w.host_offsets = host;
  b->grouped_matmul_fp8_wgrad(w);
  EXPECT_EQ(values(w.out), device_offsets);
  // Expert 0 from columns 0..15 of both: a_t[0, :16] . b_t[0, :16], scaled by 0.5 x 2.
  double want = 0;
  for (int r = 0; r < 16; ++r)
    want += fp8_bits_to_float(codes[r], DType::E4M3) * fp8_bits_to_float(codes[r], DType::E4M3);
  EXPECT_NEAR(device_offsets[0], want, 1e-3 * std::fabs(want));
}

// A linear's backward takes an input's transposed codes only where its forward took the
// input's codes from the producer (delayed scaling with a history): before the first history
// (just-in-time scales) they are refused, naming the linear.
TEST_F(CpuOps, Fp8LinearRefusesTransposedInputCodesWhereItCastsItsInput) {
  Fp8Options o;
  o.mode = Fp8Mode::Hybrid;
  Fp8Linears fp8(*b, o, {{.name = "down", .out = 16, .in = 32}}, 16);
  EXPECT_FALSE(fp8.input_cast(0, 16).out.defined()) << "no history: the forward casts";
  const Tensor weight = make(DType::F32, {16, 32}), dout = make(DType::F32, {16, 16});
  b->fill(weight, 0.5f);
  b->fill(dout, 0.25f);
  try {
    fp8.backward(0, make(DType::F32, {16, 32}),
                 dout, LinearOperand::transposed_codes(make(DType::E4M3, {32, 16})), weight,
                 make(DType::F32, {16, 32}), 0.0f);
    ADD_FAILURE() << "transposed input codes accepted where the backward casts its input";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("fp8 down: transposed input codes"), std::string::npos)
        << e.what();
  }
}

TEST_F(CpuOps, MatmulFp8IsTheGemmOfDequantisedCodes) {
  const int64_t M = 16, N = 32, K = 48;
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> a(M * K), w(N * K), bias(N), res(M * N);
  for (auto* v : {&a, &w, &bias, &res})
    for (auto& x : *v) x = d(rng);
  const Tensor at = make(DType::F32, {M, K}), wt = make(DType::F32, {N, K});
  b->upload(at, a.data());
  b->upload(wt, w.data());
  const Tensor a8 = make(DType::E5M2, {M, K}), w8 = make(DType::E4M3, {N, K});
  const float sa = 1000.0f, sw = 50.0f;
  b->fp8_cast_transpose({at, a8, {}, scalar(sa), {}});
  b->fp8_cast_transpose({wt, w8, {}, scalar(sw), {}});
  const Tensor out = make(DType::F32, {M, N}), c = make(DType::F32, {M, N}), bt = make(DType::F32, {N});
  b->upload(c, res.data());
  b->upload(bt, bias.data());
  Fp8MatmulArgs m;
  m.out = out, m.a = a8, m.b = w8, m.a_scale_inv = scalar(1 / sa), m.b_scale_inv = scalar(1 / sw);
  m.beta = 1.0f, m.c = c, m.bias = bt;
  b->matmul_fp8(m);
  std::vector<float> got(M * N);
  b->download(got.data(), out);
  double worst_vs_fp32 = 0, norm = 0;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double ref = res[i * N + j] + bias[j], exact = ref;
      for (int64_t k = 0; k < K; ++k) {
        ref += double(round_to_fp8(a[i * K + k] * sa, DType::E5M2) * (1 / sa)) *
               (round_to_fp8(w[j * K + k] * sw, DType::E4M3) * (1 / sw));
        exact += double(a[i * K + k]) * w[j * K + k];
      }
      EXPECT_NEAR(got[i * N + j], ref, 1e-4 * (1 + std::fabs(ref)));
      worst_vs_fp32 = std::max(worst_vs_fp32, std::fabs(got[i * N + j] - exact));
      norm = std::max(norm, std::fabs(exact));
    }
  // E5M2 keeps 2 mantissa bits (relative step 2^-3), E4M3 3: over K = 48 products of unit
  // values the error stays well below the result's scale.
  EXPECT_LT(worst_vs_fp32 / norm, 0.15);
  EXPECT_GT(worst_vs_fp32, 0.0) << "no quantisation error at all: not FP8";
}

TEST_F(CpuOps, UpdateScalesReportsNonFiniteAmaxes) {
  const Tensor h = make(DType::F32, {2, 2}), s = make(DType::F32, {2}), si = make(DType::F32, {2});
  const std::vector<float> hv = {4.0f, NAN, 8.0f, 1.0f}, ones = {1, 1};
  b->upload(h, hv.data());
  b->upload(s, ones.data());
  const Tensor flag = scalar(0.0f);
  Fp8ScaleUpdateArgs u;
  u.amax_history = h, u.scale = s, u.scale_inv = si, u.nonfinite = flag, u.fp8_max = 448.0f;
  b->fp8_update_scales(u);
  EXPECT_TRUE(std::isnan(value(flag)));
  std::vector<float> sv(2);
  b->download(sv.data(), s);
  EXPECT_EQ(sv[0], 448.0f / 8.0f);
  EXPECT_EQ(sv[1], 1.0f);
}

// ---------------------------------------------------------------- the model's FP8 linears

ModelSpec tiny_spec() {
  ModelSpec s;
  s.vocab_size = 128;
  s.tokenizer_vocab = 128;
  s.max_position_embeddings = 64;
  s.hidden = 64;
  s.ffn = 128;
  s.num_layers = 2;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 16;
  return s;
}

struct ModelRun {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  std::unique_ptr<DecoderModel> model;
  std::vector<float> grads;
  float loss = 0;
};

// The runtime of the model tests: micro_batch sequences of seq tokens, with `fp8`.
ModelRuntime fp8_runtime(int64_t micro_batch, int64_t seq, const Fp8Options& fp8) {
  ModelRuntime rt;
  rt.micro_batch = micro_batch;
  rt.seq_length = seq;
  rt.fp8 = fp8;
  return rt;
}

// `steps` forward-backward passes over one batch of `tokens` tokens without updates, each
// ended by the model's step hooks (FP8 scaling) as the trainer ends a step; the last pass's
// loss sum and gradients.
void run_passes(Backend& b, Model& m, int tokens, int steps, float& loss, std::vector<float>& grads) {
  std::vector<int32_t> ids(tokens), targets(tokens);
  for (int i = 0; i < tokens; ++i) ids[i] = (i * 37) % 128, targets[i] = (i * 53 + 1) % 128;
  DeviceBuffer norm(b, 4, "norm");
  for (int step = 0; step < steps; ++step) {
    m.set_batch(ids.data(), targets.data());
    m.zero_grads();
    m.zero_loss_sum();
    m.forward_backward(1.0f / static_cast<float>(tokens));
    for (StepHook* hook : m.step_hooks()) {
      b.fill(norm.tensor(DType::F32, {1}), 0.0f);
      hook->end_step(norm.tensor(DType::F32, {1}));
    }
  }
  b.download(&loss, m.loss_sum());
  grads.resize(m.layout().total);
  b.download(grads.data(), m.grads());
}

ModelRun run_model(const Fp8Options& fp8, int steps = 1) {
  ModelRun r;
  const ModelRuntime rt = fp8_runtime(2, 16, fp8);
  const ModelSpec spec = tiny_spec();
  r.model = std::make_unique<DecoderModel>(*r.backend, spec, rt);
  init_parameters(*r.backend, spec, r.model->layout(), r.model->params(), 11);
  run_passes(*r.backend, *r.model, 32, steps, r.loss, r.grads);
  return r;
}

double rel_err(const std::vector<float>& a, const std::vector<float>& ref, int64_t off, int64_t n) {
  double d = 0, s = 0;
  for (int64_t i = off; i < off + n; ++i) d += double(a[i] - ref[i]) * (a[i] - ref[i]), s += double(ref[i]) * ref[i];
  return std::sqrt(d / std::max(s, 1e-30));
}

class Fp8Model : public ::testing::TestWithParam<std::tuple<Fp8Mode, Fp8Recipe, bool>> {};

TEST_P(Fp8Model, LossAndGradientsStayNearFp32) {
  Fp8Options o;
  std::tie(o.mode, o.recipe, o.weight_cache) = GetParam();
  o.lm_head = true;
  o.amax_history_len = 4;
  const ModelRun ref = run_model(Fp8Options{});
  // Three steps on the same batch without updates: the first scales just in time, the
  // later ones from the history (delayed), so both paths are exercised.
  const ModelRun fp8 = run_model(o, 3);
  EXPECT_NEAR(fp8.loss / ref.loss, 1.0, 0.02);
  for (const ParamInfo& p : ref.model->layout().params) {
    const double e = rel_err(fp8.grads, ref.grads, p.offset, p.numel());
    // E5M2 gradients carry 2 mantissa bits: a few percent per GEMM, compounded over layers.
    EXPECT_LT(e, o.mode == Fp8Mode::Hybrid ? 0.25 : 0.15) << p.name;
    EXPECT_GT(e, 0.0) << p.name << ": identical to fp32, so FP8 did not run";
  }
  float status = 0;
  fp8.backend->download(&status, fp8.model->fp8()->status());
  EXPECT_EQ(status, 0.0f);
}

INSTANTIATE_TEST_SUITE_P(
    Fp8, Fp8Model,
    ::testing::Values(std::tuple{Fp8Mode::Hybrid, Fp8Recipe::Delayed, true},
                      std::tuple{Fp8Mode::Hybrid, Fp8Recipe::Delayed, false},
                      std::tuple{Fp8Mode::Hybrid, Fp8Recipe::Tensorwise, true},
                      std::tuple{Fp8Mode::E4M3, Fp8Recipe::Delayed, true}));

// Counts the ops a run launches that may write an FP8 linear's input codes (the SwiGLU, the
// norms and attention), with their cast folded in or not.
class ProducerOps final : public OpObserver {
 public:
  void op_begin(const char* name, const OpArgs& /*args*/) override {
    const std::string_view op = name;
    swiglu_folded += op == "swiglu_forward_cast";
    swiglu_plain += op == "swiglu_forward";
    norm_folded += op == "rmsnorm_forward_cast";
    norm_plain += op == "rmsnorm_forward";
    attention_folded += op == "attention_forward_cast";
    attention_plain += op == "attention_forward";
    backward_folded += op == "swiglu_backward_cast";
    backward_plain += op == "swiglu_backward";
    passes += op == "embedding_forward";
    second_pass_casts += passes == 2 && op == "fp8_cast_transpose";
    norm_codes_t += op == "rmsnorm_transposed_codes";
  }
  void op_end() override {}
  void range_begin(const char*) override {}
  void range_end() override {}
  int swiglu_folded = 0, swiglu_plain = 0, norm_folded = 0, norm_plain = 0;
  int attention_folded = 0, attention_plain = 0, backward_folded = 0, backward_plain = 0;
  int passes = 0, second_pass_casts = 0, norm_codes_t = 0;
};

// Delayed scaling with one step of most-recent history, over one batch and unchanged weights,
// gives every tensor the scale tensorwise scaling computes from the tensor itself. From its
// second pass the delayed run takes the input codes of the down projections from the SwiGLU
// (swiglu_forward_cast), those of the QKV and gate_up projections from the pre-norms
// (rmsnorm_forward_cast) and those of the output projections from attention
// (attention_forward_cast), into Fp8Linears::input_cast's target, instead of casting their
// inputs, and the gate_up projections' output-gradient codes from the SwiGLU backward
// (swiglu_backward_cast, into output_grad_cast's target), the down projections' transposed
// input codes, kept from the SwiGLU in h's place, and the QKV and gate_up projections', written
// in the backward from the pre-norms' inputs (rmsnorm_transposed_codes); tensorwise never can. So
// the two must agree bit for bit: the folded codes go where the GEMMs read them, with each slot's
// scale and amax. Two passes of the tiny model, delayed (one step of most-recent history) or
// tensorwise, with the ops counted.
ModelRun run_two_passes(Fp8Recipe recipe, RecomputeGranularity recompute, ProducerOps& ops) {
  Fp8Options o;
  o.mode = Fp8Mode::Hybrid;
  o.recipe = recipe;
  o.amax_history_len = 1;
  o.amax_algo = Fp8AmaxAlgo::MostRecent;
  ModelRuntime rt = fp8_runtime(2, 16, o);
  rt.recompute = recompute;
  const ModelSpec spec = tiny_spec();
  ModelRun r;
  r.model = std::make_unique<DecoderModel>(*r.backend, spec, rt);
  init_parameters(*r.backend, spec, r.model->layout(), r.model->params(), 11);
  r.backend->set_op_observer(&ops);
  run_passes(*r.backend, *r.model, 32, 2, r.loss, r.grads);
  r.backend->set_op_observer(nullptr);
  return r;
}

TEST(Fp8Model, InputCodesFromTheirProducersChangeNoBit) {
  ProducerOps folded_ops, plain_ops;
  const ModelRun folded =
      run_two_passes(Fp8Recipe::Delayed, RecomputeGranularity::None, folded_ops);
  const ModelRun plain =
      run_two_passes(Fp8Recipe::Tensorwise, RecomputeGranularity::None, plain_ops);
  const int L = static_cast<int>(tiny_spec().num_layers);
  EXPECT_EQ(folded_ops.swiglu_folded, L) << "the second pass's SwiGLUs, one a layer";
  EXPECT_EQ(folded_ops.swiglu_plain, L) << "the first pass's, scaled just in time";
  EXPECT_EQ(folded_ops.norm_folded, 2 * L) << "the second pass's pre-norms, two a layer";
  EXPECT_EQ(folded_ops.norm_plain, 2 * L + 2) << "the first pass's, and the final norms";
  EXPECT_EQ(folded_ops.attention_folded, L) << "the second pass's attention, one a layer";
  EXPECT_EQ(folded_ops.attention_plain, L) << "the first pass's";
  EXPECT_EQ(folded_ops.backward_folded, L) << "the second pass's SwiGLU backwards";
  EXPECT_EQ(folded_ops.backward_plain, L) << "the first pass's";
  // The second pass casts (weights cached) the output gradients of the QKV, output and down
  // projections and the output projection's transposed input; tensorwise casts every input
  // twice (its amax first) and every output gradient twice, and transposes every input again.
  EXPECT_EQ(folded_ops.second_pass_casts, 4 * L);
  EXPECT_EQ(folded_ops.norm_codes_t, 2 * L) << "the second pass's pre-norms' transposed codes";
  EXPECT_EQ(plain_ops.second_pass_casts, 20 * L);
  EXPECT_EQ(plain_ops.swiglu_folded + plain_ops.norm_folded + plain_ops.attention_folded +
                plain_ops.backward_folded + plain_ops.norm_codes_t,
            0);
  EXPECT_EQ(folded.loss, plain.loss);
  EXPECT_EQ(folded.grads, plain.grads);
}

// Under recompute the SwiGLU runs again in the backward: selective recompute (which keeps no h)
// recomputes the down projection's transposed codes rather than h, full recompute re-runs the
// layer's forward, which writes them again; the pre-norms' transposed codes are written in the
// backward either way. The delayed run equals the tensorwise one bit for bit.
TEST(Fp8Model, KeptTransposedCodesChangeNoBitUnderRecompute) {
  const int L = static_cast<int>(tiny_spec().num_layers);
  for (const RecomputeGranularity recompute :
       {RecomputeGranularity::Selective, RecomputeGranularity::Full}) {
    SCOPED_TRACE(recompute == RecomputeGranularity::Selective ? "selective" : "full");
    ProducerOps folded_ops, plain_ops;
    const ModelRun folded = run_two_passes(Fp8Recipe::Delayed, recompute, folded_ops);
    const ModelRun plain = run_two_passes(Fp8Recipe::Tensorwise, recompute, plain_ops);
    EXPECT_EQ(folded_ops.swiglu_folded, 2 * L) << "the second pass's, forward and recompute";
    EXPECT_EQ(folded_ops.swiglu_plain, 2 * L) << "the first pass's";
    EXPECT_EQ(folded_ops.norm_codes_t, 2 * L) << "the second pass's";
    EXPECT_EQ(folded.loss, plain.loss);
    EXPECT_EQ(folded.grads, plain.grads);
  }
}

// LoRA on an FP8 base: the frozen weights run their FP8 GEMMs, the adapters stay in the
// compute dtype, and the loss and the adapters' gradients stay as near the run without FP8 as
// a full FP8 model's do; the base's FP8 scaling is among the model's step hooks (amaxes
// reduced over ranks, state checkpointed).
TEST(Fp8Lora, AdaptersOnAnFp8BaseStayNearTheirRunWithoutFp8) {
  struct LoraRun {
    std::unique_ptr<Backend> backend = make_cpu_backend();
    std::unique_ptr<LoraModel> model;
    std::vector<float> grads;
    float loss = 0;
  };
  LoraOptions options;
  options.rank = 4;
  options.alpha = 8;
  options.targets = lora_targets("all-linear");
  auto run = [&](const Fp8Options& fp8) {
    LoraRun r;
    const ModelRuntime rt = fp8_runtime(2, 16, fp8);
    const ModelSpec spec = tiny_spec();
    r.model = std::make_unique<LoraModel>(*r.backend, spec, rt, options);
    init_parameters(*r.backend, spec, r.model->base_layout(), r.model->base_slices(), 11);
    init_parameters(*r.backend, spec, r.model->layout(), r.model->params(), 12);
    for (const LoraAdapted& a : r.model->adapted())  // B away from zero: both factors get gradients
      r.backend->init_normal(r.model->param(a.b), 13, static_cast<uint64_t>(a.b) * 1000, 0.0f, 0.2f);
    run_passes(*r.backend, *r.model, 32, 3, r.loss, r.grads);
    return r;
  };
  Fp8Options o;
  o.mode = Fp8Mode::Hybrid;
  o.amax_history_len = 4;
  const LoraRun ref = run(Fp8Options{});
  const LoraRun fp8 = run(o);
  ASSERT_EQ(fp8.model->step_hooks().size(), 1u);
  EXPECT_NEAR(fp8.loss / ref.loss, 1.0, 0.02);
  for (const ParamInfo& p : ref.model->layout().params) {
    const double e = rel_err(fp8.grads, ref.grads, p.offset, p.numel());
    EXPECT_LT(e, 0.25) << p.name;
    EXPECT_GT(e, 0.0) << p.name << ": identical to the run without FP8, so FP8 did not run";
  }
  float status = 0;
  const auto* fp8_hook = dynamic_cast<const Fp8Linears*>(fp8.model->step_hooks()[0]);
  ASSERT_NE(fp8_hook, nullptr);
  fp8.backend->download(&status, fp8_hook->status());
  EXPECT_EQ(status, 0.0f);
}

// An FP8 output head on the loss rows alone: their count (107) is padded to the FP8 GEMMs'
// multiple (112 on the CPU) with masked rows (zero loss, zero gradient), and the run stays as
// near fp32 as the FP8 head on every row does (its scales now come from those rows' amax).
TEST(Fp8Model, HeadOnLossRowsPadsToWholeBlocksAndStaysNearFp32) {
  const int64_t tokens = 2 * 160;
  std::vector<int32_t> ids(tokens), targets(tokens);
  for (int64_t i = 0; i < tokens; ++i)
    ids[i] = static_cast<int32_t>((i * 37) % 128), targets[i] = i % 3 == 1 ? static_cast<int32_t>((i * 53 + 1) % 128) : -1;
  auto run = [&](const Fp8Options& fp8, bool rows) {
    ModelRun r;
    ModelRuntime rt = fp8_runtime(2, 160, fp8);
    rt.head_on_loss_rows = rows;
    const ModelSpec spec = tiny_spec();
    r.model = std::make_unique<DecoderModel>(*r.backend, spec, rt);
    init_parameters(*r.backend, spec, r.model->layout(), r.model->params(), 11);
    DeviceBuffer norm(*r.backend, 4, "norm");
    for (int step = 0; step < 3; ++step) {
      r.model->set_batch(ids.data(), targets.data());
      r.model->zero_grads();
      r.model->zero_loss_sum();
      r.model->forward_backward(1.0f / 107.0f);
      for (StepHook* hook : r.model->step_hooks()) {
        r.backend->fill(norm.tensor(DType::F32, {1}), 0.0f);
        hook->end_step(norm.tensor(DType::F32, {1}));
      }
    }
    r.backend->download(&r.loss, r.model->loss_sum());
    r.grads.resize(r.model->layout().total);
    r.backend->download(r.grads.data(), r.model->grads());
    return r;
  };
  Fp8Options o;
  o.mode = Fp8Mode::Hybrid;
  o.lm_head = true;
  o.amax_history_len = 4;
  const ModelRun ref = run(Fp8Options{}, false), whole = run(o, false), rows = run(o, true);
  EXPECT_NEAR(rows.loss / ref.loss, 1.0, 0.02);
  double whole_err = 0, rows_err = 0;
  for (const ParamInfo& p : ref.model->layout().params) {
    whole_err = std::max(whole_err, rel_err(whole.grads, ref.grads, p.offset, p.numel()));
    rows_err = std::max(rows_err, rel_err(rows.grads, ref.grads, p.offset, p.numel()));
  }
  EXPECT_LT(rows_err, 0.25);
  EXPECT_LT(rows_err, 1.5 * whole_err) << "whole head " << whole_err;
  // The head's rows differ from every row's (112 of 320), so the two
  // FP8 runs differ.
  EXPECT_NE(rows.loss, whole.loss);
}

// FSDP's part in a pass, on one rank: each unit bound from flat buffers the test holds when
// the model asks for it (gradients started from zero each step, as FSDP's slots start), and a
// unit the model reads from its copies bound to NaNs instead, so that reading it would show.
class FlatUnits final : public ParamUnitObserver {
 public:
  FlatUnits(Backend& b, Model& m)
      : b_(b),
        m_(m),
        params_(b, m.layout().total * sizeof(float), "params"),
        grads_(b, m.layout().total * sizeof(float), "grads"),
        nans_(b, m.layout().total * sizeof(float), "nans"),
        gathers(m.layout().units.size(), 0) {
    b.fill(nans_.tensor(DType::F32, {m.layout().total}), NAN);
    m.set_unit_observer(this);
  }
  Tensor params() const { return params_.tensor(DType::F32, {m_.layout().total}); }
  Tensor grads() const { return grads_.tensor(DType::F32, {m_.layout().total}); }
  void params_needed(int unit, int) override {
    const ParamRange& r = m_.layout().units[unit];
    const bool copies = m_.unit_read_from_copies(unit);
    if (!copies) ++gathers[unit];
    m_.bind_unit_params(unit, (copies ? nans_.tensor(DType::F32, {m_.layout().total}) : params())
                                  .flat_range(r.begin, r.count()));
  }
  void grads_needed(int unit) override {
    const ParamRange& r = m_.layout().units[unit];
    m_.bind_unit_grads(unit, grads().flat_range(r.begin, r.count()));
  }
  std::vector<int> gathers;  // per unit: the passes it was bound for

 private:
  Backend& b_;
  Model& m_;
  DeviceBuffer params_, grads_, nans_;
};

// With parameters sharded (FSDP) and FP8 weights cached, a unit whose matrices are all FP8
// weights is bound only until they are cached: the passes after read the codes and the
// model's copies of its vectors. Three steps of two micro-batches, the weights changed between
// steps, give the losses and gradients of the same model binding every unit for every pass,
// bit for bit; each layer and the FP8 head are bound once a step, the embedding every forward.
TEST(Fp8Model, ShardedUnitsAreReadFromCopiesOnceTheirWeightsAreCached) {
  Fp8Options o;
  o.mode = Fp8Mode::Hybrid;
  o.lm_head = true;
  o.amax_history_len = 4;
  const int tokens = 32, steps = 3;
  std::vector<int32_t> ids(tokens), targets(tokens);
  for (int i = 0; i < tokens; ++i) ids[i] = (i * 37) % 128, targets[i] = (i * 53 + 1) % 128;
  struct Run {
    std::vector<float> losses, grads;
    std::vector<int> gathers;
  };
  auto run = [&](bool copies) {
    auto backend = make_cpu_backend();
    Backend& b = *backend;
    ModelRuntime rt = fp8_runtime(2, 16, o);
    rt.sharded_params = true;
    rt.fp8_unit_copies = copies;
    const ModelSpec spec = tiny_spec();
    DecoderModel model(b, spec, rt);
    FlatUnits units(b, model);
    const int64_t n = model.layout().total;
    init_parameters(b, spec, model.layout(), units.params(), 11);
    DeviceBuffer norm(b, 4, "norm");
    Run out;
    std::vector<float> p(n), g(n);
    for (int step = 0; step < steps; ++step) {
      b.fill(units.grads(), 0.0f);
      model.zero_grads();
      model.zero_loss_sum();
      for (int micro = 0; micro < 2; ++micro) {
        model.set_batch(ids.data(), targets.data());
        model.forward_backward(1.0f / (2.0f * tokens));
      }
      for (StepHook* hook : model.step_hooks()) {
        b.fill(norm.tensor(DType::F32, {1}), 0.0f);
        hook->end_step(norm.tensor(DType::F32, {1}));
      }
      float loss = 0;
      b.download(&loss, model.loss_sum());
      out.losses.push_back(loss);
      // A descent step on the host, so the next step's copies must be refreshed.
      b.download(p.data(), units.params());
      b.download(g.data(), units.grads());
      for (int64_t i = 0; i < n; ++i) p[i] -= 0.5f * g[i];
      b.upload(units.params(), p.data());
      model.params_updated();
    }
    out.grads = g;
    out.gathers = units.gathers;
    return out;
  };
  const Run bound = run(false), copied = run(true);
  ASSERT_EQ(copied.losses.size(), static_cast<size_t>(steps));
  for (int s = 0; s < steps; ++s) {
    EXPECT_TRUE(std::isfinite(copied.losses[s])) << "step " << s;
    EXPECT_EQ(copied.losses[s], bound.losses[s]) << "step " << s;
  }
  EXPECT_NE(copied.losses[0], copied.losses[steps - 1]) << "the weights changed between steps";
  EXPECT_EQ(copied.grads, bound.grads);
  // Units: the embedding, two layers, the final norm with the head.
  ASSERT_EQ(copied.gathers.size(), 4u);
  EXPECT_EQ(copied.gathers[0], bound.gathers[0]) << "the embedding is always bound";
  for (int u = 1; u < 4; ++u) {
    EXPECT_EQ(copied.gathers[u], steps) << "unit " << u;
    EXPECT_GT(bound.gathers[u], steps) << "unit " << u;
  }
}

TEST(Fp8ModelState, DelayedScalesComeFromTheHistoryAndNaNIsReported) {
  Fp8Options o;
  o.mode = Fp8Mode::Hybrid;
  o.amax_history_len = 8;
  ModelRun r = run_model(o, 2);
  Fp8Linears& f = *r.model->fp8();
  const auto state = f.state_tensors();
  ASSERT_EQ(state.size(), 6u);
  EXPECT_EQ(state[0].first, "fp8.forward.amax_history");
  const Tensor& hist = state[0].second;
  EXPECT_EQ(hist.dim(0), 8);
  EXPECT_EQ(hist.dim(1), 2 * 4 * 2);  // (input, weight) x 4 linears x 2 layers
  std::vector<float> h(hist.numel()), scale(hist.dim(1));
  r.backend->download(h.data(), hist);
  r.backend->download(scale.data(), state[1].second);
  const int64_t S = hist.dim(1);
  for (int64_t s = 0; s < S; ++s) {
    float amax = 0;
    for (int64_t row = 0; row < 8; ++row) amax = std::max(amax, h[row * S + s]);
    ASSERT_GT(amax, 0.0f) << "slot " << s << " recorded no amax";
    EXPECT_EQ(h[s], 0.0f) << "row 0 is cleared after the update";
    EXPECT_EQ(scale[s], 448.0f / amax) << "slot " << s;
  }
  // A NaN in a weight: the amax is NaN, the status says so, and end_step poisons the norm.
  const float nan = NAN;
  const ParamInfo* gate_up = r.model->layout().find("model.layers.0.mlp.gate_up_proj.weight");
  ASSERT_NE(gate_up, nullptr);
  const int gate_up_index = static_cast<int>(gate_up - r.model->layout().params.data());
  r.backend->upload(r.model->param(gate_up_index).flat_range(5, 1), &nan);
  r.model->params_updated();
  r.model->zero_grads();
  r.model->forward_backward(1.0f / 32);
  DeviceBuffer norm(*r.backend, 4, "norm");
  r.backend->fill(norm.tensor(DType::F32, {1}), 1.0f);
  f.end_step(norm.tensor(DType::F32, {1}));
  float status = 0, n = 0;
  r.backend->download(&status, f.status());
  r.backend->download(&n, norm.tensor(DType::F32, {1}));
  EXPECT_TRUE(std::isnan(status));
  EXPECT_TRUE(std::isnan(n));
}

TEST(Fp8ModelState, RejectsDimensionsThatAreNotMultiplesOf16) {
  auto backend = make_cpu_backend();
  ModelSpec s = tiny_spec();
  s.ffn = 120;
  ModelRuntime rt;
  rt.seq_length = 16;
  rt.fp8.mode = Fp8Mode::Hybrid;
  try {
    DecoderModel m(*backend, s, rt);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("multiples of 16"), std::string::npos) << e.what();
  }
}

TEST(Fp8ModelState, CheckpointSavesAndRestoresTheScalingState) {
  Fp8Options o;
  o.mode = Fp8Mode::Hybrid;
  o.amax_history_len = 4;
  ModelRun r = run_model(o, 2);
  const ModelSpec spec = tiny_spec();
  Backend& b = *r.backend;
  const int64_t P = r.model->layout().total;
  DeviceBuffer opt(b, 3 * P * 4, "optimizer");
  TrainingTensors t;
  t.backend = &b;
  t.spec = &spec;
  t.layout = &r.model->layout();
  t.param = [m = r.model.get()](int index) { return m->param(index); };
  t.master = opt.tensor(DType::F32, {P});
  t.exp_avg = opt.tensor(DType::F32, {P}, P * 4);
  t.exp_avg_sq = opt.tensor(DType::F32, {P}, 2 * P * 4);
  t.extra_state = r.model->fp8()->state_tensors();
  b.copy(t.master, r.model->params());
  const fs::path dir = fs::temp_directory_path() / ("tessera_fp8_ckpt_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  TrainerState st;
  st.iteration = 2;
  const std::string saved = save_checkpoint(dir.string(), t, st, 0);
  std::vector<float> before(t.extra_state[0].second.numel());
  b.download(before.data(), t.extra_state[0].second);

  ModelRun fresh = run_model(o, 0);
  TrainingTensors t2 = t;
  t2.extra_state = fresh.model->fp8()->state_tensors();
  t2.param = [m = fresh.model.get()](int index) { return m->param(index); };
  std::vector<std::string> warnings;
  const TrainerState loaded = load_checkpoint(saved, t2, &warnings);
  EXPECT_TRUE(loaded.extra_state_restored);
  EXPECT_TRUE(warnings.empty());
  std::vector<float> after(before.size());
  b.download(after.data(), t2.extra_state[0].second);
  EXPECT_EQ(after, before);

  // A checkpoint of a run without FP8 still loads; the FP8 state starts fresh.
  TrainingTensors no_fp8 = t;
  no_fp8.extra_state.clear();
  st.iteration = 3;
  const std::string plain = save_checkpoint(dir.string(), no_fp8, st, 0);
  const TrainerState loaded2 = load_checkpoint(plain, t2, &warnings);
  EXPECT_FALSE(loaded2.extra_state_restored);
  ASSERT_FALSE(warnings.empty());
  EXPECT_NE(warnings[0].find("fp8.forward.amax_history"), std::string::npos) << warnings[0];
  fs::remove_all(dir);
}

// ---------------------------------------------------------------- configuration

Experiment load(const std::vector<std::string>& cli) {
  LoadOptions o;
  o.cli_overrides = cli;
  o.cli_overrides.insert(o.cli_overrides.end(), {"--mock_data", "true"});
  return load_experiment(o);
}

TEST(Fp8Config, KeysParseWithTransformerEngineDefaults) {
  const Experiment d = load({});
  EXPECT_EQ(d.training.fp8, Fp8Mode::Off);
  EXPECT_EQ(d.training.fp8_recipe, Fp8Recipe::Delayed);
  EXPECT_EQ(d.training.fp8_amax_history_len, 1024);
  EXPECT_EQ(d.training.fp8_amax_compute_algo, Fp8AmaxAlgo::Max);
  EXPECT_EQ(d.training.fp8_margin, 0);
  EXPECT_FALSE(d.training.fp8_lm_head);
  EXPECT_TRUE(d.training.fp8_weight_transpose_cache);
  const Experiment e = load({"--device", "cuda", "--fp8", "hybrid", "--fp8_recipe", "tensorwise",
                             "--fp8-amax-compute-algo", "most_recent", "--fp8_margin", "1",
                             "--fp8_lm_head", "--no_fp8_weight_transpose_cache", "--seq_length", "64"});
  EXPECT_EQ(e.training.fp8, Fp8Mode::Hybrid);
  EXPECT_EQ(e.training.fp8_recipe, Fp8Recipe::Tensorwise);
  EXPECT_EQ(e.training.fp8_amax_compute_algo, Fp8AmaxAlgo::MostRecent);
  EXPECT_EQ(e.training.fp8_margin, 1);
  EXPECT_TRUE(e.training.fp8_lm_head);
  EXPECT_FALSE(e.training.fp8_weight_transpose_cache);
  EXPECT_FALSE(load({"--no-fp8-weight-transpose-cache"}).training.fp8_weight_transpose_cache);
}

// TE's MMParams defaults: split (full-precision) accumulation in dgrad and wgrad only; each
// key reaches its own GEMM kind.
TEST(Fp8Config, SplitAccumulatorKeysChooseFastAccumulationPerGemmKind) {
  const Fp8Options d = fp8_options(load({}).training);
  EXPECT_TRUE(d.fast_accum_fprop);
  EXPECT_FALSE(d.fast_accum_dgrad);
  EXPECT_FALSE(d.fast_accum_wgrad);
  EXPECT_EQ(fast_accumulation_kinds(d), "fprop");
  const Fp8Options w = fp8_options(load({"--fp8_gemm_wgrad_split_accumulator", "false"}).training);
  EXPECT_TRUE(w.fast_accum_fprop && w.fast_accum_wgrad && !w.fast_accum_dgrad);
  EXPECT_EQ(fast_accumulation_kinds(w, "+"), "fprop+wgrad");
  const Fp8Options all = fp8_options(load({"--fp8_gemm_dgrad_split_accumulator", "false",
                                           "--fp8_gemm_wgrad_split_accumulator", "false"})
                                         .training);
  EXPECT_EQ(fast_accumulation_kinds(all), "fprop, dgrad, wgrad");
  const Fp8Options none =
      fp8_options(load({"--fp8_gemm_fprop_split_accumulator", "true"}).training);
  EXPECT_EQ(fast_accumulation_kinds(none), "none");
  try {
    load({"--fp8_gemm_wgrad_split_accumulator", "sometimes"});
    FAIL() << "expected a ConfigError for a non-boolean accumulation key";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("fp8_gemm_wgrad_split_accumulator"), std::string::npos) << m;
    EXPECT_NE(m.find("sometimes"), std::string::npos) << m;
  }
}

TEST(Fp8Config, ValidationNamesTheConflict) {
  auto error_of = [](const std::vector<std::string>& cli) -> std::string {
    try {
      load(cli);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of({"--fp8", "hybrid", "--device", "cpu"}).find("GPU"), std::string::npos);
  EXPECT_NE(error_of({"--fp8", "hybrid", "--precision", "fp32"}).find("bf16"), std::string::npos);
  EXPECT_NE(error_of({"--fp8", "hybrid", "--fp8_amax_history_len", "0"}).find("fp8_amax_history_len"),
            std::string::npos);
  EXPECT_NE(error_of({"--fp8", "fp16"}).find("null, hybrid, e4m3"), std::string::npos);
  // --no_<key> exists only for boolean keys.
  EXPECT_NE(error_of({"--no_seq_length"}).find("no_seq_length"), std::string::npos);
}

// The CPU backend with FP8 tensor cores claimed, so that the trainer's device checks pass the
// capability and reach the FP8 GEMMs' multiples, which the CPU keeps as GPUs do.
class Fp8CpuBackend final : public CpuBackend {
 public:
  bool supports(Capability c) const override {
    return c == Capability::Fp8TensorCores || CpuBackend::supports(c);
  }
};

// The multiples a device's FP8 GEMMs need (Backend::fp8_gemm_multiple) are checked against the
// backend the trainer runs on, before the model is built.
TEST(Fp8Config, TheTrainerHoldsTokensToTheBackendsFp8GemmMultiple) {
  auto error_of = [](const std::vector<std::string>& cli) -> std::string {
    Logger log("", 0, false, false);
    try {
      Trainer trainer(load(cli), std::make_unique<Fp8CpuBackend>(), log, nullptr);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  const std::string tokens =
      error_of({"--fp8", "e4m3", "--micro_batch_size", "1", "--seq_length", "100"});
  EXPECT_NE(tokens.find("micro_batch_size x seq_length (now 100) a multiple of 16"),
            std::string::npos)
      << tokens;
  const std::string chunk = error_of({"--fp8", "hybrid", "--fp8_lm_head", "--seq_length", "64",
                                      "--cross_entropy_chunk_tokens", "40"});
  EXPECT_NE(chunk.find("cross_entropy_chunk_tokens"), std::string::npos) << chunk;
  EXPECT_NE(chunk.find("a multiple of 16 with fp8_lm_head"), std::string::npos) << chunk;
}

// ---------------------------------------------------------------- block scaling

// Every tile's scale is the power of two that brings its amax into [fp8_max / 2, fp8_max], the
// codes decode to the tile's values within an FP8 rounding, and the layouts put each scale
// where core/fp8.h says, for 1x128 tiles along either dimension and for 128x128 blocks, at
// sizes with partial tiles at the edges.
TEST(Fp8BlockScaling, ScalesArePowersOfTwoAndCodesDecodeToTheirTile) {
  const int64_t R = 200, C = 300;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(R * C);
  for (int64_t i = 0; i < R * C; ++i)  // a few rows and columns far larger: block scales' case
    x[i] = normal(rng) * ((i / C) % 37 == 5 || (i % C) % 41 == 7 ? 300.0f : 0.01f);
  for (Fp8Scaling scaling : {Fp8Scaling::Tile1x128, Fp8Scaling::Block128x128}) {
    for (DType format : {DType::E4M3, DType::E5M2}) {
      std::vector<uint8_t> q(R * C), qt(R * C);
      std::vector<float> s(fp8_scale_count(scaling, R, C)), st(fp8_scale_count(scaling, C, R));
      EXPECT_FALSE(fp8_block_cast_reference(x.data(), R, C, scaling, format, q.data(), s.data(),
                                            qt.data(), st.data()));
      const float max = fp8_max(format);
      const bool blocks = scaling == Fp8Scaling::Block128x128;
      // The amax each element's out (rowwise) and out_t (columnwise) tile sees.
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) {
          float amax = 0, amax_t = 0;
          for (int64_t k = c / 128 * 128; k < std::min(C, c / 128 * 128 + 128); ++k)
            for (int64_t j = blocks ? r / 128 * 128 : r;
                 j < (blocks ? std::min(R, r / 128 * 128 + 128) : r + 1); ++j)
              amax = std::max(amax, std::fabs(x[j * C + k]));
          for (int64_t j = r / 128 * 128; j < std::min(R, r / 128 * 128 + 128); ++j)
            for (int64_t k = blocks ? c / 128 * 128 : c;
                 k < (blocks ? std::min(C, c / 128 * 128 + 128) : c + 1); ++k)
              amax_t = std::max(amax_t, std::fabs(x[j * C + k]));
          const float inv = s[fp8_scale_index(scaling, R, C, r, c)];
          const float inv_t = st[fp8_scale_index(scaling, C, R, c, r)];
          for (const auto& [a, i] : {std::pair{amax, inv}, std::pair{amax_t, inv_t}}) {
            int e = 0;
            ASSERT_EQ(std::frexp(i, &e), 0.5f) << "scale_inv " << i << " is not a power of two";
            ASSERT_LE(a / i, max) << r << "," << c;
            ASSERT_GT(a / i, max / 2) << r << "," << c;
          }
          const float back = fp8_bits_to_float(q[r * C + c], format) * inv;
          const float back_t = fp8_bits_to_float(qt[c * R + r], format) * inv_t;
          // Half an ulp relative, or half the smallest subnormal (times the tile's scale_inv).
          const float step = format == DType::E4M3 ? 1.0f / 16 : 1.0f / 8;
          const float sub = std::ldexp(1.0f, format == DType::E4M3 ? -10 : -17);
          const float ax = std::fabs(x[r * C + c]);
          ASSERT_LE(std::fabs(back - x[r * C + c]), ax * step + sub * inv) << r << "," << c;
          ASSERT_LE(std::fabs(back_t - x[r * C + c]), ax * step + sub * inv_t) << r << "," << c;
        }
      if (blocks)  // one block, two layouts: the same scales
        for (int64_t r = 0; r < R; r += 128)
          for (int64_t c = 0; c < C; c += 128)
            EXPECT_EQ(s[fp8_scale_index(scaling, R, C, r, c)],
                      st[fp8_scale_index(scaling, C, R, c, r)]);
    }
  }
  EXPECT_EQ(fp8_scale_count(Fp8Scaling::Tile1x128, 200, 300), 3 * 200);
  EXPECT_EQ(fp8_scale_count(Fp8Scaling::Block128x128, 200, 300), 2 * 4);  // 3 blocks, 16-byte rows
  EXPECT_EQ(fp8_block_scale(0.0f, 448.0f), 1.0f);
  EXPECT_EQ(fp8_block_scale(448.0f, 448.0f), 1.0f);
  EXPECT_EQ(fp8_block_scale(449.0f, 448.0f), 0.5f);
  EXPECT_EQ(fp8_block_scale(1.0f, 448.0f), 256.0f);
  EXPECT_EQ(fp8_block_scale(INFINITY, 448.0f), 1.0f);
}

// With outliers in a few rows, 1x128 tiles keep the other rows' precision that one scale for
// the tensor loses: the blockwise GEMM is closer to the exact product than the tensorwise one.
TEST(Fp8BlockScaling, OutliersCostTilesLessThanTensors) {
  auto b = make_cpu_backend();
  const int64_t M = 256, N = 128, K = 256;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> a(M * K), w(N * K), exact(M * N, 0.0f);
  for (int64_t i = 0; i < M * K; ++i) a[i] = normal(rng) * ((i / K) % 64 == 0 ? 1000.0f : 0.001f);
  for (float& v : w) v = normal(rng);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) exact[m * N + n] += a[m * K + k] * w[n * K + k];
  DeviceBuffer buf(*b, size_t{8} << 20, "tensors");
  size_t at = 0;
  auto take = [&](DType d, Shape s) {
    const Tensor t = buf.tensor(d, s, at);
    at += (static_cast<size_t>(s.numel()) * dtype_size(d) + 255) / 256 * 256;
    return t;
  };
  const Tensor ta = take(DType::F32, {M, K}), tw = take(DType::F32, {N, K}),
               out = take(DType::F32, {M, N});
  b->upload(ta, a.data());
  b->upload(tw, w.data());
  const Tensor qa = take(DType::E4M3, {M, K}), qw = take(DType::E4M3, {N, K});
  auto error = [&]() {
    std::vector<float> got(M * N);
    b->download(got.data(), out);
    double d = 0, s = 0;
    for (int64_t m = 0; m < M; ++m)
      if (m % 64 != 0)  // the ordinary rows
        for (int64_t n = 0; n < N; ++n)
          d += std::pow(got[m * N + n] - exact[m * N + n], 2), s += std::pow(exact[m * N + n], 2);
    return std::sqrt(d / s);
  };
  // Blockwise.
  const Tensor sa = take(DType::F32, {fp8_scale_count(Fp8Scaling::Tile1x128, M, K)});
  const Tensor sw = take(DType::F32, {fp8_scale_count(Fp8Scaling::Block128x128, N, K)});
  b->fp8_block_cast({ta, Fp8Scaling::Tile1x128, qa, sa, {}, {}, {}});
  b->fp8_block_cast({tw, Fp8Scaling::Block128x128, qw, sw, {}, {}, {}});
  Fp8MatmulArgs m;
  m.out = out, m.a = qa, m.b = qw, m.a_scale_inv = sa, m.b_scale_inv = sw;
  m.a_scaling = Fp8Scaling::Tile1x128, m.b_scaling = Fp8Scaling::Block128x128;
  b->matmul_fp8(m);
  const double blockwise = error();
  // Tensorwise, one scale each from the tensor's amax.
  const Tensor amax = take(DType::F32, {1}), scale = take(DType::F32, {2}),
               inv = take(DType::F32, {2});
  for (int i = 0; i < 2; ++i) {
    b->fill(amax, 0.0f);
    b->fp8_cast_transpose(Fp8CastArgs{i == 0 ? ta : tw, {}, {}, {}, amax});
    Fp8ScaleUpdateArgs u;
    u.amax_history = amax.view({1, 1}), u.scale = scale.flat_range(i, 1),
    u.scale_inv = inv.flat_range(i, 1);
    u.most_recent = true, u.roll = false;
    b->fp8_update_scales(u);
    b->fp8_cast_transpose(
        Fp8CastArgs{i == 0 ? ta : tw, i == 0 ? qa : qw, {}, scale.flat_range(i, 1), {}});
  }
  Fp8MatmulArgs t;
  t.out = out, t.a = qa, t.b = qw, t.a_scale_inv = inv.flat_range(0, 1),
  t.b_scale_inv = inv.flat_range(1, 1);
  b->matmul_fp8(t);
  const double tensorwise = error();
  std::printf("[ fp8      ] ordinary rows' relative error: blockwise %.3e, tensorwise %.3e\n",
              blockwise, tensorwise);
  EXPECT_LT(blockwise, 0.05);
  EXPECT_GT(tensorwise, 10 * blockwise);
}

TEST(Fp8BlockScaling, NonFiniteInputIsReported) {
  auto b = make_cpu_backend();
  DeviceBuffer buf(*b, 64 * 1024, "tensors");
  const Tensor x = buf.tensor(DType::F32, {2, 256});
  std::vector<float> v(512, 1.0f);
  v[300] = INFINITY;
  b->upload(x, v.data());
  const Tensor q = buf.tensor(DType::E4M3, {2, 256}, 4096);
  const Tensor s = buf.tensor(DType::F32, {4}, 8192);
  const Tensor flag = buf.tensor(DType::F32, {1}, 12288);
  b->fill(flag, 0.0f);
  b->fp8_block_cast({x, Fp8Scaling::Tile1x128, q, s, {}, {}, flag});
  float f = 0;
  b->download(&f, flag);
  EXPECT_TRUE(std::isnan(f));
}

// A model whose FP8 dimensions and tokens are whole blocks: blockwise training stays near fp32
// like the per-tensor recipes (test Fp8Model), and keeps no scaling state.
TEST(Fp8BlockScaling, ModelLossAndGradientsStayNearFp32) {
  auto spec = tiny_spec();
  spec.hidden = 128, spec.ffn = 256, spec.heads = 2, spec.kv_heads = 1, spec.head_dim = 64;
  spec.max_position_embeddings = 128;
  auto run = [&](const Fp8Options& fp8) {
    ModelRun r;
    const ModelRuntime rt = fp8_runtime(1, 128, fp8);
    r.model = std::make_unique<DecoderModel>(*r.backend, spec, rt);
    init_parameters(*r.backend, spec, r.model->layout(), r.model->params(), 11);
    run_passes(*r.backend, *r.model, 128, 1, r.loss, r.grads);
    return r;
  };
  Fp8Options o;
  o.mode = Fp8Mode::Hybrid;
  o.recipe = Fp8Recipe::Blockwise;
  o.lm_head = true;
  const ModelRun ref = run(Fp8Options{});
  for (bool cache : {true, false}) {
    o.weight_cache = cache;
    const ModelRun fp8 = run(o);
    EXPECT_NEAR(fp8.loss / ref.loss, 1.0, 0.02);
    for (const ParamInfo& p : ref.model->layout().params) {
      const double e = rel_err(fp8.grads, ref.grads, p.offset, p.numel());
      EXPECT_LT(e, 0.25) << p.name;
      EXPECT_GT(e, 0.0) << p.name << ": identical to fp32, so FP8 did not run";
    }
    EXPECT_TRUE(fp8.model->fp8()->state_tensors().empty());
    EXPECT_EQ(Fp8Linears::plan_bytes(o, fp8.model->fp8()->linears(), 128),
              DecoderModel::plan_memory(spec,
                                        [&] {
                                          ModelRuntime rt;
                                          rt.seq_length = 128;
                                          rt.fp8 = o;
                                          return rt;
                                        }())
                  .fp8);
  }
  // Widths that are not whole blocks are refused by name.
  spec.ffn = 320;
  ModelRuntime rt;
  rt.seq_length = 128;
  rt.fp8 = o;
  auto backend = make_cpu_backend();
  try {
    DecoderModel m(*backend, spec, rt);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("multiples of 128"), std::string::npos) << e.what();
    EXPECT_EQ(e.key(), "fp8_recipe");
  }
}

}  // namespace
}  // namespace tessera
