#!/usr/bin/env python3
"""The full-size and proxy table of one GPU, against its targets, from what gpu_suite.sh's
`full` and `full_proxies` steps wrote under OUT:

  OUT/full_bf16/bench_model_full.json, OUT/full_fp8/bench_model_full.json   (bench model --full)
  OUT/proxy_*/bench_model.json                                              (bench model, proxies)
  OUT/full_peer.jsonl                                                       (torch_llama.py)

usage: full_table.py OUT   (prints markdown; rows whose measurements are missing say so)
"""
import json
import os
import sys

out = sys.argv[1]


def load(path):
    try:
        with open(os.path.join(out, path)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return []


def peers():
    rows = []
    try:
        with open(os.path.join(out, "full_peer.jsonl")) as f:
            for line in f:
                line = line.strip()
                if line:
                    rows.append(json.loads(line))
    except OSError:
        pass
    return rows


full = load("full_bf16/bench_model_full.json") + load("full_fp8/bench_model_full.json")
proxies = (load("proxy_bf16/bench_model.json") + load("proxy_mistral/bench_model.json") +
           load("proxy_fp8/bench_model.json"))
peer = peers()


def tessera_row(rows, model, fp8):
    for r in rows:
        if r["model"] == model and r["precision"].startswith("fp8") == fp8:
            return r
    return None


def peer_row(model, attn="sdpa", fp8=False, window=0):
    for r in peer:
        if (r["model"] == model and r.get("attn", "sdpa") == attn and bool(r.get("fp8")) == fp8
                and r.get("window", 0) == window and r.get("compile")):
            return r
    return None


print("## Full models on one GPU (bench model --full: all layers, seq 8192, mbs 1, "
      "16 micro-batches per step)\n")
print("| model | precision | tokens/s/GPU | target | met | TFLOP/s/GPU | MFU | peak GiB | "
      "planned GiB (error) |")
print("|---|---|---|---|---|---|---|---|---|")
for model in ("llama3.1_8B", "qwen2.5_7B"):
    for fp8, target in ((True, 16000), (False, 11000)):
        r = tessera_row(full, model, fp8)
        name = "FP8 hybrid" if fp8 else "BF16"
        if r is None:
            print(f"| {model} | {name} | not measured | {target} | - | - | - | - | - |")
            continue
        tok = r["tokens_per_s_per_gpu"]
        print(f"| {model} | {name} | {tok:.0f} | {target} | {'yes' if tok >= target else 'no'} | "
              f"{r['tflops_per_gpu']:.1f} | {100 * r['mfu']:.1f}% | {r['peak_mem_gib']:.2f} | "
              f"{r['planned_mem_gib']:.2f} ({r['plan_error_pct']:+.2f}%) |")

parts = ["gemm", "attention", "recompute", "casts", "optimizer", "communication", "other", "idle"]
print("\n### Where a full step's time goes (one profiled step, ms and % of it)\n")
print("| model | precision | step | " + " | ".join(parts) + " |")
print("|---|---|---|" + "---|" * len(parts))
for r in full:
    b = r.get("breakdown")
    if not b:
        continue
    step = b["step_ms"]
    cells = " | ".join(f"{b['parts_ms'][p]:.0f} ({100 * b['parts_ms'][p] / step:.1f}%)"
                       for p in parts)
    print(f"| {r['model']} | {r['precision']} | {step:.0f} | {cells} |")

print("\n## Proxies against the PyTorch peers (4 layers, seq 8192, mbs 1; tokens/s)\n")
print("| proxy | Tessera | peer | peer tokens/s | ratio | target | met | peak GiB Tessera / peer |")
print("|---|---|---|---|---|---|---|---|")
cases = [
    ("Llama, BF16", "llama3.1_8B", False, ("llama3.1_8b", "sdpa", False, 0), "--compile", 1.25),
    ("Qwen, BF16", "qwen2.5_7B", False, ("qwen2.5_7b", "sdpa", False, 0), "--compile", 1.25),
    ("Mistral, window 4096", "mistral_7B", False, ("mistral_7b", "flex", False, 4096),
     "--attn flex --compile", 1.3),
    ("FP8 hybrid", "llama3.1_8B", True, ("llama3.1_8b", "sdpa", True, 0), "--fp8 --compile", 1.45),
]
for name, model, fp8, key, peer_flags, target in cases:
    t = tessera_row(proxies, model, fp8)
    p = peer_row(*key)
    if t is None or p is None:
        print(f"| {name} | {'-' if t is None else round(t['tokens_per_s_per_gpu'])} | "
              f"{peer_flags} | {'-' if p is None else round(p['tok_s'])} | not measured | "
              f"{target}x | - | - |")
        continue
    ratio = t["tokens_per_s_per_gpu"] / p["tok_s"]
    mem_ok = t["peak_mem_gib"] <= p["peak_mem_gib"]
    print(f"| {name} | {t['tokens_per_s_per_gpu']:.0f} | {peer_flags} | {p['tok_s']:.0f} | "
          f"{ratio:.3f}x | {target}x | {'yes' if ratio >= target else 'no'} | "
          f"{t['peak_mem_gib']:.2f} / {p['peak_mem_gib']:.2f}{'' if mem_ok else ' (above)'} |")
