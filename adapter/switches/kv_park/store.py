"""The host store of parked entries: a byte budget, LRU eviction, the pool rows they hold, and
the landing of their copies (the background save worker's thread: :mod:`.save_worker`).

Invariants (tests check each one):

* Every byte the store holds or has promised to an in-flight copy counts against the budget
  (``used + reserved <= budget``). An offer that cannot fit is refused and the request is
  recomputed; an offer that fits after evicting the least recently used ready entries evicts them.
  Nothing is lost: an evicted or refused entry only means a re-prefill.
* An offer with ``read=`` (a list; the switch's offers on CUDA) into pinned pool rows returns as soon
  as the copy is queued on the device ("queued"): the entry is stored at once with its
  ``written`` event, ``read`` receives the event after which the device pages may be written
  again, and nothing of the store ever waits for either on the caller's thread (``pending`` and
  :meth:`poll` query them; a restore from such an entry is ordered after ``written`` on the device;
  its rows go back to the pool only once ``written`` is done). :meth:`fence` waits for them (off
  the scheduler path: close, tests).
* An offer with a worker returns before the copy ran ("queued"); the caller's ``on_landed``
  callback (which releases what the copy reads) runs on the caller's thread, from :meth:`poll`,
  :meth:`fence` or :meth:`take`, only after the copy has landed. A full queue (``queue_depth``; None:
  unbounded, as the switch runs it: every queued copy already holds its bytes of the budget, so the
  budget bounds the queue), or a store without a worker, copies synchronously ("saved") and runs
  ``on_landed`` before returning.
* A failed copy (worker or synchronous) disables parking for the process with one log line, drops
  every parked entry and still runs ``on_landed``: the requests recompute. Later offers are refused.
* Entries live in ordinary pageable host memory (eviction drops the reference), or, with a park
  pool (:mod:`adapter.switches.kv_park.host_pool`, CUDA pools), in rows carved out of it: the budget
  is the pool's capacity, a full pool evicts least recently used ready entries as the byte budget
  does, and every entry's rows go back to the pool when it is evicted, discarded, dropped by a
  failure, or released after its restore (:meth:`ParkStore.release`; a restore still reading them
  on the device frees them once its event is done). No entry ever lives outside the pool.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from adapter.core import api
from adapter.switches.kv_park.engine import CopyEngine
from adapter.switches.kv_park.host_pool import Carving, HostPool
from adapter.switches.kv_park.page_format import check_page_ids, on_a_device
from adapter.switches.kv_park.save_worker import SaveJob, SaveWorker, run_save

SWITCH = api.handle(__name__)
_LIVE_STORES: weakref.WeakSet[ParkStore] = weakref.WeakSet()


@atexit.register
def _stop_workers_at_exit() -> None:
    # A daemon thread still inside torch when the interpreter finalizes can abort the process
    # ("terminate called without an active exception"): land the copies and stop the workers first.
    for store in list(_LIVE_STORES):
        store.stop_worker()


def _label(key: Hashable) -> str:
    """A key as one receipt word: ``r1`` or ``r1/swa``."""
    text = "/".join(map(str, key)) if isinstance(key, tuple) else str(key)
    return "_".join(text.split())


@dataclass
class Entry:
    """One parked request: ``rows`` (``[pages, page_bytes]`` in the engine's byte format) are either
    one pageable tensor (``data``) or the segments of a park-pool carving (``carving``)."""

    key: Hashable
    data: torch.Tensor | None
    meta: dict[str, Any] = field(default_factory=dict)
    carving: Carving | None = None
    written: Any = None  # a device event: the rows hold the bytes once it is done (None: they do)

    @property
    def rows(self) -> list[torch.Tensor]:
        if self.carving is not None:
            return self.carving.segments
        assert self.data is not None
        return [self.data]

    @property
    def nbytes(self) -> int:
        """Host bytes the entry holds (a carving's rows, rounded up to a host page per segment)."""
        if self.carving is not None:
            return self.carving.nbytes
        assert self.data is not None
        return self.data.numel()

    @property
    def pages(self) -> int:
        return self.carving.rows if self.carving is not None else int(self.data.shape[0])  # type: ignore[union-attr]

    def bytes(self) -> torch.Tensor:
        """The entry's rows as one tensor (a copy when it spans several segments)."""
        rows = self.rows
        return rows[0] if len(rows) == 1 else torch.cat(rows)


@dataclass
class Stats:
    saved: int = 0  # entries that landed
    queued: int = 0  # offers handed to the worker
    sync_saves: int = 0  # offers copied on the caller's thread (no worker or full queue)
    refused: int = 0
    evicted: int = 0
    restored: int = 0
    missed: int = 0  # take() found nothing (never parked, evicted, failed)
    failed: int = 0


class ParkStore:
    """Parked entries under one byte budget: pageable entries (CPU pools), or carvings of a park
    pool (``host_pool``: CUDA pools; the budget is then the pool's capacity)."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        worker: bool = True,
        queue_depth: int | None = 2,
        idle_exit_s: float = 0.5,
        host_pool: HostPool | None = None,
    ):
        if host_pool is not None:
            budget_bytes = host_pool.capacity
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        if queue_depth is not None and queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1 (or None: unbounded), got {queue_depth}")
        self.budget = int(budget_bytes)
        self.stats = Stats()
        self.disabled_reason: str | None = None
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()  # least recently used first
        self._pending: OrderedDict[Hashable, SaveJob] = OrderedDict()  # in submission order
        self._lock = threading.Lock()
        self._saver = SaveWorker(enabled=worker, queue_depth=queue_depth, idle_exit_s=idle_exit_s)
        self.host_pool = host_pool
        # Carvings a restore still reads on the device (its event not yet done): freed once it is.
        self._draining: list[tuple[list[Any], Carving]] = []
        # ``written`` events of the device copies still in flight (an entry taken for a restore keeps
        # its copy here until the event is done).
        self._in_flight: list[Any] = []
        _LIVE_STORES.add(self)

    def use_pool(self, host_pool: HostPool) -> None:
        """Carve every later entry out of ``host_pool`` (the budget becomes its capacity); entries
        parked before (pageable) are dropped: the requests recompute."""
        self.fence()
        for entry in self._entries.values():
            self._free(entry)
        self._entries.clear()
        self.host_pool = host_pool
        self.budget = host_pool.capacity

    # -- accounting ------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    @property
    def reserved_bytes(self) -> int:
        return sum(j.entry.nbytes for j in self._pending.values())

    @property
    def disabled(self) -> bool:
        return self.disabled_reason is not None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries or key in self._pending

    def ready_keys(self) -> list[Hashable]:
        """Ready entries, least recently used first."""
        return list(self._entries)

    def pending(self) -> int:
        """Copies in flight: queued for the worker, or queued on the device (events queried, never waited)."""
        self._settle()
        return len(self._pending) + len(self._in_flight)

    def _settle(self) -> None:
        """Forget the ``written`` events of device copies that are done (queries, no wait)."""
        if self._in_flight:
            self._in_flight = [e for e in self._in_flight if not e.query()]
        for entry in self._entries.values():
            if entry.written is not None and entry.written.query():
                entry.written = None

    # -- saving ----------------------------------------------------------------------------------
    def offer(
        self,
        key: Hashable,
        engine: CopyEngine,
        page_ids: torch.Tensor | Sequence[int],
        *,
        meta: dict[str, Any] | None = None,
        after: object = None,
        on_landed: Callable[[], None] | None = None,
        read: list | None = None,
    ) -> str:
        """Park pages ``page_ids`` under ``key``: "queued", "saved", or "refused: <why>".

        On "refused" nothing was copied and ``on_landed`` has already run. ``read``: a list that
        receives the device event after which the pages may be written again, when the copy was
        queued on the device without waiting (CUDA, pinned pool rows; "queued").
        """
        self.poll()
        # IndexError here, not in the worker; device ids (the allocator's own) are not read back.
        ids = page_ids.reshape(-1) if on_a_device(page_ids) else check_page_ids(page_ids, engine.layout.num_pages)
        nbytes = ids.numel() * engine.page_bytes
        why, carving = self._make_room(key, nbytes, ids.numel(), engine.page_bytes)
        if why:
            self.stats.refused += 1
            SWITCH.event("declined", level=logging.DEBUG, key=_label(key), bytes=nbytes, why=why.replace(" ", "_"))
            if on_landed is not None:
                on_landed()
            return f"refused: {why}"
        if carving is not None:
            entry = Entry(key, None, dict(meta or {}), carving)
        else:
            entry = Entry(key, engine.new_entry(ids.numel()), dict(meta or {}))
        job = SaveJob(entry, engine, ids, after, on_landed)
        with self._lock:
            self._pending[key] = job
        if read is None and self._saver.submit(job):  # else (off, or a full queue): a synchronous save below
            self.stats.queued += 1
            return "queued"
        events: list = []
        run_save(job, events if read is not None else None)
        if events:  # queued on the device: the rows hold the bytes once ``written`` is done
            pages_read, job.entry.written = events[0]
            read.append(pages_read)  # type: ignore[union-attr]
            self._in_flight.append(job.entry.written)
            self.stats.queued += 1
        else:
            self.stats.sync_saves += 1
        self._land(job)
        if job.error is not None:
            return f"refused: copy failed ({type(job.error).__name__})"
        return "queued" if events else "saved"

    def _make_room(self, key: Hashable, nbytes: int, rows: int, row_bytes: int) -> tuple[str, Carving | None]:
        """Evict least recently used ready entries until the offer fits: ``("", carving or None)``,
        or ``(why, None)`` when it cannot."""
        if self.disabled:
            return "parking disabled", None
        if nbytes > self.budget:
            return f"{nbytes} bytes exceed the budget of {self.budget}", None
        if key in self._pending:
            return "a copy of this key is in flight", None
        old = self._entries.pop(key, None)  # a newer park of the same request replaces the old entry
        if old is not None:
            self._free(old)
        if self.host_pool is not None:
            return self._carve(rows, row_bytes)
        while self.used_bytes + self.reserved_bytes + nbytes > self.budget and self._entries:
            self._evict_lru()
        if self.used_bytes + self.reserved_bytes + nbytes > self.budget:
            return "the budget is held by copies in flight", None
        return "", None

    def _carve(self, rows: int, row_bytes: int) -> tuple[str, Carving | None]:
        """Carve, evicting least recently used entries; never waits: rows a device copy still reads
        or writes come back once its event is done (a later offer), so an offer that would need
        them now is refused (the request recomputes)."""
        pool = self.host_pool
        assert pool is not None
        while True:
            self._drain(wait=False)
            carving = pool.carve(rows, row_bytes)
            if carving is not None:
                return "", carving
            if not self._entries:
                return "the park pool is held by copies in flight", None
            self._evict_lru()

    def _evict_lru(self) -> None:
        old_key, old = self._entries.popitem(last=False)
        self.stats.evicted += 1
        SWITCH.event("evicted", level=logging.DEBUG, key=_label(old_key), bytes=old.nbytes)
        self._free(old)

    def _free(self, entry: Entry, after: object = None) -> None:
        """Give an entry's pool rows back, at once or, while a device copy still writes them (its
        ``written`` event) or reads them (``after``), once those events are done (queried by later
        calls, never waited for here)."""
        carving, entry.carving = entry.carving, None
        if carving is None or carving.released:
            return
        busy = [e for e in (entry.written, after) if e is not None and not e.query()]  # type: ignore[attr-defined]
        if busy:
            self._draining.append((busy, carving))
        else:
            carving.release()

    def _drain(self, *, wait: bool) -> None:
        keep = []
        for events, carving in self._draining:
            if wait:
                for event in events:
                    event.synchronize()
            if wait or all(event.query() for event in events):
                carving.release()
            else:
                keep.append((events, carving))
        self._draining = keep

    def release(self, entry: Entry, after: object = None) -> None:
        """Done with an entry :meth:`take` returned: its pool rows go back to the pool (``after``:
        once that device event is done, e.g. the restore's copy). Pageable entries need nothing."""
        self._free(entry, after)

    @property
    def worker(self) -> bool:
        """Whether offers are queued for the background save worker (False: copied synchronously)."""
        return self._saver.enabled

    def stop_worker(self, timeout: float = 10.0) -> None:
        """Land what is in flight and stop the worker thread; later offers save synchronously."""
        self._saver.enabled = False
        self.fence(timeout=timeout)
        self._saver.stop(timeout)

    # -- landing (caller's thread) ---------------------------------------------------------------
    def _land(self, job: SaveJob) -> None:
        with self._lock:
            self._pending.pop(job.entry.key, None)
        if job.error is not None:
            self.stats.failed += 1
            self._free(job.entry)
            self.disable(f"copy of {_label(job.entry.key)} failed: {type(job.error).__name__}: {job.error}")
        elif self.disabled:
            self._free(job.entry)  # parked after the store was disabled: drop it, the request recomputes
        else:
            self._entries[job.entry.key] = job.entry
            self.stats.saved += 1
        if job.on_landed is not None:
            job.on_landed()

    def disable(self, reason: str) -> None:
        """Stop parking for this process (one WARNING line); parked entries are dropped (recompute)."""
        if self.disabled:
            return
        self.disabled_reason = reason
        for entry in self._entries.values():
            self._free(entry)
        self._entries.clear()
        SWITCH.event("disabled", level=logging.WARNING, reason=" ".join(reason.split()).replace(" ", "_"))

    def poll(self) -> int:
        """Land every finished copy (store it, run its ``on_landed``); forget the events of device
        copies that are done and give back the rows they held (queries, no wait); returns how many
        worker copies landed."""
        landed = [job for job in list(self._pending.values()) if job.done.is_set()]
        for job in landed:
            self._land(job)
        self._settle()
        if self._draining:
            self._drain(wait=False)
        return len(landed)

    def fence(self, key: Hashable | None = None, timeout: float | None = None) -> bool:
        """Wait until the copy of ``key`` (or every copy in flight: the worker's and those queued on
        the device) has landed, then land it. A host wait: never on the scheduler path.

        Returns False when ``timeout`` ran out first.
        """
        if not self._await_jobs(key, timeout):
            return False
        for k, entry in self._entries.items():
            if entry.written is not None and (key is None or k == key):
                entry.written.synchronize()
                entry.written = None
        if key is None:
            for event in self._in_flight:
                event.synchronize()
        self.poll()
        return True

    def _await_jobs(self, key: Hashable | None = None, timeout: float | None = None) -> bool:
        """Wait for the worker's copy of ``key`` (or all of them) and land it; False on timeout.
        Nothing to wait for when the store has no worker (the switch's)."""
        jobs = list(self._pending.values()) if key is None else [j for k, j in self._pending.items() if k == key]
        for job in jobs:
            if not self._saver.wait(job, timeout):
                return False
        if jobs:
            self.poll()
        return True

    def fence_pages(
        self, pages: set[int], timeout: float | None = None, *, select: Callable[[Hashable], bool] | None = None
    ) -> bool:
        """Wait for the copies in flight that read any of ``pages`` (a writer is about to touch them).

        ``select`` limits the check to the copies whose key it accepts (page ids of one index space).
        """
        for key, job in list(self._pending.items()):
            if select is not None and not select(key):
                continue
            if job.done.is_set() or not pages.intersection(job.page_ids.tolist()):
                continue
            if not self._saver.wait(job, timeout):
                return False
        self.poll()
        return True

    # -- restoring -------------------------------------------------------------------------------
    def peek(self, key: Hashable) -> Entry | None:
        """The entry of ``key`` (waiting for a worker's copy; a device copy is not waited for: its
        ``written`` event orders whatever reads the rows), marked most recently used."""
        self._await_jobs(key)
        if key in self._entries:
            self._entries.move_to_end(key)
        return self._entries.get(key)

    def take(self, key: Hashable) -> Entry | None:
        """Remove and return the entry of ``key`` (waiting for a worker's copy, never for a device
        copy: a restore from it follows its ``written`` event on the device); None: recompute.

        The entry's pool rows stay held until :meth:`release` (after the restore read them)."""
        self._await_jobs(key)
        entry = self._entries.pop(key, None)
        if entry is None:
            self.stats.missed += 1
        else:
            self.stats.restored += 1
        return entry

    def discard(self, key: Hashable) -> None:
        self._await_jobs(key)
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._free(entry)

    def close(self) -> None:
        """Land what is in flight and stop the worker (an alias of :meth:`stop_worker`)."""
        self.stop_worker()
