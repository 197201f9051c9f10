#include "tessera/model/decoder_model.h"

#include <algorithm>
#include <functional>

#include <fmt/format.h>

#include "tessera/core/error.h"
#include "tessera/core/fp8.h"
#include "tessera/model/rope.h"

namespace tessera {
namespace {

void check_unit_binding(const Tensor& t, DType dtype, const ParamRange& unit, int index,
                        const char* what) {
  TS_CHECK(t.dtype == dtype && t.numel() >= unit.count(),
           "unit {} {}: {} elements of {} bound, needs {} of {}", index, what, t.numel(),
           dtype_name(t.dtype), unit.count(), dtype_name(dtype));
}

// The weights that run as FP8 GEMMs, as (parameter index, shape), in model order.
std::vector<std::pair<int, Fp8LinearShape>> fp8_linears(
    const ParamLayout& layout, const std::vector<std::unique_ptr<DecoderLayer>>& layers,
    const ModelRuntime& rt) {
  std::vector<std::pair<int, Fp8LinearShape>> out;
  if (!rt.fp8.enabled()) return out;
  auto add = [&](int index) {
    const ParamInfo& p = layout.params[index];
    out.push_back({index, {p.name, p.shape[0], p.shape[1]}});
  };
  for (const auto& layer : layers) {
    for (int index : layer->linear_weights()) add(index);
    // Blockwise scaling keeps the experts in bf16 (their grouped GEMMs take tensor scales).
    if (rt.fp8.recipe == Fp8Recipe::Blockwise) continue;
    for (auto [index, shape] : layer->expert_linears(rt)) {
      shape.name = layout.params[index].name;
      out.push_back({index, shape});
    }
  }
  if (rt.fp8.lm_head && layout.lm_head >= 0) add(layout.lm_head);
  return out;
}

// runtime.fp8_unit_copies: per unit, the parameters its passes read from the model's copies
// once its FP8 weights are cached, each with its place among the copies (64-element aligned, as
// the kernels' vector loads want); empty for a unit without them: one holding the embedding, no
// FP8 weight, or a matrix that is not one (a router, an expert stack).
struct UnitCopies {
  std::vector<std::vector<std::pair<int, int64_t>>> units;
  int64_t elements = 0;
};

UnitCopies unit_copies(const ParamLayout& layout,
                       const std::vector<std::pair<int, Fp8LinearShape>>& linears,
                       const ModelRuntime& rt) {
  UnitCopies c;
  c.units.resize(layout.units.size());
  if (!rt.fp8_unit_copies || !rt.sharded_params || !rt.fp8.enabled() || !rt.fp8.weight_cache)
    return c;
  std::vector<char> fp8(layout.params.size(), 0), has_fp8(layout.units.size(), 0),
      excluded(layout.units.size(), 0);
  for (const auto& [index, shape] : linears) fp8[index] = shape.expert_stack() ? 2 : 1;
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const ParamInfo& p = layout.params[i];
    if (fp8[i] == 1)
      has_fp8[p.unit] = 1;
    else if (fp8[i] == 2 || p.shape.rank() > 1)
      excluded[p.unit] = 1;
  }
  if (layout.embedding >= 0) excluded[layout.params[layout.embedding].unit] = 1;
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const ParamInfo& p = layout.params[i];
    if (fp8[i] || !has_fp8[p.unit] || excluded[p.unit]) continue;
    c.units[p.unit].push_back({static_cast<int>(i), c.elements});
    c.elements += (p.numel() + 63) / 64 * 64;
  }
  return c;
}

std::vector<Fp8LinearShape> shapes_of(const std::vector<std::pair<int, Fp8LinearShape>>& linears) {
  std::vector<Fp8LinearShape> shapes;
  for (const auto& l : linears) shapes.push_back(l.second);
  return shapes;
}

// The runs of layers a rank's model holds: its pipeline chunks, or every layer.
std::vector<LayerRange> model_chunks(const ModelSpec& spec, const ModelRuntime& rt) {
  if (rt.pipeline_chunks.empty()) return {{0, spec.num_layers}};
  return rt.pipeline_chunks;
}

// The parts of the split parameters a rank holds. Expert runs align to the buffer's own
// multiple: the data-parallel shards of both kinds of runs are then whole granules.
ParamSplit param_split(const ModelRuntime& rt) {
  ParamSplit s;
  s.tensor_parallel = {rt.tensor_parallel_size, rt.tensor_parallel_rank};
  s.expert_parallel = {rt.expert_parallel_size, rt.expert_parallel_rank};
  if (rt.expert_parallel_size > 1)
    s.expert_run_multiple = std::max<int64_t>(rt.flat_buffer_multiple, 64);
  return s;
}

DecoderParts parts_held(const ModelSpec& spec, const ModelRuntime& rt) {
  const std::vector<LayerRange> chunks = model_chunks(spec, rt);
  return {chunks.front().first == 0, chunks.back().end() == spec.num_layers};
}

std::vector<std::unique_ptr<DecoderLayer>> chunk_layers(const ModelSpec& spec,
                                                        const ModelRuntime& rt) {
  std::vector<std::unique_ptr<DecoderLayer>> layers;
  for (const LayerRange& c : model_chunks(spec, rt))
    for (int64_t l = c.first; l < c.end(); ++l) layers.push_back(make_decoder_layer(spec, l));
  return layers;
}

}  // namespace

