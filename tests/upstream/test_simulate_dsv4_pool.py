"""``simulate`` at the DeepSeek-V4 family's geometry replays on SGLang's own ``DeepSeekV4TokenToKVPool``
(:mod:`overlay_tools.simulate.dsv4_pool`): sized by SGLang's ``DSV4PoolConfigurator`` at DeepSeek-V4.1's
ratios (60 C4 layers and one C128), one layer per ratio standing in, and with ``+hicache`` SGLang's
DeepSeek-V4 host stack.

The known answer for the accounting is the engine itself: the same requests through SGLang's real
scheduler (:func:`devkit.testkit.scheduler.build_scheduler` with ``dsv4=True``: its own DSV4 pool, four
layers C0/C4/C128/C4, the real ``get_new_batch_prefill`` / ``update_running_batch`` / result processing)
leave the same free and evictable Full and SWA slots as the replay leaves in its pool. Pages of 256,
window 128, chunk 1,024; every trace needs more KV than the Full pool holds, so both evict.
"""

from __future__ import annotations

import importlib
import json

import pytest

from overlay_tools.simulate import dsv4_pool, engine, fleet, trace

importlib.import_module("sglang.srt.managers.scheduler")

PAGE, WINDOW, CHUNK, RUNNING = 256, 128, 1024, 4
V41_RATIOS = tuple([4] * 60 + [128])
DSV4_HOST_STACK = [("kv", "LogicalHostPool"), ("swa", "DeepSeekV4PagedHostPool"),
                   ("deepseek_v4_c4", "DeepSeekV4PagedHostPool"), ("deepseek_v4_c4_indexer", "DeepSeekV4PagedHostPool"),
                   ("deepseek_v4_c4_state", "DeepSeekV4StateHostPool"),
                   ("deepseek_v4_c4_indexer_state", "DeepSeekV4StateHostPool"),
                   ("deepseek_v4_c128", "DeepSeekV4PagedHostPool")]


def _fleet(full_pages: int, tails: int = 2, hicache_ratio: float = 2.0) -> fleet.Fleet:
    pool = dsv4_pool.configure(ratios=V41_RATIOS, kv_sources=(10,), window=WINDOW, page=PAGE, chunk=CHUNK,
                               max_running=RUNNING, tails=tails, full_tokens=full_pages * PAGE)
    return fleet.Fleet(page=PAGE, window=WINDOW, chunk=CHUNK, max_running=RUNNING, tails=tails, swa_pool=pool.swa,
                       full_tokens=pool.full, full_source="test", cone_tokens=2048, cone_bound=2048, model="test",
                       profile="test", hicache_ratio=hicache_ratio, dsv4=pool)


def _trace(tmp_path, rows) -> list[trace.Request]:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                                        "hash_ids": ids}) + "\n" for ts, n_in, n_out, ids in rows))
    return trace.load(str(path), PAGE)


def _counts(allocator, cache) -> dict[str, int]:
    return {"full_free": allocator.full_available_size(), "swa_free": allocator.swa_available_size(),
            "full_evictable": cache.full_evictable_size(), "swa_evictable": cache.swa_evictable_size()}


def _replay(geo: fleet.Fleet, requests, policy: str = "stock"):
    from adapter import cost_model

    kit = fleet.build_kit(policy, geo, max_ctx=8192)
    try:
        replay = engine.Replay(kit, requests, chunk=CHUNK, max_running=RUNNING, coef=cost_model.DEFAULTS)
        turns = replay.run()
        assert kit.leak_check() == {"full": 0, "swa": 0}
        return kit, turns
    finally:
        fleet.uninstall()


