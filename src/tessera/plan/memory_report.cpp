#include "tessera/plan/memory_report.h"

#include <fmt/format.h>

#include "tessera/analysis/report_output.h"
#include "tessera/data/tokenizer.h"
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

std::string sharding_text(StateSharding s, int64_t n) {
  switch (s) {
    case StateSharding::None:
      return n > 1 ? "none (plain data parallel: every GPU holds everything)" : "none";
    case StateSharding::Zero1:
      return "zero1 (optimizer state split across GPUs)";
    case StateSharding::Fsdp:
      return "fsdp (weights, gradients and optimizer state split across GPUs)";
  }
  return "?";
}

// "8.03B" / "52.4M"
std::string count_text(double n) {
  return n >= 1e9 ? fmt::format("{:.2f}B", n / 1e9) : fmt::format("{:.1f}M", n / 1e6);
}

analysis::Table breakdown_table(const PlanInput& in, const MemoryPlan& p, int64_t params) {
  const DType dt = in.runtime.compute_dtype;
  const bool fp32 = dt == DType::F32;
  const bool fsdp = in.sharding == StateSharding::Fsdp;
  const int64_t n = std::max<int64_t>(1, in.num_gpus);
  const double shard = static_cast<double>((params + n - 1) / n);
  const std::string weight_params = count_text(fsdp ? shard : params);
  const std::string opt_params = count_text(in.sharding == StateSharding::None ? params : shard);
  const ModelRuntime& rt = in.runtime;

  analysis::Table t;
  t.name = "memory_breakdown";
  t.title = "Memory per GPU";
  t.note =
      "bytes from DecoderModel::plan_memory, FullyShardedDataParallel::plan_memory and "
      "AdamWOptimizer::state_bytes (what the run "
      "allocates); allocated = what memory_stats() reports as peak; total adds the CUDA "
      "context allowance.";
  t.columns = {{"component", true}, {"bytes"}, {"gib"}, {"detail"}};
  auto row = [&](const char* name, size_t bytes, std::string detail) {
    t.rows.push_back({std::string(name), static_cast<int64_t>(bytes), gib(bytes), detail});
  };
  row("weights", p.weights,
      fmt::format("{} params x {} B ({}){}", weight_params, dtype_size(dt), dtype_name(dt),
                  fsdp ? " + gathered-unit slots (current, prefetched)" : ""));
  row("gradients", p.gradients,
      fmt::format("{} params x 4 B (fp32){}", weight_params,
                  fsdp ? " + unit gradient slots (being written, being reduce-scattered)" : ""));
  row("optimizer", p.optimizer,
      fmt::format("{} params x {} B ({})", opt_params, fp32 ? 8 : 12,
                  fp32 ? "AdamW moments; master weights are the fp32 weights"
                       : "fp32 master weights + AdamW moments"));
  row("activations", p.activations,
      fmt::format("micro batch {} x seq {} = {} tokens, recompute {}, logits chunk {} tokens",
                  rt.micro_batch, rt.seq_length, rt.micro_batch * rt.seq_length,
                  recompute_name(rt.recompute), rt.cross_entropy_chunk_tokens));
  if (rt.fp8.enabled())
    row("fp8", p.fp8,
        rt.fp8.weight_cache
            ? "FP8 copies of inputs and gradients, scaling state, cached FP8 weights + transposes"
            : "FP8 copies of inputs and gradients, scaling state, one weight cast at a time");
  row("backend_buffers", p.backend_buffers, "cuBLASLt workspace + kernel scratch (fixed)");
  row("allocated", p.allocated(), "what memory_stats().peak_bytes reports");
  row("cuda_context", p.context, "CUDA context, kernels, driver reserve (fixed allowance)");
  row("total", p.total(), "");
  return t;
}

}  // namespace

size_t gpu_capacity_bytes(const analysis::GpuSpec& gpu) {
  return static_cast<size_t>(gpu.hbm_gb * kGiB);
}

