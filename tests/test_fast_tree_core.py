"""The fast insert walk (``DSV41_SWA_FAST_CORE``) on the real python ``UnifiedTreeCore``: the same
tree, match lengths, LRU order and accounting as the stock walk, op by op, on random multi-session
traces with chunked and one-pass turns, forks and evictions; and the key is copied once per insert."""

from __future__ import annotations

import importlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapter import boot, fast_tree_core
from adapter.testkit import radix_cache as rc

# Small pools, so allocations evict (Full and SWA) on many traces; a one-pass turn longer than
# MAX_ONE_PASS tokens (a re-prefill after its prefix was evicted) is prefilled in passes that fit,
# and a session longer than MAX_HISTORY tokens starts over (a prompt must fit the Full pool).
GEOMETRY = rc.SMALL.with_pools(full_tokens=2048, swa_tokens=384)
MAX_ONE_PASS, MAX_HISTORY = 128, 1024
P = GEOMETRY.page


@pytest.fixture
def fast():
    state = boot.install({"DSV41_SWA_FAST_CORE": "1"})
    importlib.import_module("sglang.srt.mem_cache.unified_radix_cache")
    outcome = state.outcomes["fast_tree_core"]
    assert outcome.status == "installed", outcome.reason
    assert "swa_thin" not in state.outcomes  # usable alone
    return state


def twins() -> tuple[rc.CacheKit, rc.CacheKit]:
    stock = rc.build(GEOMETRY, backend="python")
    fast_tree_core.keep_stock(stock.core)
    return stock, rc.build(GEOMETRY, backend="python")


TURNS = st.builds(rc.Op, kind=st.just("turn"), session=st.integers(-1, 4), new_pages=st.integers(1, 8),
                  out_pages=st.integers(0, 3), chunked=st.booleans(), fork=st.booleans(),
                  trim_pages=st.sampled_from([0, 0, 1, 3, 9]))
OTHERS = st.builds(rc.Op, kind=st.sampled_from(["evict_swa", "evict_full", "idle"]), pages=st.integers(1, 24))
OPS = st.one_of(TURNS, TURNS, TURNS, OTHERS)  # mostly turns: allocations must run the pools dry


@given(ops=st.lists(OPS, min_size=2, max_size=14))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fast_walk_leaves_the_same_cache_as_stock_after_every_operation(fast, ops):
    stock, quick = twins()
    runner = rc.TraceRunner([stock, quick], max_one_pass=MAX_ONE_PASS, max_history=MAX_HISTORY)

    def check(stage: str) -> None:
        assert rc.snapshot(stock, lru_order=True) == rc.snapshot(quick, lru_order=True), stage
        stock.cache.sanity_check()
        quick.cache.sanity_check()

    for op in ops:
        runner.run(op, check)
    for a, b in runner.results:
        assert (a.prefix_len, a.swa_branching_seqlen) == (b.prefix_len, b.swa_branching_seqlen)
    assert stock.leak_check() == quick.leak_check() == {"full": 0, "swa": 0}


def test_a_deep_insert_copies_the_key_once(fast, monkeypatch):
    """Stock slices the rest of the key at every walked node; the fast walk slices it once."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    slices = []
    original = RadixKey.__getitem__

    def counting(self, idx):
        slices.append(len(self))
        return original(self, idx)

    stock, quick = twins()
    tok = rc.Tokens()
    history = tok.fresh(8 * P)
    for _ in range(12):  # a session of 12 turns: a deep path of nodes
        results = [k.run_turn(history, P) for k in (stock, quick)]
        history = results[0].history + tok.fresh(8 * P)
    counts = []
    monkeypatch.setattr(RadixKey, "__getitem__", counting)
    for kit in (stock, quick):
        slices.clear()
        req = kit.admit(history, P)
        slices.clear()
        kit.prefill(req, chunk=len(history))  # the one-pass checkpoint: the deep insert walk
        counts.append(sum(1 for n in slices if n > len(history) // 2))  # copies of (most of) the key
        kit.finish(req, P)
    stock_copies, fast_copies = counts
    # The fast walk keeps the insert's fixed slices (page alignment of the insert and prompt keys,
    # the new leaf's key); the stock walk adds one copy per walked node of the 12-turn path.
    assert fast_copies <= 4, fast_copies
    assert stock_copies >= fast_copies + 12, (stock_copies, fast_copies)
    assert rc.snapshot(stock, lru_order=True) == rc.snapshot(quick, lru_order=True)


def test_rust_core_caches_are_untouched(fast):
    tok = rc.Tokens()
    kit = rc.build(GEOMETRY, backend="rust")
    a = kit.run_turn(tok.fresh(20 * P), P, chunk=128)
    b = kit.run_turn(a.history + tok.fresh(2 * P), P)
    assert b.prefix_len == len(a.history)
    assert kit.leak_check() == {"full": 0, "swa": 0}
