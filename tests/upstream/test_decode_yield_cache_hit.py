"""Decode yield's read of a waiting prompt's cache hit (adapter/switches/decode_yield/cache_hit.py) on
the real hybrid SWA cache, and the bound charging a hit lost while the windows held the prompt
(adapter/switches/decode_yield/backlog.py) on the real scheduler with scripted wall times."""

from __future__ import annotations

import importlib

import pytest

from adapter.core import boot, receipts
from adapter.switches.decode_yield import cache_hit
from adapter.switches.decode_yield import clock as yield_clock
from devkit.bench.chat_scripted import Costs
from devkit.testkit.scheduler import ScriptedClock, build_scheduler

CHUNK = 64
ATTR = "_dsv41_decode_yield"
SWA = {"hybrid_swa": True, "swa_pool_tokens": 1 << 14, "sliding_window": 32}


@pytest.fixture(autouse=True)
def _clock_restored(monkeypatch):
    monkeypatch.setattr(yield_clock, "now", yield_clock.now)


def _next_turn(h, before, question: int = 40):
    """A chat turn after ``before``: its prompt and answer, then a new question."""
    fresh = h.make_request(question, 1)
    return h.make_request(0, 4, prompt_ids=[*before.origin_input_ids, *before.output_ids, *fresh.origin_input_ids])


def _lru_and_recency(core):
    """The SWA LRU list head to tail and every node's last access time (the Python tree core)."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    lru = core.lru_lists[ComponentType.SWA]
    order, node = [], lru.head.lru_next[ComponentType.SWA]
    while node is not lru.tail:
        order.append(node.id)
        node = node.lru_next[ComponentType.SWA]
    times, stack = {}, [core.root_node]
    while stack:
        node = stack.pop()
        times[node.id] = node.last_access_time
        stack.extend(node.children.values())
    return order, times


def test_the_read_hit_is_the_schedulers_own_match_and_leaves_lru_order_and_recency_as_they_were(monkeypatch):
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")  # its LRU is readable
    h = build_scheduler(page_size=1, pool_tokens=1 << 15, chunked_prefill_size=CHUNK, max_reqs=16, **SWA)
    first = h.add_request(300, max_new_tokens=3)
    h.add_request(200, max_new_tokens=3)  # another path, so the LRU has an order to keep
    h.drain()
    cache = h.scheduler.tree_cache
    turn = _next_turn(h, first)
    before = _lru_and_recency(cache.tree_core)
    hit = cache_hit.reader(cache)(turn)
    assert _lru_and_recency(cache.tree_core) == before
    assert hit == _matched(h, turn) >= 300


def test_a_full_hit_past_the_last_live_window_reads_where_the_match_resumes_and_never_deeper():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h = build_scheduler(page_size=1, pool_tokens=1 << 15, chunked_prefill_size=CHUNK, max_reqs=16, **SWA)
    first = h.add_request(300, max_new_tokens=3)
    h.drain()
    h.add_request(_next_turn(h, first))  # a later turn: the first turn's end becomes an inner node
    h.drain()
    cache = h.scheduler.tree_cache
    branch = _next_turn(h, first)  # another continuation of the first turn
    read = cache_hit.reader(cache)
    full = cache.tree_core.match_full_device_prefix(_key(cache, branch))[0]
    assert full > 300  # the Full hit runs into the later turn's node, whose SWA is only at its end ...
    assert read(branch) == _matched(h, branch) == 300  # ... so the match resumes at the first turn's end
    assert cache.evict(EvictParams(swa_num_tokens=1 << 30)).swa_num_tokens_evicted > 0
    assert read(branch) <= _matched(h, branch)


def _matched(h, req):
    """What the scheduler's own match resumes for a copy of ``req`` (it touches the cache's recency)."""
    from sglang.srt.mem_cache.common import match_kv_cache

    twin = h.make_request(0, 4, prompt_ids=req.origin_input_ids)
    match_kv_cache(twin, h.scheduler.tree_cache, max_prefix_len=twin._compute_max_prefix_len(len(req.origin_input_ids)))
    return twin.prefix_len


def _key(cache, req):
    from sglang.srt.mem_cache.common import _req_radix_key

    return _req_radix_key(cache, req, req.origin_input_ids + req.output_ids)


def _wait_behind_windows(evict: bool, debug_lines: list[str]):
    """Decode yield 50: two streams decode, a 16-chunk prompt prefills, and a chat turn whose
    earlier turns are cached arrives after its first chunk; with ``evict`` the cache is emptied of
    every unlocked prefix while the turn waits (a pool under pressure). Returns the turn's stamp
    when first seen, the turn, the bound's count of prompts served past their bound and the
    unbounded lines."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    importlib.import_module("sglang.srt.managers.scheduler")
    boot.install({"DSV41_DECODE_YIELD": "50", "DSV41_DEBUG_LOG": "1"})
    h = build_scheduler(page_size=1, pool_tokens=1 << 15, chunked_prefill_size=CHUNK, max_reqs=16, **SWA)
    clock = ScriptedClock(Costs())
    h.on_forward = clock.forward
    yield_clock.now = clock.now
    earlier = h.add_request(1000, max_new_tokens=3)
    h.drain()
    streams = [h.add_request(32, max_new_tokens=4000) for _ in range(2)]
    h.drain()
    h.run(8)
    long = h.add_request(16 * CHUNK, max_new_tokens=2)
    h.run_until(lambda: long.rid in h.trace[-1].rids)
    turn = h.add_request(_next_turn(h, earlier))
    state = h.scheduler.__dict__[ATTR]
    h.run_until(lambda: turn in state.backlog.stamps)
    stamp = state.backlog.stamps[turn]
    if evict:
        h.scheduler.tree_cache.evict(EvictParams(num_tokens=1 << 30, swa_num_tokens=1 << 30))
    h.run_until(lambda: bool(turn.output_ids))
    h.run(1)  # the ledger weighs a served prompt on the next pass
    assert all(not s.finished() for s in streams)
    return stamp, turn, state.observe.unbounded, [line for line in debug_lines if "decode_yield unbounded" in line]


