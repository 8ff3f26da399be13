"""Container health: the engine's /health answers 200. Run with ``python -S`` (no site, no overlay)."""

import os
import sys
import urllib.request

PORT = os.environ.get("SGLANG_PORT", "30000")
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5) as response:
        sys.exit(0 if response.status == 200 else 1)
except Exception as exc:  # any failure is "unhealthy", with the reason for `docker inspect`
    print(f"unhealthy: {exc}", file=sys.stderr)
    sys.exit(1)
