#!/usr/bin/env bash
# Image step 4 (and CI outside docker): put what a serving process loads into OUT, and nothing else:
# the overlay's wheel (dist/, built by build_wheel.sh: the adapter package and its sglang.srt.plugins
# entry point), sitecustomize.py (the import hook, for PYTHONPATH=OUT), the built native decode
# module, the image scripts the final stage runs, the lock and the notices. No tests, no devkit
# (gate, kits, benchmarks), no pytest, no adapter sources beside the wheel.
# Usage: stage_overlay.sh OUT. PYTHON picks the interpreter that builds the wheel (default python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: stage_overlay.sh OUT (an empty or missing folder)}"
if [[ -e "$OUT" && -n "$(ls -A "$OUT" 2>/dev/null)" ]]; then
  echo "stage_overlay: OUT=$OUT is not empty; expected an empty or missing folder" >&2
  exit 2
fi
mkdir -p "$OUT/tools/image"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
bash tools/image/build_wheel.sh "$OUT/dist"
cp sitecustomize.py constraints.txt NOTICE "$OUT/"
cp tools/image/install_overlay.sh tools/image/install_roce.sh tools/image/healthcheck.py "$OUT/tools/image/"
if [[ -d build/native_decode ]]; then
  mkdir -p "$OUT/build"
  cp -r build/native_decode "$OUT/build/"
fi
echo "stage_overlay: staged $(find "$OUT" -type f | wc -l) files in $OUT"
