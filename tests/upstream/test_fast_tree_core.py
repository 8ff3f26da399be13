"""The fast tree core (``DSV41_SWA_FAST_CORE``) on the real python ``UnifiedTreeCore``: the same
tree, match lengths, LRU order, lock refs, evictable sets and accounting as stock, op by op, on random
multi-session traces with chunked and one-pass turns, forks and evictions, whether children are found
by scanning or by their tuple key; every fast path (insert walk, match, Full lock and unlock) runs on
those traces; the key is copied once per insert and no child tuple key is built on a single-child
path."""

from __future__ import annotations

import importlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapter.core import boot
from adapter.switches import fast_tree_core
from devkit.testkit import radix_cache as rc
from devkit.testkit.hypothesis_budget import examples
from overlay_tools.simulate import cache_kit

# Small pools, so allocations evict (Full and SWA) on many traces; a one-pass turn longer than
# MAX_ONE_PASS tokens (a re-prefill after its prefix was evicted) is prefilled in passes that fit,
# and a session longer than MAX_HISTORY tokens starts over (a prompt must fit the Full pool).
GEOMETRY = cache_kit.SMALL.with_pools(full_tokens=2048, swa_tokens=384)
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


def twins() -> tuple[cache_kit.CacheKit, cache_kit.CacheKit]:
    stock = cache_kit.build(GEOMETRY, backend="python")
    fast_tree_core.keep_stock(stock.core)
    return stock, cache_kit.build(GEOMETRY, backend="python")


def _deep_session() -> tuple[cache_kit.CacheKit, cache_kit.CacheKit, list[int]]:
    """Twins after a session of 12 turns (a deep path of nodes), and the history to send next."""
    stock, quick = twins()
    tok = rc.Tokens()
    history = tok.fresh(8 * P)
    for _ in range(12):
        results = [k.run_turn(history, P) for k in (stock, quick)]
        history = results[0].history + tok.fresh(8 * P)
    return stock, quick, history


TURNS = st.builds(rc.Op, kind=st.just("turn"), session=st.integers(-1, 4), new_pages=st.integers(1, 8),
                  out_pages=st.integers(0, 3), chunked=st.booleans(), fork=st.booleans(),
                  trim_pages=st.sampled_from([0, 0, 1, 3, 9]))
OTHERS = st.builds(rc.Op, kind=st.sampled_from(["evict_swa", "evict_full", "idle"]), pages=st.integers(1, 24))
OPS = st.one_of(TURNS, TURNS, TURNS, OTHERS)  # mostly turns: allocations must run the pools dry


class _Counts:
    """Calls into the fast paths (module functions they route through); the Full lock walks counted
    per core (``lock``: the fast cache took the fast walk; ``stock_lock``: another core did)."""

    def __init__(self, monkeypatch, quick: cache_kit.CacheKit):
        self.n = {"match": 0, "walk": 0, "scan": 0, "lock": 0, "leaf": 0, "stock_lock": 0}

        def counting(name, fn):
            def wrapper(*args, **kwargs):
                if name != "scan" or args[0]:  # scans of a childless node decide nothing
                    self.n[name] += 1
                return fn(*args, **kwargs)
            return wrapper

        def fast_full(component):
            fast = original_fast_full(component)
            if fast:
                self.n["lock" if component.tree_core is quick.core else "stock_lock"] += 1
            return fast

        original_fast_full = fast_tree_core._fast_full
        monkeypatch.setattr(fast_tree_core, "_bind_match", counting("match", fast_tree_core._bind_match))
        monkeypatch.setattr(fast_tree_core, "_plan", counting("walk", fast_tree_core._plan))
        monkeypatch.setattr(fast_tree_core, "_scan", counting("scan", fast_tree_core._scan))
        monkeypatch.setattr(fast_tree_core, "refresh_leaf_sets", counting("leaf", fast_tree_core.refresh_leaf_sets))
        monkeypatch.setattr(fast_tree_core, "_fast_full", fast_full)


class _HeaderTokens(rc.Tokens):
    """Fresh spans that open with the same ``header`` tokens (a chat template's role header): sibling
    continuations share their first tokens and differ inside the first page (header < page), or share
    whole pages (header >= page: every new session branches off one shared root child)."""

    def __init__(self, header: int):
        super().__init__()
        self.header = header

    def fresh(self, n: int) -> list[int]:
        head = min(self.header, n)
        return [cache_kit.OUTPUT_TOKEN + 1] * head + super().fresh(n - head)


