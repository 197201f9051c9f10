#include "tessera/bench/model_bench.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tessera/backend/backend_factory.h"
#include "tessera/bench/command_args.h"
#include "tessera/config/config.h"
#include "tessera/config/keys.h"
#include "tessera/core/error.h"
#include "tessera/obs/logger.h"
#include "tessera/ops/device_buffer.h"
#include "tessera/train/trainer.h"

namespace tessera::bench {
namespace {

struct Options {
  std::vector<std::string> models = {"llama3.1_8B", "qwen2.5_7B", "mistral_7B"};
  std::vector<std::string> overrides;  // passed to every experiment
  int warmup = 3;
  int iters = 10;
  std::string output_dir;
  bool breakdown = true;
};

Options parse(const std::vector<std::string>& args) {
  Options o;
  o.overrides = {"--num_layers", "4", "--seq_length", "8192", "--micro_batch_size", "1",
                 "--global_batch_size", "1", "--eval_interval", "0", "--log_interval", "1000000"};
  const CommandArgs a(args, {"models", "warmup", "iters", "output"}, {"no_breakdown"}, true);
  o.models = a.get_list("models", o.models);
  o.warmup = static_cast<int>(a.get_int("warmup", o.warmup, 0));
  o.iters = static_cast<int>(a.get_int("iters", o.iters, 1));
  o.output_dir = a.get("output", "");
  o.breakdown = !a.has("no_breakdown");
  if (!a.positional().empty())
    throw ConfigError("command line", "(argument)", a.positional()[0],
                      "--key value or --key=value");
  // Any experiment key, e.g. --num_layers 8 --precision bf16, after the proxy's defaults.
  o.overrides.insert(o.overrides.end(), a.unknown().begin(), a.unknown().end());
  return o;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The dense bf16 GEMM rate this backend reaches at 8192^3: the ceiling MFU is quoted against.
double measure_gemm_ceiling_tflops(Backend& b) {
  if (!b.supports(Capability::Bf16Compute)) return 0;
  const int64_t n = 8192;
  DeviceBuffer a(b, n * n * 2, "gemm a"), w(b, n * n * 2, "gemm b"), c(b, n * n * 2, "gemm c");
  const Tensor ta = a.tensor(DType::BF16, {n, n}), tw = w.tensor(DType::BF16, {n, n}), tc = c.tensor(DType::BF16, {n, n});
  b.init_normal(ta, 1, 0, 0.0f, 1.0f);
  b.init_normal(tw, 2, 0, 0.0f, 1.0f);
  MatmulArgs m;
  m.out = tc, m.a = ta, m.b = tw, m.trans_b = true;
  std::vector<double> ms;
  for (int i = 0; i < 13; ++i) {
    b.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    b.matmul(m);
    b.synchronize();
    if (i >= 3) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * n * n * n / (median(ms) / 1e3) / 1e12;
}

std::string family(const std::string& op) {
  if (op.starts_with("matmul") || op.starts_with("bias_backward")) return "gemm";
  if (op.starts_with("attention")) return "attention";
  return "other";
}

}  // namespace

int model_bench_command(const std::vector<std::string>& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    fmt::print(
        "usage: tessera bench model [--models a,b,...] [--iters N] [--warmup N] [-o DIR] [--no_breakdown]\n"
        "                           [--key value ...]\n\n"
        "Trains each model's shipped `<model>-pretrain` experiment on mock data as a proxy (default:\n"
        "--num_layers 4 --seq_length 8192 --micro_batch_size 1) and reports median step time,\n"
        "tokens/s/GPU, TFLOP/s/GPU (Megatron FLOPs convention), MFU against the measured 8192^3\n"
        "bf16 GEMM rate, peak memory and the time split GEMM / attention / other.\n"
        "Other --key value pairs override every experiment (e.g. --sliding_window 4096; FP8:\n"
        "--fp8 hybrid, and --no_fp8_weight_transpose_cache for its peak memory without the cache).\n");
    return 0;
  }
  const Options o = parse(args);
  Logger log("", 0, false, false);
  nlohmann::json results = nlohmann::json::array();
  double ceiling = -1;
  std::string device;
  for (const std::string& model : o.models) {
    LoadOptions lo;
    lo.config_path = model + "-pretrain";
    lo.cli_overrides = o.overrides;
    lo.cli_overrides.insert(lo.cli_overrides.end(), {"--train_iters", std::to_string(o.warmup + o.iters)});
    const Experiment e = load_experiment(lo);
    auto backend = make_backend(e.training.device, 0, backend_options(e.training));
    if (ceiling < 0) ceiling = measure_gemm_ceiling_tflops(*backend), device = backend->description();
    Trainer trainer(e, std::move(backend), log, nullptr);
    Backend& b = trainer.backend();
    for (int i = 1; i <= o.warmup; ++i) trainer.run_iteration(i);
    b.reset_peak_memory();
    std::vector<double> ms;
    double last_loss = 0;
    for (int i = 1; i <= o.iters; ++i) {
      b.synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      last_loss = trainer.run_iteration(o.warmup + i).loss;
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::map<std::string, double> split, per_op;
    if (o.breakdown) {
      b.enable_op_timing(true);
      trainer.run_iteration(o.warmup + o.iters + 1);
      for (const auto& [op, t] : b.op_times_ms()) split[family(op)] += t, per_op[op] += t;
      b.enable_op_timing(false);
    }
    const double step_ms = median(ms);
    const double tokens = static_cast<double>(e.training.global_batch_size * e.training.seq_length);
    const double tok_s = tokens / (step_ms / 1e3);
    const double tflops = trainer.spec().flops_per_token(e.training.seq_length) * tok_s / 1e12;
    const MemoryStats mem = b.memory_stats();
    // FP8 runs say so, whether the weight transpose cache (2 bytes per FP8 weight) is on, the
    // output head in FP8 and which GEMM kinds accumulate fast when that is not Transformer
    // Engine's default (e.g. "fast-acc fprop+wgrad"), so that one table compares the variants.
    std::string precision(dtype_name(trainer.model().params().dtype));
    if (e.training.fp8 != Fp8Mode::Off) {
      const std::string fast = fast_accumulation_kinds(fp8_options(e.training), "+");
      const bool default_accumulation = fast == fast_accumulation_kinds(Fp8Options{}, "+");
      precision = "fp8 " + find_key("fp8")->get(e) + " " + find_key("fp8_recipe")->get(e) +
                  (e.training.fp8_lm_head ? " +head" : "") +
                  (e.training.fp8_weight_transpose_cache ? "" : " no-cache") +
                  (default_accumulation ? "" : " fast-acc " + fast);
    }
    nlohmann::json r = {{"model", model}, {"num_layers", e.model_config.num_layers},
                        {"precision", precision},
                        {"micro_batch_size", e.training.micro_batch_size}, {"seq_length", e.training.seq_length},
                        {"sliding_window", e.model_config.sliding_window}, {"step_ms", step_ms},
                        {"tokens_per_s_per_gpu", tok_s}, {"tflops_per_gpu", tflops},
                        {"mfu_vs_gemm_ceiling", ceiling > 0 ? tflops / ceiling : 0.0},
                        {"peak_mem_gib", mem.peak_bytes / double(1 << 30)}, {"loss", last_loss}};
    for (const auto& [k, v] : split) r["breakdown_ms_" + k] = v;
    if (!per_op.empty()) r["op_ms"] = per_op;
    results.push_back(r);
    fmt::print("{}\n", r.dump());
  }
  fmt::print("\n{}\nGEMM ceiling (bf16 8192^3): {:.1f} TFLOP/s\n\n", device, ceiling);
  fmt::print("| model | layers | precision | mbs | seq | window | step ms | tokens/s/GPU | TFLOP/s/GPU | MFU | peak GiB | gemm ms | attention ms | other ms |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  auto ms_or_dash = [](const nlohmann::json& r, const char* key) {
    return r.contains(key) ? fmt::format("{:.1f}", r[key].get<double>()) : std::string("-");
  };
  for (const auto& r : results)
    fmt::print("| {} | {} | {} | {} | {} | {} | {:.1f} | {:.0f} | {:.1f} | {:.1f}% | {:.2f} | {} | {} | {} |\n",
               r["model"].get<std::string>(), r["num_layers"].get<int64_t>(), r["precision"].get<std::string>(),
               r["micro_batch_size"].get<int64_t>(), r["seq_length"].get<int64_t>(), r["sliding_window"].get<int64_t>(),
               r["step_ms"].get<double>(), r["tokens_per_s_per_gpu"].get<double>(), r["tflops_per_gpu"].get<double>(),
               100 * r["mfu_vs_gemm_ceiling"].get<double>(), r["peak_mem_gib"].get<double>(),
               ms_or_dash(r, "breakdown_ms_gemm"), ms_or_dash(r, "breakdown_ms_attention"),
               ms_or_dash(r, "breakdown_ms_other"));
  if (!o.output_dir.empty()) {
    std::filesystem::create_directories(o.output_dir);
    std::ofstream out(std::filesystem::path(o.output_dir) / "bench_model.json");
    out << results.dump(2) << "\n";
  }
  return 0;
}

}  // namespace tessera::bench
