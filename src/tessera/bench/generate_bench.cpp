#include "tessera/bench/generate_bench.h"

#include <algorithm>
#include <chrono>
#include <random>

#include <fmt/format.h>

#include "tessera/analysis/report_output.h"
#include "tessera/bench/command_args.h"
#include "tessera/bench/measure.h"
#include "tessera/config/config.h"
#include "tessera/core/error.h"
#include "tessera/data/tokenizer.h"
#include "tessera/model/continuations.h"
#include "tessera/model/generator.h"
#include "tessera/model/model_spec.h"
#include "tessera/obs/profiler/profiler.h"

namespace tessera::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string model = "llama3.1_8B";
  int64_t layers = 4, prompt = 256, new_tokens = 256;
  std::vector<int64_t> batches = {1, 64};
  bool eager = false;  // time the steps op by op too
  // The experiment's moe_layer_freq (a preset's list names every one of its layers: fewer
  // layers need their own, e.g. "1"); empty: the experiment's.
  std::string moe_layer_freq;
};

// B prompts of P ids drawn uniformly from the vocabulary, the same for every run.
std::vector<std::vector<int32_t>> random_prompts(int64_t batch, int64_t length, int64_t vocab) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(vocab - 1));
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(batch));
  for (auto& p : out) {
    p.resize(static_cast<size_t>(length));
    for (int32_t& t : p) t = id(rng);
  }
  return out;
}

// The preset's pretraining experiment (`<model>-pretrain`, as bench model reads it), or the
// default experiment with the model preset `<model>` (the tiny ones have no experiment).
Experiment generate_experiment(const Options& o) {
  LoadOptions lo;
  // One device: an MoE experiment's experts, spread over a node's GPUs, all on this one.
  lo.cli_overrides = {"--num_layers", std::to_string(o.layers), "--seq_length",
                      std::to_string(o.prompt + o.new_tokens), "--expert_model_parallel_size", "1"};
  if (!o.moe_layer_freq.empty())
    lo.cli_overrides.insert(lo.cli_overrides.end(), {"--moe_layer_freq", o.moe_layer_freq});
  lo.config_path = o.model + "-pretrain";
  try {
    return load_experiment(lo);
  } catch (const ConfigError& no_experiment) {
    lo.config_path.clear();
    lo.cli_overrides.insert(lo.cli_overrides.begin(), {"--model", o.model});
    try {
      return load_experiment(lo);
    } catch (const ConfigError&) {
      throw no_experiment;  // neither: the experiment's message lists the shipped ones
    }
  }
}

std::vector<std::vector<Continuation>> generate(Generator& gen, const std::vector<std::vector<int32_t>>& prompts,
                                                double temperature, int64_t new_tokens, uint64_t seed) {
  std::vector<PromptContinuations> asked;
  for (size_t i = 0; i < prompts.size(); ++i) asked.push_back({prompts[i], {static_cast<int32_t>(i)}});
  ContinuationRequest r;
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  r.max_new_tokens = new_tokens;
  r.vocab = gen.vocab_size();
  return continue_prompts(gen, asked, r);
}

std::vector<std::vector<int32_t>> ids_of(const std::vector<std::vector<Continuation>>& done) {
  std::vector<std::vector<int32_t>> out;
  for (const auto& group : done) out.push_back(group[0].ids);
  return out;
}

}  // namespace

