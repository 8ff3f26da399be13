"""Cone replay's turn on the cache kit (:mod:`.cache_kit`) in the scheduler's steps, for a replay that
interleaves requests (``simulate``'s engine): admission by a real ``PrefillAdder`` through the
switch's wrapped ``_select_prefill_admission``, the cone's copy where the switch's
``ScheduleBatch.prepare_for_extend`` wrapper makes it, and the checkpoints, all SGLang's own. The
checkout's ``devkit.testkit.cone`` builds its whole-turn helpers and the model kit on these.

API::

    install(tokens, **keys)                       # cone replay (and keys) through the real boot path
    turn = start_turn(kit, tokens, out_len, chunk, budget=B)  # match, admission, first pass; None: not admitted
    prefill_pass(kit, turn, end)                  # the next pass [turn.pos, end) + its checkpoint
    end_turn(kit, turn, out_len, history=False)   # decode + release
    finish(kit, req)                              # release a finished request (its KV into the tree)

The switch must be installed before a kit is built (its ``UnifiedRadixCache.__init__`` hook checks
the bound).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from adapter.switches.cone_replay.copy import copy_replay_rows
from adapter.switches.cone_replay.plan import REQ_ATTR
from adapter.switches.cone_replay.switch import SWITCH, reset_counters
from overlay_tools.simulate.cache_kit import OUTPUT_TOKEN, CacheKit


@dataclass
class ConeTurn:
    rid: str
    stock_prefix: int  # P: what the stock match gave
    prefix_len: int  # the prefix the turn ran from (s on a cone, else P)
    F: int | None  # swa_branching_seqlen of the match
    plan: Any  # the ConePlan, or None
    recomputed: int  # prompt tokens prefilled
    checks: dict[str, Any] = field(default_factory=dict)
    history: list[int] = field(default_factory=list)
    req: Any = None  # the running Req (None once the turn has ended)
    pos: int = 0  # prompt tokens in the cache so far (the next pass starts here)
    passes: int = 0  # prefill passes run
    rem_input_tokens: int = 0  # the adder's --max-prefill-tokens budget left after admitting it


def install(tokens: int, **keys: str) -> Any:
    """Install cone replay with ``DSV41_SWA_CONE_TOKENS=tokens`` (and ``keys``) at once: the
    switch waits until every module it wraps has executed, which an engine has and a cache-only
    test or bench does not, so they are imported first."""
    import importlib

    from adapter.core import boot

    for module in SWITCH.record.modules:
        importlib.import_module(module)
    state = boot.install({"DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": str(tokens), **keys})
    reset_counters()
    return state


def start_turn(kit: CacheKit, tokens: Any, out_len: int, chunk: int | None = None,
               forward: Callable[[Any, int, int, dict[str, Any] | None], None] | None = None,
               rid: str | None = None, budget: int | None = None, running_batch: Any = None,
               new_token_ratio: float = 0.0, input_budget: int = 1 << 30,
               session_id: str | None = None, defer: list[Callable[[], None]] | None = None) -> ConeTurn | None:
    """Match (the switch's plan), admission by a real ``PrefillAdder`` with ``budget`` chunk tokens
    left (default ``chunk``) and the first prefill pass (with the cone's copy). None when the adder
    does not admit the request (memory or budget): its row is freed, nothing is locked.
    ``running_batch`` (a ``ScheduleBatch``) and ``new_token_ratio``: the adder reserves the running
    requests' future decode tokens as the scheduler's does; ``input_budget``: the pass's
    ``--max-prefill-tokens`` left (the adder's ``rem_input_tokens``; what is left after this request
    is ``rem_input_tokens`` of the turn); ``session_id``: with ``--enable-session-radix-cache``, the
    request's session, tagged as the scheduler tags it (``ensure_session_generation``; the finished
    insert then registers the session's reference); ``defer``: see :func:`prefill_pass`."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    chunk = chunk or kit.geometry.chunk
    req = Req(rid=rid or f"c{next(kit._rid)}", origin_input_text="", origin_input_ids=array("q", tokens),
              sampling_params=SamplingParams(temperature=0, max_new_tokens=out_len + 1))
    if session_id is not None and kit.cache.enable_session_radix_cache:
        req.session_id = session_id
        req.session_generation = kit.cache.ensure_session_generation(session_id)
    kit.pool.alloc([req])
    req.init_next_round_input(kit.cache)  # match_kv_cache -> the switch's plan
    plan = getattr(req, REQ_ATTR, None)
    stock_prefix = plan.P if plan is not None else req.prefix_len
    # A real PrefillAdder selects the first pass [prefix, prefix + chunk): the switch's wrapper
    # keeps or drops the cone; _commit_prefill_admission locks req.last_node (F's node on a cone).
    adder = _prefill_adder(kit, chunk if budget is None else budget, running_batch, new_token_ratio, input_budget)
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    if adder.can_run_list != [req]:
        kit.pool.free(req)
        return None
    if kit.cache.cache_controller is not None:  # HiCache: the batch starts the queued load-back
        kit.cache.ready_to_load_host_cache()
        kit.sync_hicache()
        kit.loaded_from_host += req.host_loaded_length
        kit.load_backs += bool(req.host_loaded_length)
    if plan is not None and getattr(req, REQ_ATTR, None) is not plan:
        plan = None  # the admission rule restored the stock match
    turn = ConeTurn(req.rid, stock_prefix, req.prefix_len, req.swa_branching_seqlen, plan,
                    len(tokens) - req.prefix_len, req=req, pos=req.prefix_len, rem_input_tokens=adder.rem_input_tokens)
    if req.prefix_len:
        kit.pool.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), kit.cache.prefix_device_indices(req))
    if plan is not None:
        turn.checks["anchor_locked"] = _full_lock_ref(kit, plan.anchor)
    prefill_pass(kit, turn, req.extend_end, forward, defer)  # the first pass: what the adder admitted
    return turn


