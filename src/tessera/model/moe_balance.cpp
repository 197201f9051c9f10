#include "tessera/model/moe_balance.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {

std::vector<MoeLayerBalance> moe_step_balance(const std::vector<float>& stats,
                                              const std::vector<int64_t>& layers, int64_t experts,
                                              int64_t passes) {
  const int64_t width = moe_stats_width(experts);
  TS_CHECK(static_cast<int64_t>(stats.size()) == static_cast<int64_t>(layers.size()) * width,
           "moe statistics of {} values for {} layers of {} experts", stats.size(), layers.size(),
           experts);
  std::vector<MoeLayerBalance> out;
  for (size_t i = 0; i < layers.size(); ++i) {
    const float* row = stats.data() + i * width;
    MoeLayerBalance b;
    b.layer = layers[i];
    double sum = 0, sq = 0;
    b.tokens_min = b.tokens_max = row[0];
    for (int64_t e = 0; e < experts; ++e) {
      sum += row[e];
      sq += static_cast<double>(row[e]) * row[e];
      b.tokens_min = std::min<double>(b.tokens_min, row[e]);
      b.tokens_max = std::max<double>(b.tokens_max, row[e]);
    }
    b.tokens_mean = sum / static_cast<double>(experts);
    const double variance =
        std::max(0.0, sq / static_cast<double>(experts) - b.tokens_mean * b.tokens_mean);
    b.tokens_cv = b.tokens_mean > 0 ? std::sqrt(variance) / b.tokens_mean : 0.0;
    b.aux_loss = row[experts] / static_cast<double>(passes);
    b.z_loss = row[experts + 1] / static_cast<double>(passes);
    b.dropped = sum > 0 ? row[experts + 2] / sum : 0.0;
    out.push_back(b);
  }
  return out;
}

void MoeBalanceInterval::add(const std::vector<MoeLayerBalance>& step) {
  if (steps_ == 0) {
    sum_ = step;
  } else {
    for (size_t i = 0; i < step.size(); ++i) {
      sum_[i].tokens_min += step[i].tokens_min;
      sum_[i].tokens_max += step[i].tokens_max;
      sum_[i].tokens_mean += step[i].tokens_mean;
      sum_[i].tokens_cv += step[i].tokens_cv;
      sum_[i].aux_loss += step[i].aux_loss;
      sum_[i].z_loss += step[i].z_loss;
      sum_[i].dropped += step[i].dropped;
    }
  }
  ++steps_;
}

std::vector<MoeLayerBalance> MoeBalanceInterval::mean() const {
  std::vector<MoeLayerBalance> out = sum_;
  const double n = static_cast<double>(std::max<int64_t>(steps_, 1));
  for (MoeLayerBalance& b : out) {
    b.tokens_min /= n, b.tokens_max /= n, b.tokens_mean /= n, b.tokens_cv /= n;
    b.aux_loss /= n, b.z_loss /= n, b.dropped /= n;
  }
  return out;
}

void MoeBalanceInterval::clear() {
  sum_.clear();
  steps_ = 0;
}

std::string moe_iteration_fields(const std::vector<MoeLayerBalance>& layers) {
  if (layers.empty()) return "";
  double aux = 0, z = 0, worst_ratio = 0, worst_cv = 0, dropped = 0;
  for (const MoeLayerBalance& b : layers) {
    aux += b.aux_loss;
    z += b.z_loss;
    worst_ratio = std::max(worst_ratio, b.tokens_mean > 0 ? b.tokens_max / b.tokens_mean : 0.0);
    worst_cv = std::max(worst_cv, b.tokens_cv);
    dropped += b.dropped;
  }
  const double n = static_cast<double>(layers.size());
  return fmt::format(
      " | load balancing loss: {:.6E} | z loss: {:.6E} | expert load max/mean: {:.3f} | "
      "expert load cv: {:.3f}{}",
      aux / n, z / n, worst_ratio, worst_cv,
      dropped > 0 ? fmt::format(" | dropped pairs: {:.2f}%", 100 * dropped / n) : "");
}

