#!/usr/bin/env bash
# One idempotent setup: creates .venv and installs the pinned stack from constraints.txt.
# A second run with nothing changed returns in seconds (stamp = sha256 of this file + the lock).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DSV41_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
LOCK="$ROOT/constraints.txt"
STAMP="$VENV/.dsv41-setup-stamp"
want="$(cat "$LOCK" "$ROOT/tools/setup.sh" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
  echo "setup: $VENV is up to date"
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# Pinned names, in lock order, without comments.
names() { sed -e 's/#.*//' -e '/^\s*$/d' "$LOCK" | cut -d= -f1 | grep -vxE "$1"; }
# torch first (a local file on the dev machines; the lock keeps it at 2.14.1).
pip install -c "$LOCK" torch torchvision
# The engine and FlashInfer without their dependency trees: sglang's pulls sglang-kernel (a CUDA
# build that cannot import on CPU); FlashInfer is needed for its sources and headers only.
pip install -c "$LOCK" --no-deps sglang flashinfer-python
# Everything else that the lock names (with their own dependencies).
# shellcheck disable=SC2046
pip install -c "$LOCK" $(names 'sglang|flashinfer-python|torch|torchvision')
echo "$want" > "$STAMP"
echo "setup: $VENV ready"
