#!/usr/bin/env bash
# Post-training benchmarks on one GPU, beside the transformers peer (.device/peer/
# torch_posttrain.py) in the same call. Run by gpu_suite.sh's posttrain step (binaries in
# .device/bin), or alone after it unpacked the payload:
#   bash scripts/device/posttrain_bench.sh OUT_DIR [attention] [sft] [full]
#     attention  bench attention at seq 8192, D 128, 32/8 heads: causal, full, window 4096, and packed documents
#                of 1024 tokens (Tessera's kernels; cuDNN's causal beside)
#     sft        the Llama 3.1 8B 4-layer proxy at seq 8192, global batch 1: pretraining on
#                mock data, then packed SFT of Brown conversations (256-2048 tokens, the loss
#                on the assistant's three quarters, documents masked, positions restarted);
#                the peer's --task sft --compile at the same size
#     full       the same pretraining and SFT with the full model (bench model --full)
#     grpo       GRPO of the Llama 3.1 8B 4-layer proxy (16 and 64 completions of one prompt), then
#                generate_proxy
#     grpo_tiny  the tiny GRPO experiment end to end in bf16 (grpo_tiny.yaml's commands)
#     grpo_lora  the same with LoRA adapters on the fine-tuned model (grpo_lora_tiny.yaml), then
#                the proxy's GRPO of 64 completions with LoRA r16 on every projection
#     generate_proxy  bench generate on the proxy (batch 1 and 64, captured and op by op) beside
#                the peer's --task gen
#     generate_full  bench generate of the full Llama 3.1 8B at batch 1, 16, 64 and 256 (512 new
#                tokens, the issue's sizes)
#     generate_ab  bench generate of the packed baseline binary and this one, interleaved (proxy
#                and full 8B at batch 64)
#     generate   bench generate of the proxy profiled (tessera report of batch 1 and 64), then of the
#                full Llama 3.1 8B (batch 16 and 64, 1024 new tokens, captured and op by op)
#     dpo        DPO of the Llama 3.1 8B 4-layer proxy on Brown pairs of 2 x 4096 tokens (a
#                prompt of ~2000 tokens, each answer cut at 4096), one pair per step, reference
#                log-probabilities precomputed (kept beside the dataset); the peer's --task dpo
#                --compile at the same size (--seq 8192: two sequences of 4096); each pair
#                with its prompt once (the default), then as two sequences (dpo_shared_prompt false)
#     dpo_full   the full Llama 3.1 8B: DPO on those pairs (prompt once, then two sequences)
#                and packed SFT at seq 4096 (bench model --full), DPO's tokens/s against SFT's
#     dpo_copy   DPO of the proxy and of the full model with a frozen copy of the reference
#                on the device (dpo_precompute_ref_log_probs false): its cost in time and memory
#     lora       the full Llama 3.1 8B at seq 4096, global batch 1, selective recompute and
#                bf16 optimizer state: LoRA rank 16 on every projection, the full fine-tune at
#                the same settings, and the peer's --task lora (peft r16, same projections)
#     lora_fp8   the LoRA of lora on a bf16 base and on an FP8 hybrid base (delayed scaling)
#     grpo_full  GRPO of the full Llama 3.1 8B, 16 completions of up to 1024 tokens, colocated
#     grpo_offload  the same with the AdamW moments on the host while generating
#     grpo_split  the same on two GPUs, split placement (GPU 1 generates, GPU 0 trains)
#     grpo_split_async  split, the next batch generated while this one trains
#     lora_peer  the peer of lora alone (its full-depth build takes 4 minutes): with lora_fp8, the
#                two bases and peft in one call
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$1"; shift
BIN="$ROOT/.device/bin"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(attention sft)
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
mkdir -p "$OUT"
work="$(mktemp -d)"
SFT_DATA=(--mock_data false --data_path "$work/chats_chat_document" --tokenizer_type HuggingFaceTokenizer
          --tokenizer_model llama3.1 --packing_strategy bfd --reset_position_ids true --reset_attention_mask true)
if want sft || want full; then
  python3 "$ROOT/scripts/data/brown_chats.py" "$work/chats.jsonl" --conversations 3000
  "$BIN/tessera" preprocess --chat --input "$work/chats.jsonl" --output-prefix "$work/chats" \
    --tokenizer-model llama3.1 --seq-length 8192 --overlong truncate --workers "$(nproc)" 2>&1 | tail -3
