"""The restore: at each scheduler pass, a parked request that waits for admission gets pages, its
bytes and the tree's part of its prefix, inserted under its tokens and pinned until admission; a
request the tree held in full gets its pages pinned. Every entry not restored: one line.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass
from typing import Any

import torch

from adapter.core import api
from adapter.switches.kv_park.engine import CopyEngine
from adapter.switches.kv_park.state import _Engines, _recorded_on, _State, kv_streams
from adapter.switches.kv_park.store import SWITCH, ParkStore
from adapter.switches.kv_park.tree import _full_on_device, _pin, _running_need


def restore_pages(state: _State, copies: list[tuple[Any, CopyEngine, torch.Tensor, int]]) -> None:
    """Take each ``(key, engine, page ids, first entry row)`` entry out of the store and write it into
    its pages.

    On CUDA nothing here waits on the host: the copies follow the work already queued on the KV
    streams (a forward still in flight may touch pages just handed out: a row that finished last
    step) and the park's own copy into the rows (an entry whose save is still in flight:
    its ``written`` event), and those streams then wait for the copies, so the forward that reads
    the pages, and HiCache's write-back (its device-to-host stream follows the forward stream), see
    the restored bytes. Each entry's pool rows go back to the pool once its copy has read them. A
    failed copy waits out what was queued and raises (the caller frees the pages)."""
    store = state.store
    device = copies[0][1].device
    streams = kv_streams(state, device) if device.type == "cuda" else []
    after = _recorded_on(streams)
    fence: list[Any] = []  # CUDA events of the copies queued from pinned pool rows
    try:
        for key, engine, pages, first in copies:
            entry = store.take(key)
            if entry is None:
                raise LookupError(f"the parked entry {key!r} is gone")
            done: list[Any] = []
            follow = [*after, entry.written] if streams and entry.written is not None else after
            try:
                engine.restore(entry.rows, pages, first=first, fence=done, after=follow or None)
            finally:
                store.release(entry, after=done[0] if done else None)
            fence += done
    except BaseException:
        for event in fence:
            event.synchronize()
        raise
    for stream in streams:
        for event in fence:
            stream.wait_event(event)


def _resume_from_tree(state: _State, scheduler: Any) -> None:
    """Retractions the tree held in full: at the re-admission pass, pin the tree's pages until the
    admission takes them (``resumed_from_tree``), or say they are gone (``dropped reason=
    prefix_gone_from_the_tree``: the request recomputes, as stock)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    waiting = {r.rid: r for r in scheduler.waiting_queue if r.rid in state.tree_held}
    for rid in [rid for rid in state.tree_held if rid not in waiting]:
        del state.tree_held[rid]  # admitted another way, aborted or finished
    tree = scheduler.tree_cache
    for rid, req in waiting.items():
        tokens = state.tree_held.pop(rid)
        key = RadixKey(token_ids=tokens, extra_key=req.extra_key, cache_salt=req.cache_salt)
        match = tree.match_prefix(MatchPrefixParams(key=key))
        have = int(match.device_prefix_len)
        if have >= len(tokens):
            _pin(state, rid, tree, match.last_device_node)
            SWITCH.event("resumed_from_tree", level=logging.DEBUG, rid=rid, tokens=have)
        else:
            SWITCH.event("dropped", level=logging.DEBUG, rid=rid, reason="prefix_gone_from_the_tree",
                         servable=len(tokens), cached=have)


def _restore_waiting(state: _State, scheduler: Any) -> None:
    store = state.store
    if state.tree_held:
        _resume_from_tree(state, scheduler)
    if store.disabled or (not store.ready_keys() and not store.pending()):
        return
    waiting = [r for r in scheduler.waiting_queue if r.rid in store]
    waiting_rids = {r.rid for r in waiting}
    for key in store.ready_keys():
        if (key[0] if isinstance(key, tuple) else key) not in waiting_rids:
            if isinstance(key, tuple):
                store.discard(key)
            else:  # admitted another way, aborted or finished: the entry is stale
                _drop(store, key, "not_waiting")
    if not waiting:
        return
    # No fence: a restore's copy is queued after the work on the KV streams, which already wait
    # for every park copy's reads (save_pages), and after its own entry's save (restore_pages).
    for i, req in enumerate(waiting):
        if not _restore_one(state, scheduler, req, may_evict=(i == 0)):
            break