// s: what this rank computes (tensor_parallel_shard), whose vocabulary is its rows of the head.
// What each pass of one micro-batch reads from earlier passes is stored (once per slot); what
// lives within one pass is shared.
void DecoderModel::declare_activations(const ModelSpec& s, const ModelRuntime& rt,
                                       const std::vector<std::unique_ptr<DecoderLayer>>& layers,
                                       Activations& a, ActivationPlan& plan) {
  const int64_t N = rt.tokens(), Ns = rt.sequence_tokens(), C = s.hidden;
  const int64_t chunk = std::min(N, rt.cross_entropy_chunk_tokens);
  const DType dt = rt.compute_dtype;
  const std::vector<LayerRange> chunks = model_chunks(s, rt);
  a.resid.assign(chunks.size(), {});
  // Each chunk's residual states are stored, but for the inner ones of a uniform recompute
  // group, which the group's recompute pass writes again.
  size_t begin = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    std::vector<Tensor>& resid = a.resid[c];
    resid.assign(chunks[c].count + 1, Tensor{});
    for (int64_t i = 0; i <= chunks[c].count; ++i)
      if (i == chunks[c].count || rt.recompute_role(i, chunks[c].count).group_start)
        plan.add(&resid[i], dt, {Ns, C});
    for (int64_t i = 0; i < chunks[c].count; ++i) {
      const RecomputeRole role = rt.recompute_role(i, chunks[c].count);
      layers[begin + i]->declare_activations(plan, s, rt, role,
                                             role.group_start ? nullptr : &resid[i]);
    }
    begin += static_cast<size_t>(chunks[c].count);
  }
  for (const auto& layer : layers) layer->declare_backward_scratch(plan, rt);
  plan.add(&a.final_norm, dt, {Ns, C}, Keep::Shared);
  plan.add(&a.final_rstd, DType::F32, {Ns}, Keep::Shared);
  plan.add(&a.logits, dt, {chunk, s.vocab_size}, Keep::Shared);
  plan.add(&a.losses, DType::F32, {N}, Keep::Shared);
  plan.add(&a.chunk_logps, DType::F32, {chunk}, Keep::Shared);
  plan.add(&a.chunk_lse, DType::F32, {chunk}, Keep::Shared);
  if (rt.keep_logit_grads) plan.add(&a.logit_grads, dt, {N, s.vocab_size});
  plan.add(&a.loss_sum, DType::F32, {1}, Keep::Shared);
  a.dresid.assign(chunks.size(), Tensor{});
  for (Tensor& d : a.dresid) plan.add(&d, dt, {Ns, C});
  plan.add(&a.dnorm, dt, {Ns, C}, Keep::Shared);
  plan.add(&a.tokens, DType::I32, {N});
  plan.add(&a.targets, DType::I32, {N});
  if (rt.head_on_loss_rows) {
    plan.add(&a.loss_rows, DType::I32, {N});
    plan.add(&a.loss_targets, DType::I32, {N});
    plan.add(&a.head_in, dt, {chunk, C}, Keep::Shared);
    plan.add(&a.head_din, dt, {chunk, C}, Keep::Shared);
    plan.add(&a.row_values, DType::F32, {chunk}, Keep::Shared);
  }
  a.rope.tables.clear();
  for (double base : rope_bases(layers)) a.rope.tables.push_back({base, Tensor{}});
  // A row per position, or with reset_position_ids a row per token: the micro-batch's, kept
  // per slot like its tokens (pipeline stages hold several micro-batches at once).
  for (auto& [base, table] : a.rope.tables) {
    if (rt.reset_position_ids) plan.add(&table, DType::F32, {N, s.head_dim});
    else plan.add(&table, DType::F32, {rt.seq_length, s.head_dim}, Keep::Shared);
  }
  // The document starts by position over whole sequences: under context parallelism every
  // rank's tokens' (the gathered attention's keys).
  if (rt.reset_attention_mask)
    plan.add(&a.document_starts, DType::I32,
             {std::max(N * rt.context_parallel_size, rt.attention_batch() * rt.attention_seq())});
  if (rt.shared_prompt_side > 0) {
    SharedPromptBuffers& b = a.shared_prompt;
    const int64_t expanded = rt.attention_batch() * rt.attention_seq();
    plan.add(&b.source, DType::I32, {expanded});
    for (Tensor* rows : {&b.home_model, &b.home_attention}) plan.add(rows, DType::I32, {N});
    for (Tensor* t : {&b.qkv, &b.dqkv}) plan.add(t, dt, {expanded, s.qkv_width()}, Keep::Shared);
    for (Tensor* t : {&b.out, &b.dout}) plan.add(t, dt, {expanded, s.attn_width()}, Keep::Shared);
  }
  if (s.logit_softcap > 0) plan.add(&a.capped, dt, {chunk, s.vocab_size}, Keep::Shared);
  if (rt.tensor_parallel_size > 1) {
    plan.add(&a.ce_stats, DType::F32, {chunk, 2}, Keep::Shared);
    plan.add(&a.ce_all_stats, DType::F32, {rt.tensor_parallel_size, chunk, 2}, Keep::Shared);
  }
  if (rt.sequence_parallel) {
    plan.add(&a.gathered, dt, {N, C}, Keep::Shared);
    plan.add(&a.partial, dt, {N, C}, Keep::Shared);
  }
  if (rt.context_parallel_size > 1) {
    const int64_t cp = rt.context_parallel_size;
    plan.add(&a.cp_kv, dt, {N, s.kv_width()}, Keep::Shared);
    plan.add(&a.cp_kv_all, dt, {cp * N, s.kv_width()}, Keep::Shared);
    plan.add(&a.cp_dkv_all, dt, {cp * N, s.kv_width()}, Keep::Shared);
    plan.add(&a.cp_positions, DType::I32, {cp, rt.seq_length}, Keep::Shared);
  }
}

ParamLayout DecoderModel::plan_layout(const ModelSpec& whole, const ModelRuntime& rt) {
  const ModelSpec spec = tensor_parallel_shard(whole, rt.tensor_parallel_size);
  return decoder_param_layout(spec, chunk_layers(spec, rt), param_split(rt), parts_held(spec, rt));
}

ModelMemory DecoderModel::plan_memory(const ModelSpec& whole, const ModelRuntime& rt) {
  const ModelSpec spec = tensor_parallel_shard(whole, rt.tensor_parallel_size);
  const auto layers = chunk_layers(spec, rt);
  const ParamLayout layout =
      decoder_param_layout(spec, layers, param_split(rt), parts_held(spec, rt));
  ModelMemory m;
  const int64_t multiple = std::max<int64_t>(rt.flat_buffer_multiple, 1);
  const auto padded = static_cast<size_t>((layout.total + multiple - 1) / multiple * multiple);
  if (!rt.sharded_params) {
    m.weights = padded * dtype_size(rt.compute_dtype);
    m.gradients = padded * dtype_size(rt.grad_dtype);
  }
  ActivationPlan plan(rt.recompute == RecomputeGranularity::Selective, rt.pipeline_slots);
  Activations acts;
  declare_activations(spec, rt, layers, acts, plan);
  m.activations = plan.bytes();
  int64_t stats_rows = 0, stats_width = 0, state = 0;  // as bind_stats and bind_state allocate
  for (const auto& layer : layers) {
    if (layer->stats_width() > 0) ++stats_rows, stats_width = layer->stats_width();
    for (const auto& [name, width] : layer->state_layout()) state += width;
  }
  m.block_state = static_cast<size_t>(stats_rows * stats_width + state) * sizeof(float);
  if (rt.fp8.enabled()) {
    const auto linears = fp8_linears(layout, layers, rt);
    m.fp8 = Fp8Linears::plan_bytes(rt.fp8, shapes_of(linears), rt.tokens()) +
            static_cast<size_t>(unit_copies(layout, linears, rt).elements) * dtype_size(rt.compute_dtype);
    m.fp8_expert_stacks = std::ranges::any_of(
        linears, [](const auto& linear) { return linear.second.expert_stack(); });
  }
  return m;
}

