#!/usr/bin/env bash
# Image step 1 (and CI outside docker): install the overlay's own packages, pinned by
# constraints.txt, into the interpreter that runs the engine, then verify that the engine there is
# the pinned one (versions and every source pin). The SGLang CUDA base image brings SGLang,
# sglang-kernel, FlashInfer and torch; this adds only what the overlay needs.
# PYTHON picks the interpreter (default python3; CI passes the repo's .venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# --serving (the final image stage, run in the folder stage_overlay.sh filled): wrapt and the
# overlay's wheel from dist/, whose sglang.srt.plugins entry point SGLang's load_plugins runs in every
# engine process. Without it (the test stage, in the repo): the test tools; the sources are the overlay.
PYTHON="${PYTHON:-python3}"
packages=(wrapt nvidia-ml-py pytest hypothesis)
case "${1:-}" in
  --serving)
    wheels=("$ROOT"/dist/dsv41_overlay-*.whl)
    if [[ ${#wheels[@]} -ne 1 || ! -f "${wheels[0]}" ]]; then
      echo "install_overlay: --serving needs exactly one dist/dsv41_overlay-*.whl in $ROOT (stage_overlay.sh builds it)" >&2
      exit 2
    fi
    packages=(wrapt "${wheels[0]}") ;;
  "") ;;
  *) echo "install_overlay: unknown argument ${1@Q}; expected --serving or nothing" >&2; exit 2 ;;
esac
"$PYTHON" -m pip install --disable-pip-version-check --no-cache-dir -q -c "$ROOT/constraints.txt" "${packages[@]}"
cd "$ROOT"
"$PYTHON" -m adapter pins
