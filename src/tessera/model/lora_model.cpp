#include "tessera/model/lora_model.h"

#include <algorithm>
#include <set>

#include "tessera/core/error.h"
#include "tessera/model/model_family.h"

namespace tessera {
namespace {

const std::vector<std::string> kProjections = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                               "gate_proj", "up_proj", "down_proj"};

// "model.layers.3.self_attn.q_proj.weight" -> "q_proj".
std::string module_of(const std::string& hf_name) {
  const size_t end = hf_name.rfind('.');
  const size_t begin = hf_name.rfind('.', end - 1);
  return hf_name.substr(begin + 1, end - begin - 1);
}

}  // namespace

std::vector<std::string> lora_targets(const std::string& value) {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> kMegatron = {
      {"linear_qkv", {"q_proj", "k_proj", "v_proj"}},
      {"linear_proj", {"o_proj"}},
      {"linear_fc1", {"gate_proj", "up_proj"}},
      {"linear_fc2", {"down_proj"}}};
  std::set<std::string> chosen;
  size_t at = 0;
  while (at <= value.size()) {
    size_t comma = value.find(',', at);
    if (comma == std::string::npos) comma = value.size();
    std::string name = value.substr(at, comma - at);
    name.erase(0, name.find_first_not_of(' '));
    name.erase(name.find_last_not_of(' ') + 1);
    at = comma + 1;
    if (name.empty()) continue;
    if (name == "all-linear") {
      chosen.insert(kProjections.begin(), kProjections.end());
      continue;
    }
    if (std::find(kProjections.begin(), kProjections.end(), name) != kProjections.end()) {
      chosen.insert(name);
      continue;
    }
    const auto m = std::find_if(kMegatron.begin(), kMegatron.end(),
                                [&](const auto& e) { return e.first == name; });
    if (m == kMegatron.end())
      throw ConfigError("configuration", "lora_target_modules", value,
                        "comma-separated projections: q_proj, k_proj, v_proj, o_proj, gate_proj, "
                        "up_proj, down_proj (or Megatron's linear_qkv, linear_proj, linear_fc1, "
                        "linear_fc2), or all-linear; '" + name + "' is none of them");
    chosen.insert(m->second.begin(), m->second.end());
  }
  if (chosen.empty())
    throw ConfigError("configuration", "lora_target_modules", value, "at least one projection");
  std::vector<std::string> out;  // in the layer's order
  for (const std::string& p : kProjections)
    if (chosen.count(p)) out.push_back(p);
  return out;
}

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

LoraModel::LoraModel(Backend& backend, const ModelSpec& spec, const ModelRuntime& runtime,
                     LoraOptions options)
    : backend_(backend), runtime_(runtime), options_(std::move(options)) {
  TS_CHECK(runtime.tensor_parallel_size == 1 && runtime.pipeline_chunks.empty() &&
               runtime.context_parallel_size == 1 && runtime.expert_parallel_size == 1 &&
               !runtime.sharded_params && !runtime.fp8.enabled(),
           "LoRA runs on one model replica (data parallelism only), without FP8");
  TS_CHECK(options_.rank > 0 && !options_.targets.empty(), "LoRA: rank {} and {} targets",
           options_.rank, options_.targets.size());
  ModelRuntime base_runtime = runtime;
  base_runtime.sharded_params = true;
  // dW only feeds the adapters' GEMMs, which read it in the compute dtype.
  base_runtime.grad_dtype = runtime.compute_dtype;
  base_ = std::make_unique<DecoderModel>(backend, spec, base_runtime);
  const ParamLayout& base = base_->layout();
  const ModelFamily& family = model_family(spec.family);

  // One adapter unit per base unit; each adapted piece gets A then B, named as peft names them.
  ParamLayoutBuilder builder(layout_);
  adapted_in_unit_.resize(base.units.size());
  int64_t largest_unit = 0, largest_adapted_unit = 0;
  for (size_t u = 0; u < base.units.size(); ++u) {
    int layer = -1;
    for (const ParamInfo& p : base.params)
      if (p.unit == static_cast<int>(u)) layer = p.layer;
    builder.begin_unit("", layer);
    for (size_t w = 0; w < base.params.size(); ++w) {
      const ParamInfo& p = base.params[w];
      if (p.unit != static_cast<int>(u) || p.shape.rank() != 2 || p.layer < 0) continue;
      for (const HfTensorPiece& piece : family.hf_pieces(p, spec)) {
        const std::string module = module_of(piece.name);
        if (std::find(options_.targets.begin(), options_.targets.end(), module) ==
                options_.targets.end() ||
            piece.shape.size() != 2)
          continue;
        const std::string stem = piece.name.substr(0, piece.name.size() - std::string(".weight").size());
        Adapted a;
        a.base_weight = static_cast<int>(w);
        a.cols = piece.shape[1];
        a.row0 = piece.offset / a.cols;
        a.rows = piece.shape[0];
        a.a = builder.add(stem + ".lora_A.weight", {options_.rank, a.cols}, ParamInit::LowRankNormal, true);
        a.b = builder.add(stem + ".lora_B.weight", {a.rows, options_.rank}, ParamInit::Zeros, true);
        adapted_in_unit_[u].push_back(static_cast<int>(adapted_.size()));
        adapted_.push_back(a);
      }
    }
    largest_unit = std::max(largest_unit, base.units[u].count());
    if (!adapted_in_unit_[u].empty()) largest_adapted_unit = std::max(largest_adapted_unit, base.units[u].count());
  }
  TS_CHECK(!adapted_.empty(), "LoRA: no projection of the {} model is among the targets", spec.family);

  const DType compute = runtime.compute_dtype;
  const int64_t multiple = std::max<int64_t>(runtime.flat_buffer_multiple, 1);
  const int64_t padded = (layout_.total + multiple - 1) / multiple * multiple;
  frozen_buffer_ = DeviceBuffer(backend, base.total * dtype_size(compute), "LoRA frozen base weights");
  merged_buffer_ = DeviceBuffer(backend, largest_adapted_unit * dtype_size(compute), "LoRA merged weights of a layer");
  base_grad_buffer_ = DeviceBuffer(backend, largest_unit * dtype_size(compute), "LoRA base gradients of a layer");
  param_buffer_ = DeviceBuffer(backend, padded * dtype_size(compute), "LoRA adapters");
  grad_buffer_ = DeviceBuffer(backend, padded * dtype_size(runtime.grad_dtype), "LoRA adapter gradients");
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
    const Adapted& a = adapted_[k];
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
    const Adapted& a = adapted_[k];
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