def _small_on(device: torch.device, value: int) -> torch.Tensor:
    """``[value]`` as int64 on ``device``; on CUDA through pinned memory, so the host does not wait
    for the stream (a copy from pageable memory would)."""
    host = torch.tensor([value], dtype=torch.int64)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


def _drop(store: ParkStore, rid: Any, reason: str, **params: object) -> bool:
    """Forget a parked entry (the request recomputes); one DEBUG line ``kv_park dropped reason=...``."""
    store.discard(rid)
    store.discard((rid, "swa"))
    SWITCH.event("dropped", level=logging.DEBUG, rid=rid, reason=reason, **params)
    return True


def _load_back(tree: Any, req: Any, match: Any, upto: int) -> str | None:
    """Bring the tree's host-only part of ``req``'s prefix (at least ``upto`` tokens with the device
    part) to the device through HiCache's own load-back (``init_load_back``, what the admission
    calls: its locks, its eviction for room, its one batch of host-to-device copies, which the next
    prefill batch starts and its forward waits for). None on success, else why it cannot."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    host = int(getattr(match, "host_hit_length", 0) or 0)
    if int(match.device_prefix_len) + host < upto:
        return "prefix_gone_from_hicache"  # HiCache evicted part of it from both tiers
    # init_load_back reads the request's last match; the admission's own match sets them again.
    req.last_node = match.last_device_node
    req.swa_host_hit_length = int(getattr(match, "swa_host_hit_length", 0) or 0)
    req.mamba_host_hit_length = int(getattr(match, "mamba_host_hit_length", 0) or 0)
    loaded = tree.init_load_back(InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=host, req=req))
    if loaded is None or int(loaded[0]) == 0:
        return "load_back_refused"  # no device room, under HiCache's threshold, or pinned by another load
    return None


@dataclass
class _Restore:
    """One parked request's restore, as its phases learn it."""

    req: Any
    entry: Any
    engines: _Engines
    page_size: int
    n: int  # servable tokens: whole pages before the request's last token
    key: Any  # the RadixKey of tokens[:n]
    swa_from: int | None  # the first token of the parked SWA window (None: no SWA side)
    parked_from: int  # below it, the tree's Full KV (not parked)
    tree_from: int  # below it, all the tree's (Full and SWA)
    match: Any = None  # the tree's match of ``key`` once its part is on the device
    have: int = 0  # tokens of ``key`` the tree holds on the device
    gap_lock: Any = None  # the tree's Full KV past what it serves, locked (Full only)


def _restore_one(state: _State, scheduler: Any, req: Any, *, may_evict: bool) -> bool:
    """Restore one parked request into the tree; False when there is no room (try next pass).

    Phases, one named step each: the entry checked against the request (:func:`_checked_entry`),
    the tree's part of the prefix brought to the device (:func:`_tree_part_on_device`), the pages
    allocated (:func:`_allocated`), the parked bytes written and inserted (:func:`_written_and_inserted`)."""
    r = _checked_entry(state, scheduler, req)
    if r is None:
        return True  # dropped
    tree = scheduler.tree_cache
    if not _tree_part_on_device(state, tree, r):
        return True  # dropped
    if r.have >= r.n:
        # Nothing to copy, but the same hazard as a restore: keep the tree's pages until admission.
        _pin(state, req.rid, tree, r.match.last_device_node)
        return _drop(state.store, req.rid, "tree_holds_it", servable=r.n, cached=r.have)
    lock = tree.lock(r.match.last_device_node)  # the matched prefix must survive our eviction
    try:
        allocated = _allocated(scheduler, r, may_evict=may_evict)
        if allocated is None:
            return False
        pages = _written_and_inserted(state, scheduler, r, *allocated)
    finally:
        tree.unlock(lock)
        if r.gap_lock is not None:
            tree.unlock(r.gap_lock)
    if SWITCH.debug or api.metrics_on():  # the line and the metrics: skip the sums when nothing reads them
        SWITCH.event("restored", level=logging.DEBUG, rid=req.rid, pages=pages.numel(), tokens=r.n, cached=r.have,
                     held=state.store.used_bytes + state.store.reserved_bytes)
    return True


