#!/usr/bin/env bash
# Image step (inside stage_overlay.sh) and CI outside docker: build the overlay's wheel
# (dsv41_overlay-<version>-py3-none-any.whl: the adapter package and its sglang.srt.plugins entry
# point, and the operator tools' overlay_tools; no devkit, no tests) into OUT with pip, from a copy of
# what it packages, so the checkout gets no build/ or *.egg-info. The backend is pyproject's pinned
# setuptools: the interpreter's own when it is that version (no download), else pip fetches that
# version into an isolated build.
# Usage: build_wheel.sh OUT. PYTHON picks the interpreter (default python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: build_wheel.sh OUT (folder for the wheel)}"
PYTHON="${PYTHON:-python3}"
pinned="$(sed -n 's/^setuptools==//p' "$ROOT/constraints.txt")"
if ! grep -qxF "requires = [\"setuptools==$pinned\"]" "$ROOT/pyproject.toml"; then
  echo "build_wheel: pyproject.toml's build requirement is not setuptools==$pinned (constraints.txt)" >&2
  exit 2
fi
src="$(mktemp -d)"
trap 'rm -rf "$src"' EXIT
cd "$ROOT"
cp pyproject.toml NOTICE "$src/"
tar --exclude='__pycache__' --exclude='*.pyc' -cf - adapter overlay_tools | tar -xf - -C "$src"
mkdir -p "$OUT"
isolation=()
if [[ "$("$PYTHON" -c 'import setuptools; print(setuptools.__version__)' 2>/dev/null || true)" == "$pinned" ]]; then
  isolation=(--no-build-isolation)
fi
"$PYTHON" -m pip wheel --disable-pip-version-check --no-cache-dir -q --no-deps "${isolation[@]}" -w "$OUT" "$src"
echo "build_wheel: $(cd "$OUT" && ls dsv41_overlay-*.whl)"
