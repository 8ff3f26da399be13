"""SWA thin beside HiCache, on the real ``UnifiedRadixCache`` with HiCache attached (``init_hicache``:
SGLang's host pools, controller and transfers on the engine kit's CPU routes).

"Moved past" is a tree fact: the request's previous checkpoint, unless another request branched
there or passed through it (``hit_count > 2``), or it is locked. HiCache keeps host copies beside
the tree, it does not change which checkpoint a request has passed, so the rule is the same under
every write policy; what must hold is that the hit counts it reads are the same too. Write-back
returns from ``_inc_hit_count_and_check`` (and ``_should_backup_after_insert``) before counting, so
thin counts there: the counts and the demotions equal those without HiCache, op by op.
"""

from __future__ import annotations

from adapter.switches import swa_thin
from devkit.testkit import radix_cache as rc
from overlay_tools.simulate import cache_kit

POLICIES = [None, "write_back", "write_through"]
# Forks, trims and continuations: nodes passed by two and by three requests, splits of counted nodes.
TRACE = [rc.Op("turn", new_pages=6, chunked=True), rc.Op("turn", session=0, new_pages=2),
         rc.Op("turn", session=0, new_pages=2, fork=True), rc.Op("turn", new_pages=3),
         rc.Op("turn", session=0, new_pages=1), rc.Op("turn", session=1, new_pages=1),
         rc.Op("turn", session=0, trim_pages=1, new_pages=1), rc.Op("turn", session=2, new_pages=9, chunked=True),
         rc.Op("turn", session=0, new_pages=2, chunked=True), rc.Op("turn", session=0, trim_pages=3, new_pages=2)]


def _run(policy: str | None, stock: bool = False) -> tuple[cache_kit.CacheKit, list[tuple], list[int]]:
    """The trace on a cache large enough that nothing is evicted: (kit, per-op hit counts, per-op
    thin demotions)."""
    hicache = None if policy is None else cache_kit.HiCache(ratio=2.0, write_policy=policy)
    kit = cache_kit.build(cache_kit.SMALL, backend="python", hicache=hicache)
    if stock:
        swa_thin.keep_stock(kit.cache)
    runner = rc.TraceRunner([kit])
    counts, demoted = [], []
    for op in TRACE:
        before = swa_thin.STATS.demoted
        runner.run(op)
        counts.append(tuple(n.hit_count for n in rc._dfs(kit.core)))
        demoted.append(swa_thin.STATS.demoted - before)
    kit.cache.sanity_check()
    return kit, counts, demoted


def test_under_every_write_policy_hits_and_demotions_equal_those_without_hicache(thin):
    _, counts, demoted = _run(None)
    assert sum(demoted) > 0 and max(max(c) for c in counts) > swa_thin.SHARED_HIT_COUNT  # the rule is exercised
    for policy in ("write_back", "write_through"):
        kit, counts_p, demoted_p = _run(policy)
        assert kit.cache.cache_controller is not None and kit.core.is_write_back == (policy == "write_back")
        assert counts_p == counts, policy
        assert demoted_p == demoted, policy


def test_a_stock_twin_under_write_back_keeps_stocks_uncounted_hits(thin):
    """``keep_stock`` leaves a cache on every stock path: write-back counts no hit there."""
    _, counts, _ = _run("write_back", stock=True)
    assert all(c == 0 for c in counts[-1])
