"""Which device tensors of a KV pool make up a parked page, in byte-format order.

Every function returns a :class:`adapter.switches.kv_park.page_format.PageLayout` whose page ids are the pool's
page ids (``slot // page_size``), or raises :class:`Unsupported` with a one-line reason.

* ``MHATokenToKVPool``: per layer ``k``, then per layer ``v`` (then the FP4 scale buffers when
  the pool has them). Token-major ``[tokens, heads, dim]`` buffers, ``page_size`` tokens a page.
* ``MLATokenToKVPool``: per layer ``kv``.
* ``SWAKVPool``: the full side (:func:`swa_full_layout`) and the SWA side
  (:func:`swa_window_layout`) are two layouts, because SWA pages live in their own index space
  (``full_to_swa_index_mapping`` translates a full slot to its SWA slot).

* ``DeepSeekV4TokenToKVPool`` (non-unified layout, paged SWA): two layouts, like a
  ``SWAKVPool``, because the pool itself has two page-id spaces:

  - full page id (:func:`dsv4_full_layout`): per compress ratio, that ratio's compressed KV
    buffers (C4 latents, C128 latents; compressed slot = full slot // ratio, so compressed page
    = full page), then that ratio's indexer key+scale buffers: exactly the buffers, order and
    row sizes of the pool's own ``get_contiguous_buf_infos`` (what PD ships by full page id);
  - SWA page id (:func:`dsv4_swa_layout`): the main (SWA) cache pages, then the page-scoped
    compressor states (C4 attention and C4 indexer ``kv_score`` rings: ``ring_size`` rows per
    SWA page, ``state_loc = swa_page * ring_size + swa_loc % ring_size``): exactly the buffers,
    order and row sizes of ``get_state_buf_infos``.

  Not parked, on purpose: the request-scoped C128 state ring (addressed by ``req_pool_idx``).
  A parked prefix is whole pages, and a page (256 tokens) is a whole number of 128-token C128
  blocks, so no C128 block is pending at its end ("nothing pends at a block boundary"); the
  re-admitted request starts its C128 ring fresh exactly as after any prefix-cache hit. The
  C4 overlap state the next token needs (the last ``ring_size`` positions) lives in the last
  parked SWA page's state rows.

  Refused with a one-line reason (:class:`Unsupported`, the retraction stays stock): the
  unified KV layout (its SWA ring and C4 state are per-request ring rows, not pages a radix
  node can own), the encoder-replay request window and the per-request SWA ring (no paged SWA
  side), the HiSparse C4 pool (its own device mapping), ratio-1/2 kv-source layers (their
  pending-pair state is request-scoped and the layout is untested here), and a page size that
  is not a whole number of C128 blocks.

A layout's regions can have more padding pages than the allocator hands out (DSV4 pools round
each buffer up separately); a DSV4 layout views every region over the smallest page count, and
the copy engine rejects a page id beyond it before any copy (``IndexError``; the switch then
disables parking, the request recomputes).

:func:`layouts_for` is what the retraction hook uses.
"""

from __future__ import annotations

from typing import Any

import torch

from adapter.switches.kv_park.page_format import PageLayout, Region, page_rows


class Unsupported(Exception):
    """This pool cannot be parked (one-line reason)."""


def _token_major(prefix: str, buffers: Any, page_size: int) -> list[Region]:
    regions = []
    for layer, buf in enumerate(buffers or ()):
        if not isinstance(buf, torch.Tensor):
            raise Unsupported(f"{prefix}[{layer}] is not a tensor")
        try:
            regions.append(page_rows(f"{prefix}.{layer}", buf, page_size))
        except ValueError as exc:
            raise Unsupported(str(exc)) from None
    return regions


