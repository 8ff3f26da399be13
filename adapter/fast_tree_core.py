"""Fast Python tree core (``DSV41_SWA_FAST_CORE=1``): the insert walk of ``UnifiedTreeCore`` without
quadratic key copies.

What it changes: the stock insert walk (every chunk checkpoint and every finished turn goes through
it) ends each walked node with ``state.key = state.key[prefix_len:]`` in
``UnifiedTreeCore._finish_insert_walk_node``, which copies the whole rest of the key at every node
on the root-to-leaf path: O(path nodes x session length), about half of a deep checkpoint on a
2M-token tree (9.0 ms vs 2.1 ms on the Rust core for chunks ending past 128K;
``shared/upstream/tree-core-cost.md``). With this switch the walk keeps the key whole and advances
an offset instead (``RadixKey.child_key_at`` / ``match_at``, the offset forms upstream already uses in
``_match_prefix_helper``); the remaining key is sliced once, when the walk reaches the commit step
that needs it for the new leaf. Two more per-node costs go: the child lookup hashes the page-long
tuple key once instead of twice (``dict.get`` instead of ``in`` + ``[]``), and a node that matches
whole is recognised by one C-level memoryview comparison instead of ``match_at``'s galloping
slice copies (a partial match still goes to ``match_at``); the SWA walk-down refresh (an upstream
no-op) is not called, and a node inside the request's own protected prefix skips the overlap hooks,
which claim nothing there (Full's base hook, SWA's early return; both pinned). Everything else the walk does (touch, split, un-evict, overlap and
duplicate frees, hit counts, component hooks) calls the same upstream methods in the same order,
so the tree, the match lengths, the LRU lists and ``sanity_check()`` are identical to stock
(``tests/test_fast_tree_core.py`` compares the two op by op on random traces).

Why: SWA thin (``DSV41_SWA_THIN``) needs the Python tree core, which the Rust core outruns on deep
checkpoints; this switch is turned on by SWA thin and can be used alone on any Python-core cache
(``--enable-session-radix-cache`` already runs it). It does nothing on the Rust core.

Invariants:
* the walk offset lives on the tree core, keyed by the in-flight ``_InsertWalkState`` (inserts are
  single-flight), so a walk suspended at a barrier resumes at its offset;
* ``state.key`` is the whole (page-aligned) insert key while the walk runs and exactly the stock
  remainder from the commit step on.

Rollback: unset ``DSV41_SWA_FAST_CORE`` (and ``DSV41_SWA_THIN``, which turns it on).
"""

from __future__ import annotations

import weakref
from array import array
from typing import Any

NAME = "fast_tree_core"
MODULE = "sglang.srt.mem_cache.unified_cache.unified_tree_core"
WALK_STEP = f"{MODULE}:UnifiedTreeCore._insert_walk_step"
FINISH_NODE = f"{MODULE}:UnifiedTreeCore._finish_insert_walk_node"
COMMIT_STEP = f"{MODULE}:UnifiedTreeCore._insert_commit_step"
WRAPS = (WALK_STEP, FINISH_NODE, COMMIT_STEP)

# Attributes on the tree core: [state, offset] of the in-flight insert walk; the per-core plan.
_OFFSET_ATTR = "_dsv41_walk_key_offset"
_PLAN_ATTR = "_dsv41_walk_plan"

# Tree cores left on the stock walk while the switch is installed (side-by-side tests, benchmarks).
_STOCK: weakref.WeakSet[Any] = weakref.WeakSet()


def keep_stock(core: Any) -> None:
    """Leave ``core`` on the stock insert walk (a twin to compare the fast walk against)."""
    _STOCK.add(core)


def _offset(core: Any, state: Any) -> int:
    entry = core.__dict__.get(_OFFSET_ATTR)
    return entry[1] if entry is not None and entry[0] is state else 0


def _set_offset(core: Any, state: Any, offset: int) -> None:
    core.__dict__[_OFFSET_ATTR] = [state, offset]


def _match_len(node_key: Any, key: Any, offset: int, page: int) -> int:
    """``node_key.match_at(key, offset, page_size=page)``, with a copy-free answer for the common
    case: plain keys (no bigram, no limit, one namespace) and the whole node matching, compared as
    two memoryviews in C. Anything else, or a node that matches only in part, asks upstream."""
    t0, t1 = node_key.token_ids, key.token_ids
    n0 = len(t0)
    if (
        type(t0) is array
        and type(t1) is array
        and t0.typecode == t1.typecode
        and not node_key.is_bigram
        and not key.is_bigram
        and node_key.limit is None
        and key.limit is None
        and node_key.extra_key == key.extra_key
        and node_key.cache_salt == key.cache_salt
        and 0 < n0 <= len(t1) - offset
        and memoryview(t0) == memoryview(t1)[offset : offset + n0]
    ):
        return n0 if page == 1 else n0 // page * page
    return node_key.match_at(key, offset, page_size=page)


