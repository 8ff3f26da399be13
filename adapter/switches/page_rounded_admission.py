"""Page-rounded admission (``DSV41_PAGE_ROUNDED_ADMISSION=1``): admission charges KV in whole pages.

What it changes: SGLang 0.5.23 allocates KV in whole pages, but ``PrefillAdder`` charges running
rows raw tokens (``_get_running_request_total_token_offset``: tokens left to decode) and mixed
decode rows one raw token each, while new requests get ``extend + max_new + one page``. A running
row sitting on a page boundary with ``R = 1 (mod page)`` tokens to go really needs ``R + page - 1``
slots, so a prompt sized to the raw budget is admitted, the pool runs out during decode and the
engine retracts a row and recomputes it ("KV cache pool is full. Retract requests"). With this switch one cost, :func:`kv_reservation` (the
slots, in whole pages, a sequence holding ``held`` slots needs to store ``more`` tokens), is used
by every place admission charges or checks KV on a single-pool paged cache:

* running rows: ``kv_reservation(allocated, committed + tokens_left - allocated)`` (``tokens_left``
  is the stock estimate: clipped, scaled by ``new_token_ratio`` unless ``ignore_eos``);
* mixed decode rows (``--enable-mixed-chunk``): the next decode step of each row, one page for a
  row on a page boundary, none otherwise (stock: one token per row);
* the admission check: ``kv_reservation(prefix, extend + max_new) <= remaining`` replaces
  ``extend + max_new + page < remaining``, so a request that fits exactly is admitted;
* the reserved-size charge: ``kv_reservation(0, extend + max_new)`` (``extend`` alone for the
  immediate offset) replaces ``ceil(extend) + page + max_new``. Start 0 is the page-aligned worst
  case, because the chunked paths hand over 0 for the prefix;
* the never-fits clip (``Scheduler.init_req_max_new_tokens``, queue time): ``max_new`` is clipped
  to the largest value whose reservation fits the empty pool, the bound admission itself applies
  (stock clips to ``capacity - ceil(input) - page - 1``, which stays valid but wastes up to two pages).

Every charge is then a whole number of pages, so ``remaining_total`` stays page-aligned and the
continuation-chunk bound (``PrefillBudget.available_chunk_tokens``) needs no change.

Scope: the plain ``PrefillBudget`` (one FULL pool), radix cache on, no page-interleave shards, no
dLLM, no mamba state. Anywhere else (hybrid SWA, mamba, HiSparse, a disabled radix cache with its
``ignore_eos`` simulation) the adder keeps the stock charges and a DEBUG receipt names the reason.

Invariant (tests/upstream/test_page_rounded_admission.py): after every admission pass, the page-exact KV
that running and admitted requests still need to finish fits the free plus evictable pages.

Trade-off: the switch never admits into KV that running rows will need, so a prompt that stock
would run beside a wave of decode rows (and then retract) waits for them instead; on random
lengths stock's raw charge errs both ways and the switch is slightly ahead (``bench admission``).

Rollback: unset ``DSV41_PAGE_ROUNDED_ADMISSION``; nothing is persisted.
"""

from __future__ import annotations

import importlib
import logging
import math
from typing import Any

from adapter.core import api

SWITCH = api.handle(__name__)
POLICY = SWITCH.module_of("PrefillAdder.__init__")
BUDGET = SWITCH.module_of("PrefillBudget.reserve")
ALLOCATOR_BASE = SWITCH.module_of("BaseTokenToKVPoolAllocator.max_new_tokens_for_memory")

_SCOPE_ATTR = "_dsv41_page_rounded_scope"  # cached per PrefillAdder: None (in scope) or a reason
_reported: set[str] = set()
_upstream: dict[str, Any] = {}  # modules resolved at install (prefill_budget loads lazily upstream)


