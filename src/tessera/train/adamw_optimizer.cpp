#include "tessera/train/adamw_optimizer.h"

namespace tessera {

AdamWOptimizer::AdamWOptimizer(LlamaModel& model, const TrainingConfig& config)
    : model_(model), config_(config), segments_(model.layout().decay_segments()) {
  Backend& b = model.backend();
  const int64_t P = model.layout().total;
  if (model.params().dtype == DType::F32) {
    master_ = model.params();
  } else {
    master_buffer_ = DeviceBuffer(b, P * sizeof(float), "fp32 master weights");
    master_ = master_buffer_.tensor(DType::F32, {P});
  }
  moments_buffer_ = DeviceBuffer(b, 2 * P * sizeof(float), "AdamW moments");
  exp_avg_ = moments_buffer_.tensor(DType::F32, {P});
  exp_avg_sq_ = moments_buffer_.tensor(DType::F32, {P}, P * sizeof(float));
  b.fill(exp_avg_, 0.0f);
  b.fill(exp_avg_sq_, 0.0f);
}

size_t AdamWOptimizer::state_bytes(int64_t params, DType compute) {
  const size_t p = static_cast<size_t>(params);
  return (compute == DType::F32 ? 2 : 3) * p * sizeof(float);
}

void AdamWOptimizer::sync_params_from_master() {
  if (master_.data != model_.params().data) model_.backend().convert(model_.params(), master_);
}

void AdamWOptimizer::step(double lr, const Tensor& grad_norm_sq, int64_t step) {
  AdamWArgs a;
  a.master = master_;
  a.grad = model_.grads();
  a.exp_avg = exp_avg_;
  a.exp_avg_sq = exp_avg_sq_;
  if (master_.data != model_.params().data) a.params = model_.params();
  a.grad_norm_sq = grad_norm_sq;
  a.segments = segments_;
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(config_.adam_beta1);
  a.beta2 = static_cast<float>(config_.adam_beta2);
  a.eps = static_cast<float>(config_.adam_eps);
  a.weight_decay = static_cast<float>(config_.weight_decay);
  a.max_grad_norm = static_cast<float>(config_.clip_grad);
  a.step = step;
  model_.backend().adamw_step(a);
}

}  // namespace tessera
