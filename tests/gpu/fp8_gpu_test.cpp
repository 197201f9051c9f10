// FP8 on the GPU: the cast+transpose kernel, the block cast and the scale update bit for bit
// against the CPU reference, FP8 GEMMs against bf16 GEMMs within the error FP8 implies, and FP8
// hybrid (per-tensor and blockwise) training on real text tracking bf16 training. Every
// comparison prints its numbers.

#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "common/experiment_yaml.h"
#include "gpu_test_util.h"
#include "tessera/core/fp8.h"
#include "tessera/model/decoder_model.h"
#include "tessera/obs/logger.h"
#include "tessera/train/trainer.h"

namespace tessera::gpu_test {
namespace {


Tensor scalar_on(Backend& b, DeviceBuffer& buf, size_t slot, float v) {
  const Tensor t = buf.tensor(DType::F32, {1}, slot * 256);
  b.upload(t, &v);
  return t;
}

// Elements of two tensors of one shape and dtype on b whose bits differ (codes, or values bit
// for bit).
int64_t differing(Backend& b, const Tensor& want, const Tensor& got) {
  const size_t n = want.nbytes(), e = dtype_size(want.dtype);
  std::vector<uint8_t> w(n), g(n);
  b.download(w.data(), want);
  b.download(g.data(), got);
  int64_t bad = 0;
  for (size_t i = 0; i < n; i += e) bad += std::memcmp(&w[i], &g[i], e) != 0;
  return bad;
}

float read_scalar(Backend& b, const Tensor& t) {
  float v = 0;
  b.download(&v, t);
  return v;
}

TEST(GpuFp8, CastTransposeMatchesTheCpuCodeForCode) {
  TS_REQUIRE_GPU();
  Backends be;
  for (const DType format : {DType::E4M3, DType::E5M2}) {
    for (const auto& [R, C] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 1}, {33, 65}, {300, 200}, {96, 136}, {130, 72}, {256, 128}, {1024, 4096}}) {
      SCOPED_TRACE(fmt::format("{} R={} C={}", dtype_name(format), R, C));
      std::vector<float> x = round_bf16(random_normal(R * C, 17, 3.0f));
      // Both backends see the bf16 input the GPU reads.
      x[0] = round_to_bf16(1e6f);  // saturates
      if (x.size() > 3) x[3] = round_to_bf16(1e-7f);  // below the smallest subnormal after scaling, or a subnormal
      const float scale = format == DType::E4M3 ? 448.0f / 1e6f * 1000 : 1.0f;
      DeviceBuffer cs(*be.cpu, 4 * 256, "cpu scalars"), gs(*be.gpu, 4 * 256, "gpu scalars");
      DeviceBuffer cx(*be.cpu, R * C * 4, "cpu x");
      be.cpu->upload(cx.tensor(DType::F32, {R, C}), x.data());
      GuardedTensor gx(*be.gpu, DType::BF16, {R, C});
      upload_float(*be.gpu, gx, x);
      DeviceBuffer co(*be.cpu, 2 * R * C, "cpu codes");
      GuardedTensor go(*be.gpu, format, {R, C}), got(*be.gpu, format, {C, R});
      Fp8CastArgs c{cx.tensor(DType::F32, {R, C}), co.tensor(format, {R, C}), co.tensor(format, {C, R}, R * C),
                    scalar_on(*be.cpu, cs, 0, scale), scalar_on(*be.cpu, cs, 1, 0.0f)};
      Fp8CastArgs g{gx, go, got, scalar_on(*be.gpu, gs, 0, scale), scalar_on(*be.gpu, gs, 1, 0.0f)};
      be.cpu->fp8_cast_transpose(c);
      be.gpu->fp8_cast_transpose(g);
      std::vector<uint8_t> rc(2 * R * C), rg(R * C), rgt(R * C);
      be.cpu->download(rc.data(), co.tensor(DType::U8, {2 * R * C}));
      be.gpu->download(rg.data(), go.t());
      be.gpu->download(rgt.data(), got.t());
      int64_t bad = 0, bad_t = 0;
      for (int64_t i = 0; i < R * C; ++i) bad += rg[i] != rc[i], bad_t += rgt[i] != rc[R * C + i];
      EXPECT_EQ(bad, 0) << "codes differing from the CPU reference";
      EXPECT_EQ(bad_t, 0) << "transposed codes differing from the CPU reference";
      {  // The transposed layout alone, as the weight gradient's re-cast of an input asks.
        GuardedTensor only_t(*be.gpu, format, {C, R});
        be.gpu->fp8_cast_transpose(Fp8CastArgs{gx, {}, only_t, g.scale, {}});
        std::vector<uint8_t> rt(R * C);
        be.gpu->download(rt.data(), only_t.t());
        int64_t bad_only_t = 0;
        for (int64_t i = 0; i < R * C; ++i) bad_only_t += rt[i] != rc[R * C + i];
        EXPECT_EQ(bad_only_t, 0) << "transposed-only codes differing from the CPU reference";
        EXPECT_TRUE(only_t.guards_intact()) << "write outside the transposed-only output";
      }
      EXPECT_EQ(read_scalar(*be.gpu, g.amax), read_scalar(*be.cpu, c.amax));
      EXPECT_TRUE(go.guards_intact() && got.guards_intact()) << "write outside the outputs";
      std::printf("[ fp8      ] cast %-8s %5ldx%-5ld mismatches %ld / %ld (transposed), amax %g\n",
                  std::string(dtype_name(format)).c_str(), static_cast<long>(R), static_cast<long>(C),
                  static_cast<long>(bad), static_cast<long>(bad_t), read_scalar(*be.gpu, g.amax));
      if (R * C < 8) continue;
      // Non-finite inputs: the amax reports them (NaN wins over everything, Inf over finite).
      x[5] = INFINITY;
      upload_float(*be.gpu, gx, x);
      be.gpu->fill(g.amax, 0.0f);
      be.gpu->fp8_cast_transpose(Fp8CastArgs{gx, {}, {}, {}, g.amax});
      EXPECT_EQ(read_scalar(*be.gpu, g.amax), INFINITY);
      x[7] = NAN;
      upload_float(*be.gpu, gx, x);
      be.gpu->fp8_cast_transpose(g);
      EXPECT_TRUE(std::isnan(read_scalar(*be.gpu, g.amax)));
      be.gpu->download(rg.data(), go.t());
      EXPECT_TRUE(std::isnan(fp8_bits_to_float(rg[7], format))) << "NaN must stay NaN";
      EXPECT_EQ(rg[5], float_to_fp8_bits(INFINITY, format)) << "Inf saturates";
    }
  }
}