def kv_reservation(held: int, more: int, page_size: int) -> int:
    """KV slots, in whole pages, that a sequence holding ``held`` slots needs to store ``more`` more.

    ``ceil(held + more) - ceil(held)`` in page units: the pages a paged allocator hands out for
    positions ``[held, held + more)``. Never more than ``ceil(more)``, whatever ``held`` is.
    """
    if more <= 0:
        return 0
    return (-(-(held + more) // page_size) - -(-held // page_size)) * page_size


def row_reservation(req: Any, tokens_left: float, page_size: int) -> int:
    """What a running row still needs: from its allocated slots to committed + ``tokens_left``."""
    kv = req.kv
    target = kv.kv_committed_len + math.ceil(tokens_left)
    return kv_reservation(kv.kv_allocated_len, target - kv.kv_allocated_len, page_size)


# -- scope -----------------------------------------------------------------------------------


def _out_of_scope(adder: Any) -> str | None:
    """None when the adder charges one plain FULL pool; else why it keeps the stock charges."""
    cached = adder.__dict__.get(_SCOPE_ATTR, ...)
    if cached is not ...:
        return cached
    reason = None
    budget_type = _upstream[BUDGET].PrefillBudget
    budget = adder.__dict__.get("memory_budget")
    tree_cache = adder.tree_cache
    if budget is None or type(budget) is not budget_type:
        reason = f"budget-{type(budget).__name__}"
    elif adder.dllm_config is not None:
        reason = "dllm"
    elif getattr(tree_cache, "disable", True):
        reason = "radix-cache-disabled"
    elif tree_cache.supports_mamba():
        reason = "mamba"
    elif _upstream[POLICY].page_interleave_shard_size(adder.token_to_kv_pool_allocator) > 1:
        reason = "kv-shards"
    if reason is not None and reason not in _reported:
        _reported.add(reason)
        SWITCH.event("stock charges", reason=reason, level=logging.DEBUG)
    if budget is not None:  # decided only once the budget exists (it is created early in __init__)
        adder.__dict__[_SCOPE_ATTR] = reason
    return reason


# -- wrappers --------------------------------------------------------------------------------


def _running_offset(wrapped: Any, adder: Any, args: tuple, kwargs: dict) -> Any:
    """Running rows: the page-exact reservation of the stock token estimate."""
    if _out_of_scope(adder) is not None:
        return wrapped(*args, **kwargs)
    req = args[0] if args else kwargs["req"]
    return row_reservation(req, wrapped(*args, **kwargs), adder.page_size)


def _bind_init(
    page_size: int,
    tree_cache: Any,
    token_to_kv_pool_allocator: Any,
    running_batch: Any,
    new_token_ratio: float,
    rem_input_tokens: int,
    rem_chunk_tokens: Any,
    num_mixed_decode_tokens: int = 0,
    *args: Any,
    **kwargs: Any,
) -> tuple[Any, int]:
    return running_batch, num_mixed_decode_tokens


def _init(wrapped: Any, adder: Any, args: tuple, kwargs: dict) -> None:
    """Mixed decode rows: the budget starts with their next step in pages, not one token each."""
    wrapped(*args, **kwargs)
    running_batch, mixed = _bind_init(*args, **kwargs)
    if not mixed or _out_of_scope(adder) is not None:
        return
    rows = list(running_batch.reqs) if running_batch is not None else []
    if len(rows) == mixed:
        rounded = sum(row_reservation(r, 1, adder.page_size) for r in rows)
    else:  # rows unknown: each could open a page
        rounded = mixed * adder.page_size
    adder.memory_budget.total_offset += rounded - mixed
    adder.memory_budget.current_offset += rounded - mixed


def _check(wrapped: Any, adder: Any, args: tuple, kwargs: dict) -> tuple[bool, int | None]:
    """The admission check: the whole request's page-exact reservation must fit (``<=``)."""
    if _out_of_scope(adder) is not None:
        return wrapped(*args, **kwargs)
    req = args[0] if args else kwargs["req"]
    extend = kwargs["extend_input_len"]
    total_tokens = kwargs["total_tokens"]
    chunk_limit = kwargs["chunk_limit"]
    clip = _upstream[POLICY].CLIP_MAX_NEW_TOKENS
    max_new = min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), clip)
    fill = len(req.full_untruncated_fill_ids)
    # add_one_req built total_tokens = extend-from-req.prefix_len + max_new + per-request overhead
    # + state-slot reserves; keep the reserves, replace the rest.
    stock_kv = (fill - req.prefix_len) + max_new + adder.per_req_token_overhead
    extras = total_tokens - stock_kv + (adder.per_req_token_overhead - adder.page_size)
    need = kv_reservation(fill - extend, extend + max_new, adder.page_size) + extras
    if need <= adder.memory_budget.remaining_total:
        return True, chunk_limit
    return False, None


