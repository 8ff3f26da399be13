"""Fast Python tree core (``DSV41_SWA_FAST_CORE=1``): the insert walk, the prefix match and the
Full lock walks of ``UnifiedTreeCore`` without per-node key copies, tuple keys or method layers.

What it changes, path by path (each the same reads and writes as stock, in the same order):

* Insert walk (every chunk checkpoint and every finished turn): the stock walk ends each walked node
  with ``state.key = state.key[prefix_len:]`` (``_finish_insert_walk_node``), which copies the whole
  rest of the key at every node on the root-to-leaf path: O(path nodes x session length)
  (measured with ``python -m adapter bench swa-thin``). Here the key stays whole and the walk advances an offset;
  the remaining key is sliced once, at the commit step that needs it for the new leaf. The walk runs
  node after node inside one ``_insert_walk_step`` call, keeping the walk position, the prefix length
  and the value offset in locals; it writes them back to the walk state before any upstream step
  that reads them (overlap, un-evict, commit) and stops exactly where stock's ``_advance_insert``
  would stop: when a node emits an action that is not deferrable (a barrier).
* Child lookup (insert walk and match): stock builds the page-long tuple key
  (``RadixKey.child_key_at``: 256 boxed ints at page 256), hashes it and compares it with the stored
  tuple key, at every node. Here a node with at most ``SCAN_CHILDREN`` children is scanned instead:
  the child whose key starts with the same page of tokens (same ``extra_key`` / ``cache_salt``
  namespace, plain keys only) is the one the dict maps that tuple to, because every upstream writer
  of ``children`` files a child under ``child_key`` of its own key (``_split_node``,
  ``_add_new_node``, ``insert_host``; checked on every state by the op-by-op test). Anything else
  (bigram, limit, typed arrays of another kind, page 1, many children) uses the stock tuple lookup.
* Match length: a node that matches whole is recognised by one C-level array comparison of the
  node key with the same span of the insert key (``array.__eq__`` of one typecode compares items in
  C); a partial match still goes to ``RadixKey.match_at``.
* Node state in the walk: the SWA walk-down refresh (an upstream no-op) is not called; a node inside
  the request's own protected prefix skips the overlap hooks, which claim nothing there (Full's base
  hook, SWA's early return; both pinned); ``_inc_hit_count_and_check`` is inlined for a core without
  write-back, HiCache or an external linker (then it only counts the hit).
* Prefix match (``_match_prefix_helper``, every admission), with or without HiCache: the same
  walk, the same validators called on the same nodes in the same order (under HiCache both stock
  sets: host-capable, then device-only), the same stop at a dead node (evicted and not backed up),
  the same splits, the same ``_match_post_processor`` call; only the child lookup and the
  whole-node match are the fast forms above.
* Full lock and unlock (``FullComponent.acquire_component_lock`` / ``release_component_lock``, twice
  per checkpoint, three times per release, each over the whole root path): the same per-node ledger
  moves, lock refs and evictable-leaf set operations in the same order, with the leaf test
  (``_update_evictable_leaf_sets``: ``_is_device_leaf`` / ``_is_host_leaf``) and the value length
  (``reclaimable_value_len``, ``len(tensor)``) inlined; a host lock, a component or core subclass
  that overrides one of these, or a stock-kept core goes to upstream.

So the tree, the match lengths, the LRU lists, the lock refs, the evictable sets, the ledgers and
``sanity_check()`` are identical to stock (``tests/upstream/test_fast_tree_core.py`` compares the two op by
op on random traces, including the child-key invariant the scan relies on).

Why: SWA thin (``DSV41_SWA_THIN``) needs the Python tree core, which the Rust core outruns; this
switch is turned on by SWA thin and can be used alone on any Python-core cache
(``--enable-session-radix-cache`` already runs it). It does nothing on the Rust core.

Invariants:
* the walk offset lives on the tree core, keyed by the in-flight ``_InsertWalkState`` (inserts are
  single-flight), so a walk suspended at a barrier resumes at its offset;
* ``state.key`` is the whole (page-aligned) insert key while the walk runs and exactly the stock
  remainder from the commit step on; ``state.node``, ``state.total_prefix_length`` and
  ``state.value`` equal stock's whenever upstream code runs.

Rollback: unset ``DSV41_SWA_FAST_CORE`` (and ``DSV41_SWA_THIN``, which turns it on).
"""

from __future__ import annotations

from array import array
from typing import Any

from adapter.core import api

