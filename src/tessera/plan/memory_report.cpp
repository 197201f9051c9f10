#include "tessera/plan/memory_report.h"

#include <fmt/format.h>

#include <optional>
#include <vector>

#include "tessera/analysis/report_output.h"
#include "tessera/backend/backend_factory.h"
#include "tessera/config/keys.h"
#include "tessera/config/validate.h"
#include "tessera/core/error.h"
#include "tessera/data/tokenizer.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/param_layout.h"

namespace tessera::plan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double gib(size_t bytes) {
  return static_cast<double>(bytes) / kGiB;
}

std::string_view recompute_name(RecomputeGranularity r) {
  switch (r) {
    case RecomputeGranularity::None:
      return "none";
    case RecomputeGranularity::Full:
      return "full";
    case RecomputeGranularity::Selective:
      return "selective";
  }
  return "?";
}

// `ranks`: "GPUs", or "ranks" for thread ranks on the CPU.
std::string sharding_text(StateSharding s, int64_t n, std::string_view ranks) {
  switch (s) {
    case StateSharding::None:
      return n > 1 ? fmt::format("none (plain data parallel: every one of the {} holds everything)",
                                 ranks)
                   : "none";
    case StateSharding::Zero1:
      return fmt::format("zero1 (use_distributed_optimizer: optimizer state split across {})",
                         ranks);
    case StateSharding::Fsdp:
      return fmt::format(
          "fsdp (use_torch_fsdp2: weights, gradients and optimizer state split across {})", ranks);
  }
  return "?";
}

// A key's value as the configuration prints it: "hybrid", "delayed", "true".
std::string key_value(const Experiment& e, std::string_view key) {
  return find_key(key)->get(e);
}

std::string fp8_text(const Experiment& e, const ModelRuntime& rt, const MemoryPlan& p) {
  if (!rt.fp8.enabled()) return fmt::format("fp8: null ({} GEMMs)", dtype_name(rt.compute_dtype));
  return fmt::format(
      "fp8: {} ({} scaling), output head in {}, {}; FP8 buffers {:.2f} GiB", key_value(e, "fp8"),
      key_value(e, "fp8_recipe"), rt.fp8.lm_head ? "fp8" : "bf16",
      rt.fp8.weight_cache ? "FP8 weights and their transposes cached" : "one weight cast at a time",
      gib(p.fp8));
}

// "fp32 master weights, bf16/bf16 AdamW moments" (the precision-aware optimizer's dtypes).
std::string optimizer_state_text(const PlanInput& in) {
  const OptimizerDtypes& o = in.optimizer;
  const bool master_is_params =
      o.main_params != DType::F32 ||
      (in.runtime.compute_dtype == DType::F32 && in.sharding == StateSharding::None);
  return fmt::format("{} master weights, {}/{} AdamW moments",
                     o.main_params != DType::F32 ? "no (bf16 parameters updated in place)"
                     : master_is_params          ? "fp32 (the weights)"
                                                 : "fp32",
                     dtype_name(o.exp_avg), dtype_name(o.exp_avg_sq));
}

// "8.03B" / "52.4M"
std::string count_text(double n) {
  return n >= 1e9 ? fmt::format("{:.2f}B", n / 1e9) : fmt::format("{:.1f}M", n / 1e6);
}

