#!/usr/bin/env bash
# Install what is missing (chromium included, for the HTML report test), build, and run the
# whole test suite. Tests labelled "gpu" report "skipped: no GPU" on machines without one.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh" --test
cd "$ROOT/build"
ctest --output-on-failure -j "${TESSERA_TEST_JOBS:-2}" --timeout 900 "$@"