std::string moe_layer_lines(const std::vector<MoeLayerBalance>& layers) {
  std::string out;
  for (const MoeLayerBalance& b : layers)
    out += fmt::format(
        "{}layer {}: tokens per expert min {:.0f} max {:.0f} cv {:.3f}, aux {:.4f}, z {:.4f}{}",
        out.empty() ? "" : "; ", b.layer, b.tokens_min, b.tokens_max, b.tokens_cv, b.aux_loss,
        b.z_loss, b.dropped > 0 ? fmt::format(", dropped {:.2f}%", 100 * b.dropped) : "");
  return out;
}

void add_moe_metrics(nlohmann::json& j, const std::vector<MoeLayerBalance>& layers) {
  if (layers.empty()) return;
  double aux = 0, z = 0;
  nlohmann::json ids, aux_l, z_l, mins, maxs, cvs, dropped;
  for (const MoeLayerBalance& b : layers) {
    aux += b.aux_loss, z += b.z_loss;
    ids.push_back(b.layer);
    aux_l.push_back(b.aux_loss);
    z_l.push_back(b.z_loss);
    mins.push_back(b.tokens_min);
    maxs.push_back(b.tokens_max);
    cvs.push_back(b.tokens_cv);
    dropped.push_back(b.dropped);
  }
  j["moe_aux_loss"] = aux / static_cast<double>(layers.size());
  j["moe_z_loss"] = z / static_cast<double>(layers.size());
  j["moe_layers"] = ids;
  j["moe_aux_loss_per_layer"] = aux_l;
  j["moe_z_loss_per_layer"] = z_l;
  j["moe_expert_tokens_min"] = mins;
  j["moe_expert_tokens_max"] = maxs;
  j["moe_expert_tokens_cv"] = cvs;
  j["moe_expert_dropped_fraction"] = dropped;
}

MoeBalanceHook::MoeBalanceHook(Backend& backend, Tensor stats, std::vector<int64_t> layers,
                               int64_t experts, bool force_balance,
                               std::function<void()> update_state)
    : backend_(backend),
      stats_(stats),
      layers_(std::move(layers)),
      experts_(experts),
      force_balance_(force_balance),
      update_state_(std::move(update_state)) {}

void MoeBalanceHook::end_step(const Tensor&) {
  // The step's balance over every rank, which also moves the aux-loss-free expert bias.
  if (collectives_) collectives_->sum(stats_);
  if (update_state_) update_state_();
}

void MoeBalanceHook::read_step(int64_t passes) {
  std::vector<float> host(static_cast<size_t>(stats_.numel()));
  backend_.download(host.data(), stats_);
  step_ = moe_step_balance(host, layers_, experts_, passes);
  interval_.add(step_);
}

NamedScalars MoeBalanceHook::step_scalars() const {
  NamedScalars out;
  if (step_.empty()) return out;
  double aux = 0, z = 0;
  for (const MoeLayerBalance& b : step_) {
    aux += b.aux_loss;
    z += b.z_loss;
    const std::string layer = std::to_string(b.layer);
    out.emplace_back("moe/load_balancing_loss_layer_" + layer, b.aux_loss);
    out.emplace_back("moe/z_loss_layer_" + layer, b.z_loss);
    out.emplace_back("moe/expert_tokens_cv_layer_" + layer, b.tokens_cv);
    out.emplace_back("moe/expert_tokens_max_over_mean_layer_" + layer,
                     b.tokens_mean > 0 ? b.tokens_max / b.tokens_mean : 0.0);
  }
  out.emplace_back("load_balancing_loss", aux / static_cast<double>(step_.size()));
  out.emplace_back("z_loss", z / static_cast<double>(step_.size()));
  return out;
}

std::string MoeBalanceHook::interval_fields() const {
  return moe_iteration_fields(interval_.mean());
}

std::string MoeBalanceHook::interval_detail(int64_t iteration) const {
  if (interval_.empty()) return "";
  return fmt::format("moe balance, iteration {} ({} routing, mean over {} iteration{}): {}",
                     iteration, force_balance_ ? "force-balanced" : "learned", interval_.steps(),
                     interval_.steps() == 1 ? "" : "s", moe_layer_lines(interval_.mean()));
}

void MoeBalanceHook::add_interval_metrics(nlohmann::json& record) const {
  if (interval_.empty()) return;
  add_moe_metrics(record, interval_.mean());
  record["moe_force_balance"] = force_balance_;
}

}  // namespace tessera
