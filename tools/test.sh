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
PYTHON="$ROOT/.venv/bin/python" exec bash tools/image/run_cpu_tests.sh "$@"
