"""SWA thin (``DSV41_SWA_THIN=1``): checkpoints a request has moved past are evicted first, so idle
agent sessions keep their resume point.

What it changes: a cached prefix of a sliding-window model can be resumed only at a tree node whose
last window still holds SWA slots. Every chunk checkpoint and every turn leaves such a node, all in
one SWA LRU list, and in stock LRU order an idle session's only resume point dies after the SWA
slots of a few other requests (8 requests, 163K slots at DSV4 geometry), so its next turn
re-prefills the whole context although its Full KV is still resident (sglang#26907). With this
switch, when a request's checkpoint lands (``UnifiedRadixCache.checkpoint_into_tree``, the one
tree-insert point of 0.5.23), the checkpoint it has moved past goes to the evict-first end of the
SWA LRU: the previous chunk's checkpoint of a chunked prefill while more chunks follow, or the
prefix-match node of a request that finished its prefill in one pass (the previous turn's leaf) and,
with it, the next checkpoint above it on the same unshared path (that turn's last prompt
checkpoint, kept below). At the evict-first end the moved checkpoints keep stock's order among
themselves, oldest first (each goes in front of those moved before it), so of the checkpoints a
prompt's chunks passed the deepest, the one a branch in the prompt's last chunks resumes at, is the
last to go. Only the list order changes: membership, sizes, locks and ``last_access_time`` stay
identical, so the Full heap, the match and every accounting ledger see exactly the stock tree.

Left where they are:
* the first chunk's prefix-match node of a chunked request (the session's resume point before the
  turn; the turn may still be aborted);
* the prompt's last chunk checkpoint, passed by the insert that ends a chunked prefill. Requests
  that share the prompt's document but not its question branch inside that last chunk, and resume
  at the deepest checkpoint below their branch point with a live window (0.5.23's match validator).
  Demoted, it was evicted before anything shared it and the first such request re-prefilled the
  document where stock resumed (``tests/upstream/test_swa_thin_branching.py``); SGLang's own
  branching-point insert (``swa_branching_seqlen``: the request that finds Full KV past its SWA
  boundary inserts a checkpoint there) then serves every later one under both orders, and the new
  node has two children, so thin keeps it (shared). A session's next turn that moves past the
  finished leaf demotes this checkpoint with the leaf: the path proved to be one conversation;
* every node of the new checkpoint's own window (W + page tokens up from it);
* locked nodes (``lock_ref > 0``: a running request holds them);
* shared nodes: more than one child (another request branched there, e.g. a system-prompt
  boundary), or a hit count above the creator's plus this request's (``hit_count > 2``: a third
  request inserted through it);
* with ``--enable-session-radix-cache``, session-referenced nodes (``session_ref > 0``); the others
  move to the evict-first end of the unreferenced partition, which is the tail (``mid`` stays the
  partition boundary);
* anything of a finished request's release (the finished turn's leaf is the resume point).

The tree core: the default Rust core cannot reorder its LRU, so the switch sets
``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python`` before the cache is built (the engine reads it
when it constructs the cache) and turns on ``fast_tree_core`` (``DSV41_SWA_FAST_CORE``), which
takes the key copies, tuple child keys and method layers out of the Python insert walk, prefix match
and Full lock walks (identical results). If the operator set the variable to
``rust`` the switch refuses. A cache built with an explicit Rust core is left stock (one warning).

Beside HiCache (``--enable-hierarchical-cache``): "moved past" stays a tree fact (the request's
previous checkpoint, under the rules above); host copies do not change which checkpoint a request
has passed, only what leaving the device costs it. Write-through has usually copied a passed
checkpoint to host already (its hit threshold is 1, selective 2), so demoting it drops only the
device copy; under write-back HiCache copies its window to host when it leaves the device
(``InternalStateBackup``), as it would later in stock LRU order. The rule reads ``hit_count``,
which write-back never counts (``_inc_hit_count_and_check`` and ``_should_backup_after_insert``
return first): the switch counts there exactly as every other policy does (live nodes only; the
answer stays stock's False; nothing upstream but that function reads the count), so hits and
demotions are the same under every write policy (``tests/upstream/test_swa_thin_hicache.py``).
Measured beside HiCache: ``python -m adapter bench swa-thin-hicache`` (docs/benchmarks.md).

Left stock beside HiCache: an inner node whose Full KV is on host and whose window is on device
only loses the window on both tiers at its SWA tombstone, under every write policy (0.5.23 backs
an inner window up there only under write-back and only while the node's Full KV is not on host;
write-through backs a window up at insert only within one window of the insert's target). A node
gets there once the SWA host tier is full: its host copy was evicted for room, then a request
recomputed through it (``tests/upstream/test_hicache_swa_window_drop.py``). Upstream PR #40712
demotes such windows to host under write-back; this switch does not, under any policy: with the
host tier full each demotion first evicts the host's oldest SWA entries (a host-only leaf goes
whole, Full KV included), and on the cache kit that recomputed more, not less, under write-through
(the datacenter profile's policy) and under write-back on mixed traffic
(``python -m adapter bench swa-host-demote``).

What no online order can promise: a document whose reader's question spans more than one chunk
past the document's last checkpoint. The reader passes that checkpoint mid-prefill, before anything
shares it; thin demotes it (behind the checkpoints demoted before it), and when SWA eviction reaches
it before the first request branching there arrives, that request re-prefills from the checkpoint
below where stock, if it kept the window, resumed (only the first: it inserts the branch point).
Measured with ``python -m adapter simulate synthetic_trace.jsonl --share 1/16 --policies
stock,thin``: thin recomputes 3,368,448 tokens vs stock's 3,385,856 (3,439,872 before this rule).

Receipts: ``installed tree_core=python backend_set_by=overlay|operator``; every 1024 hooked inserts
``[dsv41] swa_thin demoted hooked=.. demoting_inserts=.. demoted_nodes=..``.

Measured (``python -m adapter bench swa-thin``, DSV4 geometry, SWA pool of the real configurator at
64 running requests and 256 tails): an idle 300K-token session's resume point survives 4.2x the
other traffic (1.43M -> 5.99M SWA slots, where the simulated 6M-token Full pool becomes the limit);
after 2M slots of traffic stock re-prefills both idle sessions whole (619K tokens), thin none.

Rollback: unset ``DSV41_SWA_THIN``; the engine goes back to the stock LRU order and its default
(Rust) tree core. If the profile raised ``--swa-prefix-tails`` alongside, set it back to 128.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

from adapter.core import api
from adapter.core.api import Refusal

SWITCH = api.handle(__name__)
BACKEND_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
# Set beside BACKEND_ENV by the overlay, so a child process (the scheduler inherits the launcher's
# environment) still knows who chose the Python core. Not a DSV41_* key: no profile sets it.
SET_BY_OVERLAY_ENV = "_DSV41_TREE_CORE_SET_BY_OVERLAY"
RECEIPT_EVERY = 1024
SHARED_HIT_COUNT = 2  # the node's creator plus the request passing it
# On an SWA LRU list: (the installation's STATS, the node thin demoted last). The run from that node
# to the tail holds the nodes thin demoted and nothing has touched since, oldest nearest the tail:
# upstream adds nodes at the most-recently-used end (``head`` or ``mid``), except a split's new prefix
# node, which goes right behind the node it was split from (``_split_node``: inside the run only when
# that node is in it, and it then leaves with it, as in stock order) and the eviction walk's cursor
# sentinel. A run kept by an earlier installation in this process is forgotten: its front may have
# moved while no wrapper watched.
FRONT = "_dsv41_thin_front"


@dataclass
class Stats:
    hooked: int = 0  # checkpoint_into_tree calls seen on a python-core SWA cache
    demoting_inserts: int = 0  # of which moved at least one node
    demoted: int = 0  # nodes moved to the evict-first end
    rust_caches: int = 0  # caches built with an explicit Rust core (left stock)


STATS = Stats()

# Caches left in stock LRU order while the switch is installed (side-by-side tests, benchmarks).
_STOCK: weakref.WeakSet[Any] = weakref.WeakSet()


def keep_stock(cache: Any) -> None:
    """Leave ``cache`` in stock LRU order and stock hit counts (a twin to compare thin against)."""
    _STOCK.add(cache)
    _STOCK_CORES.add(cache.tree_core)


_STOCK_CORES: weakref.WeakSet[Any] = weakref.WeakSet()


class _Environ:
    """``os.environ`` as attributes, so ``patch.set_attr`` can set a variable and revert it."""

    def __getattr__(self, name: str) -> str:
        try:
            return os.environ[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: str) -> None:
        os.environ[name] = value

    def __delattr__(self, name: str) -> None:
        os.environ.pop(name, None)


ENVIRON = _Environ()


def install(ctx: api.SwitchContext) -> dict[str, object]:
    SWITCH.bind(ctx)
    chosen = os.environ.get(BACKEND_ENV)
    inherited = chosen == "python" and os.environ.get(SET_BY_OVERLAY_ENV) == "1"
    if chosen is not None and chosen.strip().lower() != "python":
        raise Refusal(
            f"{BACKEND_ENV}={chosen!r} was set by the operator; SWA thin reorders the SWA LRU, which only "
            f"the Python tree core allows (unset it or set it to python)"
        )
    ctx.wrap("UnifiedRadixCache.checkpoint_into_tree", _checkpoint_into_tree)
    ctx.wrap("UnifiedRadixCache.__init__", _cache_init)
    ctx.wrap("UnifiedTreeCore._inc_hit_count_and_check", _count_hit_under_write_back)
    ctx.wrap("UnifiedTreeCore._should_backup_after_insert", _count_creator_under_write_back)
    ctx.wrap("UnifiedLRUList._remove_node", _unlink)
    if chosen is None:
        ctx.set_attr(ENVIRON, BACKEND_ENV, "python")  # read when the cache is built, after this
        ctx.set_attr(ENVIRON, SET_BY_OVERLAY_ENV, "1")
    global STATS
    STATS = Stats()
    set_by = "overlay" if chosen is None or inherited else "operator"
    return {"tree_core": "python", "backend_set_by": set_by,
            "receipt_every": RECEIPT_EVERY}


NO_SWA_TREE = ("the prefix tree has no SWA component (a model without sliding windows, or DeepSeek-V4.1 under "
               "--enable-encoder-swa-bounded-replay, which keeps windows in per-request rings and ignores "
               "--swa-prefix-tails): there is no SWA LRU to reorder")


def predict(profile: api.Profile) -> api.Prediction:
    """What ``check`` predicts a boot logs: installed at import, the cache build can still refuse
    (:data:`NO_SWA_TREE`), which the model's ``config.json`` and the launch line foretell."""
    if profile.status != "installed":
        return api.Prediction()
    model = profile.model
    encoder_rings = "--enable-encoder-swa-bounded-replay" in profile.argv
    if encoder_rings and (model is None or model.model_type == "deepseek_v41"):
        return api.Prediction(f"refused: {NO_SWA_TREE}")
    if model is None:
        return api.Prediction("not decided (no model config.json: the cache build decides, and refuses a tree "
                              "without an SWA component)")
    if model.pool == "none":
        return api.Prediction(f"refused: {NO_SWA_TREE}")
    return api.Prediction()


