"""Cone replay (issue 5, ``DSV41_SWA_CONE_REPLAY=1``): a lost SWA resume point costs N recomputed tokens.

What it changes. When a request's prefix match stops early only because the sliding window at its
resume point F (``MatchResult.swa_branching_seqlen``) was evicted while the Full KV of ``[0, F)``
is still resident, stock SGLang 0.5.23 re-prefills ``[P, L)`` from the stock match point P (often
0): 21.8-68.3 s for 130-400K-token prompts on the reference fleet. With the switch the request is
matched on Full KV up to ``s = page_floor(F - N)`` and prefills ``[s, L)``:

* plan (``UnifiedRadixCache.match_prefix``): anchor at F's node (found by the Full-only
  ``tree_core.match_full_device_prefix``, on both tree cores) with prefix s, keeping
  ``swa_branching_seqlen = F`` so the first checkpoint inserts exactly ``[0, F)`` and re-publishes
  F's window from the replay's SWA. The stock result is kept on the request to fall back to.
  One line per plan: ``DSV41_SWA_CONE plan rid=.. F=.. s=.. N=..``.
* admission (``PrefillAdder._select_prefill_admission``): the first prefill pass must be one
  chunk covering ``[s, F)``; otherwise the stock match is restored, the selection re-run and the
  reason logged (``DSV41_SWA_CONE fallback rid=.. reason=..``). The request's lock on F's node
  (``_commit_prefill_admission`` locks ``req.last_node``) keeps the copy source resident.
* copy (``ScheduleBatch.prepare_for_extend``, after ``alloc_for_extend`` wrote the rows): the
  resident Full-side KV of ``[s, F)`` is copied page by page into the replay rows' fresh pages.
  One line per replay: ``DSV41_SWA_CONE copy rid=.. pages=.. bytes=..``.
* write mask and window floor (forward side: ``ForwardBatch.init_new`` finds the replay rows,
  ``ModelRunner.forward`` publishes them for its duration, ``RadixAttention.forward`` applies them):
  the replay rows ``[s, F)`` must not let their own (inexact) Full-side K/V reach any row from F on.
  SGLang's extend kernels read the extend rows' K/V from the forward's own ``k``/``v`` tensors,
  not from the cache, so masking the cache write alone would not do it. On ``SWAKVPool`` the
  switch therefore replaces, in every Full-attention layer, the replay rows' ``k``/``v`` with the
  resident Full KV of ``[s, F)`` read from F's locked tree pages before the backend sees them:
  every row from F on reads exactly what a prefix hit at F reads, and the rows' cache write
  stores the copied bytes again (the same effect as sending it to the padding slot). Sliding-
  window layers are untouched. Their window has no per-row floor in SGLang's SWAKVPool backends;
  a replay row below ``s + W`` reads the evicted positions below s as the SWA padding slot (the
  allocator points a freed SWA slot's mapping at slot 0), which changes only rows inside the
  cone, and the bound keeps every row from F on out of their reach
  (``tests/upstream/test_cone_replay_exactness.py`` proves both, with a floor and with padding reads).
  A batch with replay rows never runs in a prefill CUDA graph (``can_run_graph`` is False for
  it), because a graph would replay attention without the substitution.
  DeepSeek-V4 (:func:`dsv4_forward_fields`: ``encoder_swa_compress_rows`` masking
  ``[s, F - align_up(W, page))`` so the last rows before F write the compressor states, and the
  per-row ``encoder_swa_row_floor``) is computed and tested at its seams only: its backend cannot
  run here, so on DeepSeek-V4 pools the switch refuses at cache build (GPU-unverified) unless the
  test-only ``DSV41_SWA_CONE_FORWARD_STANDIN=1`` says the caller's forward applies them itself.
  It never replays inexactly.

The bound. A row's hidden state after k sliding-window layers depends on at most the k*W rows
before it (SGLang's window: ``r - j < W``); Full-attention layers read the copied, exact Full KV.
Rows >= F read the window ``[F - W, F)`` of every SWA layer, computed from the input of that
layer, so they are exact when ``F - s >= L_swa * W``. Rounding the first window to a page (the
compressor states and the last page before F are written by whole pages) and the total to a page
gives ``align_up(align_up(W, page) + (L_swa - 1) * W, page)``, the shape of sglang #31713's
recompute window (the issue's formula). One page more is needed: the request's first checkpoint
re-publishes the replay's own SWA KV of the last ``align_up(W, page) + page`` rows before F, not
only F's window (measured on the real cache for five geometries; ``tests/upstream/test_cone_replay_tree.py``
checks it), and a later request that resumes one page below F reads that extra page. At the
issue's formula its top SWA layers are inexact in three of the five exactness cases
(``tests/upstream/test_cone_replay_exactness.py``), so ``bound = align_up(align_up(W, page) + (L_swa - 1) *
W, page) + page``. The bound is computed when the cache is built (the pools are sized from the
loaded model config: W, page and the number of sliding-window layers). At import the switch
logs ``cone_replay armed N=..``; once the cache is built it logs ``cone_replay installed N=..
bound=.. window=.. page=.. swa_layers=..``, or ``cone_replay refused: ..`` when N < bound, N is
not a multiple of the page, the pool's layout cannot be replayed exactly, or the tree has no SWA
component (a boot failure under ``DSV41_STRICT=1``).
Local pool layers are counted: under pipeline parallelism a stage sees only its own layers.

Rollback: unset ``DSV41_SWA_CONE_REPLAY`` (and ``DSV41_SWA_CONE_TOKENS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapter.core import api

SWITCH = api.handle(__name__)
TOKENS_KEY = "DSV41_SWA_CONE_TOKENS"
REQ_ATTR = "_dsv41_cone"  # the plan of one request (set on its Req)
CACHE_ATTR = "_dsv41_cone_cfg"  # the checked geometry of one cache (set on the UnifiedRadixCache)

FORWARD_ATTR = "_dsv41_cone_rows"  # (batch rows, F's tree slots) of one forward's replay rows
# The replay rows of the forward running now. A field-less attribute does not survive the runners'
# copies of the live ForwardBatch (dataclasses.replace into static buffers), so ModelRunner.forward
# publishes it here for its duration; forwards of one process never overlap.
_ACTIVE: list[Any] = [None]

# Plan states: planned (match) -> admitted (first chunk covers [s, F)) -> copied (rows filled)
# -> forwarded (its ForwardBatch carries the replay rows).
PLANNED, ADMITTED, COPIED, FORWARDED = "planned", "admitted", "copied", "forwarded"


def align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def cone_bound(window: int, page: int, swa_layers: int) -> int:
    """The smallest replay depth that keeps rows >= F exact (see the module docstring)."""
    if window <= 0 or page <= 0 or swa_layers <= 0:
        raise ValueError(f"cone_bound needs a positive window, page and layer count: {window}, {page}, {swa_layers}")
    return align_up(align_up(window, page) + (swa_layers - 1) * window, page) + page


def cone_start(F: int, N: int, page: int) -> int:
    """s = page_floor(F - N), never below 0."""
    return max(0, (F - N) // page * page)


def forward_rows(s: int, F: int) -> dict[str, Any]:
    """What the forward of a cone's first pass needs: rows ``[s, F)`` write no Full-side KV (the
    copy is kept), and the sliding window of the request's rows is floored at s."""
    return {"mask": (s, F), "floor": s}


