#include "tessera/model/llama_model.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "tessera/core/error.h"
#include "tessera/model/rope.h"

namespace tessera {
namespace {

constexpr size_t kArenaAlign = 256;

// Lays tensors out back to back in one allocation; bind() points them at the real buffer.
class ArenaPlan {
 public:
  void add(Tensor* t, DType dtype, Shape shape) {
    items_.push_back({t, dtype, shape, bytes_});
    const size_t n = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
    bytes_ += (n + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
  }
  size_t bytes() const { return bytes_; }
  void bind(const DeviceBuffer& buffer) const {
    for (const auto& it : items_) *it.target = buffer.tensor(it.dtype, it.shape, it.offset);
  }

 private:
  struct Item {
    Tensor* target;
    DType dtype;
    Shape shape;
    size_t offset;
  };
  std::vector<Item> items_;
  size_t bytes_ = 0;
};

// A layer's linear weights: the parameters its GEMMs multiply by.
std::array<int, 4> linear_weights(const LayerParamIndex& l) {
  return {l.qkv_weight, l.o_proj, l.gate_up, l.down_proj};
}

// The weights that run as FP8 GEMMs, as (parameter index, shape), in model order.
std::vector<std::pair<int, Fp8LinearShape>> fp8_linears(const ParamLayout& layout,
                                                         const ModelRuntime& rt) {
  std::vector<std::pair<int, Fp8LinearShape>> out;
  if (!rt.fp8.enabled()) return out;
  auto add = [&](int index) {
    const ParamInfo& p = layout.params[index];
    out.push_back({index, {p.name, p.shape[0], p.shape[1]}});
  };
  for (const LayerParamIndex& l : layout.layers)
    for (int index : linear_weights(l)) add(index);
  if (rt.fp8.lm_head) add(layout.lm_head);
  return out;
}

std::vector<Fp8LinearShape> shapes_of(const std::vector<std::pair<int, Fp8LinearShape>>& linears) {
  std::vector<Fp8LinearShape> shapes;
  for (const auto& l : linears) shapes.push_back(l.second);
  return shapes;
}

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

class ScopedRange {
 public:
  ScopedRange(Backend& b, const char* name) : b_(b) { b_.range_push(name); }
  ~ScopedRange() { b_.range_pop(); }

