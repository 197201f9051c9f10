#!/usr/bin/env bash
# One call on a GPU machine: GPU tests, the attention kernel lab, and the benchmark against
# the PyTorch peer, all writing under $OUT. Binaries are built elsewhere and carried in
# .device/bin; the PyTorch peer scripts in .device/peer.
#   bash scripts/device/gpu_suite.sh [tests] [lab] [hf] [chat] [kernels] [memory] [profile] [tensorboard]
#       [attention_profile] [bench] [peer] [gemm_tune] [attention_choice] [variants] [fp8] [fp8_nocache] [curves] [node]
#       [dist] [four_gpu] [eight_gpu] [full] [full_proxies] [moe] [deepseek] [full_fp8_loss]
#       [posttrain]   (scripts/device/posttrain_bench.sh with the steps in POSTTRAIN_STEPS)
#       [peft]   (scripts/ckpt/peft_lora_check.py: LoRA checkpoints in peft, merged exports)
#       [baseline]   (not in the default; dist: 2 GPUs; four_gpu: scripts/device/four_gpu.sh
#                     with the steps in FOUR_GPU_STEPS (default all), 4 GPUs; eight_gpu:
#                     scripts/device/eight_gpu.sh with EIGHT_GPU_STEPS, 8 GPUs; baseline: bench model of the packed
#                     baseline build and this one, interleaved, scripts/device/pack.sh --baseline;
#                     full_baseline: the same at full size, FP8 hybrid with FULL_ARGS, each
#                     profiled step's kernels reported to OUT/full_ab_BUILD_roundN/report)
#       full: Llama 3.1 8B and Qwen 2.5 7B at full size on one GPU, BF16 and FP8 hybrid
#             (bench model --full: all layers, 16 micro-batches per step, precision-aware
#             optimizer, profiled step breakdown); full_proxies: the 4-layer proxies and the
#             PyTorch peers they are compared with. Each writes OUT/full_table.md (the two
#             together: the whole table; each fits one 10-minute call). full_fp8_loss:
#             scripts/device/full_fp8_loss.sh (two GPUs side by side, or one;
#             FULL_FP8_MODEL, TOKENIZER, FP8_RECIPE, FP8_ATTENTION pass through).
#   (default: all)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/.device/out}"
BIN="$ROOT/.device/bin"
mkdir -p "$OUT"
# Binaries, their host libraries, the peer scripts and the Brown corpus travel packed
# (scripts/device/pack.sh).
if [ -f "$ROOT/.device/payload.tgz" ]; then
  tar xzf "$ROOT/.device/payload.tgz" -C "$ROOT/.device"
  [ -e "$ROOT/node_modules" ] || ln -s "$ROOT/.device/node_modules" "$ROOT/node_modules"
fi
# Test binaries have the build machine's source path compiled in (TESSERA_BUILT_AT, default
# /work/main), and the tessera binary's path in the build directory.
BUILT_AT="${TESSERA_BUILT_AT:-/work/main}"
mkdir -p "$(dirname "$BUILT_AT")" && [ -e "$BUILT_AT" ] || ln -s "$ROOT" "$BUILT_AT"
mkdir -p "$ROOT/build" && ln -sf "$BIN/tessera" "$ROOT/build/tessera"
export TESSERA_ROOT="$ROOT" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Host libraries of the build machine travel in .device/lib; cuBLASLt comes from the GPU
# machine's CUDA (or PyTorch's wheel of it). cuDNN (attention_backend cudnn/auto, loaded with
# dlopen) comes from PyTorch's wheel: its lib directory goes first, so that one consistent set
# of cuDNN libraries loads; NVRTC's (cuDNN compiles its fused attention kernels at run time)
# goes last, after everything that resolved cuBLASLt before.
cublas_dir="$(python3 -c 'import nvidia.cublas, os; print(os.path.join(os.path.dirname(nvidia.cublas.__file__), "lib"))' 2>/dev/null || true)"
# Directories of PyTorch's wheels (site-packages/nvidia/*/lib) that hold a file matching $1.
wheel_lib_dirs() {
  python3 - "$1" 2>/dev/null <<'PY' || true
import glob, os, sys
try:
    import nvidia
    roots = list(nvidia.__path__)
except Exception:
    roots = []
dirs = []
for root in roots:
    for f in sorted(glob.glob(os.path.join(root, sys.argv[1]))):
        if os.path.dirname(f) not in dirs:
            dirs.append(os.path.dirname(f))
print(":".join(dirs))
PY
}
cudnn_dirs="$(wheel_lib_dirs 'cudnn/lib/libcudnn.so.9')"
nvrtc_dirs="$(wheel_lib_dirs '*/lib/libnvrtc.so*')"
nccl_dirs="$(wheel_lib_dirs 'nccl/lib/libnccl.so.2')"
export LD_LIBRARY_PATH="${cudnn_dirs:+$cudnn_dirs:}${nccl_dirs:+$nccl_dirs:}$ROOT/.device/lib:/usr/local/cuda/lib64:${cublas_dir}${nvrtc_dirs:+:$nvrtc_dirs}:${LD_LIBRARY_PATH:-}"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests lab hf chat kernels memory profile tensorboard bench peer)
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())' 2>&1
  echo "cuDNN for Tessera: ${cudnn_dirs:-no wheel directory found}; NVRTC: ${nvrtc_dirs:-no wheel directory found}; NCCL: ${nccl_dirs:-no wheel directory found}"
} | tee "$OUT/machine.txt"

