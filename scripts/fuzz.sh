#!/usr/bin/env bash
# Fuzzes every parser of untrusted input (tests/fuzz): builds the targets with clang's libFuzzer,
# AddressSanitizer and UndefinedBehaviorSanitizer into build-fuzz/ (CUDA off, only the folders
# the parsers live in), then runs each for a bounded time from its checked-in corpus. Fails when
# a target crashes, reports a sanitizer error or a leak, times out on one input or passes the
# RSS limit; the input that did it is left in build-fuzz/findings/<target>/ (add it to
# tests/fuzz/corpus/<target>/ with the fix). Ends with a table of executions per target.
#   scripts/fuzz.sh [TARGET...]     default: every target
#   TESSERA_FUZZ_SECONDS  seconds per target (default 12)
#   TESSERA_FUZZ_JOBS     targets fuzzed at once (default 2); also the build's parallel jobs
#   TESSERA_FUZZ_SEED     libFuzzer's seed (default 1, so that a run can be repeated; 0 picks one)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$ROOT/build-fuzz"
SECONDS_EACH="${TESSERA_FUZZ_SECONDS:-12}"
JOBS="${TESSERA_FUZZ_JOBS:-2}"
SEED="${TESSERA_FUZZ_SEED:-1}"

cmake -S "$ROOT/tests/fuzz" -B "$BUILD" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ >/dev/null
cmake --build "$BUILD" -j "$JOBS"

if (($# > 0)); then
  targets=("$@")
else
  mapfile -t targets < <(sed -n '/^set(fuzz_targets/,/)/p' "$ROOT/tests/fuzz/CMakeLists.txt" |
    tr ' ()' '\n\n\n' | grep -v -e '^$' -e '^set$' -e '^fuzz_targets$')
fi

rm -rf "$BUILD/runs" "$BUILD/findings"
# One target: new inputs go to a scratch corpus (the checked-in seeds stay as they are), the
# log to runs/<target>.log, the exit status to runs/<target>.status.
fuzz_one() {
  local target="$1" dir="$BUILD/runs/$1"
  mkdir -p "$dir/corpus" "$BUILD/findings/$target"
  local dict=()
  [[ -f "$ROOT/tests/fuzz/dict/$target.dict" ]] && dict=(-dict="$ROOT/tests/fuzz/dict/$target.dict")
  local status=0
  # Run from the scratch directory: relative paths an input names stay inside it.
  (cd "$dir" && ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$BUILD/fuzz_$target" -max_total_time="$SECONDS_EACH" -seed="$SEED" -timeout=10 -rss_limit_mb=2048 \
      -malloc_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$BUILD/findings/$target/" \
      "${dict[@]}" "$dir/corpus" "$ROOT/tests/fuzz/corpus/$target") \
    >"$BUILD/runs/$target.log" 2>&1 || status=$?
  echo "$status" >"$BUILD/runs/$target.status"
}

mkdir -p "$BUILD/runs"
started=$(date +%s)
for target in "${targets[@]}"; do
  while (($(jobs -rp | wc -l) >= JOBS)); do wait -n || true; done
  fuzz_one "$target" &
done
wait

failed=()
printf '\n%-16s %12s %10s %8s  %s\n' target executions "exec/s" "corpus" result
for target in "${targets[@]}"; do
  log="$BUILD/runs/$target.log"
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  units=$(sed -n 's/^stat::new_units_added: *//p' "$log" | tail -1)
  status=$(cat "$BUILD/runs/$target.status")
  result=ok
  if [[ "$status" != 0 ]]; then
    result="FAILED (exit $status): $(grep -m1 -E 'ERROR: |runtime error|==[0-9]+==' "$log" || true)"
    failed+=("$target")
  fi
  printf '%-16s %12s %10s %8s  %s\n' "$target" "${execs:-?}" "${rate:-?}" "+${units:-?}" "$result"
done
echo "fuzzing took $(($(date +%s) - started)) s; logs in $BUILD/runs/"
if ((${#failed[@]})); then
  for target in "${failed[@]}"; do
    echo "---- $target (input in $BUILD/findings/$target/):"
    tail -40 "$BUILD/runs/$target.log"
  done
  exit 1
fi