 private:
  Backend& b_;
};

}  // namespace

// Declares every activation of the model in one arena and returns its size; binds the
// tensors to `bind_to` when given. Tensors of full-recompute layers alias the single
// recompute scratch set; with selective recompute, the norm outputs and the SwiGLU output of
// every layer alias one scratch tensor that backward refills just before each use.
size_t LlamaModel::declare_activations(const ModelSpec& s, const ModelRuntime& rt,
                                       Activations& a, const DeviceBuffer* bind_to) {
  ArenaPlan plan;
  const int64_t N = rt.micro_batch * rt.seq_length;
  const int64_t C = s.hidden, F = s.ffn, L = s.num_layers;
  const DType dt = rt.compute_dtype;
  const bool selective = rt.recompute == RecomputeGranularity::Selective;

  a.resid.assign(L + 1, Tensor{});
  for (auto& r : a.resid) plan.add(&r, dt, {N, C});
  auto declare_layer = [&](LayerActs& la) {
    plan.add(&la.x_mid, dt, {N, C});
    plan.add(&la.rstd1, DType::F32, {N});
    plan.add(&la.qkv, dt, {N, s.qkv_width()});
    plan.add(&la.att, dt, {N, s.attn_width()});
    plan.add(&la.lse, DType::F32, {rt.micro_batch, s.heads, rt.seq_length});
    plan.add(&la.rstd2, DType::F32, {N});
    plan.add(&la.gate_up, dt, {N, 2 * F});
    if (!selective) {
      plan.add(&la.ln1, dt, {N, C});
      plan.add(&la.ln2, dt, {N, C});
      plan.add(&la.h, dt, {N, F});
    }
  };
  a.stored.assign(L, LayerActs{});
  bool any_full = false;
  for (int64_t l = 0; l < L; ++l) {
    if (full_recompute_layer(rt, l)) {
      any_full = true;
    } else {
      declare_layer(a.stored[l]);
    }
  }
  if (any_full) declare_layer(a.scratch);
  if (selective) plan.add(&a.norm_scratch, dt, {N, std::max(C, F)});

  plan.add(&a.final_norm, dt, {N, C});
  plan.add(&a.final_rstd, DType::F32, {N});
  plan.add(&a.logits, dt, {std::min(N, rt.cross_entropy_chunk_tokens), s.vocab_size});
  plan.add(&a.losses, DType::F32, {N});
  plan.add(&a.loss_sum, DType::F32, {1});
  plan.add(&a.dresid, dt, {N, C});
  plan.add(&a.dnorm, dt, {N, C});
  plan.add(&a.grad_a, dt, {N * std::max(F, s.attn_width())});
  plan.add(&a.grad_b, dt, {N * std::max(2 * F, s.qkv_width())});
  plan.add(&a.tokens, DType::I32, {N});
  plan.add(&a.targets, DType::I32, {N});
  plan.add(&a.freqs, DType::F32, {rt.seq_length, s.head_dim});
  if (!bind_to) return plan.bytes();

  plan.bind(*bind_to);
  if (selective) {
    const Tensor nc = a.norm_scratch.flat_range(0, N * C).view({N, C});
    const Tensor nf = a.norm_scratch.flat_range(0, N * F).view({N, F});
    a.scratch.ln1 = a.scratch.ln2 = nc;
    a.scratch.h = nf;
    for (auto& la : a.stored) la.ln1 = la.ln2 = nc, la.h = nf;
  }
  for (int64_t l = 0; l < L; ++l)
    if (full_recompute_layer(rt, l)) a.stored[l] = a.scratch;
  return plan.bytes();
}

ModelMemory LlamaModel::plan_memory(const ModelSpec& spec, const ModelRuntime& rt) {
  const ParamLayout layout = make_param_layout(spec);
  Activations acts;
  ModelMemory m;
  const int64_t multiple = std::max<int64_t>(rt.flat_buffer_multiple, 1);
  const auto padded = static_cast<size_t>((layout.total + multiple - 1) / multiple * multiple);
  if (!rt.sharded_params) {
    m.weights = padded * dtype_size(rt.compute_dtype);
    m.gradients = padded * sizeof(float);
  }
  m.activations = declare_activations(spec, rt, acts, nullptr);
  if (rt.fp8.enabled())
    m.fp8 = Fp8Linears::plan_bytes(rt.fp8, shapes_of(fp8_linears(layout, rt)),
                                   rt.micro_batch * rt.seq_length);
  return m;
}

LlamaModel::LlamaModel(Backend& backend, const ModelSpec& spec, const ModelRuntime& runtime)
    : backend_(backend), spec_(spec), runtime_(runtime), layout_(make_param_layout(spec)) {
  const ModelMemory mem = plan_memory(spec, runtime);
  unit_params_.resize(layout_.units.size());
  unit_grads_.resize(layout_.units.size());
  if (!runtime_.sharded_params) {
    param_buffer_ = DeviceBuffer(backend_, mem.weights, "parameters");
    grad_buffer_ = DeviceBuffer(backend_, mem.gradients, "gradients");
    params_ = param_buffer_.tensor(runtime_.compute_dtype, {layout_.total});
    grads_ = grad_buffer_.tensor(DType::F32, {layout_.total});
    for (size_t u = 0; u < layout_.units.size(); ++u) {
      const ParamRange& r = layout_.units[u];
      unit_params_[u] = params_.flat_range(r.begin, r.count());
      unit_grads_[u] = grads_.flat_range(r.begin, r.count());
    }
    backend_.fill(params_, 0.0f);
    backend_.fill(grads_, 0.0f);  // alignment gaps between tensors stay zero from here on
  }

  act_buffer_ = DeviceBuffer(backend_, mem.activations, "activations");
  declare_activations(spec_, runtime_, a_, &act_buffer_);

  const std::vector<float> table = rope_table(spec_, runtime_.seq_length);
  backend_.upload(a_.freqs, table.data());
  fp8_index_.assign(layout_.params.size(), -1);
  if (runtime_.fp8.enabled()) {
    const auto linears = fp8_linears(layout_, runtime_);
    for (size_t i = 0; i < linears.size(); ++i) fp8_index_[linears[i].first] = static_cast<int>(i);
    fp8_ = std::make_unique<Fp8Linears>(backend_, runtime_.fp8, shapes_of(linears),
                                        runtime_.micro_batch * runtime_.seq_length);
  }
  std::vector<char> gemm_written(layout_.params.size(), 0);
  for (const LayerParamIndex& l : layout_.layers)
    for (int i : linear_weights(l)) gemm_written[i] = 1;
  // A tied head's gradient is the embedding's, which the embedding backward adds to.
  if (layout_.lm_head != layout_.embedding) gemm_written[layout_.lm_head] = 1;
  for (size_t i = 0; i < layout_.params.size(); ++i) {
    if (gemm_written[i]) continue;
    const ParamInfo& p = layout_.params[i];
    if (!accumulated_grad_ranges_.empty() && accumulated_grad_ranges_.back().end >= p.offset)
      accumulated_grad_ranges_.back().end = p.offset + p.numel();
    else
      accumulated_grad_ranges_.push_back({p.offset, p.offset + p.numel()});
  }
  zero_grads();
  zero_loss_sum();
}

bool LlamaModel::recomputes_fully(int64_t layer) const {
  return full_recompute_layer(runtime_, layer);
}

Tensor LlamaModel::param(int index) const {
  const ParamInfo& p = layout_.params[index];
  const int64_t at = p.offset - layout_.units[p.unit].begin;
  return unit_params_[p.unit].flat_range(at, p.numel()).view(p.shape);
}

Tensor LlamaModel::grad(int index) const {
  const ParamInfo& p = layout_.params[index];
  const int64_t at = p.offset - layout_.units[p.unit].begin;
  return unit_grads_[p.unit].flat_range(at, p.numel()).view(p.shape);
}

void LlamaModel::bind_unit_params(int unit, const Tensor& params) {
  TS_CHECK(runtime_.sharded_params, "parameters are bound only with sharded_params");
  check_unit_binding(params, runtime_.compute_dtype, layout_.units[unit], unit, "parameters");
  unit_params_[unit] = params;
}

void LlamaModel::bind_unit_grads(int unit, const Tensor& grads) {
  TS_CHECK(runtime_.sharded_params, "gradients are bound only with sharded_params");
  check_unit_binding(grads, DType::F32, layout_.units[unit], unit, "gradients");
  unit_grads_[unit] = grads;
}

// A new step's gradients: also the start of the step's FP8 non-finite check. Sharded, the
// observer starts each unit's gradients itself and every GEMM accumulates.
void LlamaModel::zero_grads() {
  if (!runtime_.sharded_params)
    for (const ParamRange& r : accumulated_grad_ranges_)
      backend_.fill(grads_.flat_range(r.begin, r.count()), 0.0f);
  grad_written_.assign(layout_.params.size(), runtime_.sharded_params ? 1 : 0);
  if (fp8_) fp8_->clear_status();
}

void LlamaModel::params_needed(int unit, int next) {
  if (observer_) observer_->params_needed(unit, next);
}
void LlamaModel::params_done(int unit) {
  if (observer_) observer_->params_done(unit);
}
void LlamaModel::grads_needed(int unit) {
  if (observer_) observer_->grads_needed(unit);
}
void LlamaModel::grads_ready(int unit) {
  if (observer_) observer_->grads_ready(unit);
}

// The tail reads the embedding table too when the head is tied to it.
void LlamaModel::tail_params_needed(int next) {
  params_needed(layout_.tail_unit(), tied() ? 0 : next);
  if (tied()) params_needed(0, next);
}

void LlamaModel::tail_params_done() {
  params_done(layout_.tail_unit());
  if (tied()) params_done(0);
}

void LlamaModel::params_updated() {
  if (fp8_) fp8_->weights_changed();
}
void LlamaModel::zero_loss_sum() { backend_.fill(a_.loss_sum, 0.0f); }

void LlamaModel::set_batch(const int32_t* tokens, const int32_t* targets) {
  backend_.upload(a_.tokens, tokens);
  backend_.upload(a_.targets, targets);
}

AttentionShape LlamaModel::attention_shape() const {
  AttentionShape s;
  s.batch = runtime_.micro_batch;
  s.seq = runtime_.seq_length;
  s.heads = spec_.heads;
  s.kv_heads = spec_.kv_heads;
  s.head_dim = spec_.head_dim;
  s.causal = true;
  s.window = spec_.sliding_window;
  s.scale = 1.0f / std::sqrt(static_cast<float>(spec_.head_dim));
  return s;
}

// out = in @ W^T (+ bias) (+ beta * residual): the residual add of the attention output and
// MLP down projections rides on the GEMM's beta instead of a separate pass.
void LlamaModel::linear(const Tensor& out, const Tensor& in, int weight, int bias, float beta,
                        const Tensor& residual) {
  if (fp8_index_[weight] >= 0) {
    fp8_->forward(fp8_index_[weight], out, in, param(weight), bias >= 0 ? param(bias) : Tensor{},
                  beta, residual);
    return;
  }
  MatmulArgs m;
  m.out = out;
  m.a = in;
  m.b = param(weight);
  m.trans_b = true;
  m.beta = beta;
  m.c = residual;
  if (bias >= 0) m.bias = param(bias);
  backend_.matmul(m);
}

// din = dout @ W (skipped when din is undefined); dW += dout^T @ in (dW = ... for the step's
// first contribution); dbias += colsum(dout).
void LlamaModel::linear_backward(const Tensor& din, const Tensor& dout, const Tensor& in,
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
void LlamaModel::embed() {
  params_needed(0, 1);
  {
    ScopedRange r(backend_, "embedding_forward");
    backend_.embedding_forward(a_.resid[0], a_.tokens, param(layout_.embedding));
  }
  params_done(0);
}

void LlamaModel::layer_forward(int64_t l, const LayerActs& a) {
  const int unit = static_cast<int>(l) + 1;
  params_needed(unit, unit + 1);
  recompute_layer(l, a);
  {
    ScopedRange r(backend_, "mlp_down");
    linear(a_.resid[l + 1], a.h, layout_.layers[l].down_proj, -1, 1.0f, a.x_mid);
  }
  params_done(unit);
}

// Everything of the layer's forward except the final down projection (whose output, the
// next residual state, is always stored).
void LlamaModel::recompute_layer(int64_t l, const LayerActs& a) {
  const LayerParamIndex& p = layout_.layers[l];
  const AttentionShape s = attention_shape();
  const Tensor& x_in = a_.resid[l];
  {
    ScopedRange r(backend_, "attention_block");
    backend_.rmsnorm_forward(a.ln1, a.rstd1, x_in, param(p.attn_norm), spec_.norm_eps);
    linear(a.qkv, a.ln1, p.qkv_weight, p.qkv_bias, 0.0f, {});
    backend_.rope_forward(a.qkv, a_.freqs, s);
    backend_.attention_forward(a.att, a.lse, a.qkv, s);
    linear(a.x_mid, a.att, p.o_proj, -1, 1.0f, x_in);
  }
  ScopedRange r(backend_, "mlp_block");
  backend_.rmsnorm_forward(a.ln2, a.rstd2, a.x_mid, param(p.mlp_norm), spec_.norm_eps);
  linear(a.gate_up, a.ln2, p.gate_up, -1, 0.0f, {});
  backend_.swiglu_forward(a.h, a.gate_up);
}

// On entry dresid holds d(loss)/d(resid[l+1]); on exit d(loss)/d(resid[l]).
void LlamaModel::layer_backward(int64_t l, const LayerActs& a) {
  const LayerParamIndex& p = layout_.layers[l];
  const AttentionShape s = attention_shape();
  const int64_t N = runtime_.micro_batch * runtime_.seq_length;
  const bool selective = runtime_.recompute == RecomputeGranularity::Selective;
  {
    ScopedRange r(backend_, "mlp_block_backward");
    if (selective) backend_.swiglu_forward(a.h, a.gate_up);
    const Tensor dh = a_.grad_a.flat_range(0, N * spec_.ffn).view({N, spec_.ffn});
    const Tensor dgu = a_.grad_b.flat_range(0, N * 2 * spec_.ffn).view({N, 2 * spec_.ffn});
    linear_backward(dh, a_.dresid, a.h, p.down_proj, -1);
    backend_.swiglu_backward(dgu, dh, a.gate_up);
    if (selective)
      backend_.rmsnorm_forward(a.ln2, a.rstd2, a.x_mid, param(p.mlp_norm), spec_.norm_eps);
    linear_backward(a_.dnorm, dgu, a.ln2, p.gate_up, -1);
    backend_.rmsnorm_backward(a_.dresid, grad(p.mlp_norm), a_.dnorm, a.x_mid, param(p.mlp_norm),
                              a.rstd2);
  }
  ScopedRange r(backend_, "attention_block_backward");
  const Tensor datt = a_.grad_a.flat_range(0, N * spec_.attn_width()).view({N, spec_.attn_width()});
  const Tensor dqkv = a_.grad_b.flat_range(0, N * spec_.qkv_width()).view({N, spec_.qkv_width()});
  linear_backward(datt, a_.dresid, a.att, p.o_proj, -1);
  backend_.attention_backward(dqkv, datt, a.att, a.lse, a.qkv, s);
  backend_.rope_backward(dqkv, a_.freqs, s);
  if (selective)
    backend_.rmsnorm_forward(a.ln1, a.rstd1, a_.resid[l], param(p.attn_norm), spec_.norm_eps);
  linear_backward(a_.dnorm, dqkv, a.ln1, p.qkv_weight, p.qkv_bias);
  backend_.rmsnorm_backward(a_.dresid, grad(p.attn_norm), a_.dnorm, a_.resid[l], param(p.attn_norm),
                            a.rstd1);
}

// Final norm, output head and cross-entropy, chunked over tokens so that only
// chunk x vocab logits ever exist. With gradients, each chunk's d(logits) overwrites its
// logits and is consumed at once: the head's backward runs inside the forward pass.
void LlamaModel::head_forward(bool with_grad, float grad_scale) {
  const int tail = layout_.tail_unit();
  // With gradients the backward's first layer follows (unit tail - 1, unless there is none).
  tail_params_needed(with_grad && tail > 1 ? tail - 1 : -1);
  if (with_grad) {
    grads_needed(tail);
    if (tied()) grads_needed(0);
  }
  ScopedRange r(backend_, "output_head");
  const int64_t N = runtime_.micro_batch * runtime_.seq_length;
  const Tensor& x = a_.resid[spec_.num_layers];
  backend_.rmsnorm_forward(a_.final_norm, a_.final_rstd, x, param(layout_.final_norm), spec_.norm_eps);
  const int64_t chunk = a_.logits.dim(0);
  for (int64_t c = 0; c < N; c += chunk) {
    const int64_t n = std::min(chunk, N - c);
    const Tensor logits = a_.logits.rows(0, n);
    const Tensor xn = a_.final_norm.rows(c, c + n);
    linear(logits, xn, layout_.lm_head, -1, 0.0f, {});
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

void LlamaModel::forward_backward(float grad_scale) {
  embed();
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    ScopedRange r(backend_, "layer_forward");
    layer_forward(l, a_.stored[l]);
  }
  head_forward(true, grad_scale);
  // Backward order: layer l's unit is followed by layer l - 1's; the embedding's backward
  // reads no parameters.
  for (int64_t l = spec_.num_layers - 1; l >= 0; --l) {
    const int unit = static_cast<int>(l) + 1;
    params_needed(unit, unit > 1 ? unit - 1 : -1);
    grads_needed(unit);
    {
      ScopedRange r(backend_, "layer_backward");
      if (recomputes_fully(l)) recompute_layer(l, a_.stored[l]);
      layer_backward(l, a_.stored[l]);
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

void LlamaModel::forward_loss() {
  embed();
  for (int64_t l = 0; l < spec_.num_layers; ++l) layer_forward(l, a_.stored[l]);
  head_forward(false, 0.0f);
}

void LlamaModel::forward_logits(const Tensor& logits) {
  embed();
  for (int64_t l = 0; l < spec_.num_layers; ++l) layer_forward(l, a_.stored[l]);
  tail_params_needed(-1);
  backend_.rmsnorm_forward(a_.final_norm, a_.final_rstd, a_.resid[spec_.num_layers],
                           param(layout_.final_norm), spec_.norm_eps);
  linear(logits, a_.final_norm, layout_.lm_head, -1, 0.0f, {});
  tail_params_done();
}

}  // namespace tessera
