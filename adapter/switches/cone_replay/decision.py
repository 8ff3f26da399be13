"""Cone replay's cache-build decision, as one pure function of what the cache is built on.

The switch calls :func:`decide` with :func:`facts_of_cache` (read from the built
``UnifiedRadixCache`` and its pool) and ``python -m adapter check`` with facts it predicts from
the model's ``config.json`` and the launch line (:mod:`.predict`), so the two can never disagree on
a rule. ``decide`` returns the bound and either no refusal (the switch acts: ``installed``) or the
one-line refusal a boot logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapter.switches.cone_replay import geometry

TOKENS_KEY = "DSV41_SWA_CONE_TOKENS"
STANDIN_KEY = "DSV41_SWA_CONE_FORWARD_STANDIN"
VERIFIED_LAYOUT = "v4"  # the DeepSeek-V4 layout the exactness tests ran on (the CPU kit: 584-byte rows)
NO_TAIL_LAYER = ("--enable-decoder-swa-bounded-replay on a pool without KV-source layers: cannot tell which "
                 "layers run on the tail only")
ENCODER_REPLAY = ("--enable-encoder-swa-bounded-replay: SWA lives in per-request window rings the tree does not own "
                  "(upstream replays min(prefix, 128) tokens on every hit itself); nothing for the cone to replay")
UNIFIED_KV = ("DeepSeek-V4 unified KV ring (SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton): its Full side has no "
              "pages of its own to copy")


@dataclass(frozen=True)
class CacheFacts:
    """What the decision reads of one cache (and of the pool under it)."""

    tokens: int  # N
    pool: str  # the pool's class name: SWAKVPool | DeepSeekV4TokenToKVPool | ...
    radix_disabled: bool = False
    swa_tree: bool = True  # the tree has an SWA component
    swa_gates_match: bool = True  # ... and its evicted windows stop a prefix match
    request_window: bool = False  # DeepSeek-V4 encoder replay: SWA in per-request rings
    window: int = 0
    page: int = 1
    swa_layers: int | None = None
    unified_kv: bool = False  # DeepSeek-V4's unified KV ring
    kv_layout: str = VERIFIED_LAYOUT  # DeepSeek-V4: v4 | v41 | v41_new | uniform_fp8
    decoder_replay: bool = False  # DeepSeek-V4.1's decoder SWA bounded replay runs
    kv_sources: tuple[int, ...] = ()  # DeepSeek-V4.1's KV-source layers (model layer ids)
    compress_ratios: tuple[int, ...] = ()  # DeepSeek-V4: per model layer
    start_layer: int = 0  # the first local layer (pipeline parallelism)
    full_kv_unsupported: str | None = None  # SWAKVPool: why its Full side cannot be substituted
    standin: bool = False  # tests only: act on a DeepSeek-V4 layout not shown exact

    @property
    def dsv4(self) -> bool:
        return self.pool == geometry.DSV4_POOL


@dataclass(frozen=True)
class Decision:
    refusal: str | None  # None: the switch acts
    bound: int = 0
    tail_from: int | None = None  # decoder replay's first tail-only layer (DeepSeek-V4.1)

    @property
    def receipt(self) -> str:
        return "installed" if self.refusal is None else f"refused: {self.refusal}"


def dsv4_unsupported(facts: CacheFacts) -> str | None:
    """Why the cone cannot be exact on this DeepSeek-V4 pool (None: it acts); one line each."""
    if facts.unified_kv:
        return UNIFIED_KV
    if facts.request_window:
        return ENCODER_REPLAY
    if facts.standin or facts.kv_layout == VERIFIED_LAYOUT:
        return None
    return (f"DeepSeek-V4 KV layout {facts.kv_layout}: cone replay's exactness is shown on the {VERIFIED_LAYOUT} "
            "layout (584 B rows) only; the engine stays stock")


def decide(facts: CacheFacts) -> Decision:
    """The switch's decision when the cache is built (every refusal of the switch docstring)."""
    if facts.radix_disabled:
        return Decision("the radix cache is disabled; nothing to replay")
    if not facts.swa_tree:
        # Never silently inert: a tree without an SWA component has no evicted windows to replay.
        why = "the prefix tree has no SWA component"
        if facts.request_window:
            why += (" (--enable-encoder-swa-bounded-replay keeps SWA in per-request window rings and replays "
                    "min(prefix, 128) tokens on every hit itself)")
        return Decision(f"{why}; nothing to replay")
    if not facts.swa_gates_match:
        return Decision("the tree's SWA component does not gate prefix matches (a per-request SWA ring, or paged SWA "
                        "beside the encoder-replay request window): no match stops at an evicted window")
    window, page, layers = facts.window, facts.page, facts.swa_layers
    if layers is None or layers <= 0 or window <= 0:
        return Decision(f"cannot read the sliding window ({window}) or its layer count from {facts.pool}")
    if facts.dsv4 and facts.unified_kv:
        return Decision(UNIFIED_KV)
    # Decoder SWA bounded replay runs the last KV-source layer and every later one on each extend's
    # tail only (``DeepseekV4Model.__init__``: ``late_layer_start = last_source`` with
    # ``tail_writes_source_kv``); a V4 pool has no KV source, so the tail cannot be told.
    tail_start = (max(facts.kv_sources) if facts.kv_sources else None) if facts.dsv4 and facts.decoder_replay else None
    if facts.dsv4 and facts.decoder_replay and tail_start is None:
        return Decision(NO_TAIL_LAYER)
    bound = _bound(facts, tail_start)
    if facts.tokens % page:
        return Decision(f"{TOKENS_KEY}={facts.tokens} is not a multiple of the page size {page}", bound, tail_start)
    if facts.tokens < bound:
        return Decision(f"{TOKENS_KEY}={facts.tokens} < bound={bound} (window {window}, page {page}, {layers} "
                        f"sliding-window layers): set it to at least {bound}", bound, tail_start)
    # Without the forward side the replay rows' own Full-side K/V leak into every row from F on
    # (tests/upstream/test_cone_replay_exactness.py): never run inexact, stay stock.
    why = dsv4_unsupported(facts) if facts.dsv4 else facts.full_kv_unsupported
    return Decision(why, bound, tail_start)


