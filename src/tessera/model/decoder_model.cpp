#include "tessera/model/decoder_model.h"

#include <algorithm>

#include "tessera/core/error.h"
#include "tessera/model/rope.h"

namespace tessera {
namespace {

bool full_recompute_layer(const ModelRuntime& rt, int64_t layer) {
  return rt.recompute == RecomputeGranularity::Full &&
         (rt.recompute_num_layers == 0 || layer < rt.recompute_num_layers);
}

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
  for (const auto& layer : layers)
    for (int index : layer->linear_weights()) add(index);
  if (rt.fp8.lm_head) add(layout.lm_head);
  return out;
}

std::vector<Fp8LinearShape> shapes_of(const std::vector<std::pair<int, Fp8LinearShape>>& linears) {
  std::vector<Fp8LinearShape> shapes;
  for (const auto& l : linears) shapes.push_back(l.second);
  return shapes;
}

}  // namespace

void DecoderModel::declare_activations(const ModelSpec& s, const ModelRuntime& rt,
                                       const std::vector<std::unique_ptr<DecoderLayer>>& layers,
                                       Activations& a, ActivationPlan& plan) {
  const int64_t N = rt.tokens(), C = s.hidden;
  const DType dt = rt.compute_dtype;
  a.resid.assign(s.num_layers + 1, Tensor{});
  for (Tensor& r : a.resid) plan.add(&r, dt, {N, C});
  for (size_t l = 0; l < layers.size(); ++l)
    layers[l]->declare_activations(plan, s, rt, full_recompute_layer(rt, static_cast<int64_t>(l)));
  for (const auto& layer : layers) layer->declare_backward_scratch(plan, rt);
  plan.add(&a.final_norm, dt, {N, C});
  plan.add(&a.final_rstd, DType::F32, {N});
  plan.add(&a.logits, dt, {std::min(N, rt.cross_entropy_chunk_tokens), s.vocab_size});
  plan.add(&a.losses, DType::F32, {N});
  plan.add(&a.loss_sum, DType::F32, {1});
  plan.add(&a.dresid, dt, {N, C});
  plan.add(&a.dnorm, dt, {N, C});
  plan.add(&a.tokens, DType::I32, {N});
  plan.add(&a.targets, DType::I32, {N});
  plan.add(&a.freqs, DType::F32, {rt.seq_length, s.head_dim});
}

ModelMemory DecoderModel::plan_memory(const ModelSpec& spec, const ModelRuntime& rt) {
  const auto layers = make_decoder_layers(spec);
  const ParamLayout layout = decoder_param_layout(spec, layers);
  ModelMemory m;
  const int64_t multiple = std::max<int64_t>(rt.flat_buffer_multiple, 1);
  const auto padded = static_cast<size_t>((layout.total + multiple - 1) / multiple * multiple);
  if (!rt.sharded_params) {
    m.weights = padded * dtype_size(rt.compute_dtype);
    m.gradients = padded * dtype_size(rt.grad_dtype);
  }
  ActivationPlan plan(rt.recompute == RecomputeGranularity::Selective);
  Activations acts;
  declare_activations(spec, rt, layers, acts, plan);
  m.activations = plan.bytes();
  if (rt.fp8.enabled())
    m.fp8 = Fp8Linears::plan_bytes(rt.fp8, shapes_of(fp8_linears(layout, layers, rt)), rt.tokens());
  return m;
}

