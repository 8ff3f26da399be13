#!/usr/bin/env bash
# Build the native SWA decode module (DSV41_SWA_NATIVE_DECODE) for sm_120a and sm_121a from the
# installed flashinfer-python 0.7.2; the Dockerfiles and CI run this. Arguments go to
# runtime/build_native_decode.py (--out DIR, --arch 120a|121a, --jobs N). PYTHON picks the
# interpreter (default: the repo's .venv, else python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
exec "$PYTHON" "$ROOT/runtime/build_native_decode.py" "$@"
