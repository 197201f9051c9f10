#include "tessera/plan/memory_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <set>
#include <vector>

#include "tessera/analysis/report_output.h"
#include "tessera/backend/backend_factory.h"
#include "tessera/config/keys.h"
#include "tessera/config/validate.h"
#include "tessera/core/error.h"
#include "tessera/data/tokenizer.h"
#include "tessera/model/decoder_model.h"
#include "tessera/model/lora_layout.h"
#include "tessera/model/param_layout.h"
#include "tessera/optim/adamw_optimizer.h"

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

// "full (block: the first 12 layers of each pipeline stage)", as the run's keys set it up.
std::string recompute_text(const ModelRuntime& rt) {
  if (rt.recompute != RecomputeGranularity::Full) return std::string(recompute_name(rt.recompute));
  const int64_t n = rt.recompute_num_layers;
  switch (rt.recompute_method) {
    case RecomputeMethod::Uniform:
      return fmt::format("full (uniform: groups of {} layer{}, each re-run from its input)", n,
                         n == 1 ? "" : "s");
    case RecomputeMethod::Block:
      return fmt::format("full (block: the first {} layer{} of each pipeline stage)", n,
                         n == 1 ? "" : "s");
    case RecomputeMethod::None:
      break;
  }
  return n > 0 ? fmt::format("full (the first {} layers of each pipeline stage)", n)
               : std::string("full (every layer)");
}

// `ranks`: "GPUs", or "ranks" for thread ranks on the CPU. Under expert parallelism the
// experts are split whatever the sharding of the rest.
std::string sharding_text(StateSharding s, int64_t n, std::string_view ranks, int ep) {
  const std::string experts =
      ep > 1 ? fmt::format(
                   "; experts split over {} expert-parallel {} "
                   "(expert_model_parallel_size: each holds 1/{} of every MoE layer's "
                   "experts, their gradients and optimizer state)",
                   ep, ranks, ep)
             : std::string();
  switch (s) {
    case StateSharding::None:
      return (n > 1 ? fmt::format("none (plain data parallel: every one of the {} holds{} the "
                                  "rest)",
                                  ranks, ep > 1 ? "" : " everything")
                    : std::string("none")) +
             experts;
    case StateSharding::Zero1:
      return fmt::format("zero1 (use_distributed_optimizer: optimizer state split across {})",
                         ranks) +
             experts;
    case StateSharding::Fsdp:
      return fmt::format(
                 "fsdp (use_torch_fsdp2: weights, gradients and optimizer state split across {})",
                 ranks) +
             experts;
  }
  return "?";
}

