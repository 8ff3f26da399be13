#!/usr/bin/env bash
# Image step 4 (and CI outside docker): copy what a serving process loads into OUT, and nothing else:
# sitecustomize.py, the adapter package, the built native decode module, the image scripts the final
# stage runs, the lock and the notices. No tests, no devkit (gate, kits, benchmarks), no pytest.
# Usage: stage_overlay.sh OUT
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: stage_overlay.sh OUT (an empty or missing folder)}"
if [[ -e "$OUT" && -n "$(ls -A "$OUT" 2>/dev/null)" ]]; then
  echo "stage_overlay: OUT=$OUT is not empty; expected an empty or missing folder" >&2
  exit 2
fi
mkdir -p "$OUT/tools/image"
cd "$ROOT"
cp sitecustomize.py constraints.txt NOTICE pyproject.toml "$OUT/"
# The package without caches.
tar --exclude='__pycache__' --exclude='*.pyc' -cf - adapter | tar -xf - -C "$OUT"
cp tools/image/install_overlay.sh tools/image/install_roce.sh tools/image/healthcheck.py "$OUT/tools/image/"
if [[ -d build/native_decode ]]; then
  mkdir -p "$OUT/build"
  cp -r build/native_decode "$OUT/build/"
fi
echo "stage_overlay: staged $(find "$OUT" -type f | wc -l) files in $OUT"
