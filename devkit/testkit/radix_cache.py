"""Probes and multi-session traces on the cache kit, a real ``UnifiedRadixCache`` (FULL + SWA) on CPU.

The kit itself (``CacheKit``, ``build``, ``Geometry``, ``HiCache``) is the one ``simulate`` ships with in
the wheel: tests and benchmarks import it from :mod:`overlay_tools.simulate.cache_kit`. This module adds
what only the checkout has::

    Tokens().fresh(n)                             # fresh token ids: two prompts share only what they are given
    snapshot(kit, lru_order=False)                # whole tree state, comparable across two caches (python core)
    swa_lru(kit)                                  # SWA LRU order (MRU first) as DFS indices (python core)
    misfiled_children(kit)                        # children not filed under child_key of their key (python core)
    TraceRunner / Op                              # multi-session traces, in lockstep on several caches
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from overlay_tools.simulate import cache_kit


class Tokens:
    """Fresh token ids: every span is unique, so two prompts share only what they are given."""

    def __init__(self, start: int = 1_000_000):
        self._next = itertools.count(start)

    def fresh(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


# -- whole-state snapshots (python core) ----------------------------------------------------------
def _dfs(core: Any) -> list[Any]:
    """Nodes in a deterministic order (children sorted by their first page), root first."""
    out, stack = [], [core.root_node]
    while stack:
        node = stack.pop()
        out.append(node)
        kids = sorted(node.children.values(), key=lambda n: tuple(n.key.token_ids[:1]), reverse=True)
        stack.extend(kids)
    return out


def _ids(t: Any) -> tuple[int, ...] | None:
    if t is None:
        return None
    return tuple(int(x) for x in (t.tolist() if hasattr(t, "tolist") else t))


def snapshot(kit: cache_kit.CacheKit, lru_order: bool = False) -> dict[str, Any]:
    """The whole tree state of a python-core cache in a form two caches can be compared by:
    structure and keys, Full and SWA values, lock refs, hit counts, session refs, LRU membership,
    evictable leaves, access-time order (ranks, since the clock is process-global) and the
    component sizes. ``lru_order=True`` adds the SWA LRU order."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    core = kit.core
    nodes = _dfs(core)
    index = {n.id: i for i, n in enumerate(nodes)}
    full, swa = ComponentType.FULL, ComponentType.SWA
    lru = core.lru_lists[swa]
    rows = []
    for n in nodes:
        fd, sd = n.component_data[full], n.component_data[swa]
        rows.append((
            index[n.parent.id] if n.parent is not None else -1,
            tuple(n.key.token_ids) if n.key is not None else (),
            _ids(fd.value), _ids(sd.value), fd.lock_ref, sd.lock_ref, sd.session_ref, n.hit_count,
            n.priority, n.id in lru.cache, n in core.evictable_device_leaves,
        ))
    times = sorted(range(len(nodes)), key=lambda i: nodes[i].last_access_time)
    state: dict[str, Any] = {
        "nodes": rows,
        "access_order": times,
        "evictable": {int(k): v for k, v in core.component_evictable_size_.items()},
        "protected": {int(k): v for k, v in core.component_protected_size_.items()},
        "free": (kit.allocator.full_available_size(), kit.allocator.swa_available_size()),
    }
    if lru_order:
        state["swa_lru"] = swa_lru(kit)
    return state