// How the MoE layers' expert activations are sized: the plan holds what the run allocates,
// which without token dropping or forced balance is the worst case of the routing.
std::string moe_rows_text(const ModelSpec& s, const ModelRuntime& rt) {
  if (!s.moe.enabled()) return "";
  const int ep = rt.expert_parallel_size;
  if (s.moe.capacity_factor > 0)
    return fmt::format("; expert rows at the capacity limit (moe_expert_capacity_factor {})",
                       s.moe.capacity_factor);
  if (rt.moe_force_balance)
    return "; expert rows at force-balanced routing's exact share (moe_force_balance)";
  if (ep > 1)
    return fmt::format(
        "; expert rows planned at the dropless worst case: every routed row of all {} "
        "expert-parallel ranks reaching one rank's experts ({}x the balanced share; "
        "--moe_expert_capacity_factor bounds it)",
        ep, ep);
  return "; expert rows planned at the dropless worst case (every routed row)";
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
  const bool split = AdamWOptimizer::splits_master(in.runtime.compute_dtype, o,
                                                   in.sharding != StateSharding::None);
  return fmt::format("{} master weights, {}/{} AdamW moments",
                     o.main_params != DType::F32 ? "no (bf16 parameters updated in place)"
                     : master_is_params          ? "fp32 (the weights)"
                     : split ? "fp32 (split: the bf16 weights and their 2-byte low halves)"
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
      "bytes from the size functions the run allocates with (the model's parameters and "
      "activations, the data-parallel shards, the optimizer state and the GPU backend's "
      "scratch); allocated = the run's peak memory (mem peak); {}",
      in.gpu ? "total adds the CUDA context allowance."
             : "the CPU backend has no context or scratch buffers besides these.");
  t.columns = {{"component", true}, {"bytes"}, {"gib"}, {"detail"}};
  auto row = [&](const char* name, size_t bytes, std::string detail) {
    t.rows.push_back({std::string(name), static_cast<int64_t>(bytes), gib(bytes), detail});
  };
  if (in.lora) {
    // The frozen base (sharded under FSDP) and the adapters, which alone have gradients.
    row("weights", p.weights,
        fmt::format("frozen base {} params x {} B ({}){} + the adapters", weight_params, dtype_size(dt),
                    dtype_name(dt), fsdp ? " + gathered-unit slots (current, prefetched)" : ""));
    const int64_t adapters = make_lora_layout(in.spec, DecoderModel::plan_layout(in.spec, rt), *in.lora).adapters.total;
    row("gradients", p.gradients,
        fmt::format("the adapters' {} params x {} B ({}) + one base unit's unread gradient scratch",
                    count_text(static_cast<double>(adapters)),
                    dtype_size(gt), dtype_name(gt)));
  } else {
    row("weights", p.weights,
        fmt::format("{} params x {} B ({}){}", weight_params, dtype_size(dt), dtype_name(dt),
                    fsdp ? " + gathered-unit slots (current, prefetched)" : ""));
    row("gradients", p.gradients,
        fmt::format("{} params x {} B ({}){}", weight_params, dtype_size(gt), dtype_name(gt),
                    fsdp ? " + unit gradient slots (being written, being reduce-scattered)" : ""));
  }
  row("optimizer", p.optimizer, fmt::format("{} params: {}", opt_params, optimizer_state_text(in)));
  row("activations", p.activations,
      fmt::format("micro batch {} x seq {} = {} tokens, recompute {}, logits chunk {} tokens{}{}",
                  rt.micro_batch, rt.seq_length, rt.micro_batch * rt.seq_length, recompute_text(rt),
                  rt.cross_entropy_chunk_tokens, moe_rows_text(in.spec, rt),
                  rt.pipeline_slots > 1
                      ? fmt::format("; stored activations of {} micro-batches at once ({})",
                                    rt.pipeline_slots,
                                    rt.pipeline_chunks.empty() ? "DPO's two answers"
                                                               : "the pipeline schedule's")
                      : std::string()));
  if (rt.fp8.enabled())
    row("fp8", p.fp8,
        rt.fp8.weight_cache
            ? "FP8 copies of inputs and gradients, scaling state, cached FP8 weights + transposes"
            : "FP8 copies of inputs and gradients, scaling state, one weight cast at a time");
  if (in.gpu)
    row("backend_buffers", p.backend_buffers,
        "cuBLASLt workspace + the largest kernel scratch of a step (attention backward, norm "
        "and reduction partials) + AdamW chunk table");
  if (p.reference > 0)
    row("reference", p.reference,
        "the frozen reference weights (DPO with dpo_precompute_ref_log_probs false, GRPO with grpo_beta, reference_load): "
        "the optimizer's shard of them, compute dtype; twice where the optimizer keeps no fp32 master "
        "copy (the policy's kept beside them)");
  if (p.generation > 0)
    row("generation", p.generation,
        in.link_completions > 0
            ? "GRPO split placement (grpo_generation_gpus): a training rank's reward exchange and its link to "
              "its generation rank (whose own memory the verdict gives)"
            : "GRPO's generator: the KV cache of the completions a rank decodes at once (grpo_max_num_seqs, "
              "by default all of its completions of a generation batch, x seq_length positions per layer), its "
              "states, logits and scratch, and the reward exchange");
  row("run_buffers", p.run_buffers,
      "the trainer's device scalars (and MoE layers' statistics and expert bias)");
  row("allocated", p.allocated(), "the run's peak memory (mem peak in its iteration line)");
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

  // GRPO's generation ranks (split placement) train nothing: the ranks that do.
  int training_ranks(const Experiment& e) const { return grpo_training_ranks(e.training, devices_.world_size); }

  PlanInput input(const Experiment& e) {
    // The alternatives change no data key, so the tokenizer is loaded at most once.
    auto vocab = [&] {
      if (!vocab_) vocab_ = make_tokenizer(e.data, e.model_config.vocab_size)->vocab_size();
      return *vocab_;
    };
    // The plan is a training rank's.
    RunDevices training = devices_;
    training.world_size = training_ranks(e);
    // Pipeline stages hold different layers, the embedding or the head, and different numbers
    // of micro-batches: the plan is the stage that needs the most (its first rank).
    PlanInput worst = plan_input(make_run_setup(e, training, vocab), gpu_);
    const int64_t pp = e.training.pipeline_model_parallel_size;
    for (int64_t stage = 1; stage < pp; ++stage) {
      RunDevices d = training;
      d.rank = static_cast<int>(stage * training.world_size / pp);
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
    const int64_t per_rank = e.training.global_batch_size / training_ranks(e);
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

// Whether a full recompute re-runs every layer (Primus's block method over all 80 layers is
// the same run as recompute_method null).
bool recomputes_every_layer(const TrainingConfig& t, int64_t layers) {
  if (t.recompute_granularity != RecomputeGranularity::Full) return false;
  switch (t.recompute_method) {
    case RecomputeMethod::None:
      return t.recompute_num_layers == 0 || t.recompute_num_layers >= layers;
    case RecomputeMethod::Block:
      return t.recompute_num_layers >= layers;
    case RecomputeMethod::Uniform:
      return true;
  }
  return false;
}

// Full recompute of every layer: the run's own keys where they already ask for it.
void recompute_every_layer(Alternative& a) {
  a.set("recompute_granularity", "full");
  if (recomputes_every_layer(a.experiment.training, a.experiment.model_config.num_layers)) return;
  a.set("recompute_method", "null");
  a.set("recompute_num_layers", "null");
}

Alternative make_alternative(const Experiment& e, const ModelRuntime& rt, PrecisionChoice p,
                             RecomputeGranularity rc, StateSharding sh, int64_t n) {
  Alternative a{e, "", 0};
  // Only where the dtype differs: precision auto is already bf16 on GPUs, fp32 on the CPU.
  if (p.dtype != rt.compute_dtype) a.set("precision", std::string(dtype_name(p.dtype)));
  if (!p.fp8) a.set("fp8", "null");
  if (p.fp8 && !rt.fp8.enabled()) a.set("fp8", "hybrid");
  if (rc == RecomputeGranularity::Full) {
    recompute_every_layer(a);
  } else {
    a.set("recompute_granularity", rc == RecomputeGranularity::None ? "null" : "selective");
    a.set("recompute_method", "null");
    a.set("recompute_num_layers", "null");
  }
  if (n > 1) {
    a.set("use_distributed_optimizer", sh == StateSharding::Zero1 ? "true" : "false");
    a.set("use_torch_fsdp2", sh == StateSharding::Fsdp ? "true" : "false");
  }
  return a;
}

// Megatron's precision-aware optimizer keeping gradients and AdamW moments in bf16 (12 bytes
// of state per parameter instead of 18), inside the distributed optimizer it needs.
void use_bf16_state(Alternative& a) {
  if (!a.experiment.training.use_torch_fsdp2) a.set("use_distributed_optimizer", "true");
  a.set("use_precision_aware_optimizer", "true");
  for (const char* key : {"main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"})
    a.set(key, "bf16");
}

// The expert-parallel sizes an MoE model can have on n ranks: powers of two dividing both
// its experts and n.
std::vector<int64_t> expert_parallel_sizes(const Experiment& e, int64_t n) {
  std::vector<int64_t> sizes;
  const int64_t experts = e.model_config.num_experts;
  for (int64_t ep = 2; experts > 0 && ep <= std::min(experts, n); ep *= 2)
    if (experts % ep == 0 && n % ep == 0) sizes.push_back(ep);
  return sizes;
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

// When nothing on the query's GPUs fits: the fewest GPUs (doubling, up to 64 times as many) on
// which the configuration fits with its state sharded over them (ZeRO-1 or FSDP; an MoE
// model's experts over as many expert-parallel ranks as divide them), as configured or with
// full recompute, the global batch raised to a multiple of the new data-parallel size.
std::string more_gpus_text(const MemoryQuery& q) {
  const Experiment& e = q.experiment;
  const TrainingConfig& t = e.training;
  const int64_t model_parallel =
      t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size;
  const size_t capacity = gpu_capacity_bytes(q.gpu);
  for (int64_t n = q.num_gpus * 2; n <= q.num_gpus * 64; n *= 2) {
    MemoryQuery more = q;
    more.num_gpus = n;
    Planner planner(more);
    const int64_t per_step = t.micro_batch_size * (n / model_parallel);
    const int64_t batch = (t.global_batch_size + per_step - 1) / per_step * per_step;
    std::vector<int64_t> eps = {t.expert_model_parallel_size};
    if (const auto sizes = expert_parallel_sizes(e, n / model_parallel); !sizes.empty())
      eps.push_back(sizes.back());
    for (const bool full : {false, true}) {
      for (const StateSharding sh : {StateSharding::Zero1, StateSharding::Fsdp}) {
        for (const int64_t ep : eps) {
          Alternative alt{e, "", 0};
          if (batch != t.global_batch_size) alt.set("global_batch_size", std::to_string(batch));
          if (full) recompute_every_layer(alt);
          alt.set("use_distributed_optimizer", sh == StateSharding::Zero1 ? "true" : "false");
          alt.set("use_torch_fsdp2", sh == StateSharding::Fsdp ? "true" : "false");
          alt.set("expert_model_parallel_size", std::to_string(ep));
          if (!planner.accepted(alt.experiment)) continue;
          const MemoryPlan plan = plan_memory(planner.input(alt.experiment));
          if (plan.total() > capacity) continue;
          return fmt::format("It fits on {} GPUs{} ({:.2f} GiB per GPU): --num_gpus {}{}{}.", n,
                             n % 8 == 0 ? fmt::format(", {} nodes of 8", n / 8) : std::string(),
                             gib(plan.total()), n, alt.flags.empty() ? "" : " ", alt.flags);
        }
      }
    }
  }
  return fmt::format("It fits on no alternative, nor on up to {} GPUs.", q.num_gpus * 64);
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
  const std::string batch =
      global_batch_text(e.training.global_batch_size, planner.training_ranks(e), q.host.has_value());

  MemoryReport r;
  r.plan = plan_memory(in);
  r.sharding = in.sharding;
  r.fits = r.plan.total() <= capacity;
  r.largest_micro_batch = largest_micro_batch(in, capacity);
  r.largest_valid_micro_batch = planner.largest_valid_micro_batch(e, in);
  const std::string device =
      q.host
          ? fmt::format(
                "device: cpu{}; this host's memory: {:.2f} GiB ({:.2f} GiB available now), as "
                "the CPU backend reports it; no GPU",
                n > 1 ? fmt::format(", {} ranks as threads of one process, sharding {}", n,
                                    sharding_text(in.sharding, n, "ranks", rt.expert_parallel_size))
                      : std::string(),
                gib(q.host->total_bytes), gib(q.host->available_bytes))
          : fmt::format("GPUs: {} x {} ({} GB HBM, configs/gpus.yaml), sharding {}", n, q.gpu.name,
                        q.gpu.hbm_gb,
                        sharding_text(in.sharding, n, "GPUs", rt.expert_parallel_size));
  r.summary = fmt::format(
      "model: {}\nrun: micro batch {}, seq {}, {} weights and activations, {} gradients, {}, "
      "recompute {}{}\n{}\n{}\n",
      in.spec.summary(), rt.micro_batch, rt.seq_length, dtype_name(rt.compute_dtype),
      dtype_name(rt.grad_dtype), optimizer_state_text(in), recompute_text(rt),
      moe_rows_text(in.spec, rt), fp8_text(e, rt, r.plan), device);
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
  std::set<std::string> considered;
  auto consider = [&](const Alternative& alt) {
    if (!considered.insert(alt.flags).second) return;  // reached along two axes
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
  consider(Alternative{e, "", 0});
  for (PrecisionChoice p : {PrecisionChoice{DType::BF16, false}, PrecisionChoice{DType::BF16, true},
                            PrecisionChoice{DType::F32, false}}) {
    for (auto rc : {RecomputeGranularity::None, RecomputeGranularity::Selective,
                    RecomputeGranularity::Full}) {
      for (StateSharding sh : shardings) {
        consider(make_alternative(e, rt, p, rc, sh, n));
      }
    }
  }
  const TrainingConfig& t = e.training;
  // What lowers the state of every parameter: the precision-aware optimizer's bf16 gradients
  // and moments, as configured and with full recompute.
  for (const bool full : {false, true}) {
    if (full && recomputes_every_layer(t, e.model_config.num_layers)) continue;
    Alternative alt{e, "", 0};
    if (full) recompute_every_layer(alt);
    use_bf16_state(alt);
    consider(alt);
  }
  // Mixtures of experts: their experts spread over more ranks (with ZeRO-1: expert parallelism
  // does not compose with FSDP), and Megatron's token dropping, which bounds each expert's rows
  // at its capacity instead of the dropless worst case.
  for (const int64_t ep : expert_parallel_sizes(e, n)) {
    for (const bool full : {false, true}) {
      if (ep == t.expert_model_parallel_size && !full) continue;
      if (full && recomputes_every_layer(t, e.model_config.num_layers)) continue;
      Alternative alt{e, "", 0};
      if (full) recompute_every_layer(alt);
      alt.set("expert_model_parallel_size", std::to_string(ep));
      alt.set("use_torch_fsdp2", "false");
      alt.set("use_distributed_optimizer", "true");
      consider(alt);
    }
  }
  if (e.model_config.num_experts > 0 && e.model_config.moe_expert_capacity_factor < 0 &&
      !t.moe_force_balance) {
    Alternative alt{e, "", 0};
    alt.set("moe_expert_capacity_factor", "1.0");
    consider(alt);
  }
  // Model-parallel meshes at the configured precision, with the configured and with full
  // recompute: tensor parallelism (with sequence parallelism) over up to the ranks of a node
  // and pipeline stages, the rest data parallel: FSDP where it is configured and composes
  // (no pipeline stages), else ZeRO-1 where there are data-parallel ranks to shard over.
  for (int64_t tp = 1; tp <= std::min<int64_t>(n, 8); tp *= 2) {
    for (int64_t pp = 1; tp * pp <= n; pp *= 2) {
      for (const bool full : {false, true}) {
        if ((tp == t.tensor_model_parallel_size && pp == t.pipeline_model_parallel_size) ||
            n % (tp * pp * t.context_parallel_size) != 0 ||
            (full && recomputes_every_layer(t, e.model_config.num_layers)))
          continue;
        Alternative alt{e, "", 0};
        if (full) recompute_every_layer(alt);
        alt.set("tensor_model_parallel_size", std::to_string(tp));
        alt.set("sequence_parallel", tp > 1 ? "true" : "false");
        alt.set("pipeline_model_parallel_size", std::to_string(pp));
        const bool fsdp = t.use_torch_fsdp2 && pp == 1;
        if (!fsdp) alt.set("use_torch_fsdp2", "false");
        if (!fsdp && n / (tp * pp * t.context_parallel_size) > 1)
          alt.set("use_distributed_optimizer", "true");
        consider(alt);
      }
    }
  }
  // The configuration first, then the alternatives from the least memory to the most.
  std::stable_sort(s.rows.begin(), s.rows.end(), [](const auto& a, const auto& b) {
    const bool a_configured = std::get<std::string>(a[0]) == "(as configured)";
    const bool b_configured = std::get<std::string>(b[0]) == "(as configured)";
    if (a_configured != b_configured) return a_configured;
    return std::get<double>(a[6]) < std::get<double>(b[6]);
  });
  s.summary_rows = s.rows.size();
  s.note = fmt::format(
      "each row's flags, added to this command line or to tessera train's, select that run "
      "(full recompute covers every layer; meshes plan their fullest pipeline stage); rows "
      "from the least memory per {} to the most; fits: at the configured micro batch ({}); "
      "largest_micro_batch: the largest that fits and that {} allows.{}",
      q.host ? "rank" : "GPU", rt.micro_batch, batch,
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
  if (!r.fits && !suggestion && !q.host) r.verdict += " " + more_gpus_text(q);
  if (e.training.objective == Objective::Grpo && e.training.grpo_generation_gpus > 0) {
    // The busiest generation rank serves the most training ranks.
    const int64_t generation = e.training.grpo_generation_gpus, training = planner.training_ranks(e);
    const GrpoGenerationShare share = grpo_generation_share(e, training, (training + generation - 1) / generation);
    const size_t bytes = grpo_generation_rank_bytes(in.spec, rt, share) + (q.host ? 0 : kContextBytes);
    r.verdict += fmt::format(
        " {} {:.2f} GiB: a copy of the weights, the generator ({} sequences of {} positions) and the "
        "link; {}.",
        generation == 1 ? "The generation rank (grpo_generation_gpus) holds"
                        : fmt::format("Each of the {} generation ranks (grpo_generation_gpus) holds at most", generation),
        gib(bytes), share.slots, rt.seq_length, bytes <= capacity ? "it fits" : "IT DOES NOT FIT");
  }
  return r;
}

std::string memory_report_markdown(const MemoryReport& r) {
  return r.summary + "\n" + analysis::markdown_table(r.breakdown) + "\n" + r.verdict + "\n\n" +
         analysis::markdown_table(r.scenarios);
}

}  // namespace tessera::plan
