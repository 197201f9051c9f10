#!/usr/bin/env bash
# Two and four GPUs of one host: the multi-GPU tests, scaling of the full Llama 3.1 8B, the MoE
# models with experts over four GPUs, the 40-layer Llama 3.1 70B proxy, and a profiled step on
# every rank with `tessera report --ranks` (steps that need four GPUs say so when fewer are
# there). Runs on the GPU machine after gpu_suite.sh has
# unpacked the payload (binaries in .device/bin, the environment below); results under $OUT,
# one markdown table per step and OUT/four_gpu.md with all of them.
#   bash scripts/device/four_gpu.sh [tests] [profile] [scaling] [moe] [big] [sharding_profile]
#                                   (default: all but sharding_profile)
#     tests:   DistGpu.* (the size-4 layouts on Brown text with 4 GPUs, two nodes on one host
#              over sockets and a lost node among them, besides the 2-GPU tests)
#     profile: the Llama 3.1 8B proxy on every GPU (TP 2 x DP the rest, ZeRO-1), two profiled
#              steps on every rank, then `tessera report --ranks` (skew, stragglers, who waited
#              for whom)
#     scaling: full Llama 3.1 8B, BF16 and FP8 hybrid, on 1, 2 and 4 GPUs with ZeRO-1 and with
#              FSDP, 8 micro-batches per GPU per step, tokens/s/GPU against one GPU
#     moe:     the DeepSeek-V3 proxy (3 layers, every one MoE, 256 experts), DeepSeek-V2-Lite
#              and Mixtral 8x7B with experts over 4 GPUs, the layout the planner picks
#     sharding_profile: full Llama 3.1 8B FP8 hybrid on 2 GPUs, ZeRO-1 and FSDP, one profiled
#              step each on rank 0, then `tessera report --compare` of the two traces
#     big:     Llama 3.1 70B, 40 layers, FP8 hybrid without the transpose cache, on 4 GPUs in
#              the first layout the planner says fits, in the order below (no recompute first)
# SCALING_GPUS (default "1 2 4"), SCALING_PRECISIONS (default "bf16 fp8") and SCALING_ITERS
# (default 4) shorten the scaling step;
# OTHER_TESTS (default DistGpu.*) picks the tests run after the four-GPU ones.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/.device/out}"
BIN="${BIN:-$ROOT/.device/bin}"
T="$BIN/tessera"
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests profile scaling moe big)
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
# shellcheck source=scripts/device/multi_gpu_common.sh
source "$ROOT/scripts/device/multi_gpu_common.sh"
machine_info "$OUT/four_gpu_machine.txt"

if want tests; then
  echo "== DistGpu.* on $GPUS GPUs: the four-GPU tests, then the others"
  four="DistGpu.FourGpu*:DistGpu.TwoNodes*"
  timeout "${FOUR_TESTS_TIMEOUT:-300}" "$BIN/test_gpu" --gtest_color=no --gtest_filter="$four" \
    > "$OUT/dist_gpu_tests_four.log" 2>&1 || status=1
  timeout "${OTHER_TESTS_TIMEOUT:-400}" "$BIN/test_gpu" --gtest_color=no \
    --gtest_filter="${OTHER_TESTS:-DistGpu.*}-$four" > "$OUT/dist_gpu_tests_other.log" 2>&1 ||
    status=1
  grep -hE "^\[ (parity|lost node|  FAILED|  PASSED|  SKIPPED|       OK)" \
    "$OUT/dist_gpu_tests_four.log" "$OUT/dist_gpu_tests_other.log"
fi

if want profile; then
  echo "== profiled step on every rank, report --ranks"
  PROXY="--config llama3.1_8B-pretrain --num_layers 4 --micro_batch_size 1 --global_batch_size 8"
  # shellcheck disable=SC2086
  train profile_tp2_dp2 "$GPUS" $PROXY --train_iters 6 --tensor_model_parallel_size 2 \
    --sequence_parallel true --use_distributed_optimizer true --profile true \
    --profile_step_start 4 --profile_step_end 6 --profile_ranks all || status=1
  "$T" report --ranks "$RUNS/g/u/profile_tp2_dp2/traces" -o "$OUT/ranks_report" \
    > "$OUT/ranks_report.txt" 2>&1 || status=1
  # The traces themselves, small at this size (the suite's archive leaves traces out).
  tar czf "$OUT/profile_traces.tgz" -C "$RUNS/g/u/profile_tp2_dp2" traces
  grep -E "iteration +[0-9]+/" "$OUT/profile_tp2_dp2.log" | grep -o "iteration *[0-9]*/.*per iteration (ms): [0-9.]*"
  head -12 "$OUT/ranks_report/summary.md"
