"""SWA windows HiCache drops at an internal SWA tombstone while the node's Full KV is on host, and
upstream PR #40712's demotion for that case: an experiment for tests and the bench, never
installed in a server (SWA thin does not adopt it: docs/switches/swa_thin.md, "Beside HiCache").

The case. SGLang 0.5.23's ``SWAComponent._evict_device_next_node`` (``components/swa.py`` ~797-813)
backs an internal node's device-only SWA window up to host before the SWA tombstone only under
write-back and only while the node's Full KV is not on host (``not x.backuped``); write-through and
write-through-selective never back up at eviction. A node whose Full KV is on host and whose
window is on device only therefore loses the window on both tiers at its SWA tombstone while its
Full KV stays on device, and a later request resuming at the node's boundary matches short of it.
How a node gets there: its SWA host copy is evicted for host room (``drive_host_eviction``: at an
internal node that frees the SWA host copy only), then a request recomputes through the node and
republishes the window on device (``_recover_from_incoming``); write-through backs that window up
at insert only when it lies within one window of the insert's target node.

:func:`demote_host_backed_windows` applies PR #40712's behaviour to that case: before such a
node's SWA tombstone, make SWA host room (``evict_host``), back the window up
(``backup_node_for_write_back``, the helper stock calls for the write-back case) and wait for the
copy; the stock tombstone then keeps the host copy, a later match accepts it as a boundary and
the load-back restores it. :class:`DroppedWindows` records every internal SWA tombstone that leaves
no host copy (read-only).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

_SWA_NEXT = "sglang.srt.mem_cache.unified_cache.components.swa:SWAComponent._evict_device_next_node"
_DETACH = "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._evict_component_and_detach_lru"
_BACKUP = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.backup_node_for_write_back"
_SHOULD_BACKUP = "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._should_backup_after_insert"
_COLLECT = "sglang.srt.mem_cache.unified_cache.components.swa:SWAComponent._collect_unbacked_swa_nodes"

#: The upstream functions whose behaviour this module's description and wrap depend on.
PINS: dict[str, str] = {
    _SWA_NEXT: "aa54958cdcbc37cac84205e20aae77ab133157e294bfe09e5236a618f089bada",
    _BACKUP: "3feee37843265f1b3e73459c3c42362a68b546a4360297fc142d7687de48c870",
    _SHOULD_BACKUP: "2591b96f6c167e2e72b253cab41825260dab952703e428026f41eed16febc026",
    _COLLECT: "d276b9434edc8857bd6daf39aaf35e2839f345db43552fcd95d9a1d837b634f4",
    _DETACH: "0ee097e199f78544f92d2edbc7415742788603752c1e3601e3ce08e139ed3235",
}


class ExperimentDrifted(RuntimeError):
    """An upstream function the experiment relies on has drifted from its pin."""


def _check_pins() -> None:
    from adapter.core.pins import drifted

    found = drifted(PINS)
    if found:
        raise ExperimentDrifted("swa_host_demote refused: " + "; ".join(found))


def is_host_backed_device_window(component: Any, node: Any) -> bool:
    """The case stock leaves open: ``node`` is the SWA walk's next victim as an internal node (not
    a leaf it evicts whole), its Full KV is on device and on host, its SWA window on device only,
    no write is pending on it, and the cache has an SWA host pool."""
    from sglang.srt.mem_cache.unified_cache.components.base import BASE_COMPONENT_TYPE

    core = component.tree_core
    if node is None or not (core.enable_hicache and core.has_swa_host_pool):
        return False
    cd = node.component_data[component.component_type]
    if cd.value is None or cd.host_value is not None or cd.lock_ref > 0:
        return False
    if not node.backuped or node.component_data[BASE_COMPONENT_TYPE].value is None:
        return False
    if node.write_through_pending_id is not None or not core.lru_lists[component.component_type].in_list(node):
        return False
    whole_leaf = node in core.evictable_device_leaves and (
        not core.enable_session_radix_cache or component._can_evict_leaf_atomically(node))
    return not whole_leaf


@dataclass
class DemoteStats:
    demoted: int = 0  # windows backed up before their tombstone
    failed: int = 0  # no host copy after the attempt (host room could not be made): dropped as stock


def _demote_before_tombstone(stats: DemoteStats):
    def wrapper(wrapped: Any, component: Any, args: tuple, kwargs: dict) -> Any:
        node = component._evict_device_cursor  # the node the stock step examines next
        if is_host_backed_device_window(component, node):
            window = component._collect_unbacked_swa_nodes(node)
            needed = sum(len(n.component_data[component.component_type].value) for n in window)
            cache = component.cache
            pool = cache.host_pool_group.get_pool(component.pool_name)
            if pool is not None and pool.available_size() < needed:
                cache.evict_host(needed, component.component_type)
            cache.backup_node_for_write_back(node.id)
            if cache.ongoing_write_through:  # Full already on host: the helper returned before waiting
                cache.writing_check(write_back=True)
            if node.component_data[component.component_type].host_value is not None:
                stats.demoted += 1
            else:
                stats.failed += 1
        return wrapped(*args, **kwargs)

    return wrapper


@contextmanager
def demote_host_backed_windows() -> Iterator[DemoteStats]:
    """Within the block, every cache's SWA eviction walk backs a host-backed node's device-only
    window up to host before its internal SWA tombstone (PR #40712's behaviour for the case 0.5.23
    leaves open), under every write policy."""
    from adapter.core.patching import Patch

    _check_pins()
    stats, patch = DemoteStats(), Patch("devkit.swa_host_demote")
    patch.wrap(_SWA_NEXT, _demote_before_tombstone(stats))
    try:
        yield stats
    finally:
        patch.revert()


@dataclass
class DroppedWindow:
    node_id: int
    tokens: list[int]  # the path from the root to the node's end: a request resuming there starts with it
    full_on_host: bool


@dataclass
class DroppedWindows:
    """Internal SWA tombstones that leave no host copy of the window while the node's Full KV stays
    on device (recorded as they happen; read-only)."""

    windows: list[DroppedWindow] = field(default_factory=list)

    @property
    def with_full_on_host(self) -> list[DroppedWindow]:
        return [w for w in self.windows if w.full_on_host]


def _path_tokens(node: Any) -> list[int]:
    spans = []
    while node.parent is not None:
        spans.append(list(node.key.token_ids))
        node = node.parent
    return [t for span in reversed(spans) for t in span]


@contextmanager
def record_dropped_windows() -> Iterator[DroppedWindows]:
    """Within the block, record every internal SWA tombstone that leaves the window on neither tier
    while the node's Full KV stays on device."""
    from sglang.srt.mem_cache.unified_cache.components.base import BASE_COMPONENT_TYPE, ComponentType

    from adapter.core.patching import Patch

    seen = DroppedWindows()

    def spy(wrapped: Any, core: Any, args: tuple, kwargs: dict) -> Any:
        node, component = args[0], args[1]
        target = kwargs.get("target")
        if component.component_type == ComponentType.SWA and node.children and target is not None and target.name == "DEVICE":
            cd = node.component_data[ComponentType.SWA]
            if cd.value is not None and cd.host_value is None and node.component_data[BASE_COMPONENT_TYPE].value is not None:
                seen.windows.append(DroppedWindow(node.id, _path_tokens(node), node.backuped))
        return wrapped(*args, **kwargs)

    _check_pins()
    patch = Patch("devkit.swa_host_demote")
    patch.wrap(_DETACH, spy)
    try:
        yield seen
    finally:
        patch.revert()
