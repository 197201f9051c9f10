#pragma once
// The load balance of a run's MoE layers as the trainer reports it (docs/moe.md): per MoE
// layer, the tokens each expert received in a step (min, max, coefficient of variation), and
// the layer's aux loss and z-loss (means over the step's micro-batches and ranks, unweighted),
// from Model::moe_stats summed over the step; averaged over a log interval.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

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

// One step: stats (layers, experts + 3) as Model::moe_stats lays them out, summed over
// `passes` forward passes (micro-batches x data-parallel ranks).
std::vector<MoeLayerBalance> moe_step_balance(const std::vector<float>& stats,
                                              const std::vector<int64_t>& layers, int64_t experts,
                                              int64_t passes);

// The steps of a log interval, averaged field by field.
class MoeBalanceInterval {
 public:
  void add(const std::vector<MoeLayerBalance>& step);
  bool empty() const { return steps_ == 0; }
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

}  // namespace tessera
