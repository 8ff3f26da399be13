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
    on a host page and page-locked once (``cudaHostRegister``; the ``kv_park pool ... at=boot
    boot_ms=..`` line gives the time), after the TP ranks on the host agreed there is room for all
    of them (:mod:`adapter.switches.kv_park.host_ledger`: they pass or refuse together), and every entry is carved out of it page by page
    (:mod:`adapter.switches.kv_park.host_pool`); a full pool evicts least recently used entries as
    the byte budget does. A pool that cannot be allocated or locked fails the boot (``BootError``
    naming ``DSV41_KV_PARK_GIB``, the size, how far pinning got and the host limit). Saves and
    restores move device pages straight into and out of the pinned rows on the copy engine's
    streams (the link overlaps the gather / scatter of the next chunk): a save and a restore each
    return before their copy lands (the KV streams wait for its event); its pool
    rows go back to the pool only once that event is done. A CPU KV pool
    keeps pageable entries (nothing to pin).

Beside HiCache: one host budget, HiCache's, and nothing held twice
    With ``--enable-hierarchical-cache`` the park pool is carved out of HiCache's host pools at
    boot (:mod:`adapter.switches.kv_park.beside_hicache`: their own allocator hands
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

import sys
from typing import Any

import torch

from adapter.core import api
from adapter.switches.kv_park import capture, dsv4_offload
from adapter.switches.kv_park.park import _park, save_pages  # noqa: F401  (save_pages: tests drive it)
from adapter.switches.kv_park.pool_boot import _boot_pool, boot_pool, ranks_on_this_host  # noqa: F401
from adapter.switches.kv_park.restore import _restore_one, _restore_waiting, restore_pages  # noqa: F401
from adapter.switches.kv_park.state import GIB, _Engines, _State  # noqa: F401
from adapter.switches.kv_park.store import SWITCH, ParkStore
from adapter.switches.kv_park.tree import _pin, _release_pins  # noqa: F401

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
    # A global-mode CUDA graph capture on another thread must not see a parking copy being queued
    # (capture.py): the capture waits for the copies being queued and holds new ones back until it ends.
    ctx.wrap("CUDAGraph.capture_begin", capture.locked_capture_begin)
    ctx.wrap("CUDAGraph.capture_end", capture.locked_capture_end)
    # SGLang's own DSV4 retraction offload (PD decode, cpu_tensor backup) through the copy engine.
    ctx.wrap("KVCache.get_cpu_copy", dsv4_offload.wrapped_get_cpu_copy)
    ctx.wrap("KVCache.load_cpu_copy", dsv4_offload.wrapped_load_cpu_copy)
    ctx.wrap("sglang.srt.mem_cache.common:dsv4_needs_rebootstrap", dsv4_offload.wrapped_needs_rebootstrap)
    ctx.wrap("sglang.srt.disaggregation.decode:dsv4_needs_rebootstrap", dsv4_offload.wrapped_needs_rebootstrap)
    ctx.set_attr(sys.modules[__name__], "STATE", state)
    return {"mode": ctx.value, "budget_gib": budget_gib, "copies": "device_queued", "capture_lock": "global"}


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


def _built_kv_cache(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``build_kv_cache``: once the scheduler has its KV pool and tree, settle the park pool."""
    result = wrapped(*args, **kwargs)
    state = STATE
    if state is not None and not state.pool_booted:
        _boot_pool(state, result, at="boot", ranks=ranks_on_this_host(kwargs.get("server_args")))
    return result