WALK_STEP = "UnifiedTreeCore._insert_walk_step"
FINISH_NODE = "UnifiedTreeCore._finish_insert_walk_node"
COMMIT_STEP = "UnifiedTreeCore._insert_commit_step"
MATCH_HELPER = "UnifiedTreeCore._match_prefix_helper"
FULL_ACQUIRE = "FullComponent.acquire_component_lock"
FULL_RELEASE = "FullComponent.release_component_lock"

# A node with at most this many children is scanned instead of hashed (the root, with one child per
# distinct first page, takes the tuple lookup).
SCAN_CHILDREN = 8

# Attributes on the tree core: [state, offset] of the in-flight insert walk; the per-core plan; the
# stock mark.
_OFFSET_ATTR = "_dsv41_walk_key_offset"
_PLAN_ATTR = "_dsv41_walk_plan"
_STOCK_ATTR = "_dsv41_stock_core"


def keep_stock(core: Any) -> None:
    """Leave ``core`` on every stock path (a twin to compare the fast paths against)."""
    core.__dict__[_STOCK_ATTR] = True


def _offset(core: Any, state: Any) -> int:
    entry = core.__dict__.get(_OFFSET_ATTR)
    return entry[1] if entry is not None and entry[0] is state else 0


def _set_offset(core: Any, state: Any, offset: int) -> None:
    core.__dict__[_OFFSET_ATTR] = [state, offset]


# -- child lookup and match length ---------------------------------------------------------------
_UNDECIDED = -2  # the scan cannot answer: use the stock tuple lookup
_PARTIAL = -1  # found; the node matches in part (ask match_at)


def _plain(key: Any) -> bool:
    return type(key.token_ids) is array and not key.is_bigram and key.limit is None


def _scan(children: dict, key: Any, offset: int, page: int) -> tuple[Any, int]:
    """``children.get(key.child_key_at(offset, page))`` and, when it is found whole, its match
    length, for a plain ``key`` (the caller checks) and ``page > 1``: the child whose key is plain,
    in ``key``'s namespace and starts with ``key``'s page at ``offset``. Returns (child or None,
    match length | ``_PARTIAL`` | ``_UNDECIDED``)."""
    t1 = key.token_ids
    rest = len(t1) - offset
    if rest < page:
        return None, _UNDECIDED  # stock raises IndexError here: let it
    first, head = t1[offset], None
    extra, salt, code = key.extra_key, key.cache_salt, t1.typecode
    single = len(children) == 1
    for child in children.values():
        ck = child.key
        t0 = ck.token_ids
        if type(t0) is not array or t0.typecode != code or ck.is_bigram or ck.limit is not None or len(t0) < page:
            return None, _UNDECIDED
        if ck.extra_key != extra or ck.cache_salt != salt or t0[0] != first:
            continue  # another namespace or another first token: another dict key
        n0 = len(t0)
        # One child: try the whole node first (the common case: it matches whole).
        if single and n0 <= rest and t0 == t1[offset : offset + n0]:
            return child, n0 // page * page
        if head is None:
            head = t1[offset : offset + page]
        if t0[:page] == head:
            if not single and n0 <= rest and t0 == t1[offset : offset + n0]:
                return child, n0 // page * page
            return child, _PARTIAL
    return None, 0


def _match_len(node_key: Any, key: Any, offset: int, page: int) -> int:
    """``node_key.match_at(key, offset, page_size=page)``, with a copy-light answer for the common
    case: plain keys of one namespace and the whole node matching, compared as arrays in C. Anything
    else, or a node that matches only in part, asks upstream."""
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
        and t0 == t1[offset : offset + n0]
    ):
        return n0 if page == 1 else n0 // page * page
    return node_key.match_at(key, offset, page_size=page)


def _child(node: Any, key: Any, offset: int, page: int, scan: bool) -> tuple[Any, int]:
    """The child stock's walk takes at ``offset`` (or None) and its match length (or ``_PARTIAL``:
    ask ``match_at``; ``_UNDECIDED`` never leaves here)."""
    children = node.children
    if scan and len(children) <= SCAN_CHILDREN:
        child, plen = _scan(children, key, offset, page)
        if plen != _UNDECIDED:
            return child, plen
    child = children.get(key.child_key_at(offset, page))
    return child, (_match_len(child.key, key, offset, page) if child is not None else 0)