if want tests; then
  echo "== GPU tests"
  "$BIN/test_gpu" --gtest_color=no --gtest_filter="${GPU_TEST_FILTER:--DistGpu.*}" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^\[ (op|grad|curve|  FAILED|  PASSED|  SKIPPED|       OK|RUN)|Failure|error|attention_backend" | tail -150
fi
if want lab && [ -x "$BIN/attention_lab" ]; then
  echo "== attention lab (Tessera's kernels and cuDNN)"
  timeout 240 "$BIN/attention_lab" --require-cudnn 2>&1 | tee "$OUT/attention_lab.log" | tail -45
fi
if want attention_profile; then
  # Nsight Compute on one launch of a warpgroup attention kernel at seq 8192: every section,
  # plus per-instruction stall samples; the report and its text pages come back in $OUT.
  # ATTENTION_PROFILE_KERNELS: forward and/or backward (default backward); ATTENTION_PROFILE_MASK:
  # a bench attention mask (default causal; packed: documents of 1024 tokens);
  # ATTENTION_PROFILE_ARGS: more bench attention arguments (--fp8_dot_product_attention true),
  # ATTENTION_PROFILE_TAG a suffix of the output names.
  ncu_bin="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)"
  mask="${ATTENTION_PROFILE_MASK:-causal}"
  for pass in ${ATTENTION_PROFILE_KERNELS:-backward}; do
    echo "== ncu: attention_${pass}_hopper_kernel at seq 8192, $mask"
    name="attention_${pass}_${mask}${ATTENTION_PROFILE_TAG:-}"
    timeout 300 "$ncu_bin" --clock-control none --set full --import-source yes \
      -k "regex:attention_${pass}_hopper" --launch-skip 2 --launch-count 1 -f -o "$OUT/$name" \
      "$BIN/tessera" bench attention --seqs 8192 --head_dims 128 --masks "$mask" --document_length 1024 \
      --attention_backend tessera ${ATTENTION_PROFILE_ARGS:-} -o "$OUT/${name}_bench" > "$OUT/${name}_ncu_run.log" 2>&1
    tail -3 "$OUT/${name}_ncu_run.log"
    "$ncu_bin" --import "$OUT/$name.ncu-rep" --page details > "$OUT/${name}_details.txt" 2>&1
    "$ncu_bin" --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/${name}_source_sass.csv" 2>&1
    grep -E "Duration|Throughput|Warp Cycles|Issue Slot|Eligible" "$OUT/${name}_details.txt" | head -20
  done
fi
if want hf; then
  echo "== Hugging Face transformers round trip (import, export, logits)"
  timeout 180 python3 "$ROOT/scripts/ckpt/hf_transformers_check.py" --tessera "$BIN/tessera" \
    2>&1 | tee "$OUT/hf_check.log" | tail -14
fi
if want chat; then
  echo "== chat templates: preprocess --chat ids against transformers' apply_chat_template"
  timeout 120 python3 "$ROOT/scripts/tokenizer/chat_template_transformers_check.py" \
    --tessera "$BIN/tessera" --out "$OUT/chat_template_ids.json" 2>&1 | tee "$OUT/chat_check.log" | tail -14
fi
if want peft; then
  echo "== LoRA against peft (adapters in peft's format, merged export)"
  timeout 180 python3 "$ROOT/scripts/ckpt/peft_lora_check.py" --tessera "$BIN/tessera" 2>&1 | tee "$OUT/peft_check.log" | tail -8
fi
if want posttrain; then
  echo "== post-training benchmarks against the transformers peer"
  bash "$ROOT/scripts/device/posttrain_bench.sh" "$OUT/posttrain" ${POSTTRAIN_STEPS:-} 2>&1 | tee "$OUT/posttrain.log"
fi
if want kernels; then
  echo "== preflight and kernel benchmarks"
  timeout 60 "$BIN/tessera" preflight -o "$OUT/preflight" 2>&1 | tail -20
  timeout 120 "$BIN/tessera" bench gemm --sizes 4096,8192 --layouts NN,NT,TN -o "$OUT/gemm" 2>&1 | tail -14
  timeout 120 "$BIN/tessera" bench gemm --config llama3.1_8B-pretrain --num_layers 4 -o "$OUT/gemm_llama" 2>&1 | tail -14
  timeout 120 "$BIN/tessera" bench gemm --config llama3.1_8B-pretrain --num_layers 4 --gemm_autotune false \
    -o "$OUT/gemm_llama_heuristic" 2>&1 | tail -14
  timeout 120 "$BIN/tessera" bench gemm --sizes 4096,8192 --layouts NT --dtypes bf16,fp8 -o "$OUT/gemm_fp8" 2>&1 | tail -6
  timeout 150 "$BIN/tessera" bench attention --seqs 4096,8192,16384 --masks causal,window \
    --attention_backend tessera -o "$OUT/attention_tessera" 2>&1 | tail -14
  timeout 150 "$BIN/tessera" bench attention --seqs 4096,8192,16384 --masks causal,window \
    --attention_backend cudnn -o "$OUT/attention_cudnn" 2>&1 | tail -14
  timeout 60 "$BIN/tessera" bench membw -o "$OUT/membw" 2>&1 | tail -8
fi
if want gemm_tune; then
  echo "== the training step's GEMMs: tuned against the heuristic's first choices"
  for tune in true false; do
    timeout 120 "$BIN/tessera" bench gemm --config llama3.1_8B-pretrain --num_layers 4 --gemm_autotune $tune \
      -o "$OUT/gemm_llama_tune_$tune" 2>&1 | tail -3
  done
fi
if want memory; then
  echo "== memory planner (compare with the measured peaks of bench model)"
  for m in llama3.1_8B qwen2.5_7B mistral_7B; do
    "$BIN/tessera" memory --config "$m-pretrain" --num_layers 4 --micro_batch_size 1 \
      -o "$OUT/memory_$m" 2>&1 | head -20
  done
fi
if want profile; then
  echo "== profiled training run and its report"
  timeout 150 "$BIN/tessera" train --config llama3.1_8B-pretrain --num_layers 4 --train_iters 14 \
    --global_batch_size 4 --profile true --profile_step_start 10 --profile_step_end 12 --log_interval 2 \
    --workspace "$OUT/profile_ws" 2>&1 | tail -4
  trace="$(find "$OUT/profile_ws" -name 'rank-0.pt.trace.json.gz' | head -1)"
  [ -n "$trace" ] && timeout 120 "$BIN/tessera" report "$trace" -o "$OUT/profile_report" 2>&1 | head -60
fi
if want tensorboard; then
  echo "== TensorBoard event file of a short run, as TensorBoard's EventAccumulator reads it"
  timeout 150 "$BIN/tessera" train --config llama3.1_8B-pretrain --num_layers 2 --train_iters 10 \
    --global_batch_size 2 --log_interval 5 --eval_interval 5 --eval_iters 2 --log_progress false \
    --tensorboard_dir tensorboard --log_timers_to_tensorboard --log_throughput_to_tensorboard \
    --log_memory_to_tensorboard --log_validation_ppl_to_tensorboard \
    --workspace "$OUT/tensorboard_ws" 2>&1 | tail -3
  # Every scalar as TensorBoard itself reads the natively written file: one line per tag.
  tb_dir="$(find "$OUT/tensorboard_ws" -type d -name tensorboard | head -1)"
  timeout 120 python3 - "${tb_dir:-$OUT/tensorboard_ws}" <<'PY' 2>&1 | tee "$OUT/tensorboard_scalars.log" | tail -30
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
accumulator = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})  # 0: keep every point
accumulator.Reload()
tags = sorted(accumulator.Tags()["scalars"])
print(f"{len(tags)} scalar tags in {sys.argv[1]}")
for tag in tags:
    print(f"{tag:36s} " + " ".join(f"{e.step}:{e.value:.6g}" for e in accumulator.Scalars(tag)))
