#include "tessera/train/dpo.h"

#include <algorithm>
#include <cmath>

namespace tessera {
namespace {

// log sigmoid(x) without overflow for large |x|.
double log_sigmoid(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }
double sigmoid(double x) { return x >= 0 ? 1 / (1 + std::exp(-x)) : std::exp(x) / (1 + std::exp(x)); }

}  // namespace

DpoPair dpo_pair(const DpoOptions& o, double policy_chosen, double policy_rejected,
                 double reference_chosen, double reference_rejected, int64_t chosen_tokens,
                 int64_t rejected_tokens) {
  const double nc = static_cast<double>(std::max<int64_t>(chosen_tokens, 1));
  const double nr = static_cast<double>(std::max<int64_t>(rejected_tokens, 1));
  const double raw_chosen = policy_chosen;
  // What the loss sees of each summed log-probability, and d(seen) / d(summed).
  const double sc = o.length_normalize ? 1 / nc : 1, sr = o.length_normalize ? 1 / nr : 1;
  policy_chosen *= sc;
  policy_rejected *= sr;
  reference_chosen = o.reference_free ? 0 : reference_chosen * sc;
  reference_rejected = o.reference_free ? 0 : reference_rejected * sr;
  DpoPair p;
  p.chosen_reward = o.beta * (policy_chosen - reference_chosen);
  p.rejected_reward = o.beta * (policy_rejected - reference_rejected);
  const double z = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected);
  double dz = 0;  // d loss / d z
  switch (o.loss_type) {
    case DpoLossType::Sigmoid: {
      const double e = o.label_smoothing, x = o.beta * z;
      p.loss = -(1 - e) * log_sigmoid(x) - e * log_sigmoid(-x);
      dz = o.beta * (-(1 - e) * sigmoid(-x) + e * sigmoid(x));
      break;
    }
    case DpoLossType::Ipo: {
      const double d = z - 1 / (2 * o.beta);
      p.loss = d * d;
      dz = 2 * d;
      break;
    }
    case DpoLossType::Hinge:
      p.loss = std::max(0.0, 1 - o.beta * z);
      dz = 1 - o.beta * z > 0 ? -o.beta : 0.0;
      break;
  }
  p.dloss_dchosen = dz * sc;
  p.dloss_drejected = -dz * sr;
  if (o.rpo_alpha > 0) {
    p.loss += o.rpo_alpha * -raw_chosen / nc;
    p.dloss_dchosen -= o.rpo_alpha / nc;
  }
  return p;
}

}  // namespace tessera