DecoderModel::DecoderModel(Backend& backend, const ModelSpec& spec, const ModelRuntime& runtime)
    : backend_(backend),
      spec_(spec),
      runtime_(runtime),
      layers_(make_decoder_layers(spec)),
      layout_(decoder_param_layout(spec, layers_)) {
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

  ActivationPlan plan(runtime_.recompute == RecomputeGranularity::Selective);
  declare_activations(spec_, runtime_, layers_, a_, plan);
  TS_CHECK(plan.bytes() == mem.activations, "activation plan {} bytes, planned {}", plan.bytes(),
           mem.activations);
  act_buffer_ = DeviceBuffer(backend_, plan.bytes(), "activations");
  plan.bind(act_buffer_);

  const std::vector<float> table = tessera::rope_table(spec_, runtime_.seq_length);
  backend_.upload(a_.freqs, table.data());
  fp8_index_.assign(layout_.params.size(), -1);
  if (runtime_.fp8.enabled()) {
    const auto linears = fp8_linears(layout_, layers_, runtime_);
    for (size_t i = 0; i < linears.size(); ++i) fp8_index_[linears[i].first] = static_cast<int>(i);
    fp8_ =
        std::make_unique<Fp8Linears>(backend_, runtime_.fp8, shapes_of(linears), runtime_.tokens());
  }
  std::vector<char> gemm_written(layout_.params.size(), 0);
  for (const auto& layer : layers_)
    for (int i : layer->linear_weights()) gemm_written[i] = 1;
  // A tied head's gradient is the embedding's, which the embedding backward adds to.
  if (!tied()) gemm_written[layout_.lm_head] = 1;
  for (size_t i = 0; i < layout_.params.size(); ++i) {
    if (gemm_written[i]) continue;
    const ParamInfo& p = layout_.params[i];
    if (!accumulated_grad_ranges_.empty() && accumulated_grad_ranges_.back().end >= p.offset)
      accumulated_grad_ranges_.back().end = p.offset + p.numel();
    else
      accumulated_grad_ranges_.push_back({p.offset, p.offset + p.numel()});
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
  TS_CHECK(size == runtime_.expert_parallel_size,
           "an expert exchange over {} ranks for a model planned for {}", size,
           runtime_.expert_parallel_size);
  expert_exchange_ = exchange;
}

void DecoderModel::update_persistent_state() {
  for (auto& layer : layers_) layer->update_state(backend_);
}

void DecoderModel::bind_stats() {
  int64_t width = 0;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const int64_t w = layers_[l]->stats_width();
    if (w == 0) continue;
    TS_CHECK(width == 0 || w == width, "layer {} keeps {} statistics, others {}", l, w, width);
    width = w;
    moe_layers_.push_back(static_cast<int64_t>(l));
  }
  if (moe_layers_.empty()) return;
  const int64_t rows = static_cast<int64_t>(moe_layers_.size());
  stats_buffer_ =
      DeviceBuffer(backend_, static_cast<size_t>(rows * width) * sizeof(float), "moe statistics");
  moe_stats_ = stats_buffer_.tensor(DType::F32, {rows, width});
  for (int64_t i = 0; i < rows; ++i)
    layers_[moe_layers_[i]]->bind_stats(moe_stats_.flat_range(i * width, width));
}

bool DecoderModel::recomputes_fully(int64_t layer) const {
  return full_recompute_layer(runtime_, layer);
}

