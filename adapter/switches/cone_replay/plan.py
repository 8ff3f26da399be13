"""Cone replay's plan and admission: which requests replay, from where, and when they fall back.

* :func:`plan` (after ``UnifiedRadixCache.match_prefix``): a match stopped only by an evicted SWA
  window at F (``swa_branching_seqlen``) with the Full KV of ``[0, F)`` resident becomes a match
  at ``s = page_floor(F - N)`` anchored on F's node (``tree_core.match_full_device_prefix``); the
  stock ``MatchResult`` is kept on the request to fall back to. Beside HiCache the stock admission
  loads host copies back up to ``best_match_node`` (its depth B): the cone plans only when s lies
  past B, with no host hit in its match (no stock load-back queued). Where the Full KV of
  ``[D, F)`` sits on host only (D: the deepest node with Full KV on device), the anchor is F's host
  node (the match walk's last node) and ``plan.load = F - D``: the admission loads that Full KV
  back through HiCache (:mod:`.hicache`) before the copy.
* :func:`admit` (after ``PrefillAdder._select_prefill_admission``): the first prefill pass must be
  one chunk covering ``[s, F)``; a chunk cut short by the requests admitted before it in the same
  pass waits for the next pass, once per request and F; else the stock match is restored and the
  reason logged.

Plan states: planned (match) -> admitted (first chunk covers [s, F)) -> copied (rows filled) ->
forwarded (its ForwardBatch carries the replay rows); or planned -> stock (fell back: the request is
detached from the plan and admitted again from the stock match).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapter.core import api
from adapter.switches.cone_replay.geometry import cache_config, cone_start

SWITCH = api.handle(__name__)
REQ_ATTR = "_dsv41_cone"  # the plan of one request (set on its Req)
NO_LOAD_ATTR = "_dsv41_cone_no_load"  # F of a request whose cone load-back fell back (runs stock)
WAITED_ATTR = "_dsv41_cone_waited"  # F of a request whose short first chunk waited a pass
PLANNED, ADMITTED, COPIED, FORWARDED = "planned", "admitted", "copied", "forwarded"
STOCK = "stock"  # fell back: the stock match restored, to be admitted from the top
WAIT = "wait"  # admission: not this pass (nothing committed), the plan kept for the next


@dataclass
class ConePlan:
    """One request's cone: resume point F, replay start s, stock prefix P, anchor at F."""

    rid: str
    F: int
    s: int
    P: int
    anchor: Any  # F's node (NodeId / TreeNode), Full-only match
    stock: Any  # the stock MatchResult, to fall back to
    stock_protected: int  # the stock cache_protected_len
    B: int = 0  # HiCache: the stock resume point after its load-back (P without HiCache)
    state: str = PLANNED
    source: Any = None  # F's tree slots of [s, F) (the copy source; locked through the anchor)
    load: int = 0  # HiCache: Full tokens [F - load, F) on host only, loaded back at admission


@dataclass
class Counters:
    plans: int = 0
    admitted: int = 0
    copies: int = 0
    copied_pages: int = 0
    copied_bytes: int = 0
    forwards: int = 0  # forward batches that carried replay rows
    substituted_layers: int = 0  # Full-attention layer calls whose replay rows read the resident KV
    masked_rows: int = 0  # DeepSeek-V4: replay rows whose compressor / indexer writes went to slot 0
    fallbacks: int = 0
    waits: int = 0  # first chunks cut short by the pass's earlier requests that waited a pass
    loads: int = 0  # HiCache: plans whose Full KV of [D, F) was loaded back from host
    loaded_tokens: int = 0

    def reset(self) -> None:
        self.__init__()


COUNTERS = Counters()
FALLBACKS: dict[str, int] = {}  # reason -> count (bench and tests)


class Live:
    """The switch's state in this process (one scheduler a process), set by install and read on the
    scheduler's and the forward's paths."""

    __slots__ = ("active", "copied", "loading", "standin", "tokens")

    def __init__(self) -> None:
        self.tokens = 0  # N, set by install
        self.standin = False  # DeepSeek-V4 layouts not shown exact: act anyway (tests only)
        self.copied = 0  # copied plans whose forward is not built yet (decode batches skip the scan)
        self.active: Any = None  # the replay rows of the forward running now (forward.py)
        self.loading: list[Any] | None = None  # the cone's load-back running now: [node id, spec tokens seen]

    def reset_flight(self) -> None:
        """Forget what is in flight (plans copied, a forward, a load-back); keep what install set."""
        self.copied, self.active, self.loading = 0, None, None


LIVE = Live()


def fallback(req: Any, reason: str, **fields: Any) -> None:
    COUNTERS.fallbacks += 1
    FALLBACKS[reason] = FALLBACKS.get(reason, 0) + 1
    SWITCH.event("DSV41_SWA_CONE fallback", rid=req.rid, reason=reason, **fields)


