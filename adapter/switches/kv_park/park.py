"""The park: what a retraction frees and a re-admission can be served, past what the tree holds,
offered to the store (queued on the device on CUDA); one log line per retraction.
"""

from __future__ import annotations

import logging
from array import array
from typing import Any

import torch

from adapter.core import api
from adapter.switches.kv_park.state import _Engines, _recorded_on, _State, kv_streams
from adapter.switches.kv_park.store import SWITCH
from adapter.switches.kv_park.tree import _full_on_device, _held_by_tree, _tree_holds_swa


def _why_not_parkable(state: _State, req: Any, tree_cache: Any, allocator: Any) -> str | None:
    """Why this release is not parked (None: it may be). An abort (``req.finished()``) is not a
    retraction: "" (nothing to log)."""
    from sglang.srt.runtime_context import get_disagg, get_spec

    if req.finished() or not req.kv.holds_kv:
        return ""
    if state.store.disabled:
        return "parking_disabled"
    if get_disagg().disaggregation_mode == "decode":
        return "pd_decode_keeps_its_own_backup"
    if req.multimodal_inputs is not None:
        return "multimodal"  # the tree key would need the multimodal hashes
    if get_spec().speculative_algorithm is not None:
        # A draft model keeps its own KV (and DSV4 MTP its own pool): parking only the target's
        # would resume the draft on stale pages. Recompute, as stock does.
        state.once("unsupported", reason="speculative_decoding_draft_kv_not_parked")
        return "speculative_decoding"
    if getattr(tree_cache, "disable", True) or not tree_cache.supports_prefix_sharing():
        state.once("unsupported", tree=type(tree_cache).__name__, reason="no_prefix_sharing")
        return "no_prefix_sharing"
    if tree_cache.supports_mamba() or tree_cache.tree_core.is_eagle:
        state.once("unsupported", tree=type(tree_cache).__name__, reason="mamba_or_bigram_tree")
        return "mamba_or_bigram_tree"
    if tree_cache.supports_swa() and (
        getattr(allocator, "full_to_swa_index_mapping", None) is None or getattr(allocator, "swa_req_ring", False)
    ):
        state.once("unsupported", allocator=type(allocator).__name__, reason="swa_without_a_paged_swa_mapping")
        return "swa_without_a_paged_swa_mapping"
    return None


def _not_parked(req: Any, reason: str, **params: object) -> None:
    """One DEBUG line per retraction kv_park does not park, with why (the soak's split reads them)."""
    SWITCH.event("not_parked", level=logging.DEBUG, rid=req.rid, reason=reason, **params)


def _whole_pages(slots: torch.Tensor, page_size: int) -> torch.Tensor | None:
    """Page ids of ``slots`` when they are whole pages in order, else None. Checked on host slots
    only: on a device, reading the answer back would synchronize the scheduler's stream, and
    SGLang's paged allocators hand a request whole pages in order by construction
    (``PagedTokenToKVPoolAllocator``: "the indices handed to one request are always page-aligned")."""
    pages = torch.div(slots[::page_size], page_size, rounding_mode="floor")
    if slots.device.type != "cpu":
        return pages
    expected = pages.repeat_interleave(page_size) * page_size + torch.arange(slots.numel(), device=slots.device) % page_size
    return pages if torch.equal(slots, expected) else None


