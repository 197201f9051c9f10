#!/usr/bin/env python3
"""PyTorch reference for tests/train/dpo_test.cpp: TRL's DPO losses (sigmoid with label
smoothing, ipo, hinge) and rewards, with autograd's gradients for the policy's log-probs;
optionally length-normalised (per-token log-probs), reference-free, and with RPO's term
(rpo_alpha x the chosen answer's mean token loss).

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
        nc, nr = c.get("nc", 1), c.get("nr", 1)
        pcn, prn = (pc / nc, pr / nr) if c.get("length_normalize") else (pc, pr)
        rcn, rrn = (rc / nc, rr / nr) if c.get("length_normalize") else (rc, rr)
        if c.get("reference_free"):
            rcn, rrn = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        logits = (pcn - rcn) - (prn - rrn)  # TRL: chosen_logratios - rejected_logratios
        if c["loss_type"] == "sigmoid":
            loss = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
        elif c["loss_type"] == "ipo":
            loss = (logits - 1 / (2 * beta)) ** 2
        else:  # hinge
            loss = torch.relu(1 - beta * logits)
        loss = loss + c.get("rpo_alpha", 0.0) * (-pc / nc)  # TRL: rpo_alpha * the chosen NLL
        loss.backward()
        out.append({"loss": loss.item(), "dchosen": pc.grad.item(), "drejected": pr.grad.item(),
                    "chosen_reward": (beta * (pcn - rcn)).item(), "rejected_reward": (beta * (prn - rrn)).item()})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
