#pragma once
// Direct preference optimisation's losses, as TRL's DPOTrainer computes them. For one pair,
// with the policy's and the reference's summed log-probabilities of the chosen and rejected
// answers (pc, pr; rc, rr) and z = (pc - rc) - (pr - rr):
//   sigmoid  -(1 - e) log sigmoid(beta z) - e log sigmoid(-beta z)   (DPO; e: label smoothing,
//            the robust/conservative variant)
//   ipo      (z - 1 / (2 beta))^2                                      (IPO)
//   hinge    max(0, 1 - beta z)                                        (SLiC)
// The rewards are beta (pc - rc) and beta (pr - rr).
#include "tessera/config/config.h"

namespace tessera {

struct DpoOptions {
  DpoLossType loss_type = DpoLossType::Sigmoid;
  double beta = 0.1;
  double label_smoothing = 0.0;
};

struct DpoPair {
  double loss = 0;
  // d loss / d pc and d loss / d pr: what the chosen and rejected answers' log-probabilities
  // are pushed by (the reference's are constants).
  double dloss_dchosen = 0, dloss_drejected = 0;
  double chosen_reward = 0, rejected_reward = 0;
};

DpoPair dpo_pair(const DpoOptions& o, double policy_chosen, double policy_rejected,
                 double reference_chosen, double reference_rejected);

// Means over a batch of pairs, under TRL's names: loss, rewards/chosen, rewards/rejected,
// rewards/accuracies (the share of pairs whose chosen reward is the higher), logps/chosen,
// logps/rejected; rewards/margins is chosen minus rejected.
struct DpoBatchStats {
  double loss = 0, chosen_reward = 0, rejected_reward = 0, accuracy = 0, logp_chosen = 0,
         logp_rejected = 0;
  double margin() const { return chosen_reward - rejected_reward; }
};

}  // namespace tessera