fi
DPO_DATA=(--objective dpo --mock_data false --data_path "$work/pairs_preference_document" --tokenizer_type HuggingFaceTokenizer
          --tokenizer_model llama3.1 --seq_length 4096 --micro_batch_size 1)
if want dpo || want dpo_full || want dpo_copy; then
  python3 "$ROOT/scripts/data/brown_chats.py" "$work/pairs.jsonl" --preference --conversations 200 \
    --answer-tokens 2900
  "$BIN/tessera" preprocess --preference --input "$work/pairs.jsonl" --output-prefix "$work/pairs" \
    --tokenizer-model llama3.1 --seq-length 4096 --overlong truncate --workers "$(nproc)" 2>&1 | tail -3
fi
if want dpo_full; then
  python3 "$ROOT/scripts/data/brown_chats.py" "$work/chats4k.jsonl" --conversations 3000
  "$BIN/tessera" preprocess --chat --input "$work/chats4k.jsonl" --output-prefix "$work/chats4k" \
    --tokenizer-model llama3.1 --seq-length 4096 --overlong truncate --workers "$(nproc)" 2>&1 | tail -3
fi
if want attention; then
  echo "== attention at seq 8192: causal and packed documents of 1024 tokens"
  timeout 120 "$BIN/tessera" bench attention --seqs 8192 --head_dims 128 --masks causal,full,window,packed \
    --document_length 1024 --attention_backend tessera -o "$OUT/attention_tessera" 2>&1 | tail -8
  timeout 120 "$BIN/tessera" bench attention --seqs 8192 --head_dims 128 --masks causal,full,window \
    --attention_backend cudnn -o "$OUT/attention_cudnn" 2>&1 | tail -6
fi
if want sft; then
  echo "== proxy: pretraining, packed SFT, the peer"
  timeout 150 "$BIN/tessera" bench model --models llama3.1_8B -o "$OUT/proxy_pretrain" 2>&1 | tail -4
  timeout 150 "$BIN/tessera" bench model --models llama3.1_8B "${SFT_DATA[@]}" -o "$OUT/proxy_sft" 2>&1 | tail -5
  timeout 200 python3 "$ROOT/.device/peer/torch_posttrain.py" --task sft --compile --layers 4 --seq 8192 \
    --json "$OUT/peer.jsonl" 2>&1 | tail -1
fi
if want full; then
  echo "== full model: pretraining and packed SFT"
  timeout 240 "$BIN/tessera" bench model --full --models llama3.1_8B -o "$OUT/full_pretrain" 2>&1 | tail -4
  timeout 240 "$BIN/tessera" bench model --full --models llama3.1_8B "${SFT_DATA[@]}" -o "$OUT/full_sft" 2>&1 | tail -5
fi
if want dpo; then
  echo "== DPO proxy: pairs of 2 x 4096 tokens, the peer"
  timeout 200 "$BIN/tessera" bench model --models llama3.1_8B "${DPO_DATA[@]}" -o "$OUT/proxy_dpo" 2>&1 | tail -4
  timeout 200 "$BIN/tessera" bench model --models llama3.1_8B "${DPO_DATA[@]}" --dpo_shared_prompt false \
    -o "$OUT/proxy_dpo_apart" 2>&1 | tail -4
  timeout 200 python3 "$ROOT/.device/peer/torch_posttrain.py" --task dpo --compile --layers 4 --seq 8192 \
    --json "$OUT/peer.jsonl" 2>&1 | tail -1
fi
if want dpo_full; then
  echo "== full model at seq 4096: DPO, then packed SFT"
  timeout 240 "$BIN/tessera" bench model --full --models llama3.1_8B "${DPO_DATA[@]}" -o "$OUT/full_dpo" 2>&1 | tail -4
  timeout 240 "$BIN/tessera" bench model --full --models llama3.1_8B "${DPO_DATA[@]}" --dpo_shared_prompt false \
    -o "$OUT/full_dpo_apart" 2>&1 | tail -4
  timeout 240 "$BIN/tessera" bench model --full --models llama3.1_8B "${SFT_DATA[@]}" --seq_length 4096 \
    --data_path "$work/chats4k_chat_document" -o "$OUT/full_sft4k" 2>&1 | tail -5
