"""KV parking beside HiCache: one host budget, HiCache's.

With ``--enable-hierarchical-cache`` the park pool is not a second host-RAM budget: at boot (once
the scheduler has built its KV cache) it is *carved out of HiCache's host pools*. The switch allocates host slots from
each pool's own allocator (``HostKVCache.alloc``: HiCache then sees them as used, forever) and
parks into the bytes behind those slots (each run of consecutive slots is, per leading index of the
host buffer, one contiguous byte range; every range is trimmed to host pages and becomes one chunk
of a :class:`~adapter.switches.kv_park.host_pool.HostPool`). On CUDA those bytes are HiCache's
page-locked buffers, so nothing is pinned twice either. The carve-out is
``min(DSV41_KV_PARK_GIB, SHARE x HiCache's host pools)``: the host-RAM total of the profile is
HiCache's host pool alone (``--hicache-ratio`` / ``--hicache-size``), and HiCache keeps at least
``1 - SHARE`` of it for its own prefixes.

What is parked (:func:`adapter.switches.kv_park.switch._park`): only the Full pages past the tree's
Full KV of the row, and only the SWA window pages past the prefix the tree serves, on the device or on
host through HiCache (a retraction whose servable prefix it holds in full parks nothing), so no page
is both parked and in HiCache's host pools. The restore brings HiCache's part back through HiCache's
own load-back before it writes the parked tail, or drops the entry (the request recomputes) when
HiCache evicted that part in between. Full KV the tree holds past a window it lost is used from the
device, never parked (see the switch's docstring).

Importing this module imports no SGLang.
"""

from __future__ import annotations

from typing import Any

import torch

from adapter.switches.kv_park.host_pool import HOST_PAGE, HostPool, PoolError

GIB = 1 << 30
SHARE = 0.5  # at most this share of HiCache's host pools is carved out for parking


def attached(tree_cache: Any) -> bool:
    return getattr(tree_cache, "cache_controller", None) is not None and getattr(tree_cache, "host_pool_group", None) is not None


def host_pools(tree_cache: Any) -> list[Any]:
    return [e.host_pool for e in tree_cache.host_pool_group.entries]


def _buffers(pool: Any) -> list[torch.Tensor]:
    buf = getattr(pool, "kv_buffer", None)
    if buf is None:
        return []  # a logical pool (DeepSeek-V4's slot bookkeeping): no bytes of its own
    return [b for b in (buf if isinstance(buf, (list, tuple)) else [buf]) if isinstance(b, torch.Tensor)]


def pool_bytes(pool: Any) -> int:
    return sum(b.numel() * b.element_size() for b in _buffers(pool))


def host_bytes(tree_cache: Any) -> int:
    """HiCache's host pools attached to ``tree_cache``, in bytes (their buffers)."""
    return sum(pool_bytes(p) for p in host_pools(tree_cache))


def describe(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.1f} MiB"


def from_flags(server_args: Any) -> str | None:
    """HiCache's host pool as the launch line sizes it (None: HiCache off)."""
    if not getattr(server_args, "enable_hierarchical_cache", False):
        return None
    size = getattr(server_args, "hicache_size", 0) or 0
    if size:
        return f"--hicache-size {size}: {size} GB per rank"
    return f"--hicache-ratio {getattr(server_args, 'hicache_ratio', 2.0)}: that many times the device KV pool"


def _slot_dim(pool: Any, buf: torch.Tensor) -> tuple[int, int] | None:
    """The buffer dimension its host slots index, and how many slots one of its rows holds (1 for a
    token-major buffer, the slot page for a page-major one); None when no dimension counts them."""
    size, page = int(pool.size), int(pool.page_size)
    for d, n in enumerate(buf.shape):
        if n == size:
            return d, 1
    for d, n in enumerate(buf.shape):
        if page > 1 and n * page == size:
            return d, page
    return None