def _engine(geo: fleet.Fleet, requests, together: bool, hicache: bool = False, loaded: list | None = None) -> dict[str, int]:
    """The same requests through SGLang's scheduler on its own DSV4 pool: one after another (each
    finished before the next arrives), or all queued at once; ``hicache``: with HiCache attached
    (write-through, the fleet's ratio), each request's tokens loaded from host appended to ``loaded``."""
    from devkit.testkit.scheduler import build_scheduler
    from overlay_tools.simulate.cache_kit import HiCache

    tier = HiCache(ratio=geo.hicache_ratio, write_policy="write_through") if hicache else None
    h = build_scheduler(page_size=PAGE, pool_tokens=geo.dsv4.full, swa_pool_tokens=geo.dsv4.swa, max_reqs=RUNNING,
                        chunked_prefill_size=CHUNK, sliding_window=WINDOW, dsv4=True, max_context_len=8192,
                        hicache=tier)
    reqs = []
    for r in requests:
        tokens = trace.materialize(r.prompt)
        reqs.append(h.add_request(h.make_request(len(tokens), r.output_length, prompt_ids=tokens)))
        if not together:
            h.run_until(reqs[-1].finished)
    h.run_until(lambda: all(req.finished() for req in reqs))
    if loaded is not None:
        loaded.extend(req.host_loaded_length for req in reqs)
    s = h.scheduler
    return _counts(s.token_to_kv_pool_allocator, s.tree_cache)


