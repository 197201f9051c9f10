#!/bin/bash
# Multi-GPU checks for a machine with 2+ GPUs; builds nothing (run after the build exists).
#   scripts/device/dist_suite.sh [BUILD_DIR] [STEP ...]   results under $OUT (default ./dist_out)
# STEP: tests comm proxies full (default: all)
# 1. the 2-GPU tests (DP, ZeRO-1 and FSDP loss vs 1 GPU, resumes, killed rank), 2. bench comm
# on 2 GPUs and on 1, preflight, 3. the Llama 3.1 8B proxy (4 layers, mock data) on 1 GPU, 2
# GPUs DP, ZeRO-1 and FSDP, 4. the full 32-layer Llama 3.1 8B on 2 GPUs (ZeRO-1 with full
# recompute, FSDP without recompute) beside the memory planner's figures for them.
set -uo pipefail
BUILD=${1:-build}
OUT=${OUT:-$PWD/dist_out}
TESSERA=$BUILD/tessera
mkdir -p "$OUT"
status=0
step() { echo "== $*" | tee -a "$OUT/summary.txt"; }
shift $(( $# > 0 ? 1 : 0 ))
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests comm proxies full)
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

nvidia-smi -L > "$OUT/gpus.txt" 2>&1
if want tests; then
step "gpu tests (DistGpu.*)"
"$BUILD/test_gpu" --gtest_filter='DistGpu.*' > "$OUT/dist_gpu_tests.txt" 2>&1 || status=1
tail -n 5 "$OUT/dist_gpu_tests.txt" | tee -a "$OUT/summary.txt"
fi
if want comm; then

step "bench comm, 2 GPUs"
"$TESSERA" launch --nproc_per_node 2 --master_port 29621 bench comm -o "$OUT/comm_2gpu" \
  > "$OUT/bench_comm_2gpu.txt" 2>&1 || status=1
tail -n 3 "$OUT/bench_comm_2gpu.txt" | tee -a "$OUT/summary.txt"
step "bench comm, 1 GPU"
"$TESSERA" bench comm --max_bytes 67108864 -o "$OUT/comm_1gpu" > "$OUT/bench_comm_1gpu.txt" 2>&1 || status=1

step "preflight (all-reduce over every GPU)"
"$TESSERA" preflight -o "$OUT/preflight" > "$OUT/preflight.txt" 2>&1 || status=1
grep -E "all-reduce|verdict" "$OUT/preflight.txt" | tee -a "$OUT/summary.txt"
fi

PROXY="train --config llama3.1_8B-pretrain --num_layers 4 --mock_data true --train_iters 30
  --log_interval 5 --micro_batch_size 1 --global_batch_size 8 --workspace $OUT/runs"
if want proxies; then
step "Llama 3.1 8B proxy, 1 GPU (8 accumulation steps)"
"$TESSERA" $PROXY --exp_name proxy_1gpu > "$OUT/proxy_1gpu.txt" 2>&1 || status=1
step "Llama 3.1 8B proxy, 2 GPUs DP"
"$TESSERA" launch --nproc_per_node 2 --master_port 29622 $PROXY --exp_name proxy_dp2 \
  > "$OUT/proxy_dp2.txt" 2>&1 || status=1
step "Llama 3.1 8B proxy, 2 GPUs ZeRO-1"
"$TESSERA" launch --nproc_per_node 2 --master_port 29623 $PROXY --exp_name proxy_zero2 \
  --use_distributed_optimizer true > "$OUT/proxy_zero2.txt" 2>&1 || status=1
step "Llama 3.1 8B proxy, 2 GPUs ZeRO-1, parameter gather overlapped with the forward"
"$TESSERA" launch --nproc_per_node 2 --master_port 29626 $PROXY --exp_name proxy_zero2_overlap \
  --use_distributed_optimizer true --overlap_param_gather true > "$OUT/proxy_zero2_overlap.txt" 2>&1 || status=1
step "Llama 3.1 8B proxy, 2 GPUs FSDP"
"$TESSERA" launch --nproc_per_node 2 --master_port 29627 $PROXY --exp_name proxy_fsdp2 \
  --use_torch_fsdp2 true > "$OUT/proxy_fsdp2.txt" 2>&1 || status=1
step "Llama 3.1 8B proxy, 2 GPUs DP without overlap"
"$TESSERA" launch --nproc_per_node 2 --master_port 29624 $PROXY --exp_name proxy_dp2_nooverlap \
  --overlap_grad_reduce false > "$OUT/proxy_dp2_nooverlap.txt" 2>&1 || status=1
fi
FULL="train --config llama3.1_8B-pretrain --mock_data true --train_iters 6 --log_interval 1
  --micro_batch_size 1 --global_batch_size 4 --workspace $OUT/runs"
if want full; then
step "Full Llama 3.1 8B (32 layers, seq 8192), 2 GPUs ZeRO-1 + full recompute"
"$TESSERA" memory --config llama3.1_8B-pretrain --num_gpus 2 --sharding zero1 \
  --recompute_granularity full --micro_batch_size 1 > "$OUT/full8b_memory_plan.txt" 2>&1
grep -E "^\| (allocated|total) |FITS|DOES NOT" "$OUT/full8b_memory_plan.txt" | tee -a "$OUT/summary.txt"
"$TESSERA" launch --nproc_per_node 2 --master_port 29625 $FULL --exp_name full8b_zero2 \
  --use_distributed_optimizer true --recompute_granularity full > "$OUT/full8b_zero2.txt" 2>&1 || status=1
step "Full Llama 3.1 8B (32 layers, seq 8192), 2 GPUs FSDP, no recompute"
"$TESSERA" memory --config llama3.1_8B-pretrain --num_gpus 2 --sharding fsdp \
  --micro_batch_size 1 > "$OUT/full8b_fsdp_memory_plan.txt" 2>&1
grep -E "^\| (allocated|total) |FITS|DOES NOT" "$OUT/full8b_fsdp_memory_plan.txt" | tee -a "$OUT/summary.txt"
"$TESSERA" launch --nproc_per_node 2 --master_port 29628 $FULL --exp_name full8b_fsdp2 \
  --use_torch_fsdp2 true > "$OUT/full8b_fsdp2.txt" 2>&1 || status=1
fi
for r in proxy_1gpu proxy_dp2 proxy_zero2 proxy_zero2_overlap proxy_fsdp2 proxy_dp2_nooverlap full8b_zero2 full8b_fsdp2; do
  [ -f "$OUT/$r.txt" ] || continue
  grep -h "done:" "$OUT/$r.txt" | sed "s/^/$r: /" | tee -a "$OUT/summary.txt"
  find "$OUT/runs" -path "*$r/metrics.jsonl" -exec cp {} "$OUT/$r.metrics.jsonl" \;
done
echo "exit $status" | tee -a "$OUT/summary.txt"
exit $status