def test_a_turn_that_loses_its_cached_prefix_while_windows_hold_it_is_counted_with_what_it_lost(debug_lines):
    stamp, turn, late, lines = _wait_behind_windows(True, debug_lines)
    assert stamp.hit >= 1000  # it could resume its earlier turns when first seen waiting ...
    assert turn.cached_tokens == 0  # ... and prefilled them again
    assert late == 1 and len(lines) == 1
    fields = receipts.parse_line(lines[0]).params
    assert int(fields["lost_hit_tokens"]) == stamp.hit


def test_a_turn_that_keeps_its_cached_prefix_behind_the_same_windows_is_within_its_bound(debug_lines):
    stamp, turn, late, lines = _wait_behind_windows(False, debug_lines)
    assert turn.cached_tokens == stamp.hit >= 1000
    assert late == 0 and not lines


@pytest.mark.parametrize(("tombstones", "hit", "expected"), [
    ([], 300, 300),  # no tombstone since the root
    ([(0, 268)], 300, 300),  # a window's worth of SWA KV at the end
    ([(0, 280)], 300, 0),  # less than a window after the only tombstone, which starts at the root
    ([(100, 290)], 300, 100),  # the start of the tombstone: nothing tombstoned before it
    ([(0, 31), (64, 95), (256, 267), (300, 301)], 301, 300),  # 33 live tokens before the last tombstone
    ([(0, 31), (64, 95), (100, 120)], 130, 64),  # 5 and 10 live tokens: back to the first run of 33
])
def test_the_deepest_valid_point_needs_a_window_of_swa_kv_since_the_last_tombstone(tombstones, hit, expected):
    assert cache_hit.deepest_valid(tombstones, hit, 32) == expected