def plan(cache: Any, params: Any, result: Any) -> Any:
    req, F = params.req, result.swa_branching_seqlen
    previous = getattr(req, REQ_ATTR, None) if req is not None else None
    if previous is not None and previous.state in (PLANNED, FORWARDED):  # unadmitted, or spent
        setattr(req, REQ_ATTR, None)
    cfg = cache_config(cache)
    if req is None or F is None or cfg is None or not cfg.enabled:
        return result
    P = int(result.device_prefix_len)
    s = cone_start(F, cfg.tokens, cfg.page)
    hicache = cache.cache_controller is not None
    # HiCache: the stock admission loads the host copies up to best_match_node, so its resume point
    # is that node's depth B, not P.
    B = _stock_resume_point(cache, result) if hicache else P
    if s <= B:  # the stock resume point is as good: nothing to save
        return result
    key = params.key
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    urc = __import__(SWITCH.module_of("UnifiedRadixCache.match_prefix"), fromlist=["get_disagg"])
    why, load, device_node = None, 0, None
    if cache.linker is not None:
        why = "linker"
    elif urc.get_disagg().disaggregation_mode == "decode":
        why = "pd_decode"
    elif not cache.components[ComponentType.SWA].gates_prefix_match:
        why = "swa_not_gating"
    elif key.is_bigram:
        why = "bigram_key"
    if why is None:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        anchor_key = RadixKey(token_ids=key.token_ids, extra_key=key.extra_key, limit=F, cache_salt=key.cache_salt)
        f_len, anchor, _pinned = cache.tree_core.match_full_device_prefix(anchor_key)
        if f_len < F and hicache and result.full_kv_hit_length >= F:
            # The Full KV of [f_len, F) sits on host only: the cone loads it back through HiCache,
            # Full component only (.hicache); the match walk's last node is F's node.
            if getattr(req, NO_LOAD_ATTR, None) == F:  # its load-back fell back: stock, once
                return result
            why = load_unsupported(cache, result.last_visited_node_id, F)
            if why is None:
                device_node, anchor, load = anchor, result.last_visited_node_id, F - f_len
        elif f_len < F:
            why = "full_not_resident"
    if why is not None:
        if getattr(req, REQ_ATTR + "_why", None) != (why, F):  # once per request and reason
            setattr(req, REQ_ATTR + "_why", (why, F))
            fallback(req, why, F=F, P=P, **({"B": B} if hicache else {}))
        return result
    protected = result.cache_protected_len
    plan = ConePlan(req.rid, F, s, P, anchor, result, P if protected is None else int(protected), B=B, load=load)
    setattr(req, REQ_ATTR, plan)
    if previous is None or (previous.F, previous.s, previous.load) != (F, s, load):  # matched every round
        COUNTERS.plans += 1
        extra = ({"B": B} if hicache else {}) | ({"load": load} if load else {})
        SWITCH.event("DSV41_SWA_CONE plan", rid=req.rid, F=F, s=s, N=F - s, P=P, **extra)
    # No stock load-back is queued (a stock host hit below s is superseded: the replay starts
    # deeper than its load-back would end). Without a load the prefix [0, s) is on device; with one
    # the request's device node is D's until the admission has loaded [D, F) (.hicache.load_full_kv).
    return result._replace(
        device_prefix_len=s, last_device_node=device_node if load else anchor, last_host_node=anchor,
        best_match_node=anchor,
        cache_protected_len=None if protected is None else s,
        host_hit_length=0, swa_host_hit_length=0, mamba_host_hit_length=0,
    )


def load_unsupported(cache: Any, host_node: Any, F: int) -> str | None:
    """Beside HiCache: why the cone cannot load F's Full KV through this cache (None: it can;
    :mod:`.hicache` names each reason)."""
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    if not isinstance(cache.tree_core, UnifiedTreeCore):
        return "load_back_rust_core"
    if getattr(cache, "buffer_pipeline", None) is not None:
        return "load_back_buffer_mode"
    if host_node is None:
        return "full_on_host"
    (path,) = cache.tree_core.collect_path_info([host_node])
    if not path or int(path[-1].path_end) != F:  # the walk's last node does not end at F
        return "full_on_host"
    return None


def _stock_resume_point(cache: Any, result: Any) -> int:
    """Depth of the stock match's ``best_match_node``: where the stock admission resumes after
    loading the host copies (``init_load_back`` splices everything between the last device node
    and it). Both tree cores answer ``collect_path_info``."""
    (path,) = cache.tree_core.collect_path_info([result.best_match_node])
    return int(path[-1].path_end) if path else 0


def admit(req: Any, prefix_len: int, extend_len: int, behind_others: bool) -> str:
    """The admission rule: keep the cone only if the first pass is one chunk covering ``[s, F)``
    (ADMITTED). A chunk cut short while requests admitted before it in this pass hold part of the
    pass's chunk budget (``behind_others``) waits one pass (WAIT), once per request and F: the next
    pass may give it the whole chunk, where falling back recomputes ``F - P`` tokens from the
    stock match instead of N. Otherwise restore the stock match and log why (STOCK)."""
    plan = getattr(req, REQ_ATTR)
    if prefix_len == plan.s and prefix_len + extend_len >= plan.F:
        plan.state = ADMITTED
        COUNTERS.admitted += 1
        return ADMITTED
    if behind_others and getattr(req, WAITED_ATTR, None) != plan.F:
        setattr(req, WAITED_ATTR, plan.F)
        COUNTERS.waits += 1
        SWITCH.event("DSV41_SWA_CONE wait", rid=req.rid, F=plan.F, s=plan.s, chunk=extend_len)
        return WAIT
    fallback(req, "first_chunk_short", F=plan.F, s=plan.s, chunk=extend_len)
    restore_stock(req, plan)
    return STOCK


def restore_stock(req: Any, plan: ConePlan) -> None:
    """Put back what ``match_kv_cache`` / ``init_next_round_input`` set from the stock match."""
    stock = plan.stock
    req.prefix_len = int(stock.device_prefix_len)
    req.last_node, req.last_host_node, req.best_match_node = (
        stock.last_device_node, stock.last_host_node, stock.best_match_node)
    req.host_hit_length, req.swa_host_hit_length, req.mamba_host_hit_length = (
        stock.host_hit_length, stock.swa_host_hit_length, stock.mamba_host_hit_length)
    req.num_matched_prefix_tokens = min(req.num_matched_prefix_tokens, req.prefix_len + req.host_hit_length)
    req.kv.cache_protected_len = plan.stock_protected
    plan.state = STOCK
    setattr(req, REQ_ATTR, None)