DecoderModel::DecoderModel(Backend& backend, const ModelSpec& spec, const ModelRuntime& runtime)
    : backend_(backend),
      spec_(spec),
      runtime_(runtime),
      local_spec_(tensor_parallel_shard(spec, runtime.tensor_parallel_size)),
      chunks_(model_chunks(spec, runtime)),
      parts_(parts_held(spec, runtime)),
      layers_(chunk_layers(local_spec_, runtime)),
      layout_(decoder_param_layout(local_spec_, layers_, param_split(runtime), parts_)),
      gemms_(
          backend, [this](int i) { return param(i); }, [this](int i) { return grad(i); },
          layout_.params.size()) {
  int64_t held = 0;
  size_t begin = 0;
  for (const LayerRange& c : chunks_) {
    TS_CHECK(c.count >= 1 && c.first >= held && c.end() <= spec_.num_layers,
             "pipeline chunks: layers [{}, {}) after layer {} of {}", c.first, c.end(), held,
             spec_.num_layers);
    chunk_begin_.push_back(begin);
    begin += static_cast<size_t>(c.count);
    held = c.end();
  }
  TS_CHECK(runtime_.tensor_parallel_rank >= 0 &&
               runtime_.tensor_parallel_rank < runtime_.tensor_parallel_size,
           "tensor-parallel rank {} of {}", runtime_.tensor_parallel_rank,
           runtime_.tensor_parallel_size);
  TS_CHECK(!runtime_.sequence_parallel || runtime_.tokens() % runtime_.tensor_parallel_size == 0,
           "sequence parallelism: {} tokens do not split over {} ranks", runtime_.tokens(),
           runtime_.tensor_parallel_size);
  TS_CHECK(runtime_.expert_parallel_rank >= 0 &&
               runtime_.expert_parallel_rank < runtime_.expert_parallel_size,
           "expert-parallel rank {} of {}", runtime_.expert_parallel_rank,
           runtime_.expert_parallel_size);
  if (runtime_.tensor_parallel_size > 1 || runtime_.expert_parallel_size > 1 ||
      !runtime_.pipeline_chunks.empty())
    set_full_offsets(layout_, make_param_layout(spec_));
  const ModelMemory mem = plan_memory(spec, runtime);
  unit_params_.resize(layout_.units.size());
  unit_grads_.resize(layout_.units.size());
  if (!runtime_.sharded_params) {
    param_buffer_ = DeviceBuffer(backend_, mem.weights, "parameters");
    grad_buffer_ = DeviceBuffer(backend_, mem.gradients, "gradients");
    params_ = param_buffer_.tensor(runtime_.compute_dtype, {layout_.total});
    grads_ = grad_buffer_.tensor(runtime_.grad_dtype, {layout_.total});
    for (size_t u = 0; u < layout_.units.size(); ++u) {
      const ParamRange& r = layout_.units[u];
      unit_params_[u] = params_.flat_range(r.begin, r.count());
      unit_grads_[u] = grads_.flat_range(r.begin, r.count());
    }
    backend_.fill(params_, 0.0f);
    backend_.fill(grads_, 0.0f);  // alignment gaps between tensors stay zero from here on
  }

  plan_ = std::make_unique<ActivationPlan>(runtime_.recompute == RecomputeGranularity::Selective,
                                           runtime_.pipeline_slots);
  declare_activations(local_spec_, runtime_, layers_, a_, *plan_);
  TS_CHECK(plan_->bytes() == mem.activations, "activation plan {} bytes, planned {}",
           plan_->bytes(), mem.activations);
  act_buffer_ = DeviceBuffer(backend_, plan_->bytes(), "activations");
  plan_->bind(act_buffer_);
  loss_row_count_.assign(static_cast<size_t>(runtime_.pipeline_slots), -1);
  sequence_rows_.assign(static_cast<size_t>(runtime_.pipeline_slots), {});
  sequence_head_rows_.assign(static_cast<size_t>(runtime_.pipeline_slots), {});
  shared_prompt_layouts_.assign(static_cast<size_t>(runtime_.pipeline_slots), {});
  if (runtime_.shared_prompt_side > 0) {
    // Attention's expanded sides are whole sequences of the model's rows: every rank must
    // hold the whole of them, and the expansion reads q, k and v of one layout.
    TS_CHECK(runtime_.context_parallel_size == 1 && runtime_.reset_position_ids && !spec_.mla.enabled,
             "shared prompts (sides of {} in rows of {}) need reset_position_ids, one "
             "context-parallel rank and grouped-query attention",
             runtime_.shared_prompt_side, runtime_.seq_length);
  }
  document_positions_.assign(static_cast<size_t>(runtime_.pipeline_slots), {});
  document_pairs_.assign(static_cast<size_t>(runtime_.pipeline_slots), {});

  const int cp = runtime_.context_parallel_size;
  TS_CHECK(cp >= 1 && runtime_.context_parallel_rank >= 0 && runtime_.context_parallel_rank < cp &&
               (cp == 1 || runtime_.seq_length % 2 == 0),
           "context-parallel rank {} of {} with {} tokens per sequence",
           runtime_.context_parallel_rank, cp, runtime_.seq_length);
  if (cp > 1) {
    // This rank's tokens' places in the whole sequence, and every rank's for the attention's
    // masks.
    context_positions_ =
        context_parallel_positions(runtime_.seq_length, cp, runtime_.context_parallel_rank);
    backend_.upload(a_.cp_positions, context_parallel_positions(runtime_.seq_length, cp).data());
  }
  if (runtime_.reset_position_ids) {
    for (const auto& [base, t] : a_.rope.tables)
      position_tables_.emplace_back(base,
                                    tessera::rope_table(spec_, runtime_.seq_length * cp, base));
  } else if (cp == 1) {
    for (const auto& [base, t] : a_.rope.tables)
      backend_.upload(t, tessera::rope_table(spec_, runtime_.seq_length, base).data());
  } else {  // each token's row of the whole sequence's tables
    const int64_t D = spec_.head_dim;
    for (const auto& [base, t] : a_.rope.tables) {
      const std::vector<float> whole = tessera::rope_table(spec_, runtime_.seq_length * cp, base);
      std::vector<float> table;
      for (int32_t p : context_positions_)
        table.insert(table.end(), whole.begin() + p * D, whole.begin() + (p + 1) * D);
      backend_.upload(t, table.data());
    }
  }
  if (runtime_.fp8.enabled()) {
    const auto linears = fp8_linears(layout_, layers_, runtime_);
    std::vector<int> fp8_index(layout_.params.size(), -1);
    for (size_t i = 0; i < linears.size(); ++i) fp8_index[linears[i].first] = static_cast<int>(i);
    fp8_ =
        std::make_unique<Fp8Linears>(backend_, runtime_.fp8, shapes_of(linears), runtime_.tokens());
    const UnitCopies copies = unit_copies(layout_, linears, runtime_);
    unit_copies_ = copies.units;
    unit_fp8_.resize(layout_.units.size());
    for (size_t u = 0; u < layout_.units.size(); ++u)
      if (!unit_copies_[u].empty())
        for (size_t i = 0; i < linears.size(); ++i)
          if (layout_.params[linears[i].first].unit == static_cast<int>(u)) unit_fp8_[u].push_back(static_cast<int>(i));
    if (copies.elements > 0) {
      copy_buffer_ = DeviceBuffer(backend_, static_cast<size_t>(copies.elements) * dtype_size(runtime_.compute_dtype),
                                  "copies of FP8-cached units' vectors");
      const Tensor all = copy_buffer_.tensor(runtime_.compute_dtype, {copies.elements});
      param_copies_.resize(layout_.params.size());
      for (const auto& unit : unit_copies_)
        for (const auto& [index, at] : unit)
          param_copies_[index] = all.flat_range(at, layout_.params[index].numel()).view(layout_.params[index].shape);
    }
    gemms_.use_fp8(fp8_.get(), std::move(fp8_index));
  }
  copies_current_.assign(layout_.units.size(), 0);
  reading_copies_.assign(layout_.units.size(), 0);
  tp_.size = runtime_.tensor_parallel_size;
  tp_.rank = runtime_.tensor_parallel_rank;
  tp_.sequence_parallel = runtime_.sequence_parallel;
  tp_.gathered = a_.gathered;
  tp_.partial = a_.partial;
  embedding_ = std::make_unique<VocabParallelEmbedding>(backend_, tp_, first_vocab_id());
  cross_entropy_ = std::make_unique<VocabParallelCrossEntropy>(backend_, tp_, first_vocab_id(),
                                                               a_.ce_stats, a_.ce_all_stats);
  attention_ = std::make_unique<ContextParallelAttention>(
      backend_, cp, runtime_.context_parallel_rank,
      ContextParallelAttention::Buffers{a_.cp_kv, a_.cp_kv_all, a_.cp_dkv_all, a_.cp_positions});
  if (runtime_.shared_prompt_side > 0)
    shared_prompt_ = std::make_unique<SharedPromptAttention>(backend_, *attention_, a_.shared_prompt);
  // Gradients the first GEMM of a step writes (beta 0) need no zeroing: the linears' and the
  // expert stacks' (whose grouped weight gradient writes every expert, with rows or not).
  std::vector<char> gemm_written(layout_.params.size(), 0);
  for (const auto& layer : layers_) {
    for (int i : layer->linear_weights()) gemm_written[i] = 1;
    for (const auto& [i, shape] : layer->expert_linears(runtime_)) gemm_written[i] = 1;
  }
  // A tied head's gradient is the embedding's, which the embedding backward adds to.
  if (!tied() && layout_.lm_head >= 0) gemm_written[layout_.lm_head] = 1;
  for (size_t i = 0; i < layout_.params.size(); ++i) {
    if (gemm_written[i]) continue;
    const ParamInfo& p = layout_.params[i];
    if (!accumulated_grad_ranges_.empty() && accumulated_grad_ranges_.back().end >= p.offset)
      accumulated_grad_ranges_.back().end = p.offset + p.numel();
    else
      accumulated_grad_ranges_.push_back({p.offset, p.offset + p.numel()});
  }
  // Per unit: all of it but its GEMM-written weights (the gaps between tensors included), from
  // the unit's start.
  unit_accumulated_ranges_.assign(layout_.units.size(), {});
  unit_gemm_weights_.assign(layout_.units.size(), {});
  for (size_t u = 0; u < layout_.units.size(); ++u) {
    const ParamRange& unit = layout_.units[u];
    int64_t at = unit.begin;
    for (size_t i = 0; i < layout_.params.size(); ++i) {
      const ParamInfo& p = layout_.params[i];
      if (!gemm_written[i] || p.offset < unit.begin || p.offset >= unit.end) continue;
      if (p.offset > at) unit_accumulated_ranges_[u].push_back({at - unit.begin, p.offset - unit.begin});
      at = p.offset + p.numel();
      unit_gemm_weights_[u].push_back(static_cast<int>(i));
    }
    if (at < unit.end) unit_accumulated_ranges_[u].push_back({at - unit.begin, unit.end - unit.begin});
  }
  bind_stats();
  bind_state();
  zero_grads();
  zero_loss_sum();
}

