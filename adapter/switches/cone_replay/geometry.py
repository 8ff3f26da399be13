"""Cone replay's geometry: the replay depth bound, the replay start, and one cache's checked config.

Pure arithmetic plus reading a pool's sliding window / layer count; no wrapping, no state. The
derivations are in the package's switch docstring (``SWAKVPool``) and in :func:`cone_bound_dsv4`
(DeepSeek-V4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CACHE_ATTR = "_dsv41_cone_cfg"  # the checked geometry of one cache (set on the UnifiedRadixCache)
DSV4_POOL = "DeepSeekV4TokenToKVPool"
C4_OVERLAP = 4  # DSV4's C4 compressor pools each 4-row group with the previous group's 4 rows


def align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _check_positive(**values: int) -> None:
    bad = {k: v for k, v in values.items() if not isinstance(v, int) or v <= 0}
    if bad:
        raise ValueError(f"cone bound needs positive integers, got {bad}")


def cone_bound(window: int, page: int, swa_layers: int) -> int:
    """``SWAKVPool``: the smallest replay depth that keeps rows >= F exact,
    ``align_up(align_up(W, page) + (L_swa - 1) * W, page) + page`` (switch docstring)."""
    _check_positive(window=window, page=page, swa_layers=swa_layers)
    return align_up(align_up(window, page) + (swa_layers - 1) * window, page) + page


def dsv4_republished_rows(window: int, page: int) -> int:
    """Rows before F whose SWA pages (and the C4 state rings paired with them) the request's first
    checkpoint re-publishes: ``align_up(W, page) + page``. On DeepSeek-V4 these rows must write
    their own compressed KV, index keys and compressor states (:func:`cone_bound_dsv4`)."""
    return align_up(window, page) + page


def cone_bound_dsv4(window: int, page: int, layers: int, *, ratios: Sequence[int] | None = None,
                    tail_from: int | None = None) -> int:
    """DeepSeek-V4 (``DeepSeekV4TokenToKVPool``): the smallest replay depth that keeps rows >= F exact.

    Every DSV4 layer has a sliding window (``r - j < W``) over the main SWA KV; its compressed
    attention (C4 / C128 latents, C4 index keys) reads the cache, and so does its SWA attention
    (the backend stores, then reads: ``_forward_attention``). Inexactness enters a replay only
    where a replay row near s reads SWA keys below s (evicted: the padding slot), so the input of
    layer k (1-based) is inexact on ``[s, s + (k - 1) * W)`` at most; compressed entries of the
    masked rows keep the copied, resident bytes (their writes go to slot 0 through
    ``encoder_swa_compress_rows``).

    The rows that must write are the last ``R = align_up(W, page) + page`` before F
    (:func:`dsv4_republished_rows`): their SWA KV is re-published by the first checkpoint, and
    the C4 compressor state ring lives with each SWA page (SWA-addressed state pool), so a later
    request resuming one page below F reads the state those rows wrote; rows >= F read all their
    compressed entries. Layer k computes its SWA KV, compressed groups and states of those rows
    from its input, and a C4 group also pools the previous group's 4 rows, so layer k needs
    ``F - s >= R + o_k + (k - 1) * W`` (``o_k`` = 4 for a C4 layer, else 0). The bound is the
    largest of these, rounded up to a page (s is a page floor). ``ratios`` (the pool's local
    layers' compress ratios) gives ``o_k``; without it every layer is taken as C4.
    W 128, page 256: 768 for the kit's C0/C4/C128; 61 layers: 8,192 when the last is not C4,
    else 8,448.

    ``tail_from`` (decoder SWA bounded replay: the last KV-source layer, a local layer index; see
    :func:`.decision.decide`):
    from that layer on, layers run only on each extend's last ``W`` rows, and those rows read no
    layer's window below the tail (the window floor ``seq_len - W`` of SGLang's
    ``late_layer_tail_layout``), so no window information crosses rows there; the layer at
    ``tail_from`` (the last KV source) still compresses every row from its input
    (``write_tail_source_kv``). Only layers ``0 .. tail_from`` count: the V4.1 kit (sources 1, 2)
    gets 768 instead of 1,024.
    """
    _check_positive(window=window, page=page, layers=layers)
    if ratios is not None and len(ratios) != layers:
        raise ValueError(f"cone bound: ratios={list(ratios)} has {len(ratios)} entries, expected layers={layers}")
    base = dsv4_republished_rows(window, page)
    counted = layers if tail_from is None else max(0, min(layers, tail_from + 1))
    need = max((base + (C4_OVERLAP if ratios is None or ratios[k] == 4 else 0) + k * window for k in range(counted)),
               default=base)
    return align_up(need, page)


def cone_start(F: int, N: int, page: int) -> int:
    """s = page_floor(F - N), never below 0."""
    return max(0, (F - N) // page * page)


def swa_layer_count(kvpool: Any) -> int | None:
    """Sliding-window layers of the model behind ``kvpool``: ``SWAKVPool`` keeps them apart from
    its Full layers; every DeepSeek-V4 layer has a sliding window (its compressed caches are the
    Full side). None when the pool is of neither family. Local layers: under pipeline parallelism
    a stage counts its own."""
    if kvpool is None:
        return None
    if hasattr(kvpool, "swa_layer_nums"):
        return int(kvpool.swa_layer_nums)
    if is_dsv4_pool(kvpool):
        return int(kvpool.layer_num)
    return None


def is_dsv4_pool(kvpool: Any) -> bool:
    return type(kvpool).__name__ == DSV4_POOL


@dataclass
class ConeConfig:
    """One cache's checked cone geometry."""

    enabled: bool
    tokens: int
    bound: int = 0
    window: int = 0
    page: int = 0
    swa_layers: int = 0
    reason: str = ""
    dsv4: bool = False  # the forward side sets encoder_swa_compress_rows (DeepSeek-V4 paged pool)


def cache_config(cache: Any) -> ConeConfig | None:
    return getattr(cache, CACHE_ATTR, None)
