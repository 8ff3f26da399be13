"""SGLang's own retraction offload for DeepSeek-V4 (sglang#33385), served by the copy engine.

What it changes
    On a PD decode node a retracted request's KV is backed up to host by
    ``ScheduleBatch.offload_kv_cache`` (``--disaggregation-decode-retraction-backup cpu_tensor``)
    and loaded back by ``load_kv_cache``; both go through the allocator to the pool's
    ``get_cpu_copy`` / ``load_cpu_copy``. ``DeepSeekV4TokenToKVPool`` has neither (they fall to
    ``KVCache``'s ``NotImplementedError``), so SGLang 0.5.23 marks every DSV4 pool as needing a
    *rebootstrap* (``dsv4_needs_rebootstrap``: the prefill node recomputes the whole context). With
    ``DSV41_KV_PARK`` set, the DSV4 pool's CPU copy and load are this module's (wrapped on
    ``KVCache``: other pools keep their own), and ``dsv4_needs_rebootstrap`` is False for a pool the
    copy engine can move, so the stock offload path runs.

What is copied (the request's ``seqlen - 1`` tokens, their slots as ``req_to_token`` holds them)
    * full-page regions (:func:`~adapter.switches.kv_park.regions.dsv4_full_layout`: C4 / C128
      latents, C4 index keys) of every page the tokens touch, the partial last page included;
    * SWA-page regions (:func:`~adapter.switches.kv_park.regions.dsv4_swa_layout`: the main cache and
      the page-scoped compressor state rings) of the pages from the first whole page whose tokens
      all still have SWA slots (the window) to the last;
    * the request-scoped compressor state rings (C128: ``ring_size`` rows at ``req_pool_idx``),
      which a token boundary inside a page leaves pending.

    The load writes each part to the same token positions of the new slots (paged allocators put
    position ``i`` at offset ``i % page_size`` of its page, so page rows map one to one), and the
    state rings to the new ``req_pool_idx``. A layout the copy engine does not move (unified KV,
    request window, SWA ring, HiSparse, ratio-1/2 layers: :func:`regions.dsv4_refusal`) keeps the
    stock rebootstrap.

Tested on SGLang's real pool and allocator classes on CPU (``tests/upstream/test_kv_park_dsv4_offload.py``):
the round trip puts back every byte of every region at the new slots. SGLang's PD decode needs a
prefill peer and a transfer engine, which the CPU kits do not run, so the decode node's event loop
itself is not exercised here.

Importing this module imports no SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from adapter.switches.kv_park import regions
from adapter.switches.kv_park.engine import CopyEngine


@dataclass
class Dsv4Backup:
    """What ``get_cpu_copy`` returns for a DSV4 pool (``RetractionBackup.cpu_tensors``)."""

    tokens: int
    page_size: int
    full: torch.Tensor  # [full pages, full page bytes] in the engine's byte format
    swa_from: int  # first token position of the parked SWA pages (page aligned); == tokens: none
    swa: torch.Tensor | None  # [SWA pages, SWA page bytes]
    states: list[torch.Tensor]  # request-scoped state rings, in pool order


_ENGINES: dict[int, tuple[Any, CopyEngine, CopyEngine]] = {}


def movable(pool: Any) -> bool:
    """Whether the copy engine moves this DSV4 pool (else the stock rebootstrap stays)."""
    try:
        return regions.dsv4_refusal(pool) is None and pool.full_to_swa_index_mapping is not None
    except AttributeError:
        return False


def _engines(pool: Any) -> tuple[CopyEngine, CopyEngine]:
    known = _ENGINES.get(id(pool))
    if known is None or known[0] is not pool:
        known = (pool, CopyEngine(regions.dsv4_full_layout(pool)), CopyEngine(regions.dsv4_swa_layout(pool)))
        _ENGINES[id(pool)] = known
    return known[1], known[2]


def _pages(slots: torch.Tensor, page: int, what: str) -> torch.Tensor:
    """Page ids of ``slots`` (positions 0.. of a request, the last page possibly partial)."""
    pages = torch.div(slots[::page], page, rounding_mode="floor")
    pos = torch.arange(slots.numel(), device=slots.device)
    expected = pages.repeat_interleave(page)[: slots.numel()] * page + pos % page
    if not torch.equal(slots, expected):
        raise ValueError(f"DeepSeek-V4 CPU copy: the request's {what} slots are not whole pages in position order")
    return pages


def _request_states(pool: Any) -> list[Any]:
    return [s for s in list(pool.compress_state_pools) + list(pool.indexer_compress_state_pools)
            if s is not None and s.request_scoped]


def _ring(state: Any, req_pool_index: int) -> torch.Tensor:
    ring = int(state.ring_size)
    return state.kv_score_buffer.kv_score[int(req_pool_index) * ring : (int(req_pool_index) + 1) * ring]


def _window_from(swa_slots: torch.Tensor, page: int) -> int:
    dead = (swa_slots <= 0).nonzero()
    return 0 if dead.numel() == 0 else (int(dead.max()) // page + 1) * page


def get_cpu_copy(pool: Any, indices: torch.Tensor, req_pool_index: Any) -> Dsv4Backup:
    full_engine, swa_engine = _engines(pool)
    page = int(pool.page_size)
    slots = indices.to(torch.int64)
    n = slots.numel()
    if str(pool.device).startswith("cuda"):
        torch.cuda.synchronize(pool.device)  # the forward that wrote these slots has finished
    full = full_engine.save(_pages(slots, page, "full").cpu()) if n else full_engine.new_entry(0)
    swa_slots = pool.translate_loc_from_full_to_swa(slots).to(torch.int64)
    swa_from = _window_from(swa_slots, page)
    swa = None
    if swa_from < n:
        swa = swa_engine.save(_pages(swa_slots[swa_from:], page, "SWA").cpu())
    states = [] if req_pool_index is None else [_ring(s, int(req_pool_index)).cpu().clone() for s in _request_states(pool)]
    return Dsv4Backup(n, page, full, swa_from, swa, states)


def load_cpu_copy(pool: Any, backup: Dsv4Backup, indices: torch.Tensor, req_pool_index: Any) -> None:
    full_engine, swa_engine = _engines(pool)
    page = int(pool.page_size)
    slots = indices.to(torch.int64)
    if slots.numel() != backup.tokens or page != backup.page_size:
        raise ValueError(
            f"DeepSeek-V4 CPU load: {slots.numel()} slots of page {page} for a backup of {backup.tokens} tokens "
            f"of page {backup.page_size}"
        )
    if backup.tokens:
        full_engine.restore(backup.full, _pages(slots, page, "full").cpu())
    if backup.swa is not None:
        swa_slots = pool.translate_loc_from_full_to_swa(slots[backup.swa_from :]).to(torch.int64)
        if bool((swa_slots <= 0).any()):
            raise ValueError("DeepSeek-V4 CPU load: the new slots have no SWA slot for the window the backup holds")
        swa_engine.restore(backup.swa, _pages(swa_slots, page, "SWA").cpu())
    if backup.states and req_pool_index is not None:
        for state, rows in zip(_request_states(pool), backup.states, strict=True):
            _ring(state, int(req_pool_index)).copy_(rows)


# -- the wrappers (``wrapt`` signature; installed by the switch) -----------------------------------


def _is_dsv4(pool: Any) -> bool:
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    return isinstance(pool, DeepSeekV4TokenToKVPool)


def wrapped_get_cpu_copy(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``KVCache.get_cpu_copy(indices, mamba_indices=None, req_pool_index=None)``."""
    if not (_is_dsv4(instance) and movable(instance)):
        return wrapped(*args, **kwargs)
    indices = kwargs["indices"] if "indices" in kwargs else args[0]
    req_pool_index = kwargs.get("req_pool_index", args[2] if len(args) > 2 else None)
    return get_cpu_copy(instance, indices, req_pool_index)


def wrapped_load_cpu_copy(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``KVCache.load_cpu_copy(kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None)``."""
    backup = kwargs["kv_cache_cpu"] if "kv_cache_cpu" in kwargs else args[0]
    if not isinstance(backup, Dsv4Backup):
        return wrapped(*args, **kwargs)
    indices = kwargs["indices"] if "indices" in kwargs else args[1]
    req_pool_index = kwargs.get("req_pool_index", args[3] if len(args) > 3 else None)
    return load_cpu_copy(instance, backup, indices, req_pool_index)


def wrapped_needs_rebootstrap(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> bool:
    """``dsv4_needs_rebootstrap(allocator)``: False where the copy engine moves the DSV4 pool."""
    allocator = kwargs["token_to_kv_pool_allocator"] if "token_to_kv_pool_allocator" in kwargs else args[0]
    pool = allocator.get_kvcache()
    if _is_dsv4(pool) and movable(pool):
        return False
    return wrapped(*args, **kwargs)