def test_the_replay_at_dsv4_geometry_builds_sglangs_dsv4_pool_sized_by_its_configurator():
    """The production profile (DeepSeek-V4.1 assumed, --swa-prefix-tails 384, 64 running requests):
    the fleet's pool is SGLang's configurator's (SWA = the request cap + 384 tails of window + page,
    C4 = Full / 4, C128 = Full / 128, C4 state = SWA pages x ring 8, C128 state = request slots x ring
    128), and the kit's cache sits on a ``DeepSeekV4TokenToKVPool`` of two layers (C4, C128) at those
    sizes, with SGLang's ``SWATokenToKVPoolAllocator`` counting them."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    from overlay_tools.simulate.swa_pool import swa_pool_for_tails

    full = 64 * PAGE
    geo = fleet.resolve(kv_tokens=full)
    pool = geo.dsv4
    assert pool is not None and (pool.layers, pool.ratios) == ((4, 128), V41_RATIOS)
    assert geo.swa_pool == pool.swa == swa_pool_for_tails(384, max_running=64)["swa_pool"] == 213_248
    assert (pool.full, pool.c4, pool.c128) == (full, full // 4, full // 128)
    assert pool.c4_state == pool.swa // PAGE * 8 and pool.c128_state == (64 + 1) * 128
    assert "2 layers (C4, C128) stand in for the model's 61 (60 C4, 1 C128)" in geo.describe()
    kit = fleet.build_kit("stock", geo, max_ctx=8192)
    try:
        kv = kit.allocator.get_kvcache()
        assert type(kv) is DeepSeekV4TokenToKVPool and type(kit.allocator) is SWATokenToKVPoolAllocator
        assert kv.compression_ratios == [4, 128] and kv.swa_kv_pool.size == pool.swa and kv.c128_size == pool.c128
        assert kv.compressed_pool_configs[4].kv_size == pool.c4
        assert kv.compressed_pool_configs[4].state_size == pool.c4_state
        assert (kit.allocator.size_full, kit.allocator.size_swa) == (full, pool.swa)
        assert (kit.allocator.full_available_size(), kit.allocator.swa_available_size()) == (full, pool.swa)
    finally:
        fleet.uninstall()


# Five requests, 27 pages of KV together: a shared one-block prompt ([1]) under three of them, the
# last chunked in two passes.
ROWS = [(1024, 300, [1, 2]), (1024, 100, [1, 3]), (512, 40, [4]), (1536, 10, [1, 5, 6]), (2048, 200, [7, 8, 9, 10])]


@pytest.mark.parametrize(("together", "full_pages"), [(False, 16), (True, 12), (True, 24)])
def test_after_the_same_requests_the_replays_dsv4_pool_holds_what_the_engines_does(tmp_path, together, full_pages):
    """Free and evictable Full and SWA slots after the same requests are equal in the replay's DSV4
    pool (two stand-in layers) and in the engine scheduler's (four layers): the allocators count the
    same, and the replay evicts before each allocation as SGLang over-estimates it (a prefill pass's
    extend plus a page per request, a page per decoding request each decode step)."""
    rows = [(0 if together else 1_000_000 * i, *row) for i, row in enumerate(ROWS)]
    requests = _trace(tmp_path, rows)
    assert sum(-(-(r.prompt_len + r.output_length) // PAGE) for r in requests) > full_pages  # both evict
    geo = _fleet(full_pages)
    kit, turns = _replay(geo, requests)
    assert _counts(kit.allocator, kit.cache) == _engine(geo, requests, together)
    assert turns[3].prefix == 512  # the shared prompt's block (the match the engine makes too)


def test_a_hicache_replay_at_dsv4_geometry_runs_on_sglangs_dsv4_host_stack(tmp_path):
    """``+hicache`` on the DSV4 pool: ``init_hicache`` builds SGLang's DeepSeek-V4 host stack (a
    ``LogicalHostPool`` anchor; ``DeepSeekV4PagedHostPool`` for SWA, C4, C4 indexer and C128;
    ``DeepSeekV4StateHostPool`` for the two C4 states), not the generic SWA one. A's 512-token history
    is pushed off the 8-page device pool by two strangers; its next turn loads the 512 tokens back from
    host (stock without a host tier recomputes them); nothing leaks. The engine's scheduler with HiCache
    on its own DSV4 pool loads the same 512 tokens and leaves the same free and evictable slots."""
    rows = [(0, 512, 16, [1]), (1_000_000, 1024, 16, [2, 3]), (2_000_000, 1024, 16, [4, 5]),
            (3_000_000, 1024, 16, [1, 6])]
    requests = _trace(tmp_path, rows)
    geo = _fleet(8, hicache_ratio=4.0)
    kit, turns = _replay(geo, requests, "stock+hicache")
    assert dsv4_pool.host_stack(kit.cache) == DSV4_HOST_STACK
    _, stock = _replay(geo, requests, "stock")
    last = turns[-1]
    assert last.continuation and last.full_lost and last.loaded == 512 and last.prefix == 512
    assert stock[-1].prefix == 0 and stock[-1].recomputed == last.recomputed + 512
    loaded: list[int] = []
    assert _counts(kit.allocator, kit.cache) == _engine(geo, requests, together=False, hicache=True, loaded=loaded)
    assert loaded == [turn.loaded for turn in turns] == [0, 0, 0, 512]


def test_every_pin_of_the_dsv4_pool_and_the_replay_matches_the_installed_sglang_and_a_drifted_one_refuses_by_name(
        monkeypatch):
    from adapter.core import pins

    for table in (dsv4_pool.PINS, engine.PINS):
        assert [c.describe() for c in (pins.check(t, table) for t in table) if not c.ok] == []
    monkeypatch.setitem(engine.PINS, "sglang.srt.mem_cache.common:evict_from_tree_cache", "0" * 64)
    with pytest.raises(engine.ReplayRefused, match=r"evict_from_tree_cache drifted from the pin"):
        engine.check_pins()
    target = "sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool.__init__"
    monkeypatch.setitem(dsv4_pool.PINS, target, "0" * 64)
    with pytest.raises(dsv4_pool.PoolRefused, match=r"DeepSeekV4TokenToKVPool.__init__ drifted from the pin"):
        dsv4_pool.configure(ratios=V41_RATIOS, kv_sources=(), window=WINDOW, page=PAGE, chunk=CHUNK,
                            max_running=RUNNING, tails=2, full_tokens=16 * PAGE)


def test_the_host_pools_are_booked_against_free_ram_without_a_serving_nodes_reserve(tmp_path, monkeypatch):
    """SGLang's host pools refuse to allocate unless the machine keeps 10 GiB free beside them (a serving
    node's reserve). ``simulate`` is the only thing its process runs: it books them against the RAM
    that is free (SGLang's ``host_memory_budget_scope``), so a reserve no machine has does not stop
    the replay; a pool that does not fit still refuses with SGLang's own error."""
    from sglang.srt.mem_cache.pool_host import base

    monkeypatch.setattr(base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 1 << 50)
    requests = _trace(tmp_path, [(0, 512, 16, [1])])
    kit, turns = _replay(_fleet(8), requests, "stock+hicache")
    assert dsv4_pool.host_stack(kit.cache) == DSV4_HOST_STACK and turns[0].recomputed == 512
