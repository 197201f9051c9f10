#include "tessera/bench/model_bench.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tessera/analysis/gpu_specs.h"
#include "tessera/analysis/step_breakdown.h"
#include "tessera/backend/backend_factory.h"
#include "tessera/bench/command_args.h"
#include "tessera/config/config.h"
#include "tessera/config/keys.h"
#include "tessera/core/error.h"
#include "tessera/data/tokenizer.h"
#include "tessera/obs/logger.h"
#include "tessera/obs/profiler/profiler.h"
#include "tessera/ops/device_buffer.h"
#include "tessera/plan/memory_plan.h"
#include "tessera/train/trainer.h"

namespace tessera::bench {
namespace {

namespace fs = std::filesystem;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct Options {
  std::vector<std::string> models = {"llama3.1_8B", "qwen2.5_7B", "mistral_7B"};
  std::vector<std::string> overrides;  // passed to every experiment
  int warmup = 3, iters = 10;  // the proxy's; --full's are 1 and 2
  std::string output_dir;
  bool breakdown = true;
  // Full size: every layer of the preset, the global batch by accumulation of micro_batches
  // micro-batches (the optimizer amortized as in real training), and the step's time broken
  // down from a profiled step's trace.
  bool full = false;
  int micro_batches = 16;
};

// The full-size run's defaults, before the user's keys (which win): Megatron's
// precision-aware optimizer with bf16 gradients and moments. Recompute is chosen per run
// (full_recompute): none where the plan fits the device, which the fp32 master's low halves
// (store_param_remainders) allow for the 7-8B presets at seq 8192 on one H200, FP8 weight cache
// included (docs/memory.md), else selective.
const std::vector<std::string> kFullDefaults = {"--use_precision_aware_optimizer",
                                                "true",
                                                "--use_distributed_optimizer",
                                                "true",
                                                "--main_grads_dtype",
                                                "bf16",
                                                "--exp_avg_dtype",
                                                "bf16",
                                                "--exp_avg_sq_dtype",
                                                "bf16"};

Options parse(const std::vector<std::string>& args) {
  Options o;
  const CommandArgs a(args, {"models", "warmup", "iters", "output", "micro_batches"},
                      {"no_breakdown", "full"}, true);
  o.models = a.get_list("models", o.models);
  o.full = a.has("full");
  o.warmup = static_cast<int>(a.get_int("warmup", o.full ? 1 : 3, 0));
  o.iters = static_cast<int>(a.get_int("iters", o.full ? 2 : 10, 1));
  // The global batch is micro_batches x micro_batch_size.
  o.micro_batches = static_cast<int>(a.get_int("micro_batches", o.micro_batches, 1));
  o.output_dir = a.get("output", "");
  o.breakdown = !a.has("no_breakdown");
  if (!a.positional().empty())
    throw ConfigError("command line", "(argument)", a.positional()[0],
                      "--key value or --key=value");
  // Any experiment key, e.g. --num_layers 8 --precision bf16, after the mode's defaults.
  o.overrides.assign(a.unknown().begin(), a.unknown().end());
  return o;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The dense GEMM rate the ceiling MFU is quoted against, in the backend's compute dtype: bf16
// at 8192^3 on GPUs; on the CPU backend fp32 at 1024^3, where a CPU's rate has levelled off
// and which takes a second rather than minutes.
struct GemmCeiling {
  DType dtype = DType::BF16;
  int64_t n = 8192;
  double tflops = 0;
  std::string text() const {
    return fmt::format("GEMM ceiling ({} {}^3): {:.3g} TFLOP/s", dtype_name(dtype), n, tflops);
  }
};

GemmCeiling measure_gemm_ceiling(Backend& b) {
  GemmCeiling g;
  g.dtype = b.default_compute_dtype();
  g.n = b.device().kind == DeviceKind::GPU ? 8192 : 1024;
  const int64_t n = g.n;
  const size_t bytes = static_cast<size_t>(n * n) * dtype_size(g.dtype);
  DeviceBuffer a(b, bytes, "gemm a"), w(b, bytes, "gemm b"), c(b, bytes, "gemm c");
  const Tensor ta = a.tensor(g.dtype, {n, n}), tw = w.tensor(g.dtype, {n, n}),
               tc = c.tensor(g.dtype, {n, n});
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
  g.tflops = 2.0 * n * n * n / (median(ms) / 1e3) / 1e12;
  return g;
}

std::string family(const std::string& op) {
  if (op.starts_with("matmul") || op.starts_with("bias_backward")) return "gemm";
  if (op.starts_with("attention")) return "attention";
  return "other";
}

// The last value of `key` among `--key value` / `--key=value` tokens (dashes or underscores).
std::optional<std::string> last_value(const std::vector<std::string>& tokens, const std::string& key) {
  std::optional<std::string> last;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (!tokens[i].starts_with("--")) continue;
    std::string name = tokens[i].substr(2), value;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
    } else if (i + 1 < tokens.size()) {
      value = tokens[i + 1];
    }
    std::replace(name.begin(), name.end(), '-', '_');
    if (name == key) last = value;
  }
  return last;
}

// last_value() of an integer key, or `fallback`.
int64_t last_int(const std::vector<std::string>& tokens, const std::string& key, int64_t fallback) {
  const std::optional<std::string> value = last_value(tokens, key);
  if (!value) return fallback;
  try {
    return std::stoll(*value);
  } catch (...) {
    throw ConfigError("command line", key, *value, "an integer");
  }
}

// The experiment `bench model` trains for `model`: the proxy (4 layers, global batch 1) or
// the full model (all layers, micro_batches micro-batches per step, `full_recompute`), then the
// user's keys.
Experiment bench_experiment(const Options& o, const std::string& model,
                            const std::string& full_recompute = "null") {
  LoadOptions lo;
  lo.config_path = model + "-pretrain";
  // One device: an MoE experiment's experts, spread over a node's GPUs, all on this one.
  lo.cli_overrides = {
      "--seq_length",   "8192",    "--micro_batch_size",           "1", "--eval_interval", "0",
      "--log_interval", "1000000", "--expert_model_parallel_size", "1"};
  if (o.full) {
    lo.cli_overrides.insert(lo.cli_overrides.end(), kFullDefaults.begin(), kFullDefaults.end());
    lo.cli_overrides.insert(lo.cli_overrides.end(), {"--recompute_granularity", full_recompute});
  } else {
    lo.cli_overrides.insert(lo.cli_overrides.end(),
                            {"--num_layers", "4", "--global_batch_size", "1"});
  }
  // The bench's sequence is the positions the model must take: an experiment whose own runs
  // are shorter (Primus's Mixtral at 4096) is measured at it all the same, unless the user's
  // keys set max_position_embeddings themselves.
  if (!last_value(o.overrides, "max_position_embeddings")) {
    const int64_t seq = last_int(o.overrides, "seq_length", last_int(lo.cli_overrides, "seq_length", 0));
    lo.cli_overrides.insert(lo.cli_overrides.end(), {"--max_position_embeddings", std::to_string(seq)});
  }
  lo.cli_overrides.insert(lo.cli_overrides.end(), o.overrides.begin(), o.overrides.end());
  lo.cli_overrides.insert(lo.cli_overrides.end(),
                          {"--train_iters", std::to_string(o.warmup + o.iters + 1)});
  if (!o.full) return load_experiment(lo);
  // The global batch follows the micro batch the keys settle on.
  lo.cli_overrides.insert(lo.cli_overrides.end(),
                          {"--global_batch_size",
                           std::to_string(o.micro_batches * last_int(lo.cli_overrides, "micro_batch_size", 1))});
  return load_experiment(lo);
}

// Runs iteration `it` under the profiler (CUPTI on GPUs) as ProfilerStep#it, writes the trace
// to `path` and returns its breakdown.
analysis::StepBreakdown profiled_step(Trainer& trainer, int64_t it, const std::string& path) {
  Backend& b = trainer.backend();
  profiler::ProfilerOptions po;
  po.device = b.device();
  po.process_name = "tessera bench model";
  profiler::Profiler prof(po);
  b.synchronize();  // the step's window holds only its own GPU work
  b.set_op_observer(&prof);
  prof.start();
  prof.begin_annotation("ProfilerStep#" + std::to_string(it));
  trainer.run_iteration(it);  // ends reading the loss back: its GPU work is done
  prof.end_annotation();
  prof.stop();
  b.set_op_observer(nullptr);
  prof.write(path);
  return analysis::step_breakdown(path);
}

// "bf16", or "fp8 hybrid delayed +head no-cache fast-acc ..." so that one table compares
// FP8 variants.
std::string precision_text(const Experiment& e, DType compute) {
  std::string precision(dtype_name(compute));
  if (e.training.fp8 == Fp8Mode::Off) return precision;
  const std::string fast = fast_accumulation_kinds(fp8_options(e.training), "+");
  const bool default_accumulation = fast == fast_accumulation_kinds(Fp8Options{}, "+");
  return "fp8 " + find_key("fp8")->get(e) + " " + find_key("fp8_recipe")->get(e) +
         (e.training.fp8_lm_head ? " +head" : "") +
         (e.training.fp8_weight_transpose_cache ? "" : " no-cache") +
         (default_accumulation ? "" : " fast-acc " + fast);
}

// "grads bf16, master fp32, m/v bf16/bf16", the precision-aware optimizer's state.
std::string state_text(const Experiment& e) {
  const TrainingConfig& t = e.training;
  return fmt::format("grads {}, master {}, m/v {}/{}", dtype_name(t.main_grads_dtype),
                     dtype_name(t.main_params_dtype), dtype_name(t.exp_avg_dtype),
                     dtype_name(t.exp_avg_sq_dtype));
}

// `per`: "GPU", or "rank" on the CPU backend.
void print_proxy_table(const nlohmann::json& results, std::string_view per) {
  fmt::print(
      "| model | layers | precision | mbs | seq | window | step ms | tokens/s/{0} | "
      "TFLOP/s/{0} | MFU | peak GiB | timed step ms | gemm ms | attention ms | other ms |\n",
      per);
  fmt::print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  auto ms_or_dash = [](const nlohmann::json& r, const char* key) {
    return r.contains(key) ? fmt::format("{:.1f}", r[key].get<double>()) : std::string("-");
  };
  for (const auto& r : results)
    fmt::print(
        "| {} | {} | {} | {} | {} | {} | {:.1f} | {:.0f} | {:.3g} | {:.1f}% | {:.2f} | {} | {} | "
        "{} "
        "| {} |\n",
        r["model"].get<std::string>(), r["num_layers"].get<int64_t>(),
        r["precision"].get<std::string>(), r["micro_batch_size"].get<int64_t>(),
        r["seq_length"].get<int64_t>(), r["sliding_window"].get<int64_t>(),
        r["step_ms"].get<double>(), r["tokens_per_s_per_gpu"].get<double>(),
        r["tflops_per_gpu"].get<double>(), 100 * r["mfu_vs_gemm_ceiling"].get<double>(),
        r["peak_mem_gib"].get<double>(), ms_or_dash(r, "breakdown_step_ms"),
        ms_or_dash(r, "breakdown_ms_gemm"), ms_or_dash(r, "breakdown_ms_attention"),
        ms_or_dash(r, "breakdown_ms_other"));
  for (const auto& r : results)
    if (r.contains("real_tokens_per_s_per_gpu"))
      fmt::print("{}: packed sequences, {:.0f} real tokens/s/{} (packing efficiency {:.1f}%)\n",
                 r["model"].get<std::string>(), r["real_tokens_per_s_per_gpu"].get<double>(), per,
                 100 * r["packing_efficiency"].get<double>());
}

constexpr const char* kParts[] = {"gemm",      "attention",     "recompute", "casts",
                                  "optimizer", "communication", "other",     "idle"};

void print_full_table(const nlohmann::json& results) {
  fmt::print(
      "| model | layers | precision | state | global batch | step s | tokens/s/GPU | TFLOP/s/GPU | "
      "MFU | peak GiB | planned GiB | plan error |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : results)
    fmt::print(
        "| {} | {} | {} | {} | {} x {} | {:.2f} | {:.0f} | {:.1f} | {:.1f}% | {:.2f} | {:.2f} | "
        "{:+.2f}% |\n",
        r["model"].get<std::string>(), r["num_layers"].get<int64_t>(),
        r["precision"].get<std::string>(), r["state"].get<std::string>(),
        r["micro_batch_size"].get<int64_t>(), r["micro_batches"].get<int64_t>(),
        r["step_ms"].get<double>() / 1e3, r["tokens_per_s_per_gpu"].get<double>(),
        r["tflops_per_gpu"].get<double>(), 100 * r["mfu"].get<double>(),
        r["peak_mem_gib"].get<double>(), r["planned_mem_gib"].get<double>(),
        r["plan_error_pct"].get<double>());
  bool any = false;
  for (const auto& r : results) any = any || r.contains("breakdown");
  if (!any) return;
  fmt::print("\nTime of one profiled step, ms (% of it); the parts add up to the step:\n\n");
  fmt::print("| model | precision | step |");
  for (const char* p : kParts) fmt::print(" {} |", p);
  fmt::print("\n|---|---|---|");
  for (size_t i = 0; i < std::size(kParts); ++i) fmt::print("---|");
  fmt::print("\n");
  for (const auto& r : results) {
    if (!r.contains("breakdown")) continue;
    const auto& b = r["breakdown"];
    const double step = b["step_ms"].get<double>();
    fmt::print("| {} | {} | {:.0f} |", r["model"].get<std::string>(),
               r["precision"].get<std::string>(), step);
    for (const char* p : kParts) {
      const double ms = b["parts_ms"][p].get<double>();
      fmt::print(" {:.0f} ({:.1f}%) |", ms, 100 * ms / step);
    }
    fmt::print("\n");
  }
}

}  // namespace

int model_bench_command(const std::vector<std::string>& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    fmt::print(
        "usage: tessera bench model [--models a,b,...] [--iters N] [--warmup N] [-o DIR] "
        "[--no_breakdown]\n"
        "                           [--full [--micro_batches N]] [--key value ...]\n\n"
        "Trains each model's shipped `<model>-pretrain` experiment on mock data and reports median "
        "step\n"
        "time, tokens/s/GPU, TFLOP/s/GPU (Megatron FLOPs convention), MFU and peak memory.\n"
        "Proxy (default): --num_layers 4 --seq_length 8192 --micro_batch_size 1, global batch 1;\n"
        "MFU against the measured 8192^3 bf16 GEMM rate and the time split GEMM / attention / "
        "other.\n"
        "--full: every layer of the preset, the global batch by accumulation of --micro_batches\n"
        "micro-batches (default 16), Megatron's precision-aware optimizer with bf16 gradients and\n"
        "moments and no recompute where the plan fits the device, else selective (keys given\n"
        "here win); MFU against the GPU's datasheet "
        "bf16\n"
        "peak (configs/gpus.yaml), the memory planner's prediction beside the measured peak, and "
        "one\n"
        "more step profiled (CUPTI) and broken down into GEMM, attention, recompute, casts, "
        "optimizer,\n"
        "communication, other and idle, which add up to it (its trace under -o DIR or the "
        "workspace).\n"
        "Defaults: --warmup 3 --iters 10, with --full --warmup 1 --iters 2.\n"
        "Other --key value pairs override every experiment (e.g. --sliding_window 4096; FP8:\n"
        "--fp8 hybrid, and --no_fp8_weight_transpose_cache for its peak memory without the "
        "cache).\n");
    return 0;
  }
  const Options o = parse(args);
  Logger log("", 0, false, false);
  nlohmann::json results = nlohmann::json::array();
  std::optional<GemmCeiling> ceiling_gemm;
  bool device_is_gpu = true;
  double ceiling = 0;
  std::string device;
  for (const std::string& model : o.models) {
    Experiment e = bench_experiment(o, model);
    auto backend = make_backend(e.training.device, 0, backend_options(e.training));
    if (!ceiling_gemm) {
      device = backend->description();
      device_is_gpu = backend->device().kind == DeviceKind::GPU;
      if (!device_is_gpu)
        fmt::print(
            "bench model on the CPU backend ({}): the fp32 reference kernels of this host, not a "
            "GPU's; a proxy step of a 7-8B model takes minutes here (--num_layers 1 "
            "--seq_length 512 makes it seconds)\n",
            device);
      ceiling_gemm = measure_gemm_ceiling(*backend);
      ceiling = ceiling_gemm->tflops;
    }
    // What the planner says this run needs, from the run set-up the trainer makes.
    const auto setup_of = [&](const Experiment& x) {
      return make_run_setup(x, {1, backend->default_compute_dtype()}, [&] {
        return make_tokenizer(x.data, x.model_config.vocab_size)->vocab_size();
      });
    };
    const auto plan_of = [&](const RunSetup& s) {
      return plan::plan_memory(plan::plan_input(s, backend->device().kind == DeviceKind::GPU));
    };
    RunSetup setup = setup_of(e);
    plan::MemoryPlan planned = plan_of(setup);
    // --full without a recompute key of the user's: selective where no recompute would not fit.
    const MemoryStats free = backend->memory_stats();
    if (o.full && !last_value(o.overrides, "recompute_granularity") && free.device_free_bytes > 0 &&
        planned.allocated() > free.device_free_bytes + free.allocated_bytes) {
      fmt::print("{}: without recompute the run needs {:.2f} GiB of the {:.2f} GiB free: selective recompute\n",
                 model, static_cast<double>(planned.allocated()) / (1 << 30),
                 static_cast<double>(free.device_free_bytes + free.allocated_bytes) / (1 << 30));
      e = bench_experiment(o, model, "selective");
      setup = setup_of(e);
      planned = plan_of(setup);
    }
    Trainer trainer(e, std::move(backend), log, nullptr);
    Backend& b = trainer.backend();
    for (int i = 1; i <= o.warmup; ++i) trainer.run_iteration(i);
    b.reset_peak_memory();
    std::vector<double> ms;
    double last_loss = 0;
    int64_t real_tokens = 0;  // of the timed steps: what is not padding of packed sequences
    for (int i = 1; i <= o.iters; ++i) {
      b.synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      const IterationStats stats = trainer.run_iteration(o.warmup + i);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      last_loss = stats.loss;
      real_tokens += stats.real_tokens;
    }
    const MemoryStats mem = b.memory_stats();
    const double step_ms = median(ms);
    const double tokens = static_cast<double>(trainer.positions_per_step());
    const double tok_s = tokens / (step_ms / 1e3);
    const double tflops = trainer.spec().flops_per_token(e.training.seq_length) * tok_s / 1e12;
    const int64_t last = o.warmup + o.iters + 1;
    nlohmann::json r = {{"model", model},
                        {"num_layers", e.model_config.num_layers},
                        {"precision", precision_text(e, trainer.model().params().dtype)},
                        {"micro_batch_size", e.training.micro_batch_size},
                        {"seq_length", e.training.seq_length},
                        {"sliding_window", e.model_config.sliding_window},
                        {"step_ms", step_ms},
                        {"tokens_per_s_per_gpu", tok_s},
                        {"tflops_per_gpu", tflops},
                        {"mfu_vs_gemm_ceiling", ceiling > 0 ? tflops / ceiling : 0.0},
                        {"gemm_ceiling_tflops", ceiling},
                        {"peak_mem_gib", mem.peak_bytes / kGiB},
                        {"loss", last_loss}};
    // Packed sequences (packing_strategy bfd) pad: their real tokens per second beside.
    const double real_share = real_tokens / (tokens * o.iters);
    if (real_share < 1) {
      r["real_tokens_per_s_per_gpu"] = tok_s * real_share;
      r["packing_efficiency"] = real_share;
    }
    if (o.full) {
      const auto spec = analysis::find_gpu_spec(device);
      r["mode"] = "full";
      r["state"] = state_text(e);
      r["recompute"] = find_key("recompute_granularity")->get(e);
      r["micro_batches"] = setup.accumulation_steps;
      r["global_batch_size"] = e.training.global_batch_size;
      r["mfu"] = spec && spec->bf16_tflops > 0 ? tflops / spec->bf16_tflops : 0.0;
      r["peak_tflops_bf16"] = spec ? spec->bf16_tflops : 0.0;
      r["planned_mem_gib"] = planned.allocated() / kGiB;
      r["plan_error_pct"] =
          100.0 * (static_cast<double>(planned.allocated()) - static_cast<double>(mem.peak_bytes)) /
          static_cast<double>(mem.peak_bytes);
      r["planned"] = {{"weights", planned.weights},
                      {"gradients", planned.gradients},
                      {"optimizer", planned.optimizer},
                      {"activations", planned.activations},
                      {"fp8", planned.fp8},
                      {"backend_buffers", planned.backend_buffers},
                      {"run_buffers", planned.run_buffers},
                      {"allocated", planned.allocated()}};
      r["measured_peak_bytes"] = mem.peak_bytes;
      r["device_used_gib"] = (mem.device_total_bytes - mem.device_free_bytes) / kGiB;
      if (o.breakdown) {
        const fs::path dir = o.output_dir.empty() ? fs::path(e.experiment_root()) / "traces"
                                                  : fs::path(o.output_dir) / "traces";
        fs::create_directories(dir);
        const std::string trace =
            (dir / (model + "-" + std::to_string(results.size()) + ".pt.trace.json.gz")).string();
        const analysis::StepBreakdown sb = profiled_step(trainer, last, trace);
        nlohmann::json parts;
        for (const analysis::StepPart& p : sb.parts) parts[p.name] = p.ns / 1e6;
        r["breakdown"] = {{"step_ms", sb.step_ns / 1e6},
                          {"parts_ms", parts},
                          {"kernels", sb.kernels},
                          {"trace", trace}};
      }
    } else if (o.breakdown) {
      // One more step with every op timed: its GEMMs and attention, and as "other" the rest of
      // that step (other ops, and the host time between them), so that the parts add up to the
      // step they come from. Timing each op slows that step down: its time is reported too.
      std::map<std::string, double> split, per_op;
      b.enable_op_timing(true);
      b.synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      trainer.run_iteration(last);
      b.synchronize();
      const double timed_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      for (const auto& [op, t] : b.op_times_ms()) split[family(op)] += t, per_op[op] += t;
      b.enable_op_timing(false);
      r["breakdown_step_ms"] = timed_ms;
      r["breakdown_ms_gemm"] = split["gemm"];
      r["breakdown_ms_attention"] = split["attention"];
      r["breakdown_ms_other"] = std::max(0.0, timed_ms - split["gemm"] - split["attention"]);
      if (!per_op.empty()) r["op_ms"] = per_op;
    }
    results.push_back(r);
    fmt::print("{}\n", r.dump());
  }
  fmt::print("\n{}\n{}\n\n", device, ceiling_gemm ? ceiling_gemm->text() : std::string());
  if (o.full) {
    print_full_table(results);
  } else {
    print_proxy_table(results, device_is_gpu ? "GPU" : "rank");
    if (o.breakdown)
      fmt::print(
          "\ngemm / attention / other: one more step with every op timed (timed step ms, slower "
          "than the median step by the timing); other is the rest of that step.\n");
  }
  if (!o.output_dir.empty()) {
    fs::create_directories(o.output_dir);
    std::ofstream out(fs::path(o.output_dir) /
                      (o.full ? "bench_model_full.json" : "bench_model.json"));
    out << results.dump(2) << "\n";
  }
  return 0;
}

}  // namespace tessera::bench
