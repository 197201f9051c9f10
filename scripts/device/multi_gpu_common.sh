# Sourced by four_gpu.sh and eight_gpu.sh: the machine, the runs through `tessera launch`, their
# summary rows and the planner's verdicts. Expects T (the tessera binary) and OUT; sets GPUS,
# PLAN_GPU, RUNS, status and the helpers below.
GPUS=$(nvidia-smi -L | wc -l)
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$GPU_NAME" in *H200*) PLAN_GPU=H200 ;; *H100*) PLAN_GPU=H100 ;; *) PLAN_GPU=H200 ;; esac
status=0
port=29800
next_port() { port=$((port + 1)); echo $port; }
# Megatron's precision-aware optimizer with bf16 gradients and moments and selective recompute:
# what `bench model --full` runs the 8B models with on one GPU (docs/memory.md).
PA="--use_precision_aware_optimizer true --main_grads_dtype bf16 --exp_avg_dtype bf16
  --exp_avg_sq_dtype bf16"
FULL_STATE="$PA --recompute_granularity selective"
RUNS="$OUT/runs"

# train NAME GPUS ARGS...: one training run through `tessera launch`; its log is OUT/NAME.log.
train() {
  local name=$1 gpus=$2
  shift 2
  timeout "${RUN_TIMEOUT:-240}" "$T" launch --nproc_per_node "$gpus" --master_port "$(next_port)" \
    train --mock_data true --log_interval 1 --eval_interval 0 --workspace "$RUNS" \
    --work_group g --user_name u --exp_name "$name" "$@" > "$OUT/$name.log" 2>&1
}

# summary NAME GPUS [PLAN_GIB]: one markdown row from the run's metrics (medians over the
# iterations after the first; TFLOP/s in Tessera's convention and in Megatron-Bridge's, causal
# attention counted half; MoE balance from the last: the largest coefficient of variation of
# tokens per expert over the layers, and the dropped share).
summary() {
  python3 - "$RUNS/g/u/$1/metrics.jsonl" "$1" "$2" "${3:-}" <<'PY'
import json, statistics, sys
path, name, gpus, plan = sys.argv[1:5]
try:
    rows = [json.loads(l) for l in open(path) if '"lm_loss"' in l]
except OSError:
    rows = []
if not rows:
    print(f"| {name} | {gpus} | run failed (see {name}.log) | | | | | | | |")
    sys.exit(0)
body = rows[1:] or rows
med = lambda k: statistics.median(r[k] for r in body if k in r)
peak = max(r.get("mem_peak_gib", 0) for r in rows)
last = rows[-1]
balance = ""
if last.get("moe_expert_tokens_cv"):
    balance = (f"cv {max(last['moe_expert_tokens_cv']):.3f}, dropped "
               f"{100 * max(last.get('moe_expert_dropped_fraction', [0])):.2f}%")
causal = f"{med('tflops_per_gpu_causal'):.0f}" if "tflops_per_gpu_causal" in last else ""
print(f"| {name} | {gpus} | {med('elapsed_ms'):.0f} | {med('tokens_per_s_per_gpu'):,.0f} | "
      f"{med('tflops_per_gpu'):.0f} | {causal} | {peak:.2f} | {plan} | {last['lm_loss']:.4f} | "
      f"{balance} |")
PY
}
TABLE_HEAD="| run | GPUs | ms/iter | tokens/s/GPU | TFLOP/s/GPU | TFLOP/s/GPU, causal half | peak GiB | plan GiB | final loss | balance |
|---|---|---|---|---|---|---|---|---|---|"

# plan_gib GPUS ARGS...: the planner's total per GPU for a run, or empty when it does not fit.
plan_gib() {
  local gpus=$1
  shift
  "$T" memory --num_gpus "$gpus" --gpu "$PLAN_GPU" "$@" 2>/dev/null |
    awk '/^FITS/ {fits = 1} /^\| total / {total = $6} END {if (fits) print total}'
}