def _walk_step(wrapped: Any, core: Any, args: tuple, kwargs: dict) -> None:
    """``_insert_walk_step`` reading the key at the walk offset instead of a sliced copy, with one
    child lookup instead of two (a page-long tuple key is re-hashed by every dict operation)."""
    if core in _STOCK:
        return wrapped(*args, **kwargs)
    BASE_COMPONENT_TYPE, _InsertPhase = _UPSTREAM["BASE_COMPONENT_TYPE"], _UPSTREAM["_InsertPhase"]
    state = args[0] if args else kwargs["state"]
    key, page = state.key, core.page_size
    offset = _offset(core, state)
    node = state.node.children.get(key.child_key_at(offset, page)) if len(key) > offset else None
    if node is None:
        state.phase = _InsertPhase.COMMIT
        return
    walkdown, plain_overlap = _plan(core)
    # _touch_node, without the SWA walk-down refresh (a no-op upstream: SWA refreshes its window at
    # MATCH_END / INSERT_END only).
    node.last_access_time = _UPSTREAM["time_counter"]()
    for component in walkdown:
        component.refresh_lru(_UPSTREAM["WALKDOWN"], node, core.root_node)
    prefix_len = _match_len(node.key, key, offset, page)
    if prefix_len < len(node.key):
        node, action = core._split_node(node.key, node, prefix_len)
        if action is not None:
            state.pending_actions.append(action)
    node.priority = max(node.priority, state.priority)
    if node.evicted:
        # Full comes back from the request's fresh KV; aux components rebuild from the same slice.
        core._unevict_node_on_insert(node, state.value[:prefix_len], session_id=state.params.session_id)
        state.result.record_adopted_range(
            BASE_COMPONENT_TYPE, state.total_prefix_length, state.total_prefix_length + prefix_len
        )
        for component in core.components:
            if component.component_type == BASE_COMPONENT_TYPE:
                continue
            component.recover_after_unevict(
                node=node,
                prefix_len=prefix_len,
                total_prefix_len=state.total_prefix_length,
                params=state.params,
                result=state.result,
                cache_actions=state.pending_actions,
            )
        core._finish_insert_walk_node(state, node, prefix_len)
        return
    if plain_overlap and state.params.prev_prefix_len >= state.total_prefix_length + prefix_len:
        # The node lies inside what this request already protects: the Full and SWA overlap hooks
        # claim nothing and there is no duplicate to free, so the overlap step is only its finish.
        core._finish_insert_walk_node(state, node, prefix_len)
        return
    state.overlap_node = node
    state.overlap_prefix_len = prefix_len
    state.phase = _InsertPhase.OVERLAP
    core._insert_overlap_step(state)


def _plan(core: Any) -> tuple[tuple[Any, ...], bool]:
    """Per tree core, once: the components whose walk-down refresh must run, and whether every
    component's insert-overlap hook is one known to claim nothing inside the protected prefix."""
    plan = core.__dict__.get(_PLAN_ATTR)
    if plan is None:
        swa_refresh, quiet = _UPSTREAM["swa_refresh"], _UPSTREAM["quiet_overlaps"]
        walkdown = tuple(
            c for c in core.components
            if c.component_type != _UPSTREAM["BASE_COMPONENT_TYPE"] and type(c).refresh_lru is not swa_refresh
        )
        plain = all(type(c).update_component_on_insert_overlap in quiet for c in core.components)
        plan = core.__dict__[_PLAN_ATTR] = (walkdown, plain)
    return plan


def _finish_node(wrapped: Any, core: Any, args: tuple, kwargs: dict) -> None:
    """``_finish_insert_walk_node`` advancing the key offset instead of copying the key's rest."""
    if core in _STOCK:
        return wrapped(*args, **kwargs)
    state, node, prefix_len = args
    node_end = state.total_prefix_length + prefix_len
    # Nodes this request already inserted were counted back then (stock rule).
    if node_end > state.params.inserted_len and core._inc_hit_count_and_check(node):
        state.pending_actions.append(core._build_backup_kv_action(node))
    state.node = node
    state.total_prefix_length += prefix_len
    _set_offset(core, state, _offset(core, state) + prefix_len)
    state.value = state.value[prefix_len:]  # a tensor view: O(1), as stock
    state.overlap_node = None
    state.overlap_prefix_len = 0
    state.phase = _UPSTREAM["_InsertPhase"].WALK


def _commit_step(wrapped: Any, core: Any, args: tuple, kwargs: dict) -> None:
    """Slice the remaining key once (the new leaf's key), then run the stock commit step."""
    if core in _STOCK:
        return wrapped(*args, **kwargs)
    state = args[0] if args else kwargs["state"]
    offset = _offset(core, state)
    core.__dict__.pop(_OFFSET_ATTR, None)
    if offset:
        state.key = state.key[offset:]
    return wrapped(*args, **kwargs)


# Upstream names the hot paths use, resolved once at install (not per walked node).
_UPSTREAM: dict[str, Any] = {}


def install(config: Any, patch: Any) -> dict[str, object]:
    from sglang.srt.mem_cache.unified_cache.components import base
    from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import _InsertPhase

    _UPSTREAM.update(
        BASE_COMPONENT_TYPE=base.BASE_COMPONENT_TYPE,
        _InsertPhase=_InsertPhase,
        time_counter=base.get_and_increase_time_counter,
        WALKDOWN=base.LRURefreshPhase.WALKDOWN,
        swa_refresh=vars(SWAComponent)["refresh_lru"],
        # Base: claims nothing; SWA: returns at once when the node is inside prev_prefix_len.
        quiet_overlaps=(
            vars(base.TreeComponent)["update_component_on_insert_overlap"],
            vars(SWAComponent)["update_component_on_insert_overlap"],
        ),
    )
    patch.wrap(WALK_STEP, _walk_step)
    patch.wrap(FINISH_NODE, _finish_node)
    patch.wrap(COMMIT_STEP, _commit_step)
    return {"paths": "insert_walk", "key_copies": "once_per_insert"}
