"""SWA thin on a tree without an SWA component says so once instead of doing nothing silently (issue 16).

DeepSeek-V4.1 under ``--enable-encoder-swa-bounded-replay`` builds its ``UnifiedRadixCache`` without
an SWA component (the windows live in per-request rings; ``--swa-prefix-tails`` is ignored), so SWA
thin has no SWA LRU to reorder although it forced the Python tree core.
"""

from __future__ import annotations

import logging

from adapter.switches import swa_thin
from devkit.testkit import radix_cache as rc


def test_a_tree_without_an_swa_component_logs_one_inactive_warning_and_runs_the_stock_insert(records):
    kit = rc.build(rc.SMALL, backend="python")
    cache = kit.cache
    cache.is_swa_enabled = False  # what the engine builds under encoder bounded replay
    calls = []

    def stock(*args, **kwargs):
        calls.append(args)
        return "stock"

    for _ in range(3):
        assert swa_thin._checkpoint_into_tree(stock, cache, ("req", 0), {}) == "stock"
    assert len(calls) == 3
    warned = [r for r in records if "tree_has_no_swa_component" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "swa_thin inactive" in warned[0].getMessage()