@given(ops=st.lists(OPS, min_size=2, max_size=14), scan_children=st.sampled_from([0, 1, 8, 10**6]),
       header=st.sampled_from([0, 0, 1, P - 1, P + 3]))
@settings(max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fast_core_leaves_the_same_cache_as_stock_after_every_operation(fast, ops, scan_children, header):
    """scan_children 0: every child by its tuple key (and whole-node matches by the array compare);
    1 / 8: single-child nodes / small nodes scanned; 10**6: every node scanned, the root too."""
    stock, quick = twins()
    runner = rc.TraceRunner([stock, quick], tokens=_HeaderTokens(header), max_one_pass=MAX_ONE_PASS,
                            max_history=MAX_HISTORY)

    def check(stage: str) -> None:
        assert rc.snapshot(stock, lru_order=True) == rc.snapshot(quick, lru_order=True), stage
        assert rc.misfiled_children(quick) == [], stage  # the filing rule the scan stands on
        stock.cache.sanity_check()
        quick.cache.sanity_check()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast_tree_core, "SCAN_CHILDREN", scan_children)
        counts = _Counts(mp, quick)
        for op in ops:
            runner.run(op, check)
    for a, b in runner.results:
        assert (a.prefix_len, a.swa_branching_seqlen) == (b.prefix_len, b.swa_branching_seqlen)
    assert stock.leak_check() == quick.leak_check() == {"full": 0, "swa": 0}
    # Every turn ran the fast walk and the fast Full lock walks on the fast cache only (admission lock;
    # per checkpoint an unlock and a lock; the release's unlock), and the fast match when its prompt
    # is longer than a page (a match key is the prompt less its last token, page-aligned).
    turns = len(runner.results)
    matched = sum(1 for a, _ in runner.results if a.prefix_len + a.reprefilled > P)
    n = counts.n
    assert n["match"] == matched and n["stock_lock"] == 0, n
    assert n["walk"] >= turns and n["lock"] >= 4 * turns and n["leaf"] >= turns, n
    if scan_children == 0:
        assert n["scan"] == 0, n


def _host_values(kit: cache_kit.CacheKit) -> list[tuple]:
    """Per node (DFS order): its Full and SWA host indices and whether a write-through is pending."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return [(rc._ids(n.component_data[ComponentType.FULL].host_value),
             rc._ids(n.component_data[ComponentType.SWA].host_value), n.write_through_pending_id is None)
            for n in rc._dfs(kit.core)]


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@given(ops=st.lists(OPS, min_size=2, max_size=12), header=st.sampled_from([0, P + 3]))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_beside_hicache_the_fast_match_leaves_the_same_cache_and_host_tier_as_stock(fast, policy, ops, header):
    """HiCache attached to both twins (host pools of twice the device pools): evictions demote to
    host, admissions load host hits back, and the fast match (both validator sets) runs on every
    admission; after every operation the tree, the host copies, the matches and the loads agree."""
    hicache = cache_kit.HiCache(ratio=2.0, write_policy=policy)
    stock = cache_kit.build(GEOMETRY, backend="python", hicache=hicache)
    fast_tree_core.keep_stock(stock.core)
    quick = cache_kit.build(GEOMETRY, backend="python", hicache=hicache)
    assert quick.core.enable_hicache
    runner = rc.TraceRunner([stock, quick], tokens=_HeaderTokens(header), max_one_pass=MAX_ONE_PASS,
                            max_history=MAX_HISTORY)

    def check(stage: str) -> None:
        assert rc.snapshot(stock, lru_order=True) == rc.snapshot(quick, lru_order=True), stage
        assert _host_values(stock) == _host_values(quick), stage
        stock.cache.sanity_check()
        quick.cache.sanity_check()

    # Two sessions pushed to host and resumed first (every example loads back), then the drawn trace.
    opening = [rc.Op("turn", new_pages=6, chunked=True), rc.Op("turn", new_pages=4),
               rc.Op("evict_full", pages=128), rc.Op("turn", session=0, new_pages=2),
               rc.Op("evict_swa", pages=24), rc.Op("turn", session=1, new_pages=1)]
    with pytest.MonkeyPatch.context() as mp:
        counts = _Counts(mp, quick)
        for op in opening + ops:
            runner.run(op, check)
    for a, b in runner.results:
        assert (a.prefix_len, a.swa_branching_seqlen) == (b.prefix_len, b.swa_branching_seqlen)
    assert (stock.loaded_from_host, stock.load_backs) == (quick.loaded_from_host, quick.load_backs)
    assert quick.load_backs >= 1
    assert stock.leak_check() == quick.leak_check() == {"full": 0, "swa": 0}
    matched = sum(1 for a, _ in runner.results if a.prefix_len + a.reprefilled > P)
    assert counts.n["match"] == matched, counts.n  # the fast match ran under HiCache, not stock's


def test_a_deep_insert_copies_the_key_once(fast, monkeypatch):
    """Stock slices the rest of the key at every walked node; the fast walk slices it once."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    slices = []
    original = RadixKey.__getitem__

    def counting(self, idx):
        slices.append(len(self))
        return original(self, idx)

    stock, quick, history = _deep_session()
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
    kit = cache_kit.build(GEOMETRY, backend="rust")
    a = kit.run_turn(tok.fresh(20 * P), P, chunk=128)
    b = kit.run_turn(a.history + tok.fresh(2 * P), P)
    assert b.prefix_len == len(a.history)
    assert kit.leak_check() == {"full": 0, "swa": 0}


