#!/usr/bin/env bash
# README's test command: setup (idempotent), lint, then the whole pytest suite (slow and build
# tests included) through the same script the docker images run. Extra arguments go to pytest
# (e.g. -m "not slow").
#
#   bash tools/test.sh          CI's lane: everything but the heavy end-to-end runs
#   bash tools/test.sh fast     the everyday lane: lint, contracts, unit and upstream tests that boot
#                               no server and spawn no interpreter, Hypothesis' quick profile
#   bash tools/test.sh -m heavy the heavy runs on their own (many minutes each)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup.sh
.venv/bin/ruff check .
.venv/bin/lint-imports --no-cache
if [[ "${1:-}" == "fast" ]]; then
  shift
  export HYPOTHESIS_PROFILE=fast
  set -- tests/unit tests/upstream -m "not slow and not heavy and not spawns and not build and not cuda" \
    --durations=15 -q "$@"
# With no arguments: everything but the heavy end-to-end runs (each many minutes on 2 cores), so CI
# stays well inside its time; `bash tools/test.sh -m heavy` runs those on their own.
elif [[ $# -eq 0 ]]; then
  set -- -m "not heavy" --durations=25
fi
PYTHON="$ROOT/.venv/bin/python" exec bash tools/image/run_cpu_tests.sh "$@"