def _bound(facts: CacheFacts, tail_start: int | None) -> int:
    layers = int(facts.swa_layers or 0)
    if not facts.dsv4:
        return geometry.cone_bound(facts.window, facts.page, layers)
    ratios, start = facts.compress_ratios, facts.start_layer
    local = list(ratios[start : start + layers]) if len(ratios) >= start + layers else None
    tail_from = None if tail_start is None else tail_start - start
    return geometry.cone_bound_dsv4(facts.window, facts.page, layers, ratios=local, tail_from=tail_from)


def facts_of_pool(kvpool: Any, *, tokens: int, window: int, page: int, decoder_replay: bool = False,
                  standin: bool = False) -> CacheFacts:
    """:class:`CacheFacts` of a tree with an SWA component that gates matches, on ``kvpool``."""
    from adapter.switches.cone_replay.forward import swa_kv_pool_unsupported

    dsv4 = geometry.is_dsv4_pool(kvpool)
    layout = getattr(getattr(kvpool, "kv_layout", None), "value", str(getattr(kvpool, "kv_layout", None)))
    return CacheFacts(
        tokens=tokens,
        pool=type(kvpool).__name__,
        window=window,
        page=page,
        swa_layers=geometry.swa_layer_count(kvpool),
        request_window=getattr(kvpool, "request_window", None) is not None,
        unified_kv=bool(getattr(kvpool, "_unified_kv", False)),
        kv_layout="uniform_fp8" if getattr(kvpool, "uniform_fp8", False) else layout,
        decoder_replay=decoder_replay,
        kv_sources=tuple(int(x) for x in getattr(kvpool, "kv_source_layers", None) or ()),
        compress_ratios=tuple(int(r) for r in getattr(kvpool, "compression_ratios", None) or ()),
        start_layer=int(getattr(kvpool, "start_layer", 0) or 0),
        full_kv_unsupported=None if dsv4 or kvpool is None else swa_kv_pool_unsupported(kvpool),
        standin=standin,
    )


def facts_of_cache(cache: Any, tokens: int, standin: bool) -> CacheFacts:
    """Read :class:`CacheFacts` from a built ``UnifiedRadixCache`` and its pool."""
    from dataclasses import replace

    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    kvpool = cache.token_to_kv_pool_allocator.get_kvcache() if cache.token_to_kv_pool_allocator else None
    facts = facts_of_pool(kvpool, tokens=tokens, window=int(cache._sliding_window_size or 0),
                          page=int(cache.page_size), standin=standin,
                          decoder_replay=bool(getattr(cache, "decoder_swa_bounded_replay", False)))
    if cache.disable or not cache.is_swa_enabled:
        return replace(facts, radix_disabled=bool(cache.disable), swa_tree=False)
    swa = cache.components.get(ComponentType.SWA)
    return replace(facts, swa_gates_match=swa is None or bool(swa.gates_prefix_match))
