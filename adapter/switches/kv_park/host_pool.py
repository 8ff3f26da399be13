"""The park pool: one page-aligned host buffer, allocated (and on CUDA page-locked) once at boot.

Why
---
A parked entry in ordinary pageable memory moves at the speed of a pageable copy (on an H200:
8-9 GiB/s save, 6 GiB/s restore, against 51 GiB/s into pinned memory), and pinning per save costs
more than the copy (a fresh 2 GiB ``pin_memory`` allocation: about 0.8 s). Every production
offload path (SGLang's HiCache host pool, vLLM's CPU offload, LMCache, Mooncake) pins one bounded
pool at start and never per request. This module is that pool for KV parking.

Shape
-----
``DSV41_KV_PARK_GIB`` of host memory in chunks (``chunk_bytes``, 1 GiB by default; the last one
smaller), each chunk starting on a 4 KiB host page and page-locked on its own
(``cudaHostRegister``, as SGLang's ``alloc_with_host_register`` does for HiCache), so a boot that
cannot lock the whole size stops at the chunk that failed and says how far it got. An entry of
``n`` parked pages of ``P`` bytes is *carved* page by page: first fit over the free extents of
the chunks, each extent giving as many whole ``P``-byte rows as it holds, so an entry is one or
more *segments* (``[k, P]`` uint8 views into the pool, each inside one chunk, each starting on a
4 KiB boundary). Releasing a carving returns its extents (merged with their neighbours). A full
pool carves nothing: the store evicts its least recently used entries and carves again, as it does
with the byte budget of pageable entries.

Invariants (``tests/unit/test_kv_park_host_pool.py`` checks each one, on CPU over ordinary memory,
with the same class; ``tests/unit/test_kv_park_cuda.py`` checks the page-locking):

* every segment of a live carving lies inside one chunk of the pool, and no two live segments
  overlap;
* ``used_bytes + free_bytes == capacity`` at all times; after any churn of carve and release,
  releasing every carving leaves one free extent per chunk (nothing leaked, nothing fragmented);
* a carving is never released twice, and a carving of another pool is refused;
* a carve that does not fit returns None and changes nothing.

Page-locking is a :class:`PageLocker` (the only call that pins): :class:`CudaHostRegister` in a
serving process, none for a pool over ordinary memory (CPU KV pools keep pageable entries and no
pool at all). Tests inject a locker that fails at a chosen chunk to see the boot error. Before
locking, :func:`check_host_room` compares the size with the host's available memory (``MemAvailable``
and the cgroup's ``memory.max``): asking for more than that is the same boot error, without
touching memory.

Importing this module imports no SGLang.
"""

from __future__ import annotations

import contextlib
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

GIB = 1 << 30
MiB = 1 << 20
HOST_PAGE = 4096  # every chunk and every segment starts on a host page
DEFAULT_CHUNK_BYTES = GIB


class PoolError(RuntimeError):
    """The park pool cannot be allocated or page-locked (the message names the size and the limit)."""


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _gib(n: int | float) -> str:
    return f"{n / GIB:.2f} GiB"


# -- host limits -----------------------------------------------------------------------------------


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom() -> tuple[int, str] | None:
    """Bytes the process's cgroup may still take, and which file said so (None: no limit found)."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    ):
        try:
            raw = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if raw == "max":
            return None
        try:
            limit, usage = int(raw), int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:  # v1's "no limit"
            return None
        return max(0, limit - usage), limit_file
    return None


def _memlock() -> str:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else _gib(soft)


@dataclass(frozen=True)
class HostRoom:
    """What the host can give the pool: the smaller of ``MemAvailable`` and the cgroup's headroom."""

    available: int | None
    limit: str  # which limit that is, in words

    def describe(self) -> str:
        return f"{self.limit}; RLIMIT_MEMLOCK {_memlock()}"


def host_room() -> HostRoom:
    avail = _meminfo_available()
    found = [(avail, "MemAvailable " + (_gib(avail) if avail is not None else "?"))] if avail is not None else []
    cg = _cgroup_headroom()
    if cg is not None:
        found.append((cg[0], f"cgroup headroom {_gib(cg[0])} ({cg[1]})"))
    if not found:
        return HostRoom(None, "no host memory limit readable")
    best = min(found, key=lambda f: f[0])
    return HostRoom(best[0], best[1])