# -- insert walk -----------------------------------------------------------------------------------
def _walk_step(wrapped: Any, core: Any, args: tuple, kwargs: dict) -> None:
    """``_insert_walk_step`` run node after node until stock would leave the walk phase or stop at a
    barrier, reading the key at the walk offset instead of sliced copies."""
    d = core.__dict__
    if _STOCK_ATTR in d:
        return wrapped(*args, **kwargs)
    U = _UPSTREAM
    WALK, time_counter = U["WALK"], U["time_counter"]
    state = args[0] if args else kwargs["state"]
    key, page, root = state.key, core.page_size, core.root_node
    scan = page > 1 and _plain(key)
    n1 = len(key)
    walkdown, plain_overlap = _plan(core)
    params = state.params
    prev_prefix_len, inserted_len, priority = params.prev_prefix_len, params.inserted_len, state.priority
    only_count_hits = not (core.is_write_back or core.enable_external_cache_linker or core.enable_hicache)
    full = U["FULL"]
    actions = state.pending_actions
    node, total, offset = state.node, state.total_prefix_length, _offset(core, state)
    value, consumed = state.value, 0  # stock's state.value is value[consumed:]

    def sync() -> None:
        state.node = node
        state.total_prefix_length = total
        if consumed:
            state.value = value[consumed:]  # a tensor view, as stock's chain of slices
        d[_OFFSET_ATTR] = [state, offset]

    while True:
        child, prefix_len = _child(node, key, offset, page, scan) if offset < n1 else (None, 0)
        if child is None:
            sync()
            state.phase = U["_InsertPhase"].COMMIT
            return
        mark = len(actions)
        # _touch_node, without the SWA walk-down refresh (a no-op upstream: SWA refreshes its window
        # at MATCH_END / INSERT_END only).
        child.last_access_time = time_counter()
        for component in walkdown:
            component.refresh_lru(U["WALKDOWN"], child, root)
        if prefix_len == _PARTIAL:
            prefix_len = child.key.match_at(key, offset, page_size=page)
        if prefix_len < len(child.key):
            child, action = core._split_node(child.key, child, prefix_len)
            if action is not None:
                actions.append(action)
        child.priority = max(child.priority, priority)
        if child.parent is not None and child.component_data[full].value is None:  # child.evicted
            sync()
            _unevict_step(core, state, child, prefix_len)
            node, total, offset, value, consumed = state.node, state.total_prefix_length, _offset(core, state), state.value, 0
        elif plain_overlap and prev_prefix_len >= total + prefix_len:
            # Inside what this request already protects: the Full and SWA overlap hooks claim nothing
            # and there is no duplicate to free, so the overlap step is only its finish.
            if total + prefix_len > inserted_len:  # nodes this request inserted were counted then
                if only_count_hits:
                    child.hit_count += 1  # _inc_hit_count_and_check of a live node: count, no backup
                elif core._inc_hit_count_and_check(child):
                    actions.append(core._build_backup_kv_action(child))
            node = child
            total += prefix_len
            offset += prefix_len
            consumed += prefix_len
        else:
            sync()
            state.overlap_node = child
            state.overlap_prefix_len = prefix_len
            state.phase = U["_InsertPhase"].OVERLAP
            core._insert_overlap_step(state)
            node, total, offset, value, consumed = state.node, state.total_prefix_length, _offset(core, state), state.value, 0
            if state.phase is not WALK:  # a backend's resource barrier resumes in OVERLAP
                return
        # _advance_insert suspends after a step that emitted a non-deferrable action.
        if len(actions) > mark and not all(map(core._is_deferrable_action, actions[mark:])):
            sync()
            return


def _unevict_step(core: Any, state: Any, node: Any, prefix_len: int) -> None:
    """Stock's walk step for an evicted node: Full comes back from the request's fresh KV and the aux
    components rebuild from the same slice."""
    base = _UPSTREAM["BASE_COMPONENT_TYPE"]
    core._unevict_node_on_insert(node, state.value[:prefix_len], session_id=state.params.session_id)
    state.result.record_adopted_range(base, state.total_prefix_length, state.total_prefix_length + prefix_len)
    for component in core.components:
        if component.component_type == base:
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
    if _STOCK_ATTR in core.__dict__:
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
    if _STOCK_ATTR in core.__dict__:
        return wrapped(*args, **kwargs)
    state = args[0] if args else kwargs["state"]
    offset = _offset(core, state)
    core.__dict__.pop(_OFFSET_ATTR, None)
    if offset:
        state.key = state.key[offset:]
    return wrapped(*args, **kwargs)


