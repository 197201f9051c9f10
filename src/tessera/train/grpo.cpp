#include "tessera/train/grpo.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "tessera/core/error.h"

namespace tessera {
namespace {

void check_groups(size_t completions, int64_t group_size) {
  if (group_size < 1 || completions % static_cast<size_t>(group_size) != 0)
    throw Error(fmt::format("{} completions in groups of {}", completions, group_size));
}

double group_mean(const std::vector<double>& rewards, size_t first, size_t G) {
  double mean = 0;
  for (size_t i = first; i < first + G; ++i) mean += rewards[i] / static_cast<double>(G);
  return mean;
}

}  // namespace

std::vector<double> group_stds(const std::vector<double>& rewards, int64_t group_size) {
  check_groups(rewards.size(), group_size);
  const auto G = static_cast<size_t>(group_size);
  std::vector<double> out;
  for (size_t g = 0; g < rewards.size(); g += G) {
    const double mean = group_mean(rewards, g, G);
    double var = 0;
    for (size_t i = g; i < g + G; ++i) var += (rewards[i] - mean) * (rewards[i] - mean);
    // torch.std: the unbiased estimate, NaN for a group of one (whose advantage is then 0).
    out.push_back(G > 1 ? std::sqrt(var / static_cast<double>(G - 1)) : 0.0);
  }
  return out;
}

std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t group_size,
                                     bool scale_rewards) {
  const std::vector<double> stds = group_stds(rewards, group_size);
  const auto G = static_cast<size_t>(group_size);
  std::vector<double> out(rewards.size());
  for (size_t g = 0; g < rewards.size(); g += G) {
    const double mean = group_mean(rewards, g, G), std = stds[g / G];
    for (size_t i = g; i < g + G; ++i)
      out[i] = scale_rewards ? (rewards[i] - mean) / (std + 1e-4) : rewards[i] - mean;
  }
  return out;
}

std::vector<bool> informative_groups(const std::vector<double>& rewards, int64_t group_size) {
  check_groups(rewards.size(), group_size);
  const auto G = static_cast<size_t>(group_size);
  std::vector<bool> out;
  for (size_t g = 0; g < rewards.size(); g += G)
    out.push_back(std::any_of(rewards.begin() + static_cast<std::ptrdiff_t>(g),
                              rewards.begin() + static_cast<std::ptrdiff_t>(g + G),
                              [&](double r) { return r != rewards[g]; }));
  return out;
}

GrpoBatchLoss grpo_loss(const GrpoOptions& o, const std::vector<GrpoCompletion>& batch,
                        GrpoBatchCounts whole) {
  GrpoBatchLoss out;
  int64_t tokens = 0;
  for (const GrpoCompletion& c : batch) {
    if (c.old_logp.size() != c.logp.size() || (o.beta != 0 && c.ref_logp.size() != c.logp.size()))
      throw Error(fmt::format("a completion of {} tokens with {} old and {} reference log-probabilities",
                              c.logp.size(), c.old_logp.size(), c.ref_logp.size()));
    tokens += static_cast<int64_t>(c.logp.size());
  }
  if (o.loss_type == GrpoLossType::DrGrpo && o.max_completion_length < 1)
    throw Error("dr_grpo needs max_completion_length");
  out.tokens = tokens;
  if (whole.completions == 0) whole = {static_cast<int64_t>(batch.size()), tokens};
  const double completions = static_cast<double>(std::max<int64_t>(whole.completions, 1));
  for (const GrpoCompletion& c : batch) {
    const double n = static_cast<double>(c.logp.size());
    // Each token loss's weight in the batch loss.
    const double weight =
        o.loss_type == GrpoLossType::Grpo   ? 1.0 / (completions * std::max(n, 1.0))
        : o.loss_type == GrpoLossType::Bnpo ? 1.0 / static_cast<double>(std::max<int64_t>(whole.tokens, 1))
                                            : 1.0 / (completions * static_cast<double>(o.max_completion_length));
    std::vector<double>& grad = out.dloss_dlogp.emplace_back(c.logp.size());
    const double A = c.advantage;
    for (size_t t = 0; t < c.logp.size(); ++t) {
      const double r = std::exp(c.logp[t] - c.old_logp[t]);
      const double clipped = std::clamp(r, 1 - o.epsilon, 1 + o.epsilon_high);
      // -min(r A, clip(r) A): the unclipped term carries the gradient r A where it is the
      // smaller, or where both are equal (inside the clip range); the clipped one carries none
      // outside its range.
      const double unclipped_term = r * A, clipped_term = clipped * A;
      double loss = -std::min(unclipped_term, clipped_term);
      double dloss = unclipped_term <= clipped_term ? -r * A : 0.0;
      const bool low = r < 1 - o.epsilon && A < 0, high = r > 1 + o.epsilon_high && A > 0;
      out.clip_low += low, out.clip_high += high, out.clip_region += low || high;
      if (o.beta != 0) {
        const double d = c.ref_logp[t] - c.logp[t];
        const double kl = std::exp(d) - d - 1;
        loss += o.beta * kl;
        dloss += o.beta * (1 - std::exp(d));
        out.kl += kl;
      }
      out.loss += weight * loss;
      grad[t] = weight * dloss;
    }
  }
  const double n = static_cast<double>(std::max<int64_t>(tokens, 1));
  out.clip_low /= n, out.clip_high /= n, out.clip_region /= n, out.kl /= n;
  return out;
}

}  // namespace tessera
