#!/usr/bin/env python3
"""PyTorch reference for tests/train/dpo_test.cpp: TRL's DPO losses (sigmoid with label
smoothing, ipo, hinge) and rewards, with autograd's gradients for the policy's log-probs.

    dpo_reference.py CASES_JSON     prints [{loss, dchosen, drejected, chosen_reward, rejected_reward}]
"""
import json
import sys

import torch
import torch.nn.functional as F


def main():
    cases = json.load(open(sys.argv[1]))
    out = []
    for c in cases:
        pc = torch.tensor(c["pc"], dtype=torch.float64, requires_grad=True)
        pr = torch.tensor(c["pr"], dtype=torch.float64, requires_grad=True)
        rc = torch.tensor(c["rc"], dtype=torch.float64)
        rr = torch.tensor(c["rr"], dtype=torch.float64)
        beta, ls = c["beta"], c["label_smoothing"]
        logits = (pc - rc) - (pr - rr)  # TRL: chosen_logratios - rejected_logratios
        if c["loss_type"] == "sigmoid":
            loss = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
        elif c["loss_type"] == "ipo":
            loss = (logits - 1 / (2 * beta)) ** 2
        else:  # hinge
            loss = torch.relu(1 - beta * logits)
        loss.backward()
        out.append({"loss": loss.item(), "dchosen": pc.grad.item(), "drejected": pr.grad.item(),
                    "chosen_reward": (beta * (pc - rc)).item(), "rejected_reward": (beta * (pr - rr)).item()})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
