// Benchmarks on the CPU backend: argument parsing, timing and rotation, the model's GEMM list
// against the FLOPs convention, the correctness checks (a backend that computes wrong results
// must fail them, so that no number is reported), and the commands end to end.
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tessera/backend/backend_factory.h"
#include "tessera/backend/cpu/cpu_backend.h"
#include "tessera/bench/attention_bench.h"
#include "tessera/bench/command_args.h"
#include "tessera/bench/gemm_bench.h"
#include "tessera/bench/membw_bench.h"
#include "tessera/core/error.h"

namespace tessera::bench {
namespace {

namespace fs = std::filesystem;

// The CPU backend with wrong arithmetic where a flag says so: what a broken kernel looks like
// to the checks.
class FaultyBackend final : public CpuBackend {
 public:
  bool bad_matmul = false, bad_attention = false, bad_copy = false;

  std::string description() const override { return "faulty cpu"; }

 protected:
  void do_copy(const Tensor& d, const Tensor& s) override {
    CpuBackend::do_copy(d, s);
    if (bad_copy)
      CpuBackend::do_fill(d.flat_range(d.numel() - 1, 1), 0.0f);  // the last element lost
  }
  void do_matmul(const MatmulArgs& a) override {
    CpuBackend::do_matmul(a);
    if (bad_matmul) CpuBackend::do_fill(a.out.flat_range(0, 1), 1e4f);  // one wrong element
  }
  void do_matmul_fp8(const Fp8MatmulArgs& a) override {
    CpuBackend::do_matmul_fp8(a);
    if (bad_matmul) CpuBackend::do_fill(a.out.flat_range(0, 1), 1e4f);
  }
  void do_attention_forward(const Tensor& o, const Tensor& l, const Tensor& q,
                            const AttentionShape& s) override {
    AttentionShape wrong = s;
    if (bad_attention) wrong.causal = !s.causal;  // a masking bug
    CpuBackend::do_attention_forward(o, l, q, wrong);
  }
  void do_attention_gathered_forward(const Tensor& o, const Tensor& l, const Tensor& q,
                                     const Tensor& kv, const Tensor& positions, int64_t segment,
                                     const AttentionShape& s) override {
    AttentionShape wrong = s;
    if (bad_attention) wrong.window = 3;  // keys lost beyond a window it was not asked for
    CpuBackend::do_attention_gathered_forward(o, l, q, kv, positions, segment, wrong);
  }
};

BenchContext cpu_context(bool faulty = false) {
  BenchContext c;
  c.device =
      faulty ? std::unique_ptr<Backend>(std::make_unique<FaultyBackend>()) : make_cpu_backend();
  c.reference = make_cpu_backend();
  c.warmup = 1;
  c.iters = 3;
  c.budget_bytes = size_t{1} << 30;
  return c;
}

FaultyBackend& faults(BenchContext& c) {
  return static_cast<FaultyBackend&>(*c.device);
}

struct Result {
  int status = -1;
  std::string output;
};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

Result run(const std::string& args) {
  Result r;
  FILE* p = popen((std::string(TESSERA_BINARY) + " " + args + " 2>&1").c_str(), "r");
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) r.output.append(buf, n);
  const int s = pclose(p);
  r.status = WIFEXITED(s) ? WEXITSTATUS(s) : -1;
  return r;
}

TEST(CommandArgs, ConventionsOfTheCli) {
  const CommandArgs a({"--sizes", "1,2", "--iters=7", "-o", "out", "run1", "--flag", "--num_layers",
                       "4", "--seq_length=128", "run2"},
                      {"sizes", "iters", "output"}, {"flag"}, true);
  EXPECT_EQ(a.get_int_list("sizes", {}), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(a.get_int("iters", 1), 7);
  EXPECT_EQ(a.get("output", ""), "out");
  EXPECT_TRUE(a.has("flag"));
  EXPECT_EQ(a.positional(), (std::vector<std::string>{"run1", "run2"}));
  EXPECT_EQ(a.unknown(), (std::vector<std::string>{"--num_layers", "4", "--seq_length=128"}));
  EXPECT_THROW(CommandArgs({"--bogus", "1"}, {"sizes"}, {}, false), ConfigError);
  EXPECT_THROW(CommandArgs({"--sizes"}, {"sizes"}, {}, false), ConfigError);
  EXPECT_THROW(CommandArgs({"--iters", "x"}, {"iters"}, {}, false).get_int("iters", 1),
               ConfigError);
  EXPECT_THROW(CommandArgs({"--iters", "0"}, {"iters"}, {}, false).get_int("iters", 1),
               ConfigError);
  try {
    context_options(CommandArgs({"--gemm_autotune", "maybe"}, {"gemm_autotune"}, {}, false));
    FAIL() << "expected an error for --gemm_autotune maybe";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "gemm_autotune") << e.what();
  }
  EXPECT_FALSE(context_options(CommandArgs({}, {"deterministic_mode"}, {}, false)).deterministic);
  EXPECT_TRUE(context_options(CommandArgs({"--deterministic_mode", "true"}, {"deterministic_mode"}, {}, false))
                  .deterministic);
  try {
    context_options(CommandArgs({"--deterministic_mode", "yes"}, {"deterministic_mode"}, {}, false));
    FAIL() << "expected an error for --deterministic_mode yes";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "deterministic_mode") << e.what();
  }
}