// A producer writing its output's FP8 codes on the way (an FP8 linear's forward cast folded
// into it) gives what the producer then the cast give, bit for bit and code for code, so the
// model's numbers do not depend on which path ran: 16-byte and element paths, e4m3 and e5m2;
// and a NaN in the input reaches the amax. `produce(out, codes)` runs the plain producer
// (codes undefined) or its *_forward_cast; `input` (R, in_cols) bf16 is what it reads.
struct ForwardCastCase {
  std::string name;
  int64_t R, in_cols, out_cols;
  std::function<void(Backend&, const Tensor& input, const Tensor& out, const Fp8CastArgs* codes)>
      produce;
};

void expect_forward_cast_matches_the_cast(Backend& g, const ForwardCastCase& c) {
  for (const DType format : {DType::E4M3, DType::E5M2}) {
    const int64_t R = c.R, F = c.out_cols;
    SCOPED_TRACE(fmt::format("{} {} R={} cols={}", c.name, dtype_name(format), R, F));
    GuardedTensor input(g, DType::BF16, {R, c.in_cols});
    GuardedTensor h(g, DType::BF16, {R, F}), h_fused(g, DType::BF16, {R, F});
    std::vector<float> x = random_normal(R * c.in_cols, 29, 3.0f);
    upload_float(g, input, x);
    DeviceBuffer scalars(g, 4 * 256, "scalars");
    const Tensor scale = scalar_on(g, scalars, 0, format == DType::E4M3 ? 40.0f : 1000.0f);
    GuardedTensor codes(g, format, {R, F}), fused_codes(g, format, {R, F});
    const Fp8CastArgs cast{h, codes, {}, scale, scalar_on(g, scalars, 1, 0.0f)};
    const Fp8CastArgs fused{{}, fused_codes, {}, scale, scalar_on(g, scalars, 2, 0.0f)};
    c.produce(g, input.t(), h.t(), nullptr);
    g.fp8_cast_transpose(cast);
    c.produce(g, input.t(), h_fused.t(), &fused);
    const int64_t bad_h = differing(g, h, h_fused), bad_codes = differing(g, codes, fused_codes);
    const float amax = read_scalar(g, cast.amax);
    EXPECT_EQ(bad_h, 0) << "output differing from the plain producer's";
    EXPECT_EQ(bad_codes, 0) << "codes differing from the cast of the plain producer's output";
    EXPECT_EQ(read_scalar(g, fused.amax), amax);
    EXPECT_TRUE(h_fused.guards_intact() && fused_codes.guards_intact())
        << "write outside the outputs";
    std::printf("[ fp8      ] %-42s %-8s %5ldx%-5ld out %ld, codes %ld differ, amax %g\n",
                c.name.c_str(), std::string(dtype_name(format)).c_str(), static_cast<long>(R),
                static_cast<long>(F), static_cast<long>(bad_h), static_cast<long>(bad_codes), amax);
    x[c.in_cols + 1] = NAN;  // row 1
    upload_float(g, input, x);
    c.produce(g, input.t(), h_fused.t(), &fused);
    EXPECT_TRUE(std::isnan(read_scalar(g, fused.amax)))
        << "a NaN in the output must reach the amax";
  }
}

TEST(GpuFp8, SwigluForwardCastMatchesSwigluThenTheCast) {
  TS_REQUIRE_GPU();
  Backends be;
  for (const auto& [R, F] :
       std::vector<std::pair<int64_t, int64_t>>{{33, 36}, {130, 72}, {1000, 1792}, {512, 14336}}) {
    expect_forward_cast_matches_the_cast(
        *be.gpu, {"swiglu_forward_cast", R, 2 * F, F,
                  [](Backend& g, const Tensor& gate_up, const Tensor& h, const Fp8CastArgs* codes) {
                    if (codes) return g.swiglu_forward_cast(h, gate_up, *codes);
                    g.swiglu_forward(h, gate_up);
                  }});
  }
}

// The pre-norm writing the codes of the mixer's first linear: rows of the full models' widths
// (Llama 4096, Qwen 3584), an odd width on the element path.
TEST(GpuFp8, RmsnormForwardCastMatchesTheNormThenTheCast) {
  TS_REQUIRE_GPU();
  Backends be;
  Backend& g = *be.gpu;
  for (const auto& [R, C] :
       std::vector<std::pair<int64_t, int64_t>>{{33, 36}, {7, 1001}, {257, 3584}, {1024, 4096}}) {
    GuardedTensor weight(g, DType::BF16, {C});
    upload_float(g, weight, random_normal(C, 31, 1.0f));
    GuardedTensor rstd(g, DType::F32, {R});
    const Tensor w = weight.t(), r = rstd.t();
    expect_forward_cast_matches_the_cast(
        g, {"rmsnorm_forward_cast", R, C, C,
            [w, r](Backend& b, const Tensor& x, const Tensor& out, const Fp8CastArgs* codes) {
              if (codes) return b.rmsnorm_forward_cast(out, r, x, w, 1e-5f, *codes);
              b.rmsnorm_forward(out, r, x, w, 1e-5f);
            }});
  }
}