DecoderModel::~DecoderModel() = default;

void DecoderModel::bind_state() {
  int64_t total = 0;
  for (const auto& layer : layers_)
    for (const auto& [name, width] : layer->state_layout()) total += width;
  if (total == 0) return;
  state_buffer_ = DeviceBuffer(backend_, static_cast<size_t>(total) * sizeof(float), "block state");
  const Tensor all = state_buffer_.tensor(DType::F32, {total});
  backend_.fill(all, 0.0f);
  int64_t at = 0;
  for (auto& layer : layers_) {
    std::vector<Tensor> mine;
    for (const auto& [name, width] : layer->state_layout()) {
      mine.push_back(all.flat_range(at, width));
      state_.emplace_back(name, mine.back());
      at += width;
    }
    layer->bind_state(mine);
  }
}

void DecoderModel::set_expert_exchange(ExpertExchange* exchange) {
  const int size = exchange ? exchange->size() : runtime_.expert_parallel_size;
  TS_CHECK(size == runtime_.expert_parallel_size &&
               (exchange == nullptr || exchange->rank() == runtime_.expert_parallel_rank),
           "an expert exchange over {} ranks (this one {}) for a model planned for rank {} of {}",
           size, exchange ? exchange->rank() : 0, runtime_.expert_parallel_rank,
           runtime_.expert_parallel_size);
  expert_exchange_ = exchange;
}

std::vector<StepHook*> DecoderModel::step_hooks() const {
  std::vector<StepHook*> hooks;
  if (fp8_) hooks.push_back(fp8_.get());
  if (moe_balance_) hooks.push_back(moe_balance_.get());
  return hooks;
}

void DecoderModel::bind_stats() {
  // A row per MoE layer of the whole model, on every pipeline stage (one without MoE layers
  // too), so that a stage's rows of the layers it does not hold stay zero and the step hook's
  // sum over the stages gives every rank every layer's.
  for (int64_t l = 0; l < spec_.num_layers; ++l)
    if (spec_.moe.is_moe_layer(l)) moe_layers_.push_back(l);
  if (moe_layers_.empty()) return;
  const int64_t rows = static_cast<int64_t>(moe_layers_.size());
  const int64_t width = moe_stats_width(spec_.moe.experts);
  stats_buffer_ =
      DeviceBuffer(backend_, static_cast<size_t>(rows * width) * sizeof(float), "moe statistics");
  moe_stats_ = stats_buffer_.tensor(DType::F32, {rows, width});
  for (size_t c = 0; c < chunks_.size(); ++c)
    for (int64_t i = 0; i < chunks_[c].count; ++i) {
      const size_t l = chunk_begin_[c] + static_cast<size_t>(i);
      const int64_t layer = chunks_[c].first + i, w = layers_[l]->stats_width();
      if (w == 0) continue;
      const auto row = std::find(moe_layers_.begin(), moe_layers_.end(), layer) - moe_layers_.begin();
      TS_CHECK(row < rows && w == width, "layer {} keeps {} statistics; the MoE layers keep {}",
               layer, w, width);
      layers_[l]->bind_stats(moe_stats_.flat_range(row * width, width));
    }
  // Its update moves the blocks' state (the aux-loss-free expert bias) from the summed
  // statistics.
  moe_balance_ = std::make_unique<MoeBalanceHook>(
      backend_, moe_stats_, moe_layers_, spec_.moe.experts, runtime_.moe_force_balance, [this] {
        for (auto& layer : layers_) layer->update_state(backend_);
      });
}

RecomputeRole ModelRuntime::recompute_role(int64_t position, int64_t count) const {
  RecomputeRole r;
  if (recompute != RecomputeGranularity::Full) return r;
  const RecomputeMethod method = recompute_method != RecomputeMethod::None ? recompute_method
                                 : recompute_num_layers > 0                ? RecomputeMethod::Block
                                                            : RecomputeMethod::Uniform;
  if (method == RecomputeMethod::Block) {
    r.recomputed = position < recompute_num_layers;
    return r;
  }
  const int64_t group = std::max<int64_t>(recompute_num_layers, 1);
  r.recomputed = true;
  r.group_start = position % group == 0;
  r.group_end = position % group == group - 1 || position == count - 1;
  return r;
}

Tensor DecoderModel::param(int index) const {
  const ParamInfo& p = layout_.params[index];
  if (reading_copies_[p.unit]) {
    TS_CHECK(param_copies_[index].defined(), "{} is read while unit {} is served from copies: only its FP8 codes are",
             p.name, p.unit);
    return param_copies_[index];
  }
  const int64_t at = p.offset - layout_.units[p.unit].begin;
  return unit_params_[p.unit].flat_range(at, p.numel()).view(p.shape);
}

Tensor DecoderModel::grad(int index) const {
  const ParamInfo& p = layout_.params[index];
  const int64_t at = p.offset - layout_.units[p.unit].begin;
  return unit_grads_[p.unit].flat_range(at, p.numel()).view(p.shape);
}

void DecoderModel::bind_unit_params(int unit, const Tensor& params) {
  TS_CHECK(runtime_.sharded_params, "parameters are bound only with sharded_params");
  check_unit_binding(params, runtime_.compute_dtype, layout_.units[unit], unit, "parameters");
  unit_params_[unit] = params;
}

void DecoderModel::bind_unit_grads(int unit, const Tensor& grads) {
  TS_CHECK(runtime_.sharded_params, "gradients are bound only with sharded_params");
  check_unit_binding(grads, runtime_.grad_dtype, layout_.units[unit], unit, "gradients");
  unit_grads_[unit] = grads;
}

void DecoderModel::start_unit_grads(int unit) {
  TS_CHECK(runtime_.sharded_params, "start_unit_grads only with sharded_params");
  const Tensor& g = unit_grads_[unit];
  for (const ParamRange& r : unit_accumulated_ranges_[unit]) backend_.fill(g.flat_range(r.begin, r.count()), 0.0f);
  for (int weight : unit_gemm_weights_[unit]) gemms_.write_grad_next(weight);
}

// A new step's gradients: also the start of the step's FP8 non-finite check. Sharded, the
// observer starts each unit's gradients itself and every GEMM accumulates.
void DecoderModel::zero_grads() {
  if (!runtime_.sharded_params)
    for (const ParamRange& r : accumulated_grad_ranges_)
      backend_.fill(grads_.flat_range(r.begin, r.count()), 0.0f);
  gemms_.start_step(runtime_.sharded_params);
  if (fp8_) fp8_->clear_status();
}

bool DecoderModel::unit_read_from_copies(int unit) const {
  if (unit_copies_.empty() || unit_copies_[unit].empty() || !copies_current_[unit]) return false;
  return std::all_of(unit_fp8_[unit].begin(), unit_fp8_[unit].end(),
                     [&](int i) { return fp8_->weight_cached(i); });
}

// A unit read whole while its copies are stale refreshes them from what was just bound.
void DecoderModel::params_needed(int unit, int next) {
  reading_copies_[unit] = unit_read_from_copies(unit);
  if (observer_) observer_->params_needed(unit, next);
  if (reading_copies_[unit] || unit_copies_.empty() || unit_copies_[unit].empty() || copies_current_[unit]) return;
  for (const auto& [index, at] : unit_copies_[unit]) backend_.copy(param_copies_[index], param(index));
  copies_current_[unit] = 1;
}
void DecoderModel::params_done(int unit) {
  if (observer_) observer_->params_done(unit);
  reading_copies_[unit] = 0;
}
void DecoderModel::grads_needed(int unit) {
  if (observer_) observer_->grads_needed(unit);
}
void DecoderModel::grads_ready(int unit) {
  if (observer_) observer_->grads_ready(unit);
}

int DecoderModel::layer_unit(size_t layer) const {
  return (parts_.embedding ? 1 : 0) + static_cast<int>(layer);
}

