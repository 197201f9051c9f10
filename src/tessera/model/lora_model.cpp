#include "tessera/model/lora_model.h"

#include <algorithm>
#include <cstring>

#include "tessera/core/error.h"

namespace tessera {
namespace {

// Elements of each buffer a LoraModel allocates.
struct Sizes {
  int64_t frozen = 0;      // the base weights (compute dtype)
  int64_t base_grads = 0;  // the largest unit: the base's gradient writes (compute dtype)
  int64_t adapters = 0;    // the adapters and their gradients, padded for data parallelism
  int64_t stacked = 0;     // the largest stacked A's gradient: pieces x r x cols
  int64_t diagonal = 0;    // the largest diagonal B's gradient: rows x pieces x r
  int64_t per_token = 0;   // tokens x the most pieces x r: x A^T, dy B
  int64_t piece = 0;       // the largest B: one piece's gradient, cut out
  size_t fused_bytes = 0;  // every fused weight's stacked A and diagonal B (compute dtype, aligned)
  // The GEMM scratch: x A^T and dy B in the compute dtype; the stacked gradients and a piece cut
  // out in the gradient dtype; each of the 5 aligned to 16 bytes (at most 15 bytes beyond its
  // size).
  size_t scratch_bytes(DType compute, DType grad) const {
    return static_cast<size_t>(2 * per_token) * dtype_size(compute) +
           static_cast<size_t>(stacked + diagonal + piece) * dtype_size(grad) + 5 * 16;
  }
};

size_t aligned16(int64_t elements, DType dtype) {
  return (static_cast<size_t>(elements) * dtype_size(dtype) + 15) / 16 * 16;
}

Sizes sizes(const ParamLayout& base, const ParamLayout& adapters, const std::vector<LoraAdapted>& adapted,
            const ModelRuntime& runtime, int64_t rank) {
  Sizes n;
  n.frozen = runtime.sharded_params ? 0 : base.total;
  for (const ParamRange& u : base.units) n.base_grads = std::max(n.base_grads, u.count());
  std::vector<int64_t> pieces(base.params.size(), 0);
  for (const LoraAdapted& a : adapted) {
    ++pieces[a.base_weight];
    n.piece = std::max(n.piece, a.rows * rank);
  }
  for (size_t w = 0; w < base.params.size(); ++w) {
    if (pieces[w] == 0) continue;
    const int64_t r = pieces[w] * rank, rows = base.params[w].shape[0], cols = base.params[w].shape[1];
    n.stacked = std::max(n.stacked, r * cols);
    n.diagonal = std::max(n.diagonal, rows * r);
    n.per_token = std::max(n.per_token, runtime.tokens() * r);
    if (pieces[w] > 1)
      n.fused_bytes += aligned16(r * cols, runtime.compute_dtype) + aligned16(rows * r, runtime.compute_dtype);
  }
  const int64_t multiple = std::max<int64_t>(runtime.flat_buffer_multiple, 1);
  n.adapters = (adapters.total + multiple - 1) / multiple * multiple;
  return n;
}

// The base's runtime: no buffers of its own, its (unread) gradients in the compute dtype.
ModelRuntime base_runtime(const ModelRuntime& runtime) {
  ModelRuntime rt = runtime;
  rt.sharded_params = true;
  rt.fp8_unit_copies = false;  // its units are bound by the LoRA model, gathered or not
  rt.grad_dtype = runtime.compute_dtype;
  return rt;
}

MatmulArgs gemm(const Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha,
                float beta) {
  MatmulArgs m;
  m.out = out;
  m.a = a;
  m.trans_a = trans_a;
  m.b = b;
  m.trans_b = trans_b;
  m.alpha = alpha;
  m.beta = beta;
  return m;
}

}  // namespace

// Binds the base's units as it reads and writes them, after telling the outer observer (data
// parallelism), so that the adapters are current before the unit's pass reads them.
class LoraModel::BaseObserver : public ParamUnitObserver {
 public:
  explicit BaseObserver(LoraModel& m) : m_(m) {}
  void params_needed(int unit, int next) override {
    if (m_.outer_) m_.outer_->params_needed(unit, next);
    m_.bind_params(unit, next);
  }
  void params_done(int unit) override {
    if (m_.outer_) m_.outer_->params_done(unit);
    m_.params_done(unit);
  }
  void grads_needed(int unit) override {
    if (m_.outer_) m_.outer_->grads_needed(unit);
    m_.bind_grads(unit);
  }
  void grads_ready(int unit) override {
    if (m_.outer_) m_.outer_->grads_ready(unit);
  }