// The pre-norm without its output (codes and statistics alone), and the transposed codes
// written later from its input and statistics (rmsnorm_transposed_codes), code for code what
// rmsnorm_forward then the cast of both layouts give: the tiled kernel at the full models'
// widths (Llama 4096, Qwen 3584), the element path at odd shapes; e4m3 and e5m2.
TEST(GpuFp8, RmsnormCodesWithoutItsOutputAreTheCastOfIt) {
  TS_REQUIRE_GPU();
  Backends be;
  Backend& g = *be.gpu;
  for (const DType format : {DType::E4M3, DType::E5M2}) {
    for (const auto& [R, C] : std::vector<std::pair<int64_t, int64_t>>{
             {128, 64}, {1024, 4096}, {256, 3584}, {33, 36}, {7, 1001}}) {
      SCOPED_TRACE(fmt::format("{} R={} C={}", dtype_name(format), R, C));
      GuardedTensor x(g, DType::BF16, {R, C}), weight(g, DType::BF16, {C});
      upload_float(g, x, random_normal(R * C, 53, 3.0f));
      upload_float(g, weight, random_normal(C, 59, 1.0f));
      GuardedTensor out(g, DType::BF16, {R, C}), rstd(g, DType::F32, {R}),
          rstd2(g, DType::F32, {R});
      DeviceBuffer scalars(g, 4 * 256, "scalars");
      const Tensor scale = scalar_on(g, scalars, 0, format == DType::E4M3 ? 40.0f : 1000.0f);
      GuardedTensor codes(g, format, {R, C}), codes_t(g, format, {C, R});
      GuardedTensor rows(g, format, {R, C}), rows_t(g, format, {C, R});
      g.rmsnorm_forward(out.t(), rstd.t(), x.t(), weight.t(), 1e-5f);
      const Fp8CastArgs cast{out, codes, codes_t, scale, scalar_on(g, scalars, 1, 0.0f)};
      g.fp8_cast_transpose(cast);
      const Fp8CastArgs folded{{}, rows, {}, scale, scalar_on(g, scalars, 2, 0.0f)};
      g.rmsnorm_forward_cast({}, rstd2.t(), x.t(), weight.t(), 1e-5f, folded);
      g.rmsnorm_transposed_codes(Fp8CastArgs{{}, {}, rows_t, scale, {}}, x.t(), rstd2.t(),
                                 weight.t(), 1e-5f);
      const int64_t bad = differing(g, codes, rows), bad_t = differing(g, codes_t, rows_t),
                    bad_rstd = differing(g, rstd, rstd2);
      EXPECT_EQ(bad, 0) << "codes differing from the cast of rmsnorm_forward's output";
      EXPECT_EQ(bad_t, 0) << "transposed codes differing";
      EXPECT_EQ(bad_rstd, 0) << "statistics differing";
      EXPECT_EQ(read_scalar(g, folded.amax), read_scalar(g, cast.amax));
      EXPECT_TRUE(rows.guards_intact() && rows_t.guards_intact() && rstd2.guards_intact())
          << "write outside the outputs";
      std::printf(
          "[ fp8      ] rmsnorm codes without out  %-8s %5ldx%-5ld codes %ld, transposed %ld, "
          "rstd %ld differ\n",
          std::string(dtype_name(format)).c_str(), static_cast<long>(R), static_cast<long>(C),
          static_cast<long>(bad), static_cast<long>(bad_t), static_cast<long>(bad_rstd));
    }
  }
}

// The SwiGLU backward writing its gradient's codes in both layouts (never the gradient itself)
// gives what swiglu_backward then the cast give, code for code: the folded kernel's tiles
// (rows a multiple of 128, F of 64) at the full models' widths (Llama 14336, Qwen 18944) and
// the written-then-cast path elsewhere; e4m3 and e5m2; a NaN reaches the amax.
TEST(GpuFp8, SwigluBackwardCastMatchesTheBackwardThenTheCast) {
  TS_REQUIRE_GPU();
  Backends be;
  Backend& g = *be.gpu;
  for (const DType format : {DType::E4M3, DType::E5M2}) {
    for (const auto& [R, F] : std::vector<std::pair<int64_t, int64_t>>{
             {128, 64}, {512, 14336}, {256, 18944}, {300, 72}, {33, 36}}) {
      SCOPED_TRACE(fmt::format("{} R={} F={}", dtype_name(format), R, F));
      GuardedTensor gate_up(g, DType::BF16, {R, 2 * F}), dh(g, DType::BF16, {R, F});
      GuardedTensor dgate_up(g, DType::BF16, {R, 2 * F}), scratch(g, DType::BF16, {R, 2 * F});
      upload_float(g, gate_up, random_normal(R * 2 * F, 41, 3.0f));
      std::vector<float> d = random_normal(R * F, 43, 0.02f);
      upload_float(g, dh, d);
      DeviceBuffer scalars(g, 4 * 256, "scalars");
      const Tensor scale = scalar_on(g, scalars, 0, format == DType::E4M3 ? 4000.0f : 60000.0f);
      GuardedTensor codes(g, format, {R, 2 * F}), codes_t(g, format, {2 * F, R});
      GuardedTensor fused(g, format, {R, 2 * F}), fused_t(g, format, {2 * F, R});
      const Fp8CastArgs cast{dgate_up, codes, codes_t, scale, scalar_on(g, scalars, 1, 0.0f)};
      const Fp8CastArgs folded{{}, fused, fused_t, scale, scalar_on(g, scalars, 2, 0.0f)};
      g.swiglu_backward(dgate_up.t(), dh.t(), gate_up.t());
      g.fp8_cast_transpose(cast);
      g.swiglu_backward_cast(scratch.t(), dh.t(), gate_up.t(), folded);
      const int64_t bad = differing(g, codes, fused), bad_t = differing(g, codes_t, fused_t);
      const float amax = read_scalar(g, cast.amax);
      EXPECT_EQ(bad, 0) << "codes differing from the cast of swiglu_backward's gradient";
      EXPECT_EQ(bad_t, 0) << "transposed codes differing";
      EXPECT_EQ(read_scalar(g, folded.amax), amax);
      EXPECT_TRUE(fused.guards_intact() && fused_t.guards_intact() && scratch.guards_intact())
          << "write outside the outputs";
      std::printf(
          "[ fp8      ] swiglu_backward_cast %-8s %5ldx%-5ld codes %ld, transposed %ld "
          "differ, amax %g\n",
          std::string(dtype_name(format)).c_str(), static_cast<long>(R), static_cast<long>(F),
          static_cast<long>(bad), static_cast<long>(bad_t), amax);
      d[F + 3] = NAN;  // row 1
      upload_float(g, dh, d);
      g.swiglu_backward_cast(scratch.t(), dh.t(), gate_up.t(), folded);
      EXPECT_TRUE(std::isnan(read_scalar(g, folded.amax))) << "a NaN must reach the amax";
    }
  }
}

