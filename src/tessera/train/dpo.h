#pragma once
// Direct preference optimisation's losses, as TRL's DPOTrainer computes them. For one pair,
// with the policy's and the reference's summed log-probabilities of the chosen and rejected
// answers (pc, pr; rc, rr) and z = (pc - rc) - (pr - rr):
//   sigmoid  -(1 - e) log sigmoid(beta z) - e log sigmoid(-beta z)   (DPO; e: label smoothing,
//            the robust/conservative variant)
//   ipo      (z - 1 / (2 beta))^2                                      (IPO)
//   hinge    max(0, 1 - beta z)                                        (SLiC)
// The rewards are beta (pc - rc) and beta (pr - rr). Options, as TRL's: length_normalize
// divides each log-probability by its answer's tokens (as TRL's IPO and SimPO's average
// log-probabilities do); reference_free takes rc = rr = 0; rpo_alpha adds RPO's
// alpha x the chosen answer's mean token loss, -(its summed log-probability) / its tokens.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tessera/config/config.h"

namespace tessera {

struct DpoOptions {
  DpoLossType loss_type = DpoLossType::Sigmoid;
  double beta = 0.1;
  double label_smoothing = 0.0;
  bool length_normalize = false;
  bool reference_free = false;
  double rpo_alpha = 0.0;
};

struct DpoPair {
  double loss = 0;
  // d loss / d pc and d loss / d pr (the summed log-probabilities): what the chosen and
  // rejected answers are pushed by (the reference's are constants).
  double dloss_dchosen = 0, dloss_drejected = 0;
  double chosen_reward = 0, rejected_reward = 0;
};

// *_tokens: the answers' token counts (length_normalize, rpo_alpha).
DpoPair dpo_pair(const DpoOptions& o, double policy_chosen, double policy_rejected,
                 double reference_chosen, double reference_rejected, int64_t chosen_tokens = 1,
                 int64_t rejected_tokens = 1);

// Means over a batch of pairs, under TRL's names: loss, rewards/chosen, rewards/rejected,
// rewards/accuracies (the share of pairs whose chosen reward is the higher), logps/chosen,
// logps/rejected; rewards/margins is chosen minus rejected.
struct DpoBatchStats {
  double loss = 0, chosen_reward = 0, rejected_reward = 0, accuracy = 0, logp_chosen = 0,
         logp_rejected = 0;
  double margin() const { return chosen_reward - rejected_reward; }
  // The statistics under TRL's names, as the iteration line, metrics.jsonl and TensorBoard
  // report them.
  std::vector<std::pair<std::string, double>> trl_named() const {
    return {{"rewards/chosen", chosen_reward}, {"rewards/rejected", rejected_reward},
            {"rewards/accuracies", accuracy},  {"rewards/margins", margin()},
            {"logps/chosen", logp_chosen},     {"logps/rejected", logp_rejected}};
  }
};

}  // namespace tessera
