// The step breakdown on hand-built traces with known answers: each kernel goes to its part
// (recompute by the range its op ran in, casts and optimizer by op, GEMM and attention by
// kernel name), overlapping time to the first busy part, communication only where exposed,
// and the parts add up to the step.
#include "tessera/analysis/step_breakdown.h"

#include <map>

#include "tessera/core/error.h"
#include "trace_builder.h"

namespace tessera::analysis::testing {
namespace {

std::map<std::string, int64_t> parts_us(const StepBreakdown& b) {
  std::map<std::string, int64_t> m;
  for (const StepPart& p : b.parts) m[p.name] = p.ns / 1000;
  return m;
}

TEST(StepBreakdown, EveryPartAndTheirSumIsTheStep) {
  TraceBuilder t(test_dir());
  auto op = [&](const std::string& name, double ts, int64_t id) {
    t.cpu_op(name, ts, 1, {{"External id", id}});
  };
  auto kernel = [&](const std::string& name, double ts, double dur, int64_t id, int stream = 7) {
    t.kernel(name, ts, dur, {{"External id", id}}, 0, stream);
  };
  t.step(5, 1000, 1000);  // [1000, 2000) µs
  t.step(6, 2000, 500);   // a later step is not this one
  op("matmul", 1000, 1);
  kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 1010, 100, 1);  // gemm 100
  op("attention_forward", 1100, 2);
  kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 1110, 50, 2);  // attention 50
  op("fp8_cast_transpose", 1150, 3);
  kernel("fp8_cast_transpose_kernel", 1160, 20, 3);  // casts 20
  // A recompute range: its GEMM and its norm both count as recompute.
  t.add({{"ph", "X"},
         {"cat", "user_annotation"},
         {"name", "recompute"},
         {"pid", 100},
         {"tid", 100},
         {"ts", 1200},
         {"dur", 100}});
  op("matmul", 1201, 4);
  kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 1210, 60, 4);
  op("rmsnorm_forward", 1250, 5);
  kernel("rmsnorm_forward_kernel", 1270, 10, 5);  // recompute 70
  op("rmsnorm_backward", 1300, 6);
  kernel("rmsnorm_backward_kernel", 1310, 30, 6);  // other 30
  op("sum_squares", 1400, 7);
  kernel("sum_partial_kernel", 1410, 5, 7);
  op("adamw_step", 1420, 8);
  kernel("adamw_kernel", 1425, 25, 8);  // optimizer 30
  // A collective on another stream: 40 µs, half of it under the norm backward above.
  kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 1320, 40, 9, 20);  // exposed 20
  // A kernel linked to its op through the runtime's correlation (PyTorch's way): gemm.
  op("matmul", 1500, 10);
  t.runtime(1501, 77, 10);
  t.kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 1510, 40,
           {{"correlation", 77}});
  // Outside the step: ignored; and a kernel that runs past its end is clipped.
  kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 900, 50, 1);
  op("fill", 1980, 11);
  kernel("fill_kernel", 1990, 30, 11);  // other 10 inside the step
  const StepBreakdown b = step_breakdown(t.write("trace.json"));
  EXPECT_EQ(b.step, "ProfilerStep#5");
  EXPECT_EQ(b.step_ns, 1000 * 1000);
  const auto p = parts_us(b);
  EXPECT_EQ(p.at("gemm"), 140);
  EXPECT_EQ(p.at("attention"), 50);
  EXPECT_EQ(p.at("casts"), 20);
  EXPECT_EQ(p.at("recompute"), 70);
  EXPECT_EQ(p.at("optimizer"), 30);
  EXPECT_EQ(p.at("other"), 40);
  EXPECT_EQ(p.at("communication"), 20);
  EXPECT_EQ(p.at("idle"), 1000 - 140 - 50 - 20 - 70 - 30 - 40 - 20);
  int64_t sum = 0;
  for (const StepPart& part : b.parts) sum += part.ns;
  EXPECT_EQ(sum, b.step_ns);
  EXPECT_EQ(b.parts.back().name, "idle");
  EXPECT_EQ(b.kernels, 11);  // not the one before the step
}

TEST(StepBreakdown, ATraceWithoutStepsIsRefusedByName) {
  TraceBuilder t(test_dir());
  t.kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 10, 5);
  const std::string path = t.write("no_steps.json");
  try {
    step_breakdown(path);
    FAIL() << "a trace without ProfilerStep ranges was accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("no ProfilerStep# range"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera::analysis::testing