def test_a_deep_walk_and_match_build_no_child_tuple_keys_on_single_child_paths(fast, monkeypatch):
    """Stock builds the page-long tuple key at every walked node (insert walk and match); the fast
    core scans small child sets instead: only the root (many children) and the new nodes' own
    filing build one."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    built = []
    original = RadixKey.child_key_at

    def counting(self, offset, page_size=1):
        built.append(offset)
        return original(self, offset, page_size)

    stock, quick, history = _deep_session()
    counts = []
    monkeypatch.setattr(RadixKey, "child_key_at", counting)
    for kit in (stock, quick):
        built.clear()
        req = kit.admit(history, P)  # the match walk
        kit.prefill(req, chunk=len(history))  # the one-pass checkpoint: the deep insert walk
        kit.finish(req, P)  # the release: the walk again
        counts.append(len(built))
    stock_keys, fast_keys = counts
    assert stock_keys >= 3 * 12, counts  # match, checkpoint and release each walk the 12-turn path
    assert fast_keys <= 8, counts  # the root lookups and the new leaves' filing
    assert rc.snapshot(stock, lru_order=True) == rc.snapshot(quick, lru_order=True)
    assert rc.misfiled_children(quick) == []


def test_the_fast_unlock_refreshes_the_same_leaf_sets_as_stock_and_defers_to_any_override(fast, monkeypatch):
    """Stock's Full unlock calls ``_update_evictable_leaf_sets`` on every node it brings to lock_ref 0;
    the fast unlock refreshes exactly those nodes inline. A stock-kept core, or a core whose class
    overrides the leaf-set method, takes the stock walk."""
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    updates: dict[int, int] = {}
    inline: dict[int, int] = {}
    original_refresh = fast_tree_core.refresh_leaf_sets

    def refresh(core, node):
        inline[id(core)] = inline.get(id(core), 0) + 1
        return original_refresh(core, node)

    def counted(core):  # an instance attribute: the class method (what _fast_full checks) stays stock
        bound = core._update_evictable_leaf_sets

        def update(node):
            updates[id(core)] = updates.get(id(core), 0) + 1
            return bound(node)
        core._update_evictable_leaf_sets = update

    def trace(kits):
        runner = rc.TraceRunner(kits)
        for op in (rc.Op("turn", new_pages=8, out_pages=1, chunked=True),
                   rc.Op("turn", session=0, new_pages=9, chunked=True),
                   rc.Op("turn", session=0, new_pages=2, fork=True, trim_pages=3), rc.Op("evict_full", pages=6)):
            runner.run(op)

    monkeypatch.setattr(fast_tree_core, "refresh_leaf_sets", refresh)
    stock, quick = twins()
    counted(stock.core)
    counted(quick.core)
    trace([stock, quick])
    assert inline.get(id(stock.core), 0) == 0
    assert inline[id(quick.core)] > 10
    assert updates[id(stock.core)] == updates[id(quick.core)] + inline[id(quick.core)]
    assert rc.snapshot(stock, lru_order=True) == rc.snapshot(quick, lru_order=True)

    inline.clear()
    original_update = UnifiedTreeCore._update_evictable_leaf_sets
    monkeypatch.setattr(UnifiedTreeCore, "_update_evictable_leaf_sets", lambda self, node: original_update(self, node))
    stock, quick = twins()
    trace([stock, quick])
    assert inline == {}
    assert rc.snapshot(stock, lru_order=True) == rc.snapshot(quick, lru_order=True)