fi
if want dpo_copy; then
  echo "== DPO with a frozen reference copy: proxy, then the full model"
  timeout 200 "$BIN/tessera" bench model --models llama3.1_8B "${DPO_DATA[@]}" --dpo_precompute_ref_log_probs false \
    -o "$OUT/proxy_dpo_copy" 2>&1 | tail -3
  timeout 300 "$BIN/tessera" bench model --full --models llama3.1_8B "${DPO_DATA[@]}" --dpo_precompute_ref_log_probs false \
    -o "$OUT/full_dpo_copy" 2>&1 | tail -4
fi
if want lora; then
  echo "== LoRA on the full model against the full fine-tune and peft"
  SAME=(--num_layers 32 --seq_length 4096 --recompute_granularity selective --use_distributed_optimizer true
        --use_precision_aware_optimizer true --main_grads_dtype bf16 --exp_avg_dtype bf16 --exp_avg_sq_dtype bf16)
  timeout 200 "$BIN/tessera" bench model --models llama3.1_8B "${SAME[@]}" --lora_rank 16 --lora_alpha 32 \
    --iters 6 -o "$OUT/lora" 2>&1 | tail -4
  timeout 200 "$BIN/tessera" bench model --models llama3.1_8B "${SAME[@]}" --iters 6 -o "$OUT/full_finetune" 2>&1 | tail -4
  # The peer builds the 8B model on the host first: over 4 minutes.
  timeout 420 python3 "$ROOT/.device/peer/torch_posttrain.py" --task lora --seq 4096 --steps 4 \
    --json "$OUT/peer.jsonl" > "$OUT/peer_lora.log" 2>&1; echo "peer exit $?"; tail -3 "$OUT/peer_lora.log"
fi
if want lora_fp8; then
  echo "== LoRA on the full model: bf16 base, then FP8 base"
  SAME=(--num_layers 32 --seq_length 4096 --recompute_granularity selective --use_distributed_optimizer true
        --use_precision_aware_optimizer true --main_grads_dtype bf16 --exp_avg_dtype bf16 --exp_avg_sq_dtype bf16
        --lora_rank 16 --lora_alpha 32 --iters 6)
  timeout 200 "$BIN/tessera" bench model --models llama3.1_8B "${SAME[@]}" -o "$OUT/lora_bf16" 2>&1 | tail -4
  timeout 200 "$BIN/tessera" bench model --models llama3.1_8B "${SAME[@]}" --fp8 hybrid -o "$OUT/lora_fp8" 2>&1 | tail -4
fi
if want lora_peer; then
  timeout 420 python3 "$ROOT/.device/peer/torch_posttrain.py" --task lora --seq 4096 --steps 4 \
    --json "$OUT/peer.jsonl" > "$OUT/peer_lora.log" 2>&1; echo "peer exit $?"; tail -3 "$OUT/peer_lora.log"
fi
if want grpo || want grpo_tiny || want grpo_lora; then
  echo "== GRPO: the tiny experiment end to end in bf16"
  python3 "$ROOT/scripts/data/grpo_tasks.py" --task parity --held-out 100 --sft-hash-share 0.3 "$work/parity"
  "$BIN/tessera" preprocess --chat --input "$work/parity_sft.jsonl" --output-prefix "$work/parity" \
    --tokenizer-model llama3 2>&1 | tail -1
  PROMPTS=(--train_data_path "$work/parity_prompts.jsonl" --valid_data_path "$work/parity_held_out.jsonl"
           --log_progress false --workspace "$OUT/grpo_ws")
  timeout 120 "$BIN/tessera" train --config sft_tiny --finetune false --data_path "$work/parity_chat_document" \
    --train_iters 150 --log_progress false --save "$work/parity_sft" --workspace "$OUT/grpo_ws" 2>&1 | tail -1
  timeout 60 "$BIN/tessera" train --config grpo_tiny --load "$work/parity_sft" --skip_train true "${PROMPTS[@]}" \
    --exp_name grpo_tiny_before 2>&1 | grep "validation:"
  timeout 120 "$BIN/tessera" train --config grpo_tiny --load "$work/parity_sft" "${PROMPTS[@]}" 2>&1 \
    | grep -E "validation:|done:|iteration +(5|20)/" | cut -c1-400