// The tail reads the embedding table too when the head is tied to it.
void DecoderModel::tail_params_needed(int next) {
  params_needed(layout_.tail_unit(), tied() ? 0 : next);
  if (tied()) params_needed(0, next);
}

void DecoderModel::tail_params_done() {
  params_done(layout_.tail_unit());
  if (tied()) params_done(0);
}

void DecoderModel::params_updated() {
  if (fp8_) fp8_->weights_changed();
  std::fill(copies_current_.begin(), copies_current_.end(), 0);
}
void DecoderModel::zero_loss_sum() {
  backend_.fill(a_.loss_sum, 0.0f);
  if (moe_stats_.defined()) backend_.fill(moe_stats_, 0.0f);
}

void DecoderModel::set_batch(const int32_t* tokens, const int32_t* targets,
                             const int32_t* positions) {
  if (runtime_.packed_documents()) set_document_positions(positions);
  if (runtime_.context_parallel_size == 1) {
    backend_.upload(a_.tokens, tokens);
    backend_.upload(a_.targets, targets);
    set_loss_rows(targets);
    return;
  }
  // This rank's tokens (and targets) of each whole sequence.
  const int64_t local = runtime_.seq_length, whole = local * runtime_.context_parallel_size;
  host_ids_.resize(static_cast<size_t>(runtime_.tokens()));
  for (const auto& [from, to] : {std::pair{tokens, a_.tokens}, std::pair{targets, a_.targets}}) {
    for (int64_t b = 0; b < runtime_.micro_batch; ++b)
      for (int64_t t = 0; t < local; ++t)
        host_ids_[b * local + t] = from[b * whole + context_positions_[t]];
    backend_.upload(to, host_ids_.data());
  }
  set_loss_rows(host_ids_.data());  // the targets, the loop's last
}

void DecoderModel::set_loss_rows(const int32_t* targets) {
  int64_t& count = loss_row_count_[static_cast<size_t>(slot_)];
  std::vector<int64_t>& begins = sequence_head_rows_[static_cast<size_t>(slot_)];
  std::vector<int64_t>& sequences = sequence_rows_[static_cast<size_t>(slot_)];
  const int64_t N = runtime_.tokens(), T = runtime_.seq_length;
  if (!shared_prompt_) {  // shared prompts' sequences come from their pairs
    sequences.clear();
    for (int64_t b = 0; b <= runtime_.micro_batch; ++b) sequences.push_back(b * T);
  }
  begins = sequences;
  count = -1;
  if (!runtime_.head_on_loss_rows) return;
  host_loss_rows_.clear();
  for (int64_t i = 0; i < N; ++i)
    if (targets[i] >= 0) host_loss_rows_.push_back(static_cast<int32_t>(i));
  // The row count is rounded up to the backend's multiple for GEMMs of varying rows, and an
  // FP8 head's (powers of two both). The padding rows are ones whose targets do not count:
  // their losses and gradients are the zeros their positions hold anyway.
  int64_t multiple = backend_.varying_gemm_rows_multiple();
  if (runtime_.fp8.enabled() && runtime_.fp8.lm_head)
    multiple = std::max(multiple, runtime_.fp8.recipe == Fp8Recipe::Blockwise ? kFp8BlockSize
                                                                              : backend_.fp8_gemm_multiple());
  const int64_t kept = static_cast<int64_t>(host_loss_rows_.size());
  const int64_t rows = (kept + multiple - 1) / multiple * multiple;
  if (rows >= N) return;
  for (int64_t i = 0; static_cast<int64_t>(host_loss_rows_.size()) < rows; ++i)
    if (targets[i] < 0) host_loss_rows_.push_back(static_cast<int32_t>(i));
  for (size_t b = 1; b < sequences.size(); ++b)
    begins[b] = std::lower_bound(host_loss_rows_.begin(), host_loss_rows_.begin() + kept,
                                 static_cast<int32_t>(sequences[b])) - host_loss_rows_.begin();
  host_loss_targets_.resize(host_loss_rows_.size());
  for (size_t i = 0; i < host_loss_rows_.size(); ++i) host_loss_targets_[i] = targets[host_loss_rows_[i]];
  count = rows;
  if (rows == 0) return;
  backend_.upload(a_.loss_rows.flat_range(0, rows), host_loss_rows_.data());
  backend_.upload(a_.loss_targets.flat_range(0, rows), host_loss_targets_.data());
}

// Packed documents: every token's rotary row is its position's, and a query's keys start at
// its document's first token.
void DecoderModel::set_document_positions(const int32_t* positions) {
  TS_CHECK(positions != nullptr, "reset_position_ids or reset_attention_mask without positions");
  // positions covers whole sequences; under context parallelism this rank's tokens are the
  // ones at context_positions_ of each.
  const int cp = runtime_.context_parallel_size;
  const int64_t N = runtime_.tokens(), T = runtime_.seq_length, whole = T * cp, D = spec_.head_dim;
  const int64_t all = N * cp;
  for (int64_t i = 0; i < all; ++i)
    TS_CHECK(positions[i] >= 0 && positions[i] <= i % whole,
             "token {} of its sequence at position {} in its document", i % whole, positions[i]);
  // This rank's tokens' positions in their documents. With shared prompts attention's
  // documents are the expanded sides' (set_shared_prompt_pairs).
  const bool shared = runtime_.shared_prompt_side > 0;
  std::vector<int32_t> rows_positions;
  std::vector<int32_t>& own = shared ? rows_positions : document_positions_[static_cast<size_t>(slot_)];
  own.resize(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) {
    const int64_t b = i / T, t = i % T;
    own[i] = positions[b * whole + (cp > 1 ? context_positions_[t] : t)];
  }
  if (runtime_.reset_position_ids) {
    std::vector<float> rows(static_cast<size_t>(N * D));
    for (const auto& [base, table] : position_tables_) {
      for (int64_t i = 0; i < N; ++i)
        std::copy_n(table.begin() + own[i] * D, D, rows.begin() + i * D);
      backend_.upload(a_.rope.at(base), rows.data());
    }
  }
  if (runtime_.reset_attention_mask && !shared) {
    host_ids_.resize(static_cast<size_t>(all));
    for (int64_t i = 0; i < all; ++i) host_ids_[i] = static_cast<int32_t>(i % whole) - positions[i];
    backend_.upload(a_.document_starts, host_ids_.data());
    document_pairs_[static_cast<size_t>(slot_)].clear();
  }
}

void DecoderModel::set_shared_prompt_pairs(std::span<const SharedPromptPair> pairs) {
  TS_CHECK(shared_prompt_ && static_cast<int64_t>(pairs.size()) == runtime_.micro_batch,
           "set_shared_prompt_pairs: {} pairs for a micro-batch of {}{}", pairs.size(),
           runtime_.micro_batch, shared_prompt_ ? "" : " without shared_prompt_side");
  const SharedPromptRows rows =
      shared_prompt_rows(pairs, runtime_.seq_length, runtime_.shared_prompt_side);
  const SharedPromptBuffers& b = a_.shared_prompt;
  const auto upload = [&](const Tensor& t, const std::vector<int32_t>& v) {
    if (!v.empty()) backend_.upload(t.flat_range(0, static_cast<int64_t>(v.size())), v.data());
  };
  upload(b.source, rows.source);
  upload(b.home_model, rows.home_model);
  upload(b.home_attention, rows.home_attention);
  const auto slot = static_cast<size_t>(slot_);
  shared_prompt_layouts_[slot] = {static_cast<int64_t>(rows.home_model.size()), rows.prompts, rows.padding};
  sequence_rows_[slot] = rows.sequence_rows;
  // Without reset_attention_mask each side attends causally over its whole sequence, padding
  // after it, as the batched layout's sequences do.
  if (!runtime_.reset_attention_mask) return;
  const int64_t side = runtime_.shared_prompt_side;
  host_ids_.resize(rows.positions.size());
  for (size_t i = 0; i < rows.positions.size(); ++i)
    host_ids_[i] = static_cast<int32_t>(static_cast<int64_t>(i) % side) - rows.positions[i];
  backend_.upload(a_.document_starts, host_ids_.data());
  document_positions_[slot] = rows.positions;
  document_pairs_[slot].clear();
}

