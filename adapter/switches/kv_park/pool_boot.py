"""The park pool at boot: carved out of HiCache's host pools beside HiCache, else (CUDA KV pool)
pinned once after the TP ranks on the host agree there is room; one timed ``kv_park pool`` line.
"""

from __future__ import annotations

import time
from typing import Any

from adapter.core import api
from adapter.switches.kv_park import beside_hicache, host_ledger
from adapter.switches.kv_park.host_pool import CudaHostRegister, HostPool, PageLocker, PoolError
from adapter.switches.kv_park.state import GIB, _State
from adapter.switches.kv_park.store import SWITCH


def boot_pool(
    budget_gib: int,
    *,
    locker: PageLocker | None = None,
    chunk_bytes: int | None = None,
    ranks: int = 1,
    ledger: Any = None,
    group: str | None = None,
) -> tuple[HostPool, dict[str, object]]:
    """The park pool of a CUDA KV pool: ``budget_gib`` GiB page-locked once, in chunks, and the
    facts of its boot line.

    The ``ranks`` TP ranks of this server on this host agree first (:mod:`host_ledger`): they pass
    or refuse together. A pool refused, or one that cannot be allocated or locked, is a boot failure
    (:class:`api.BootError`) naming ``DSV41_KV_PARK_GIB``, the size and the limit it hit. ``locker``
    is the page-locking call (``cudaHostRegister``; tests inject a failing one)."""
    what = f"DSV41_KV_PARK_GIB={budget_gib}"
    kwargs = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    try:
        facts = host_ledger.agree(budget_gib * GIB, ranks=ranks, what=what, group=group, ledger=ledger)
        pool = HostPool.allocate(budget_gib * GIB, locker=CudaHostRegister() if locker is None else locker, what=what, **kwargs)
        host_ledger.report_pinned(group=group, ledger=ledger)
    except PoolError as exc:
        raise api.BootError(f"kv_park: {exc}") from exc
    return pool, facts


def ranks_on_this_host(server_args: Any) -> int:
    """The scheduler ranks of one server on one host, each pinning its own pool: TP x PP over the nodes."""
    if server_args is None:
        return 1
    ranks = int(getattr(server_args, "tp_size", 1) or 1) * int(getattr(server_args, "pp_size", 1) or 1)
    return max(1, ranks // max(1, int(getattr(server_args, "nnodes", 1) or 1)))


def _boot_pool(state: _State, scheduler: Any, *, at: str, ranks: int = 1) -> None:
    """Beside HiCache, the park pool is carved out of HiCache's host pools (one host budget);
    otherwise a CUDA KV pool parks into a pinned pool allocated now, once, and a CPU pool keeps
    pageable entries (nothing to pin). One ``kv_park pool at=boot|first_pass boot_ms=..`` line."""
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    if allocator is None or state.store.host_pool is not None:
        return
    state.pool_booted = True
    start = time.perf_counter()
    tree = getattr(scheduler, "tree_cache", None)
    if beside_hicache.attached(tree):
        try:
            carved, facts = beside_hicache.carve_pool(tree, state.store.budget // GIB)
        except PoolError as exc:
            raise api.BootError(f"kv_park: {exc}") from exc
        state.store.use_pool(carved)
        state.beside_hicache = True
        SWITCH.event("pool", **facts, **carved.describe(), at=at, boot_ms=_ms_since(start))
        return
    device = getattr(allocator, "device", None) or getattr(allocator.get_kvcache(), "device", "cpu")
    if not str(device).startswith("cuda"):
        SWITCH.event("pool", pool="pageable", reason="cpu_kv_pool", at=at)
        return
    pool, facts = boot_pool(state.store.budget // GIB, ranks=ranks)
    state.store.use_pool(pool)
    SWITCH.event("pool", **pool.describe(), **facts, at=at, boot_ms=_ms_since(start))


def _ms_since(start: float) -> float:
    return round((time.perf_counter() - start) * 1e3, 1)