fi
if want grpo_lora; then
  echo "== GRPO with LoRA: the tiny experiment in bf16 (grpo_lora_tiny.yaml)"
  timeout 120 "$BIN/tessera" train --config grpo_lora_tiny --pretrained_checkpoint "$work/parity_sft" "${PROMPTS[@]}" 2>&1 \
    | grep -E "validation:|done:|LoRA:|iteration +(5|20)/" | cut -c1-400
  python3 "$ROOT/scripts/data/grpo_tasks.py" --task addition --digits 3 --train 64 --held-out 4 "$work/add"
  echo "== GRPO with LoRA r16: Llama 3.1 8B 4-layer proxy, 64 completions of one prompt, up to 256 tokens"
  timeout 240 "$BIN/tessera" train --config llama3.1_8B-pretrain --num_layers 4 --objective grpo --data_path null \
    --mock_data false --train_data_path "$work/add_prompts.jsonl" --tokenizer_type HuggingFaceTokenizer \
    --tokenizer_model llama3.1 --seq_length 512 --micro_batch_size 8 --global_batch_size 64 \
    --grpo_num_generations 64 --grpo_max_completion_length 256 --grpo_rewards answer --train_iters 3 \
    --lora_rank 16 --lora_alpha 32 --log_interval 1 --eval_interval 0 --log_progress false \
    --workspace "$OUT/grpo_lora_proxy_ws" 2>&1 | grep -E "iteration +[0-9]+/|done:|rror|LoRA:" | cut -c1-1200
fi
if want grpo; then
  python3 "$ROOT/scripts/data/grpo_tasks.py" --task addition --digits 3 --train 64 --held-out 4 "$work/add"
  # G completions of one prompt per step, decoded together; micro-batches of MB.
  for g_mb in 16:4 64:8; do
    G="${g_mb%:*}"; MB="${g_mb#*:}"
    echo "== GRPO: Llama 3.1 8B 4-layer proxy, $G completions of one prompt, up to 256 tokens"
    timeout 240 "$BIN/tessera" train --config llama3.1_8B-pretrain --num_layers 4 --objective grpo --data_path null \
      --mock_data false --train_data_path "$work/add_prompts.jsonl" --tokenizer_type HuggingFaceTokenizer \
      --tokenizer_model llama3.1 --seq_length 512 --micro_batch_size "$MB" --global_batch_size "$G" \
      --grpo_num_generations "$G" --grpo_max_completion_length 256 --grpo_rewards answer --train_iters 3 \
      --log_interval 1 --eval_interval 0 --log_progress false --workspace "$OUT/grpo_proxy${G}_ws" 2>&1 \
      | grep -E "iteration +[0-9]+/|done:|rror" | cut -c1-1200
  done
fi
if want grpo || want generate_proxy; then
  echo "== generation: Llama 3.1 8B 4-layer proxy, prompts of 256 random ids, 256 new tokens; transformers beside"
  timeout 200 "$BIN/tessera" bench generate --num_layers 4 --batch 1,64 --prompt 256 --new 256 --eager \
    -o "$OUT/generate" 2>&1 | tail -8
  for batch in 1 64; do
    timeout 200 python3 "$ROOT/.device/peer/torch_posttrain.py" --task gen --layers 4 --batch $batch --prompt 256 \
      --new 256 --json "$OUT/peer.jsonl" 2>&1 | tail -1
  done
fi
if want generate; then
  echo "== generation profiled: the Llama 3.1 8B 4-layer proxy at batch 1 and 64 (64 new tokens), op by op"
  timeout 200 "$BIN/tessera" bench generate --num_layers 4 --batch 1,64 --prompt 256 --new 64 --iters 1 \
    --trace "$OUT/gen" 2>&1 | tail -4
  for b in 1 64; do
    "$BIN/tessera" report "$OUT/gen_b$b.json" -o "$OUT/gen_report_b$b" --format md,csv > /dev/null 2>&1
    echo "-- batch $b"; head -40 "$OUT/gen_report_b$b/summary.md"
  done
  echo "== generation: full Llama 3.1 8B, batch 16 and 64, prompts of 256, 1024 new tokens"
  timeout 280 "$BIN/tessera" bench generate --num_layers 32 --batch 16,64 --prompt 256 --new 1024 --eager \
    -o "$OUT/generate_full" 2>&1 | tail -8