// The pairs the slot's batch's documents leave visible to attention of `window` (0: none).
double DecoderModel::document_pairs(int64_t window) const {
  const auto [at, added] = document_pairs_[static_cast<size_t>(slot_)].try_emplace(window, 0.0);
  if (added)
    for (const int32_t p : document_positions_[static_cast<size_t>(slot_)])
      at->second += static_cast<double>(window > 0 ? std::min<int64_t>(p + 1, window) : p + 1);
  return at->second;
}

void DecoderModel::set_context_parallel_group(ParallelGroup* group) {
  attention_->set_group(group);
}

// With reset_attention_mask every block's attention stays within documents. Shared prompts
// cast out after their attention.
void DecoderModel::attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                     const AttentionShape& s, const Fp8CastArgs& codes) {
  const AttentionShape within = attention_shape(s);
  if (!shared_prompt_) return attention_->forward(out, lse, qkv, within, codes);
  shared_prompt_->forward(shared_prompt_layouts_[static_cast<size_t>(slot_)], out, lse, qkv, within);
  if (codes.out.defined())
    backend_.fp8_cast_transpose({out, codes.out, {}, codes.scale, codes.amax});
}

void DecoderModel::attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                                      const Tensor& lse, const Tensor& qkv,
                                      const AttentionShape& s) {
  const AttentionShape within = attention_shape(s);
  if (!shared_prompt_) return attention_->backward(dqkv, dout, out, lse, qkv, within);
  shared_prompt_->backward(shared_prompt_layouts_[static_cast<size_t>(slot_)], dqkv, dout, out,
                           lse, qkv, within);
}

// The blocks' shape of their rows, as attention runs on them: within documents with
// reset_attention_mask, and with shared prompts over the pairs' two sides apart.
AttentionShape DecoderModel::attention_shape(const AttentionShape& s) const {
  AttentionShape within = s;
  if (shared_prompt_) within.batch = runtime_.attention_batch(), within.seq = runtime_.attention_seq();
  within.document_starts = a_.document_starts;
  if (within.document_starts.defined()) within.document_pairs = document_pairs(s.window);
  within.fp8 = runtime_.fp8_attention;
  return within;
}

// Each parameter's tensor-parallel style picks its layer. A replicated weight (the whole of it
// on every rank) and the output head (whose collectives are the cross-entropy's) run the local
// GEMMs; a residual is added by a row-parallel layer, or folded into a local GEMM's beta.
void DecoderModel::linear(const Tensor& out, const LinearOperand& in, int weight, int bias,
                          const Tensor& residual) {
  const ParamInfo& p = layout_.params[weight];
  switch (p.tp) {
    case TensorParallelStyle::Column:
      if (tp_.size > 1 || !residual.defined()) {
        TS_CHECK(!residual.defined(), "{}: a column-parallel linear with a residual", p.name);
        return column_.forward(out, in, weight, bias);
      }
      break;
    case TensorParallelStyle::Row:
      // A bias would be added by every rank.
      TS_CHECK(bias < 0 || tp_.size == 1, "{}: a row-parallel linear with a bias", p.name);
      if (bias < 0) return row_.forward(out, in, weight, residual);
      break;
    case TensorParallelStyle::Replicated:
    case TensorParallelStyle::ReplicatedPartialGrads:
    case TensorParallelStyle::Vocab:
      break;
    case TensorParallelStyle::Expert:
      throw InternalError(fmt::format("{}: an expert stack used as a linear layer", p.name));
  }
  // A replicated weight under tensor parallelism (an MoE router) multiplies the same input on
  // every rank, its gradient the same on each (a sequence shard's partial sum under sequence
  // parallelism, summed over the ranks as a norm's).
  gemms_.forward(out, in, weight, bias, residual.defined() ? 1.0f : 0.0f, residual);
}

void DecoderModel::linear_backward(const Tensor& din, const LinearOperand& dout,
                                   const LinearOperand& in, int weight, int bias) {
  switch (layout_.params[weight].tp) {
    case TensorParallelStyle::Column:
      return column_.backward(din, dout, in, weight, bias);
    case TensorParallelStyle::Row:
      if (bias < 0) return row_.backward(din, dout, in, weight);
      break;
    default:
      break;
  }
  gemms_.backward(din, dout, in, weight, bias);
}

// A column-parallel layer under sequence parallelism gathers its input over the sequence
// shards first: it casts the gathered tensor itself.
Fp8CastArgs DecoderModel::linear_input_cast(int weight, int64_t rows) const {
  if (layout_.params[weight].tp == TensorParallelStyle::Column && tp_.sequence_parallel) return {};
  return gemms_.input_cast(weight, rows);
}

bool DecoderModel::linear_keeps_input_codes(int weight, int64_t rows) const {
  return linear_input_cast(weight, rows).out.defined() && !gemms_.adapted(weight);
}

// A row-parallel layer under sequence parallelism gathers its output gradient over the shards
// first: it casts the gathered tensor itself.
Fp8CastArgs DecoderModel::linear_output_grad_cast(int weight, int64_t rows) const {
  if (layout_.params[weight].tp == TensorParallelStyle::Row && tp_.sequence_parallel) return {};
  return gemms_.output_grad_cast(weight, rows);
}

void DecoderModel::expert_linear(const Tensor& out, const Tensor& in, int weight, const Tensor& w,
                                 const ExpertGroups& groups) {
  gemms_.expert_forward(out, in, weight, w, groups);
}

void DecoderModel::expert_linear_backward(const Tensor& din, const Tensor& dout, const Tensor& in,
                                          int weight, const Tensor& w, const Tensor& dw,
                                          const ExpertGroups& groups) {
  gemms_.expert_backward(din, dout, in, weight, w, dw, groups);
}

// Units are read in forward order, each followed by the next (layer l is unit l + 1; the
// last layer is followed by the tail).
void DecoderModel::embed(const Tensor& x) {
  params_needed(0, 1);
  {
    ScopedRange r(backend_, "embedding_forward");
    embedding_->forward(x, a_.tokens, param(layout_.embedding));
    if (spec_.embedding_scale != 0) backend_.scale(x, x, static_cast<float>(spec_.embedding_scale));
  }
  params_done(0);
}

DecoderModel::HeadRows DecoderModel::head_begin(int chunk, bool with_grad) {
  const int tail = layout_.tail_unit();
  // With gradients the backward's first layer follows (the chunk's last).
  tail_params_needed(with_grad && chunks_[chunk].count > 0
                         ? layer_unit(chunk_begin_[chunk] + chunks_[chunk].count - 1)
                         : -1);
  if (with_grad) {
    grads_needed(tail);
    if (tied()) grads_needed(0);
  }
  backend_.rmsnorm_forward(a_.final_norm, a_.final_rstd, a_.resid[chunk].back(),
                           param(layout_.final_norm), spec_.norm_eps);
  // Vocabulary-parallel head: every rank computes its columns of the logits for every token,
  // and d(normed) partial sums over them, added up over the ranks after the last chunk.
  const bool sp = runtime_.sequence_parallel;
  return {sp ? tp_.gather_sequence(a_.final_norm) : a_.final_norm, sp ? a_.partial : a_.dnorm};
}

void DecoderModel::head_end(int chunk, bool with_grad) {
  if (with_grad) {
    tp_.reduce_to_sequence(a_.dnorm, runtime_.sequence_parallel ? a_.partial : a_.dnorm);
    backend_.fill(a_.dresid[chunk], 0.0f);
    backend_.rmsnorm_backward(a_.dresid[chunk], grad(layout_.final_norm), a_.dnorm,
                              a_.resid[chunk].back(), param(layout_.final_norm), a_.final_rstd);
  }
  tail_params_done();
  if (with_grad) grads_ready(layout_.tail_unit());
}

int64_t DecoderModel::head_rows() const {
  const int64_t count = loss_row_count_[static_cast<size_t>(slot_)];
  return count >= 0 ? count : runtime_.tokens();
}