def dsv4_forward_fields(rows: list[tuple[int, int, Any]], window: int, page: int) -> tuple[Any, Any]:
    """DeepSeek-V4's forward seams for one extend batch: ``(encoder_swa_compress_rows,
    encoder_swa_row_floor)``, the two ``ForwardBatch`` fields the encoder SWA replay fold already
    feeds to ``DeepseekV4AttnBackend`` (``_compressor_out_loc`` sends rows outside
    ``compress_rows`` to slot 0; the floor bounds each row's window).

    ``rows``: per request ``(prefix_len, extend_len, plan or None)`` in batch order. A cone's rows
    ``[s, F - align_up(W, page))`` are masked; its last ``align_up(W, page)`` rows before F write
    normally so the compressor state rings (paired with SWA pages) hold F's state. Those rows are
    exact by the cone argument: the bound's first term, ``align_up(W, page)``, pays for them."""
    import torch

    keep, floor = [], []
    for prefix, extend, plan in rows:
        pos = torch.arange(prefix, prefix + extend, dtype=torch.int64)
        if plan is None:
            keep.append(torch.ones(extend, dtype=torch.bool))
            floor.append(torch.zeros(extend, dtype=torch.int32))
            continue
        lo, hi = plan.s, plan.F - align_up(window, page)
        keep.append(~((pos >= lo) & (pos < hi)))
        floor.append(torch.full((extend,), plan.s, dtype=torch.int32))
    mask = torch.cat(keep) if keep else torch.zeros(0, dtype=torch.bool)
    return torch.nonzero(mask).flatten(), (torch.cat(floor) if floor else torch.zeros(0, dtype=torch.int32))


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
    state: str = PLANNED
    source: Any = None  # F's tree slots of [s, F) (the copy source; locked through the anchor)