def _bind_update(
    prefix_len: int,
    extend_input_len: int,
    max_new_tokens: int,
    retracted_stain: bool,
    mamba_gap_reserve: int = 0,
    request_slot_reserve: int = 0,
    is_chunked_continuation: bool = False,
    replay_len: int = 0,
) -> tuple[int, int, int]:
    return extend_input_len, max_new_tokens, mamba_gap_reserve + request_slot_reserve


def _update(wrapped: Any, adder: Any, args: tuple, kwargs: dict) -> None:
    """The reserved-size charge: replace the stock reserve by the page-exact one."""
    wrapped(*args, **kwargs)
    if _out_of_scope(adder) is not None:
        return
    extend, max_new, reserves = _bind_update(*args, **kwargs)
    page = adder.page_size
    extra = reserves + adder.per_req_token_overhead - page
    # PrefillBudget.reserve (pinned): total += ceil(extend) + page + extra + max_new, current
    # likewise without max_new.
    stock_now = -(-extend // page) * page + page + extra
    budget = adder.memory_budget
    budget.total_offset += kv_reservation(0, extend + max_new, page) + extra - (stock_now + max_new)
    budget.current_offset += kv_reservation(0, extend, page) + extra - stock_now


def _scheduler_out_of_scope(scheduler: Any) -> str | None:
    """The clip's scope: the same single-pool cases the adder charges page-exact."""
    allocator = scheduler.token_to_kv_pool_allocator
    tree_cache = scheduler.tree_cache
    base = _upstream[ALLOCATOR_BASE].BaseTokenToKVPoolAllocator
    if type(allocator).create_prefill_budget is not base.create_prefill_budget:
        return f"allocator-{type(allocator).__name__}"
    if getattr(scheduler, "dllm_config", None) is not None:
        return "dllm"
    if getattr(tree_cache, "disable", True):
        return "radix-cache-disabled"
    if tree_cache.supports_mamba():
        return "mamba"
    if getattr(scheduler, "kv_shard_widening", 1) != 1:
        return "kv-shards"
    return None


def _clip_max_new(wrapped: Any, scheduler: Any, args: tuple, kwargs: dict) -> None:
    """The never-fits clip: lower ``max_new`` to the largest value whose reservation fits the pool.

    Stock clips to ``capacity - ceil(input) - page - 1`` (its admission's raw check); admission
    here admits ``kv_reservation(0, input + max_new) <= capacity`` on an empty pool, so the bound
    is ``floor_page(capacity) - input``. Never below the stock clip, which stays valid.
    """
    req = args[0] if args else kwargs["req"]
    requested = req.sampling_params.max_new_tokens
    wrapped(*args, **kwargs)
    if req.finished() or _scheduler_out_of_scope(scheduler) is not None:
        return
    input_len = len(req.origin_input_ids)
    wanted = requested if requested is not None else 1 << 30
    limit = scheduler.max_new_tokens_limit
    if limit is not None and limit > 0:
        wanted = min(wanted, limit)
    wanted = max(0, min(wanted, scheduler.max_req_len - input_len - 1))
    page = scheduler.page_size
    fits = scheduler.max_total_num_tokens // page * page - input_len
    params = req.sampling_params
    params.max_new_tokens = max(params.max_new_tokens, min(wanted, fits))
    params.min_new_tokens = min(params.min_new_tokens, params.max_new_tokens)


def install(ctx: api.SwitchContext) -> dict[str, object]:
    SWITCH.bind(ctx)
    # Pins (boot checked them): the five wrapped functions and, unwrapped, the arithmetic the
    # wrappers replace (stock reserve and check, add_one_req's total_tokens, the stock clip).
    # prefill_budget loads lazily upstream (first PrefillAdder); resolve it now.
    _upstream.update({name: importlib.import_module(name) for name in (BUDGET, POLICY, ALLOCATOR_BASE)})
    ctx.wrap("PrefillAdder._get_running_request_total_token_offset", _running_offset)
    ctx.wrap("PrefillAdder.__init__", _init)
    ctx.wrap("PrefillAdder._check_prefill_budget", _check)
    ctx.wrap("PrefillAdder._update_prefill_budget", _update)
    ctx.wrap("Scheduler.init_req_max_new_tokens", _clip_max_new)
    _reported.clear()
    return {"charges": "running,mixed,check,reserve,clip", "scope": "single-pool"}
