#!/usr/bin/env bash
# One call on a GPU machine: GPU tests, the attention kernel lab, and the benchmark against
# the PyTorch peer, all writing under $OUT. Binaries are built elsewhere and carried in
# .device/bin; the PyTorch peer scripts in .device/peer.
#   bash scripts/device/gpu_suite.sh [tests] [lab] [bench] [peer]   (default: all)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/.device/out}"
BIN="$ROOT/.device/bin"
mkdir -p "$OUT"
# Binaries, their host libraries, the peer scripts and the Brown corpus travel packed.
if [ -f "$ROOT/.device/payload.tgz" ]; then
  tar xzf "$ROOT/.device/payload.tgz" -C "$ROOT/.device"
  [ -e "$ROOT/node_modules" ] || ln -s "$ROOT/.device/node_modules" "$ROOT/node_modules"
fi
# Test binaries have the build machine's source path compiled in.
mkdir -p /work && [ -e /work/main ] || ln -s "$ROOT" /work/main
export TESSERA_ROOT="$ROOT" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Host libraries of the build machine travel in .device/lib; cuBLASLt comes from the GPU
# machine's CUDA (or PyTorch's wheel of it).
cublas_dir="$(python3 -c 'import nvidia.cublas, os; print(os.path.join(os.path.dirname(nvidia.cublas.__file__), "lib"))' 2>/dev/null || true)"
export LD_LIBRARY_PATH="$ROOT/.device/lib:/usr/local/cuda/lib64:${cublas_dir}:${LD_LIBRARY_PATH:-}"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests lab bench peer)
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())' 2>&1
} | tee "$OUT/machine.txt"

if want tests; then
  echo "== GPU tests"
  "$BIN/test_gpu" --gtest_color=no 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^\[ (op|grad|curve|  FAILED|  PASSED|       OK|RUN)|Failure|error" | tail -150
fi
if want lab && [ -x "$BIN/attention_lab" ]; then
  echo "== attention lab"
  timeout 240 "$BIN/attention_lab" 2>&1 | tee "$OUT/attention_lab.log" | tail -40
fi
if want bench; then
  echo "== tessera bench model"
  timeout 300 "$BIN/tessera" bench model --models llama3.1_8B,qwen2.5_7B -o "$OUT" 2>&1 | tee "$OUT/bench_model.log" | tail -8
  timeout 200 "$BIN/tessera" bench model --models mistral_7B -o "$OUT/mistral" 2>&1 | tee "$OUT/bench_mistral.log" | tail -4
fi
if want peer; then
  echo "== PyTorch peer (torch.compile)"
  for args in "--model llama3.1_8b" "--model qwen2.5_7b" "--model mistral_7b --window 4096"; do
    timeout 240 python3 "$ROOT/.device/peer/torch_llama.py" $args --compile --json "$OUT/peer.jsonl" 2>&1 | tail -1
  done
fi
