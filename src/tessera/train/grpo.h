#pragma once
// GRPO's arithmetic, as TRL's GRPOTrainer computes it: advantages relative to each group of
// completions of one prompt, and the clipped policy-gradient loss per completion token with
// its gradient with respect to the token's log-probability (what the model's backward then
// scales each token's loss gradient by).
//
// For completion token t of a completion with advantage A, the policy's log-probability p,
// the sampling policy's o (the old policy: p itself on the first optimizer step of a
// generation batch) and the reference's q:
//   r = exp(p - o),  loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)
//                             + beta (exp(q - p) - (q - p) - 1)        (k3 KL estimate)
// epsilon_high above epsilon is DAPO's asymmetric clip ("clip-higher"). The batch loss:
//   grpo     each completion's mean token loss, averaged over the completions
//   bnpo     the token losses' mean over every completion token of the batch (DAPO's
//            token-level normalisation)
//   dr_grpo  the token losses' sum over (completions x max_completion_length) (Dr. GRPO)
#include <cstdint>
#include <vector>

#include "tessera/config/config.h"

namespace tessera {

struct GrpoOptions {
  double epsilon = 0.2;       // the ratio's lower clip, 1 - epsilon
  double epsilon_high = 0.2;  // its upper clip, 1 + epsilon_high (DAPO: 0.28)
  double beta = 0.0;          // the KL penalty's weight; 0: no reference is needed
  GrpoLossType loss_type = GrpoLossType::Grpo;
  int64_t max_completion_length = 0;  // dr_grpo's normaliser
};

// rewards: completions in groups of `group_size` consecutive ones (the completions of one
// prompt). The reward minus its group's mean, divided by the group's standard deviation (the
// unbiased one, as torch.std, plus 1e-4) when scale_rewards (GRPO), not when false (Dr. GRPO).
std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t group_size,
                                     bool scale_rewards);

// Each group's standard deviation of its rewards: the unbiased one, as torch.std (0 for a
// group of one).
std::vector<double> group_stds(const std::vector<double>& rewards, int64_t group_size);

// Dynamic sampling (DAPO): per group, whether its rewards differ, i.e. whether it teaches
// anything (a group of equal rewards has zero advantages).
std::vector<bool> informative_groups(const std::vector<double>& rewards, int64_t group_size);

struct GrpoCompletion {
  std::vector<double> logp, old_logp, ref_logp;  // per completion token; ref_logp only with beta
  double advantage = 0;
};

struct GrpoBatchLoss {
  double loss = 0;
  std::vector<std::vector<double>> dloss_dlogp;  // per completion, per token
  // Means over the completion tokens, under TRL's names: clip_ratio/low_mean (ratio below
  // 1 - epsilon where the advantage is negative), clip_ratio/high_mean (above 1 + epsilon_high,
  // advantage positive), clip_ratio/region_mean (either), kl (the k3 estimate; 0 without beta).
  double clip_low = 0, clip_high = 0, clip_region = 0, kl = 0;
  int64_t tokens = 0;  // the completion tokens those means are over
};

// The counts the batch loss normalises by: those of the whole batch when a call scores part
// of it (a micro-batch on one rank); zeros: the counts of the completions passed.
struct GrpoBatchCounts {
  int64_t completions = 0, tokens = 0;
};

GrpoBatchLoss grpo_loss(const GrpoOptions& o, const std::vector<GrpoCompletion>& batch,
                        GrpoBatchCounts whole = {});

}  // namespace tessera