analysis::Table breakdown_table(const PlanInput& in, const MemoryPlan& p, int64_t params) {
  const DType dt = in.runtime.compute_dtype;
  const bool fsdp = in.sharding == StateSharding::Fsdp;
  const int64_t n = std::max<int64_t>(1, in.data_parallel);
  const double shard = static_cast<double>((params + n - 1) / n);
  const std::string weight_params = count_text(fsdp ? shard : params);
  const std::string opt_params = count_text(static_cast<double>(p.optimizer_elements));
  const DType gt = in.runtime.grad_dtype;
  const ModelRuntime& rt = in.runtime;

  analysis::Table t;
  t.name = "memory_breakdown";
  t.title = in.gpu            ? "Memory per GPU"
            : in.num_gpus > 1 ? "Memory per rank on the host"
                              : "Memory on the host";
  t.note = fmt::format(
      "bytes from DecoderModel::plan_memory, FullyShardedDataParallel::plan_memory, "
      "AdamWOptimizer::state_bytes and the GPU platform's step_buffer_bytes (what the run "
      "allocates); allocated = what memory_stats() reports as peak; {}",
      in.gpu ? "total adds the CUDA context allowance."
             : "the CPU backend has no context or scratch buffers besides these.");
  t.columns = {{"component", true}, {"bytes"}, {"gib"}, {"detail"}};
  auto row = [&](const char* name, size_t bytes, std::string detail) {
    t.rows.push_back({std::string(name), static_cast<int64_t>(bytes), gib(bytes), detail});
  };
  row("weights", p.weights,
      fmt::format("{} params x {} B ({}){}", weight_params, dtype_size(dt), dtype_name(dt),
                  fsdp ? " + gathered-unit slots (current, prefetched)" : ""));
  row("gradients", p.gradients,
      fmt::format("{} params x {} B ({}){}", weight_params, dtype_size(gt), dtype_name(gt),
                  fsdp ? " + unit gradient slots (being written, being reduce-scattered)" : ""));
  row("optimizer", p.optimizer, fmt::format("{} params: {}", opt_params, optimizer_state_text(in)));
  row("activations", p.activations,
      fmt::format("micro batch {} x seq {} = {} tokens, recompute {}, logits chunk {} tokens",
                  rt.micro_batch, rt.seq_length, rt.micro_batch * rt.seq_length,
                  recompute_name(rt.recompute), rt.cross_entropy_chunk_tokens));
  if (rt.fp8.enabled())
    row("fp8", p.fp8,
        rt.fp8.weight_cache
            ? "FP8 copies of inputs and gradients, scaling state, cached FP8 weights + transposes"
            : "FP8 copies of inputs and gradients, scaling state, one weight cast at a time");
  if (in.gpu)
    row("backend_buffers", p.backend_buffers,
        "cuBLASLt workspace + the largest kernel scratch of a step (attention backward, norm "
        "and reduction partials) + AdamW chunk table");
  row("run_buffers", p.run_buffers,
      "the trainer's device scalars (and MoE layers' statistics and expert bias)");
  row("allocated", p.allocated(), "what memory_stats().peak_bytes reports");
  if (in.gpu)
    row("cuda_context", p.context, "CUDA context, kernels, driver reserve (fixed allowance)");
  row("total", p.total(), "");
  return t;
}

// Sets up and plans experiments for the query's devices, as make_run_setup sets up the
// trainer's run there.
class Planner {
 public:
  // On the CPU the ranks are threads of one process (tessera train --nproc_per_node N), so
  // each has 1/N of the host's memory.
  explicit Planner(const MemoryQuery& q)
      : devices_{static_cast<int>(q.num_gpus), q.host ? q.host->compute_dtype : DType::BF16},
        gpu_(!q.host),
        capacity_(q.host ? q.host->total_bytes / q.num_gpus : gpu_capacity_bytes(q.gpu)) {}

  // Per GPU, or per rank on the host.
  size_t capacity() const { return capacity_; }

  PlanInput input(const Experiment& e) {
    // The alternatives change no data key, so the tokenizer is loaded at most once.
    auto vocab = [&] {
      if (!vocab_) vocab_ = make_tokenizer(e.data)->vocab_size();
      return *vocab_;
    };
    // Pipeline stages hold different layers, the embedding or the head, and different numbers
    // of micro-batches: the plan is the stage that needs the most (its first rank).
    PlanInput worst = plan_input(make_run_setup(e, devices_, vocab), gpu_);
    const int64_t pp = e.training.pipeline_model_parallel_size;
    for (int64_t stage = 1; stage < pp; ++stage) {
      RunDevices d = devices_;
      d.rank = static_cast<int>(stage * devices_.world_size / pp);
      const PlanInput in = plan_input(make_run_setup(e, d, vocab), gpu_);
      if (plan_memory(in).total() > plan_memory(worst).total()) worst = in;
    }
    return worst;
  }

