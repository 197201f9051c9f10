#!/usr/bin/env bash
# Eight GPUs of one host: the workflow's single-node table with the shipped experiments, scaling
# of the full Llama 3.1 8B FP8 to 8 GPUs, parity of TP 8 and an interleaved PP 8 against one
# GPU, and a profiled step on all 8 ranks with `tessera report --ranks`. Runs on the GPU machine
# after gpu_suite.sh has unpacked the payload (binaries in .device/bin); results under $OUT,
# one markdown table per step and OUT/eight_gpu.md with all of them.
#   bash scripts/device/eight_gpu.sh [tests] [table] [scaling] [profile]   (default: all)
#     tests:   DistGpu.EightGpu* (TP 8 + SP, PP 8 interleaved, 20 steps of Brown text in fp32)
#     table:   each command of the workflow's table as written (`--config <experiment> <args>`),
#              TABLE_ITERS iterations (default 50); a command the planner says does not fit
#              runs with the first change it names that fits (recompute, then Megatron's
#              precision-aware optimizer), and the row says which; then `tessera plot` of
#              the runs (OUT/plots: curves and report.html)
#     scaling: full Llama 3.1 8B FP8 hybrid on 1 and 8 GPUs, ZeRO-1 and FSDP, 8 micro-batches
#              per GPU per step, tokens/s/GPU against one GPU
#     profile: the Llama 3.1 8B proxy on 8 GPUs (TP 2 x DP 4, ZeRO-1), two profiled steps on
#              every rank, then `tessera report --ranks`
# TABLE_ONLY (a space-separated list of row names) picks rows, so the table fits several calls;
# SCALING_ITERS (default 4) and RUN_TIMEOUT (seconds per run, default 240) shorten the runs.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/.device/out}"
BIN="${BIN:-$ROOT/.device/bin}"
T="$BIN/tessera"
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests table scaling profile)
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
# shellcheck source=scripts/device/multi_gpu_common.sh
source "$ROOT/scripts/device/multi_gpu_common.sh"
machine_info "$OUT/eight_gpu_machine.txt"
if [ "$GPUS" -lt 8 ]; then
  echo "eight_gpu.sh: $GPUS GPUs here, 8 needed"
  exit 2
fi

if want tests; then
  echo "== DistGpu.EightGpu* on $GPUS GPUs"
  timeout "${EIGHT_TESTS_TIMEOUT:-400}" "$BIN/test_gpu" --gtest_color=no \
    --gtest_filter="DistGpu.EightGpu*" > "$OUT/dist_gpu_tests_eight.log" 2>&1 || status=1
  grep -hE "^\[ (parity|  FAILED|  PASSED|  SKIPPED|       OK)" "$OUT/dist_gpu_tests_eight.log"
fi

if want table; then
  echo "== the workflow's single-node table, ${TABLE_ITERS:-50} iterations each"
  table="$OUT/table.md"
  echo "$TABLE_HEAD" > "$table"
  : > "$OUT/table_layouts.txt"
  ITERS="--train_iters ${TABLE_ITERS:-50}"
  for spec in \
      "llama3.1_8B_fp8|--config llama3.1_8B-pretrain --fp8 hybrid --micro_batch_size 2 --global_batch_size 256" \
      "llama3.1_8B_bf16|--config llama3.1_8B-pretrain --micro_batch_size 2 --global_batch_size 256" \
      "qwen2.5_7B_fp8|--config qwen2.5_7B-pretrain --fp8 hybrid --micro_batch_size 4 --global_batch_size 512" \
      "qwen2.5_7B_bf16|--config qwen2.5_7B-pretrain --micro_batch_size 4 --global_batch_size 512" \
      "llama3.1_70B_40l_fp8|--config llama3.1_70B-pretrain --num_layers 40 --fp8 hybrid --no_fp8_weight_transpose_cache true" \
      "mixtral_8x7B|--config mixtral_8x7B-pretrain --global_batch_size 256" \
      "deepseek_v2_lite|--config deepseek_v2_lite-pretrain --global_batch_size 256" \
      "deepseek_v3_proxy|--config deepseek_v3-pretrain --num_layers 3 --moe_layer_freq 1"; do
    name=${spec%%|*}
    if [ -n "${TABLE_ONLY:-}" ] && [[ " $TABLE_ONLY " != *" $name "* ]]; then continue; fi
    RUN_TIMEOUT=${RUN_TIMEOUT:-580} run_fitting "$name" 8 "$table" "$OUT/table_layouts.txt" \
      "${spec#*|} $ITERS" "" "--recompute_granularity selective" "--recompute_granularity full" \
      "$PA" "$PA --recompute_granularity selective" "$PA --recompute_granularity full"
  done
  cat "$table" "$OUT/table_layouts.txt"
  # The table's curves and throughput page (tessera plot: loss, iteration time, tokens/s,
  # memory, MoE balance; report.html).
  "$T" plot "$RUNS" -o "$OUT/plots" --format svg > "$OUT/plots.txt" 2>&1 || status=1
fi

if want scaling; then
  echo "== full Llama 3.1 8B FP8 hybrid on 1 and 8 GPUs (8 micro-batches per GPU per step)"
  scaling_runs "$OUT/scaling.md" fp8 "1 8"
fi

if want profile; then
  echo "== profiled step on all 8 ranks, report --ranks"
  PROXY="--config llama3.1_8B-pretrain --num_layers 4 --micro_batch_size 1 --global_batch_size 8"
  # shellcheck disable=SC2086
  train profile_tp2_dp4 8 $PROXY --train_iters 6 --tensor_model_parallel_size 2 \
    --sequence_parallel true --use_distributed_optimizer true --profile true \
    --profile_step_start 4 --profile_step_end 6 --profile_ranks all || status=1
  "$T" report --ranks "$RUNS/g/u/profile_tp2_dp4/traces" -o "$OUT/ranks_report" \
    > "$OUT/ranks_report.txt" 2>&1 || status=1
  head -16 "$OUT/ranks_report/summary.md"
fi

cat "$OUT"/table.md "$OUT"/scaling.md > "$OUT/eight_gpu.md" 2>/dev/null
echo "exit $status"
exit $status
