"""Which device tensors of a KV pool make up a parked page, in byte-format order.

Every function returns a :class:`adapter.kv_park.engine.PageLayout` whose page ids are the pool's
page ids (``slot // page_size``), or raises :class:`Unsupported` with a one-line reason.

* ``MHATokenToKVPool``: per layer ``k``, then per layer ``v`` (then the FP4 scale buffers when
  the pool has them). Token-major ``[tokens, heads, dim]`` buffers, ``page_size`` tokens a page.
* ``MLATokenToKVPool``: per layer ``kv``.
* ``SWAKVPool``: the full side (:func:`swa_full_layout`) and the SWA side
  (:func:`swa_window_layout`) are two layouts, because SWA pages live in their own index space
  (``full_to_swa_index_mapping`` translates a full slot to its SWA slot).

:func:`layouts_for` is what the retraction hook uses. DeepSeek-V4 pools
(``DeepSeekV4TokenToKVPool``) are not listed yet: their compressed C4/C128
caches and indexer are addressed by compressed page ids and their compressor state by request
slot, so a full page id does not name their bytes. They raise :class:`Unsupported` and the
retraction stays stock (recompute).
"""

from __future__ import annotations

from typing import Any

import torch

from adapter.kv_park.engine import PageLayout, Region, page_rows


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
    if isinstance(pool, BaseSWAKVPool):
        raise Unsupported(f"{type(pool).__name__}: DeepSeek-V4 pools are not parked by the retraction hook yet")
    return token_pool_layout(pool), None


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
