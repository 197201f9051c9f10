// Megatron's precision-aware optimizer on the GPU: bf16 gradients, moments and main
// parameters (no fp32 master) train the tiny Llama on Brown text like fp32 state does, their
// state has the dtypes asked for, and a checkpoint of bf16 state resumes bitwise; split master
// weights train as a whole fp32 copy and checkpoint as its fp32 values.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>

#include "common/experiment_yaml.h"
#include "common/scratch_dir.h"
#include "gpu_test_util.h"
#include "tessera/core/split_master.h"
#include "tessera/data/tokenizer.h"
#include "tessera/obs/logger.h"
#include "tessera/plan/memory_plan.h"
#include "tessera/train/trainer.h"

namespace tessera::gpu_test {
namespace {

namespace fs = std::filesystem;

const std::string kBf16Moments =
    "use_precision_aware_optimizer: true\nuse_distributed_optimizer: true\n"
    "exp_avg_dtype: bf16\nexp_avg_sq_dtype: bf16\n";
const std::string kBf16GradsAndMoments = kBf16Moments + "main_grads_dtype: bf16\n";
const std::string kAllBf16 = kBf16GradsAndMoments + "main_params_dtype: bf16\n";

Experiment experiment(int iters, const std::string& extra, int ffn_hidden_size = 320) {
  return testing::experiment_from_yaml(brown_tiny_llama_yaml(iters, false, ffn_hidden_size) +
                                       extra);
}

std::vector<double> losses(const Experiment& e, int iters) {
  Logger log("", 0, false, false);
  Trainer t(e, make_backend(DeviceChoice::Gpu, 0), log, nullptr);
  std::vector<double> out;
  for (int it = 1; it <= iters; ++it) out.push_back(t.run_iteration(it).loss);
  return out;
}

// The largest difference of 10-iteration means, relative to the reference's: single steps
// move with the batch, the means with what the optimizer does.
double worst_window(const std::vector<double>& a, const std::vector<double>& ref) {
  double worst = 0;
  for (size_t w = 0; w + 10 <= ref.size(); w += 10) {
    double sa = 0, sr = 0;
    for (size_t i = w; i < w + 10; ++i) sa += a[i], sr += ref[i];
    worst = std::max(worst, std::abs(sa - sr) / sr);
  }
  return worst;
}

// bf16 moments and gradients round each step's state to 8 mantissa bits (relative 2^-9); the
// CPU test of the same state (tests/optim) moves 80-step curves by under 0.2%. Held to the
// FP8-vs-BF16 bar, 1%. bf16 main parameters also round every update into the weights, and an
// update below half a bf16 ulp of its weight is lost: with lr 1e-3 the matrices' updates
// (weights ~0.02, ulp 1.2e-4) are ~8 ulps and survive, the norm weights' (1.0, ulp 7.8e-3)
// mostly do not, so the curve drifts further; held to 3%.
TEST(GpuPrecisionAwareOptimizer, Bf16StateTracksFp32StateOnRealText) {
  TS_REQUIRE_GPU();
  constexpr int kIters = 150;
  const std::vector<double> fp32 = losses(experiment(kIters, ""), kIters);
  const std::vector<double> moments = losses(experiment(kIters, kBf16GradsAndMoments), kIters);
  const std::vector<double> all = losses(experiment(kIters, kAllBf16), kIters);
  const double d_moments = worst_window(moments, fp32), d_all = worst_window(all, fp32);
  std::printf(
      "[ curve    ] fp32 state %.4f -> %.4f; bf16 grads+moments -> %.4f (worst 10-step "
      "mean %.2f%%); + bf16 main params -> %.4f (%.2f%%)\n",
      fp32.front(), fp32.back(), moments.back(), 100 * d_moments, all.back(), 100 * d_all);
  EXPECT_LT(fp32.back(), fp32.front() - 1.0) << "the model should learn the text";
  EXPECT_LE(d_moments, 0.01);
  EXPECT_LE(d_all, 0.03);
  EXPECT_NE(moments, fp32) << "bf16 state changed nothing: is it bf16?";
}

TEST(GpuPrecisionAwareOptimizer, StateHasTheAskedDtypesAndNoMasterCopy) {
  TS_REQUIRE_GPU();
  Logger log("", 0, false, false);
  Trainer t(experiment(4, kAllBf16), make_backend(DeviceChoice::Gpu, 0), log, nullptr);
  EXPECT_EQ(t.model().params().dtype, DType::BF16);
  EXPECT_EQ(t.model().grads().dtype, DType::BF16);
  EXPECT_EQ(t.optimizer().exp_avg().dtype, DType::BF16);
  EXPECT_EQ(t.optimizer().exp_avg_sq().dtype, DType::BF16);
  EXPECT_TRUE(t.optimizer().params_are_master());
  EXPECT_EQ(t.optimizer().master().data, t.model().params().data);
  const IterationStats s = t.run_iteration(1);
  EXPECT_FALSE(s.skipped);
  EXPECT_TRUE(std::isfinite(s.grad_norm) && s.grad_norm > 0);
}

// Three steps, a checkpoint, three more in a new trainer: the losses of a straight run,
// bitwise (one process: the GEMM autotuner's choices are the same for both).
TEST(GpuPrecisionAwareOptimizer, Bf16StateCheckpointResumesBitwise) {
  TS_REQUIRE_GPU();
  testing::ScratchDir dir;
  const std::string save = (dir / "ckpt").string();
  const std::vector<double> straight = losses(experiment(6, kAllBf16), 6);
  Logger log("", 0, false, false);
  {
    Trainer first(experiment(6, kAllBf16 + "save: " + save + "\n"),
                  make_backend(DeviceChoice::Gpu, 0), log, nullptr);
    for (int it = 1; it <= 3; ++it) first.run_iteration(it);
    first.save_checkpoint();
  }
  Trainer resumed(experiment(6, kAllBf16 + "load: " + save + "\n"),
                  make_backend(DeviceChoice::Gpu, 0), log, nullptr);
  ASSERT_EQ(resumed.completed_iterations(), 3);
  for (int it = 4; it <= 6; ++it)
    EXPECT_EQ(resumed.run_iteration(it).loss, straight[it - 1]) << "iteration " << it;
}

// Split master weights (the default beside bf16 parameters) against a whole fp32 copy: the
// same update on the same fp32 values, the parameters rounding ties away from zero instead of to
// even, so the curves differ only by the few halfway values a step meets (~P / 65,536).
TEST(GpuPrecisionAwareOptimizer, SplitMasterTrainsAsAWholeFp32Copy) {
  TS_REQUIRE_GPU();
  constexpr int kIters = 60;
  const std::vector<double> whole = losses(experiment(kIters, "store_param_remainders: false\n"), kIters);
  const std::vector<double> split = losses(experiment(kIters, ""), kIters);
  const double d = worst_window(split, whole);
  std::printf("[ curve    ] whole fp32 master %.5f -> %.5f; split %.5f -> %.5f (worst 10-step mean %.4f%%)\n",
              whole.front(), whole.back(), split.front(), split.back(), 100 * d);
  EXPECT_NEAR(split.front(), whole.front(), 1e-4 * whole.front());
  EXPECT_LE(d, 0.002);
  Logger log("", 0, false, false);
  Trainer t(experiment(2, ""), make_backend(DeviceChoice::Gpu, 0), log, nullptr);
  EXPECT_TRUE(t.optimizer().splits_master());
  EXPECT_EQ(t.optimizer().master().dtype, DType::U16);
  EXPECT_EQ(t.optimizer().master().numel(), t.model().params().numel());
}

// A split master's checkpoint resumes bitwise, and loads into a run with a whole fp32 copy as
// the same fp32 values (checkpoints hold fp32 either way).
TEST(GpuPrecisionAwareOptimizer, SplitMasterCheckpointResumesBitwiseAndLoadsIntoAWholeCopy) {
  TS_REQUIRE_GPU();
  testing::ScratchDir dir;
  const std::string save = (dir / "ckpt").string();
  const std::vector<double> straight = losses(experiment(6, ""), 6);
  Logger log("", 0, false, false);
  {
    Trainer first(experiment(6, "save: " + save + "\n"), make_backend(DeviceChoice::Gpu, 0), log,
                  nullptr);
    for (int it = 1; it <= 3; ++it) first.run_iteration(it);
    first.save_checkpoint();
  }
  Trainer resumed(experiment(6, "load: " + save + "\n"), make_backend(DeviceChoice::Gpu, 0), log,
                  nullptr);
  Trainer whole(experiment(6, "load: " + save + "\nstore_param_remainders: false\n"),
                make_backend(DeviceChoice::Gpu, 0), log, nullptr);
  const int64_t P = resumed.model().params().numel();
  std::vector<uint16_t> high(P), low(P);
  std::vector<float> fp32(P);
  resumed.backend().download(high.data(), resumed.model().params());
  resumed.backend().download(low.data(), resumed.optimizer().master());
  whole.backend().download(fp32.data(), whole.optimizer().master());
  int64_t mismatches = 0;
  for (int64_t i = 0; i < P; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &fp32[i], 4);
    mismatches += split_master_join(high[i], low[i]) != bits;
  }
  EXPECT_EQ(mismatches, 0) << "of " << P;
  ASSERT_EQ(resumed.completed_iterations(), 3);
  for (int it = 4; it <= 6; ++it)
    EXPECT_EQ(resumed.run_iteration(it).loss, straight[it - 1]) << "iteration " << it;
}

// The memory planner counts what the CUDA backend allocates, exactly: weights, gradients and
// optimizer state in their dtypes, activations, FP8 buffers, the cuBLASLt workspace, the kernel
// scratch, the AdamW chunk table and the trainer's scalars. With Tessera's attention every
// byte is known; with cuDNN's, the engine's own workspace (not counted) may add to it.
TEST(GpuPrecisionAwareOptimizer, PlannerPredictsThePeakExactly) {
  TS_REQUIRE_GPU();
  struct Case {
    const char* name;
    std::string extra;
    bool exact;
    int ffn_hidden_size = 320;  // whole 128-blocks (384) for blockwise FP8
  };
  const Case cases[] = {
      {"fp32 state (split master)", "attention_backend: tessera\n", true},
      {"fp32 state (whole master)", "attention_backend: tessera\nstore_param_remainders: false\n",
       true},
      {"bf16 state", kAllBf16 + "attention_backend: tessera\n", true},
      {"bf16 grads+moments, fp8, selective",
       kBf16GradsAndMoments +
           "attention_backend: tessera\nfp8: hybrid\nrecompute_granularity: selective\n",
       true},
      {"cuDNN attention, full recompute", kBf16GradsAndMoments + "recompute_granularity: full\n",
       false}};
  std::vector<Case> all(std::begin(cases), std::end(cases));
  if (make_backend(DeviceChoice::Gpu, 0)->supports(Capability::Fp8BlockScaling))
    all.push_back(
        {"fp8 blockwise, head, no cache",
         kBf16GradsAndMoments +
             "attention_backend: tessera\nfp8: hybrid\n"
             "fp8_recipe: blockwise\nfp8_lm_head: true\nfp8_weight_transpose_cache: false\n",
         true, 384});
  for (const Case& c : all) {
    const Experiment e = experiment(3, c.extra, c.ffn_hidden_size);
    Logger log("", 0, false, false);
    Trainer t(e, make_backend(DeviceChoice::Gpu, 0), log, nullptr);
    const RunSetup setup =
        make_run_setup(e, {1, DType::BF16}, [&] { return make_tokenizer(e.data)->vocab_size(); });
    const plan::MemoryPlan p = plan::plan_memory(plan::plan_input(setup, /*gpu=*/true));
    for (int it = 1; it <= 2; ++it) t.run_iteration(it);
    const size_t peak = t.backend().memory_stats().peak_bytes;
    std::printf("[ memory   ] %-38s planned %zu measured %zu (%+lld bytes)\n", c.name,
                p.allocated(), peak,
                static_cast<long long>(peak) - static_cast<long long>(p.allocated()));
    if (c.exact) {
      EXPECT_EQ(peak, p.allocated()) << c.name;
    } else {
      EXPECT_GE(peak + (size_t{1} << 20), p.allocated()) << c.name;
      EXPECT_LE(peak, p.allocated() + (size_t{64} << 20)) << c.name;
    }
  }
}

}  // namespace
}  // namespace tessera::gpu_test
