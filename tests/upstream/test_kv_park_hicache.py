"""``DSV41_KV_PARK=ram`` beside HiCache, on the real SGLang scheduler (CPU) with HiCache attached to
its cache (``devkit.testkit.scheduler.build_scheduler(hicache=...)``: ``init_hicache``, the real host
pools and controller). One host budget: the park pool is carved out of HiCache's host pools at the
first scheduler pass (their own allocator hands the slots over), every parked byte lives inside
HiCache's host buffers, and a retraction parks and restores byte for byte.

Nothing held twice: a retraction parks only the Full pages past what the tree holds (device, or host
through HiCache); the restore brings HiCache's part back through HiCache's own load-back, then writes
the parked tail; when HiCache has evicted its part from both tiers meanwhile, the request recomputes
(one ``dropped reason=prefix_gone_from_hicache`` line, nothing else lost). Both a hybrid SWA pool and
a full-attention pool, write-through and write-back."""

from __future__ import annotations

import importlib
from array import array

import pytest
import torch

from adapter.core import boot
from adapter.switches.kv_park.page_format import per_view_save
from overlay_tools.simulate.cache_kit import HiCache

importlib.import_module("sglang.srt.managers.scheduler")
from devkit.testkit.scheduler import build_scheduler  # noqa: E402

HICACHE = HiCache(ratio=2.0, write_policy="write_back")
PAGE = 16


def _build(hicache: HiCache | None = HICACHE, hybrid_swa: bool = True, window: int = 32):
    return build_scheduler(page_size=PAGE, pool_tokens=1024, max_reqs=8, chunked_prefill_size=256, hybrid_swa=hybrid_swa,
                           swa_pool_tokens=512, sliding_window=window, hicache=hicache)


def _park():
    return importlib.import_module("adapter.switches.kv_park.switch")


def _host_ranges(tree) -> list[tuple[int, int]]:
    out = []
    for entry in tree.host_pool_group.entries:
        buf = entry.host_pool.kv_buffer
        for b in buf if isinstance(buf, (list, tuple)) else [buf]:
            out.append((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()))
    return out


def _inside(ranges, t: torch.Tensor) -> bool:
    start, end = t.data_ptr(), t.data_ptr() + t.numel()
    return any(lo <= start and end <= hi for lo, hi in ranges)


def _full_pool(h):
    kv = h.scheduler.token_to_kv_pool_allocator.get_kvcache()
    return getattr(kv, "full_kv_pool", kv)


def _full_bytes(h, req, n: int) -> torch.Tensor:
    kv = _full_pool(h)
    slots = h.scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()
    return torch.cat([b[slots].view(torch.uint8).reshape(n, -1) for b in [*kv.k_buffer, *kv.v_buffer]], dim=1)