// The SwiGLU writing h's transposed codes in h's place (the down projection's weight gradient
// keeps them): without h, with or without the row-major codes and the amax, and beside h; code
// for code what swiglu_forward then the cast of both layouts give. The tiled kernel's shapes
// (rows a multiple of 128, F of 64) at the full models' widths, and the element path elsewhere.
TEST(GpuFp8, SwigluForwardCastWritesTransposedCodesAsTheCast) {
  TS_REQUIRE_GPU();
  Backends be;
  Backend& g = *be.gpu;
  for (const DType format : {DType::E4M3, DType::E5M2}) {
    for (const auto& [R, F] : std::vector<std::pair<int64_t, int64_t>>{
             {128, 64}, {512, 14336}, {256, 18944}, {300, 72}, {33, 36}}) {
      GuardedTensor gate_up(g, DType::BF16, {R, 2 * F}), h(g, DType::BF16, {R, F});
      std::vector<float> x = random_normal(R * 2 * F, 47, 3.0f);
      upload_float(g, gate_up, x);
      DeviceBuffer scalars(g, 4 * 256, "scalars");
      const Tensor scale = scalar_on(g, scalars, 0, format == DType::E4M3 ? 40.0f : 1000.0f);
      GuardedTensor codes(g, format, {R, F}), codes_t(g, format, {F, R});
      const Fp8CastArgs cast{h, codes, codes_t, scale, scalar_on(g, scalars, 1, 0.0f)};
      g.swiglu_forward(h.t(), gate_up.t());
      g.fp8_cast_transpose(cast);
      const float amax = read_scalar(g, cast.amax);
      struct Variant {
        const char* name;
        bool h, rows, amax;
      };
      for (const Variant& v : {Variant{"rows and transposed", false, true, true},
                               Variant{"transposed alone", false, false, false},
                               Variant{"beside h", true, true, true}}) {
        SCOPED_TRACE(fmt::format("{} R={} F={} {}", dtype_name(format), R, F, v.name));
        GuardedTensor h2(g, DType::BF16, {R, F}), out(g, format, {R, F}), out_t(g, format, {F, R});
        const Fp8CastArgs folded{{},
                                 v.rows ? out.t() : Tensor{},
                                 out_t,
                                 scale,
                                 v.amax ? scalar_on(g, scalars, 2, 0.0f) : Tensor{}};
        g.swiglu_forward_cast(v.h ? h2.t() : Tensor{}, gate_up.t(), folded);
        const int64_t bad = v.rows ? differing(g, codes, out) : 0,
                      bad_t = differing(g, codes_t, out_t), bad_h = v.h ? differing(g, h, h2) : 0;
        EXPECT_EQ(bad, 0) << "codes differing from the cast of swiglu_forward's h";
        EXPECT_EQ(bad_t, 0) << "transposed codes differing";
        EXPECT_EQ(bad_h, 0) << "h differing from swiglu_forward's";
        if (v.amax) EXPECT_EQ(read_scalar(g, folded.amax), amax);
        EXPECT_TRUE(h2.guards_intact() && out.guards_intact() && out_t.guards_intact())
            << "write outside the outputs";
        std::printf(
            "[ fp8      ] swiglu_forward_cast %-19s %-8s %5ldx%-5ld codes %ld, transposed %ld, "
            "h %ld differ\n",
            v.name, std::string(dtype_name(format)).c_str(), static_cast<long>(R),
            static_cast<long>(F), static_cast<long>(bad), static_cast<long>(bad_t),
            static_cast<long>(bad_h));
        if (!v.amax) continue;
        const float kept = std::exchange(x[2 * F + 5], NAN);  // row 1's gate
        upload_float(g, gate_up, x);
        g.swiglu_forward_cast({}, gate_up.t(), folded);
        EXPECT_TRUE(std::isnan(read_scalar(g, folded.amax))) << "a NaN must reach the amax";
        x[2 * F + 5] = kept;
        upload_float(g, gate_up, x);
      }
    }
  }
}

// Attention writing the output projection's codes in its epilogue (the warpgroup forward on
// Hopper; elsewhere the cast after it): causal with a partial last tile, a window, and full
// attention, 4 query heads over 2 key/value heads of 128.
TEST(GpuFp8, AttentionForwardCastMatchesAttentionThenTheCast) {
  TS_REQUIRE_GPU();
  Backends be;
  Backend& g = *be.gpu;
  struct Shape {
    int64_t batch, seq, window;
    bool causal;
  };
  for (const Shape& sh :
       std::vector<Shape>{{2, 300, 0, true}, {1, 256, 64, true}, {1, 128, 0, false}}) {
    AttentionShape s;
    s.batch = sh.batch, s.seq = sh.seq, s.heads = 4, s.kv_heads = 2, s.head_dim = 128;
    s.causal = sh.causal, s.window = sh.window;
    s.scale = 1.0f / std::sqrt(128.0f);
    GuardedTensor lse(g, DType::F32, {s.batch * s.heads * s.seq});
    const Tensor l = lse.t();
    expect_forward_cast_matches_the_cast(
        g, {fmt::format("attention_forward_cast B{} T{} window {}{}", sh.batch, sh.seq, sh.window,
                        sh.causal ? "" : " full"),
            s.tokens(), s.qkv_width(), s.out_width(),
            [s, l](Backend& b, const Tensor& qkv, const Tensor& out, const Fp8CastArgs* codes) {
              if (codes) return b.attention_forward_cast(out, l, qkv, s, *codes);
              b.attention_forward(out, l, qkv, s);
            }});
  }
}