fi
if want generate_ab; then
  # The packed baseline binary (pack.sh --baseline) and this one, interleaved: the decode step's
  # kernels A/B on the proxy and the full 8B at batch 64.
  for round in 1 2; do
    for bin in tessera_baseline tessera; do
      echo "== $bin (round $round): proxy batch 64, full 8B batch 64 (512 new tokens)"
      timeout 100 "$BIN/$bin" bench generate --num_layers 4 --batch 64 --prompt 256 --new 256 \
        -o "$OUT/generate_ab_${bin}_$round" 2>&1 | grep -E "^\| 64"
      timeout 150 "$BIN/$bin" bench generate --num_layers 32 --batch 64 --prompt 256 --new 512 --iters 1 \
        -o "$OUT/generate_ab_full_${bin}_$round" 2>&1 | grep -E "^\| 64"
    done
  done
fi
if want generate_full; then
  echo "== generation: full Llama 3.1 8B, batch 1, 16, 64 and 256, prompts of 256, 512 new tokens"
  timeout 280 "$BIN/tessera" bench generate --num_layers 32 --batch 1,16,64,256 --prompt 256 --new 512 \
    --iters 1 -o "$OUT/generate_full512" 2>&1 | tail -8
fi
# GRPO of the full Llama 3.1 8B: 16 completions of up to 1024 tokens of ~256-token prompts,
# colocated; extra keys after the workspace name.
grpo_full() {
  local ws="$1"; shift
  # GRPO_GPUS: through `tessera launch` on that many GPUs (split placement).
  local launch=()
  [ -n "${GRPO_GPUS:-}" ] && launch=(launch --nproc_per_node "$GRPO_GPUS" --master_port 29877)
  timeout 280 "$BIN/tessera" "${launch[@]}" train --config llama3.1_8B-pretrain --objective grpo --data_path null --mock_data false \
    --train_data_path "$work/p256.jsonl" --tokenizer_type HuggingFaceTokenizer --tokenizer_model llama3.1 \
    --seq_length 1280 --micro_batch_size 1 --global_batch_size 16 --grpo_num_generations 16 \
    --grpo_max_completion_length 1024 --grpo_rewards answer --train_iters ${GRPO_ITERS:-3} --log_interval 1 --eval_interval 0 \
    --use_distributed_optimizer true --use_precision_aware_optimizer true --main_grads_dtype bf16 \
    --exp_avg_dtype bf16 --exp_avg_sq_dtype bf16 --recompute_granularity selective --log_progress false \
    --workspace "$OUT/$ws" "$@" 2>&1 \
    | grep -E "iteration +[0-9]+/|done:|rror|memory|model:|precision|grpo: the KV|grpo generation rank" | cut -c1-2000
}
if want grpo_full || want grpo_offload || want grpo_split || want grpo_split_async; then
  echo "== GRPO: full Llama 3.1 8B, prompts of ~256 tokens, G 16, up to 1024 new tokens, colocated"
  python3 -c 'import json
for i in range(64):
    print(json.dumps({"prompt": " ".join(["the quick brown fox jumps over the lazy dog"] * 27) + " What is %d + %d?" % (i, i + 1), "answer": str(2 * i + 1)}))' > "$work/p256.jsonl"
  grpo_full grpo_full_ws
fi
if want grpo_split; then
  echo "== GRPO: the same, split over two GPUs (GPU 1 generates, GPU 0 trains: grpo_generation_gpus 1)"
  GRPO_GPUS=2 grpo_full grpo_split_ws --grpo_generation_gpus 1
fi
if want grpo_split_async; then
  echo "== GRPO: split over two GPUs, the next batch generated while this one trains (grpo_async_generation)"
  GRPO_GPUS=2 grpo_full grpo_split_async_ws --grpo_generation_gpus 1 --grpo_async_generation true
fi
if want grpo_offload; then
  echo "== GRPO: the same with the AdamW moments on the host while generating (grpo_offload_optimizer_state)"
  grpo_full grpo_offload_ws --grpo_offload_optimizer_state true
fi
rm -rf "$work"
