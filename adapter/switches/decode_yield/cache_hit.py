"""What a waiting prompt could resume from the prefix cache now, read without changing the cache (a hit lost while it
waits is charged to its lag). SGLang's match (``UnifiedRadixCache.match_prefix``) touches the LRU and splits nodes;
this uses the read-only walks of both tree cores, ``match_full_device_prefix`` and ``swa_tombstone_ranges``, on the
key the scheduler matches (``common._req_radix_key``): the Full hit cut back to where the SWA validator accepts, a
lower bound."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def reader(cache: Any) -> Callable[[Any], int] | None:
    """``resumable`` for this cache, or None where the cache is not SGLang's unified radix cache
    (no read-only walk to use: the bound then charges no lost hit)."""
    from sglang.srt.mem_cache.common import _req_radix_key
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    core = getattr(cache, "tree_core", None)
    if core is None or getattr(cache, "disable", False) or not hasattr(core, "match_full_device_prefix"):
        return None
    swa = getattr(cache, "components", {}).get(ComponentType.SWA)
    window = int(getattr(cache, "_sliding_window_size", 0) or 0) if swa is not None and swa.gates_prefix_match else 0

    def resumable(req: Any) -> int:
        if req.positional_embed_overrides is not None:  # the scheduler matches nothing for it either
            return 0
        ids = req.origin_input_ids + req.output_ids
        key = _req_radix_key(cache, req, ids, req._compute_max_prefix_len(len(ids)))
        hit, _, _ = core.match_full_device_prefix(key)
        return hit if not window or not hit else deepest_valid(core.swa_tombstone_ranges(key, 0, hit), hit, window)

    return resumable


def deepest_valid(tombstones: list[tuple[int, int]], hit: int, window: int) -> int:
    """The deepest point of a Full hit of ``hit`` tokens the SWA validator accepts, given the hit's SWA-tombstoned
    ranges (whole nodes, in order): a point is valid with no tombstone before it, or with at least ``window``
    SWA-bearing tokens since the last one. The candidates are the hit's end and each tombstone's start (a node
    boundary); a valid node end inside a live run is not seen, so this is at most what the match gives."""
    if not tombstones or hit - tombstones[-1][1] >= window:
        return hit
    for i in range(len(tombstones) - 1, 0, -1):
        if tombstones[i][0] - tombstones[i - 1][1] >= window:
            return tombstones[i][0]
    return tombstones[0][0]  # no tombstone before it: valid (0 when the path begins tombstoned)
