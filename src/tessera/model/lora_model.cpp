#include "tessera/model/lora_model.h"

#include <algorithm>

#include "tessera/core/error.h"

namespace tessera {

// Runs the adapters around each unit the base reads or writes, then tells the outer observer
// (data parallelism): its params_needed first, so the adapters are current before they are
// merged, and its grads_ready last, once the adapters' gradients hold the unit's share.
class LoraModel::BaseObserver : public ParamUnitObserver {
 public:
  explicit BaseObserver(LoraModel& m) : m_(m) {}
  void params_needed(int unit, int next) override {
    if (m_.outer_) m_.outer_->params_needed(unit, next);
    m_.bind_params(unit);
  }
  void params_done(int unit) override {
    if (m_.outer_) m_.outer_->params_done(unit);
  }
  void grads_needed(int unit) override {
    if (m_.outer_) m_.outer_->grads_needed(unit);
    m_.bind_grads(unit);
  }
  void grads_ready(int unit) override {
    m_.adapter_grads(unit);
    if (m_.outer_) m_.outer_->grads_ready(unit);
  }

 private:
  LoraModel& m_;
};

namespace {

// Elements of each buffer a LoraModel allocates.
struct Sizes {
  int64_t frozen = 0;      // the base weights
  int64_t merged = 0;      // the largest unit with adapters: its merged weights
  int64_t base_grads = 0;  // the largest unit: its dW
  int64_t adapters = 0;    // the adapters (and their gradients), padded for data parallelism
};

Sizes sizes(const ParamLayout& base, const ParamLayout& adapters, const std::vector<LoraAdapted>& adapted,
            const ModelRuntime& runtime) {
  Sizes n;
  n.frozen = base.total;
  for (const ParamRange& u : base.units) n.base_grads = std::max(n.base_grads, u.count());
  for (const LoraAdapted& a : adapted)
    n.merged = std::max(n.merged, base.units[base.params[a.base_weight].unit].count());
  const int64_t multiple = std::max<int64_t>(runtime.flat_buffer_multiple, 1);
  n.adapters = (adapters.total + multiple - 1) / multiple * multiple;
  return n;
}

// The base's runtime: no buffers of its own, dW in the compute dtype (it only feeds the
// adapters' GEMMs, which read it so).
ModelRuntime base_runtime(const ModelRuntime& runtime) {
  ModelRuntime rt = runtime;
  rt.sharded_params = true;
  rt.grad_dtype = runtime.compute_dtype;
  return rt;
}

}  // namespace

ModelMemory LoraModel::plan_memory(const ModelSpec& spec, const ModelRuntime& runtime, const LoraOptions& options) {
  const ModelRuntime rt = base_runtime(runtime);
  ModelMemory m = DecoderModel::plan_memory(spec, rt);
  const ParamLayout base = DecoderModel::plan_layout(spec, rt);
  const LoraLayout lora = make_lora_layout(spec, base, options);
  const Sizes n = sizes(base, lora.adapters, lora.adapted, runtime);
  const size_t compute = dtype_size(runtime.compute_dtype);
  m.weights = static_cast<size_t>(n.frozen + n.merged + n.adapters) * compute;
  m.gradients = static_cast<size_t>(n.base_grads) * compute + static_cast<size_t>(n.adapters) * dtype_size(runtime.grad_dtype);
  return m;
}

LoraModel::LoraModel(Backend& backend, const ModelSpec& spec, const ModelRuntime& runtime,
                     LoraOptions options)
    : backend_(backend), runtime_(runtime), options_(std::move(options)) {
  TS_CHECK(runtime.tensor_parallel_size == 1 && runtime.pipeline_chunks.empty() &&
               runtime.context_parallel_size == 1 && runtime.expert_parallel_size == 1 &&
               !runtime.sharded_params && !runtime.fp8.enabled(),
           "LoRA runs on one model replica (data parallelism only), without FP8");
  TS_CHECK(options_.rank > 0 && !options_.targets.empty(), "LoRA: rank {} and {} targets",
           options_.rank, options_.targets.size());
  base_ = std::make_unique<DecoderModel>(backend, spec, base_runtime(runtime));
  const ParamLayout& base = base_->layout();

  LoraLayout lora = make_lora_layout(spec, base, options_);
  layout_ = std::move(lora.adapters);
  adapted_ = std::move(lora.adapted);
  adapted_in_unit_.resize(base.units.size());
  for (size_t k = 0; k < adapted_.size(); ++k)
    adapted_in_unit_[base.params[adapted_[k].base_weight].unit].push_back(static_cast<int>(k));

  const Sizes n = sizes(base, layout_, adapted_, runtime);
  const DType compute = runtime.compute_dtype;
  frozen_buffer_ = DeviceBuffer(backend, n.frozen * dtype_size(compute), "LoRA frozen base weights");
  merged_buffer_ = DeviceBuffer(backend, n.merged * dtype_size(compute), "LoRA merged weights of a layer");
  base_grad_buffer_ = DeviceBuffer(backend, n.base_grads * dtype_size(compute), "LoRA base gradients of a layer");
  param_buffer_ = DeviceBuffer(backend, n.adapters * dtype_size(compute), "LoRA adapters");
  grad_buffer_ = DeviceBuffer(backend, n.adapters * dtype_size(runtime.grad_dtype), "LoRA adapter gradients");
  const int64_t padded = n.adapters, largest_unit = n.base_grads, largest_adapted_unit = n.merged;
  frozen_ = frozen_buffer_.tensor(compute, {base.total});
  merged_ = merged_buffer_.tensor(compute, {largest_adapted_unit});
  base_grads_ = base_grad_buffer_.tensor(compute, {largest_unit});
  params_ = param_buffer_.tensor(compute, {layout_.total});
  grads_ = grad_buffer_.tensor(runtime.grad_dtype, {layout_.total});
  backend.fill(frozen_, 0.0f);
  backend.fill(param_buffer_.tensor(compute, {padded}), 0.0f);
  backend.fill(grad_buffer_.tensor(runtime.grad_dtype, {padded}), 0.0f);
  base_observer_ = std::make_unique<BaseObserver>(*this);
  base_->set_unit_observer(base_observer_.get());
}

LoraModel::~LoraModel() = default;

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

void LoraModel::zero_grads() {
  backend_.fill(grads_, 0.0f);
  base_->zero_grads();
}

void LoraModel::bind_params(int unit) {
  const ParamLayout& base = base_->layout();
  const ParamRange& r = base.units[unit];
  const Tensor frozen = frozen_.flat_range(r.begin, r.count());
  if (adapted_in_unit_[unit].empty()) {
    base_->bind_unit_params(unit, frozen);
    return;
  }
  const Tensor merged = merged_.flat_range(0, r.count());
  backend_.copy(merged, frozen);
  for (const int k : adapted_in_unit_[unit]) {
    const LoraAdapted& a = adapted_[k];
    const ParamInfo& w = base.params[a.base_weight];
    MatmulArgs m;
    m.out = merged.flat_range(w.offset - r.begin + a.row0 * a.cols, a.rows * a.cols).view({a.rows, a.cols});
    m.a = param(a.b);
    m.b = param(a.a);
    m.alpha = static_cast<float>(options_.scale());
    m.beta = 1.0f;
    backend_.matmul(m);
  }
  base_->bind_unit_params(unit, merged);
}

void LoraModel::bind_grads(int unit) {
  const Tensor g = base_grads_.flat_range(0, base_->layout().units[unit].count());
  backend_.fill(g, 0.0f);
  base_->bind_unit_grads(unit, g);
}

void LoraModel::adapter_grads(int unit) {
  const ParamLayout& base = base_->layout();
  const ParamRange& r = base.units[unit];
  for (const int k : adapted_in_unit_[unit]) {
    const LoraAdapted& a = adapted_[k];
    const ParamInfo& w = base.params[a.base_weight];
    const Tensor dw =
        base_grads_.flat_range(w.offset - r.begin + a.row0 * a.cols, a.rows * a.cols).view({a.rows, a.cols});
    MatmulArgs db;  // dB (rows, r) += s dW A^T
    db.out = grad(a.b);
    db.a = dw;
    db.b = param(a.a);
    db.trans_b = true;
    db.alpha = static_cast<float>(options_.scale());
    db.beta = 1.0f;
    backend_.matmul(db);
    MatmulArgs da;  // dA (r, cols) += s B^T dW
    da.out = grad(a.a);
    da.a = param(a.b);
    da.trans_a = true;
    da.b = dw;
    da.alpha = static_cast<float>(options_.scale());
    da.beta = 1.0f;
    backend_.matmul(da);
  }
}

}  // namespace tessera
