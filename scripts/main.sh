#!/usr/bin/env bash
# Quick start: install what is missing, build, and run the default training job (a small
# Llama on the Brown corpus). Extra arguments go to `tessera train`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
exec build/tessera train "$@"
