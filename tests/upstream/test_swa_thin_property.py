"""SWA thin against stock on random multi-session traces (chunked and one-pass turns, forks, idle
gaps, evictions) on the real ``UnifiedRadixCache``: no slot leak, ``sanity_check()`` after every
operation, and no difference from stock except the SWA LRU order until the first SWA eviction
(after that the two caches legitimately evict different resume points)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapter.switches import swa_thin
from devkit.testkit import radix_cache as rc
from devkit.testkit.hypothesis_budget import examples
from overlay_tools.simulate import cache_kit

# Small pools, so allocations evict (Full and SWA) on many traces; a one-pass turn longer than
# MAX_ONE_PASS tokens (a re-prefill after its prefix was evicted) is prefilled in passes that fit,
# and a session longer than MAX_HISTORY tokens starts over (a prompt must fit the Full pool).
GEOMETRY = cache_kit.SMALL.with_pools(full_tokens=2048, swa_tokens=384)
MAX_ONE_PASS, MAX_HISTORY = 128, 1024


TURNS = st.builds(rc.Op, kind=st.just("turn"), session=st.integers(-1, 4), new_pages=st.integers(1, 8),
                  out_pages=st.integers(0, 3), chunked=st.booleans(), fork=st.booleans(),
                  trim_pages=st.sampled_from([0, 0, 1, 3, 9]))
OTHERS = st.builds(rc.Op, kind=st.sampled_from(["evict_swa", "evict_full", "idle"]), pages=st.integers(1, 24))
OPS = st.one_of(TURNS, TURNS, TURNS, OTHERS)  # mostly turns: allocations must run the pools dry


def _row_is_valid(kit: cache_kit.CacheKit) -> None:
    """At quiescence nothing is protected: every slot is free or held by the tree."""
    assert kit.cache.full_protected_size() == 0 and kit.cache.swa_protected_size() == 0
    assert kit.leak_check() == {"full": 0, "swa": 0}


@given(ops=st.lists(OPS, min_size=2, max_size=14))
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_thin_differs_from_stock_only_in_which_resume_points_survive(thin, ops):
    stock = cache_kit.build(GEOMETRY, backend=None)
    swa_thin.keep_stock(stock.cache)
    kit = cache_kit.build(GEOMETRY, backend=None)
    runner = rc.TraceRunner([stock, kit], max_one_pass=MAX_ONE_PASS, max_history=MAX_HISTORY)
    evicted = [False]

    def check(stage: str) -> None:
        stock.cache.sanity_check()
        kit.cache.sanity_check()
        evicted[0] = evicted[0] or stage == "evict_swa" or stock.evict_calls > 0 or kit.evict_calls > 0
        if not evicted[0]:
            assert rc.snapshot(stock) == rc.snapshot(kit), stage
            assert sorted(rc.swa_lru(stock)) == sorted(rc.swa_lru(kit))
        if stage in ("release", "evict_swa", "evict_full"):
            _row_is_valid(stock)
            _row_is_valid(kit)

    for op in ops:
        runner.run(op, check)
    for a, b in runner.results:
        # Both matched a valid resume point: page aligned, inside the prompt.
        for r in (a, b):
            assert r.prefix_len % GEOMETRY.page == 0 and r.reprefilled > 0
