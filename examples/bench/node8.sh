#!/usr/bin/env bash
# The seed workload on one node: full Llama 3.1 8B and Qwen 2.5 7B (32 / 28 layers, seq 8192,
# mock data), BF16 and FP8 hybrid, data parallel + distributed optimizer over every GPU, then
# the Llama scaling series (1, 2, 4, ... GPUs), a profiled step on all ranks with
# `tessera report --ranks`, the curves through `tessera plot`, and one markdown table.
#   examples/bench/node8.sh [GPUS] [ITERS]        (defaults: 8 GPUs, 50 iterations)
# Environment: TESSERA (binary, default build/tessera), OUT (results, default ./node8_out),
# GPU (spec for the memory planner, default H200), GBS_LLAMA / GBS_QWEN (global batches,
# default the seeds' 256 / 512; smaller ones make a quick check of the whole script).
# Batch settings are the seeds' (Llama: micro 2, global 256; Qwen: micro 4, global 512). The
# memory planner picks the cheapest recompute that fits (null = none, selective, full) and
# the largest micro batch up to the seeds' that fits; the chosen settings are in the table.
set -uo pipefail
GPUS=${1:-8}
ITERS=${2:-50}
TESSERA=${TESSERA:-build/tessera}
OUT=${OUT:-$PWD/node8_out}
GPU=${GPU:-H200}
GBS_LLAMA=${GBS_LLAMA:-256}
GBS_QWEN=${GBS_QWEN:-512}
mkdir -p "$OUT"
status=0
table="$OUT/node.md"
echo "| model | precision | GPUs | micro batch | recompute | ms/iter | TFLOP/s/GPU | tokens/s/GPU | peak GiB | final loss |" > "$table"
echo "|---|---|---|---|---|---|---|---|---|---|" >> "$table"

# fits MODEL GPUS MBS RECOMPUTE [keys...]: does the planner say the run fits one GPU?
fits() {
  local model=$1 gpus=$2 mbs=$3 recompute=$4
  shift 4
  "$TESSERA" memory --config "$model-pretrain" --num_gpus "$gpus" --sharding zero1 --gpu "$GPU" \
    --micro_batch_size "$mbs" --recompute_granularity "$recompute" "$@" 2>/dev/null | grep -q "^FITS"
}

# choose MODEL GPUS MAX_MBS [keys...]: prints "MBS RECOMPUTE", the largest micro batch
# (<= MAX_MBS) with the cheapest recompute that fits.
choose() {
  local model=$1 gpus=$2 max_mbs=$3 mbs recompute
  shift 3
  for ((mbs = max_mbs; mbs >= 1; mbs /= 2)); do
    for recompute in null selective full; do
      if fits "$model" "$gpus" "$mbs" "$recompute" "$@"; then echo "$mbs $recompute"; return 0; fi
    done
  done
  return 1
}