def token_pool_layout(pool: Any) -> PageLayout:
    """The layout of an MHA or MLA token pool (also each side of a ``SWAKVPool``)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if not isinstance(pool, (MHATokenToKVPool, MLATokenToKVPool)):
        raise Unsupported(f"no page layout for {type(pool).__name__}")
    page_size = int(pool.page_size)
    if isinstance(pool, MHATokenToKVPool):
        regions = _token_major("k", pool.k_buffer, page_size) + _token_major("v", pool.v_buffer, page_size)
        regions += _token_major("k_scale", getattr(pool, "k_scale_buffer", None), page_size)
        regions += _token_major("v_scale", getattr(pool, "v_scale_buffer", None), page_size)
    else:
        regions = _token_major("kv", pool.kv_buffer, page_size)
    if not regions:
        raise Unsupported(f"{type(pool).__name__} has no KV buffers")
    try:
        return PageLayout(tuple(regions))
    except ValueError as exc:
        raise Unsupported(str(exc)) from None


def swa_full_layout(pool: Any) -> PageLayout:
    return token_pool_layout(pool.full_kv_pool)


def swa_window_layout(pool: Any) -> PageLayout:
    return token_pool_layout(pool.swa_kv_pool)


def layouts_for(pool: Any) -> tuple[PageLayout, PageLayout | None]:
    """What the retraction hook parks for ``pool``: the full-page layout and, for a ``SWAKVPool``,
    the SWA-page layout (None otherwise)."""
    from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    if isinstance(pool, SWAKVPool):
        return swa_full_layout(pool), swa_window_layout(pool)
    if _is_dsv4(pool):
        return dsv4_full_layout(pool), dsv4_swa_layout(pool)
    if isinstance(pool, BaseSWAKVPool):
        raise Unsupported(f"{type(pool).__name__}: no page layout for this SWA pool")
    return token_pool_layout(pool), None


def _is_dsv4(pool: Any) -> bool:
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    return isinstance(pool, DeepSeekV4TokenToKVPool)


def dsv4_refusal(pool: Any) -> str | None:
    """Why this ``DeepSeekV4TokenToKVPool`` cannot be parked (one line), or None."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import HiSparseC4DevicePool

    if getattr(pool, "_unified_kv", False) or getattr(pool, "unified_kv_pool", None) is not None:
        return "unified KV layout: its SWA ring and C4 state are per-request ring rows, not pages a tree node owns"
    if getattr(pool, "request_window", None) is not None or pool.swa_kv_pool is None:
        return "encoder-replay request window: no paged SWA side"
    if getattr(pool, "swa_req_ring_size", None) is not None:
        return "per-request SWA ring: no paged SWA side"
    if any(isinstance(kv, HiSparseC4DevicePool) for kv in pool.kv_pools.values()):
        return "HiSparse C4 pool: pages go through its own device mapping"
    if any(ratio in (1, 2) for ratio in list(pool.kv_pools) + list(pool.index_pools)):
        return "ratio-1/2 kv-source layers: request-scoped pending-pair state, layout untested"
    for state in pool.compress_state_pools:
        if state is not None and state.request_scoped and int(pool.page_size) % int(state.ratio):
            return f"page size {pool.page_size} is not a whole number of C{state.ratio} blocks"
    return None


def _over_common_pages(space: str, regions: list[Region]) -> PageLayout:
    if not regions:
        raise Unsupported(f"DeepSeek-V4 {space} side has no buffers")
    pages = min(int(r.rows.shape[0]) for r in regions)
    try:
        return PageLayout(tuple(Region(r.name, r.rows[:pages]) for r in regions))
    except ValueError as exc:
        raise Unsupported(f"DeepSeek-V4 {space} side: {exc}") from None


def _rows(name: str, buf: Any, per_page: int) -> Region:
    if not isinstance(buf, torch.Tensor) or buf.dim() != 2:
        raise Unsupported(f"{name} is not a 2-D tensor")
    usable = buf.shape[0] // per_page * per_page  # a trailing partial group is padding
    try:
        return page_rows(name, buf[:usable], per_page)
    except ValueError as exc:
        raise Unsupported(str(exc)) from None


