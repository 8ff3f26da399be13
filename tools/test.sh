#!/usr/bin/env bash
# README's test command: setup (idempotent), lint, then the whole pytest suite (slow and build
# tests included). Extra arguments go to pytest (e.g. -m "not slow").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup.sh
.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "tests: pytest collected no tests" >&2
  exit 1
fi
exit $rc
