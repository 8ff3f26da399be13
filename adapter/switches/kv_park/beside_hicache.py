"""Why the park store does not run beside HiCache: the one line the switch logs when it refuses at
the first scheduler pass, and the line ``python -m adapter check`` predicts from the launch line."""

from __future__ import annotations

from typing import Any

GIB = 1 << 30


def reason(host_pool: str, budget_gib: int) -> str:
    """The refusal, ``host_pool`` saying how large HiCache's host pool is (measured, or the flag)."""
    return (f"--enable-hierarchical-cache is on: HiCache pinned its own host pool at boot ({host_pool}) "
            f"and keeps a retracted request's inserted prefix there; the park store "
            f"(DSV41_KV_PARK_GIB={budget_gib}) would be a second host-RAM budget outside it, parking what "
            f"HiCache holds (unset DSV41_KV_PARK, or turn HiCache off)")


def measured(tree_cache: Any) -> str | None:
    """HiCache's host pools attached to ``tree_cache``, in bytes as text (None: no HiCache)."""
    if getattr(tree_cache, "cache_controller", None) is None or getattr(tree_cache, "host_pool_group", None) is None:
        return None
    host = sum(int(e.host_pool.size) * int(e.host_pool.size_per_token) for e in tree_cache.host_pool_group.entries)
    return f"{host / GIB:.2f} GiB" if host >= GIB else f"{host / (1 << 20):.1f} MiB"


def from_flags(server_args: Any) -> str | None:
    """HiCache's host pool as the launch line sizes it (None: HiCache off)."""
    if not getattr(server_args, "enable_hierarchical_cache", False):
        return None
    size = getattr(server_args, "hicache_size", 0) or 0
    if size:
        return f"--hicache-size {size}: {size} GB per rank"
    return f"--hicache-ratio {getattr(server_args, 'hicache_ratio', 2.0)}: that many times the device KV pool"
