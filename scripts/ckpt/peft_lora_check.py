#!/usr/bin/env python3
"""Tessera's LoRA against peft (needs transformers and peft: the GPU machine).

  1. A tiny Llama-shaped model trains a few iterations on mock data (tessera train, CPU) and
     saves its weights; LoRA adapters of rank 8 on every projection then train on that frozen
     base (pretrained_checkpoint), so that B is away from zero.
  2. peft: the base, exported with `tessera convert --to-hf --dtype fp32`, loads in
     transformers, and PeftModel.from_pretrained(base, LORA_CHECKPOINT) loads the adapters
     Tessera wrote in peft's format (adapter_config.json, adapter_model.safetensors); its
     logits on a few sequences must equal Tessera's own forward of the LoRA checkpoint
     (`tessera convert --from LORA --check-logits`, fp32 on the CPU reference backend).
  3. merged export: `tessera convert --from LORA --to-hf OUT --dtype fp32` loads in
     transformers with the same logits (the adapters merged into the weights).
  The adapters' gradients are checked on the CPU: they follow from dW as the plain model with
  merged weights gives it (tests/model/lora_model_test.cpp), whose gradients match PyTorch.

    peft_lora_check.py --tessera BIN [--tolerance 1e-4]
Prints the maximum relative error of each comparison; exits 1 if any exceeds the tolerance.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import torch


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        begin, end = t["data_offsets"]
        dtype = {"F32": torch.float32, "I32": torch.int32, "BF16": torch.bfloat16}[t["dtype"]]
        out[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype).reshape(t["shape"])
    return out


def run(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout}")
    return r.stdout


def max_relative(a, b):
    return float((a - b).abs().max() / b.abs().max())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tessera", required=True)
    p.add_argument("--tolerance", type=float, default=1e-4)
    a = p.parse_args()
    from transformers import AutoModelForCausalLM
    from peft import PeftModel

    failures = 0
    with tempfile.TemporaryDirectory() as w:
        model = ["--device", "cpu", "--model", "tiny_llama", "--hidden_size", "128", "--ffn_hidden_size", "352",
                 "--num_attention_heads", "4", "--num_query_groups", "2", "--mock_data", "true", "--vocab_size", "512",
                 "--seq_length", "64", "--micro_batch_size", "2", "--global_batch_size", "2", "--lr_warmup_iters", "1",
                 "--eval_interval", "0", "--log_progress", "false", "--workspace", w]
        run([a.tessera, "train", *model, "--train_iters", "5", "--save", f"{w}/base", "--exp_name", "base"])
        run([a.tessera, "train", *model, "--train_iters", "8", "--lr", "1e-2", "--lora_rank", "8",
             "--lora_alpha", "16", "--pretrained_checkpoint", f"{w}/base", "--save", f"{w}/lora", "--exp_name", "lora"])
        lora = f"{w}/lora/iter_0000008"
        run([a.tessera, "convert", "--from", f"{w}/base", "--to-hf", f"{w}/base_hf", "--dtype", "fp32"])
        run([a.tessera, "convert", "--from", lora, "--to-hf", f"{w}/merged_hf", "--dtype", "fp32"])
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 512, (2, 48), generator=g)
        with open(f"{w}/tokens.txt", "w") as f:
            for row in tokens.tolist():
                f.write(" ".join(map(str, row)) + "\n")
        run([a.tessera, "convert", "--from", lora, "--check-logits", f"{w}/tokens.txt", "--out", f"{w}/logits.safetensors"])
        tessera_logits = read_safetensors(f"{w}/logits.safetensors")["logits"]

        base = AutoModelForCausalLM.from_pretrained(f"{w}/base_hf", torch_dtype=torch.float32, attn_implementation="eager")
        base_logits = base(tokens).logits.detach()
        peft_model = PeftModel.from_pretrained(base, lora)
        peft_logits = peft_model(tokens).logits.detach()
        merged = AutoModelForCausalLM.from_pretrained(f"{w}/merged_hf", torch_dtype=torch.float32, attn_implementation="eager")
        merged_logits = merged(tokens).logits.detach()
        adapters = [n for n, _ in peft_model.named_parameters() if "lora_" in n]
        rows = [("peft logits vs tessera's forward", max_relative(tessera_logits, peft_logits)),
                ("merged export vs peft", max_relative(merged_logits, peft_logits))]
        for name, err in rows:
            bad = err > a.tolerance
            failures += bad
            print(f"  {name:36s} max relative error {err:.3g}{'  FAILED' if bad else ''}")
        # The adapters must matter: without them the logits are the base's.
        moved = max_relative(base_logits, peft_logits)
        print(f"  {'base vs adapted (must differ)':36s} {moved:.3g}")
        failures += moved < 100 * a.tolerance
        print(f"  peft loaded {len(adapters)} adapter tensors "
              f"({sum(p.numel() for n, p in peft_model.named_parameters() if 'lora_' in n)} parameters)")
        failures += len(adapters) != 2 * 7 * 4  # A and B on 7 projections of 4 layers
    print(f"peft: {'all within tolerance' if failures == 0 else f'{failures} failed'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