def _park(state: _State, req: Any, req_to_token_pool: Any, allocator: Any, tree_cache: Any) -> None:
    """Park what this retraction frees and a re-admission can be served: the row's whole pages
    before its last token, past what the tree holds (the tree keeps those pages, unlocked: parking
    them too would copy what the re-admission finds in the tree anyway). Every retraction logs one
    DEBUG line: ``parked`` or ``not_parked reason=..``."""
    why = _why_not_parkable(state, req, tree_cache, allocator)
    if why is not None:
        if why:
            _not_parked(req, why)
        return
    pool = allocator.get_kvcache()
    engines = state.engines_for(pool)
    if engines is None or (engines.swa is None) != (not tree_cache.supports_swa()):
        _not_parked(req, "pool_without_a_page_layout")
        return
    page_size = int(allocator.page_size)
    fill = req.origin_input_ids + req.output_ids
    tokens = fill[: int(req.kv.kv_committed_len)]
    # Only what a re-admission can be served: whole pages (the tree takes no partial page) before
    # its last token (``_compute_max_prefix_len``: the extend needs one token for the logits).
    # Under the overlap loop a retracted row's fill ends at ``kv_committed_len`` (the in-flight
    # token is dropped), so at a page boundary the row's last page is never servable.
    n = min(len(tokens), req._compute_max_prefix_len(len(fill))) // page_size * page_size
    if n == 0:
        _not_parked(req, "no_whole_page_before_the_last_token", committed=len(tokens))
        return
    # What the tree holds of the row (device, or host through HiCache): ``tree_from``, the prefix it
    # can serve (a SWA run of at least the window ends there); ``parked_from``, where its Full KV
    # ends, which may be further (another request's identical continuation whose window was
    # evicted). The retraction leaves the tree's pages in the tree; only the tail past them is
    # parked, and a re-admission finds the rest in the tree (nothing is held twice; beside HiCache
    # the restore brings a host-only part back through HiCache).
    tree_from, parked_from = _held_by_tree(tree_cache, req, tokens[:n], page_size)
    if tree_from >= n:
        # Nothing this retraction frees is servable: the re-admission's match finds it all in the
        # tree. Its pages are pinned at the re-admission pass (``resumed_from_tree``), as a restore's.
        state.tree_held[req.rid] = array("q", tokens[:n])
        _not_parked(req, "tree_holds_it", servable=n)
        return
    slots = req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
    pages = _whole_pages(slots, page_size)
    if pages is None:
        state.once("unsupported", reason="request_slots_are_not_whole_pages")
        _not_parked(req, "request_slots_are_not_whole_pages")
        return
    swa_from, swa_pages = None, None
    if engines.swa is not None:
        # Only the window still has SWA slots (0 = none): park the whole pages from the first
        # page after the last dead slot.
        swa_slots = allocator.full_to_swa_index_mapping[slots].to(torch.int64)
        # The one read-back of a park (SWA pools only): where the window starts is data on the device.
        positions = torch.arange(swa_slots.numel(), device=swa_slots.device)
        last_dead = int(torch.where(swa_slots == 0, positions, -1).max())
        swa_from = 0 if last_dead < 0 else (last_dead // page_size + 1) * page_size
        if swa_from >= n:
            # No whole window page below the servable prefix: its extend would need SWA KV that
            # decode already freed (pages wider than the window: on DeepSeek-V4's 256-token pages
            # and 128-token window, any retraction more than about 128 tokens past a page boundary).
            _not_parked(req, "window_below_the_servable_prefix", servable=n, swa_from=swa_from, committed=len(tokens))
            return
        swa_pages = _whole_pages(swa_slots[swa_from:], page_size)
        if swa_pages is None:
            state.once("unsupported", reason="swa_slots_are_not_whole_pages")
            _not_parked(req, "swa_slots_are_not_whole_pages")
            return
    swa_parked_from = swa_from  # the first token of the parked SWA pages
    if parked_from > tree_from and _full_on_device(tree_cache, req, tokens[:parked_from]) is None:
        # Part of that Full KV is on host only (HiCache), and HiCache's load-back cannot bring back
        # a node whose window is gone on both tiers (SGLang 0.5.23's SWA load-back asserts):
        # parking it would hold it twice, parking past it is useless. Recompute, as stock.
        _not_parked(req, "window_lost_full_kv_on_host", servable=n, served=tree_from, full=parked_from)
        return
    if (parked_from > tree_from and swa_from is not None
            and _tree_holds_swa(tree_cache, req, tokens, max(swa_from, tree_from), parked_from, page_size)):
        # Past what it serves the tree still holds some of the window's SWA pages (a run shorter
        # than the window, on the device or in HiCache's host pool): parking them would hold
        # them twice, and a host-only one cannot come back without a window. Recompute.
        _not_parked(req, "window_partly_in_the_tree", servable=n, served=tree_from, full=parked_from)
        return
    pages = pages[parked_from // page_size :]
    if swa_pages is not None and swa_from is not None and tree_from > swa_from:
        # The window's pages below tree_from are the tree's own SWA pages (the row shares the
        # tree's slots there): the match that counted them validated a SWA run of at least the
        # window ending at tree_from (beside HiCache its load-back brings it back with the Full KV).
        swa_pages = swa_pages[(tree_from - swa_from) // page_size :]
        swa_parked_from = tree_from
    meta = {"tokens": array("q", tokens[:n]), "page_size": page_size, "pool": id(pool), "swa_from": swa_from,
            "parked_from": parked_from, "swa_parked_from": swa_parked_from, "tree_from": tree_from}
    outcome = save_pages(state, req.rid, engines, pages, swa_pages, meta)
    if SWITCH.debug or api.metrics_on():  # the line and the metrics: skip the sums when nothing reads them
        nbytes = 0 if outcome.startswith("refused") else pages.numel() * engines.full.page_bytes + (
            0 if swa_pages is None or engines.swa is None else swa_pages.numel() * engines.swa.page_bytes)
        SWITCH.event("parked", level=logging.DEBUG, rid=req.rid, pages=pages.numel(), outcome=outcome.split(":")[0],
                     bytes=nbytes, held=state.store.used_bytes + state.store.reserved_bytes, tree=tree_from)


def save_pages(
    state: _State, rid: Any, engines: _Engines, pages: torch.Tensor, swa_pages: torch.Tensor | None, meta: dict[str, Any]
) -> str:
    """Offer a retracted row's pages (and its SWA window pages) to the store; the store's outcome.

    On CUDA the scheduler thread waits neither for the forward that wrote the pages nor for the
    copy: the copy is queued on the copy engine's stream after events recorded now on the KV
    streams (:func:`kv_streams`), and the KV streams then wait, on the device, for the event after
    which the copy has read the pages (``pages_read``). The pages are freed at once: whatever
    writes them next (a forward, a restore, HiCache's load-back, which follows the forward
    stream) is queued on those streams after that event. On a CPU pool the copy runs here."""
    cuda = engines.full.device.type == "cuda"
    streams = kv_streams(state, engines.full.device) if cuda else []
    after = _recorded_on(streams) or None
    read: list[Any] = []
    outcome = state.store.offer(rid, engines.full, pages, meta=meta, after=after, read=read)
    if swa_pages is not None and not outcome.startswith("refused"):
        assert engines.swa is not None
        swa_outcome = state.store.offer(
            (rid, "swa"), engines.swa, swa_pages, meta={"swa_from": meta["swa_from"]}, after=after, read=read
        )
        if swa_outcome.startswith("refused"):
            state.store.discard(rid)  # the full pages alone cannot be restored
            outcome = swa_outcome
    for stream in streams:
        for event in read:
            stream.wait_event(event)
    return outcome