def _checked_entry(state: _State, scheduler: Any, req: Any) -> _Restore | None:
    """Phase 1: the parked entry still fits the request and the pool (None: dropped, one line)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    store = state.store
    entry = store.peek(req.rid)
    if entry is None:
        _drop(store, req.rid, "no_entry")
        return None
    allocator = scheduler.token_to_kv_pool_allocator
    page_size = int(allocator.page_size)
    pool = allocator.get_kvcache()
    engines = state.engines_for(pool)
    tokens: array = entry.meta["tokens"]
    swa_from = entry.meta["swa_from"]
    swa_entry = store.peek((req.rid, "swa")) if swa_from is not None else None
    if (
        engines is None
        or entry.meta["page_size"] != page_size
        or entry.meta["pool"] != id(pool)
        or (swa_from is not None and (swa_entry is None or engines.swa is None))
    ):
        _drop(store, req.rid, "pool_changed_or_swa_entry_missing")
        return None
    fill = req.origin_input_ids + req.output_ids
    n = min(len(tokens), req._compute_max_prefix_len(len(fill))) // page_size * page_size
    if n == 0:
        _drop(store, req.rid, "no_whole_page_before_the_last_token", parked=len(tokens), fill=len(fill))
        return None
    if tokens[:n] != fill[:n]:
        _drop(store, req.rid, "other_tokens", parked=len(tokens), fill=len(fill))
        return None
    if swa_from is not None and n <= swa_from:
        # The servable prefix (whole pages before the last token) ends where the parked window
        # starts: its extend would need SWA KV below swa_from, which was gone at retraction.
        _drop(store, req.rid, "window_below_the_servable_prefix", servable=n, swa_from=swa_from, fill=len(fill))
        return None
    parked_from = min(int(entry.meta.get("parked_from", 0)), n)
    return _Restore(
        req, entry, engines, page_size, n,
        RadixKey(token_ids=tokens[:n], extra_key=req.extra_key, cache_salt=req.cache_salt),
        swa_from, parked_from, min(int(entry.meta.get("tree_from", parked_from)), parked_from),
    )


def _tree_part_on_device(state: _State, tree: Any, r: _Restore) -> bool:
    """Phase 2: the tree's part of the prefix (below ``parked_from``) on the device: matched, brought
    back from host through HiCache, its Full KV past a lost window locked. False: dropped."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    store, req = state.store, r.req
    r.match = tree.match_prefix(MatchPrefixParams(key=r.key))
    r.have = int(r.match.device_prefix_len)
    if r.have < r.tree_from and not state.beside_hicache:
        # The tree's part of the prefix (not parked: the tree held it at retraction) was evicted.
        _drop(store, req.rid, "prefix_gone_from_the_tree", servable=r.n, parked_from=r.parked_from, cached=r.have)
        return False
    if r.have < r.tree_from:
        # The tree's part is on host only: HiCache's own load-back brings it to the device first.
        why = _load_back(tree, req, r.match, r.tree_from)
        if why is None:
            r.match = tree.match_prefix(MatchPrefixParams(key=r.key))
            r.have = int(r.match.device_prefix_len)
            why = None if r.have >= r.tree_from else "load_back_short"
        if why is not None:
            _drop(store, req.rid, why, servable=r.n, parked_from=r.parked_from, cached=r.have,
                  host=int(getattr(r.match, "host_hit_length", 0) or 0))
            return False
    if r.have < r.parked_from:
        # The tree's Full KV past the prefix it can serve (its window was evicted), not parked: it
        # must still be on the device (HiCache cannot load it back without a window); locked, Full
        # only. The insert keeps the tree's pages and takes the window's SWA from the entry.
        gap_node = _full_on_device(tree, req, r.key.token_ids[: r.parked_from])
        if gap_node is None:
            _drop(store, req.rid, "window_gap_left_the_device", servable=r.n, parked_from=r.parked_from, cached=r.have)
            return False
        r.gap_lock = tree.lock(gap_node, skip_lock_components=(ComponentType.SWA,))
    return True