# -- prefix match ----------------------------------------------------------------------------------
def _match_helper(wrapped: Any, core: Any, args: tuple, kwargs: dict) -> Any:
    """``_match_prefix_helper`` with the fast child lookup and whole-node match; validators, splits,
    values and the post-processor as stock. Under HiCache, as stock, two validator sets: the best
    match may end on host copies (``match_device_only=False``), the best device match may not; both
    sets run on every node, host-capable first (validators keep state)."""
    if _STOCK_ATTR in core.__dict__:
        return wrapped(*args, **kwargs)
    key, params = _bind_match(*args, **kwargs)
    U = _UPSTREAM
    base, full = U["BASE_COMPONENT_TYPE"], U["FULL"]
    page, root = core.page_size, core.root_node
    scan = page > 1 and _plain(key)
    n1 = len(key)
    if n1 < page:  # stock's first child_key_at raises IndexError: let it
        return wrapped(*args, **kwargs)
    node, offset = root, 0
    value: list[Any] = []
    best_node = best_device_node = node
    best_device_len, full_hit, action = 0, 0, None
    separate = core.enable_hicache
    validators = core._create_match_validators(params, match_device_only=not separate)
    device_validators = core._create_match_validators(params, match_device_only=True) if separate else validators
    while offset < n1:
        child, prefix_len = _child(node, key, offset, page, scan)
        if child is None:
            break
        evicted = child.parent is not None and child.component_data[full].value is None
        if evicted and child.component_data[full].host_value is None:  # dead: not backuped
            break
        if prefix_len == _PARTIAL:
            prefix_len = child.key.match_at(key, offset, page_size=page)
        full_hit += prefix_len
        split = prefix_len < len(child.key)
        if split:
            node, action = core._split_node(child.key, child, prefix_len)
            if not node.evicted:
                value.append(node.component_data[base].value)
        else:
            if not evicted:
                value.append(child.component_data[base].value)
            node = child
        # every validator runs: they keep state
        if all([validator(node) for validator in validators]):
            best_node = node
            if not separate:
                best_device_node, best_device_len = node, len(value)
        if separate and all([validator(node) for validator in device_validators]):
            best_device_node, best_device_len = node, len(value)
        if split:
            break
        offset += prefix_len
    return core._match_post_processor(
        params,
        value,
        best_node,
        best_device_node,
        best_device_len,
        full_hit,
        action,
        last_visited_node_id=node.id if node is not root else None,
        device_validators=device_validators,
    )


def _bind_match(key: Any, params: Any) -> tuple[Any, Any]:
    return key, params


# -- Full lock walks -------------------------------------------------------------------------------
def _bind_acquire(node: Any, result: Any, lock_host: bool = False) -> tuple[Any, Any, bool]:
    return node, result, lock_host


def _bind_release(node: Any, params: Any, lock_host: bool = False) -> tuple[Any, bool]:
    return node, lock_host


def _fast_full(component: Any) -> bool:
    """The component and its core use the stock length and leaf-set methods (pinned)."""
    core = component.tree_core
    if _STOCK_ATTR in core.__dict__:
        return False
    U = _UPSTREAM
    cls, core_cls = type(component), type(core)
    return (
        cls.reclaimable_value_len is U["reclaimable_value_len"]
        and cls.value_len is U["value_len"]
        and core_cls._update_evictable_leaf_sets is U["update_leaf_sets"]
        and core_cls._is_device_leaf is U["is_device_leaf"]
    )


def _full_acquire(wrapped: Any, component: Any, args: tuple, kwargs: dict) -> Any:
    """``FullComponent.acquire_component_lock`` (device lock) with the value length inlined."""
    node, result, lock_host = _bind_acquire(*args, **kwargs)
    if lock_host or not _fast_full(component):
        return wrapped(*args, **kwargs)
    ct = component.component_type
    core = component.tree_core
    root = core.root_node
    evictable, protected = core.component_evictable_size_, core.component_protected_size_
    discard = core.evictable_device_leaves.discard
    cur = node
    # The bottom device-evicted segment is locked too (no ledger move).
    while cur is not root and cur.component_data[ct].value is None:
        cur.component_data[ct].lock_ref += 1
        cur = cur.parent
    delta = 0
    while cur is not root:
        cd = cur.component_data[ct]
        value = cd.value
        assert value is not None, f"FULL invariant broken: evicted ancestor {cur.id} above device-on segment"
        if cd.lock_ref == 0:
            key_len = value.shape[0] if type(value) is _Tensor else len(value)  # reclaimable_value_len
            evictable[ct] -= key_len
            protected[ct] += key_len
            delta += key_len
        cd.lock_ref += 1
        discard(cur)
        cur = cur.parent
    result.delta = delta
    return result