def dsv4_full_layout(pool: Any) -> PageLayout:
    """Full-page-id regions of a DSV4 pool: ``get_contiguous_buf_infos``' buffers, in its order."""
    why = dsv4_refusal(pool)
    if why:
        raise Unsupported(f"DeepSeek-V4 pool not parked: {why}")
    found: list[Region] = []
    for ratio, kv_pool in pool.kv_pools.items():
        if kv_pool is not None:
            found += [_rows(f"c{ratio}_kv.{i}", buf, 1) for i, buf in enumerate(kv_pool.kv_buffer)]
        index_pool = pool.index_pools.get(ratio)
        if index_pool is not None:
            found += [
                _rows(f"c{ratio}_index.{i}", buf, 1) for i, buf in enumerate(index_pool.contiguous_page_row_buffers())
            ]
    return _over_common_pages("full", found)


def dsv4_swa_layout(pool: Any) -> PageLayout:
    """SWA-page-id regions of a DSV4 pool: ``get_state_buf_infos``' buffers, in its order (main
    cache pages, then the page-scoped compressor state rings, ``ring_size`` rows per page)."""
    why = dsv4_refusal(pool)
    if why:
        raise Unsupported(f"DeepSeek-V4 pool not parked: {why}")
    swa = pool.swa_kv_pool
    per_logical = int(pool.swa_page_size) // int(swa.page_size)  # SM120 direct layout: 64-token rows
    found = [_rows(f"swa_kv.{i}", buf, per_logical) for i, buf in enumerate(swa.kv_buffer)]
    for family, states in (("state", pool.compress_state_pools), ("index_state", pool.indexer_compress_state_pools)):
        for layer, state in enumerate(states):
            if state is None or state.request_scoped:
                continue
            found.append(_rows(f"c{state.ratio}_{family}.{layer}", state.kv_score_buffer.kv_score, int(state.ring_size)))
    return _over_common_pages("SWA", found)


def dsv4_layouts(pool: Any) -> dict[str, PageLayout]:
    """Every buffer of a ``DeepSeekV4TokenToKVPool``, one layout per index space.

    ``swa`` (main-cache pages), ``c4`` and ``c128`` (compressed KV pages), ``c4_indexer``
    (indexer key+scale pages), and the compressor states (``c4_state``, ``c128_state``,
    ``c4_indexer_state``: one row per state slot). Each space has its own page ids; the
    retraction hook does not park DeepSeek-V4 yet (translating a request's full pages into each
    space is the missing part), but the copy engine moves every one of these buffers.
    """
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    if not isinstance(pool, DeepSeekV4TokenToKVPool):
        raise Unsupported(f"{type(pool).__name__} is not a DeepSeek-V4 pool")
    spaces: dict[str, list[Region]] = {}

    def add(space: str, name: str, buffers: Any) -> None:
        for i, buf in enumerate(buffers or ()):
            try:
                spaces.setdefault(space, []).append(page_rows(f"{name}.{i}", buf, 1))
            except ValueError as exc:
                raise Unsupported(str(exc)) from None

    for space, attr, name in (
        ("swa", "swa_kv_pool", "kv_buffer"),
        ("c4", "c4_kv_pool", "kv_buffer"),
        ("c128", "c128_kv_pool", "kv_buffer"),
        ("c4_indexer", "c4_indexer_kv_pool", "index_k_with_scale_buffer"),
    ):
        sub = getattr(pool, attr, None)
        if sub is not None:
            add(space, f"{space}.{name}", getattr(sub, name, None))
    ratios = list(getattr(pool, "compression_ratios", ()))[getattr(pool, "_stage_start", 0) :]
    for family, states in (("", pool.compress_state_pools), ("indexer_", pool.indexer_compress_state_pools)):
        for layer, state in enumerate(states or ()):
            if state is None:
                continue
            ratio = ratios[layer] if layer < len(ratios) else "x"
            space = f"c{ratio}_{family}state".replace("__", "_")
            add(space, f"{space}.kv_score.{layer}", [state.kv_score_buffer.kv_score])
    layouts = {}
    for space, found in spaces.items():
        try:
            layouts[space] = PageLayout(tuple(found))
        except ValueError as exc:
            raise Unsupported(f"{space}: {exc}") from None
    return layouts
