"""What the radix tree holds of a request (read-only matches), and the pins that keep a waiting
request's pages in the tree until its admission.
"""

from __future__ import annotations

import logging
from array import array
from typing import Any

from adapter.switches.kv_park.state import _State
from adapter.switches.kv_park.store import SWITCH


def _held_by_tree(tree_cache: Any, req: Any, tokens: list[int], page_size: int) -> tuple[int, int]:
    """Tokens of ``tokens`` (whole pages) the tree holds, on the device or on host: the prefix it can
    serve (``match_prefix``'s device plus host hit, SWA-validated on a hybrid tree), and the prefix
    of its Full KV (``full_kv_hit_length``: the walk goes on through host-backed nodes past a window
    the tree lost, so it is never shorter)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(token_ids=tokens, extra_key=req.extra_key, cache_salt=req.cache_salt)
    match = tree_cache.match_prefix(MatchPrefixParams(key=key))
    held = int(match.device_prefix_len) + int(getattr(match, "host_hit_length", 0) or 0)
    full = max(held, int(getattr(match, "full_kv_hit_length", 0) or 0))
    return min(held, len(tokens)) // page_size * page_size, min(full, len(tokens)) // page_size * page_size


def _full_on_device(tree: Any, req: Any, tokens: Any) -> Any:
    """The node where the tree's device Full KV of ``tokens`` ends when it covers them all (no SWA
    validation: past a window the tree lost), else None."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(token_ids=array("q", tokens), extra_key=req.extra_key, cache_salt=req.cache_salt)
    on_device, node, _ = tree.tree_core.match_full_device_prefix(key)
    return node if on_device >= len(tokens) else None


def _tree_holds_swa(tree: Any, req: Any, tokens: Any, lo: int, hi: int, page_size: int) -> bool:
    """Whether the tree holds the SWA KV (device, or host only) of any page in ``[lo, hi)`` of
    ``tokens``, whose Full KV it holds on the device (read-only: no split, no LRU touch)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    core = tree.tree_core
    for end in range(lo + page_size, hi + 1, page_size):
        key = RadixKey(token_ids=array("q", tokens[:end]), extra_key=req.extra_key, cache_salt=req.cache_salt)
        _, node, _ = core.match_full_device_prefix(key)  # the node holding token end - 1
        if core.get_component_device_value(node, ComponentType.SWA) is not None:
            return True
        if core.component_has_host_value_only(node, ComponentType.SWA):
            return True
    return False


def _running_need(scheduler: Any) -> int:
    """Tokens the running rows' next decode step allocates (what ``check_decode_mem`` asks for)."""
    running = getattr(scheduler, "running_batch", None)
    if running is None or running.is_empty():
        return 0
    return int(running.new_tokens_required_next_decode())


def _release_pins(state: _State, scheduler: Any) -> None:
    """Unpin restored pages whose request left the waiting queue (admitted: it holds its own lock;
    or aborted); every pin when no row is running (nothing decodes to evict them before this pass's
    admission, and a pin must never keep another waiting request out of an idle engine); and every
    pin when the running rows' next decode would not fit beside them (the running rows come first,
    as in stock: the pages become evictable, the request recomputes)."""
    waiting = {r.rid for r in scheduler.waiting_queue}
    for rid in [rid for rid in state.pins if rid not in waiting]:
        tree, lock = state.pins.pop(rid)
        tree.unlock(lock)
    if not state.pins:
        return
    need = _running_need(scheduler)
    allocator, tree = scheduler.token_to_kv_pool_allocator, scheduler.tree_cache
    running = getattr(scheduler, "running_batch", None)
    if running is None or running.is_empty():
        reason = "no_running_rows"
    elif allocator.available_size() + tree.evictable_size() < need:
        reason = "running_rows_need_the_pages"
    else:
        return
    for rid, (pinned_tree, lock) in list(state.pins.items()):
        pinned_tree.unlock(lock)
        SWITCH.event("unpinned", level=logging.DEBUG, rid=rid, reason=reason, need=need)
    state.pins.clear()


def _pin(state: _State, rid: Any, tree: Any, node: Any) -> None:
    old = state.pins.pop(rid, None)
    if old is not None:
        old[0].unlock(old[1])
    state.pins[rid] = (tree, tree.lock(node))