 private:
  LoraModel& m_;
};

ModelMemory LoraModel::plan_memory(const ModelSpec& spec, const ModelRuntime& runtime, const LoraOptions& options) {
  const ModelRuntime rt = base_runtime(runtime);
  ModelMemory m = DecoderModel::plan_memory(spec, rt);
  const ParamLayout base = DecoderModel::plan_layout(spec, rt);
  const LoraLayout lora = make_lora_layout(spec, base, options);
  const Sizes n = sizes(base, lora.adapters, lora.adapted, runtime, options.rank);
  m.weights = static_cast<size_t>(n.frozen + n.adapters) * dtype_size(runtime.compute_dtype);
  m.gradients = static_cast<size_t>(n.base_grads) * dtype_size(runtime.compute_dtype) +
                static_cast<size_t>(n.adapters) * dtype_size(runtime.grad_dtype);
  m.activations += n.scratch_bytes(runtime.compute_dtype, runtime.grad_dtype) + n.fused_bytes;
  return m;
}

LoraModel::LoraModel(Backend& backend, const ModelSpec& spec, const ModelRuntime& runtime,
                     LoraOptions options)
    : backend_(backend), runtime_(runtime), options_(std::move(options)) {
  TS_CHECK(runtime.pipeline_chunks.empty() && runtime.expert_parallel_size == 1,
           "LoRA runs on whole model replicas, their tensor-parallel parts and context-parallel shares");
  TS_CHECK(options_.rank > 0 && !options_.targets.empty(), "LoRA: rank {} and {} targets",
           options_.rank, options_.targets.size());
  base_ = std::make_unique<DecoderModel>(backend, spec, base_runtime(runtime));
  if (base_->moe_stats().defined())
    moe_balance_ = std::make_unique<MoeBalanceHook>(backend, base_->moe_stats(), base_->moe_layers(),
                                                    spec.moe.experts, runtime.moe_force_balance,
                                                    /*update_state=*/nullptr);
  const ParamLayout& base = base_->layout();
  LoraLayout lora = make_lora_layout(spec, base, options_);
  layout_ = std::move(lora.adapters);
  adapted_ = std::move(lora.adapted);
  group_of_.assign(base.params.size(), -1);
  for (size_t k = 0; k < adapted_.size(); ++k) {
    const int w = adapted_[k].base_weight;
    if (group_of_[w] < 0) {
      group_of_[w] = static_cast<int>(groups_.size());
      Group& g = groups_.emplace_back();
      g.rows = base.params[w].shape[0];
      g.cols = base.params[w].shape[1];
    }
    groups_[group_of_[w]].pieces.push_back(static_cast<int>(k));
  }

  const Sizes n = sizes(base, layout_, adapted_, runtime, options_.rank);
  const DType compute = runtime.compute_dtype, grad = runtime.grad_dtype;
  frozen_buffer_ = DeviceBuffer(backend, n.frozen * dtype_size(compute), "LoRA frozen base weights");
  base_grad_buffer_ = DeviceBuffer(backend, n.base_grads * dtype_size(compute), "LoRA base gradient scratch");
  param_buffer_ = DeviceBuffer(backend, n.adapters * dtype_size(compute), "LoRA adapters");
  grad_buffer_ = DeviceBuffer(backend, n.adapters * dtype_size(grad), "LoRA adapter gradients");
  frozen_ = frozen_buffer_.tensor(compute, {n.frozen});
  base_grads_ = base_grad_buffer_.tensor(compute, {n.base_grads});
  params_ = param_buffer_.tensor(compute, {layout_.total});
  grads_ = grad_buffer_.tensor(grad, {layout_.total});
  scratch_buffer_ = DeviceBuffer(backend, n.scratch_bytes(compute, grad), "LoRA GEMM scratch");
  size_t at = 0;
  auto take = [&](DType d, int64_t count) {
    const Tensor t = scratch_buffer_.tensor(d, {std::max<int64_t>(count, 1)}, at);
    at += aligned16(count, d);
    return t;
  };
  fused_buffer_ = DeviceBuffer(backend, n.fused_bytes, "LoRA fused adapters");
  size_t fused_at = 0;
  for (Group& g : groups_) {
    if (g.pieces.size() == 1) continue;
    const int64_t R = static_cast<int64_t>(g.pieces.size()) * options_.rank;
    g.a = fused_buffer_.tensor(compute, {R, g.cols}, fused_at);
    fused_at += aligned16(R * g.cols, compute);
    g.b = fused_buffer_.tensor(compute, {g.rows, R}, fused_at);
    fused_at += aligned16(g.rows * R, compute);
  }
  xa_ = take(compute, n.per_token);
  dyb_ = take(compute, n.per_token);
  da_cat_ = take(grad, n.stacked);
  db_cat_ = take(grad, n.diagonal);
  piece_ = take(grad, n.piece);
  if (n.frozen > 0) backend.fill(frozen_, 0.0f);  // sharded: the frozen source's shards
  backend.fill(param_buffer_.tensor(compute, {n.adapters}), 0.0f);
  backend.fill(grad_buffer_.tensor(grad, {n.adapters}), 0.0f);
  base_observer_ = std::make_unique<BaseObserver>(*this);
  base_->set_unit_observer(base_observer_.get());
  base_->use_linear_adapters(this);
}

LoraModel::~LoraModel() = default;

std::vector<StepHook*> LoraModel::step_hooks() const {
  std::vector<StepHook*> hooks;
  if (base_->fp8()) hooks.push_back(base_->fp8());  // the frozen base's FP8 scaling
  if (moe_balance_) hooks.push_back(moe_balance_.get());
  return hooks;
}

std::vector<uint8_t> LoraModel::whole_adapter(int index) {
  const ParamInfo& p = layout_.params[index];
  const size_t element = dtype_size(runtime_.compute_dtype);
  std::vector<uint8_t> whole(static_cast<size_t>(p.full_shape.numel()) * element);
  if (p.whole()) {
    backend_.download(whole.data(), param(index));
    return whole;
  }
  TS_CHECK(tensor_parallel_ != nullptr, "{}: split over {} ranks without a tensor-parallel group", p.name,
           p.placement.parts);
  // Every rank's part, in rank order, then each part's runs to their places in the whole.
  const int64_t n = p.numel(), parts = p.placement.parts;
  DeviceBuffer gathered_buffer(backend_, static_cast<size_t>(parts * n) * element, "LoRA adapter gather");
  const Tensor gathered = gathered_buffer.tensor(runtime_.compute_dtype, {parts, n});
  tensor_parallel_->all_gather(gathered, param(index).view({1, n}));
  std::vector<uint8_t> all(static_cast<size_t>(parts * n) * element);
  backend_.download(all.data(), gathered);
  for (int k = 0; k < parts; ++k) {
    ParamInfo part = p;
    part.placement.index = k;
    part.for_each_run(0, n, [&](int64_t begin, int64_t count, int64_t full_begin) {
      std::memcpy(whole.data() + full_begin * element, all.data() + (k * n + begin) * element, count * element);
    });
  }
  return whole;
}

Tensor LoraModel::param(int index) const {
  const ParamInfo& p = layout_.params[index];
  return params_.flat_range(p.offset, p.numel()).view(p.shape);
}

Tensor LoraModel::grad(int index) const {
  const ParamInfo& p = layout_.params[index];
  return grads_.flat_range(p.offset, p.numel()).view(p.shape);
}

void LoraModel::bind_unit_params(int, const Tensor&) {
  throw InternalError("LoRA adapters are not sharded over ranks (FSDP): they are bound in place");
}

void LoraModel::bind_unit_grads(int, const Tensor&) {
  throw InternalError("LoRA adapters are not sharded over ranks (FSDP): they are bound in place");
}

void LoraModel::start_unit_grads(int) {
  throw InternalError("LoRA adapters are not sharded over ranks (FSDP): they are bound in place");
}

void LoraModel::zero_grads() {
  backend_.fill(grads_, 0.0f);
  base_->zero_grads();
}

std::vector<FlatSlice> LoraModel::base_slices() const {
  if (!runtime_.sharded_params) return {{{0, base_->layout().total}, frozen_}};
  TS_CHECK(frozen_source_ != nullptr, "LoRA: a sharded base without a frozen unit source");
  return frozen_source_->held();
}

void LoraModel::bind_params(int unit, int next) {
  if (runtime_.sharded_params) {
    TS_CHECK(frozen_source_ != nullptr, "LoRA: a sharded base without a frozen unit source");
    base_->bind_unit_params(unit, frozen_source_->unit_needed(unit, next));
    return;
  }
  const ParamRange& r = base_->layout().units[unit];
  base_->bind_unit_params(unit, frozen_.flat_range(r.begin, r.count()));
}

void LoraModel::params_done(int unit) {
  if (runtime_.sharded_params) frozen_source_->unit_done(unit);
}

// The frozen base's gradients (norms, embedding) go to one scratch that nothing reads; the
// sharded base accumulates into it, so it is never zeroed.
void LoraModel::bind_grads(int unit) {
  base_->bind_unit_grads(unit, base_grads_.flat_range(0, base_->layout().units[unit].count()));
}

void LoraModel::params_updated() {
  for (Group& g : groups_) g.assembled = false;
}

// A fused weight's stacked A and diagonal B, assembled at the first pass that reads them after
// the adapters changed (a pass reads a unit's adapters only once data parallelism has them).
void LoraModel::assemble(Group& g) {
  const int64_t r = options_.rank, R = static_cast<int64_t>(g.pieces.size()) * r;
  for (size_t p = 0; p < g.pieces.size(); ++p)
    backend_.copy(g.a.flat_range(static_cast<int64_t>(p) * r * g.cols, r * g.cols),
                  param(adapted_[g.pieces[p]].a).flat_range(0, r * g.cols));
  backend_.fill(g.b, 0.0f);
  for (size_t p = 0; p < g.pieces.size(); ++p) {
    const LoraAdapted& a = adapted_[g.pieces[p]];
    backend_.copy_columns(g.b.flat_range(a.row0 * R, a.rows * R).view({a.rows, R}), static_cast<int64_t>(p) * r,
                          param(a.b), 0, r);
  }
  g.assembled = true;
}

Tensor LoraModel::stacked_a(Group& g) {
  if (g.pieces.size() == 1) return param(adapted_[g.pieces[0]].a);
  if (!g.assembled) assemble(g);
  return g.a;
}

Tensor LoraModel::diagonal_b(Group& g) {
  if (g.pieces.size() == 1) return param(adapted_[g.pieces[0]].b);
  if (!g.assembled) assemble(g);
  return g.b;
}

void LoraModel::forward(const Tensor& out, const Tensor& in, int weight) {
  Group& g = groups_[group_of_[weight]];
  const int64_t R = static_cast<int64_t>(g.pieces.size()) * options_.rank, N = in.numel() / g.cols;
  TS_CHECK(N * R <= xa_.numel(), "LoRA: {} rows, beyond the {} tokens its scratch holds", N, runtime_.tokens());
  const Tensor xa = xa_.flat_range(0, N * R).view({N, R});
  const Tensor a = stacked_a(g), b = diagonal_b(g);
  const auto s = static_cast<float>(options_.scale());
  backend_.matmul(gemm(xa, in.view({N, g.cols}), false, a, true, 1.0f, 0.0f));       // x A^T
  backend_.matmul(gemm(out.view({N, g.rows}), xa, false, b, true, s, 1.0f));          // += s (x A^T) B^T
}

void LoraModel::backward(const Tensor& din, const Tensor& dout, const Tensor& in, int weight) {
  Group& g = groups_[group_of_[weight]];
  const int64_t r = options_.rank, R = static_cast<int64_t>(g.pieces.size()) * r, N = in.numel() / g.cols;
  const Tensor x = in.view({N, g.cols}), dy = dout.view({N, g.rows});
  const Tensor xa = xa_.flat_range(0, N * R).view({N, R}), dyb = dyb_.flat_range(0, N * R).view({N, R});
  const Tensor a = stacked_a(g), b = diagonal_b(g);
  const auto s = static_cast<float>(options_.scale());
  const bool single = g.pieces.size() == 1;
  const LoraAdapted& first = adapted_[g.pieces[0]];
  backend_.matmul(gemm(xa, x, false, a, true, 1.0f, 0.0f));  // x A^T, again rather than kept
  backend_.matmul(gemm(dyb, dy, false, b, false, 1.0f, 0.0f));  // dy B
  // dB = s dy^T (x A^T): each piece's rows and its own r columns of the stacked product.
  if (single) {
    backend_.matmul(gemm(grad(first.b), dy, true, xa, false, s, 1.0f));
  } else {
    const Tensor db = db_cat_.flat_range(0, g.rows * R).view({g.rows, R});
    backend_.matmul(gemm(db, dy, true, xa, false, s, 0.0f));
    for (size_t p = 0; p < g.pieces.size(); ++p) {
      const LoraAdapted& k = adapted_[g.pieces[p]];
      const Tensor cut = piece_.flat_range(0, k.rows * r).view({k.rows, r});
      backend_.copy_columns(cut, 0, db.flat_range(k.row0 * R, k.rows * R).view({k.rows, R}),
                            static_cast<int64_t>(p) * r, r);
      backend_.add(grad(k.b), grad(k.b), cut);
    }
  }
  // dA = s (dy B)^T x: the stacked A's rows are the pieces' A one after another.
  if (single) {
    backend_.matmul(gemm(grad(first.a), dyb, true, x, false, s, 1.0f));
  } else {
    const Tensor da = da_cat_.flat_range(0, R * g.cols).view({R, g.cols});
    backend_.matmul(gemm(da, dyb, true, x, false, s, 0.0f));
    for (size_t p = 0; p < g.pieces.size(); ++p) {
      const LoraAdapted& k = adapted_[g.pieces[p]];
      backend_.add(grad(k.a), grad(k.a), da.flat_range(static_cast<int64_t>(p) * r * g.cols, r * g.cols).view({r, g.cols}));
    }
  }
  if (din.defined()) backend_.matmul(gemm(din.view({N, g.cols}), dyb, false, a, false, s, 1.0f));  // += s (dy B) A
}

}  // namespace tessera