  // Validation, the run set-up's checks of what the devices decide (bf16 gradients and main
  // parameters need bf16 parameters on a GPU) and, on GPUs, what the build's GPU platform's
  // FP8 GEMMs need.
  bool accepted(const Experiment& e) {
    try {
      validate_experiment(e, devices_.world_size);
      if (const Platform* platform = gpu_ ? gpu_platform() : nullptr)
        check_fp8_gemm_multiple(e, platform->fp8_gemm_multiple(), platform->name());
      input(e);
      return true;
    } catch (const ConfigError&) {
      return false;
    }
  }

  // The largest micro batch that fits and that accepted() takes (global_batch_size a multiple
  // of micro batch x ranks; with fp8, tokens a multiple of the FP8 GEMMs' multiple): a
  // `--micro_batch_size` to paste. 0 if none.
  int64_t largest_valid_micro_batch(const Experiment& e, const PlanInput& in) {
    const int64_t per_rank = e.training.global_batch_size / devices_.world_size;
    for (int64_t mbs = largest_micro_batch(in, capacity_, per_rank); mbs >= 1; --mbs) {
      if (per_rank % mbs != 0) continue;
      Experiment x = e;
      x.training.micro_batch_size = mbs;
      if (accepted(x)) return mbs;
    }
    return 0;
  }

 private:
  RunDevices devices_;
  bool gpu_;
  size_t capacity_;
  std::optional<int64_t> vocab_;
};

// The experiment with some training keys changed through the key registry, as `--key value`
// on the command line changes them, and those `--key value` flags.
struct Alternative {
  Experiment experiment;
  std::string flags;
  int changed_keys = 0;

  void set(std::string_view key, const std::string& value) {
    const KeySpec* k = find_key(key);
    if (k->get(experiment) == value) return;
    if (const std::string expected = k->set(experiment, value); !expected.empty())
      throw InternalError(fmt::format("memory alternative: {} = {}: {}", key, value, expected));
    flags += fmt::format("{}--{} {}", flags.empty() ? "" : " ", key, value);
    ++changed_keys;
  }
};

struct PrecisionChoice {
  DType dtype;
  bool fp8;
};

Alternative make_alternative(const Experiment& e, const ModelRuntime& rt, PrecisionChoice p,
                             RecomputeGranularity rc, StateSharding sh, int64_t n) {
  Alternative a{e, "", 0};
  // Only where the dtype differs: precision auto is already bf16 on GPUs, fp32 on the CPU.
  if (p.dtype != rt.compute_dtype) a.set("precision", std::string(dtype_name(p.dtype)));
  if (!p.fp8) a.set("fp8", "null");
  if (p.fp8 && !rt.fp8.enabled()) a.set("fp8", "hybrid");
  a.set("recompute_granularity",
        rc == RecomputeGranularity::None ? "null" : std::string(recompute_name(rc)));
  a.set("recompute_num_layers", "0");
  if (n > 1) {
    a.set("use_distributed_optimizer", sh == StateSharding::Zero1 ? "true" : "false");
    a.set("use_torch_fsdp2", sh == StateSharding::Fsdp ? "true" : "false");
  }
  return a;
}

// "global_batch_size 256 on 8 GPUs"
std::string global_batch_text(int64_t global_batch, int64_t n, bool host) {
  if (host && n == 1) return fmt::format("global_batch_size {}", global_batch);
  return fmt::format("global_batch_size {} on {} {}{}", global_batch, n, host ? "rank" : "GPU",
                     n > 1 ? "s" : "");
}

std::string micro_batch_text(int64_t largest, int64_t valid, const std::string& global_batch) {
  if (largest == 0) return "not even micro batch 1 fits";
  if (valid == largest) return fmt::format("largest micro batch that fits: {}", largest);
  return fmt::format("largest micro batch that fits: {} ({} with {})", largest,
                     valid > 0 ? fmt::format("--micro_batch_size {}", valid)
                               : std::string("none the configuration accepts"),
                     global_batch);
}

}  // namespace

size_t gpu_capacity_bytes(const analysis::GpuSpec& gpu) {
  return static_cast<size_t>(gpu.hbm_gb * kGiB);
}

