"""``DSV41_KV_PARK=ram``: a retracted request's KV is parked in host RAM and restored on re-admission.

What it changes
    SGLang 0.5.23 frees a retracted decode row's KV and prefills the whole context again when
    the request is re-admitted (for DeepSeek-V4 there is no copy at all; for other models only
    the PD-decode ``cpu_tensor`` backend copies, per layer and per view into fresh pinned
    tensors). With this switch, ``release_req`` (the retraction path of ``retract_decode`` and
    ``pause_generation(mode="retract")``) first parks the pages the retraction frees with the
    page-major copy engine (:mod:`adapter.switches.kv_park.engine`) into the host store
    (:mod:`adapter.switches.kv_park.store`), then frees them as before. Priority preemption in
    ``PrefillAdder`` goes through the same function and parks too. At the start of each scheduler
    pass (``get_next_batch_to_run``), a parked request that waits for admission gets fresh pages,
    its bytes are restored into them, and they are inserted into the radix tree under the
    request's own tokens, so the stock admission finds them as a cached prefix and prefills only
    the tokens past it (usually the one token whose KV was never computed). Only what a
    re-admission can be served is parked (whole pages before the row's last token: under the
    overlap loop a retracted row's fill ends at its KV, so a page-boundary retraction's last page
    is never servable), and only past what the tree holds of the row: its prompt (cached at the
    prefill) stays in the tree, unlocked, and a re-admission finds it there; parking it too was a
    copy the re-admission never used (on the DeepSeek-V4 kit's soak every parked row found the tree
    holding it all). When the tree holds the whole servable prefix nothing is parked
    (``not_parked reason=tree_holds_it``); when it lost its part by the re-admission, the parked
    tail cannot be served and the request recomputes, as stock (``dropped
    reason=prefix_gone_from_the_tree``). The restored pages (or, when the tree covers the prefix,
    the tree's: ``resumed_from_tree``) stay pinned by a tree lock until the request is admitted:
    after a pool-full retraction it waits for running rows to finish, and their decode would evict
    unlocked pages first. Pins are released when the request leaves the waiting queue, or as soon
    as the running rows' next decode step would not fit beside them (running rows come first, as
    in stock), and whenever no row runs (then nothing evicts them before the admission, and no pin
    can keep another request out of an idle engine). Every retraction logs one DEBUG line,
    ``kv_park parked`` or ``kv_park not_parked reason=...``, and every parked row not restored one
    ``kv_park dropped reason=...`` (:mod:`adapter.switches.kv_park.outcomes` counts them).

Copies in flight: ordered on the device, never waited for on the scheduler thread
    A retraction frees the row's pages at once (holding them until the copy lands would starve
    ``retract_decode``: it loops ``while not check_decode_mem(...)``, retracting one more row per
    iteration, and pages still held by a copy are neither free nor evictable). On CUDA the park
    queues its copy on the copy engine's stream from the scheduler thread and returns: the copy
    follows events recorded on the KV streams (the scheduler thread's current stream and the
    scheduler's forward stream, where the overlap loop runs the forward), and those streams then
    wait, on the device, for the event after which the copy has read the pages. In the scheduler
    process only a forward, a restore and HiCache's load-back (which follows the forward stream)
    write KV bytes into a freed page, and each is queued on those streams later, so none can
    overwrite a page before the copy has read it. A restore is queued after the work on those
    streams and after its own entry's save (the entry's ``written`` event: a request can come back
    while its park's copy is still in flight), and the KV streams wait for the restore before the
    forward that reads the pages. The store only *queries* events (``event.query()``) to know what
    is done and which pool rows are free again. The host reads nothing back on these paths, with
    one exception per park on a hybrid-SWA / DeepSeek-V4 pool: where the row's window starts is data
    on the device (its SWA mapping), one read-back of one integer. A park pool too full for an
    offer, with the rest of it still read or written by copies in flight, refuses the offer (the
    request recomputes) rather than wait. On a CPU pool the copy is the work itself and runs in the
    retraction (there is no device to overlap it with).

Host memory: the park pool (allocated once, at boot, before the first scheduler pass)
    On a CUDA KV pool, ``DSV41_KV_PARK_GIB`` of host RAM is allocated in 1 GiB chunks, each starting
    on a host page and page-locked once (``cudaHostRegister``; the ``kv_park pool ... pin_ms=..``
    line gives the time), and every entry is carved out of it page by page
    (:mod:`adapter.switches.kv_park.host_pool`); a full pool evicts least recently used entries as
    the byte budget does. A pool that cannot be allocated or locked fails the boot (``BootError``
    naming ``DSV41_KV_PARK_GIB``, the size, how far pinning got and the host limit). Saves and
    restores move device pages straight into and out of the pinned rows on the copy engine's
    streams (the link overlaps the gather / scatter of the next chunk): a save and a restore each
    return before their copy lands (the KV streams wait for its event); its pool
    rows go back to the pool only once that event is done. A CPU KV pool
    keeps pageable entries (nothing to pin).

Beside HiCache: one host budget, HiCache's, and nothing held twice
    With ``--enable-hierarchical-cache`` the park pool is carved out of HiCache's host pools at the
    first scheduler pass (:mod:`adapter.switches.kv_park.beside_hicache`: their own allocator hands
    the slots over; ``min(DSV41_KV_PARK_GIB, half of HiCache's host pools)``), so the profile's
    host-RAM total is HiCache's host pool alone and parked bytes plus HiCache's own never exceed
    it. Nothing is held twice (no page, Full or SWA, both parked and in HiCache's host pools):

    * Full: only the pages past the tree's Full KV of the row (device, or host through HiCache) are
      parked (``parked_from`` in the entry); nothing when the prefix the tree serves covers them.
    * SWA: only the window's pages past the prefix the tree serves (``tree_from``: ``match_prefix``'s
      device plus host hit, where a SWA run of at least the window ends). Below it the row's window
      pages are the tree's own (the row shares its slots), and HiCache's load-back brings them back
      with the Full KV.
    * Past a window the tree lost. In SGLang 0.5.23 the tree can hold Full KV past the prefix
      ``match_prefix`` serves, on the device and on host: another request with the same tokens
      inserted it, and its window there was evicted. ``full_kv_hit_length`` counts it. That Full
      KV is not parked: the restore locks the tree's device pages (Full only) and takes only the
      window's SWA from the entry (the insert keeps the tree's Full pages). When part of it is on
      host only, at the park or at the restore, the request recomputes from the prefix the tree
      serves (``dropped reason=window_lost_full_kv_on_host`` / ``window_gap_left_the_device``):
      HiCache's load-back of a node with no window on either tier fails (its SWA traversal asserts;
      a test pins this). The same applies when the tree still holds part of that stretch's window,
      on the device or on host (``window_partly_in_the_tree``).

    The restore matches again. When the tree's part is on host only, HiCache's own load-back
    (``init_load_back``, as the admission calls it) brings it to the device, Full and SWA; then the
    parked tail is written and inserted after it. When HiCache evicted part of it from both tiers
    (``dropped reason=prefix_gone_from_hicache``) or its load-back gives nothing
    (``load_back_refused``: no device room, under its threshold, pinned by another load), the entry
    is dropped and the request recomputes as stock.

Nothing is ever lost
    A refused offer (over ``DSV41_KV_PARK_GIB``), an entry evicted by LRU, a restore that finds no
    free pages, or a failed copy (which disables parking for the process, one log line) all mean
    the stock re-prefill. Pools without a page layout here (see :mod:`adapter.switches.kv_park.regions`:
    the unified, request-window, SWA-ring and HiSparse DeepSeek-V4 layouts) are logged once as
    unsupported with the reason and stay stock; so are mamba trees, multimodal requests,
    speculative decoding (the draft model's KV is not parked), and PD-decode retraction (it
    has its own backup path).

Hybrid SWA (``SWAKVPool``) and DeepSeek-V4 (``DeepSeekV4TokenToKVPool``)
    The full side parks every whole page; the SWA side parks the pages of the window that still
    has SWA slots (a second store entry). For DeepSeek-V4 the full side is the C4/C128
    compressed latents and the C4 indexer keys (addressed by full page id), the SWA side is the
    main cache and the C4 compressor states (addressed by SWA page id); the request-scoped C128
    state needs nothing at a page boundary (:mod:`adapter.switches.kv_park.regions`). The restore allocates with the allocator's own
    ``alloc_extend_swa_tail`` (full KV for the span, SWA slots for the window only) and inserts
    with the SWA component evicted below the window, as a checkpoint of that request would be.

Tensor parallelism
    Every rank parks its own shard of the same pages; entry sizes, the budget and the allocator
    state are the same on every rank, so refusals, evictions and restores agree. A copy failure on
    one rank only would not: that rank recomputes while the others restore (not seen, not tested
    on several ranks here).

Rollback: unset ``DSV41_KV_PARK``.
"""

