"""How many examples a property test runs: what it asks for under Hypothesis' ``ci`` profile (the
default, CI's lane), at most :data:`FAST_EXAMPLES` under ``fast`` (``HYPOTHESIS_PROFILE=fast``,
the everyday lane of ``bash tools/test.sh fast``)."""

from __future__ import annotations

import os

FAST_EXAMPLES = 8


def examples(wanted: int) -> int:
    return min(wanted, FAST_EXAMPLES) if os.environ.get("HYPOTHESIS_PROFILE") == "fast" else wanted