def check_host_room(capacity: int, what: str, room: HostRoom | None = None) -> HostRoom:
    """Raise :class:`PoolError` when ``capacity`` bytes exceed what the host can give."""
    room = host_room() if room is None else room
    if room.available is not None and capacity > room.available:
        raise PoolError(
            f"{what}: the park pool needs {_gib(capacity)} of page-locked host RAM, more than the host can "
            f"give: {room.describe()} (lower DSV41_KV_PARK_GIB or free host memory)"
        )
    return room


# -- page-locking ----------------------------------------------------------------------------------


class PageLocker(Protocol):
    """Page-locks (pins) and unlocks host memory; the one call that pins."""

    name: str

    def lock(self, tensor: torch.Tensor) -> None: ...

    def unlock(self, tensor: torch.Tensor) -> None: ...


class CudaHostRegister(PageLocker):
    """``cudaHostRegister`` of each chunk (SGLang's HiCache host pool does the same), undone at close."""

    name = "cudaHostRegister"

    def lock(self, tensor: torch.Tensor) -> None:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
        code = int(getattr(err, "value", err))
        if code != 0:
            raise PoolError(f"cudaHostRegister returned {err} (error {code})")

    def unlock(self, tensor: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


# -- the pool --------------------------------------------------------------------------------------


@dataclass
class Carving:
    """Host rows of one entry: ``segments`` in row order, each ``[k, row_bytes]`` inside one chunk."""

    pool: HostPool
    row_bytes: int
    rows: int
    segments: list[torch.Tensor]
    extents: list[tuple[int, int, int]]  # (chunk, offset, bytes) held, rounded up to HOST_PAGE
    released: bool = field(default=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool this carving holds (its rows, rounded up to a host page per segment)."""
        return sum(n for _, _, n in self.extents)

    def release(self) -> None:
        self.pool.release(self)


class HostPool:
    """Chunks of page-aligned host memory and the first-fit carving of entries out of them.

    Thread-safe: carving and releasing hold one lock (the park worker and the scheduler thread
    both reach the pool through the store).
    """

    def __init__(self, chunks: list[torch.Tensor], *, locker: PageLocker | None = None, lock_ms: float = 0.0):
        if not chunks:
            raise PoolError("a park pool needs at least one chunk")
        for i, c in enumerate(chunks):
            if c.dtype != torch.uint8 or c.dim() != 1 or c.device.type != "cpu":
                raise PoolError(f"chunk {i} must be a 1-D uint8 host tensor")
            if c.data_ptr() % HOST_PAGE or c.numel() % HOST_PAGE:
                raise PoolError(f"chunk {i} is not host-page aligned (address {c.data_ptr():#x}, {c.numel()} bytes)")
        self.chunks = chunks
        self.locker = locker
        self.lock_ms = lock_ms
        self.capacity = sum(c.numel() for c in chunks)
        self._free: list[list[tuple[int, int]]] = [[(0, c.numel())] for c in chunks]  # per chunk: (offset, bytes)
        self._used = 0
        self._live: set[int] = set()  # id() of live carvings
        self._lock = threading.Lock()

    # -- building ----------------------------------------------------------------------------------
    @classmethod
    def allocate(
        cls,
        capacity: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        locker: PageLocker | None = None,
        what: str = "park pool",
        check_room: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> HostPool:
        """Allocate ``capacity`` bytes (rounded up to a host page) in chunks, page-locking each chunk
        with ``locker`` (None: ordinary memory). :class:`PoolError` names the size and the limit hit."""
        if capacity <= 0:
            raise PoolError(f"{what}: the pool size must be positive, got {capacity}")
        if chunk_bytes < HOST_PAGE:
            raise PoolError(f"{what}: chunk_bytes must be at least {HOST_PAGE}, got {chunk_bytes}")
        capacity = _round_up(capacity, HOST_PAGE)
        chunk_bytes = _round_up(chunk_bytes, HOST_PAGE)
        room = check_host_room(capacity, what) if check_room and locker is not None else None
        sizes = [chunk_bytes] * (capacity // chunk_bytes) + ([capacity % chunk_bytes] if capacity % chunk_bytes else [])
        chunks: list[torch.Tensor] = []
        start = clock()
        for i, size in enumerate(sizes):
            try:
                raw = torch.empty(size + HOST_PAGE, dtype=torch.uint8)
                skip = (-raw.data_ptr()) % HOST_PAGE
                chunk = raw[skip : skip + size]
                if locker is not None:
                    locker.lock(chunk)
            except (RuntimeError, MemoryError) as exc:
                done = sum(c.numel() for c in chunks)
                if locker is not None:
                    for c in chunks:  # nothing stays locked after a failed boot (best effort: it fails anyway)
                        with contextlib.suppress(Exception):
                            locker.unlock(c)
                room = room or host_room()
                verb = "page-lock" if locker is not None else "allocate"
                raise PoolError(
                    f"{what}: could not {verb} {_gib(capacity)} of host RAM: {_gib(done)} in {len(chunks)} "
                    f"chunk(s) of {_gib(chunk_bytes)} done, chunk {i + 1} of {len(sizes)} failed "
                    f"({type(exc).__name__}: {exc}); host limits: {room.describe()} "
                    f"(lower DSV41_KV_PARK_GIB or free host memory)"
                ) from exc
            chunks.append(chunk)
        return cls(chunks, locker=locker, lock_ms=(clock() - start) * 1e3)

    def close(self) -> None:
        """Unlock every chunk (a serving process leaves this to its exit)."""
        if self.locker is not None:
            for c in self.chunks:
                self.locker.unlock(c)
            self.locker = None

    # -- accounting --------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._used

    @property
    def live_carvings(self) -> int:
        return len(self._live)

    def free_extents(self) -> list[list[tuple[int, int]]]:
        with self._lock:
            return [list(f) for f in self._free]

    def fits(self, rows: int, row_bytes: int) -> bool:
        """Whether :meth:`carve` of ``rows`` rows would succeed now."""
        with self._lock:
            return self._rows_free(row_bytes) >= rows

    def _rows_free(self, row_bytes: int) -> int:
        return sum(n // row_bytes for chunk in self._free for _, n in chunk)

    # -- carving -----------------------------------------------------------------------------------
    def carve(self, rows: int, row_bytes: int) -> Carving | None:
        """``rows`` whole rows of ``row_bytes`` (first fit, page by page); None when they do not fit."""
        if rows < 0 or row_bytes <= 0:
            raise ValueError(f"cannot carve {rows} rows of {row_bytes} bytes")
        with self._lock:
            if self._rows_free(row_bytes) < rows:
                return None
            left, segments, extents = rows, [], []
            for ci, free in enumerate(self._free):
                k = 0
                while left and k < len(free):
                    off, n = free[k]
                    take = min(left, n // row_bytes)
                    if take == 0:
                        k += 1
                        continue
                    held = min(n, _round_up(take * row_bytes, HOST_PAGE))
                    segments.append(self.chunks[ci][off : off + take * row_bytes].view(take, row_bytes))
                    extents.append((ci, off, held))
                    if held == n:
                        free.pop(k)
                    else:
                        free[k] = (off + held, n - held)
                    left -= take
                if not left:
                    break
            held = sum(n for _, _, n in extents)
            self._used += held
            carving = Carving(self, row_bytes, rows, segments, extents)
            self._live.add(id(carving))
            return carving

    def release(self, carving: Carving) -> None:
        """Give a carving's extents back (merged with free neighbours)."""
        with self._lock:
            if carving.pool is not self:
                raise ValueError("this carving belongs to another pool")
            if carving.released or id(carving) not in self._live:
                raise ValueError("this carving was already released")
            carving.released = True
            self._live.discard(id(carving))
            for ci, off, n in carving.extents:
                self._give_back(ci, off, n)
                self._used -= n
            carving.segments = []

    def _give_back(self, ci: int, off: int, n: int) -> None:
        free = self._free[ci]
        free.append((off, n))
        free.sort()
        merged: list[tuple[int, int]] = []
        for o, m in free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + m)
            else:
                merged.append((o, m))
        self._free[ci] = merged

    def describe(self) -> dict[str, object]:
        """The receipt's fields: size, chunks, how it was locked and how long that took."""
        return {
            "pool_gib": round(self.capacity / GIB, 2),
            "pool_chunks": len(self.chunks),
            "pinned": self.locker.name if self.locker is not None else "no",
            "pin_ms": round(self.lock_ms, 1),
        }