# first_fit GPUS "BASE ARGS" "CANDIDATE 1" "CANDIDATE 2" ...: the first candidate the planner
# says fits (cheapest first), or nothing.
first_fit() {
  local gpus=$1 base=$2 c
  shift 2
  for c in "$@"; do
    # shellcheck disable=SC2086
    if [ -n "$(plan_gib "$gpus" $base $c)" ]; then
      echo "$c"
      return 0
    fi
  done
  return 1
}

# run_fitting NAME GPUS TABLE LAYOUTS "BASE ARGS" CANDIDATE...: the run in the first candidate
# layout the planner says fits (first_fit; "" is the base as it is), its row appended to TABLE
# and its layout to the file LAYOUTS; a row saying so when none fits.
run_fitting() {
  local name=$1 gpus=$2 table=$3 layouts=$4 base=$5 layout plan
  shift 5
  if ! layout=$(first_fit "$gpus" "$base" "$@"); then
    echo "| $name | $gpus | the planner finds no layout that fits | | | | | | | |" >> "$table"
    status=1
    return 1
  fi
  echo "-- $name: ${layout:-as written}" | tee -a "$layouts"
  # shellcheck disable=SC2086
  plan=$(plan_gib "$gpus" $base $layout)
  # shellcheck disable=SC2086
  train "$name" "$gpus" $base $layout || status=1
  summary "$name" "$gpus" "$plan" >> "$table"
}

# scaling_runs TABLE PRECISIONS GPU_COUNTS: the full Llama 3.1 8B at each precision (bf16, fp8)
# on each GPU count this machine has, with ZeRO-1 and with FSDP (one GPU: neither), 8
# micro-batches per GPU per step (SCALING_ITERS iterations, default 4); a row each in TABLE.
# SCALING_FSDP_ENV="VAR=VALUE ..." adds an FSDP row per assignment, run with it in the
# environment: NCCL_CTA_POLICY=0 puts the parameter gathers back on SMs, NCCL_WIN_ENABLE=0 every
# collective on NCCL's ordinary kernels (no symmetric windows).
scaling_runs() {
  local table=$1 precisions=$2 counts=$3 precision n sharding keys extra name args plan assignment
  echo "$TABLE_HEAD" > "$table"
  for precision in $precisions; do
    extra=""
    [ "$precision" = fp8 ] && extra="--fp8 hybrid"
    for n in $counts; do
      [ "$n" -gt "$GPUS" ] && continue
      for sharding in zero1 fsdp; do
        [ "$n" = 1 ] && [ "$sharding" = fsdp ] && continue  # one GPU: nothing to shard
        keys="--use_distributed_optimizer true"
        [ "$sharding" = fsdp ] && keys="--use_torch_fsdp2 true"
        name="full8b_${precision}_${n}gpu_${sharding}"
        args="--config llama3.1_8B-pretrain --micro_batch_size 1 --global_batch_size $((8 * n))
          --train_iters ${SCALING_ITERS:-4} $FULL_STATE $keys $extra"
        echo "-- $name"
        # shellcheck disable=SC2086
        plan=$(plan_gib "$n" $args)
        # shellcheck disable=SC2086
        train "$name" "$n" $args || status=1
        summary "$name" "$n" "$plan" >> "$table"
        [ "$sharding" = fsdp ] || continue
        for assignment in ${SCALING_FSDP_ENV:-}; do
          echo "-- ${name} with $assignment"
          export "${assignment?}"
          # shellcheck disable=SC2086
          train "${name}_${assignment%%=*}" "$n" $args || status=1
          unset "${assignment%%=*}"
          summary "${name}_${assignment%%=*}" "$n" "$plan" >> "$table"
        done
      done
    done
  done
  cat "$table"
}

# machine_info FILE: the GPUs, their links and the binary's version.
machine_info() {
  {
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
    nvidia-smi topo -m 2>/dev/null | head -10
    "$T" --version 2>/dev/null
  } > "$1"
}