MemoryReport build_memory_report(const MemoryQuery& q) {
  const Experiment& e = q.experiment;
  Planner planner(q);
  const size_t capacity = planner.capacity();
  const PlanInput in = planner.input(e);
  const ModelRuntime& rt = in.runtime;
  const int64_t params = DecoderModel::plan_layout(in.spec, rt).total;  // one rank's part
  const int64_t n = q.num_gpus;
  const std::string batch = global_batch_text(e.training.global_batch_size, n, q.host.has_value());

  MemoryReport r;
  r.plan = plan_memory(in);
  r.sharding = in.sharding;
  r.fits = r.plan.total() <= capacity;
  r.largest_micro_batch = largest_micro_batch(in, capacity);
  r.largest_valid_micro_batch = planner.largest_valid_micro_batch(e, in);
  const std::string device =
      q.host ? fmt::format(
                   "device: cpu{}; this host's memory: {:.2f} GiB ({:.2f} GiB available now), as "
                   "the CPU backend reports it; no GPU",
                   n > 1 ? fmt::format(", {} ranks as threads of one process, sharding {}", n,
                                       sharding_text(in.sharding, n, "ranks"))
                         : std::string(),
                   gib(q.host->total_bytes), gib(q.host->available_bytes))
             : fmt::format("GPUs: {} x {} ({} GB HBM, configs/gpus.yaml), sharding {}", n,
                           q.gpu.name, q.gpu.hbm_gb, sharding_text(in.sharding, n, "GPUs"));
  r.summary = fmt::format(
      "model: {}\nrun: micro batch {}, seq {}, {} weights and activations, {} gradients, {}, "
      "recompute {}{}\n{}\n{}\n",
      in.spec.summary(), rt.micro_batch, rt.seq_length, dtype_name(rt.compute_dtype),
      dtype_name(rt.grad_dtype), optimizer_state_text(in), recompute_name(rt.recompute),
      rt.recompute == RecomputeGranularity::Full && rt.recompute_num_layers > 0
          ? fmt::format(" (first {} layers)", rt.recompute_num_layers)
          : "",
      fp8_text(e, rt, r.plan), device);
  r.breakdown = breakdown_table(in, r.plan, params);

  analysis::Table& s = r.scenarios;
  s.name = "memory_scenarios";
  s.title = !q.host ? fmt::format("Alternatives: GiB per GPU on {} x {}", n, q.gpu.name)
            : n > 1
                ? fmt::format("Alternatives: GiB per rank on this host (device cpu, {} ranks)", n)
                : std::string("Alternatives: GiB on this host (device cpu)");
  s.columns = {{"flags", true},        {"weights_gib"}, {"gradients_gib"}, {"optimizer_gib"},
               {"activations_gib"},    {"fp8_gib"},     {"total_gib"},     {"fits"},
               {"largest_micro_batch"}};
  std::vector<StateSharding> shardings = {StateSharding::None};
  if (n > 1) shardings = {StateSharding::None, StateSharding::Zero1, StateSharding::Fsdp};
  int rejected = 0;
  // For a configuration that does not fit, the verdict names the fitting alternative with the
  // fewest changed keys, then the most memory: the smallest departure (selective recompute
  // before full).
  struct Suggestion {
    std::string flags;
    int changed_keys;
    size_t total;
  };
  std::optional<Suggestion> suggestion;
  // One row per alternative the configuration accepts; a fitting one that changes some key
  // may become the suggestion.
  auto consider = [&](const Alternative& alt) {
    if (!planner.accepted(alt.experiment)) {
      ++rejected;
      return;
    }
    const PlanInput a = planner.input(alt.experiment);
    const MemoryPlan plan = plan_memory(a);
    const bool fits = plan.total() <= capacity;
    const int64_t mbs = planner.largest_valid_micro_batch(alt.experiment, a);
    s.rows.push_back(
        {alt.flags.empty() ? std::string("(as configured)") : alt.flags, gib(plan.weights),
         gib(plan.gradients), gib(plan.optimizer), gib(plan.activations), gib(plan.fp8),
         gib(plan.total()), std::string(fits ? "yes" : "no"),
         mbs > 0 ? fmt::format("--micro_batch_size {}", mbs) : std::string("none")});
    if (fits && alt.changed_keys > 0 &&
        (!suggestion || alt.changed_keys < suggestion->changed_keys ||
         (alt.changed_keys == suggestion->changed_keys && plan.total() > suggestion->total)))
      suggestion = Suggestion{alt.flags, alt.changed_keys, plan.total()};
  };
  for (PrecisionChoice p : {PrecisionChoice{DType::BF16, false}, PrecisionChoice{DType::BF16, true},
                            PrecisionChoice{DType::F32, false}}) {
    for (auto rc : {RecomputeGranularity::None, RecomputeGranularity::Selective,
                    RecomputeGranularity::Full}) {
      for (StateSharding sh : shardings) {
        consider(make_alternative(e, rt, p, rc, sh, n));
      }
    }
  }
  // Model-parallel meshes at the configured precision, with the configured and with full
  // recompute: tensor parallelism (with sequence parallelism) over up to the ranks of a node
  // and pipeline stages, the rest data parallel (ZeRO-1 where there are data-parallel ranks to
  // shard over).
  for (int64_t tp = 1; tp <= std::min<int64_t>(n, 8); tp *= 2) {
    for (int64_t pp = 1; tp * pp <= n; pp *= 2) {
      for (const bool full : {false, true}) {
        const TrainingConfig& t = e.training;
        if ((tp == t.tensor_model_parallel_size && pp == t.pipeline_model_parallel_size) ||
            n % (tp * pp * t.context_parallel_size) != 0 ||
            (full && t.recompute_granularity == RecomputeGranularity::Full))
          continue;
        Alternative alt{e, "", 0};
        if (full) alt.set("recompute_granularity", "full"), alt.set("recompute_num_layers", "0");
        alt.set("tensor_model_parallel_size", std::to_string(tp));
        alt.set("sequence_parallel", tp > 1 ? "true" : "false");
        alt.set("pipeline_model_parallel_size", std::to_string(pp));
        if (n / (tp * pp * t.context_parallel_size) > 1 && !t.use_torch_fsdp2)
          alt.set("use_distributed_optimizer", "true");
        consider(alt);
      }
    }
  }
  s.summary_rows = s.rows.size();
  s.note = fmt::format(
      "each row's flags, added to this command line or to tessera train's, select that run "
      "(full recompute covers every layer; meshes plan their fullest pipeline stage); fits: at "
      "the configured micro batch ({}); "
      "largest_micro_batch: the largest that fits and that {} allows.{}",
      rt.micro_batch, batch,
      rejected > 0
          ? fmt::format(" {} combinations the configuration rejects are left out.", rejected)
          : std::string());

  // "on H100: 66.96 GiB per GPU of 80 GiB", "in host memory: 2 ranks x 1.03 GiB = 2.06 GiB of
  // 24 GiB"
  const size_t used = q.host ? r.plan.total() * n : r.plan.total();
  const size_t available = q.host ? q.host->total_bytes : capacity;
  const std::string usage =
      !q.host ? fmt::format("on {}: {:.2f} GiB per GPU", q.gpu.name, gib(used))
      : n > 1 ? fmt::format("in host memory: {} ranks x {:.2f} GiB = {:.2f} GiB", n,
                            gib(r.plan.total()), gib(used))
              : fmt::format("in host memory: {:.2f} GiB", gib(used));
  r.verdict =
      fmt::format("{} {} of {:.0f} GiB ({:.0f}%); {}.", r.fits ? "FITS" : "DOES NOT FIT", usage,
                  gib(available), 100.0 * used / available,
                  micro_batch_text(r.largest_micro_batch, r.largest_valid_micro_batch, batch));
  if (!r.fits && suggestion)
    r.verdict += fmt::format(" Fits with {} ({:.2f} GiB); see the alternatives.", suggestion->flags,
                             gib(suggestion->total));
  return r;
}

std::string memory_report_markdown(const MemoryReport& r) {
  return r.summary + "\n" + analysis::markdown_table(r.breakdown) + "\n" + r.verdict + "\n\n" +
         analysis::markdown_table(r.scenarios);
}

}  // namespace tessera::plan