DecoderModel::HeadChunk DecoderModel::head_chunk(const HeadRows& head, int64_t c, int64_t n) {
  HeadChunk k;
  k.first = c;
  k.logits = a_.logits.rows(0, n);
  if (loss_row_count_[static_cast<size_t>(slot_)] < 0) {
    k.normed = head.normed.rows(c, c + n);
    k.targets = a_.targets.rows(c, c + n);
    k.losses = a_.losses.rows(c, c + n);
    if (head.dnormed.defined()) k.dnormed = head.dnormed.rows(c, c + n);
    return k;
  }
  k.rows = a_.loss_rows.flat_range(c, n);
  k.normed = a_.head_in.rows(0, n);
  backend_.copy_rows(k.normed, Tensor{}, head.normed, k.rows);
  k.targets = a_.loss_targets.rows(c, c + n);
  k.losses = a_.row_values.flat_range(0, n);
  k.dnormed = a_.head_din.rows(0, n);
  return k;
}

void DecoderModel::head_chunk_done(const HeadRows& head, const HeadChunk& k, bool losses,
                                   bool dnormed) {
  if (!k.rows.defined()) return;
  const int64_t n = k.rows.numel();
  if (losses) backend_.copy_rows(a_.losses.view({runtime_.tokens(), 1}), k.rows, k.losses.view({n, 1}), Tensor{});
  if (dnormed) backend_.copy_rows(head.dnormed, k.rows, k.dnormed, Tensor{});
}

void DecoderModel::head_chunks(const HeadRows& head, bool losses, bool dnormed,
                               const std::function<void(const HeadChunk&)>& body) {
  const int64_t rows = head_rows(), chunk = a_.logits.dim(0);
  // Positions the head skips have no loss and pass no gradient back.
  if (rows < runtime_.tokens()) {
    if (losses) backend_.fill(a_.losses, 0.0f);
    if (dnormed) backend_.fill(head.dnormed, 0.0f);
  }
  for (int64_t c = 0; c < rows; c += chunk) {
    const HeadChunk k = head_chunk(head, c, std::min(chunk, rows - c));
    gemms_.forward(k.logits, k.normed, layout_.lm_head, -1, 0.0f, {});
    body(k);
    head_chunk_done(head, k, losses, dnormed);
  }
  if (dnormed && rows == 0) gemms_.backward_without_rows(layout_.lm_head);
}

// Final norm, output head and cross-entropy, chunked over tokens so that only
// chunk x vocab logits ever exist. With gradients, each chunk's d(logits) overwrites its
// logits and is consumed at once: the head's backward runs inside the forward pass. Without,
// keep_logit_grads writes them at unit scale into the slot's logit_grads instead (row for row
// of the head's rows).
void DecoderModel::head_forward(int chunk, bool with_grad, float grad_scale) {
  ScopedRange r(backend_, "output_head");
  const HeadRows head = head_begin(chunk, with_grad);
  const bool keep = !with_grad && runtime_.keep_logit_grads;
  head_chunks(head, true, with_grad, [&](const HeadChunk& k) {
    const int64_t n = k.logits.dim(0);
    const Tensor dlogits = with_grad ? k.logits : keep ? a_.logit_grads.rows(k.first, k.first + n) : Tensor{};
    const float scale = keep ? 1.0f : grad_scale;
    if (spec_.logit_softcap > 0) {
      // The loss reads the capped logits; their gradient goes back through the cap in place.
      const Tensor capped = a_.capped.rows(0, n);
      const float cap = static_cast<float>(spec_.logit_softcap);
      backend_.softcap(capped, k.logits, cap);
      cross_entropy_->forward(k.losses, capped, k.targets, dlogits, scale);
      if (dlogits.defined()) backend_.softcap_backward(dlogits, dlogits, capped, cap);
    } else {
      cross_entropy_->forward(k.losses, k.logits, k.targets, dlogits, scale);
    }
    if (with_grad) gemms_.backward(k.dnormed, k.logits, k.normed, layout_.lm_head, -1);
  });
  backend_.sum(a_.loss_sum, a_.losses, /*accumulate=*/true);
  head_end(chunk, with_grad);
}

void DecoderModel::kept_head_backward(int chunk, std::span<const float> sequence_scales) {
  TS_CHECK(holds_head(chunk) && runtime_.keep_logit_grads,
           "kept_head_backward of chunk {}: not the head's, or no kept logit gradients", chunk);
  const std::vector<int64_t>& sequences = sequence_rows_[static_cast<size_t>(slot_)];
  const auto B = static_cast<int64_t>(sequences.size()) - 1;
  TS_CHECK(sequence_scales.size() == 1 || static_cast<int64_t>(sequence_scales.size()) == B,
           "kept_head_backward: {} scales for {} sequences", sequence_scales.size(), B);
  const auto scale_of = [&](int64_t b) { return sequence_scales[sequence_scales.size() == 1 ? 0 : b]; };
  ScopedRange r(backend_, "output_head");
  const HeadRows head = head_begin(chunk, true);
  const int64_t rows = head_rows(), chunk_rows = a_.logits.dim(0);
  const Tensor kept = a_.logit_grads.rows(0, rows);
  const std::vector<int64_t>& begins = sequence_head_rows_[static_cast<size_t>(slot_)];
  // Both of the head's backward products are linear in the kept gradients G, so sequence b's
  // scale s goes on its rows of the head's input, d(weight) = G^T (s x), and of the input
  // gradient it returns, s (G W): tokens x hidden values rather than tokens x vocabulary. An
  // FP8 head's input keeps its amax history unscaled: there the gradients take the scale.
  const bool fp8_head = runtime_.fp8.enabled() && runtime_.fp8.lm_head;
  const auto scale_rows = [&](const Tensor& t, bool head_rows_of_t) {
    for (int64_t b = 0; b < B; ++b) {
      const std::vector<int64_t>& rows_of_t = head_rows_of_t ? begins : sequences;
      const int64_t begin = rows_of_t[b], end = rows_of_t[b + 1];
      if (end > begin) backend_.scale(t.rows(begin, end), t.rows(begin, end), scale_of(b));
    }
  };
  if (fp8_head) {
    scale_rows(kept, true);
  } else {
    scale_rows(head.normed, false);
  }
  if (rows < runtime_.tokens()) backend_.fill(head.dnormed, 0.0f);
  for (int64_t c = 0; c < rows; c += chunk_rows) {
    const HeadChunk k = head_chunk(head, c, std::min(chunk_rows, rows - c));
    gemms_.backward(k.dnormed, kept.rows(c, c + k.normed.dim(0)), k.normed, layout_.lm_head, -1);
    head_chunk_done(head, k, false, true);
  }
  if (rows == 0) gemms_.backward_without_rows(layout_.lm_head);
  if (!fp8_head) scale_rows(head.dnormed, false);
  head_end(chunk, true);
}

void DecoderModel::head_backward_per_token(const Tensor& dlogps) {
  ScopedRange r(backend_, "output_head");
  const HeadRows head = head_begin(0, true);
  head_chunks(head, false, true, [&](const HeadChunk& k) {
    const int64_t n = k.logits.dim(0);
    const Tensor logps = a_.chunk_logps.flat_range(0, n), lse = a_.chunk_lse.flat_range(0, n);
    Tensor chunk_dlogps = dlogps.flat_range(k.first, n);
    if (k.rows.defined()) {
      chunk_dlogps = a_.row_values.flat_range(0, n);
      backend_.copy_rows(chunk_dlogps.view({n, 1}), Tensor{}, dlogps.view({dlogps.numel(), 1}), k.rows);
    }
    // d(logits) overwrites the logits, through the cap as in head_forward.
    const bool capped = spec_.logit_softcap > 0;
    const Tensor probs = capped ? a_.capped.rows(0, n) : k.logits;
    const float cap = static_cast<float>(spec_.logit_softcap);
    if (capped) backend_.softcap(probs, k.logits, cap);
    backend_.log_softmax_gather(logps, lse, probs, k.targets);
    backend_.log_softmax_gather_backward(k.logits, chunk_dlogps, probs, lse, k.targets);
    if (capped) backend_.softcap_backward(k.logits, k.logits, probs, cap);
    gemms_.backward(k.dnormed, k.logits, k.normed, layout_.lm_head, -1);
  });
  head_end(0, true);
}