def prefill_pass(kit: CacheKit, turn: ConeTurn, end: int,
                 forward: Callable[[Any, int, int, dict[str, Any] | None], None] | None = None,
                 defer: list[Callable[[], None]] | None = None) -> None:
    """One prefill pass ``[turn.pos, end)``: alloc + row write [+ the cone's copy on the first
    pass] [+ forward(req, start, end, rows)] + checkpoint. ``defer``: the checkpoint is appended
    to it instead, for the caller to run once the pass's batch is complete (the scheduler publishes
    a chunk after the forward: the final one in ``process_batch_result_prefill``, a middle one at
    the next pass's ``stash_chunked_request``; a request admitted in the same pass never matches it)."""
    req, plan, pos = turn.req, turn.plan, turn.pos
    first = turn.passes == 0
    row = req.kv.req_pool_idx
    kit.pool.write((row, slice(pos, end)), kit.alloc_pages(end - pos))
    rows = None
    if first and plan is not None:  # ScheduleBatch.prepare_for_extend: the copy
        pages, nbytes = copy_replay_rows(kit.cache, kit.pool.req_to_token, row, plan)
        turn.checks.update(pages=pages, bytes=nbytes)
        rows = forward_rows(plan.s, plan.F)
    if forward is not None:
        forward(req, pos, end, rows)
    req.extend_end = end
    req.kv.kv_committed_len = req.kv.kv_allocated_len = end
    turn.pos, turn.passes = end, turn.passes + 1
    if defer is None:
        _checkpoint(kit, turn, req, end, first, row)
    else:
        defer.append(lambda: _checkpoint(kit, turn, req, end, first, row))


def _checkpoint(kit: CacheKit, turn: ConeTurn, req: Any, end: int, first: bool, row: int) -> None:
    """The pass's checkpoint (and the cone's checks after its first)."""
    import torch
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    plan = turn.plan
    req.extend_end = end
    checkpoint_kv_cache(req, kit.cache)
    kit.sync_hicache()  # HiCache: the backups the checkpoint queued (the scheduler's next pass)
    if first and plan is not None:
        tree = kit.cache.path_device_indices(plan.anchor)[plan.s : plan.F]
        turn.checks.update(
            cache_protected_len=req.kv.cache_protected_len,
            swa_branching_seqlen=req.swa_branching_seqlen,
            row_is_tree_pages=bool(torch.equal(kit.pool.req_to_token[row, plan.s : plan.F].to(torch.int64),
                                               tree.to(torch.int64))),
            leak_after_first_checkpoint=_held_leak(kit, req),
            window_holes=kit.resume_state(list(req.origin_input_ids[: plan.F]))["swa_window_holes"],
        )


def end_turn(kit: CacheKit, turn: ConeTurn, out_len: int,
             forward: Callable[[Any, int, int, dict[str, Any] | None], None] | None = None,
             history: bool = True) -> None:
    """Decode ``out_len`` tokens and release the finished request; ``history``: keep prompt +
    output on ``turn.history`` (the next turn starts with it)."""
    req = turn.req
    total = len(req.origin_input_ids)
    if out_len:
        kit.pool.write((req.kv.req_pool_idx, slice(total, total + out_len)), kit.alloc_pages(out_len))
        if forward is not None:
            forward(req, total, total + out_len, None)
        req.output_ids = array("q", [OUTPUT_TOKEN] * out_len)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = total + out_len
    _finish(kit, req)
    kit.sync_hicache()
    if history:
        turn.history = list(req.origin_input_ids) + list(req.output_ids)
    turn.req = None


def _prefill_adder(kit: CacheKit, chunk: int, running_batch: Any = None, new_token_ratio: float = 0.0,
                   input_budget: int = 1 << 30) -> Any:
    """A real ``PrefillAdder`` over the kit's cache and allocator (and the running batch, if any)."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    return PrefillAdder(kit.geometry.page, kit.cache, kit.allocator, running_batch=running_batch,
                        new_token_ratio=new_token_ratio, rem_input_tokens=input_budget, rem_chunk_tokens=chunk)


def finish(kit: CacheKit, req: Any) -> None:
    """Release a finished request as the scheduler does (its KV, page-floored, into the tree)."""
    _finish(kit, req)


def _finish(kit: CacheKit, req: Any) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
    release_kv_cache(req, kit.cache, checkpoint=True)


def _full_lock_ref(kit: CacheKit, anchor: Any) -> int | None:
    """The Full lock ref of F's node (python core; the Rust core hides its nodes)."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    if not kit.is_python_core():
        return None
    node = anchor if hasattr(anchor, "component_data") else kit.core.node_by_id(anchor)
    return int(node.component_data[ComponentType.FULL].lock_ref)


def _held_leak(kit: CacheKit, req: Any) -> dict[str, int]:
    """Slots in neither the free lists, the tree, nor the running request's own row."""
    a, c = kit.allocator, kit.cache
    inserted = req.kv.cache_protected_len
    own = req.kv.kv_allocated_len - inserted  # the row's slots past its last checkpoint
    full = a.full_available_size() + c.full_evictable_size() + c.full_protected_size() + own
    return {"full": kit.baseline[0] - full}


def forward_rows(s: int, F: int) -> dict[str, Any]:
    """What the forward of a cone's first pass needs (the tiny-model exactness tests): rows
    ``[s, F)`` write no Full-side KV (the copy is kept); ``floor`` lets a test floor the sliding
    window at s (the bound makes it unnecessary: the tests show both)."""
    return {"mask": (s, F), "floor": s}