@dataclass
class Counters:
    plans: int = 0
    admitted: int = 0
    copies: int = 0
    copied_pages: int = 0
    copied_bytes: int = 0
    forwards: int = 0  # forward batches that carried replay rows
    substituted_layers: int = 0  # Full-attention layer calls whose replay rows read the resident KV
    fallbacks: int = 0

    def reset(self) -> None:
        self.__init__()


COUNTERS = Counters()
FALLBACKS: dict[str, int] = {}  # reason -> count (bench and tests)
_TOKENS: list[int] = []  # N, set by install
_COPIED: list[int] = [0]  # copied plans whose forward is not built yet (decode batches skip the scan)
STANDIN_KEY = "DSV41_SWA_CONE_FORWARD_STANDIN"
_STANDIN: list[bool] = [False]  # DeepSeek-V4 pools: the caller's forward applies mask + floor (tests, bench)


# -- geometry -------------------------------------------------------------------------------------
def swa_layer_count(kvpool: Any) -> int | None:
    """Sliding-window layers of the model behind ``kvpool``: ``SWAKVPool`` keeps them apart from
    its Full layers; every DeepSeek-V4 layer has a sliding window (its compressed caches are the
    Full side). None when the pool is of neither family."""
    if kvpool is None:
        return None
    if hasattr(kvpool, "swa_layer_nums"):
        return int(kvpool.swa_layer_nums)
    if type(kvpool).__name__ == "DeepSeekV4TokenToKVPool":
        return int(kvpool.layer_num)
    return None


def _check_cache(cache: Any) -> ConeConfig:
    tokens = _TOKENS[0] if _TOKENS else 0
    if cache.disable or not cache.is_swa_enabled:
        # Never silently inert: a tree without an SWA component (radix cache off, a model without
        # sliding windows, or DeepSeek-V4 under --enable-encoder-swa-bounded-replay, whose tree keeps
        # only Full KV) has no evicted windows to replay.
        why = "the radix cache is disabled" if cache.disable else "the prefix tree has no SWA component"
        return _refuse_late(ConeConfig(False, tokens), f"{why}; nothing to replay")
    window, page = int(cache._sliding_window_size or 0), int(cache.page_size)
    kvpool = cache.token_to_kv_pool_allocator.get_kvcache()
    layers = swa_layer_count(kvpool)
    if layers is None or window <= 0:
        return _refuse_late(ConeConfig(False, tokens, window=window, page=page),
                            f"cannot read the sliding window ({window}) or its layer count from {type(kvpool).__name__}")
    if getattr(kvpool, "_unified_kv", False):
        return _refuse_late(ConeConfig(False, tokens, window=window, page=page),
                            "DeepSeek-V4 unified KV ring: its Full side has no pages of its own to copy")
    bound = cone_bound(window, page, layers)
    cfg = ConeConfig(True, tokens, bound, window, page, layers)
    if tokens % page:
        return _refuse_late(cfg, f"{TOKENS_KEY}={tokens} is not a multiple of the page size {page}")
    if tokens < bound:
        return _refuse_late(cfg, f"{TOKENS_KEY}={tokens} < bound={bound} (window {window}, page {page}, "
                                 f"{layers} sliding-window layers): set it to at least {bound}")
    why = _forward_unsupported(kvpool)
    if why is not None and not _STANDIN[0]:
        # Without the forward side the replay rows' own Full-side K/V leak into every row from F on
        # (tests/upstream/test_cone_replay_exactness.py): never run inexact, stay stock.
        return _refuse_late(cfg, why)
    SWITCH.confirm(N=tokens, bound=bound, window=window, page=page, swa_layers=layers)
    return cfg