// The grouped cast against the CPU code for code at the MoE experts' shapes: an output
// gradient over 64 expert groups of DeepSeek-V2-Lite's width (multiples of 16 rows, some
// empty) with padding rows past them, odd groups, and an expert stack with a scale and amax
// per expert. The padding rows hold NaN and Inf: no amax may see them and no code may be
// written there. Then a NaN inside a group reaches its amax (only its expert's, in a stack).
TEST(GpuFp8, GroupedCastMatchesTheCpuCodeForCode) {
  TS_REQUIRE_GPU();
  Backends be;
  struct Case {
    std::vector<int32_t> sizes;   // offsets, or
    int64_t experts, group_rows;  // a stack
    int64_t padding, C;
    DType format;
  };
  std::vector<int32_t> routed(64);
  for (size_t g = 0; g < routed.size(); ++g) routed[g] = static_cast<int32_t>(16 * ((g * 7) % 23));
  for (const Case& k : std::vector<Case>{{routed, 0, 0, 48, 2048, DType::E5M2},
                                         {{5, 0, 33, 17, 0, 200, 1}, 0, 0, 7, 72, DType::E4M3},
                                         {{}, 8, 352, 0, 512, DType::E4M3}}) {
    const bool stack = k.group_rows > 0;
    std::vector<int32_t> offsets = {0};
    for (int32_t size : k.sizes) offsets.push_back(offsets.back() + size);
    const int64_t G = stack ? k.experts : static_cast<int64_t>(k.sizes.size());
    const int64_t used = stack ? k.experts * k.group_rows : offsets.back();
    const int64_t R = used + k.padding, C = k.C, n = R * C, S = stack ? G : 1;
    SCOPED_TRACE(fmt::format("{} G={} R={} C={}", dtype_name(k.format), G, R, C));
    std::vector<float> x = round_bf16(random_normal(n, 23, 2.0f));
    for (int64_t i = used * C; i < n; ++i) x[i] = i % 2 ? NAN : INFINITY;  // never read
    std::vector<float> scales = random_normal(S, 24, 100.0f);
    for (float& v : scales) v = std::fabs(v);
    std::vector<uint8_t> pattern(n);
    for (int64_t i = 0; i < n; ++i) pattern[i] = static_cast<uint8_t>((i * 37 + 11) % 0x70);
    struct Side {
      Tensor x, offsets, scale, amax, out, out_t;
    };
    auto run = [&](Backend& b, DeviceBuffer& buf, const Tensor& xt) {
      Side s;
      s.x = xt;
      s.offsets = buf.tensor(DType::I32, {G + 1});
      if (!stack) b.upload(s.offsets, offsets.data());
      s.scale = buf.tensor(DType::F32, {S}, 1024);
      s.amax = buf.tensor(DType::F32, {S}, 2048);
      s.out = buf.tensor(k.format, {R, C}, 4096);
      s.out_t = buf.tensor(k.format, {n}, 4096 + (n + 255) / 256 * 256);
      b.upload(s.scale, scales.data());
      b.fill(s.amax, 0.0f);
      b.upload(s.out, pattern.data());
      b.upload(s.out_t, pattern.data());
      Fp8GroupedCastArgs g;
      g.x = s.x;
      g.group_rows = stack ? k.group_rows : 0;
      if (!stack) g.offsets = s.offsets;
      g.out = s.out, g.out_t = s.out_t, g.scale = s.scale, g.amax = s.amax;
      b.fp8_grouped_cast(g);
      return s;
    };
    const size_t bytes = 4096 + 2 * ((n + 255) / 256 * 256);
    DeviceBuffer cb(*be.cpu, bytes + n * 4, "cpu"), gb(*be.gpu, bytes, "gpu");
    const Tensor cx = cb.tensor(DType::F32, {R, C}, bytes);
    be.cpu->upload(cx, x.data());
    GuardedTensor gx(*be.gpu, DType::BF16, {R, C});
    upload_float(*be.gpu, gx, x);
    const Side c = run(*be.cpu, cb, cx), g = run(*be.gpu, gb, gx);
    for (const auto& [ct, gt, what] :
         {std::tuple{c.out, g.out, "codes"}, std::tuple{c.out_t, g.out_t, "transposed codes"}}) {
      std::vector<uint8_t> want(n), got(n);
      be.cpu->download(want.data(), ct);
      be.gpu->download(got.data(), gt);
      int64_t bad = 0, untouched = 0;
      for (int64_t i = 0; i < n; ++i) bad += got[i] != want[i], untouched += got[i] == pattern[i];
      EXPECT_EQ(bad, 0) << what << " differing from the CPU reference";
      std::printf(
          "[ fp8      ] grouped cast %-8s G%-3ld %6ldx%-5ld %-16s mismatches %ld, %ld "
          "untouched\n",
          std::string(dtype_name(k.format)).c_str(), static_cast<long>(G), static_cast<long>(R),
          static_cast<long>(C), what, static_cast<long>(bad), static_cast<long>(untouched));
    }
    std::vector<float> want_amax(S), got_amax(S);
    be.cpu->download(want_amax.data(), c.amax);
    be.gpu->download(got_amax.data(), g.amax);
    EXPECT_TRUE(want_amax == got_amax) << "amaxes differ from the CPU's";
    for (float a : got_amax) EXPECT_TRUE(std::isfinite(a) && a > 0) << "amax " << a;
    EXPECT_TRUE(gx.guards_intact());
    // A NaN in the last non-empty group's rows (the last expert's, in a stack).
    const int64_t at = (used - 1) * C + 3;
    x[at] = NAN;
    upload_float(*be.gpu, gx, x);
    be.gpu->fill(g.amax, 0.0f);
    Fp8GroupedCastArgs a;
    a.x = gx;
    a.group_rows = stack ? k.group_rows : 0;
    if (!stack) a.offsets = g.offsets;
    a.amax = g.amax;
    be.gpu->fp8_grouped_cast(a);
    be.gpu->download(got_amax.data(), g.amax);
    EXPECT_TRUE(std::isnan(got_amax[S - 1])) << "the NaN must reach its group's amax";
    for (int64_t e = 0; e + 1 < S; ++e) EXPECT_EQ(got_amax[e], want_amax[e]) << "expert " << e;
    x[at] = 0.5f;
  }
}

TEST(GpuFp8, ScaleUpdateMatchesTheCpuBitForBit) {
  TS_REQUIRE_GPU();
  Backends be;
  const int64_t H = 16, S = 300;
  std::vector<float> h = random_normal(H * S, 5, 10.0f), scale = random_normal(S, 6);
  for (auto& v : h) v = std::fabs(v);
  for (auto& v : scale) v = std::fabs(v);
  h[0] = 0.0f;
  for (int64_t r = 0; r < H; ++r) h[r * S + 1] = 0.0f;  // no amax ever: scale kept
  h[2] = NAN;
  h[3] = INFINITY;
  h[4] = 1e-44f;  // scale overflows to FLT_MAX
  for (const bool most_recent : {false, true}) {
    for (const int margin : {0, 3}) {
      std::vector<std::vector<float>> out[2];
      Backend* backends[2] = {be.cpu.get(), be.gpu.get()};
      for (int k = 0; k < 2; ++k) {
        Backend& b = *backends[k];
        DeviceBuffer buf(b, (H * S + 2 * S + 64) * 4, "state");
        const Tensor th = buf.tensor(DType::F32, {H, S}), ts = buf.tensor(DType::F32, {S}, H * S * 4),
                     ti = buf.tensor(DType::F32, {S}, (H * S + S) * 4),
                     tn = buf.tensor(DType::F32, {1}, (H * S + 2 * S) * 4);
        b.upload(th, h.data());
        b.upload(ts, scale.data());
        b.fill(tn, 0.0f);
        Fp8ScaleUpdateArgs u;
        u.amax_history = th, u.scale = ts, u.scale_inv = ti, u.nonfinite = tn;
        u.fp8_max = 57344.0f, u.margin = margin, u.most_recent = most_recent;
        b.fp8_update_scales(u);
        for (const Tensor& t : {th, ts, ti, tn}) out[k].push_back(download_float(b, t));
      }
      for (size_t i = 0; i < 3; ++i) {
        int64_t bad = 0;
        for (size_t j = 0; j < out[0][i].size(); ++j)
          bad += std::memcmp(&out[0][i][j], &out[1][i][j], 4) != 0;
        EXPECT_EQ(bad, 0) << "tensor " << i << " most_recent " << most_recent << " margin " << margin;
      }
      EXPECT_TRUE(std::isnan(out[1][3][0])) << "non-finite amaxes must be reported";
    }
  }
}

// An FP8 GEMM (tensorwise scales from the operands' own amaxes) against the bf16 GEMM of the
// same bf16 inputs, and against the CPU's emulation of the same codes.
struct GemmResult {
  double vs_bf16 = 0, vs_cpu = 0;
};

