#!/usr/bin/env bash
# README's test command: setup (idempotent), lint, then the whole pytest suite (slow and build
# tests included) through the same script the docker images run. Extra arguments go to pytest
# (e.g. -m "not slow").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup.sh
.venv/bin/ruff check .
.venv/bin/lint-imports --no-cache
# With no arguments: everything but the heavy end-to-end runs (each many minutes on 2 cores), so CI
# stays well inside its time; `bash tools/test.sh -m heavy` runs those on their own.
if [[ $# -eq 0 ]]; then
  set -- -m "not heavy"
fi
PYTHON="$ROOT/.venv/bin/python" exec bash tools/image/run_cpu_tests.sh "$@"