def _forward_unsupported(kvpool: Any) -> str | None:
    """Why the forward side cannot run on this pool (None: it can)."""
    name = type(kvpool).__name__
    if name == "DeepSeekV4TokenToKVPool":
        return ("the DeepSeek-V4 forward seams (encoder_swa_compress_rows, the row floor in make_core_attn_metadata) "
                "are GPU-unverified and not wired; the engine stays stock")
    full = getattr(kvpool, "full_kv_pool", None)
    if full is None or not hasattr(full, "k_buffer"):
        return f"the Full side of {name} ({type(full).__name__}) is not an MHA pool; only MHA Full layers are substituted"
    if getattr(full, "store_dtype", full.dtype) != full.dtype or full.dtype.itemsize == 1:
        return f"the Full KV cache is quantized ({full.dtype}); the replay rows' K/V cannot be read back exactly"
    return None


def _refuse_late(cfg: ConeConfig, reason: str) -> ConeConfig:
    """The bound is known only once the pools exist: refuse then, as the boot would have."""
    cfg.enabled, cfg.reason = False, reason
    SWITCH.refuse_late(reason)
    return cfg


def cache_config(cache: Any) -> ConeConfig | None:
    return getattr(cache, CACHE_ATTR, None)


# -- plan -----------------------------------------------------------------------------------------
def _fallback(req: Any, reason: str, **fields: Any) -> None:
    COUNTERS.fallbacks += 1
    FALLBACKS[reason] = FALLBACKS.get(reason, 0) + 1
    SWITCH.event("DSV41_SWA_CONE fallback", rid=req.rid, reason=reason, **fields)


def _plan(cache: Any, params: Any, result: Any) -> Any:
    req, F = params.req, result.swa_branching_seqlen
    previous = getattr(req, REQ_ATTR, None) if req is not None else None
    if previous is not None and previous.state in (PLANNED, FORWARDED):  # unadmitted, or spent
        setattr(req, REQ_ATTR, None)
    cfg = cache_config(cache)
    if req is None or F is None or cfg is None or not cfg.enabled:
        return result
    P = int(result.device_prefix_len)
    s = cone_start(F, cfg.tokens, cfg.page)
    if s <= P:  # the stock resume point is as good: nothing to save
        return result
    key = params.key
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    urc = __import__(SWITCH.module_of("UnifiedRadixCache.match_prefix"), fromlist=["get_disagg"])
    why = None
    if result.host_hit_length or result.swa_host_hit_length or cache.host_pool_group is not None:
        why = "hicache"
    elif cache.linker is not None:
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
        if f_len < F:
            why = "full_not_resident"
    if why is not None:
        if getattr(req, REQ_ATTR + "_why", None) != (why, F):  # once per request and reason
            setattr(req, REQ_ATTR + "_why", (why, F))
            _fallback(req, why, F=F, P=P)
        return result
    protected = result.cache_protected_len
    plan = ConePlan(req.rid, F, s, P, anchor, result, P if protected is None else int(protected))
    setattr(req, REQ_ATTR, plan)
    if previous is None or (previous.F, previous.s) != (F, s):  # a waiting request is matched every round
        COUNTERS.plans += 1
        SWITCH.event("DSV41_SWA_CONE plan", rid=req.rid, F=F, s=s, N=F - s, P=P)
    return result._replace(
        device_prefix_len=s, last_device_node=anchor, last_host_node=anchor, best_match_node=anchor,
        cache_protected_len=None if protected is None else s,
    )