def _runs(slots: torch.Tensor) -> list[tuple[int, int]]:
    """Runs ``[start, stop)`` of consecutive slot ids."""
    ids = sorted(int(i) for i in slots.tolist())
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _chunks_of(pool: Any, slots: torch.Tensor) -> list[torch.Tensor]:
    """The bytes behind host slots ``slots`` of ``pool``, as host-page aligned uint8 chunks."""
    chunks = []
    for buf in _buffers(pool):
        if buf.device.type != "cpu":
            raise PoolError(f"{type(pool).__name__}: its host buffer is not a host tensor")
        found = _slot_dim(pool, buf)
        if found is None:
            raise PoolError(f"{type(pool).__name__}: no dimension of its host buffer {tuple(buf.shape)} counts its {pool.size} slots")
        d, per_row = found
        lead = buf.shape[:d]
        for first, last in _runs(slots):
            start, stop = -(-first // per_row), last // per_row  # whole rows only
            if stop <= start:
                continue
            for idx in torch.cartesian_prod(*[torch.arange(n) for n in lead]).reshape(-1, len(lead)).tolist() if lead else [[]]:
                part = buf[tuple(idx)].narrow(0, start, stop - start)
                if not part.is_contiguous():
                    raise PoolError(f"{type(pool).__name__}: a run of host slots is not contiguous in its buffer")
                raw = part.reshape(-1).view(torch.uint8)
                skip = (-raw.data_ptr()) % HOST_PAGE
                usable = (raw.numel() - skip) // HOST_PAGE * HOST_PAGE
                if usable > 0:
                    chunks.append(raw[skip : skip + usable])
    return chunks


def carve_pool(tree_cache: Any, budget_gib: int) -> tuple[HostPool, dict[str, object]]:
    """The park pool carved out of HiCache's host pools: ``min(budget, SHARE x host pools)``, taken
    from each pool in proportion to its size. :class:`PoolError` names the sizes when nothing fits."""
    pools = host_pools(tree_cache)
    total = host_bytes(tree_cache)
    want = min(budget_gib * GIB, int(total * SHARE))
    chunks: list[torch.Tensor] = []
    skipped: list[str] = []
    taken = 0
    tokens: list[str] = []  # per host pool: host slots (tokens) carved out / its slots
    for pool in pools:
        nbytes = pool_bytes(pool)
        if nbytes == 0:
            continue
        per_slot = nbytes / int(pool.size)
        page = int(getattr(pool, "logical_page_size", pool.page_size))
        share = want * nbytes // max(total, 1)
        try:
            slots_wanted = min(int(pool.available_size()), int(share // per_slot)) // page * page
            slots = pool.alloc(slots_wanted) if slots_wanted > 0 else None
        except NotImplementedError as exc:  # a pool without an allocator of its own (DSV4's C4 state)
            skipped.append(f"{type(pool).__name__}: {exc}")
            continue
        if slots is None:
            continue
        try:
            chunks += _chunks_of(pool, slots)
        except PoolError as exc:  # this pool's layout cannot be carved: give its slots back
            pool.free(slots)
            skipped.append(str(exc))
            continue
        taken += int(slots_wanted * per_slot)
        tokens.append(f"{type(pool).__name__}:{slots_wanted}/{int(pool.size)}")
    if not chunks:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise PoolError(
            f"DSV41_KV_PARK_GIB={budget_gib}: HiCache's host pools ({describe(total)}) have no whole host page "
            f"free for the park pool (it takes at most {SHARE:g} of them){why}"
        )
    pool = HostPool(chunks)
    facts = {
        "carved_from": "hicache",
        "hicache_host": describe(total).replace(" ", ""),
        "pool": describe(pool.capacity).replace(" ", ""),
        "slots_bytes": taken,
        # What the carve-out takes from HiCache's host prefix capacity, in tokens (host slots).
        "hicache_tokens_taken": ",".join(tokens),
    }
    return pool, facts


def carve_out_take(server_args: Any, budget_gib: int) -> str:
    """What the carve-out takes from HiCache's host prefix capacity, in tokens, as far as the launch
    line tells: every host token of a pool costs the same bytes, so the byte share is the token share.
    With ``--hicache-size`` the share is known; with ``--hicache-ratio`` only its bound (the host pool
    scales with the device pool, sized at boot), in device-pool tokens, and in tokens when
    ``--max-total-tokens`` fixes the device pool. The boot line gives the exact tokens
    (``hicache_tokens_taken=<pool>:<taken>/<slots>``)."""
    size_gb = float(getattr(server_args, "hicache_size", 0) or 0)
    budget = budget_gib * GIB
    if size_gb:
        host = size_gb * 1e9  # SGLang sizes --hicache-size in 1e9 bytes per rank
        share = min(budget, SHARE * host) / host
        return (f"it takes {share:.1%} of HiCache's host prefix capacity ({describe(int(min(budget, SHARE * host)))} "
                f"of {size_gb:g} GB per rank), so {share:.1%} of its host tokens")
    ratio = float(getattr(server_args, "hicache_ratio", 2.0) or 2.0)
    bound = SHARE * ratio
    device = int(getattr(server_args, "max_total_tokens", 0) or 0)
    tokens = f" ({int(bound * device)} of its {int(ratio * device)} host tokens at --max-total-tokens {device})" if device else ""
    return (f"it takes at most {SHARE:.0%} of HiCache's host prefix capacity: up to {bound:g} x the device KV pool's "
            f"tokens of HiCache's {ratio:g} x{tokens}, fewer where DSV41_KV_PARK_GIB={budget_gib} binds first")


def prediction_note(host_pool: str, budget_gib: int, take: str = "") -> str:
    """What ``check`` says beside HiCache: one host-RAM total, HiCache's, and what the carve-out takes."""
    return (
        f"beside HiCache ({host_pool}): the park pool is carved out of HiCache's host pool at boot, "
        f"min(DSV41_KV_PARK_GIB={budget_gib}, {SHARE:g} x HiCache's host pool); the profile's "
        f"host-RAM total is HiCache's host pool alone{'; ' + take if take else ''} (the boot's kv_park pool line "
        f"gives the tokens: hicache_tokens_taken=<pool>:<taken>/<slots>)"
    )
