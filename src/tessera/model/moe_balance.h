#pragma once
// The load balance of a run's MoE layers as a training run reports it (docs/moe.md): per MoE
// layer, the tokens each expert received in a step (min, max, coefficient of variation), and
// the layer's aux loss and z-loss (means over the step's micro-batches and ranks, unweighted),
// from the blocks' statistics summed over the step; averaged over a log interval. The model's
// step hook (MoeBalanceHook) sums them over the ranks, moves the aux-loss-free expert bias and
// reports them.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/model/step_hook.h"
#include "tessera/ops/backend.h"

namespace tessera {

struct MoeLayerBalance {
  int64_t layer = 0;
  // (token, slot) pairs per expert in one step: with top-k routing a token counts k times.
  double tokens_min = 0, tokens_max = 0, tokens_mean = 0;
  double tokens_cv = 0;  // standard deviation / mean over the experts; 0 is perfect balance
  double aux_loss = 0, z_loss = 0;
  // The share of the routed pairs dropped beyond the experts' capacity (token dropping).
  double dropped = 0;
};

// The statistics an MoE layer keeps per step (a row of DecoderModel::moe_stats): the pairs
// routed to each expert, then the aux loss, the z-loss and the pairs dropped.
inline int64_t moe_stats_width(int64_t experts) { return experts + 3; }

// One step: stats (layers, experts + 3) as DecoderModel::moe_stats lays them out, summed over
// `passes` forward passes (micro-batches x data-parallel ranks).
std::vector<MoeLayerBalance> moe_step_balance(const std::vector<float>& stats,
                                              const std::vector<int64_t>& layers, int64_t experts,
                                              int64_t passes);

// The steps of a log interval, averaged field by field.
class MoeBalanceInterval {
 public:
  void add(const std::vector<MoeLayerBalance>& step);
  bool empty() const { return steps_ == 0; }
  int64_t steps() const { return steps_; }
  std::vector<MoeLayerBalance> mean() const;
  void clear();

 private:
  std::vector<MoeLayerBalance> sum_;
  int64_t steps_ = 0;
};

// The iteration line's part: means of the losses over the layers, the worst layer's
// max/mean and CV, e.g. " | load balancing loss: 1.012E+00 | z loss: 2.9E+00 | expert load
// max/mean: 1.31 | expert load cv: 0.142".
std::string moe_iteration_fields(const std::vector<MoeLayerBalance>& layers);
// Each layer's line: "layer 0: tokens per expert min 10 max 14 cv 0.132, aux 1.0097, z 2.9705".
std::string moe_layer_lines(const std::vector<MoeLayerBalance>& layers);
// metrics.jsonl's keys: moe_aux_loss and moe_z_loss (means over layers), and per layer
// moe_layers, moe_aux_loss_per_layer, moe_z_loss_per_layer, moe_expert_tokens_min/max/cv.
void add_moe_metrics(nlohmann::json& j, const std::vector<MoeLayerBalance>& layers);

// The MoE layers' step hook. stats: (layers.size(), experts + 3) fp32 on the device, as
// DecoderModel::moe_stats lays them out, zeroed by the model at each step's start.
// update_state moves the state the statistics steer (the expert bias) once they are summed
// over the ranks; null where that state is frozen (LoRA).
class MoeBalanceHook final : public StepHook {
 public:
  MoeBalanceHook(Backend& backend, Tensor stats, std::vector<int64_t> layers, int64_t experts,
                 bool force_balance, std::function<void()> update_state);

  void attach(StepCollectives& collectives) override { collectives_ = &collectives; }
  void end_step(const Tensor& grad_norm_sq) override;
  void read_step(int64_t passes) override;
  // Megatron's track_moe_metrics tags: load_balancing_loss and z_loss (means over the layers),
  // and per layer moe/load_balancing_loss_layer_<l>, moe/z_loss_layer_<l>,
  // moe/expert_tokens_cv_layer_<l> and moe/expert_tokens_max_over_mean_layer_<l>.
  NamedScalars step_scalars() const override;
  std::string interval_fields() const override;
  std::string interval_detail(int64_t iteration) const override;
  void add_interval_metrics(nlohmann::json& record) const override;
  void end_interval() override { interval_.clear(); }

  // The last read step, per MoE layer.
  const std::vector<MoeLayerBalance>& last_step() const { return step_; }

 private:
  Backend& backend_;
  Tensor stats_;
  std::vector<int64_t> layers_;
  int64_t experts_;
  bool force_balance_;
  std::function<void()> update_state_;
  StepCollectives* collectives_ = nullptr;
  std::vector<MoeLayerBalance> step_;
  MoeBalanceInterval interval_;
};

}  // namespace tessera