from __future__ import annotations

import logging
import sys
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from adapter.core import api
from adapter.switches.kv_park import beside_hicache, capture, dsv4_offload, host_ledger, regions
from adapter.switches.kv_park.engine import CopyEngine
from adapter.switches.kv_park.host_pool import CudaHostRegister, HostPool, PageLocker, PoolError
from adapter.switches.kv_park.store import SWITCH, ParkStore

GIB = 1 << 30


@dataclass
class _Engines:
    full: CopyEngine  # full-attention pages, addressed by full page id (slot // page_size)
    swa: CopyEngine | None  # SWAKVPool: the SWA side, addressed by SWA page id


@dataclass
class _State:
    store: ParkStore
    engines: dict[int, tuple[Any, _Engines | None]] = field(default_factory=dict)  # id(pool) -> (pool, engines)
    said: set[str] = field(default_factory=set)  # one-time log lines already written
    # rid -> (tree, TreeLock) on the pages a restore inserted, held until the request is admitted
    # (its admission then locks them as its prefix) so running rows do not evict them meanwhile.
    pins: dict[Any, tuple[Any, Any]] = field(default_factory=dict)
    checked_hicache: bool = False  # the first scheduler pass learned the forward stream
    pool_booted: bool = False  # the park pool (or its absence) was settled: at boot, else the first pass
    # The scheduler's forward stream (learned at the first pass): under the overlap loop the forward
    # writes and reads KV pages there, not on the scheduler thread's current stream.
    forward_stream: Any = None
    beside_hicache: bool = False  # the park pool is carved out of HiCache's host pools
    # rid -> the servable tokens of a retraction the tree held in full (nothing parked): its pages
    # are pinned at the re-admission pass, as a restore's are.
    tree_held: dict[Any, array] = field(default_factory=dict)

    def once(self, what: str, **params: object) -> None:
        line = what + repr(sorted(params.items()))
        if line not in self.said:
            self.said.add(line)
            SWITCH.event(what, **params)

    def engines_for(self, pool: Any) -> _Engines | None:
        known = self.engines.get(id(pool))
        if known is not None and known[0] is pool:
            return known[1]
        engines = None
        try:
            full, swa = regions.layouts_for(pool)
            engines = _Engines(CopyEngine(full), CopyEngine(swa) if swa is not None else None)
        except regions.Unsupported as exc:
            self.once("unsupported", pool=type(pool).__name__, reason=str(exc).replace(" ", "_"))
        self.engines[id(pool)] = (pool, engines)
        return engines