def admit(req: Any, prefix_len: int, extend_len: int) -> bool:
    """The admission rule: keep the cone only if the first pass is one chunk covering ``[s, F)``;
    otherwise restore the stock match and log why. True when the cone stays."""
    plan = getattr(req, REQ_ATTR)
    if prefix_len == plan.s and prefix_len + extend_len >= plan.F:
        plan.state = ADMITTED
        COUNTERS.admitted += 1
        return True
    _fallback(req, "first_chunk_short", F=plan.F, s=plan.s, chunk=extend_len)
    _restore_stock(req, plan)
    return False


def _restore_stock(req: Any, plan: ConePlan) -> None:
    """Put back what ``match_kv_cache`` / ``init_next_round_input`` set from the stock match."""
    stock = plan.stock
    req.prefix_len = int(stock.device_prefix_len)
    req.last_node, req.last_host_node, req.best_match_node = (
        stock.last_device_node, stock.last_host_node, stock.best_match_node)
    req.num_matched_prefix_tokens = min(req.num_matched_prefix_tokens, req.prefix_len)
    req.kv.cache_protected_len = plan.stock_protected
    setattr(req, REQ_ATTR, None)


# -- copy -----------------------------------------------------------------------------------------
def _full_side_buffers(kvpool: Any) -> list[tuple[Any, int]]:
    """The Full-side buffers of a pool as (tensor, rows per FULL page): ``SWAKVPool``'s Full MHA/MLA
    pool is slot-major (``page`` rows a page); DeepSeek-V4's compressed latents and index keys are
    page-row buffers (one row, or a run of index pages, per FULL page), the buffers its
    ``get_contiguous_buf_infos`` registers for PD transfer."""
    page = int(kvpool.page_size)
    if hasattr(kvpool, "full_kv_pool"):
        full = kvpool.full_kv_pool
        bufs = []
        for name in ("k_buffer", "v_buffer", "kv_buffer", "k_scale_buffer", "v_scale_buffer"):
            for buf in getattr(full, name, None) or []:
                bufs.append((buf, page))
        return bufs
    if type(kvpool).__name__ == "DeepSeekV4TokenToKVPool":
        if getattr(kvpool, "_unified_kv", False):  # refused at cache build (_check_cache)
            raise TypeError("cone copy: DeepSeek-V4 unified KV ring")
        bufs = []
        for ratio, kv in kvpool.kv_pools.items():
            if kv is not None:
                bufs.extend((buf, 1) for buf in kv.kv_buffer)
            index = kvpool.index_pools.get(ratio)
            if index is None:
                continue
            rows = (page // ratio) // index.page_size if ratio in (1, 2) else 1
            bufs.extend((buf, rows) for buf in index.contiguous_page_row_buffers())
        return bufs
    raise TypeError(f"cone copy: unknown pool family {type(kvpool).__name__} (refused at cache build)")


def copy_full_pages(kvpool: Any, src: Any, dst: Any) -> tuple[int, int]:
    """Copy the Full-side KV of the page-aligned slots ``src`` onto ``dst``; (pages, bytes)."""
    import torch

    page = int(kvpool.page_size)
    src, dst = src.to(torch.int64), dst.to(torch.int64)
    n = src.numel()
    assert n == dst.numel() and n % page == 0, (n, dst.numel(), page)
    src_pages, dst_pages = src[::page] // page, dst[::page] // page
    # Whole pages only: the tree's pages and the fresh ones are page-aligned runs.
    ar = torch.arange(page, dtype=torch.int64)
    assert torch.equal(src, (src_pages[:, None] * page + ar).flatten()), "cone source is not whole pages"
    assert torch.equal(dst, (dst_pages[:, None] * page + ar).flatten()), "cone destination is not whole pages"
    nbytes = 0
    for buf, rows in _full_side_buffers(kvpool):
        if rows == page:  # slot-major
            s_idx, d_idx = src.to(buf.device), dst.to(buf.device)
        else:  # page rows
            r = torch.arange(rows, dtype=torch.int64)
            s_idx = (src_pages[:, None] * rows + r).flatten().to(buf.device)
            d_idx = (dst_pages[:, None] * rows + r).flatten().to(buf.device)
        buf[d_idx] = buf[s_idx]
        nbytes += int(buf[0].nbytes) * int(s_idx.numel())
    return int(src_pages.numel()), nbytes


def copy_replay_rows(cache: Any, req_to_token: Any, row: int, plan: ConePlan) -> tuple[int, int]:
    """The cone's copy: tree pages of ``[s, F)`` (on the anchored path) -> the row's fresh pages."""
    src = cache.path_device_indices(plan.anchor)[plan.s : plan.F]
    dst = req_to_token[row, plan.s : plan.F]
    pages, nbytes = copy_full_pages(cache.token_to_kv_pool_allocator.get_kvcache(), src, dst)
    plan.state, plan.source = COPIED, src
    _COPIED[0] += 1
    COUNTERS.copies += 1
    COUNTERS.copied_pages += pages
    COUNTERS.copied_bytes += nbytes
    SWITCH.event("DSV41_SWA_CONE copy", rid=plan.rid, pages=pages, bytes=nbytes)
    return pages, nbytes


# -- wrappers -------------------------------------------------------------------------------------
def _cache_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    out = wrapped(*args, **kwargs)
    setattr(instance, CACHE_ATTR, _check_cache(instance))
    return out


def _match_prefix(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    result = wrapped(*args, **kwargs)
    params = args[0] if args else kwargs["params"]
    return _plan(instance, params, result)


def _select_admission(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    req = args[0] if args else kwargs["req"]
    plan = getattr(req, REQ_ATTR, None)
    if plan is None or plan.state != PLANNED or req.prefix_len != plan.s:
        return wrapped(*args, **kwargs)
    admission = wrapped(*args, **kwargs)
    if not hasattr(admission, "extend_len"):  # not admitted this round: matched again next round
        return admission
    if kwargs.get("host_hit_length"):  # excluded by the plan; never replay beside a load-back
        _fallback(req, "hicache", F=plan.F, s=plan.s)
        _restore_stock(req, plan)
    elif admit(req, admission.prefix_len, admission.extend_len):
        return admission
    # The caller priced the request from prefix s; the stock prefix is shorter.
    kwargs = dict(kwargs, total_tokens=kwargs["total_tokens"] + plan.s - plan.P)
    return wrapped(*args, **kwargs)


def _prepare_for_extend(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    out = wrapped(*args, **kwargs)
    for req in instance.reqs:
        plan = getattr(req, REQ_ATTR, None)
        if plan is None or plan.state != ADMITTED:
            continue
        if req.prefix_len == plan.s:
            copy_replay_rows(instance.tree_cache, instance.req_to_token_pool.req_to_token, req.kv.req_pool_idx, plan)
        else:  # not the pass it was admitted for (retracted and re-matched): no replay
            setattr(req, REQ_ATTR, None)
    return out


def replay_rows(batch: Any) -> tuple[Any, Any] | None:
    """The replay rows of one extend batch: (row indices in the batch's token order, the tree
    slots of ``[s, F)`` they read their Full-side K/V from); None when it has none. Marks the
    plans spent: a later pass of the same request is an ordinary extend."""
    import torch

    if not batch.forward_mode.is_extend() or batch.prefix_lens is None:
        return None
    rows, slots, start = [], [], 0
    for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        plan = getattr(req, REQ_ATTR, None)
        if plan is not None and plan.state == COPIED and prefix == plan.s:
            rows.append(torch.arange(start, start + plan.F - plan.s, dtype=torch.int64))
            slots.append(plan.source.to(torch.int64))
            plan.state = FORWARDED
            _COPIED[0] = max(0, _COPIED[0] - 1)
        start += extend
    if not rows:
        return None
    device = batch.out_cache_loc.device
    return torch.cat(rows).to(device), torch.cat(slots).to(device)


def _forward_batch_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    forward_batch = wrapped(*args, **kwargs)
    batch = args[0] if args else kwargs["batch"]
    cone = replay_rows(batch) if _COPIED[0] else None
    if cone is not None:
        model_runner = args[1] if len(args) > 1 else kwargs["model_runner"]
        cone = (*cone, model_runner.token_to_kv_pool)
        setattr(forward_batch, FORWARD_ATTR, cone)
        COUNTERS.forwards += 1
        SWITCH.event("DSV41_SWA_CONE forward", rows=int(cone[0].numel()))
    return forward_batch


def substitute_full_kv(layer: Any, k: Any, v: Any, cone: tuple[Any, Any, Any]) -> tuple[Any, Any]:
    """In a Full-attention layer of ``SWAKVPool``, the replay rows' K/V become the resident Full KV
    of ``[s, F)`` (F's tree slots); sliding-window layers are returned unchanged.
    ``cone``: (rows, slots, pool) as :func:`replay_rows` and the model runner's pool give them."""
    rows, slots, pool = cone
    mapping = getattr(pool, "layers_mapping", None)
    if mapping is None or mapping[layer.layer_id][1]:
        return k, v
    key_buffer, value_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    k = k.reshape(k.shape[0], *key_buffer.shape[1:]).clone()
    v = v.reshape(v.shape[0], *value_buffer.shape[1:]).clone()
    k[rows] = key_buffer[slots].to(k.dtype)
    v[rows] = value_buffer[slots].to(v.dtype)
    COUNTERS.substituted_layers += 1
    return k, v


def _model_forward(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    forward_batch = args[0] if args else kwargs["forward_batch"]
    cone = getattr(forward_batch, FORWARD_ATTR, None)
    if cone is None:
        return wrapped(*args, **kwargs)
    _ACTIVE[0] = cone
    try:
        return wrapped(*args, **kwargs)
    finally:
        _ACTIVE[0] = None


def _attention_forward(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    cone = _ACTIVE[0]
    if cone is None or instance.is_cross_attention:
        return wrapped(*args, **kwargs)
    q = args[0] if args else kwargs["q"]
    k = args[1] if len(args) > 1 else kwargs["k"]
    v = args[2] if len(args) > 2 else kwargs["v"]
    if k is None or "k_rope" in kwargs:  # KV-shared layer, or MLA (refused at cache build)
        return wrapped(*args, **kwargs)
    k, v = substitute_full_kv(instance, k, v, cone)
    forward_batch = args[3] if len(args) > 3 else kwargs["forward_batch"]
    rest = {key: val for key, val in kwargs.items() if key not in ("q", "k", "v", "forward_batch")}
    return wrapped(q, k, v, forward_batch, *args[4:], **rest)


def _can_run_graph(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    if _ACTIVE[0] is not None:
        return False  # a graph would replay attention without the substitution
    return wrapped(*args, **kwargs)


def install(ctx: api.SwitchContext) -> dict[str, Any]:
    SWITCH.bind(ctx)
    tokens = int(ctx.option(TOKENS_KEY))
    if tokens <= 0:
        raise api.Refusal(f"{TOKENS_KEY}={tokens} must be positive")
    _TOKENS[:] = [tokens]
    _STANDIN[0] = bool(ctx.option(STANDIN_KEY))
    for target, wrapper in (
        ("UnifiedRadixCache.__init__", _cache_init),
        ("UnifiedRadixCache.match_prefix", _match_prefix),
        ("PrefillAdder._select_prefill_admission", _select_admission),
        ("ScheduleBatch.prepare_for_extend", _prepare_for_extend),
        ("ForwardBatch.init_new", _forward_batch_init),
        ("RadixAttention.forward", _attention_forward),
        ("PrefillCudaGraphRunner.can_run_graph", _can_run_graph),
        ("ModelRunner.forward", _model_forward),
    ):
        ctx.wrap(target, wrapper)
    ctx.decide_later()  # installed or refused once a cache is built and its geometry is known
    return {"N": tokens}


def reset_counters() -> None:
    COUNTERS.reset()
    FALLBACKS.clear()
    _COPIED[0] = 0
    _ACTIVE[0] = None