def _cache_init(wrapped: Any, cache: Any, args: tuple, kwargs: dict) -> Any:
    """Never silently inert: a cache built without an SWA component refuses the switch at once (a
    boot failure under ``DSV41_STRICT=1``); the inserts then run stock."""
    out = wrapped(*args, **kwargs)
    if not cache.disable and not cache.is_swa_enabled:
        SWITCH.refuse_late(NO_SWA_TREE)
    return out


def _count_hit_under_write_back(wrapped: Any, core: Any, args: tuple, kwargs: dict) -> bool:
    """HiCache write-back returns from ``_inc_hit_count_and_check`` before counting (it never backs
    up on a hit): count the hit of a live node here, as every other policy does, and return what
    stock returns (False). ``hit_count`` is read by nothing else upstream but this function (and
    copied by ``_split_node``)."""
    if not core.is_write_back or core in _STOCK_CORES:
        return wrapped(*args, **kwargs)
    node = args[0] if args else kwargs["node"]
    if not node.evicted:
        node.hit_count += 1
    return False


def _count_creator_under_write_back(wrapped: Any, core: Any, args: tuple, kwargs: dict) -> bool:
    """Under write-back ``_should_backup_after_insert`` returns before counting a new leaf's creator
    (``_inc_hit_count_and_check``, as every other policy does): count it here; the answer (False)
    is stock's."""
    out = wrapped(*args, **kwargs)
    if core.is_write_back and core not in _STOCK_CORES:
        state = args[0] if args else kwargs["state"]
        if state.is_new_leaf and state.total_prefix_length + len(state.target_node.key) > state.params.inserted_len:
            core._inc_hit_count_and_check(state.target_node)  # counted by the wrapper above; False
    return out