int generate_bench_command(const std::vector<std::string>& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    fmt::print(
        "usage: tessera bench generate [--model llama3.1_8B] [--num_layers 4] [--moe_layer_freq "
        "F]\n"
        "                              [--batch 1,64] [--prompt 256] [--new 256] [--eager]\n"
        "                              [--device auto|cpu|cuda]\n"
        "                              [--warmup 1] [--iters 3] [--trace PREFIX] [-o DIR]\n\n"
        "Batched generation's tokens/s (batch x new tokens / time, the prompts' prefill included)\n"
        "on the continuation engine, with random weights of the preset (its experiment\n"
        "<model>-pretrain, or the model preset itself; its first --num_layers layers, with\n"
        "--moe_layer_freq where the preset lists its MoE layers one by one, e.g. 1: every layer\n"
        "MoE): --batch prompts of --prompt random ids, --new tokens each, sampled at\n"
        "temperature 1 with no end token, all in one batch of slots. On GPUs the decode steps are\n"
        "captured as CUDA graphs; --eager times them op by op as well. Each batch size is first\n"
        "checked: 8 greedy tokens (at most --new) with captured steps equal those op by op. "
        "--trace PREFIX\n"
        "profiles one more run of each batch size (op by op: profiled ops are not captured) into\n"
        "PREFIX_b<batch>.json, a Chrome trace for `tessera report`. -o DIR writes\n"
        "bench_generate.csv and .md.\n");
    return 0;
  }
  std::set<std::string> valued = kCommonOptions;
  for (const char* k : {"model", "num_layers", "moe_layer_freq", "batch", "prompt", "new", "trace"})
    valued.insert(k);
  const CommandArgs a(args, valued, {"eager"}, false);
  Options o;
  o.model = a.get("model", o.model);
  o.layers = a.get_int("num_layers", o.layers);
  o.moe_layer_freq = a.get("moe_layer_freq", o.moe_layer_freq);
  o.prompt = a.get_int("prompt", o.prompt);
  o.new_tokens = a.get_int("new", o.new_tokens);
  o.batches = a.get_int_list("batch", o.batches);
  o.eager = a.has("eager");
  ContextOptions co = context_options(a);
  if (!a.has("warmup")) co.warmup = 1;
  if (!a.has("iters")) co.iters = 3;
  BenchContext ctx = make_context(co);

  const Experiment e = generate_experiment(o);
  const ModelSpec spec = make_model_spec(e, make_tokenizer(e.data, e.model_config.vocab_size)->vocab_size());

  analysis::Table t;
  t.name = "bench_generate";
  t.title = fmt::format("Generation of {} ({} layers) on {}", o.model, o.layers, ctx.description);
  t.note = fmt::format(
      "{} new tokens after prompts of {} random ids, temperature 1, no end token; median of {} runs after {} "
      "warm-up; tokens/s = batch x new tokens / time, the prompts' prefill included.",
      o.new_tokens, o.prompt, ctx.iters, ctx.warmup);
  t.columns = {{"batch", true}, {"steps"}, {"median_s"}, {"gen_tok_s"}, {"ms_per_new_token"}, {"status"}};
  int failures = 0;
  for (const int64_t batch : o.batches) {
    Generator gen(*ctx.device, spec, ctx.dtype, o.prompt + o.new_tokens, batch);
    gen.init_random(7);
    const std::vector<std::vector<int32_t>> prompts = random_prompts(batch, o.prompt, spec.tokenizer_vocab);
    const int64_t checked = std::min<int64_t>(8, o.new_tokens);
    gen.set_eager(true);
    const auto by_op = ids_of(generate(gen, prompts, 0.0, checked, 0));
    gen.set_eager(false);
    const bool captures = gen.captures_steps();
    const auto captured = ids_of(generate(gen, prompts, 0.0, checked, 0));
    if (captures && by_op != captured) {
      ++failures;
      t.rows.push_back({batch, std::string("captured"), analysis::Cell{}, analysis::Cell{}, analysis::Cell{},
                        std::string("FAILED: greedy ids with captured steps differ from those op by op")});
      continue;
    }
    // Without capture (the CPU, a family whose decoding reads back): op by op only.
    for (const bool eager : o.eager && captures ? std::vector<bool>{false, true} : std::vector<bool>{!captures}) {
      gen.set_eager(eager);
      std::vector<double> seconds;
      for (int i = 0; i < ctx.warmup + ctx.iters; ++i) {
        ctx.device->synchronize();
        const auto t0 = Clock::now();
        generate(gen, prompts, 1.0, o.new_tokens, static_cast<uint64_t>(i));
        ctx.device->synchronize();
        if (i >= ctx.warmup) seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      std::sort(seconds.begin(), seconds.end());
      const double median = seconds[seconds.size() / 2];
      const double tok_s = static_cast<double>(batch * o.new_tokens) / median;
      t.rows.push_back({batch, std::string(eager ? "op by op" : "captured"), median, tok_s,
                        1e3 * median / static_cast<double>(o.new_tokens), std::string("ok")});
    }
    if (a.has("trace")) {
      const std::string path = fmt::format("{}_b{}.json", a.get("trace", ""), batch);
      profiler::ProfilerOptions po;
      po.device = ctx.device->device();
      po.process_name = "tessera bench generate";
      profiler::Profiler prof(po);
      ctx.device->synchronize();
      ctx.device->set_op_observer(&prof);
      prof.start();
      prof.begin_annotation("generate");
      generate(gen, prompts, 1.0, o.new_tokens, 0);
      ctx.device->synchronize();
      prof.end_annotation();
      prof.stop();
      ctx.device->set_op_observer(nullptr);
      prof.write(path);
      fmt::print("wrote {}: one run of batch {}, op by op\n", path, batch);
    }
  }
  std::string md = analysis::markdown_table(t);
  if (failures) md += fmt::format("\n{} batch sizes FAILED their check.\n", failures);
  analysis::print_and_write(a.get("output", ""), {t}, "bench_generate.md", md);
  return failures ? kExitRuntimeFailure : 0;
}

}  // namespace tessera::bench
