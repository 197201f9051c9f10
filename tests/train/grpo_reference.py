#!/usr/bin/env python3
"""PyTorch reference for tests/train/grpo_test.cpp: TRL's GRPO advantages (group mean, and the
unbiased group std unless Dr. GRPO) and its clipped per-token loss with the k3 KL penalty, the
grpo / bnpo / dr_grpo normalisations, autograd's gradients for the policy's per-token
log-probabilities, and TRL's clip-ratio and KL metrics.

    grpo_reference.py CASES_JSON    prints [{advantages, loss, grads, clip_low, clip_high, clip_region, kl}]
"""
import json
import sys

import torch


def main():
    out = []
    for c in json.load(open(sys.argv[1])):
        G = c["group_size"]
        rewards = torch.tensor(c["rewards"], dtype=torch.float64)
        grouped = rewards.view(-1, G)
        adv = rewards - grouped.mean(1).repeat_interleave(G)
        if c["scale_rewards"]:
            adv = adv / (grouped.std(1).repeat_interleave(G) + 1e-4)
        lens = [len(x) for x in c["logp"]]
        L = max(lens)
        pad = lambda rows: torch.tensor([r + [0.0] * (L - len(r)) for r in rows], dtype=torch.float64)
        logp = pad(c["logp"]).requires_grad_(True)
        old, ref = pad(c["old_logp"]), pad(c["ref_logp"])
        mask = torch.tensor([[1.0] * n + [0.0] * (L - n) for n in lens], dtype=torch.float64)
        A = adv.unsqueeze(1)
        coef1 = torch.exp(logp - old)
        coef2 = torch.clamp(coef1, 1 - c["epsilon"], 1 + c["epsilon_high"])
        per_token = -torch.min(coef1 * A, coef2 * A)
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if c["beta"] != 0:
            per_token = per_token + c["beta"] * kl
        if c["loss_type"] == "grpo":
            loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
        elif c["loss_type"] == "bnpo":
            loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
        else:
            loss = (per_token * mask).sum() / (per_token.size(0) * c["max_completion_length"])
        loss.backward()
        low = ((coef1 < 1 - c["epsilon"]) & (A < 0)).double()
        high = ((coef1 > 1 + c["epsilon_high"]) & (A > 0)).double()
        tokens = mask.sum()
        out.append({"advantages": adv.tolist(), "loss": loss.item(),
                    "grads": [logp.grad[i, :n].tolist() for i, n in enumerate(lens)],
                    "clip_low": ((low * mask).sum() / tokens).item(),
                    "clip_high": ((high * mask).sum() / tokens).item(),
                    "clip_region": ((((low + high) > 0).double() * mask).sum() / tokens).item(),
                    "kl": ((kl * mask).sum() / tokens).item() if c["beta"] != 0 else 0.0})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