def _checkpoint_into_tree(wrapped: Any, cache: Any, args: tuple, kwargs: dict) -> Any:
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    if cache.disable or cache in _STOCK:
        return wrapped(*args, **kwargs)
    if not cache.is_swa_enabled:  # refused when the cache was built (_cache_init): stock insert
        return wrapped(*args, **kwargs)
    core = cache.tree_core
    if not isinstance(core, UnifiedTreeCore):
        if not getattr(cache, "_dsv41_thin_warned", False):
            cache._dsv41_thin_warned = True
            STATS.rust_caches += 1
            SWITCH.event("inactive", level=logging.WARNING, reason="cache_built_with_rust_tree_core")
        return wrapped(*args, **kwargs)

    req = args[0] if args else kwargs["req"]
    up_to = kwargs["up_to"] if "up_to" in kwargs else args[1]
    finished = req.finished()
    old_id = req.last_node
    first_insert = req.kv.cache_inserted_len == 0
    result = wrapped(*args, **kwargs)

    STATS.hooked += 1
    new_id = req.last_node
    moved = 0
    # A finished turn's leaf is the session's resume point: nothing to demote on release. A
    # streaming session's slot stands in an object for its node (not a NodeId, not in the tree):
    # nothing of the tree to demote either (is_root would raise KeyError and kill the scheduler).
    tree_ids = isinstance(old_id, int) and isinstance(new_id, int)
    if not finished and tree_ids and old_id != new_id and not core.is_root(old_id):
        prefill_done = up_to >= len(req.origin_input_ids)
        # Demoted: a one-pass prefill's prefix-match node, and a chunked prefill's previous chunk
        # checkpoint while more chunks follow. Kept: the first chunk's prefix-match node, and the
        # prompt's last chunk checkpoint (passed by the insert that ends a chunked prefill).
        if first_insert == prefill_done:
            swa = cache.components[_swa_type()]
            moved = demote_passed(core, old_id, new_id, swa.sliding_window_size + cache.page_size,
                                  then_next=first_insert)
    if moved:
        STATS.demoting_inserts += 1
        STATS.demoted += moved
    periodic = STATS.hooked % RECEIPT_EVERY == 0
    if periodic or api.metrics_on():  # with metrics on, every insert's running totals (DEBUG between)
        SWITCH.event("demoted", level=logging.INFO if periodic else logging.DEBUG, hooked=STATS.hooked,
                     demoting_inserts=STATS.demoting_inserts, demoted_nodes=STATS.demoted)
    return result