STATE: _State | None = None


def install(ctx: api.SwitchContext) -> dict[str, object]:
    SWITCH.bind(ctx)
    budget_gib = int(ctx.option("DSV41_KV_PARK_GIB"))
    # An unbounded queue: a retraction never copies on the scheduler thread (each queued copy
    # already holds its bytes of the budget, so the budget bounds the queue).
    # No worker: on CUDA a park queues its copy on the device from the scheduler thread and returns
    # (the device orders it); on a CPU pool the copy is the work itself, done in the retraction.
    state = _State(ParkStore(budget_gib * GIB, worker=False))
    ctx.wrap("release_req", _release_req)
    ctx.wrap("Scheduler.get_next_batch_to_run", _get_next_batch_to_run)
    # The park pool is pinned (or carved out of HiCache's) as soon as the scheduler has its KV cache,
    # before the first pass: pinning takes seconds per rank (about 0.4 s/GiB), never on a live pass.
    ctx.wrap("build_kv_cache", _built_kv_cache)
    # Parking copies run on a worker thread; a global-mode CUDA graph capture on another thread must
    # not see them (capture.py): the capture drains them and holds new ones back until it ends.
    ctx.wrap("CUDAGraph.capture_begin", capture.locked_capture_begin)
    ctx.wrap("CUDAGraph.capture_end", capture.locked_capture_end)
    # SGLang's own DSV4 retraction offload (PD decode, cpu_tensor backup) through the copy engine.
    ctx.wrap("KVCache.get_cpu_copy", dsv4_offload.wrapped_get_cpu_copy)
    ctx.wrap("KVCache.load_cpu_copy", dsv4_offload.wrapped_load_cpu_copy)
    ctx.wrap("sglang.srt.mem_cache.common:dsv4_needs_rebootstrap", dsv4_offload.wrapped_needs_rebootstrap)
    ctx.wrap("sglang.srt.disaggregation.decode:dsv4_needs_rebootstrap", dsv4_offload.wrapped_needs_rebootstrap)
    ctx.set_attr(sys.modules[__name__], "STATE", state)
    return {"mode": ctx.value, "budget_gib": budget_gib, "copies": "device_queued", "capture_lock": "global"}