GemmResult fp8_gemm_errors(int64_t M, int64_t N, int64_t K, DType fa, DType fb, bool fast_accum) {
  Backends be;
  const std::vector<float> a = round_bf16(random_normal(M * K, 1, 0.5f));
  const std::vector<float> w = round_bf16(random_normal(N * K, 2, 0.02f));
  std::vector<float> outs[2];
  Backend* backends[2] = {be.cpu.get(), be.gpu.get()};
  for (int k = 0; k < 2; ++k) {
    Backend& b = *backends[k];
    const DType act = k == 0 ? DType::F32 : DType::BF16;
    DeviceBuffer in(b, (M * K + N * K) * 4, "inputs"), codes(b, M * K + N * K + 512, "codes");
    DeviceBuffer st(b, 8 * 256, "scales"), out(b, M * N * 4, "out");
    const Tensor ta = in.tensor(act, {M, K}), tw = in.tensor(act, {N, K}, M * K * 4);
    upload_float(b, ta, a);
    upload_float(b, tw, w);
    const Tensor qa = codes.tensor(fa, {M, K}), qw = codes.tensor(fb, {N, K}, (M * K + 255) / 256 * 256);
    Tensor inv[2];
    const Tensor* srcs[2] = {&ta, &tw};
    const Tensor* dsts[2] = {&qa, &qw};
    for (int i = 0; i < 2; ++i) {  // tensorwise scaling through the ops the model uses
      const Tensor amax = st.tensor(DType::F32, {1, 1}, (3 * i) * 256);
      const Tensor scale = st.tensor(DType::F32, {1}, (3 * i + 1) * 256);
      inv[i] = st.tensor(DType::F32, {1}, (3 * i + 2) * 256);
      b.fill(amax, 0.0f);
      b.fp8_cast_transpose(Fp8CastArgs{*srcs[i], {}, {}, {}, amax.view({1})});
      Fp8ScaleUpdateArgs u;
      u.amax_history = amax, u.scale = scale, u.scale_inv = inv[i];
      u.fp8_max = fp8_max(dsts[i]->dtype), u.most_recent = true, u.roll = false;
      b.fp8_update_scales(u);
      b.fp8_cast_transpose(Fp8CastArgs{*srcs[i], *dsts[i], {}, scale, {}});
    }
    Fp8MatmulArgs m;
    m.out = out.tensor(act, {M, N});
    m.a = qa, m.b = qw, m.a_scale_inv = inv[0], m.b_scale_inv = inv[1], m.fast_accum = fast_accum;
    b.matmul_fp8(m);
    outs[k] = download_float(b, m.out);
    if (k == 1) {  // the bf16 GEMM of the same inputs
      MatmulArgs r;
      DeviceBuffer rb(b, M * N * 2, "bf16 out");
      r.out = rb.tensor(DType::BF16, {M, N}), r.a = ta, r.b = tw, r.trans_b = true;
      b.matmul(r);
      GemmResult g;
      g.vs_bf16 = relative_error(outs[1], download_float(b, r.out));
      g.vs_cpu = relative_error(outs[1], outs[0]);
      return g;
    }
  }
  return {};
}

TEST(GpuFp8, GemmMatchesBf16WithinFp8ErrorAndTheCpuEmulation) {
  TS_REQUIRE_GPU();
  struct P { int64_t M, N, K; DType a, b; bool fast; double tol; };
  // Per-element relative rounding error is at most 2^-4 (E4M3) or 2^-3 (E5M2), RMS about a
  // third of that; independent errors over K terms keep that relative size in the result.
  for (const P& p : std::vector<P>{{128, 256, 512, DType::E4M3, DType::E4M3, true, 0.06},
                                   {512, 384, 1024, DType::E4M3, DType::E4M3, false, 0.06},
                                   {256, 512, 768, DType::E5M2, DType::E4M3, false, 0.10},
                                   {4096, 4096, 4096, DType::E4M3, DType::E4M3, true, 0.06}}) {
    const GemmResult g = fp8_gemm_errors(p.M, p.N, p.K, p.a, p.b, p.fast);
    std::printf("[ fp8      ] gemm M%ld N%ld K%ld %s x %s%s: rel err vs bf16 %.3e (tol %.0e), vs cpu emulation %.3e\n",
                static_cast<long>(p.M), static_cast<long>(p.N), static_cast<long>(p.K),
                std::string(dtype_name(p.a)).c_str(), std::string(dtype_name(p.b)).c_str(),
                p.fast ? " fast_accum" : "", g.vs_bf16, p.tol, g.vs_cpu);
    EXPECT_LT(g.vs_bf16, p.tol);
    EXPECT_GT(g.vs_bf16, 1e-4) << "no quantisation error: the GEMM did not run in FP8";
    // Same codes, same scales: only accumulation order and the bf16 output rounding differ.
    EXPECT_LT(g.vs_cpu, 1e-2);
  }
}

