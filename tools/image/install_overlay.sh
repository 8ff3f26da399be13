#!/usr/bin/env bash
# Image step 1 (and CI outside docker): install the overlay's own packages, pinned by
# constraints.txt, into the interpreter that runs the engine, then verify that the engine there is
# the pinned one (versions and every source pin). The SGLang CUDA base image brings SGLang,
# sglang-kernel, FlashInfer and torch; this adds only what the overlay needs.
# PYTHON picks the interpreter (default python3; CI passes the repo's .venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# --serving (the final image stage): only what a serving process needs (wrapt); the test stage also
# gets the test tools.
PYTHON="${PYTHON:-python3}"
packages=(wrapt nvidia-ml-py pytest hypothesis)
case "${1:-}" in
  --serving) packages=(wrapt) ;;
  "") ;;
  *) echo "install_overlay: unknown argument ${1@Q}; expected --serving or nothing" >&2; exit 2 ;;
esac
"$PYTHON" -m pip install --disable-pip-version-check --no-cache-dir -q -c "$ROOT/constraints.txt" "${packages[@]}"
cd "$ROOT"
"$PYTHON" -m adapter pins
