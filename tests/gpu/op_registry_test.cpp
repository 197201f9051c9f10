// The op-test registry (tests/common/op_registry.h) on the CUDA backend: bf16-rounded inputs,
// compute in bf16 (fp32 where an op's tensors are fp32), against the double reference.
// Attention runs on each available implementation (attention_backend): Tessera's kernels in
// EveryOpMatchesTheReference, cuDNN's fused SDPA in AttentionOnCudnnMatchesTheReference
// (skipped, visibly, where cuDNN cannot be loaded). Also GPU-only checks of what the registry
// does not compare: bitwise init and conversion against the CPU, and out-of-memory errors.
#include <cmath>
#include <cstdio>

#include "common/op_registry.h"
#include "gpu_test_util.h"

namespace tessera::gpu_test {
namespace {

using test::all_cases;
using test::attention_cases;
using test::wide_attention_cases;
using test::BackendUnderTest;
using test::check_case;
using test::OpCase;

BackendUnderTest cuda(AttentionBackend attention) {
  const bool cudnn = attention == AttentionBackend::Vendor;
  return {"cuda", DType::BF16, cudnn ? "cudnn" : "tessera", [attention] {
            BackendOptions options;
            options.attention = attention;
            return make_backend(DeviceChoice::Gpu, 0, options);
          }};
}

// Block-scaled FP8 GEMMs need Hopper and a cuBLASLt of 12.9 or newer loaded: elsewhere their
// cases are skipped with a printed line (the blockwise GPU test checks the error there).
TEST(GpuOps, EveryOpMatchesTheReference) {
  TS_REQUIRE_GPU();
  const bool block_scaling =
      make_backend(DeviceChoice::Gpu, 0)->supports(Capability::Fp8BlockScaling);
  for (const OpCase& c : all_cases()) {
    if (!block_scaling && c.name.starts_with("fp8_block_cast+")) {
      std::printf("[ skipped  ] %-44s no block-scaled FP8 GEMMs here\n", c.name.c_str());
      continue;
    }
    check_case(c, cuda(AttentionBackend::Tessera));
  }
}

// The flash kernels over more query tiles than the GPU has SMs: the Hopper forward's CTAs each
// take several, carrying the K/V ring, the Q buffers and the softmax state across them.
TEST(GpuOps, AttentionOverMoreTilesThanSmsMatchesTheReference) {
  TS_REQUIRE_GPU();
  for (const OpCase& c : wide_attention_cases()) check_case(c, cuda(AttentionBackend::Tessera));
}

// The MoE experts' FP8 ops alone (EveryOpMatchesTheReference runs them too): the grouped cast
// and the grouped GEMMs, for a quick run after a change to either.
TEST(GpuOps, GroupedFp8OpsMatchTheReference) {
  TS_REQUIRE_GPU();
  int cases = 0;
  for (const OpCase& c : all_cases()) {
    if (!c.name.starts_with("fp8_grouped_cast") && !c.name.starts_with("grouped_matmul_fp8"))
      continue;
    check_case(c, cuda(AttentionBackend::Tessera));
    ++cases;
  }
  EXPECT_GT(cases, 0);
}

// fp32 attention (the precision of the multi-GPU parity runs) takes the row-wise kernels: every
// attention case with fp32 compute, held to the fp32 tolerance.
TEST(GpuOps, Fp32AttentionMatchesTheReference) {
  TS_REQUIRE_GPU();
  BackendUnderTest fp32 = cuda(AttentionBackend::Tessera);
  fp32.compute = DType::F32;
  fp32.attention = "fp32";
  int cases = 0;
  for (const OpCase& c : attention_cases()) {
    if (!c.name.starts_with("attention_")) continue;
    check_case(c, fp32);
    ++cases;
  }
  EXPECT_GT(cases, 0);
}

// attention_backend cudnn never falls back: every attention case runs on cuDNN or fails.
TEST(GpuOps, AttentionOnCudnnMatchesTheReference) {
  TS_REQUIRE_GPU();
  const BackendUnderTest cudnn = cuda(AttentionBackend::Vendor);
  try {
    std::printf("[ op       ] attention on %s\n", cudnn.make()->description().c_str());
  } catch (const ConfigError& e) {
    GTEST_SKIP() << "skipped: cuDNN attention unavailable: " << e.what();
  }
  int cases = 0;
  for (const OpCase& c : attention_cases()) {
    if (!c.name.starts_with("attention_")) continue;
    try {  // a refused shape throws ConfigError naming cuDNN's reason; go on with the next
      check_case(c, cudnn);
    } catch (const ConfigError& e) {
      // Value heads narrower than the query/key heads (multi-latent attention) are a graph the
      // loaded cuDNN's engines may not take; auto then runs Tessera's kernels (EveryOp...).
      if (c.name.find(" Dv") != std::string::npos) {
        std::printf("[ skipped  ] %s [cudnn]: %s\n", c.name.c_str(), e.what());
      } else {
        ADD_FAILURE() << c.name << " [cudnn]: " << e.what();
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << c.name << " [cudnn]: " << e.what();
    }
    ++cases;
  }
  EXPECT_GT(cases, 0);
}

TEST(GpuOps, InitNormalAndConvertAreBitwiseLikeTheCpu) {
  TS_REQUIRE_GPU();
  Backends be;
  const int64_t n = 1000003;
  DeviceBuffer cb(*be.cpu, n * 4, "cpu"), gb(*be.gpu, n * 4, "gpu"), gh(*be.gpu, n * 2, "gpu bf16");
  be.cpu->init_normal(cb.tensor(DType::F32, {n}), 77, 1234, 0.0f, 0.02f);
  be.gpu->init_normal(gb.tensor(DType::F32, {n}), 77, 1234, 0.0f, 0.02f);
  const std::vector<float> c = download_float(*be.cpu, cb.tensor(DType::F32, {n}));
  const std::vector<float> g = download_float(*be.gpu, gb.tensor(DType::F32, {n}));
  int64_t mismatches = 0;
  for (int64_t i = 0; i < n; ++i) mismatches += c[i] != g[i];
  EXPECT_EQ(mismatches, 0);
  be.gpu->convert(gh.tensor(DType::BF16, {n}), gb.tensor(DType::F32, {n}));
  const std::vector<float> h = download_float(*be.gpu, gh.tensor(DType::BF16, {n}));
  for (int64_t i = 0; i < n; i += 997) EXPECT_EQ(h[i], round_to_bf16(c[i])) << i;
}

// deterministic_mode (BackendOptions::deterministic): the attention backward repeats bit for bit
// on each implementation, on a shape whose dQ rows sum many key blocks (T 1000: 8 blocks of
// 128 keys), and still matches the default (order-varying) backward within bf16's rounding.
TEST(GpuOps, DeterministicModeRepeatsTheAttentionBackwardBitForBit) {
  TS_REQUIRE_GPU();
  AttentionShape s;
  s.batch = 2, s.seq = 1000, s.heads = 8, s.kv_heads = 2, s.head_dim = 128;
  s.causal = true;
  s.scale = 1.0f / std::sqrt(128.0f);
  const Shape qkv_shape{s.batch, s.seq, s.qkv_width()}, out_shape{s.batch, s.seq, s.out_width()};
  for (AttentionBackend attention : {AttentionBackend::Tessera, AttentionBackend::Vendor}) {
    BackendOptions options;
    options.attention = attention;
    std::unique_ptr<Backend> fast, exact;
    try {
      fast = make_backend(DeviceChoice::Gpu, 0, options);
      options.deterministic = true;
      exact = make_backend(DeviceChoice::Gpu, 0, options);
    } catch (const ConfigError& e) {  // cuDNN absent
      std::printf("[ skipped  ] deterministic mode on cudnn: %s\n", e.what());
      continue;
    }
    std::vector<std::vector<float>> runs;
    for (Backend* b : {fast.get(), exact.get(), exact.get()}) {
      GuardedTensor qkv(*b, DType::BF16, qkv_shape), out(*b, DType::BF16, out_shape),
          dout(*b, DType::BF16, out_shape), dqkv(*b, DType::BF16, qkv_shape),
          lse(*b, DType::F32, {s.batch, s.heads, s.seq});
      upload_float(*b, qkv, random_normal(static_cast<size_t>(qkv.t().numel()), 11));
      upload_float(*b, dout, random_normal(static_cast<size_t>(dout.t().numel()), 12));
      b->attention_forward(out, lse, qkv, s);
      b->attention_backward(dqkv, dout, out, lse, qkv, s);
      runs.push_back(download_float(*b, dqkv));
      EXPECT_TRUE(dqkv.guards_intact());
    }
    const char* name = attention == AttentionBackend::Tessera ? "tessera" : "cudnn";
    EXPECT_EQ(runs[1], runs[2]) << name << ": the deterministic backward differs between runs";
    const double err = relative_error(runs[1], runs[0]);
    std::printf("[ op       ] attention_backward %s deterministic vs default: rel err %.2e\n", name, err);
    EXPECT_LT(err, 1e-2) << name;
  }
}

TEST(GpuOps, OutOfMemoryIsAClearError) {
  TS_REQUIRE_GPU();
  Backends be;
  try {
    be.gpu->allocate(size_t{1} << 50, "an absurd buffer");
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("an absurd buffer"), std::string::npos) << e.what();
  }
  DeviceBuffer ok(*be.gpu, 1 << 20, "after the failure");  // the device still works
  be.gpu->fill(ok.tensor(DType::F32, {1 << 18}), 1.0f);
  be.gpu->synchronize();
}

}  // namespace
}  // namespace tessera::gpu_test
