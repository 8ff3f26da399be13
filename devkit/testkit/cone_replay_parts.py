"""Cone replay's parts under one name, for tests and benchmarks (never for serving code).

The switch's package keeps one job a module (:mod:`adapter.switches.cone_replay`); tests reach
into several of them at once (counters, plan states, the forward's published rows, the copy). This
module gathers those names so the serving modules carry no re-export list for them. Mutable state
(``COUNTERS``, ``LIVE``, ...) is the switch's own object, not a copy.
"""

from __future__ import annotations

from typing import Any

from adapter.switches.cone_replay.copy import copy_full_pages, copy_replay_rows, full_side_buffers
from adapter.switches.cone_replay.decision import (
    STANDIN_KEY,
    TOKENS_KEY,
    CacheFacts,
    Decision,
    decide,
    facts_of_cache,
    facts_of_pool,
)
from adapter.switches.cone_replay.dsv4 import forward_fields as dsv4_forward_fields
from adapter.switches.cone_replay.forward import (
    FORWARD_ATTR,
    _attention_forward,
    _can_run_graph,
    _forward_batch_init,
    _model_forward,
    replay_rows,
    substitute_full_kv,
    swa_kv_pool_unsupported,
)
from adapter.switches.cone_replay.geometry import (
    CACHE_ATTR,
    ConeConfig,
    align_up,
    cache_config,
    cone_bound,
    cone_bound_dsv4,
    cone_start,
    is_dsv4_pool,
    swa_layer_count,
)
from adapter.switches.cone_replay.plan import (
    ADMITTED,
    COPIED,
    COUNTERS,
    FALLBACKS,
    FORWARDED,
    LIVE,
    PLANNED,
    REQ_ATTR,
    ConePlan,
    Counters,
    admit,
    fallback,
    restore_stock,
)
from adapter.switches.cone_replay.switch import SWITCH, install, reset_counters

__all__ = [
    "ADMITTED", "CACHE_ATTR", "COPIED", "COUNTERS", "FALLBACKS", "FORWARDED", "FORWARD_ATTR", "LIVE", "PLANNED", "REQ_ATTR",
    "STANDIN_KEY", "SWITCH", "TOKENS_KEY", "CacheFacts", "ConeConfig",
    "ConePlan", "Counters", "Decision", "_attention_forward", "_can_run_graph", "_forward_batch_init",
    "_model_forward", "admit", "align_up", "cache_config", "cone_bound", "cone_bound_dsv4", "cone_start",
    "copy_full_pages", "copy_replay_rows", "decide", "dsv4_forward_fields", "dsv4_window_floor", "facts_of_cache", "facts_of_pool",
    "fallback", "forward_unsupported", "full_side_buffers", "install", "is_dsv4_pool",
    "replay_rows", "reset_counters", "restore_stock", "substitute_full_kv", "swa_kv_pool_unsupported",
    "swa_layer_count",
]


def forward_unsupported(kvpool: Any, *, standin: bool = False) -> str | None:
    """The switch's forward-side refusal on ``kvpool`` (None: it acts), past every geometry rule."""
    window, page = 128, 256
    facts = facts_of_pool(kvpool, tokens=1 << 20, window=window, page=page, standin=standin)
    return decide(facts).refusal


def dsv4_window_floor(rows: list[tuple[int, int, Any]]) -> Any:
    """The per-row window floor a DeepSeek-V4 replay batch would carry in ``encoder_swa_row_floor``
    (``s`` on a cone's rows, 0 elsewhere; ``rows`` as :func:`dsv4_forward_fields` takes them). The
    switch sets none (``adapter.switches.cone_replay.dsv4``): the seam tests show what it would cut."""
    import torch

    parts = [torch.full((extend,), 0 if plan is None else plan.s, dtype=torch.int32) for _, extend, plan in rows]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