# -- saving on retraction ----------------------------------------------------------------------


def _release_req(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    state = STATE
    # Outside PD decode, ``offload_kv`` only says whether the stock path would back up (it never
    # does there): aborts are recognised by ``req.finished()`` (their FINISH_ABORT is set first).
    if state is not None and not args:
        try:
            _park(state, kwargs["req"], kwargs["req_to_token_pool"], kwargs["token_to_kv_pool_allocator"], kwargs["tree_cache"])
        except Exception as exc:  # parking is an optimisation: never fail a retraction over it
            state.store.disable(f"park of a retracted request failed: {type(exc).__name__}: {exc}")
    return wrapped(*args, **kwargs)


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


def kv_streams(state: _State, device: torch.device) -> list[Any]:
    """The CUDA streams whose queued work writes or reads KV pages: the scheduler thread's current
    stream (the forward runs there without the overlap loop) and the scheduler's forward stream."""
    streams = [torch.cuda.current_stream(device)]
    forward = state.forward_stream
    if forward is not None and forward != streams[0]:
        streams.append(forward)
    return streams


def _recorded_on(streams: list[Any]) -> list[Any]:
    """One CUDA event recorded now on each stream: the point a copy must follow."""
    events = []
    for stream in streams:
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    return events


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


# -- fencing and restoring around each scheduler pass -------------------------------------------


def _get_next_batch_to_run(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    state = STATE
    if state is None:
        return wrapped(*args, **kwargs)
    if not state.checked_hicache:
        state.checked_hicache = True
        forward = getattr(instance, "forward_stream", None)
        if isinstance(forward, torch.cuda.Stream):
            state.forward_stream = forward
        if not state.pool_booted:  # a scheduler built without build_kv_cache (the test harness)
            _boot_pool(state, instance, at="first_pass")
    # No fence: every copy still reading freed pages is ordered before any later write of them on
    # the device (save_pages); the store only queries what is done.
    state.store.poll()
    if state.pins:
        _release_pins(state, instance)
    try:
        _restore_waiting(state, instance)
    except Exception as exc:  # a failed restore disables parking; the request recomputes
        state.store.disable(f"restore failed: {type(exc).__name__}: {exc}")
    return wrapped(*args, **kwargs)


def boot_pool(
    budget_gib: int,
    *,
    locker: PageLocker | None = None,
    chunk_bytes: int | None = None,
    ranks: int = 1,
    ledger: Any = None,
    group: str | None = None,
) -> tuple[HostPool, dict[str, object]]:
    """The park pool of a CUDA KV pool: ``budget_gib`` GiB page-locked once, in chunks, and the
    facts of its boot line.

    The ``ranks`` TP ranks of this server on this host agree first (:mod:`host_ledger`): they pass
    or refuse together. A pool refused, or one that cannot be allocated or locked, is a boot failure
    (:class:`api.BootError`) naming ``DSV41_KV_PARK_GIB``, the size and the limit it hit. ``locker``
    is the page-locking call (``cudaHostRegister``; tests inject a failing one)."""
    what = f"DSV41_KV_PARK_GIB={budget_gib}"
    kwargs = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    try:
        facts = host_ledger.agree(budget_gib * GIB, ranks=ranks, what=what, group=group, ledger=ledger)
        pool = HostPool.allocate(budget_gib * GIB, locker=CudaHostRegister() if locker is None else locker, what=what, **kwargs)
        host_ledger.report_pinned(group=group, ledger=ledger)
    except PoolError as exc:
        raise api.BootError(f"kv_park: {exc}") from exc
    return pool, facts


def ranks_on_this_host(server_args: Any) -> int:
    """The scheduler ranks of one server on one host, each pinning its own pool: TP x PP over the nodes."""
    if server_args is None:
        return 1
    ranks = int(getattr(server_args, "tp_size", 1) or 1) * int(getattr(server_args, "pp_size", 1) or 1)
    return max(1, ranks // max(1, int(getattr(server_args, "nnodes", 1) or 1)))


def _built_kv_cache(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``build_kv_cache``: once the scheduler has its KV pool and tree, settle the park pool."""
    result = wrapped(*args, **kwargs)
    state = STATE
    if state is not None and not state.pool_booted:
        _boot_pool(state, result, at="boot", ranks=ranks_on_this_host(kwargs.get("server_args")))
    return result


def _boot_pool(state: _State, scheduler: Any, *, at: str, ranks: int = 1) -> None:
    """Beside HiCache, the park pool is carved out of HiCache's host pools (one host budget);
    otherwise a CUDA KV pool parks into a pinned pool allocated now, once, and a CPU pool keeps
    pageable entries (nothing to pin). One ``kv_park pool at=boot|first_pass boot_ms=..`` line."""
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    if allocator is None or state.store.host_pool is not None:
        return
    state.pool_booted = True
    start = time.perf_counter()
    tree = getattr(scheduler, "tree_cache", None)
    if beside_hicache.attached(tree):
        try:
            carved, facts = beside_hicache.carve_pool(tree, state.store.budget // GIB)
        except PoolError as exc:
            raise api.BootError(f"kv_park: {exc}") from exc
        state.store.use_pool(carved)
        state.beside_hicache = True
        SWITCH.event("pool", **facts, **carved.describe(), at=at, boot_ms=_ms_since(start))
        return
    device = getattr(allocator, "device", None) or getattr(allocator.get_kvcache(), "device", "cpu")
    if not str(device).startswith("cuda"):
        SWITCH.event("pool", pool="pageable", reason="cpu_kv_pool", at=at)
        return
    pool, facts = boot_pool(state.store.budget // GIB, ranks=ranks)
    state.store.use_pool(pool)
    SWITCH.event("pool", **pool.describe(), **facts, at=at, boot_ms=_ms_since(start))


def _ms_since(start: float) -> float:
    return round((time.perf_counter() - start) * 1e3, 1)


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


def _full_on_device(tree: Any, req: Any, tokens: Any) -> Any:
    """The node where the tree's device Full KV of ``tokens`` ends when it covers them all (no SWA
    validation: past a window the tree lost), else None."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(token_ids=array("q", tokens), extra_key=req.extra_key, cache_salt=req.cache_salt)
    on_device, node, _ = tree.tree_core.match_full_device_prefix(key)
    return node if on_device >= len(tokens) else None


def _tree_holds_swa(tree: Any, req: Any, tokens: Any, lo: int, hi: int, page_size: int) -> bool:
    """Whether the tree holds the SWA KV (device, or host only) of any page in ``[lo, hi)`` of
    ``tokens``, whose Full KV it holds on the device (read-only: no split, no LRU touch)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    core = tree.tree_core
    for end in range(lo + page_size, hi + 1, page_size):
        key = RadixKey(token_ids=array("q", tokens[:end]), extra_key=req.extra_key, cache_salt=req.cache_salt)
        _, node, _ = core.match_full_device_prefix(key)  # the node holding token end - 1
        if core.get_component_device_value(node, ComponentType.SWA) is not None:
            return True
        if core.component_has_host_value_only(node, ComponentType.SWA):
            return True
    return False


def _held_by_tree(tree_cache: Any, req: Any, tokens: list[int], page_size: int) -> tuple[int, int]:
    """Tokens of ``tokens`` (whole pages) the tree holds, on the device or on host: the prefix it can
    serve (``match_prefix``'s device plus host hit, SWA-validated on a hybrid tree), and the prefix
    of its Full KV (``full_kv_hit_length``: the walk goes on through host-backed nodes past a window
    the tree lost, so it is never shorter)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(token_ids=tokens, extra_key=req.extra_key, cache_salt=req.cache_salt)
    match = tree_cache.match_prefix(MatchPrefixParams(key=key))
    held = int(match.device_prefix_len) + int(getattr(match, "host_hit_length", 0) or 0)
    full = max(held, int(getattr(match, "full_kv_hit_length", 0) or 0))
    return min(held, len(tokens)) // page_size * page_size, min(full, len(tokens)) // page_size * page_size


def _running_need(scheduler: Any) -> int:
    """Tokens the running rows' next decode step allocates (what ``check_decode_mem`` asks for)."""
    running = getattr(scheduler, "running_batch", None)
    if running is None or running.is_empty():
        return 0
    return int(running.new_tokens_required_next_decode())


def _release_pins(state: _State, scheduler: Any) -> None:
    """Unpin restored pages whose request left the waiting queue (admitted: it holds its own lock;
    or aborted); every pin when no row is running (nothing decodes to evict them before this pass's
    admission, and a pin must never keep another waiting request out of an idle engine); and every
    pin when the running rows' next decode would not fit beside them (the running rows come first,
    as in stock: the pages become evictable, the request recomputes)."""
    waiting = {r.rid for r in scheduler.waiting_queue}
    for rid in [rid for rid in state.pins if rid not in waiting]:
        tree, lock = state.pins.pop(rid)
        tree.unlock(lock)
    if not state.pins:
        return
    need = _running_need(scheduler)
    allocator, tree = scheduler.token_to_kv_pool_allocator, scheduler.tree_cache
    running = getattr(scheduler, "running_batch", None)
    if running is None or running.is_empty():
        reason = "no_running_rows"
    elif allocator.available_size() + tree.evictable_size() < need:
        reason = "running_rows_need_the_pages"
    else:
        return
    for rid, (pinned_tree, lock) in list(state.pins.items()):
        pinned_tree.unlock(lock)
        SWITCH.event("unpinned", level=logging.DEBUG, rid=rid, reason=reason, need=need)
    state.pins.clear()


def _pin(state: _State, rid: Any, tree: Any, node: Any) -> None:
    old = state.pins.pop(rid, None)
    if old is not None:
        old[0].unlock(old[1])
    state.pins[rid] = (tree, tree.lock(node))


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


def _restore_one(state: _State, scheduler: Any, req: Any, *, may_evict: bool) -> bool:
    """Restore one parked request into the tree; False when there is no room (try next pass)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.common import evict_from_tree_cache
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    store = state.store
    entry = store.peek(req.rid)
    if entry is None:
        return _drop(store, req.rid, "no_entry")
    tree, allocator = scheduler.tree_cache, scheduler.token_to_kv_pool_allocator
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
        return _drop(store, req.rid, "pool_changed_or_swa_entry_missing")
    fill = req.origin_input_ids + req.output_ids
    n = min(len(tokens), req._compute_max_prefix_len(len(fill))) // page_size * page_size
    if n == 0:
        return _drop(store, req.rid, "no_whole_page_before_the_last_token", parked=len(tokens), fill=len(fill))
    if tokens[:n] != fill[:n]:
        return _drop(store, req.rid, "other_tokens", parked=len(tokens), fill=len(fill))
    if swa_from is not None and n <= swa_from:
        # The servable prefix (whole pages before the last token) ends where the parked window
        # starts: its extend would need SWA KV below swa_from, which was gone at retraction.
        return _drop(store, req.rid, "window_below_the_servable_prefix", servable=n, swa_from=swa_from, fill=len(fill))
    key = RadixKey(token_ids=tokens[:n], extra_key=req.extra_key, cache_salt=req.cache_salt)
    match = tree.match_prefix(MatchPrefixParams(key=key))
    have = int(match.device_prefix_len)
    parked_from = min(int(entry.meta.get("parked_from", 0)), n)  # below it, the tree's Full KV (beside HiCache)
    tree_from = min(int(entry.meta.get("tree_from", parked_from)), parked_from)  # below it, all the tree's
    if have < tree_from and not state.beside_hicache:
        # The tree's part of the prefix (not parked: the tree held it at retraction) was evicted.
        return _drop(store, req.rid, "prefix_gone_from_the_tree", servable=n, parked_from=parked_from, cached=have)
    if have < tree_from:
        # The tree's part is on host only: HiCache's own load-back brings it to the device first.
        why = _load_back(tree, req, match, tree_from)
        if why is None:
            match = tree.match_prefix(MatchPrefixParams(key=key))
            have = int(match.device_prefix_len)
            why = None if have >= tree_from else "load_back_short"
        if why is not None:
            return _drop(store, req.rid, why, servable=n, parked_from=parked_from, cached=have,
                         host=int(getattr(match, "host_hit_length", 0) or 0))
    gap_lock = None
    if have < parked_from:
        # The tree's Full KV past the prefix it can serve (its window was evicted), not parked: it
        # must still be on the device (HiCache cannot load it back without a window); locked, Full
        # only. The insert below keeps the tree's pages and takes the window's SWA from the entry.
        gap_node = _full_on_device(tree, req, tokens[:parked_from])
        if gap_node is None:
            return _drop(store, req.rid, "window_gap_left_the_device", servable=n, parked_from=parked_from, cached=have)
        gap_lock = tree.lock(gap_node, skip_lock_components=(ComponentType.SWA,))
    if have >= n:
        # Nothing to copy, but the same hazard as a restore: keep the tree's pages until admission.
        _pin(state, req.rid, tree, match.last_device_node)
        return _drop(store, req.rid, "tree_holds_it", servable=n, cached=have)
    need = n - have
    # Room for the restore and for the running rows' next decode step beside it: the restored
    # pages stay pinned until the request is admitted, so they must not starve the running rows.
    room = need + _running_need(scheduler)
    lock = tree.lock(match.last_device_node)  # the matched prefix must survive our eviction
    try:
        if allocator.available_size() < room:
            if not may_evict:
                return False
            evict_from_tree_cache(tree, room)
        if allocator.available_size() < room:
            return False
        prefix = tree.path_device_indices(match.last_device_node).to(torch.int64)[:have]
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
            return False
        slots = slots.to(torch.int64)
        try:
            pages = torch.div(slots[::page_size], page_size, rounding_mode="floor")
            params = InsertParams(key=key, value=torch.cat([prefix, slots]), prev_prefix_len=have)
            # Full pages below parked_from are the tree's (the insert frees these duplicates).
            skip = max(0, parked_from - have) // page_size
            copies = [(req.rid, engines.full, pages[skip:], max(0, have - parked_from) // page_size)]
            if swa_from is not None:
                assert engines.swa is not None
                swa_slots = allocator.full_to_swa_index_mapping[slots[tail_from - have :]].to(torch.int64)
                swa_pages = torch.div(swa_slots[::page_size], page_size, rounding_mode="floor")
                swa_parked_from = int(entry.meta.get("swa_parked_from", swa_from))  # below it, the tree's SWA pages
                copies.append(((req.rid, "swa"), engines.swa, swa_pages, (tail_from - swa_parked_from) // page_size))
                params.set_evicted_seqlen(ComponentType.SWA, tail_from)  # no SWA KV below the window we had
            restore_pages(state, copies)
        except BaseException:
            allocator.free(slots)  # neither in the tree nor owned by a request: give them back
            raise
        tree.insert(params)
        # Until the admission takes them as the request's prefix, running rows' decode could evict
        # the restored pages (pool-full retractions wait for them to finish): pin them.
        inserted = tree.match_prefix(MatchPrefixParams(key=key))
        if int(inserted.device_prefix_len) == n:
            _pin(state, req.rid, tree, inserted.last_device_node)
    finally:
        tree.unlock(lock)
        if gap_lock is not None:
            tree.unlock(gap_lock)
    if SWITCH.debug or api.metrics_on():  # the line and the metrics: skip the sums when nothing reads them
        SWITCH.event("restored", level=logging.DEBUG, rid=req.rid, pages=pages.numel(), tokens=n, cached=have,
                     held=store.used_bytes + store.reserved_bytes)
    return True