fi

if want sharding_profile; then
  echo "== full Llama 3.1 8B FP8 on 2 GPUs: a profiled step of ZeRO-1 against one of FSDP"
  for sharding in zero1 fsdp; do
    keys="--use_distributed_optimizer true"
    [ "$sharding" = fsdp ] && keys="--use_torch_fsdp2 true"
    # shellcheck disable=SC2086
    train "profile_full8b_$sharding" 2 --config llama3.1_8B-pretrain --micro_batch_size 1 \
      --global_batch_size 16 --train_iters 3 $FULL_STATE --fp8 hybrid $keys --profile true \
      --profile_step_start 2 --profile_step_end 3 || status=1
  done
  "$T" report --compare "$RUNS"/g/u/profile_full8b_zero1/traces/rank-0.pt.trace.json.gz \
    "$RUNS"/g/u/profile_full8b_fsdp/traces/rank-0.pt.trace.json.gz -o "$OUT/sharding_compare" \
    --format md > "$OUT/sharding_compare.txt" 2>&1 || status=1
  cat "$OUT/sharding_compare.txt"
fi

if want scaling; then
  echo "== full Llama 3.1 8B scaling (8 micro-batches per GPU per step)"
  scaling_runs "$OUT/scaling.md" "${SCALING_PRECISIONS:-bf16 fp8}" "${SCALING_GPUS:-1 2 4}"
fi

need_four() {
  [ "$GPUS" -ge 4 ] && return 0
  echo "| $1 | 4 | not run: $GPUS GPUs here, 4 needed | | | | | | | |" >> "$OUT/$1.md"
  echo "-- $1: not run, $GPUS GPUs here and 4 needed"
  return 1
}

if want moe && need_four moe; then
  echo "== MoE with experts over 4 GPUs"
  table="$OUT/moe.md"
  echo "$TABLE_HEAD" > "$table"
  EP="--expert_model_parallel_size 4 --use_distributed_optimizer true"
  for spec in "deepseek_v3_proxy|--config deepseek_v3-pretrain --num_layers 3 --moe_layer_freq 1 --micro_batch_size 1 --global_batch_size 16" \
              "deepseek_v2_lite|--config deepseek_v2_lite-pretrain --micro_batch_size 1 --global_batch_size 16" \
              "mixtral_8x7B_proxy|--config mixtral_8x7B-pretrain --num_layers 4 --micro_batch_size 1 --global_batch_size 16"; do
    run_fitting "${spec%%|*}" 4 "$table" "$OUT/moe_layouts.txt" "${spec#*|} --train_iters 5 $EP" \
      "" "--recompute_granularity selective" "--recompute_granularity full" \
      "--moe_expert_capacity_factor 1.0" "$PA" "$PA --recompute_granularity selective" \
      "$PA --recompute_granularity full" \
      "$PA --recompute_granularity full --moe_expert_capacity_factor 1.0"
  done
  cat "$table" "$OUT/moe_layouts.txt"
fi

if want big && need_four big; then
  echo "== Llama 3.1 70B proxy (40 layers, FP8 hybrid, no transpose cache) on 4 GPUs"
  table="$OUT/big.md"
  echo "$TABLE_HEAD" > "$table"
  base="--config llama3.1_70B-pretrain --num_layers 40 --fp8 hybrid
    --no_fp8_weight_transpose_cache --micro_batch_size 1 --global_batch_size 16 --train_iters 4"
  SP="--sequence_parallel true --use_distributed_optimizer true"
  RUN_TIMEOUT=400 run_fitting llama70b_40l_fp8 4 "$table" "$OUT/big_layout.txt" "$base" \
    "--use_torch_fsdp2 true --recompute_granularity selective" \
    "--use_torch_fsdp2 true $PA --recompute_granularity selective" \
    "--tensor_model_parallel_size 4 $SP $PA" \
    "--tensor_model_parallel_size 2 --pipeline_model_parallel_size 2 $SP $PA" \
    "--use_torch_fsdp2 true $PA --recompute_granularity full" \
    "--tensor_model_parallel_size 4 $SP $PA --recompute_granularity full"
  cat "$table"
fi

cat "$OUT"/scaling.md "$OUT"/moe.md "$OUT"/big.md > "$OUT/four_gpu.md" 2>/dev/null
echo "exit $status"
exit $status