Tensor DecoderModel::param(int index) const {
  const ParamInfo& p = layout_.params[index];
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

// A new step's gradients: also the start of the step's FP8 non-finite check. Sharded, the
// observer starts each unit's gradients itself and every GEMM accumulates.
void DecoderModel::zero_grads() {
  if (!runtime_.sharded_params)
    for (const ParamRange& r : accumulated_grad_ranges_)
      backend_.fill(grads_.flat_range(r.begin, r.count()), 0.0f);
  grad_written_.assign(layout_.params.size(), runtime_.sharded_params ? 1 : 0);
  if (fp8_) fp8_->clear_status();
}

void DecoderModel::params_needed(int unit, int next) {
  if (observer_) observer_->params_needed(unit, next);
}
void DecoderModel::params_done(int unit) {
  if (observer_) observer_->params_done(unit);
}
void DecoderModel::grads_needed(int unit) {
  if (observer_) observer_->grads_needed(unit);
}
void DecoderModel::grads_ready(int unit) {
  if (observer_) observer_->grads_ready(unit);
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
}
void DecoderModel::zero_loss_sum() {
  backend_.fill(a_.loss_sum, 0.0f);
  if (moe_stats_.defined()) backend_.fill(moe_stats_, 0.0f);
}

void DecoderModel::set_batch(const int32_t* tokens, const int32_t* targets) {
  backend_.upload(a_.tokens, tokens);
  backend_.upload(a_.targets, targets);
}

// The residual rides on the GEMM's beta, on the tensor-parallel rank that owns the output's
// sum (model.h): a separate add would be one more pass over the (N, C) states per block.
void DecoderModel::linear(const Tensor& out, const Tensor& in, int weight, int bias,
                          const Tensor& residual) {
  const bool row_partial =
      layout_.params[weight].tp == TensorParallelStyle::Row && runtime_.tensor_parallel_rank != 0;
  const bool add_residual = residual.defined() && !row_partial;
  const float beta = add_residual ? 1.0f : 0.0f;
  const Tensor c = add_residual ? residual : Tensor{};
  if (fp8_index_[weight] >= 0) {
    fp8_->forward(fp8_index_[weight], out, in, param(weight), bias >= 0 ? param(bias) : Tensor{},
                  beta, c);
    return;
  }
  MatmulArgs m;
  m.out = out;
  m.a = in;
  m.b = param(weight);
  m.trans_b = true;
  m.beta = beta;
  m.c = c;
  if (bias >= 0) m.bias = param(bias);
  backend_.matmul(m);
}

void DecoderModel::linear_backward(const Tensor& din, const Tensor& dout, const Tensor& in,
                                   int weight, int bias) {
  const float grad_beta = grad_written_[weight] ? 1.0f : 0.0f;
  grad_written_[weight] = 1;
  if (fp8_index_[weight] >= 0) {
    fp8_->backward(fp8_index_[weight], din, dout, in, param(weight), grad(weight), grad_beta);
    if (bias >= 0) backend_.bias_backward(grad(bias), dout);
    return;
  }
  if (din.defined()) {
    MatmulArgs m;
    m.out = din;
    m.a = dout;
    m.b = param(weight);
    backend_.matmul(m);
  }
  MatmulArgs w;
  w.out = grad(weight);
  w.a = dout;
  w.trans_a = true;
  w.b = in;
  w.beta = grad_beta;
  backend_.matmul(w);
  if (bias >= 0) backend_.bias_backward(grad(bias), dout);
}

// Units are read in forward order, each followed by the next (layer l is unit l + 1; the
// last layer is followed by the tail).
void DecoderModel::embed() {
  params_needed(0, 1);
  {
    ScopedRange r(backend_, "embedding_forward");
    backend_.embedding_forward(a_.resid[0], a_.tokens, param(layout_.embedding));
  }
  params_done(0);
}

// Final norm, output head and cross-entropy, chunked over tokens so that only
// chunk x vocab logits ever exist. With gradients, each chunk's d(logits) overwrites its
// logits and is consumed at once: the head's backward runs inside the forward pass.
void DecoderModel::head_forward(bool with_grad, float grad_scale) {
  const int tail = layout_.tail_unit();
  // With gradients the backward's first layer follows (unit tail - 1, unless there is none).
  tail_params_needed(with_grad && tail > 1 ? tail - 1 : -1);
  if (with_grad) {
    grads_needed(tail);
    if (tied()) grads_needed(0);
  }
  ScopedRange r(backend_, "output_head");
  const int64_t N = runtime_.tokens();
  const Tensor& x = a_.resid[spec_.num_layers];
  backend_.rmsnorm_forward(a_.final_norm, a_.final_rstd, x, param(layout_.final_norm),
                           spec_.norm_eps);
  const int64_t chunk = a_.logits.dim(0);
  for (int64_t c = 0; c < N; c += chunk) {
    const int64_t n = std::min(chunk, N - c);
    const Tensor logits = a_.logits.rows(0, n);
    const Tensor xn = a_.final_norm.rows(c, c + n);
    linear(logits, xn, layout_.lm_head, -1, {});
    backend_.cross_entropy(a_.losses.rows(c, c + n), logits, a_.targets.rows(c, c + n),
                           with_grad ? logits : Tensor{}, grad_scale);
    if (with_grad) linear_backward(a_.dnorm.rows(c, c + n), logits, xn, layout_.lm_head, -1);
  }
  backend_.sum(a_.loss_sum, a_.losses, /*accumulate=*/true);
  if (with_grad) {
    backend_.fill(a_.dresid, 0.0f);
    backend_.rmsnorm_backward(a_.dresid, grad(layout_.final_norm), a_.dnorm, x,
                              param(layout_.final_norm), a_.final_rstd);
  }
  tail_params_done();
  if (with_grad) grads_ready(tail);
}

void DecoderModel::forward_layers() {
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    ScopedRange r(backend_, "layer_forward");
    const int unit = static_cast<int>(l) + 1;
    params_needed(unit, unit + 1);
    layers_[l]->forward(*this, a_.resid[l], a_.resid[l + 1]);
    params_done(unit);
  }
}

void DecoderModel::forward_backward(float grad_scale) {
  grad_scale_ = grad_scale;
  embed();
  forward_layers();
  head_forward(true, grad_scale);
  // Backward order: layer l's unit is followed by layer l - 1's; the embedding's backward
  // reads no parameters.
  for (int64_t l = spec_.num_layers - 1; l >= 0; --l) {
    const int unit = static_cast<int>(l) + 1;
    params_needed(unit, unit > 1 ? unit - 1 : -1);
    grads_needed(unit);
    {
      ScopedRange r(backend_, "layer_backward");
      if (recomputes_fully(l)) {
        // Named so that a trace's step breakdown can tell recompute from the first forward.
        ScopedRange rr(backend_, "recompute");
        layers_[l]->recompute(*this, a_.resid[l]);
      }
      layers_[l]->backward(*this, a_.resid[l], a_.dresid);
    }
    params_done(unit);
    grads_ready(unit);
  }
  if (!tied()) grads_needed(0);
  {
    ScopedRange r(backend_, "embedding_backward");
    backend_.embedding_backward(grad(layout_.embedding), a_.dresid, a_.tokens);
  }
  grads_ready(0);
}

void DecoderModel::forward_loss() {
  embed();
  forward_layers();
  head_forward(false, 0.0f);
}

void DecoderModel::forward_logits(const Tensor& logits) {
  embed();
  forward_layers();
  tail_params_needed(-1);
  backend_.rmsnorm_forward(a_.final_norm, a_.final_rstd, a_.resid[spec_.num_layers],
                           param(layout_.final_norm), spec_.norm_eps);
  linear(logits, a_.final_norm, layout_.lm_head, -1, {});
  tail_params_done();
}

}  // namespace tessera