// Megatron users type `--sizes-mib`; it names the same option as `--sizes_mib`, in every
// spelling a command line allows, while unknown dashed keys go on to the configuration loader.
TEST(CommandArgs, DashedNamesAreTheUnderscoredOptions) {
  const CommandArgs a(
      {"--sizes-mib", "1,4", "--num-gpus=8", "--dry-run", "--micro-batch-size", "2"},
      {"sizes_mib", "num_gpus"}, {"dry_run"}, true);
  EXPECT_EQ(a.get_int_list("sizes_mib", {}), (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(a.get_int("num_gpus", 1), 8);
  EXPECT_TRUE(a.has("dry_run"));
  EXPECT_EQ(a.unknown(), (std::vector<std::string>{"--micro-batch-size", "2"}));
  EXPECT_THROW(CommandArgs({"--sizes-mb", "1"}, {"sizes_mib"}, {}, false), ConfigError);

  const fs::path out = fs::temp_directory_path() / ("tessera_dashed_" + std::to_string(getpid()));
  const Result r = run("bench membw --device cpu --sizes-mib 1 --iters 2 -o " + out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(out / "bench_membw.csv"));
  fs::remove_all(out);
}

TEST(Measure, SamplesLastAtLeastAMillisecondAndRotationCoversTheCache) {
  auto b = make_cpu_backend();
  int calls = 0;
  const Timing t = measure(
      *b,
      [&](int i) {
        EXPECT_EQ(i, calls);
        ++calls;
      },
      2, 5);
  EXPECT_EQ(t.samples, 5);
  EXPECT_GT(t.calls_per_sample, 1);  // an empty op needs many calls per millisecond
  EXPECT_EQ(calls, 2 + 1 + 5 * t.calls_per_sample);
  EXPECT_LE(t.min_ms, t.median_ms);
  EXPECT_LE(t.median_ms, t.max_ms);

  EXPECT_EQ(rotation_sets(100 << 20, 50 << 20, size_t{8} << 30), 1);  // already beyond L2
  EXPECT_EQ(rotation_sets(10 << 20, 50 << 20, size_t{8} << 30), 10);  // 2 x L2
  EXPECT_EQ(rotation_sets(1 << 10, 50 << 20, size_t{8} << 30), 64);   // capped
  EXPECT_EQ(rotation_sets(1 << 30, 50 << 20, 512 << 20), 1);          // over budget: one set
  EXPECT_EQ(rotation_sets(10 << 20, 0, size_t{8} << 30), 1);          // CPU: no cache target
}

TEST(AttentionFlops, Convention) {
  EXPECT_DOUBLE_EQ(visible_pairs(8192, true, 0), 8192.0 * 8192 / 2);  // causal counts half
  EXPECT_DOUBLE_EQ(visible_pairs(8192, false, 0), 8192.0 * 8192);
  EXPECT_DOUBLE_EQ(visible_pairs(8, true, 3), 1 + 2 + 3 * 6);  // the band, exactly
  EXPECT_DOUBLE_EQ(visible_pairs(8192, true, 8192), 8192.0 * 8192 / 2);
  // Packed documents: L^2 / 2 for each, the last one shorter.
  EXPECT_DOUBLE_EQ(visible_pairs(8192, true, 0, 2048), 4 * 2048.0 * 2048 / 2);
  EXPECT_DOUBLE_EQ(visible_pairs(5000, true, 0, 2048), 2 * 2048.0 * 2048 / 2 + 904.0 * 904 / 2);
  AttentionProblem p;
  p.batch = 1, p.seq = 8192, p.heads = 32, p.kv_heads = 8, p.head_dim = 128;
  EXPECT_NEAR(p.forward_flops() / 1e12, 0.5497, 1e-4);  // 4 * 32 * 128 * 8192^2 / 2
  p.backward = true;
  EXPECT_DOUBLE_EQ(p.flops(), 2.5 * p.forward_flops());
}

// The listed GEMMs of one step are the Megatron convention's 6 * P_matmul FLOPs per token.
TEST(ModelGemms, AddUpToSixTimesTheMatmulParametersPerToken) {
  ModelSpec s;
  s.vocab_size = 1024, s.num_layers = 3, s.hidden = 256, s.ffn = 512, s.heads = 8, s.kv_heads = 2;
  s.head_dim = 32, s.qkv_bias = true;
  ModelRuntime rt;
  rt.micro_batch = 2, rt.seq_length = 512, rt.cross_entropy_chunk_tokens = 256;
  const std::vector<GemmProblem> g = model_gemms(s, rt);
  ASSERT_EQ(g.size(), 15u);
  double flops = 0;
  for (const GemmProblem& p : g) flops += p.flops() * p.calls_per_step;
  EXPECT_DOUBLE_EQ(flops, 6.0 * s.matmul_params() * 1024);
  EXPECT_EQ(g[0].name, "qkv forward");
  EXPECT_EQ(g[0].layout(), "NT");
  EXPECT_EQ(g[0].epilogue, Epilogue::Bias);
  EXPECT_EQ(g[4].calls_per_step, 4);  // lm_head over 1024 tokens in chunks of 256
  EXPECT_EQ(g.back().layout(), "TN");
  EXPECT_TRUE(g.back().fp32_out);
}

// A multi-latent attention model lists its own projections (the fused down-projection, the
// query and key/value up-projections, o_proj), with and without a query latent.
TEST(ModelGemms, MlaProjectionsAddUpToSixTimesTheMatmulParameters) {
  for (int64_t q_lora : {int64_t{0}, int64_t{96}}) {
    SCOPED_TRACE(q_lora);
    ModelSpec s;
    s.family = "deepseek";
    s.vocab_size = 1024, s.num_layers = 2, s.hidden = 256, s.ffn = 512, s.heads = 8;
    s.kv_heads = 8;
    s.mla = {true, q_lora, 64, 32, 16, 24};
    s.head_dim = s.mla.rope_dim;
    ModelRuntime rt;
    rt.micro_batch = 1, rt.seq_length = 512, rt.cross_entropy_chunk_tokens = 512;
    const std::vector<GemmProblem> g = model_gemms(s, rt);
    ASSERT_EQ(g.size(), (q_lora ? 7u : 6u) * 3);  // attention, gate_up, down, the head
    double flops = 0;
    for (const GemmProblem& p : g) flops += p.flops() * p.calls_per_step;
    EXPECT_DOUBLE_EQ(flops, 6.0 * s.matmul_params() * 512);
    EXPECT_EQ(g[0].name, "q_kv_a forward");
    EXPECT_EQ(g[0].n, (q_lora ? q_lora : 8 * 48) + 64 + 16);
    EXPECT_EQ(g[q_lora ? 3 : 2].name, "o_proj forward");
    EXPECT_EQ(g[q_lora ? 3 : 2].k, 8 * 24);
  }
}

// An MoE model lists what its MoE layers multiply: the router (never FP8), each expert's GEMMs
// over its balanced share of the routed rows (top-k / experts of the tokens, once per expert
// and layer), and the shared expert; its dense layers keep gate_up and down.
TEST(ModelGemms, MoeLayersListTheRouterAndEachExpertsShareOfTheRows) {
  ModelSpec s;
  s.family = "qwen3_moe";
  s.vocab_size = 1024, s.num_layers = 3, s.hidden = 256, s.ffn = 512, s.heads = 8;
  s.kv_heads = 2, s.head_dim = 32, s.qk_norm = true;
  s.moe.experts = 8, s.moe.topk = 2, s.moe.ffn = 128, s.moe.shared_ffn = 64;
  s.moe.layers = {false, true, true};
  ModelRuntime rt;
  rt.micro_batch = 1, rt.seq_length = 512, rt.cross_entropy_chunk_tokens = 512;
  rt.fp8.mode = Fp8Mode::Hybrid;
  const std::vector<GemmProblem> g = model_gemms(s, rt);
  double flops = 0;
  for (const GemmProblem& p : g) flops += p.flops() * p.calls_per_step;
  EXPECT_DOUBLE_EQ(flops, 6.0 * s.matmul_params() * 512);
  auto find = [&](const std::string& name) {
    for (const GemmProblem& p : g)
      if (p.name == name) return p;
    ADD_FAILURE() << "no " << name;
    return GemmProblem{};
  };
  EXPECT_EQ(find("gate_up forward").calls_per_step, 1);  // the dense first layer
  const GemmProblem experts = find("experts_gate_up forward");
  EXPECT_EQ(experts.m, 512 * 2 / 8);
  EXPECT_EQ(experts.calls_per_step, 2 * 8);
  EXPECT_TRUE(experts.fp8);
  EXPECT_FALSE(find("router forward").fp8);
  EXPECT_EQ(find("router forward").calls_per_step, 2);
  EXPECT_EQ(find("shared_down forward").epilogue, Epilogue::Residual);
  rt.fp8.recipe = Fp8Recipe::Blockwise;  // its experts stay bf16
  for (const GemmProblem& p : model_gemms(s, rt))
    if (p.name.starts_with("experts_")) EXPECT_FALSE(p.fp8) << p.name;
}

// FP8 training runs its linears' GEMMs on K-major FP8 copies: fast accumulation forward
// only, output gradients in e5m2 (hybrid); the head stays bf16 unless fp8_lm_head.
TEST(ModelGemms, Fp8LinearsAreListedAsTrainingRunsThem) {
  ModelSpec s;
  s.vocab_size = 1024, s.num_layers = 2, s.hidden = 256, s.ffn = 512, s.heads = 8, s.kv_heads = 2;
  s.head_dim = 32;
  ModelRuntime rt;
  rt.micro_batch = 1, rt.seq_length = 512, rt.cross_entropy_chunk_tokens = 512;
  rt.fp8.mode = Fp8Mode::Hybrid;
  const std::vector<GemmProblem> bf16_head = model_gemms(s, rt);
  rt.fp8.lm_head = true;
  const std::vector<GemmProblem> fp8_head = model_gemms(s, rt);
  ASSERT_EQ(bf16_head.size(), 15u);
  for (const GemmProblem& p : bf16_head) {
    SCOPED_TRACE(p.name);
    const bool head = p.name.rfind("lm_head", 0) == 0;
    EXPECT_EQ(p.fp8, !head);
    if (!p.fp8) continue;
    EXPECT_EQ(p.layout(), "NT");
    const bool forward = p.name.find("forward") != std::string::npos;
    EXPECT_EQ(p.fast_accum, forward);
    EXPECT_EQ(p.fp8_a, forward ? DType::E4M3 : DType::E5M2);
    EXPECT_EQ(p.fp32_out, p.name.find("wgrad") != std::string::npos);
  }
  double flops_bf16_head = 0, flops_fp8_head = 0;
  for (size_t i = 0; i < fp8_head.size(); ++i) {
    EXPECT_TRUE(fp8_head[i].fp8) << fp8_head[i].name;
    flops_bf16_head += bf16_head[i].flops() * bf16_head[i].calls_per_step;
    flops_fp8_head += fp8_head[i].flops() * fp8_head[i].calls_per_step;
  }
  EXPECT_DOUBLE_EQ(flops_fp8_head, flops_bf16_head);
  EXPECT_DOUBLE_EQ(flops_fp8_head, 6.0 * s.matmul_params() * 512);

  // The experiment's accumulation choice per GEMM kind reaches every problem of that kind.
  rt.fp8.fast_accum_fprop = false, rt.fp8.fast_accum_wgrad = true;
  for (const GemmProblem& p : model_gemms(s, rt)) {
    SCOPED_TRACE(p.name);
    EXPECT_EQ(p.fast_accum, p.name.find("wgrad") != std::string::npos);
  }
}

TEST(Checks, PassOnTheReferenceAndFailOnWrongResults) {
  BenchContext good = cpu_context();
  for (Epilogue e : {Epilogue::None, Epilogue::Bias, Epilogue::Residual, Epilogue::Accumulate})
    for (auto [ta, tb] : {std::pair{false, false}, {false, true}, {true, false}}) {
      const GemmProblem p{"t", 96, 64, 48, ta, tb, e};
      EXPECT_TRUE(check_gemm(good, p).ok) << p.layout() << " " << epilogue_name(e);
    }

  BenchContext bad = cpu_context(true);
  faults(bad).bad_matmul = true;
  const GemmResult wrong = run_gemm(bad, GemmProblem{"sq", 64, 64, 64, false, true});
  EXPECT_FALSE(wrong.check.ok);
  EXPECT_EQ(wrong.tflops, 0);  // no timing, no number
  EXPECT_NE(wrong.check.failure.find("small case"), std::string::npos) << wrong.check.failure;

  GemmProblem fp8{"fp8", 96, 64, 48, false, true};
  fp8.fp8 = true;
  EXPECT_TRUE(check_gemm(good, fp8).ok) << check_gemm(good, fp8).failure;
  for (Epilogue e : {Epilogue::Bias, Epilogue::Residual, Epilogue::Accumulate}) {
    GemmProblem grad = fp8;  // an e5m2 operand and split accumulation, as the backward runs
    grad.epilogue = e;
    grad.fp8_a = DType::E5M2;
    grad.fast_accum = false;
    grad.fp32_out = e == Epilogue::Accumulate;
    EXPECT_TRUE(check_gemm(good, grad).ok)
        << epilogue_name(e) << ": " << check_gemm(good, grad).failure;
    EXPECT_FALSE(run_gemm(bad, grad).check.ok) << epilogue_name(e);
  }
  const GemmResult wrong_fp8 = run_gemm(bad, fp8);
  EXPECT_FALSE(wrong_fp8.check.ok);
  EXPECT_EQ(wrong_fp8.tflops, 0);

  AttentionProblem a;
  a.batch = 1, a.seq = 96, a.heads = 4, a.kv_heads = 2, a.head_dim = 16;
  EXPECT_TRUE(check_attention(good, a).ok);
  faults(bad).bad_matmul = false;
  faults(bad).bad_attention = true;
  EXPECT_FALSE(check_attention(bad, a).ok);
  AttentionProblem cp = a;  // context parallelism: the gathered attention's check
  cp.seq = 64, cp.segments = 2;
  EXPECT_FALSE(check_attention(bad, cp).ok);
  faults(bad).bad_attention = false;
  EXPECT_TRUE(check_attention(bad, cp).ok) << check_attention(bad, cp).failure;
  faults(bad).bad_attention = true;

  EXPECT_TRUE(run_copy(good, 1 << 20).ok);
  faults(bad).bad_attention = false;
  faults(bad).bad_copy = true;
  const CopyResult c = run_copy(bad, 1 << 20);
  EXPECT_FALSE(c.ok);
  EXPECT_EQ(c.gbps, 0);
}

TEST(BenchCommands, WriteTablesAsMarkdownAndCsv) {
  const fs::path out = fs::temp_directory_path() / ("tessera_bench_" + std::to_string(getpid()));
  Result r = run("bench gemm --device cpu --sizes 64,96 --layouts NT,TN --iters 2 --warmup 1 -o " +
                 out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("| 96^3 | TN | 96 | 96 | 96 | bias | fp32 |"), std::string::npos)
      << r.output;
  std::ifstream csv(out / "bench_gemm.csv");
  std::string line;
  int lines = 0;
  while (std::getline(csv, line)) ++lines;
  EXPECT_EQ(lines, 1 + 2 * 2 * 2);
  EXPECT_TRUE(fs::exists(out / "bench_gemm.md"));

  r =
      run("bench attention --device cpu --seqs 64,128 --head_dims 16 --heads 4 --kv_heads 2 "
          "--window 64 --batch 1 --iters 2 --warmup 1 -o " +
          out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  // causal and full at both lengths, the window only where it is shorter than the sequence.
  EXPECT_NE(r.output.find("10 attention problems checked and timed"), std::string::npos)
      << r.output;
  EXPECT_TRUE(fs::exists(out / "bench_attention.csv"));
  // Packed documents of 48 tokens: checked against the CPU reference with documents, skipped
  // where one document would cover the sequence.
  r = run("bench attention --device cpu --seqs 32,128 --head_dims 16 --heads 4 --kv_heads 2 --masks packed "
          "--document_length 48 --batch 1 --iters 2 --warmup 1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("2 attention problems checked and timed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("packed 48"), std::string::npos) << r.output;

  // Context parallelism: both ranks' shares of the gathered attention, checked against the CPU
  // reference (forward and backward) and timed in turn; lengths that do not cut into 2 x ranks
  // chunks, and fewer than 2 ranks, are refused by name with nothing run.
  r = run("bench attention --device cpu --seqs 64 --head_dims 16 --heads 4 --kv_heads 2 --masks cp "
          "--context_parallel_size 2 --batch 1 --iters 2 --warmup 1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("2 attention problems checked and timed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("causal cp 2"), std::string::npos) << r.output;
  r = run("bench attention --device cpu --seqs 66 --head_dims 16 --masks cp --context_parallel_size 4");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("'seqs' has value '66'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("multiples of 2 x --context_parallel_size = 8"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("checked and timed"), std::string::npos) << r.output;
  r = run("bench attention --device cpu --seqs 64 --head_dims 16 --masks cp --context_parallel_size 1");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("'context_parallel_size' has value '1'"), std::string::npos) << r.output;
  // FP8 attention takes heads of 128 and no context parallelism: refused by name, nothing run.
  r = run("bench attention --device cpu --seqs 64 --head_dims 64 --fp8_dot_product_attention true");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("'head_dims' has value '64'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("128 with --fp8_dot_product_attention true"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("checked and timed"), std::string::npos) << r.output;
  r = run("bench attention --device cpu --seqs 64 --masks cp --fp8_dot_product_attention true");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("'fp8_dot_product_attention' has value 'true'"), std::string::npos)
      << r.output;
  r = run("bench attention --device cpu --seqs 64 --fp8_dot_product_attention yes");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("true or false"), std::string::npos) << r.output;

  r = run("bench membw --device cpu --sizes_mib 1,4 --iters 2 -o " + out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(out / "bench_membw.csv"));

  r =
      run("bench gemm --device cpu --config default --seq_length 32 --micro_batch_size 2 "
          "--iters 2 --warmup 1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("one training step's GEMMs"), std::string::npos) << r.output;

  r = run("bench gemm --device cpu --sizes 64 --layouts NT --epilogues none --dtypes bf16,fp8 "
          "--iters 2 --warmup 1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("| 64^3 fp8 | NT | 64 | 64 | 64 | none |"), std::string::npos) << r.output;
  EXPECT_EQ(run("bench gemm --device cpu --sizes 72 --dtypes fp8").status, 2);  // not a multiple of 16
  EXPECT_EQ(run("bench gemm --device cpu --dtypes int8").status, 2);
  EXPECT_EQ(run("bench gemm --device cpu --config default --dtypes fp8").status, 2);
  EXPECT_EQ(run("bench gemm --device cpu --layouts XY").status, 2);
  EXPECT_EQ(run("bench gemm --device cpu --num_layers 2").status, 2);  // needs --config
  EXPECT_EQ(run("bench membw --device cpu --gpu H100").status, 2);
  fs::remove_all(out);
}

// bench model --full on the CPU backend with a small stand-in for the preset: every layer,
// the global batch by accumulation of --micro_batches, the precision-aware optimizer's bf16
// state by default (keys given win), the planner's bytes against the measured peak (exact on
// the CPU), and a profiled step whose parts add up to it (no GPU: all idle).
TEST(BenchCommands, ModelFullSizeAccumulatesAndBreaksTheStepDown) {
  const fs::path out =
      fs::temp_directory_path() / ("tessera_bench_full_" + std::to_string(getpid()));
  const std::string small =
      "bench model --full --device cpu --models llama3.1_8B --num_layers 3 --hidden_size 64 "
      "--ffn_hidden_size 128 --num_attention_heads 4 --num_query_groups 2 --seq_length 32 "
      "--vocab_size 300 --iters 1 --warmup 1 --micro_batches 3 -o " +
      out.string();
  Result r = run(small);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("| llama3.1_8B | 3 | fp32 | grads bf16, master fp32, m/v bf16/bf16 | "
                          "1 x 3 |"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("the parts add up to the step"), std::string::npos) << r.output;
  std::ifstream in(out / "bench_model_full.json");
  const auto results = nlohmann::json::parse(in);
  ASSERT_EQ(results.size(), 1u);
  const auto& row = results[0];
  EXPECT_EQ(row["global_batch_size"], 3);
  EXPECT_EQ(row["micro_batches"], 3);
  EXPECT_EQ(row["recompute"], "null");
  EXPECT_EQ(row["planned"]["allocated"], row["measured_peak_bytes"]);
  double sum = 0;
  for (const auto& [part, ms] : row["breakdown"]["parts_ms"].items()) sum += ms.get<double>();
  EXPECT_NEAR(sum, row["breakdown"]["step_ms"].get<double>(), 1e-6);
  EXPECT_EQ(row["breakdown"]["parts_ms"].size(), 8u);
  EXPECT_TRUE(fs::exists(row["breakdown"]["trace"].get<std::string>()));

  // The micro batch a key sets multiplies the global batch; the recompute a key sets wins.
  r = run(small + " --micro_batch_size=2 --recompute_granularity full --no_breakdown");
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream again(out / "bench_model_full.json");
  const auto second = nlohmann::json::parse(again)[0];
  EXPECT_EQ(second["global_batch_size"], 6);
  EXPECT_EQ(second["recompute"], "full");
  EXPECT_FALSE(second.contains("breakdown"));
  EXPECT_EQ(run(small + " --micro_batches 0").status, 2);
  fs::remove_all(out);
}

// On the CPU backend, bench gemm's defaults are a CPU's sweep: it says what it runs before the
// first check and ends within a minute (16384^3 in fp32 took minutes per call, silently).
TEST(BenchCommands, GemmDefaultsOnTheCpuFinishWithinAMinuteAndSayWhatTheyRun) {
  const auto start = std::chrono::steady_clock::now();
  const Result r = run("bench gemm --device cpu");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find("bench gemm on cpu"), 0u) << r.output;
  EXPECT_TRUE(contains(r.output, "18 problems, each checked against the CPU reference"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "| 1024^3 | TN |")) << r.output;
  EXPECT_FALSE(contains(r.output, "2048^3")) << r.output;
  EXPECT_LT(seconds, 60.0) << r.output;
}

// bench model on the CPU backend: the ceiling is the CPU's fp32 GEMM rate, measured (not 0.0),
// MFU is quoted against it, and the time split is of the step it was timed in, adding up to it.
TEST(BenchCommands, ModelOnTheCpuIsHonestAboutItsCeilingAndItsSplit) {
  const fs::path out =
      fs::temp_directory_path() / ("tessera_bench_cpu_" + std::to_string(getpid()));
  const Result r =
      run("bench model --device cpu --models llama3.1_8B --num_layers 1 --hidden_size 64 "
          "--ffn_hidden_size 128 --num_attention_heads 4 --num_query_groups 2 --seq_length 64 "
          "--vocab_size 300 --iters 2 --warmup 1 -o " +
          out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "bench model on the CPU backend")) << r.output;
  EXPECT_TRUE(contains(r.output, "GEMM ceiling (fp32 1024^3): ")) << r.output;
  EXPECT_FALSE(contains(r.output, "ceiling (bf16")) << r.output;
  EXPECT_TRUE(contains(r.output, "tokens/s/rank")) << r.output;
  std::ifstream in(out / "bench_model.json");
  const auto row = nlohmann::json::parse(in)[0];
  EXPECT_GT(row["gemm_ceiling_tflops"].get<double>(), 0.0);
  EXPECT_GT(row["mfu_vs_gemm_ceiling"].get<double>(), 0.0);
  const double parts = row["breakdown_ms_gemm"].get<double>() +
                       row["breakdown_ms_attention"].get<double>() +
                       row["breakdown_ms_other"].get<double>();
  EXPECT_NEAR(parts, row["breakdown_step_ms"].get<double>(), 1e-6);
  EXPECT_GT(row["breakdown_ms_gemm"].get<double>(), 0.0);
  fs::remove_all(out);
}

// The bench's sequence is measured even where the experiment's own runs are shorter (Primus's
// Mixtral: seq and max_position_embeddings 4096), unless the keys cap the positions.
TEST(BenchCommands, ModelMeasuresTheBenchSequenceBeyondTheExperimentsPositions) {
  const std::string mixtral =
      "bench model --device cpu --models mixtral_8x7B --num_layers 1 --hidden_size 64 "
      "--ffn_hidden_size 64 --moe_ffn_hidden_size 64 --num_attention_heads 4 "
      "--num_query_groups 2 --vocab_size 300 --iters 1 --warmup 0 --no_breakdown --seq_length 4160";
  Result r = run(mixtral);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "| mixtral_8x7B |")) << r.output;
  r = run(mixtral + " --max_position_embeddings 4096");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "expected at most max_position_embeddings (4096)")) << r.output;
}

// Exit code 0 with a verdict whether or not there is a GPU; without one the report says so.
TEST(Preflight, ReportsAVerdictPerLine) {
  const fs::path out =
      fs::temp_directory_path() / ("tessera_preflight_" + std::to_string(getpid()));
  const Result r = run("preflight --gemm_size 2048 --copy_mib 256 -o " + out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("verdict: "), std::string::npos) << r.output;
  if (gpu_device_count() == 0) {
    EXPECT_NE(r.output.find("| GPU | none | warn |"), std::string::npos) << r.output;
    // Said plainly (no driver "version" to blame), with what the machine can do instead.
    EXPECT_EQ(r.output.find("insufficient"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("| CPU backend | available | info | cpu (OpenBLAS"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("tessera train --device cpu"), std::string::npos) << r.output;
  } else {
    EXPECT_NE(r.output.find("| GEMM | "), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("FAILED"), std::string::npos) << r.output;
  }
  EXPECT_TRUE(fs::exists(out / "preflight.csv"));
  fs::remove_all(out);
}

}  // namespace
}  // namespace tessera::bench
