#!/usr/bin/env python3
"""Tessera against Hugging Face transformers on tiny random models (needs `transformers`).

For LlamaForCausalLM (GQA, llama3 RoPE scaling, untied head), Qwen2ForCausalLM (QKV bias,
tied head, MQA) and MistralForCausalLM (sliding window shorter than the sequence):

  1. import: build a random model with transformers, save_pretrained it (fp32 in one file,
     and bf16 in small shards with an index), run
       tessera convert --from-hf DIR --check-logits TOKENS.txt --out LOGITS.safetensors
     and compare Tessera's logits and loss with transformers' forward (labels = input ids)
     of the same saved weights;
  2. export: tessera convert --from-hf DIR --to CKPT, then
       tessera convert --from CKPT --to-hf OUT --dtype fp32
     load OUT with from_pretrained (no missing or unexpected weights allowed) and compare
     its logits with the original model's.

Prints the maximum relative error of each (max |diff| / max |reference|) and exits 1 if
any exceeds --tolerance. Tessera runs in fp32 on its CPU reference backend (the CUDA
backend computes in bf16 and is checked against that reference by the GPU tests),
transformers in fp32 with eager attention.

  python3 scripts/ckpt/hf_transformers_check.py [--tessera build/tessera]
      [--torch-device cpu|cuda] [--tolerance 1e-4] [--keep DIR]
"""
import argparse
import copy
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import torch
import transformers

VOCAB, SEQ, BATCH = 128, 24, 2
# transformers 5 folded rope_theta and rope_scaling into rope_parameters and renamed
# from_pretrained's torch_dtype to dtype.
V5 = int(transformers.__version__.split(".")[0]) >= 5


def rope(theta, scaling=None):
    if V5:
        return {"rope_parameters": dict(scaling or {"rope_type": "default"}, rope_theta=theta)}
    return {"rope_theta": theta, "rope_scaling": scaling}


MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        **rope(10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        **rope(1000000.0))),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, sliding_window=8, tie_word_embeddings=False, **rope(10000.0))),
}

ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I32": torch.int32}


def read_safetensors(path):
    """By hand, so that the check does not depend on the `safetensors` package's version."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, v in header.items():
        a, b = v["data_offsets"]
        out[name] = torch.frombuffer(bytearray(raw[8 + n + a:8 + n + b]), dtype=ST_DTYPES[v["dtype"]]).reshape(v["shape"])
    return out


def max_relative_error(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def random_model(kind):
    config_cls, model_cls, kwargs = MODELS[kind]
    config = config_cls(**kwargs, initializer_range=0.1)
    config._attn_implementation = "eager"
    torch.manual_seed({"llama": 1, "qwen2": 2, "mistral": 3}[kind])
    model = model_cls(config).eval()
    with torch.no_grad():  # norms at 1 and biases at 0 would hide mistakes in their mapping
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def reference(model_cls, directory, tokens, device):
    dtype = {"dtype" if V5 else "torch_dtype": torch.float32}
    model, info = model_cls.from_pretrained(directory, output_loading_info=True, attn_implementation="eager",
                                            **dtype)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"{directory}: transformers reports {bad}")
    model = model.to(device).eval()
    with torch.no_grad():
        out = model(input_ids=tokens.to(device), labels=tokens.to(device))
    return model, out.logits.float().cpu(), out.loss.float().cpu()


def tessera(args, *cli):
    cmd = [args.tessera, "convert", *cli]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")


def tessera_logits(args, source_flag, source, tokens_file, work):
    out = os.path.join(work, f"logits_{len(os.listdir(work))}.safetensors")
    tessera(args, source_flag, source, "--check-logits", tokens_file, "--out", out)
    t = read_safetensors(out)
    return t["logits"], t["loss"][0]


def check(args, kind, work, rows):
    _, model_cls, _ = MODELS[kind]
    model = random_model(kind)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(11))
    tokens_file = os.path.join(work, "tokens.txt")
    with open(tokens_file, "w") as f:
        f.writelines(" ".join(str(int(i)) for i in row) + "\n" for row in tokens)

    variants = {
        "fp32": dict(safe_serialization=True),
        "bf16 sharded": dict(safe_serialization=True, max_shard_size="20KB"),
    }
    for variant, save_kwargs in variants.items():
        hf_dir = os.path.join(work, variant.replace(" ", "_"))
        saved = copy.deepcopy(model).to(torch.bfloat16) if variant.startswith("bf16") else model
        saved.save_pretrained(hf_dir, **save_kwargs)
        _, ref_logits, ref_loss = reference(model_cls, hf_dir, tokens, args.torch_device)
        logits, loss = tessera_logits(args, "--from-hf", hf_dir, tokens_file, work)
        rows.append((kind, f"import {variant}", max_relative_error(logits, ref_logits),
                     max_relative_error(loss.reshape(1), ref_loss.reshape(1))))

    # Export: HF (fp32) -> Tessera checkpoint -> HF, loaded back by transformers.
    ckpt, exported = os.path.join(work, "ckpt"), os.path.join(work, "exported")
    tessera(args, "--from-hf", os.path.join(work, "fp32"), "--to", ckpt)
    tessera(args, "--from", ckpt, "--to-hf", exported, "--dtype", "fp32")
    with open(os.path.join(exported, "config.json")) as f:
        written = json.load(f)
    if written["model_type"] != kind:
        raise RuntimeError(f"exported model_type {written['model_type']}, expected {kind}")
    _, original_logits, original_loss = reference(model_cls, os.path.join(work, "fp32"), tokens, args.torch_device)
    reloaded, logits, loss = reference(model_cls, exported, tokens, args.torch_device)
    if type(reloaded).__name__ != model_cls.__name__:
        raise RuntimeError(f"exported directory loads as {type(reloaded).__name__}")
    rows.append((kind, "export fp32 round trip", max_relative_error(logits, original_logits),
                 max_relative_error(loss.reshape(1), original_loss.reshape(1))))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--tessera", default=os.path.join(root, "build", "tessera"))
    parser.add_argument("--torch-device", default="cpu")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--keep", help="keep the work files in this directory")
    args = parser.parse_args()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, tessera {args.tessera}")
    rows = []
    work_root = args.keep or tempfile.mkdtemp(prefix="tessera_hf_check_")
    try:
        for kind in MODELS:
            work = os.path.join(work_root, kind)
            shutil.rmtree(work, ignore_errors=True)
            os.makedirs(work)
            check(args, kind, work, rows)
    finally:
        if not args.keep:
            shutil.rmtree(work_root, ignore_errors=True)
    failed = False
    print(f"{'model':<8} {'check':<24} {'logits max rel err':>18} {'loss rel err':>13}")
    for kind, what, logits_err, loss_err in rows:
        ok = logits_err < args.tolerance and loss_err < args.tolerance
        failed |= not ok
        print(f"{kind:<8} {what:<24} {logits_err:>18.3e} {loss_err:>13.3e}  {'ok' if ok else 'FAIL'}")
    print(f"tolerance {args.tolerance:g}: {'FAILED' if failed else 'all passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
