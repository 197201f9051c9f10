"""DeepSeek's YaRN RoPE as transformers computes it, for Tessera's YaRN test.

Reads a JSON list of configs (rotary_base, and mla/yarn as torch_reference.py takes them) from
argv[1] and prints, per config, the inverse frequencies, the cos/sin factor and the softmax
scale (torch_reference.py's transformers-style functions, in float64) as JSON.
"""
import json
import sys

import torch

from torch_reference import mla_rope, mla_softmax_scale


def main(path):
    with open(path) as f:
        configs = json.load(f)
    out = []
    for c in configs:
        inv, factor = mla_rope(c)
        out.append({"inv_freq": inv.tolist(), "table_factor": factor, "softmax_scale": mla_softmax_scale(c)})
    print(json.dumps(out))


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    main(sys.argv[1])