def swa_lru(kit: cache_kit.CacheKit) -> list[int]:
    """The SWA LRU from MRU to LRU as DFS indices (sentinels ``mid`` as -1, skipped cursor)."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    core = kit.core
    index = {n.id: i for i, n in enumerate(_dfs(core))}
    lru = core.lru_lists[ComponentType.SWA]
    pt = lru._pt
    out, x = [], lru.head.lru_next[pt]
    while x is not lru.tail:
        if x is lru.mid:
            out.append(-1)
        elif x is not lru.cursor:
            out.append(index[x.id])
        x = x.lru_next[pt]
    return out


def misfiled_children(kit: cache_kit.CacheKit) -> list[int]:
    """Ids of nodes not filed in their parent's ``children`` under ``child_key`` of their own key, or
    filed under a parent that is not their ``parent`` (empty when the tree keeps upstream's filing rule,
    which a child lookup by scanning relies on)."""
    page, bad = kit.geometry.page, []
    for node in _dfs(kit.core):
        for filed_key, child in node.children.items():
            if child.parent is not node or child.key.child_key(page) != filed_key:
                bad.append(child.id)
    return bad


# -- multi-session traces, run in lockstep on several caches ---------------------------------------
@dataclass(frozen=True)
class Op:
    """One trace operation. ``turn``: a turn of session ``session`` (``-1`` or out of range: a new
    session; ``fork``: continue its history without replacing it; ``trim_pages``: branch off that many
    pages before the history's end, so match and insert end inside a node) with ``new_pages`` fresh prompt
    pages and ``out_pages`` output pages, prefilled in chunks of ``geometry.chunk`` when ``chunked``
    else in one pass. ``evict_swa`` / ``evict_full``: evict ``pages`` pages of that pool. ``idle``:
    nothing (a gap)."""

    kind: str
    session: int = -1
    new_pages: int = 1
    out_pages: int = 1
    chunked: bool = False
    fork: bool = False
    trim_pages: int = 0
    pages: int = 0


class TraceRunner:
    """Runs the same trace on several caches in lockstep; ``check(stage)`` runs after every
    sub-operation (admission, each checkpoint, release, eviction) on all of them."""

    def __init__(self, kits: list[cache_kit.CacheKit], tokens: Tokens | None = None, max_one_pass: int | None = None,
                 max_history: int | None = None):
        """``max_one_pass``: a one-pass turn whose extend is longer is prefilled in passes of this
        many tokens (small SWA pools cannot hold a long extend at once; the engine would chunk it).
        ``max_history``: a turn whose prompt would be longer starts a new session instead (small
        Full pools must hold a whole prompt)."""
        self.max_one_pass, self.max_history = max_one_pass, max_history
        self.kits = kits
        self.tok = tokens or Tokens()
        self.sessions: list[list[int]] = []
        self.results: list[list[cache_kit.TurnResult]] = []

    def run(self, op: Op, check: Any = None) -> None:
        check = check or (lambda stage: None)
        page = self.kits[0].geometry.page
        if op.kind == "idle":
            return
        if op.kind in ("evict_swa", "evict_full"):
            for kit in self.kits:
                kit.evict(swa=op.pages * page) if op.kind == "evict_swa" else kit.evict(full=op.pages * page)
            check(op.kind)
            return
        assert op.kind == "turn", op.kind
        known = 0 <= op.session < len(self.sessions)
        base = self.sessions[op.session] if known else []
        base = base[: max(0, len(base) - op.trim_pages * page)]
        if self.max_history is not None and len(base) + op.new_pages * page > self.max_history:
            base, known = [], False
        prompt = base + self.tok.fresh(op.new_pages * page)
        reqs = [kit.admit(prompt, op.out_pages * page) for kit in self.kits]
        results = [cache_kit.TurnResult(r.rid, r.prefix_len, r.swa_branching_seqlen, len(prompt) - r.prefix_len) for r in reqs]
        check("admit")
        chunk = self.kits[0].geometry.chunk if op.chunked else (self.max_one_pass or len(prompt))
        while any(req._kit_pos < len(prompt) for req in reqs):  # prefixes may differ between caches
            for kit, req in zip(self.kits, reqs):
                if req._kit_pos < len(prompt):
                    kit.prefill_to(req, min(len(prompt), req._kit_pos + chunk))
            check("checkpoint")
        for kit, req, result in zip(self.kits, reqs, results):
            result.history = kit.finish(req, op.out_pages * page)
        check("release")
        history = results[0].history
        if known and not op.fork:
            self.sessions[op.session] = history
        else:
            self.sessions.append(history)
        self.results.append(results)