def _swa_type() -> Any:
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return ComponentType.SWA


def is_shared(node: Any) -> bool:
    """Another request depends on this node: it branched there, or inserted through it."""
    return len(node.children) > 1 or node.hit_count > SHARED_HIT_COUNT


def demote_passed(core: Any, old_id: int, new_id: int, cover: int, then_next: bool = False) -> int:
    """Move the SWA-bearing nodes of ``old_id``'s last window (``cover`` tokens up from it) to the
    evict-first end of the SWA LRU, except those of ``new_id``'s own window and locked, shared or
    session-referenced nodes. With ``then_next`` (a one-pass prefill moving past the previous
    turn's leaf), also the next window above it on the same unshared path (the previous turn's
    last prompt checkpoint). Only the list order changes. Returns the number of nodes moved."""
    ct = _swa_type()
    lru = core.lru_lists[ct]
    root = core.root_node
    keep, node, covered = set(), core.node_by_id(new_id), 0
    while node is not root and covered < cover:
        keep.add(node.id)
        covered += len(node.key)
        node = node.parent
    referenced = lru._is_referenced
    pt = lru._pt

    def window(node: Any) -> tuple[list[Any], Any]:
        picked, covered = [], 0
        while node is not root and covered < cover:
            data = node.component_data[ct]
            if (
                node.id not in keep
                and data.value is not None
                and data.lock_ref == 0
                and node.id in lru.cache
                and not is_shared(node)
                and (referenced is None or not referenced(node))
            ):
                picked.append(node)
            covered += len(node.key)
            node = node.parent
        return picked, node

    picked, node = window(core.node_by_id(old_id))
    if then_next:
        # Up the tombstoned stretch to the next SWA-bearing node, on this request's own path only.
        while node is not root and node.component_data[ct].value is None and not is_shared(node):
            node = node.parent
        if node is not root and not is_shared(node):
            picked = window(node)[0] + picked  # the passed resume point goes last: nearest the tail
    # Oldest demoted first, stock's own order among passed checkpoints: this call's nodes go in
    # front of those demoted before them, its last picked node nearest the evict-first end.
    for node in reversed(picked):
        lru._remove_node(node)  # moves the front on if ``node`` was it
        installation, front = getattr(lru, FRONT, (None, None))
        if installation is not STATS:  # no run yet, or one kept by an earlier installation
            front = lru.tail
        lru._add_node_after(front.lru_prev[pt], node)
        setattr(lru, FRONT, (STATS, node))
    return len(picked)


def _unlink(wrapped: Any, lru: Any, args: tuple, kwargs: dict) -> Any:
    """Every node leaving its place in an LRU list (evicted, refreshed to most-recently-used, moved
    by thin) is unlinked here: when it is the front of thin's demoted run, the front passes to the
    next node toward the tail (the tail itself when the run is empty)."""
    node = args[0] if args else kwargs["node"]
    installation, front = getattr(lru, FRONT, (None, None))
    if front is node:
        setattr(lru, FRONT, (installation, node.lru_next[lru._pt]))
    return wrapped(*args, **kwargs)