def _randomize(h, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    kv = h.scheduler.token_to_kv_pool_allocator.get_kvcache()
    for pool in (kv.full_kv_pool, kv.swa_kv_pool) if hasattr(kv, "full_kv_pool") else (kv,):
        for buf in [*pool.k_buffer, *pool.v_buffer]:
            raw = buf.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def test_beside_hicache_the_park_pool_is_carved_out_of_hicaches_host_pool_one_budget():
    state = boot.install({"DSV41_KV_PARK": "ram", "DSV41_KV_PARK_GIB": "4"})
    h = _build()
    tree = h.scheduler.tree_cache
    free_before = [e.host_pool.available_size() for e in tree.host_pool_group.entries]
    host_total = sum(int(e.host_pool.size) * int(e.host_pool.size_per_token) for e in tree.host_pool_group.entries)
    h.step()  # the first scheduler pass carves the pool
    assert state.outcomes["kv_park"].status == "installed"
    s = _park().STATE
    pool = s.store.host_pool
    assert s.beside_hicache and pool is not None
    taken = [b - e.host_pool.available_size() for b, e in zip(free_before, tree.host_pool_group.entries, strict=True)]
    assert all(t > 0 for t in taken), "every host pool gave its share of slots through its own allocator"
    carved = sum(t * int(e.host_pool.size_per_token) for t, e in zip(taken, tree.host_pool_group.entries, strict=True))
    assert pool.capacity <= carved <= host_total // 2, "the carve-out is at most half of HiCache's host pools"
    ranges = _host_ranges(tree)
    assert all(_inside(ranges, c) for c in pool.chunks), "a park-pool chunk lies outside HiCache's host buffers"
    assert s.store.budget == pool.capacity


def test_the_park_pool_is_carved_when_the_kv_cache_is_built_before_the_first_pass_with_one_timed_line(records):
    """The wrapped ``build_kv_cache`` (what ``Scheduler.__init__`` calls) settles the park pool at boot:
    carved out of HiCache's host pools before any pass, one ``kv_park pool at=boot boot_ms=..`` line;
    the first pass does not boot it again."""
    state = boot.install({"DSV41_KV_PARK": "ram", "DSV41_KV_PARK_GIB": "4"})
    assert state.outcomes["kv_park"].status == "installed"
    h = _build()
    s = _park().STATE
    built = _park()._built_kv_cache(lambda **kw: h.scheduler, None, (), {"server_args": h.scheduler.server_args})
    assert built is h.scheduler
    pool = s.store.host_pool
    assert s.beside_hicache and pool is not None, "the pool was not carved at boot"
    lines = [r.getMessage() for r in records if "kv_park pool" in r.getMessage()]
    assert len(lines) == 1 and "at=boot" in lines[0] and "boot_ms=" in lines[0] and "carved_from=hicache" in lines[0]
    h.step()
    assert s.store.host_pool is pool and len([r for r in records if "kv_park pool" in r.getMessage()]) == 1


def test_a_retraction_beside_hicache_parks_inside_hicaches_budget_and_restores_byte_for_byte():
    boot.install({"DSV41_KV_PARK": "ram", "DSV41_KV_PARK_GIB": "4"})
    h = _build()
    tree = h.scheduler.tree_cache
    host_total = sum(int(e.host_pool.size) * int(e.host_pool.size_per_token) for e in tree.host_pool_group.entries)
    a = h.add_request(100, max_new_tokens=200)
    b = h.add_request(70, max_new_tokens=200)
    _randomize(h)
    h.run(31)
    committed = {r.rid: len(r.origin_input_ids) + len(r.output_ids) - 1 for r in (a, b)}
    whole = {rid: n // PAGE * PAGE for rid, n in committed.items()}
    before = {r.rid: _full_bytes(h, r, whole[r.rid]) for r in (a, b)}
    h.retract_all()
    store = _park().STATE.store
    store.fence()
    assert {"r1", "r2"} <= set(store.ready_keys()), "the retracted rows were not parked beside HiCache"
    ranges = _host_ranges(tree)
    for key in store.ready_keys():
        assert all(_inside(ranges, seg) for seg in store._entries[key].rows), "a parked row outside HiCache's host pool"
    # Parked bytes plus what HiCache itself holds on host never exceed HiCache's host pool.
    hicache_held = sum((int(e.host_pool.size) - int(e.host_pool.available_size())) * int(e.host_pool.size_per_token)
                       for e in tree.host_pool_group.entries)
    assert hicache_held <= host_total and store.used_bytes <= store.host_pool.capacity
    # Other traffic: the device tree loses every unlocked node, every free device page is zeroed.
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    tree.evict(EvictParams(num_tokens=1 << 30))
    alloc = h.scheduler.token_to_kv_pool_allocator
    kv = alloc.get_kvcache()
    for pool, side in ((kv.full_kv_pool, alloc.full_attn_allocator), (kv.swa_kv_pool, alloc.swa_attn_allocator)):
        free = side.get_all_free_pages().long()
        for buf in [*pool.k_buffer, *pool.v_buffer]:
            buf.view(-1, PAGE, *buf.shape[1:])[free] = 0
    step = h.step()
    assert step.kind == "prefill" and set(step.rids) == {"r1", "r2"}
    prefix = dict(zip(step.rids, step.prefix_lens, strict=True))
    for r in (a, b):
        assert prefix[r.rid] == whole[r.rid], f"{r.rid}: the parked pages were not found as a cached prefix"
        assert torch.equal(_full_bytes(h, r, whole[r.rid]), before[r.rid]), f"{r.rid}: other full-attention bytes"
    assert store.stats.restored >= 2 and store.stats.failed == 0
    h.run_until(lambda: a.finished() and b.finished(), max_passes=1000)
    assert store.host_pool.used_bytes == store.used_bytes, "pool rows held by no entry"


def test_a_park_budget_larger_than_hicaches_host_pool_takes_half_of_it():
    boot.install({"DSV41_KV_PARK": "ram", "DSV41_KV_PARK_GIB": "4096"})
    h = _build()
    h.step()
    pool = _park().STATE.store.host_pool
    host_total = sum(int(e.host_pool.size) * int(e.host_pool.size_per_token)
                     for e in h.scheduler.tree_cache.host_pool_group.entries)
    assert 0 < pool.capacity <= host_total // 2


def test_hicache_without_a_host_page_to_spare_fails_the_first_pass_naming_the_key(monkeypatch):
    from adapter.switches.kv_park import beside_hicache

    monkeypatch.setattr(beside_hicache, "SHARE", 0.0)
    boot.install({"DSV41_KV_PARK": "ram", "DSV41_KV_PARK_GIB": "2"})
    h = _build()
    with pytest.raises(boot.BootError, match=r"DSV41_KV_PARK_GIB=2: HiCache's host pools \(.*\) have no whole host page"):
        h.step()


def test_without_hicache_kv_park_stays_installed_after_the_first_pass_and_keeps_pageable_entries():
    state = boot.install({"DSV41_KV_PARK": "ram"})
    h = _build(hicache=None)
    h.add_request(100, max_new_tokens=4)
    h.run(3)
    assert state.outcomes["kv_park"].status == "installed"
    assert _park().STATE.store.host_pool is None, "a CPU KV pool keeps today's pageable entries"


def _host_held(tree) -> int:
    """Bytes HiCache's host pools hold (their used slots, the park pool's carve-out included)."""
    return sum((int(e.host_pool.size) - int(e.host_pool.available_size())) * int(e.host_pool.size_per_token)
               for e in tree.host_pool_group.entries)


def _host_total(tree) -> int:
    return sum(int(e.host_pool.size) * int(e.host_pool.size_per_token) for e in tree.host_pool_group.entries)


def _zero_free_device_pages(h) -> None:
    """Every free device page zeroed: a page that comes back right got its bytes from a copy."""
    alloc = h.scheduler.token_to_kv_pool_allocator
    kv = alloc.get_kvcache()
    sides = ((kv.full_kv_pool, alloc.full_attn_allocator), (kv.swa_kv_pool, alloc.swa_attn_allocator)) \
        if hasattr(kv, "full_kv_pool") else ((kv, alloc),)
    for pool, side in sides:
        free = side.get_all_free_pages().long() if hasattr(side, "get_all_free_pages") else None
        if free is None:
            free = torch.unique(torch.div(side.free_pages.long(), 1, rounding_mode="floor"))
        for buf in [*pool.k_buffer, *pool.v_buffer]:
            buf.view(-1, PAGE, *buf.shape[1:])[free] = 0


def _tree_match(h, req, n: int):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tokens = (req.origin_input_ids + req.output_ids)[:n]
    key = RadixKey(token_ids=tokens, extra_key=req.extra_key, cache_salt=req.cache_salt)
    return h.scheduler.tree_cache.match_prefix(MatchPrefixParams(key=key))


def _retracted_pair(h):
    """Two rows decode 31 steps on random KV, then the real retraction path releases both."""
    a = h.add_request(100, max_new_tokens=200)
    b = h.add_request(70, max_new_tokens=200)
    _randomize(h)
    h.run(31)
    whole = {r.rid: (len(r.origin_input_ids) + len(r.output_ids) - 1) // PAGE * PAGE for r in (a, b)}
    before = {r.rid: _full_bytes(h, r, whole[r.rid]) for r in (a, b)}
    slots = {r.rid: h.scheduler.req_to_token_pool.req_to_token[r.kv.req_pool_idx, : whole[r.rid]].long() for r in (a, b)}
    h.retract_all()
    store = _park().STATE.store
    store.fence()
    # The parked format's oracle (one copy per page and region) of each row's Full pages, read
    # before anything writes the freed pages.
    full = _park().STATE.engines_for(h.scheduler.token_to_kv_pool_allocator.get_kvcache()).full.layout
    pages = {rid: torch.div(s[::PAGE], PAGE, rounding_mode="floor").tolist() for rid, s in slots.items()}
    rows = {rid: per_view_save(full, p, torch.empty((len(p), full.page_bytes), dtype=torch.uint8))
            for rid, p in pages.items()}
    return a, b, whole, before, store, rows


KINDS = [pytest.param(True, "write_through", id="swa-write_through"), pytest.param(True, "write_back", id="swa-write_back"),
         pytest.param(False, "write_through", id="full-write_through"), pytest.param(False, "write_back", id="full-write_back")]


@pytest.mark.parametrize("hybrid_swa, policy", KINDS)
def test_beside_hicache_a_retraction_parks_only_the_tail_hicache_lacks_and_restores_it_after_hicaches_load_back(
    hybrid_swa, policy, records
):
    boot.install({"DSV41_KV_PARK": "ram", "DSV41_KV_PARK_GIB": "4", "DSV41_DEBUG_LOG": "1"})
    h = _build(HiCache(ratio=2.0, write_policy=policy), hybrid_swa=hybrid_swa)
    tree = h.scheduler.tree_cache
    a, b, whole, before, store, rows = _retracted_pair(h)
    host_total = _host_total(tree)
    assert {"r1", "r2"} <= set(store.ready_keys()), "the retracted rows were not parked beside HiCache"
    for r in (a, b):
        entry = store._entries[r.rid]
        parked_from = entry.meta["parked_from"]
        assert 0 < parked_from < whole[r.rid], f"{r.rid}: the prompt the tree holds was parked again"
        assert entry.pages == (whole[r.rid] - parked_from) // PAGE, f"{r.rid}: parked more than the tail"
        tail = rows[r.rid][parked_from // PAGE :]
        assert torch.equal(entry.bytes(), tail), f"{r.rid}: the parked rows are not the tail's bytes"
    # Parked bytes plus HiCache's own never exceed HiCache's host pool (the park pool is carved from it).
    assert _host_held(tree) <= host_total and store.used_bytes <= store.host_pool.capacity <= host_total // 2
    # The device tree loses every unlocked node (write-back: to host now); every free page is zeroed.
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    tree.evict(EvictParams(num_tokens=1 << 30))
    for r in (a, b):  # no page both parked and in HiCache's host pool: HiCache's part ends where the tail starts
        match = _tree_match(h, r, whole[r.rid])
        held = int(match.device_prefix_len) + int(match.host_hit_length)
        assert int(match.device_prefix_len) == 0 and held == store._entries[r.rid].meta["parked_from"], (r.rid, held)
    _zero_free_device_pages(h)
    step = h.step()
    assert step.kind == "prefill" and set(step.rids) == {"r1", "r2"}
    prefix = dict(zip(step.rids, step.prefix_lens, strict=True))
    lines = [rec.getMessage() for rec in records if "kv_park restored" in rec.getMessage()]
    assert len(lines) == 2 and all("cached=" in line for line in lines), lines
    for r in (a, b):
        assert prefix[r.rid] == whole[r.rid], f"{r.rid}: HiCache's part plus the parked tail were not found as a prefix"
        assert torch.equal(_full_bytes(h, r, whole[r.rid]), before[r.rid]), f"{r.rid}: other full-attention bytes"
    assert store.stats.restored >= 2 and store.stats.failed == 0 and not store.ready_keys()
    h.run_until(lambda: a.finished() and b.finished(), max_passes=1000)
    assert store.host_pool.used_bytes == 0, "pool rows held by no entry"


@pytest.mark.parametrize("hybrid_swa", [True, False], ids=["swa", "full"])
def test_beside_hicache_a_restore_whose_prefix_hicache_evicted_recomputes_with_one_reason_line(hybrid_swa, records):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    boot.install({"DSV41_KV_PARK": "ram", "DSV41_KV_PARK_GIB": "4", "DSV41_DEBUG_LOG": "1"})
    h = _build(HiCache(ratio=2.0, write_policy="write_back"), hybrid_swa=hybrid_swa)
    tree = h.scheduler.tree_cache
    a, b, whole, _, store, _ = _retracted_pair(h)
    tree.evict(EvictParams(num_tokens=1 << 30))  # the prefix goes to host (write-back) ...
    tree.evict_host(1 << 30)  # ... and HiCache evicts it from host too
    assert all(int(_tree_match(h, r, whole[r.rid]).host_hit_length) == 0 for r in (a, b))
    step = h.step()
    dropped = [rec.getMessage() for rec in records if "kv_park dropped" in rec.getMessage()]
    assert sum("reason=prefix_gone_from_hicache" in line for line in dropped) == 2, dropped
    assert step.kind == "prefill" and step.prefix_lens == (0,) * len(step.rids), "nothing may come from the tail alone"
    assert not store.ready_keys() and store.host_pool.used_bytes == 0, "the dropped tails still hold pool rows"
    h.run_until(lambda: a.finished() and b.finished(), max_passes=1000)
    assert len(a.output_ids) == 200 and len(b.output_ids) == 200, "a request lost its output"


def _swa_bytes(h, req, lo: int, hi: int) -> torch.Tensor:
    """The SWA pool's bytes of ``req``'s tokens ``[lo, hi)`` (through the Full-to-SWA slot mapping)."""
    alloc = h.scheduler.token_to_kv_pool_allocator
    swa = alloc.get_kvcache().swa_kv_pool
    full = h.scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, lo:hi].long()
    slots = alloc.full_to_swa_index_mapping[full].long()
    assert bool((slots > 0).all()), f"{req.rid}: tokens [{lo}, {hi}) have no SWA slots"
    return torch.cat([b[slots].view(torch.uint8).reshape(hi - lo, -1) for b in [*swa.k_buffer, *swa.v_buffer]], dim=1)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_beside_hicache_the_swa_window_parks_only_past_the_trees_part_and_the_tree_brings_the_rest_back(policy, records):
    """A window wider than the parked tail: the row's window pages below ``parked_from`` are the
    tree's own SWA pages (HiCache backs them up with the prefix), so only the window's tail is parked,
    and after HiCache's load-back the whole window reads as before the retraction, byte for byte."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    window = 64
    boot.install({"DSV41_KV_PARK": "ram", "DSV41_KV_PARK_GIB": "4", "DSV41_DEBUG_LOG": "1"})
    h = _build(HiCache(ratio=2.0, write_policy=policy), hybrid_swa=True, window=window)
    tree = h.scheduler.tree_cache
    a = h.add_request(100, max_new_tokens=200)
    b = h.add_request(70, max_new_tokens=200)
    _randomize(h)
    h.run(20)
    whole = {r.rid: (len(r.origin_input_ids) + len(r.output_ids) - 1) // PAGE * PAGE for r in (a, b)}
    alloc = h.scheduler.token_to_kv_pool_allocator
    live = {}  # the row's window: its first token with a SWA slot, page aligned
    for r in (a, b):
        slots = h.scheduler.req_to_token_pool.req_to_token[r.kv.req_pool_idx, : whole[r.rid]].long()
        dead = (alloc.full_to_swa_index_mapping[slots] == 0).nonzero()
        live[r.rid] = 0 if dead.numel() == 0 else (int(dead.max()) // PAGE + 1) * PAGE
    swa_before = {r.rid: _swa_bytes(h, r, live[r.rid], whole[r.rid]) for r in (a, b)}
    full_before = {r.rid: _full_bytes(h, r, whole[r.rid]) for r in (a, b)}
    h.retract_all()
    store = _park().STATE.store
    store.fence()
    host_total = _host_total(tree)
    for r in (a, b):
        entry, swa_entry = store._entries[r.rid], store._entries[(r.rid, "swa")]
        parked_from, swa_from = entry.meta["parked_from"], entry.meta["swa_from"]
        assert swa_from == live[r.rid] and swa_from < parked_from < whole[r.rid], (r.rid, swa_from, parked_from)
        assert entry.meta["swa_parked_from"] == parked_from
        assert swa_entry.pages == (whole[r.rid] - parked_from) // PAGE, f"{r.rid}: the tree's window pages were parked again"
    assert _host_held(tree) <= host_total and store.used_bytes <= store.host_pool.capacity <= host_total // 2
    tree.evict(EvictParams(num_tokens=1 << 30))  # the device tree loses every unlocked node (write-back: to host now)
    for r in (a, b):
        # HiCache's host part (Full and its SWA run) ends where both parked tails start: no page is
        # both parked and in HiCache's host pools.
        match = _tree_match(h, r, whole[r.rid])
        held = int(match.device_prefix_len) + int(match.host_hit_length)
        assert int(match.device_prefix_len) == 0 and held == store._entries[r.rid].meta["parked_from"], (r.rid, held)
        assert int(match.swa_host_hit_length) > 0 and int(match.full_kv_hit_length) == held, (r.rid, match)
    _zero_free_device_pages(h)
    step = h.step()
    assert step.kind == "prefill" and set(step.rids) == {"r1", "r2"}
    prefix = dict(zip(step.rids, step.prefix_lens, strict=True))
    for r in (a, b):
        assert prefix[r.rid] == whole[r.rid], f"{r.rid}: HiCache's part plus the parked tails were not found as a prefix"
        assert torch.equal(_full_bytes(h, r, whole[r.rid]), full_before[r.rid]), f"{r.rid}: other full-attention bytes"
        assert torch.equal(_swa_bytes(h, r, live[r.rid], whole[r.rid]), swa_before[r.rid]), f"{r.rid}: other SWA bytes"
    assert store.stats.restored >= 2 and store.stats.failed == 0 and not store.ready_keys()
    h.run_until(lambda: a.finished() and b.finished(), max_passes=1000)
    assert store.host_pool.used_bytes == 0, "pool rows held by no entry"


def _tree_full_bytes(h, tokens: list[int]) -> torch.Tensor:
    """The Full pool's bytes of the tree's device Full KV for ``tokens`` (no SWA validation)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tree = h.scheduler.tree_cache
    n, node, _ = tree.tree_core.match_full_device_prefix(RadixKey(token_ids=array("q", tokens)))
    assert n == len(tokens), f"the tree holds {n} of {len(tokens)} tokens' Full KV on the device"
    slots = tree.path_device_indices(node).long()[:n]
    kv = _full_pool(h)
    return torch.cat([b[slots].view(torch.uint8).reshape(n, -1) for b in [*kv.k_buffer, *kv.v_buffer]], dim=1)


def _same_prompt_further(h):
    """``x`` decodes 150 tokens and finishes (the tree keeps its Full KV; its window only at its end),
    then ``y``, with the same prompt, decodes 31 of the same tokens on other KV bytes."""
    x = h.add_request(100, max_new_tokens=150, seed=1)
    h.run(2)
    _randomize(h)
    h.run_until(x.finished, max_passes=400)
    y = h.add_request(100, max_new_tokens=200, seed=1)  # the same prompt; the kit decodes the same tokens
    h.run(2)
    _randomize(h, seed=1)  # the row's own KV differs from x's: a wrong source shows in the bytes
    h.run(29)
    whole = (len(y.origin_input_ids) + len(y.output_ids) - 1) // PAGE * PAGE
    match = _tree_match(h, y, whole)
    served = int(match.device_prefix_len) + int(match.host_hit_length)
    assert served < whole == int(match.full_kv_hit_length), ("the tree's Full KV must outrun what it serves", match)
    return y, whole, served


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_beside_hicache_full_kv_the_tree_holds_past_a_lost_window_is_not_parked_again_and_the_restore_uses_the_trees(
    policy, records
):
    """Another request with the same prompt decoded the same tokens further and finished: the tree
    holds their Full KV (write-through: in HiCache's host pool too), but its window there is gone, so
    ``match_prefix`` serves only the prompt. The retracted row parks no Full page of that stretch,
    only the window's SWA pages the tree lacks; the restore keeps the tree's Full pages."""
    boot.install({"DSV41_KV_PARK": "ram", "DSV41_KV_PARK_GIB": "4", "DSV41_DEBUG_LOG": "1"})
    h = _build(HiCache(ratio=2.0, write_policy=policy), hybrid_swa=True)
    y, whole, served = _same_prompt_further(h)
    tokens = (y.origin_input_ids + y.output_ids)[:whole]
    slots = h.scheduler.req_to_token_pool.req_to_token[y.kv.req_pool_idx, :whole].long()
    dead = (h.scheduler.token_to_kv_pool_allocator.full_to_swa_index_mapping[slots] == 0).nonzero()
    live = 0 if dead.numel() == 0 else (int(dead.max()) // PAGE + 1) * PAGE
    full_before = _tree_full_bytes(h, tokens)  # the tree's bytes: the prompt (shared with y) and x's stretch
    swa_before = _swa_bytes(h, y, live, whole)  # y's own window
    h.retract_all()
    store = _park().STATE.store
    store.fence()
    entry, swa_entry = store._entries[y.rid], store._entries[(y.rid, "swa")]
    assert entry.meta["tree_from"] == served and entry.meta["parked_from"] == whole, entry.meta
    assert entry.pages == 0, "Full KV the tree holds (HiCache's host pool too) was parked again"
    assert swa_entry.pages == (whole - max(live, served)) // PAGE, "the window's SWA pages the tree lacks were not parked"
    _zero_free_device_pages(h)
    step = h.step()
    assert step.kind == "prefill" and step.rids == (y.rid,)
    dropped = [rec.getMessage() for rec in records if "kv_park dropped" in rec.getMessage()]
    assert step.prefix_lens == (whole,), (step.prefix_lens, dropped)
    assert torch.equal(_full_bytes(h, y, whole), full_before), "other Full bytes than the tree's"
    assert torch.equal(_swa_bytes(h, y, live, whole), swa_before), "other SWA bytes than the row's window"
    assert store.stats.restored >= 1 and store.stats.failed == 0 and not store.ready_keys()
    h.run_until(y.finished, max_passes=1000)
    assert len(y.output_ids) == 200 and store.host_pool.used_bytes == 0


@pytest.mark.parametrize("when", ["at_park", "before_restore"])
def test_beside_hicache_full_kv_past_a_lost_window_that_is_on_host_only_is_never_parked_and_the_request_recomputes(
    when, records
):
    """HiCache holds that Full KV on host only: SGLang 0.5.23's load-back cannot bring back a node
    whose window is gone on both tiers (pinned below), so it is not parked (nothing held twice);
    the request recomputes from the prefix the tree serves, with one ``dropped`` line."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    boot.install({"DSV41_KV_PARK": "ram", "DSV41_KV_PARK_GIB": "4", "DSV41_DEBUG_LOG": "1"})
    h = _build(HiCache(ratio=2.0, write_policy="write_through"), hybrid_swa=True)
    y, whole, served = _same_prompt_further(h)
    tree = h.scheduler.tree_cache
    if when == "at_park":
        tree.evict(EvictParams(num_tokens=1 << 30))  # x's stretch goes to host only (y locks its prompt)
    h.retract_all()
    store = _park().STATE.store
    store.fence()
    if when == "before_restore":
        assert store._entries[y.rid].pages == 0
        tree.evict(EvictParams(num_tokens=1 << 30))
    assert int(_tree_match(h, y, whole).full_kv_hit_length) == whole, "HiCache lost the stretch: not this case"
    step = h.step()
    reason = {"at_park": "window_lost_full_kv_on_host", "before_restore": "window_gap_left_the_device"}[when]
    # At the park a row not parked says why (``not_parked``); at the restore an entry dropped does.
    dropped = [rec.getMessage() for rec in records if "kv_park dropped" in rec.getMessage() or "kv_park not_parked" in rec.getMessage()]
    assert sum(f"reason={reason}" in line for line in dropped) == 1, dropped
    assert step.kind == "prefill" and step.rids == (y.rid,) and step.prefix_lens[0] <= served
    assert not store.ready_keys() and store.host_pool.used_bytes == 0
    h.run_until(y.finished, max_passes=1000)
    assert len(y.output_ids) == 200, "the request lost its output"


def test_sglang_hicache_cannot_load_back_full_kv_whose_window_is_gone_on_both_tiers():
    """Why kv_park does not leave such Full KV to HiCache when it is on host only: the tree's own
    load-back of that node fails in SGLang 0.5.23 (its SWA traversal finds no window on either tier)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h = _build(HiCache(ratio=2.0, write_policy="write_through"), hybrid_swa=True)
    y, whole, _ = _same_prompt_further(h)
    tree = h.scheduler.tree_cache
    tree.evict(EvictParams(num_tokens=1 << 30))
    match = _tree_match(h, y, whole)
    assert int(match.full_kv_hit_length) == whole and match.last_visited_node_id is not None
    with pytest.raises(AssertionError, match=r"SWA load-back traversal reached node \d+ without a device or host value"):
        tree.load_back(match.last_visited_node_id, req=y)


def test_beside_hicache_a_window_run_the_tree_holds_past_what_it_serves_is_never_parked_again(records):
    """Past what it serves the tree holds the SWA KV of the last page of that stretch (a run shorter
    than the window, attached the way SGLang's buffer-mode load-back attaches a window to a Full-only
    span): parking the stretch's window would hold that page twice, so the row parks nothing and
    recomputes from what the tree serves (one ``not_parked reason=window_partly_in_the_tree`` line)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    boot.install({"DSV41_KV_PARK": "ram", "DSV41_KV_PARK_GIB": "4", "DSV41_DEBUG_LOG": "1"})
    h = _build(HiCache(ratio=2.0, write_policy="write_through"), hybrid_swa=True)
    y, whole, served = _same_prompt_further(h)
    tree, alloc = h.scheduler.tree_cache, h.scheduler.token_to_kv_pool_allocator
    key = RadixKey(token_ids=(y.origin_input_ids + y.output_ids)[:whole])
    _, node, _ = tree.tree_core.match_full_device_prefix(key)
    full = tree.path_device_indices(node).long()[whole - PAGE : whole]
    swa = alloc.swa_attn_allocator.alloc(PAGE)
    for action in tree.tree_core.attach_swa_window(key, whole - PAGE, whole, swa, component_type=ComponentType.SWA):
        tree._apply_cache_action(action)
    alloc.full_to_swa_index_mapping[full] = swa.to(alloc.full_to_swa_index_mapping.dtype)
    match = _tree_match(h, y, whole)
    assert int(match.device_prefix_len) + int(match.host_hit_length) == served < whole == int(match.full_kv_hit_length)
    h.retract_all()
    store = _park().STATE.store
    store.fence()
    dropped = [rec.getMessage() for rec in records if "kv_park not_parked" in rec.getMessage()]
    assert sum("reason=window_partly_in_the_tree" in line for line in dropped) == 1, dropped
    assert not store.ready_keys() and store.host_pool.used_bytes == 0
    step = h.step()
    assert step.kind == "prefill" and step.rids == (y.rid,) and step.prefix_lens[0] <= served
    h.run_until(y.finished, max_passes=1000)
    assert len(y.output_ids) == 200