// Units are read in forward order, each followed by the next within the chunk (the last
// layer of the model by the tail).
void DecoderModel::forward_layers(int chunk) {
  const std::vector<Tensor>& x = a_.resid[chunk];
  const size_t begin = chunk_begin_[chunk], count = static_cast<size_t>(chunks_[chunk].count);
  const bool head = holds_head(chunk);
  for (size_t i = 0; i < count; ++i) {
    ScopedRange r(backend_, "layer_forward");
    const int unit = layer_unit(begin + i);
    params_needed(unit, i + 1 < count ? unit + 1 : head ? layout_.tail_unit() : -1);
    layers_[begin + i]->forward(*this, x[i], x[i + 1]);
    params_done(unit);
  }
}

void DecoderModel::forward_chunk(int chunk, bool with_grad, float grad_scale) {
  TS_CHECK(chunk >= 0 && chunk < chunks(), "model chunk {} of {}", chunk, chunks());
  // The MoE layers' backward scales their auxiliary losses' gradients as the loss's (a head
  // chunk run without gradients for kept_head_backward too: its layers' backward follows).
  grad_scale_ = grad_scale;
  if (holds_embedding(chunk)) embed(a_.resid[chunk][0]);
  forward_layers(chunk);
  if (holds_head(chunk)) head_forward(chunk, with_grad, grad_scale);
}

// Before the backward of a recompute group's last layer (`last`, in the chunk), the group's
// layers run forward again from its stored input: each refills its activations and, but for
// the last, writes the next residual state, whose stored copy the last layer's output is.
void DecoderModel::recompute_group(int chunk, size_t last) {
  const std::vector<Tensor>& x = a_.resid[chunk];
  const size_t begin = chunk_begin_[chunk];
  const int64_t count = chunks_[chunk].count;
  size_t first = last;
  while (!runtime_.recompute_role(static_cast<int64_t>(first), count).group_start) --first;
  // Named so that a trace's step breakdown can tell recompute from the first forward.
  ScopedRange r(backend_, "recompute");
  recomputing_ = true;
  for (size_t i = first; i <= last; ++i) {
    const int unit = layer_unit(begin + i);
    // The last layer's backward follows at once; the prefetch is for the layer below.
    params_needed(unit, i < last ? unit + 1 : last > 0 ? unit - 1 : -1);
    if (i < last) {
      layers_[begin + i]->forward(*this, x[i], x[i + 1]);
    } else {
      layers_[begin + i]->recompute(*this, x[i], x[i + 1]);
    }
    params_done(unit);
  }
  recomputing_ = false;
}

// Backward order: each layer's unit is followed by the one below it in the chunk; the
// embedding's backward reads no parameters.
void DecoderModel::backward_chunk(int chunk) {
  TS_CHECK(chunk >= 0 && chunk < chunks(), "model chunk {} of {}", chunk, chunks());
  const std::vector<Tensor>& x = a_.resid[chunk];
  const Tensor& dresid = a_.dresid[chunk];
  const size_t begin = chunk_begin_[chunk], count = static_cast<size_t>(chunks_[chunk].count);
  for (size_t i = count; i-- > 0;) {
    const RecomputeRole role =
        runtime_.recompute_role(static_cast<int64_t>(i), static_cast<int64_t>(count));
    if (role.recomputed && role.group_end) recompute_group(chunk, i);
    const int unit = layer_unit(begin + i);
    params_needed(unit, i > 0 ? unit - 1 : -1);
    grads_needed(unit);
    {
      ScopedRange r(backend_, "layer_backward");
      layers_[begin + i]->backward(*this, x[i], dresid);
    }
    params_done(unit);
    grads_ready(unit);
  }
  if (!holds_embedding(chunk)) return;
  if (!tied()) grads_needed(0);
  {
    ScopedRange r(backend_, "embedding_backward");
    if (spec_.embedding_scale != 0)
      backend_.scale(dresid, dresid, static_cast<float>(spec_.embedding_scale));
    embedding_->backward(grad(layout_.embedding), dresid, a_.tokens);
  }
  grads_ready(0);
}

void DecoderModel::forward_backward(float grad_scale) {
  TS_CHECK(chunks() == 1 && parts_.embedding && parts_.head,
           "forward_backward on a pipeline stage: its schedule runs the chunks' passes");
  forward_chunk(0, true, grad_scale);
  backward_chunk(0);
}

void DecoderModel::forward_loss() {
  TS_CHECK(chunks() == 1 && parts_.embedding && parts_.head,
           "forward_loss on a pipeline stage: its schedule runs the chunks' passes");
  forward_chunk(0, false, 0.0f);
}

void DecoderModel::loss_backward(std::span<const float> sequence_scales, float aux_grad_scale) {
  TS_CHECK(chunks() == 1 && parts_.embedding && parts_.head,
           "loss_backward on a pipeline stage: its schedule runs the chunks' passes");
  grad_scale_ = aux_grad_scale;
  if (runtime_.keep_logit_grads) {
    kept_head_backward(0, sequence_scales);
  } else {
    TS_CHECK(sequence_scales.size() == 1,
             "loss_backward: {} sequence scales without keep_logit_grads (one)", sequence_scales.size());
    head_forward(0, true, sequence_scales[0]);
  }
  backward_chunk(0);
}

void DecoderModel::token_loss_backward(const Tensor& dlogps, float aux_grad_scale) {
  TS_CHECK(chunks() == 1 && parts_.embedding && parts_.head,
           "token_loss_backward on a pipeline stage: its schedule runs the chunks' passes");
  TS_CHECK(runtime_.tensor_parallel_size == 1,
           "token_loss_backward under tensor parallelism: each rank holds part of the vocabulary");
  TS_CHECK(dlogps.dtype == DType::F32 && dlogps.numel() == runtime_.tokens(),
           "token_loss_backward: dlogps must be {} fp32 values, one per position", runtime_.tokens());
  grad_scale_ = aux_grad_scale;
  head_backward_per_token(dlogps);
  backward_chunk(0);
}

void DecoderModel::use_slot(int slot) {
  if (slot == slot_) return;
  plan_->bind(act_buffer_, slot);
  slot_ = slot;
}

// The same tensor in another slot: stored tensors repeat every slot_stride() bytes.
Tensor DecoderModel::at_slot(const Tensor& t, int slot) const {
  TS_CHECK(slot >= 0 && slot < runtime_.pipeline_slots, "slot {} of {}", slot,
           runtime_.pipeline_slots);
  Tensor s = t;
  s.data = static_cast<char*>(t.data) + (static_cast<std::ptrdiff_t>(slot) - slot_) *
                                            static_cast<std::ptrdiff_t>(plan_->slot_stride());
  return s;
}

Tensor DecoderModel::chunk_input(int chunk, int slot) const {
  return at_slot(a_.resid[chunk].front(), slot);
}

Tensor DecoderModel::chunk_output(int chunk, int slot) const {
  return at_slot(a_.resid[chunk].back(), slot);
}

Tensor DecoderModel::chunk_grad(int chunk, int slot) const {
  return at_slot(a_.dresid[chunk], slot);
}

void DecoderModel::forward_logits(const Tensor& logits) {
  TS_CHECK(runtime_.tensor_parallel_size == 1 && chunks() == 1 && parts_.embedding && parts_.head,
           "whole logits from a model split over tensor- or pipeline-parallel ranks");
  embed(a_.resid[0][0]);
  forward_layers(0);
  tail_params_needed(-1);
  backend_.rmsnorm_forward(a_.final_norm, a_.final_rstd, a_.resid[0].back(),
                           param(layout_.final_norm), spec_.norm_eps);
  gemms_.forward(logits, a_.final_norm, layout_.lm_head, -1, 0.0f, {});
  if (spec_.logit_softcap > 0)
    backend_.softcap(logits, logits, static_cast<float>(spec_.logit_softcap));
  tail_params_done();
}

}  // namespace tessera
