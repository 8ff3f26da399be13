#!/usr/bin/env bash
# Image step 3 (and the pytest part of CI's test command): the CPU test suite with no GPU visible.
# Extra arguments go to pytest. PYTHON picks the interpreter (default python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
cd "$ROOT"
export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
set +e
"$PYTHON" -m pytest "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "tests: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