# run NAME MODEL GPUS GLOBAL_BATCH MAX_MBS [extra keys...]: one training run, one table row.
run() {
  local name=$1 model=$2 gpus=$3 gbs=$4 max_mbs=$5
  shift 5
  local choice mbs recompute
  if ! choice=$(choose "$model" "$gpus" "$max_mbs" "$@"); then
    echo "$name: does not fit on $gpus x $GPU even with micro batch 1 and full recompute" | tee -a "$OUT/summary.txt"
    status=1
    return
  fi
  read -r mbs recompute <<< "$choice"
  local port=$((29700 + RANDOM % 200))
  echo "== $name: $gpus GPUs, micro batch $mbs, recompute $recompute" | tee -a "$OUT/summary.txt"
  "$TESSERA" launch --nproc_per_node "$gpus" --master_port "$port" train \
    --config "$model-pretrain" --mock_data true --train_iters "$ITERS" --log_interval 5 \
    --micro_batch_size "$mbs" --global_batch_size "$gbs" --use_distributed_optimizer true \
    --recompute_granularity "$recompute" --workspace "$OUT/runs" --exp_name "$name" "$@" \
    > "$OUT/$name.log" 2>&1 || status=1
  local metrics="$OUT/runs/tessera/${USER:-user}/$name/metrics.jsonl"
  [ -f "$metrics" ] || metrics=$(find "$OUT/runs" -path "*/$name/metrics.jsonl" | head -1)
  if [ -z "$metrics" ] || [ ! -f "$metrics" ]; then
    echo "$name: no metrics (see $OUT/$name.log)" | tee -a "$OUT/summary.txt"
    status=1
    return
  fi
  # Medians over the logged iterations after the first, as `tessera plot` reports them.
  python3 - "$metrics" "$name" "$gpus" "$mbs" "$recompute" "$@" >> "$table" <<'PY'
import json, statistics, sys
path, name, gpus, mbs, recompute = sys.argv[1:6]
precision = "fp8 hybrid" if "hybrid" in sys.argv[6:] else "bf16"
rows = [json.loads(l) for l in open(path) if '"lm_loss"' in l]
body = rows[1:] or rows
med = lambda k: statistics.median(r[k] for r in body)
model = name.split("_")[0]
print(f"| {model} | {precision} | {gpus} | {mbs} | {recompute} | {med('elapsed_ms'):.0f} | "
      f"{med('tflops_per_gpu'):.1f} | {med('tokens_per_s_per_gpu'):.0f} | "
      f"{max(r['mem_peak_gib'] for r in rows):.1f} | {rows[-1]['lm_loss']:.4f} |")
PY
}

run "llama3.1-8B_bf16_${GPUS}gpu" llama3.1_8B "$GPUS" "$GBS_LLAMA" 2
run "llama3.1-8B_fp8_${GPUS}gpu" llama3.1_8B "$GPUS" "$GBS_LLAMA" 2 --fp8 hybrid
run "qwen2.5-7B_bf16_${GPUS}gpu" qwen2.5_7B "$GPUS" "$GBS_QWEN" 4
run "qwen2.5-7B_fp8_${GPUS}gpu" qwen2.5_7B "$GPUS" "$GBS_QWEN" 4 --fp8 hybrid

# Scaling: the same Llama run on 1, 2, 4, ... GPUs (one global batch throughout); one GPU
# holds the full model only with a 4-layer proxy, so the series uses the seeds' proxy
# (--num_layers 4) at every size, and its 1-GPU figure is the efficiency baseline.
for ((g = 1; g <= GPUS; g *= 2)); do
  run "llama3.1-8B-proxy_bf16_${g}gpu" llama3.1_8B "$g" "$GBS_LLAMA" 2 --num_layers 4
done

# A profiled step on every rank, and the cross-rank report (collective skew, stragglers).
port=$((29900 + RANDOM % 50))
"$TESSERA" launch --nproc_per_node "$GPUS" --master_port "$port" train \
  --config llama3.1_8B-pretrain --mock_data true --train_iters 4 --micro_batch_size 2 \
  --global_batch_size $((2 * GPUS)) --use_distributed_optimizer true \
  --recompute_granularity full --profile true --profile_step_start 3 --profile_step_end 4 \
  --profile_ranks all --workspace "$OUT/runs" --exp_name llama3.1-8B_profiled \
  > "$OUT/profiled.log" 2>&1 || status=1
traces=$(find "$OUT/runs" -path "*llama3.1-8B_profiled/traces" -type d | head -1)
if [ -n "$traces" ]; then
  "$TESSERA" report --ranks "$traces" -o "$OUT/report_ranks" > "$OUT/report_ranks.log" 2>&1 || status=1
else
  echo "no traces from the profiled run (see $OUT/profiled.log)" | tee -a "$OUT/summary.txt"
  status=1
fi

runs=$(find "$OUT/runs" -mindepth 3 -maxdepth 3 -type d -name "*_${GPUS}gpu" | sort)
# shellcheck disable=SC2086
[ -n "$runs" ] && "$TESSERA" plot $runs -o "$OUT/plots" > "$OUT/plot.log" 2>&1 || status=1

cat "$table" | tee -a "$OUT/summary.txt"
echo "exit $status" | tee -a "$OUT/summary.txt"
exit $status