def _full_release(wrapped: Any, component: Any, args: tuple, kwargs: dict) -> None:
    """``FullComponent.release_component_lock`` (device lock) with the value length and the
    evictable-leaf refresh of every node it unlocks inlined."""
    node, lock_host = _bind_release(*args, **kwargs)
    if lock_host or not _fast_full(component):
        return wrapped(*args, **kwargs)
    ct = component.component_type
    core = component.tree_core
    root = core.root_node
    evictable, protected = core.component_evictable_size_, core.component_protected_size_
    cur = node
    while cur is not root:
        cd = cur.component_data[ct]
        ref = cd.lock_ref
        assert ref > 0, f"FULL segment release hit lock_ref=0 on node {cur.id}"
        value = cd.value
        if ref == 1 and value is not None:
            key_len = value.shape[0] if type(value) is _Tensor else len(value)  # reclaimable_value_len
            evictable[ct] += key_len
            protected[ct] -= key_len
        cd.lock_ref = ref - 1
        if ref == 1:
            refresh_leaf_sets(core, cur)
        cur = cur.parent


def refresh_leaf_sets(core: Any, node: Any) -> None:
    """``core._update_evictable_leaf_sets(node)`` for the stock core: the same set operations, with
    ``_is_device_leaf`` inlined (``_is_host_leaf`` is asked only for an evicted node; it is False
    for any other)."""
    U = _UPSTREAM
    cds = node.component_data
    evicted = node.parent is not None and cds[U["FULL"]].value is None
    leaf = node is not core.root_node and not evicted
    if leaf:
        for cd in cds:
            if cd.lock_ref > 0:
                leaf = False
                break
    if leaf:
        base = U["BASE_COMPONENT_TYPE"]
        for child in node.children.values():
            if child.component_data[base].value is not None:
                leaf = False
                break
    if leaf:
        core.evictable_device_leaves.add(node)
    else:
        core.evictable_device_leaves.discard(node)
    if evicted and core._is_host_leaf(node):
        core.evictable_host_leaves.add(node)
    else:
        core.evictable_host_leaves.discard(node)


# Upstream names the hot paths use, resolved once at install (not per walked node).
_UPSTREAM: dict[str, Any] = {}
# torch.Tensor, set at install: a 1-D tensor's len() is shape[0], but len() goes through Python.
_Tensor: Any = None


def install(ctx: api.SwitchContext) -> dict[str, object]:
    from sglang.srt.mem_cache.unified_cache.components import base
    from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore, _InsertPhase

    global _Tensor
    import torch

    _Tensor = torch.Tensor
    core_fns = vars(UnifiedTreeCore)
    _UPSTREAM.update(
        BASE_COMPONENT_TYPE=base.BASE_COMPONENT_TYPE,
        FULL=base.ComponentType.FULL,  # UnifiedTreeNode.evicted reads ComponentType.FULL
        _InsertPhase=_InsertPhase,
        WALK=_InsertPhase.WALK,
        time_counter=base.get_and_increase_time_counter,
        WALKDOWN=base.LRURefreshPhase.WALKDOWN,
        swa_refresh=vars(SWAComponent)["refresh_lru"],
        # Base: claims nothing; SWA: returns at once when the node is inside prev_prefix_len.
        quiet_overlaps=(
            vars(base.TreeComponent)["update_component_on_insert_overlap"],
            vars(SWAComponent)["update_component_on_insert_overlap"],
        ),
        reclaimable_value_len=vars(base.TreeComponent)["reclaimable_value_len"],
        value_len=vars(base.TreeComponent)["value_len"],
        update_leaf_sets=core_fns["_update_evictable_leaf_sets"],
        is_device_leaf=core_fns["_is_device_leaf"],
    )
    for target, wrapper in (
        (WALK_STEP, _walk_step),
        (FINISH_NODE, _finish_node),
        (COMMIT_STEP, _commit_step),
        (MATCH_HELPER, _match_helper),
        (FULL_ACQUIRE, _full_acquire),
        (FULL_RELEASE, _full_release),
    ):
        ctx.wrap(target, wrapper)
    return {"paths": "insert_walk,match,full_lock", "key_copies": "once_per_insert"}