TEST(GpuFp8, GemmRejectsDimensionsThatAreNotMultiplesOf16) {
  TS_REQUIRE_GPU();
  Backends be;
  DeviceBuffer buf(*be.gpu, 1 << 16, "x");
  Fp8MatmulArgs m;
  m.out = buf.tensor(DType::BF16, {24, 32});
  m.a = buf.tensor(DType::E4M3, {24, 32}, 4096);
  m.b = buf.tensor(DType::E4M3, {32, 32}, 8192);
  m.a_scale_inv = m.b_scale_inv = buf.tensor(DType::F32, {1}, 16384);
  try {
    be.gpu->matmul_fp8(m);
    FAIL() << "expected an error for M = 24";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("multiples of 16"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------- training

// Brown text through the Llama 3 tokenizer (128,256 tokens), as FP8 runs see real data.
Experiment experiment(const std::string& extra, int ffn_hidden_size = 320) {
  return testing::experiment_from_yaml(
      brown_tiny_llama_yaml(300, /*llama3_tokens=*/true, ffn_hidden_size) + extra);
}

// Runs bf16 and FP8 side by side for `iters` steps, with no skipped FP8 step. The logged
// loss (as Megatron logs it: the mean over the last kLogInterval iterations) of FP8 must stay
// within `tol` of bf16's at every logged step. Single iterations are not compared: two runs
// whose weights differ by rounding see each batch at slightly different points, and one
// batch's loss then differs by a few percent either way (bf16 vs fp32 does so too).
// model_keys: keys both runs add to the dense test model (an MoE family's, heads of 128).
// fp8_keys without `fp8:` (FP8 attention alone) leave the GEMMs in bf16.
void compare_curves(const std::string& fp8_keys, int iters, double tol,
                    const std::string& model_keys = "") {
  constexpr int kLogInterval = 10;
  Logger log("", 0, false, false);
  Trainer bf16(experiment(model_keys), make_backend(DeviceChoice::Gpu, 0), log, nullptr);
  Trainer fp8(experiment(model_keys + fp8_keys), make_backend(DeviceChoice::Gpu, 0), log, nullptr);
  const DecoderModel& model = dynamic_cast<DecoderModel&>(fp8.model());
  const Fp8Linears* linears = model.fp8();
  ASSERT_EQ(linears != nullptr, fp8_keys.find("fp8: ") != std::string::npos);
  ASSERT_EQ(model.runtime().fp8_attention,
            fp8_keys.find("fp8_dot_product_attention: true") != std::string::npos);
  if (model_keys.find("num_experts") != std::string::npos) {
    int stacks = 0;
    for (const Fp8LinearShape& l : linears->linears()) stacks += l.expert_stack();
    ASSERT_EQ(stacks, 2 * fp8.model().spec().num_layers) << "the experts do not run in FP8";
  }
  double worst = 0, first = 0, last_bf16 = 0, last_fp8 = 0, sum_bf16 = 0, sum_fp8 = 0;
  int worst_at = 0;
  for (int it = 1; it <= iters; ++it) {
    const IterationStats b = bf16.run_iteration(it), f = fp8.run_iteration(it);
    ASSERT_FALSE(f.skipped) << "iteration " << it << ": FP8 step skipped (non-finite)";
    sum_bf16 += b.loss, sum_fp8 += f.loss;
    if (it % kLogInterval != 0) continue;
    const double logged_bf16 = sum_bf16 / kLogInterval, logged_fp8 = sum_fp8 / kLogInterval;
    sum_bf16 = sum_fp8 = 0;
    const double d = std::abs(logged_fp8 - logged_bf16) / logged_bf16;
    if (d > worst) worst = d, worst_at = it;
    if (it == kLogInterval) first = logged_bf16;
    last_bf16 = logged_bf16, last_fp8 = logged_fp8;
    EXPECT_LT(d, tol) << "iterations " << it - kLogInterval + 1 << "-" << it << ": fp8 "
                      << logged_fp8 << " bf16 " << logged_bf16;
    if (it % 50 == 0 || it == kLogInterval)
      std::printf("[ curve    ] %-40s it %4d bf16 %.4f fp8 %.4f (%+.2f%%)\n", fp8_keys.c_str(), it,
                  logged_bf16, logged_fp8, 100 * (logged_fp8 - logged_bf16) / logged_bf16);
  }
  std::printf("[ curve    ] %s: logged bf16 %.4f -> %.4f, fp8 -> %.4f, worst difference %.2f%% at %d\n",
              fp8_keys.c_str(), first, last_bf16, last_fp8, 100 * worst, worst_at);
  EXPECT_LT(last_bf16, first - 0.5) << "the model should learn the text";
}

TEST(GpuFp8Model, HybridDelayedTracksBf16OnRealText) {
  TS_REQUIRE_GPU();
  compare_curves("fp8: hybrid\n", 300, 0.02);
}

TEST(GpuFp8Model, TensorwiseWithoutCacheAndE4m3WithHeadTrackBf16) {
  TS_REQUIRE_GPU();
  compare_curves("fp8: hybrid\nfp8_recipe: tensorwise\nfp8_weight_transpose_cache: false\n", 100, 0.02);
  compare_curves("fp8: e4m3\nfp8_lm_head: true\n", 100, 0.02);
}

// FP8 attention on heads of 128 (kv_channels 128 beside a hidden size of 256), alone and with
// FP8 GEMMs under current scaling.
TEST(GpuFp8Model, Fp8AttentionTracksBf16OnRealText) {
  TS_REQUIRE_GPU();
  compare_curves("fp8_dot_product_attention: true\n", 200, 0.02, "kv_channels: 128\n");
  compare_curves("fp8: hybrid\nfp8_recipe: tensorwise\nfp8_dot_product_attention: true\n", 100,
                 0.02, "kv_channels: 128\n");
}

// Fast accumulation in every FP8 GEMM, the head's included: its data gradient sums over the
// Llama 3 vocabulary (K = 128,256), the longest reduction of any GEMM in these models.
TEST(GpuFp8Model, FastAccumulationInEveryGemmTracksBf16) {
  TS_REQUIRE_GPU();
  compare_curves(
      "fp8: hybrid\nfp8_lm_head: true\nfp8_gemm_dgrad_split_accumulator: false\n"
      "fp8_gemm_wgrad_split_accumulator: false\n",
      300, 0.02);
}

// A tiny Mixtral (8 experts top-2 in both layers, learned routing) whose experts' grouped
// GEMMs run in FP8 too: hybrid delayed, and tensorwise without the transpose cache, track
// bf16 within the dense model's tolerance.
const char* kTinyMixtral =
    "model_family: mixtral\nnum_experts: 8\nmoe_router_topk: 2\nmoe_ffn_hidden_size: 96\n"
    "moe_layer_freq: 1\nmoe_aux_loss_coeff: 0.01\n";

TEST(GpuFp8Moe, HybridExpertsTrackBf16OnRealText) {
  TS_REQUIRE_GPU();
  compare_curves("fp8: hybrid\n", 300, 0.02, kTinyMixtral);
}

TEST(GpuFp8Moe, TensorwiseExpertsWithoutCacheTrackBf16) {
  TS_REQUIRE_GPU();
  compare_curves("fp8: hybrid\nfp8_recipe: tensorwise\nfp8_weight_transpose_cache: false\n", 100,
                 0.02, kTinyMixtral);
}

TEST(GpuFp8Model, TransposeCacheCostsTwoBytesPerFp8Weight) {
  TS_REQUIRE_GPU();
  Logger log("", 0, false, false);
  size_t bytes[2];
  for (int cache = 0; cache < 2; ++cache) {
    Trainer t(experiment(std::string("fp8: hybrid\nfp8_weight_transpose_cache: ") + (cache ? "true" : "false") + "\n"),
              make_backend(DeviceChoice::Gpu, 0), log, nullptr);
    t.run_iteration(1);
    bytes[cache] = t.backend().memory_stats().peak_bytes;
  }
  const ModelSpec s = Trainer(experiment("fp8: hybrid\n"), make_backend(DeviceChoice::Gpu, 0), log, nullptr).spec();
  const int64_t weights = s.num_layers * (s.qkv_width() * s.hidden + s.hidden * s.attn_width() + 3 * s.ffn * s.hidden);
  std::printf("[ fp8      ] peak memory: transpose cache %zu bytes, without %zu (fp8 weights %ld)\n", bytes[1],
              bytes[0], static_cast<long>(weights));
  EXPECT_GE(static_cast<int64_t>(bytes[1] - bytes[0]), weights);  // 2 bytes cached, 1 of scratch
}

// ---------------------------------------------------------------- block scaling

// The block cast on the GPU against the CPU reference, code for code and scale for scale, for
// 1x128 tiles and 128x128 blocks, both outputs, partial tiles at the edges and e4m3 / e5m2.
TEST(GpuFp8Blockwise, BlockCastMatchesTheCpuCodeForCode) {
  TS_REQUIRE_GPU();
  Backends be;
  for (auto [R, C] : {std::pair<int64_t, int64_t>{256, 384}, {200, 300}, {8192, 4096}}) {
    std::vector<float> x = random_normal(static_cast<size_t>(R * C), 5, 1.0f);
    for (size_t i = 0; i < x.size(); i += 997) x[i] *= 500.0f;  // outliers in some tiles
    x = round_bf16(x);
    for (Fp8Scaling scaling : {Fp8Scaling::Tile1x128, Fp8Scaling::Block128x128})
      for (DType format : {DType::E4M3, DType::E5M2}) {
        const int64_t ns = fp8_scale_count(scaling, R, C), nt = fp8_scale_count(scaling, C, R);
        std::vector<uint8_t> q(R * C), qt(R * C);
        std::vector<float> s(ns), st(nt);
        fp8_block_cast_reference(x.data(), R, C, scaling, format, q.data(), s.data(), qt.data(),
                                 st.data());
        DeviceBuffer buf(*be.gpu, 2 * R * C + 4 * (ns + nt) + 2 * R * C + 8192, "block cast");
        const Tensor tx = buf.tensor(DType::BF16, {R, C});
        upload_float(*be.gpu, tx, x);
        size_t at = (2 * R * C + 255) / 256 * 256;
        auto take = [&](DType d, Shape sh) {
          const Tensor t = buf.tensor(d, sh, at);
          at += (static_cast<size_t>(sh.numel()) * dtype_size(d) + 255) / 256 * 256;
          return t;
        };
        Fp8BlockCastArgs a;
        a.x = tx, a.scaling = scaling;
        a.out = take(format, {R, C}), a.out_scale_inv = take(DType::F32, {ns});
        a.out_t = take(format, {C, R}), a.out_t_scale_inv = take(DType::F32, {nt});
        a.nonfinite = take(DType::F32, {1});
        be.gpu->fill(a.nonfinite, 0.0f);
        be.gpu->fp8_block_cast(a);
        std::vector<uint8_t> gq(R * C), gqt(R * C);
        std::vector<float> gs(ns), gst(nt);
        be.gpu->download(gq.data(), a.out);
        be.gpu->download(gqt.data(), a.out_t);
        be.gpu->download(gs.data(), a.out_scale_inv);
        be.gpu->download(gst.data(), a.out_t_scale_inv);
        const std::string what =
            fmt::format("R{} C{} {} {}", R, C,
                        scaling == Fp8Scaling::Tile1x128 ? "1x128" : "128x128", dtype_name(format));
        EXPECT_EQ(gq, q) << what;
        EXPECT_EQ(gqt, qt) << what;
        if (scaling == Fp8Scaling::Tile1x128) {
          EXPECT_EQ(gs, s) << what;
          EXPECT_EQ(gst, st) << what;
        } else {  // compare the written entries only
          for (int64_t r = 0; r < R; r += 128)
            for (int64_t c = 0; c < C; c += 128) {
              EXPECT_EQ(gs[fp8_scale_index(scaling, R, C, r, c)],
                        s[fp8_scale_index(scaling, R, C, r, c)]);
              EXPECT_EQ(gst[fp8_scale_index(scaling, C, R, c, r)],
                        st[fp8_scale_index(scaling, C, R, c, r)]);
            }
        }
        EXPECT_EQ(read_scalar(*be.gpu, a.nonfinite), 0.0f) << what;
        std::printf("[ fp8      ] block cast %-28s codes and scales as the CPU's\n", what.c_str());
      }
  }
}

// Blockwise training needs cuBLASLt's block-scaled GEMMs: where the loaded cuBLASLt or the GPU
// has none, the run stops at once naming fp8_recipe; where it has them, FP8 blockwise training
// tracks bf16 on real text (widths of whole 128-blocks: ffn 384), as the per-tensor recipes do.
TEST(GpuFp8Blockwise, TracksBf16OnRealTextOrStopsNamingTheRecipe) {
  TS_REQUIRE_GPU();
  const bool available = make_backend(DeviceChoice::Gpu, 0)->supports(Capability::Fp8BlockScaling);
  constexpr int kWide = 384;
  if (!available) {
    Logger log("", 0, false, false);
    try {
      Trainer t(experiment("fp8: hybrid\nfp8_recipe: blockwise\n", kWide),
                make_backend(DeviceChoice::Gpu, 0), log, nullptr);
      FAIL() << "blockwise FP8 started without block-scaled GEMMs";
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.key(), "fp8_recipe");
      EXPECT_NE(std::string(e.what()).find("cuBLASLt"), std::string::npos) << e.what();
      std::printf("[ fp8      ] blockwise unavailable here: %s\n", e.what());
    }
    return;
  }
  Logger log("", 0, false, false);
  constexpr int kIters = 300, kLogInterval = 10;
  Trainer bf16(experiment("", kWide), make_backend(DeviceChoice::Gpu, 0), log, nullptr);
  Trainer fp8(experiment("fp8: hybrid\nfp8_recipe: blockwise\nfp8_lm_head: true\n", kWide),
              make_backend(DeviceChoice::Gpu, 0), log, nullptr);
  double sum_b = 0, sum_f = 0, worst = 0, first = 0, last = 0;
  for (int it = 1; it <= kIters; ++it) {
    const IterationStats b = bf16.run_iteration(it), f = fp8.run_iteration(it);
    ASSERT_FALSE(f.skipped) << "iteration " << it;
    sum_b += b.loss, sum_f += f.loss;
    if (it % kLogInterval != 0) continue;
    const double d = std::abs(sum_f - sum_b) / sum_b;
    worst = std::max(worst, d);
    if (it == kLogInterval) first = sum_b / kLogInterval;
    last = sum_b / kLogInterval;
    EXPECT_LT(d, 0.02) << "iterations " << it - kLogInterval + 1 << "-" << it;
    sum_b = sum_f = 0;
  }
  std::printf(
      "[ curve    ] fp8 hybrid blockwise +head: bf16 %.4f -> %.4f, worst logged difference "
      "%.2f%%\n",
      first, last, 100 * worst);
  EXPECT_LT(last, first - 0.5) << "the model should learn the text";
}

}  // namespace
}  // namespace tessera::gpu_test