MemoryReport build_memory_report(const MemoryQuery& q) {
  const Experiment& e = q.experiment;
  const size_t capacity = gpu_capacity_bytes(q.gpu);
  RunSetup setup = make_run_setup(e, {static_cast<int>(q.num_gpus), DType::BF16},
                                  [&] { return make_tokenizer(e.data)->vocab_size(); });
  setup.sharding = q.sharding;
  setup.runtime.sharded_params = q.sharding == StateSharding::Fsdp;
  const PlanInput in = plan_input(setup, /*gpu=*/true);
  const int64_t params = make_param_layout(in.spec).total;

  MemoryReport r;
  r.plan = plan_memory(in);
  r.fits = r.plan.total() <= capacity;
  r.largest_micro_batch = largest_micro_batch(in, capacity);
  r.summary = fmt::format(
      "model: {}\nrun: micro batch {}, seq {}, {} weights and activations, fp32 gradients and "
      "AdamW state, recompute {}{}\nGPUs: {} x {} ({} GB HBM, configs/gpus.yaml), sharding {}\n",
      in.spec.summary(), in.runtime.micro_batch, in.runtime.seq_length,
      dtype_name(in.runtime.compute_dtype), recompute_name(in.runtime.recompute),
      in.runtime.recompute == RecomputeGranularity::Full && in.runtime.recompute_num_layers > 0
          ? fmt::format(" (first {} layers)", in.runtime.recompute_num_layers)
          : "",
      q.num_gpus, q.gpu.name, q.gpu.hbm_gb, sharding_text(q.sharding, q.num_gpus));
  r.breakdown = breakdown_table(in, r.plan, params);

  const std::string mbs =
      r.largest_micro_batch > 0
          ? fmt::format("largest micro batch that fits: {}", r.largest_micro_batch)
          : std::string("not even micro batch 1 fits");
  r.verdict = fmt::format("{} on {}: {:.2f} GiB per GPU of {:.0f} GiB ({:.0f}%); {}.",
                          r.fits ? "FITS" : "DOES NOT FIT", q.gpu.name, gib(r.plan.total()),
                          gib(capacity), 100.0 * r.plan.total() / capacity, mbs);

  analysis::Table& s = r.scenarios;
  s.name = "memory_scenarios";
  s.title = fmt::format("Alternatives: GiB per GPU on {} x {}", q.num_gpus, q.gpu.name);
  s.note = fmt::format(
      "the configuration with these settings changed; fits: at the configured micro batch ({}); "
      "max_micro_batch: the largest that fits (ignoring global_batch_size divisibility); full "
      "recompute covers every layer.",
      in.runtime.micro_batch);
  s.columns = {{"precision", true}, {"recompute", true}, {"sharding", true},
               {"weights_gib"},     {"gradients_gib"},   {"optimizer_gib"},
               {"activations_gib"}, {"total_gib"},       {"fits"},
               {"max_micro_batch"}};
  std::vector<StateSharding> shardings = {StateSharding::None};
  if (q.num_gpus > 1) shardings = {StateSharding::None, StateSharding::Zero1, StateSharding::Fsdp};
  for (DType dt : {DType::BF16, DType::F32}) {
    for (auto rc : {RecomputeGranularity::None, RecomputeGranularity::Selective,
                    RecomputeGranularity::Full}) {
      for (StateSharding sh : shardings) {
        PlanInput alt = in;
        alt.runtime.compute_dtype = dt;
        alt.runtime.recompute = rc;
        alt.runtime.recompute_num_layers = 0;
        alt.sharding = sh;
        const MemoryPlan p = plan_memory(alt);
        s.rows.push_back({std::string(dtype_name(dt)), std::string(recompute_name(rc)),
                          std::string(sharding_name(sh)), gib(p.weights), gib(p.gradients),
                          gib(p.optimizer), gib(p.activations), gib(p.total()),
                          std::string(p.total() <= capacity ? "yes" : "no"),
                          largest_micro_batch(alt, capacity)});
      }
    }
  }
  return r;
}

std::string memory_report_markdown(const MemoryReport& r) {
  return r.summary + "\n" + analysis::markdown_table(r.breakdown) + "\n" + r.verdict + "\n\n" +
         analysis::markdown_table(r.scenarios);
}

}  // namespace tessera::plan