PY
fi
if want bench; then
  echo "== tessera bench model"
  timeout 300 "$BIN/tessera" bench model --models llama3.1_8B,qwen2.5_7B -o "$OUT" 2>&1 | tee "$OUT/bench_model.log" | tail -8
  timeout 200 "$BIN/tessera" bench model --models mistral_7B -o "$OUT/mistral" 2>&1 | tee "$OUT/bench_mistral.log" | tail -4
fi
if want baseline && [ -x "$BIN/tessera_baseline" ]; then
  echo "== bench model: the baseline build and this one, two interleaved rounds"
  for round in 1 2; do
    for build in tessera_baseline tessera; do
      timeout 400 "$BIN/$build" bench model -o "$OUT/${build}_round$round" 2>&1 \
        | tee "$OUT/bench_${build}_round$round.log" | tail -5
    done
  done
fi
if want full_baseline && [ -x "$BIN/tessera_baseline" ]; then
  echo "== bench model --full, FP8 hybrid: the baseline build and this one, two interleaved rounds"
  for round in 1 2; do
    for build in tessera_baseline tessera; do
      dir="$OUT/full_ab_${build}_round$round"
      timeout 290 "$BIN/$build" bench model --full --models "${FULL_MODELS:-llama3.1_8B}" --fp8 hybrid \
        ${FULL_ARGS:-} -o "$dir" 2>&1 | tee "$dir.log" | tail -3
      # The kernel tables stay; the traces (hundreds of MB) do not travel back.
      for trace in "$dir"/traces/*.pt.trace.json.gz; do
        [ -e "$trace" ] && "$BIN/tessera" report "$trace" -o "$dir/report_$(basename "$trace" .pt.trace.json.gz)" \
          > /dev/null 2>&1
      done
      rm -rf "$dir/traces"
    done
  done
fi
if want attention_choice; then
  # The proxies with Tessera's own attention kernels, for the attention_backend choice.
  timeout 300 "$BIN/tessera" bench model --models llama3.1_8B,mistral_7B --attention_backend tessera \
    -o "$OUT/tessera_attention" 2>&1 | tee "$OUT/bench_tessera_attention.log" | tail -5
fi
if want variants; then
  echo "== bench model variants: whole-sequence output head chunk, heuristic GEMM algorithms"
  timeout 200 "$BIN/tessera" bench model --models llama3.1_8B,qwen2.5_7B --cross_entropy_chunk_tokens 8192 \
    -o "$OUT/ce_chunk_8192" 2>&1 | tee "$OUT/bench_ce_chunk_8192.log" | tail -4
  timeout 200 "$BIN/tessera" bench model --models llama3.1_8B --gemm_autotune false \
    -o "$OUT/heuristic_gemms" 2>&1 | tee "$OUT/bench_heuristic_gemms.log" | tail -3
fi
if want peer; then
  echo "== PyTorch peer (torch.compile)"
  for args in "--model llama3.1_8b" "--model qwen2.5_7b" "--model mistral_7b --window 4096"; do
    timeout 240 python3 "$ROOT/.device/peer/torch_llama.py" $args --compile --json "$OUT/peer.jsonl" 2>&1 | tail -1
  done
fi
# Megatron's precision-aware optimizer with bf16 gradients and moments (bench model --full's
# state): the optimizer's bytes per parameter from ~30 to ~20.
BF16_STATE="--use_distributed_optimizer true --use_precision_aware_optimizer true --main_grads_dtype bf16 --exp_avg_dtype bf16 --exp_avg_sq_dtype bf16"
if want moe; then
  echo "== MoE proxies (4 layers, seq 8192, mbs 1): real and force-balanced routing, BF16 and FP8; the peer"
  # The shipped MoE experiments route force-balanced (Primus's setting): routed runs say false.
  R="--moe_force_balance false"
  for run in "mixtral_8x7B bf16_routed $R" "mixtral_8x7B bf16_balanced --moe_force_balance true" \
             "mixtral_8x7B fp8_routed --fp8 hybrid $R" "mixtral_8x7B fp8_balanced --fp8 hybrid --moe_force_balance true" \
             "qwen3_30B_A3B bf16_routed $R" "qwen3_30B_A3B bf16_balanced --moe_force_balance true" \
             "mixtral_8x7B bf16state_routed $BF16_STATE $R" \
             "mixtral_8x7B bf16state_balanced $BF16_STATE --moe_force_balance true" \
             "mixtral_8x7B fp8state_routed --fp8 hybrid $BF16_STATE $R" \
             "mixtral_8x7B fp8state_balanced --fp8 hybrid $BF16_STATE --moe_force_balance true" \
             "qwen3_30B_A3B bf16state_routed $BF16_STATE $R" \
             "mixtral_8x7B bf16cap1_routed --moe_expert_capacity_factor 1.0 $R" \
             "mixtral_8x7B fp8cap1_routed --fp8 hybrid --moe_expert_capacity_factor 1.0 $R"; do
    set -- $run
    model="$1" name="$1_$2"; shift 2
    # MOE_ONLY (a regular expression) picks runs by name, to fit one call.
    [[ -z "${MOE_ONLY:-}" || "$name" =~ $MOE_ONLY ]] || continue
    timeout 240 "$BIN/tessera" bench model --models "$model" "$@" -o "$OUT/moe_$name" \
      2>&1 | tee "$OUT/moe_$name.log" | tail -3
  done
  timeout 300 python3 "$ROOT/.device/peer/torch_llama.py" --model mixtral_8x7b --compile \
    --json "$OUT/moe_peer.jsonl" 2>&1 | tail -1
fi
if want deepseek; then
  echo "== DeepSeek-V2-Lite proxy (4 layers, every one MoE, seq 8192, mbs 1): real and force-balanced routing"
  R="--moe_force_balance false"
  for run in "bf16_routed $R" "bf16_balanced --moe_force_balance true" "fp8_routed --fp8 hybrid $R" \
             "bf16state_routed $BF16_STATE $R" "fp8state_routed --fp8 hybrid $BF16_STATE $R"; do
    set -- $run
    name="deepseek_v2_lite_$1"; shift
    [[ -z "${MOE_ONLY:-}" || "$name" =~ $MOE_ONLY ]] || continue
    timeout 240 "$BIN/tessera" bench model --models deepseek_v2_lite --moe_layer_freq 1 "$@" \
      -o "$OUT/moe_$name" 2>&1 | tee "$OUT/moe_$name.log" | tail -3
  done
fi
if want fp8; then
  echo "== FP8 hybrid vs BF16 (Llama 3.1 8B proxy)"
  timeout 200 "$BIN/tessera" bench model --models llama3.1_8B --fp8 hybrid -o "$OUT/fp8_hybrid" \
    2>&1 | tee "$OUT/bench_fp8_hybrid.log" | tail -4
  timeout 200 "$BIN/tessera" bench model --models llama3.1_8B --fp8 hybrid --fp8_lm_head true \
    -o "$OUT/fp8_hybrid_head" 2>&1 | tee "$OUT/bench_fp8_hybrid_head.log" | tail -4
fi
if want fp8_nocache; then
  timeout 200 "$BIN/tessera" bench model --models llama3.1_8B --fp8 hybrid \
    --no_fp8_weight_transpose_cache -o "$OUT/fp8_hybrid_nocache" 2>&1 \
    | tee "$OUT/bench_fp8_nocache.log" | tail -4
fi
if want curves; then
  echo "== fp32 / bf16 / FP8 hybrid loss curves of the FP8 curve test's model"
  timeout 400 bash "$ROOT/scripts/device/fp8_curves.sh" "$BIN/tessera" "$OUT/fp8_curves" 2>&1 | tail -40
  echo "== the Llama 3.1 8B proxy on Brown text: bf16, FP8+head, FP8+head with fast accumulation"
  timeout 400 bash "$ROOT/scripts/device/fp8_proxy_curves.sh" "$BIN/tessera" "$OUT/fp8_proxy_curves" 2>&1 | tail -4
fi
if want node; then
  echo "== examples/bench/node8.sh on the visible GPUs, small global batches, 3 iterations"
  gpus=$(nvidia-smi -L | wc -l)
  GBS_LLAMA=$((4 * gpus)) GBS_QWEN=$((4 * gpus)) TESSERA="$BIN/tessera" OUT="$OUT/node" \
    timeout 330 bash "$ROOT/examples/bench/node8.sh" "$gpus" 3 2>&1 | tail -20
fi
if want full; then
  echo "== full-size models on one GPU (bench model --full)"
  # FULL_PRECISIONS (default both), FULL_ARGS (more bench model arguments), FULL_TAG (a suffix
  # of the output names, to run the step twice in one call).
  for precision in ${FULL_PRECISIONS:-bf16 fp8}; do
    extra=""; [ "$precision" = fp8 ] && extra="--fp8 hybrid"
    timeout 290 "$BIN/tessera" bench model --full --models "${FULL_MODELS:-llama3.1_8B,qwen2.5_7B}" \
      $extra ${FULL_ARGS:-} -o "$OUT/full_$precision${FULL_TAG:-}" 2>&1 | tee "$OUT/full_$precision${FULL_TAG:-}.log" | tail -12
  done
  python3 "$ROOT/scripts/device/full_table.py" "$OUT" | tee "$OUT/full_table.md"
fi
if want full_proxies; then
  echo "== proxies against the PyTorch peers (compile, flex attention for the window, FP8)"
  timeout 200 "$BIN/tessera" bench model --models llama3.1_8B,qwen2.5_7B -o "$OUT/proxy_bf16" \
    2>&1 | tee "$OUT/proxy_bf16.log" | tail -5
  timeout 120 "$BIN/tessera" bench model --models mistral_7B -o "$OUT/proxy_mistral" \
    2>&1 | tee "$OUT/proxy_mistral.log" | tail -4
  timeout 120 "$BIN/tessera" bench model --models llama3.1_8B --fp8 hybrid -o "$OUT/proxy_fp8" \
    2>&1 | tee "$OUT/proxy_fp8.log" | tail -4
  rm -f "$OUT/full_peer.jsonl"
  for args in "--model llama3.1_8b" "--model qwen2.5_7b" "--model mistral_7b --window 4096 --attn flex" \
              "--model llama3.1_8b --fp8"; do
    timeout 200 python3 "$ROOT/.device/peer/torch_llama.py" $args --compile \
      --json "$OUT/full_peer.jsonl" 2>&1 | tail -1
  done
  python3 "$ROOT/scripts/device/full_table.py" "$OUT" | tee "$OUT/full_table.md"
fi
if want full_fp8_loss; then
  echo "== full ${FULL_FP8_MODEL:-llama3.1_8B}, FP8 hybrid against BF16 over 300 steps of Brown text"
  bash "$ROOT/scripts/device/full_fp8_loss.sh" "$BIN/tessera" "$OUT/full_fp8_loss" \
    "${FULL_FP8_MODEL:-llama3.1_8B}" 2>&1 | tail -8   # FP8_RECIPE, FP8_ATTENTION pass through
fi
if want four_gpu; then
  echo "== two and four GPUs (scripts/device/four_gpu.sh ${FOUR_GPU_STEPS:-})"
  OUT="$OUT/four_gpu" BIN="$BIN" bash "$ROOT/scripts/device/four_gpu.sh" ${FOUR_GPU_STEPS:-} 2>&1 | tail -80
fi
if want eight_gpu; then
  echo "== eight GPUs (scripts/device/eight_gpu.sh ${EIGHT_GPU_STEPS:-})"
  OUT="$OUT/eight_gpu" BIN="$BIN" bash "$ROOT/scripts/device/eight_gpu.sh" ${EIGHT_GPU_STEPS:-} 2>&1 | tail -80
fi
if want dist; then
  echo "== multi-GPU (scripts/device/dist_suite.sh)"
  OUT="$OUT/dist" timeout 540 bash "$ROOT/scripts/device/dist_suite.sh" "$BIN" ${DIST_STEPS:-} 2>&1 | tail -40
fi
# Many small files do not all come back from the GPU machine: one archive of the outputs.
tar czf "$OUT/outputs.tgz" -C "$OUT" --exclude outputs.tgz --exclude '*.trace.json.gz' . 2>/dev/null
