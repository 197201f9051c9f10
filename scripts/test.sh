#!/usr/bin/env bash
# Install what is missing (chromium included, for the HTML report test; clang's libFuzzer for
# the fuzz targets), build, run the whole test suite, then fuzz every parser of untrusted input
# for a bounded time (scripts/fuzz.sh, about 12 s per target). Arguments go to ctest (a subset
# of the tests, e.g. -R Checkpoint) and then skip fuzzing. Tests labelled "gpu" report
# "skipped: no GPU" on machines without one.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh" --test
# A fresh build has no timings of earlier runs, and ctest would start the longest tests (the
# end-to-end runs, minutes each) last, to run alone at the end: name them, so they start first.
costs="$ROOT/build/Testing/Temporary/CTestCostData.txt"
if [ ! -f "$costs" ]; then
  mkdir -p "$(dirname "$costs")"
  printf '%s 1 300\n' SftEndToEnd.FineTuningTeachesAHeldOutInstructionTask SftEndToEnd.LoraCorrectsAFrozenModel \
    GrpoEndToEnd.RewardedSamplingRaisesHeldOutAccuracy DpoTraining.ReportsTrlStatisticsValidatesAndLearnsFromPairs \
    > "$costs"
  echo "---" >> "$costs"
fi
(cd "$ROOT/build" && ctest --output-on-failure -j "${TESSERA_TEST_JOBS:-2}" --timeout 900 "$@")
if (($# == 0)); then
  "$ROOT/scripts/fuzz.sh"
fi