def _allocated(scheduler: Any, r: _Restore, *, may_evict: bool) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """Phase 3: pages for the tokens past the tree's (Full for the span, SWA for the parked window
    only): ``(slots, the tree's prefix slots, first token with SWA)``; None: no room this pass."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    tree, allocator = scheduler.tree_cache, scheduler.token_to_kv_pool_allocator
    have, n, page_size, swa_from = r.have, r.n, r.page_size, r.swa_from
    need = n - have
    # Room for the restore and for the running rows' next decode step beside it: the restored
    # pages stay pinned until the request is admitted, so they must not starve the running rows.
    room = need + _running_need(scheduler)
    if allocator.available_size() < room:
        if not may_evict:
            return None
        evict_from_tree_cache(tree, room)
    if allocator.available_size() < room:
        return None
    prefix = tree.path_device_indices(r.match.last_device_node).to(torch.int64)[:have]
    tail_from = have
    if swa_from is None:
        slots = allocator.alloc(need)
    elif page_size == 1:
        tail_from = max(swa_from, have)
        slots = allocator.alloc(need)  # full and SWA slots for every token
        if slots is not None and tail_from > have:
            allocator.free_swa(slots[: tail_from - have])  # keep SWA for the window only
    else:
        # Full KV for the whole span, SWA slots only for the window part we parked.
        tail_from = max(swa_from, have)
        dev = prefix.device
        slots = allocator.alloc_extend_swa_tail(
            _small_on(dev, have),
            torch.tensor([have]),
            _small_on(dev, n),
            torch.tensor([n]),
            prefix[-1:] if have else _small_on(dev, -1),
            need,
            n - tail_from,
        )
    if slots is None:
        return None
    return slots.to(torch.int64), prefix, tail_from


def _written_and_inserted(state: _State, scheduler: Any, r: _Restore, slots: torch.Tensor, prefix: torch.Tensor,
                          tail_from: int) -> torch.Tensor:
    """Phase 4: the parked bytes written into the pages (:func:`restore_pages`), the pages inserted
    under the request's tokens and pinned until its admission; the Full page ids written."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    tree, allocator = scheduler.tree_cache, scheduler.token_to_kv_pool_allocator
    rid, page_size, have = r.req.rid, r.page_size, r.have
    try:
        pages = torch.div(slots[::page_size], page_size, rounding_mode="floor")
        params = InsertParams(key=r.key, value=torch.cat([prefix, slots]), prev_prefix_len=have)
        # Full pages below parked_from are the tree's (the insert frees these duplicates).
        skip = max(0, r.parked_from - have) // page_size
        copies = [(rid, r.engines.full, pages[skip:], max(0, have - r.parked_from) // page_size)]
        if r.swa_from is not None:
            assert r.engines.swa is not None
            swa_slots = allocator.full_to_swa_index_mapping[slots[tail_from - have :]].to(torch.int64)
            swa_pages = torch.div(swa_slots[::page_size], page_size, rounding_mode="floor")
            swa_parked_from = int(r.entry.meta.get("swa_parked_from", r.swa_from))  # below it, the tree's SWA pages
            copies.append(((rid, "swa"), r.engines.swa, swa_pages, (tail_from - swa_parked_from) // page_size))
            params.set_evicted_seqlen(ComponentType.SWA, tail_from)  # no SWA KV below the window we had
        restore_pages(state, copies)
    except BaseException:
        allocator.free(slots)  # neither in the tree nor owned by a request: give them back
        raise
    tree.insert(params)
    # Until the admission takes them as the request's prefix, running rows' decode could evict
    # the restored pages (pool-full retractions wait for them to finish): pin them.
    inserted = tree.match_prefix(MatchPrefixParams(key=r.key))
    if int(inserted.device_prefix_len) == r.n:
        _pin(state, rid, tree, inserted.last_device_node)
    return pages
