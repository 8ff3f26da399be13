"""The page-major copy engine: a request's KV pages to one host buffer and back, in the byte
format of :mod:`adapter.switches.kv_park.page_format` (regions, page rows, page ids checked there).

Copy schedule
-------------
Pages move in chunks of whole pages, at most ``chunk_bytes`` (32 MiB) per chunk, never less than
one page. Save, per chunk: one ``index_select`` per region into the chunk's columns of a staging
buffer (two halves, used alternately, allocated once per engine), then one copy of the staged
chunk into the host entry. The host entry is ordinary pageable memory: nothing is pinned per
save and nothing needs freeing on eviction (the store drops the reference). Restore, per chunk:
one host-to-staging copy, then one ``index_copy_`` per region. On a CPU pool the staging hop
adds nothing (the "device" is host memory already), so by default the gather and scatter work on
the host entry directly, one index op per region over the whole entry (measured: 1.2x memcpy for
the whole entry vs 1.5x in 32 MiB chunks, and the staged hop costs a second pass over every byte);
``stage=True`` forces the staged, chunked schedule (tests use it to cover the CUDA path's
arithmetic on CPU, and the benchmark costs it for reference). The CPU shortcut is a choice of
schedule, not of format: both write the same entry bytes (tests compare them).

Threads (CPU, unstaged)
    On a CPU pool with more than one core, the regions are split into ``threads`` groups of
    about equal bytes (default ``min(2, cpu_count)``) and each group's index ops run on their
    own short-lived thread (the calling thread takes the first group; the others are joined
    before :meth:`CopyEngine.save` / :meth:`CopyEngine.restore` return, so no thread outlives a
    call). Each region still gets exactly one index op, and the groups write disjoint columns,
    so the bytes do not depend on the thread count. A large index op releases the GIL, so two
    threads use two cores' memory bandwidth; the stock per-view pattern (tens of thousands of
    tiny copies, GIL-bound) gains nothing from threads (measured: 340 ms with one or two).
    Entries under ``PARALLEL_MIN_BYTES`` (4 MiB) stay on the calling thread. The staged (CUDA)
    schedule is single-threaded: its index ops run on the device.

On CUDA, a save must only start once the writes of the forward that produced the pages are done
(the caller passes ``after=`` events recorded on the streams that wrote them; the engine's stream
waits for them on the device, the caller's thread never does) and runs on the engine's own stream (the
page ids travel to the device on that stream too). Into pinned rows with ``events=`` the call returns
at once with two events: after ``pages_read`` the device pages may be written again, after
``rows_written`` the host rows hold the bytes. Otherwise (pageable rows: a synchronous copy for the
host anyway) the stream is synchronized before :meth:`CopyEngine.save` returns.

CUDA graph captures (:mod:`adapter.switches.kv_park.capture`): every device copy of a CUDA engine
holds the process-wide capture lock, so it never overlaps a global-mode capture on another thread
(SGLang recaptures graphs while serving); a copy asked for on a thread whose current stream is
capturing raises :class:`~adapter.switches.kv_park.capture.CaptureConflict` before any copy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch

from adapter.switches.kv_park.capture import CAPTURE_LOCK, CaptureConflict, CaptureLock
from adapter.switches.kv_park.page_format import PageLayout, check_page_ids, on_a_device, word_dtype

MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 32 * MiB
DEVICE_CHUNK_BYTES = 64 * MiB  # a CUDA engine: fewer chunks, fewer index-op launches per entry
PARALLEL_MIN_BYTES = 4 * MiB  # smaller entries are copied on the calling thread
# Host rows of an entry: one ``[pages, page_bytes]`` tensor, or the segments of a pool carving.
HostRows = torch.Tensor | Sequence[torch.Tensor]


def default_threads(device: torch.device) -> int:
    """Copy threads for an unstaged CPU engine: ``min(2, cpu_count)``; 1 for a device pool."""
    return min(2, os.cpu_count() or 1) if device.type == "cpu" else 1


def _balanced(items: list, weights: list[int], groups: int) -> list[list]:
    """Split ``items`` into at most ``groups`` non-empty lists of about equal total weight
    (largest first, each to the lightest group); order inside a group follows ``items``."""
    bins: list[list[int]] = [[] for _ in range(max(1, groups))]
    load = [0] * len(bins)
    for i in sorted(range(len(items)), key=lambda i: -weights[i]):
        k = load.index(min(load))
        bins[k].append(i)
        load[k] += weights[i]
    return [[items[i] for i in sorted(b)] for b in bins if b]


def _run_groups(groups: list, work) -> None:
    """``work(group)`` for each group: the first on this thread, the rest on threads joined here."""
    errors: list[BaseException] = []

    def guarded(group) -> None:
        try:
            work(group)
        except BaseException as exc:  # re-raised on the calling thread below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(g,), name="dsv41-kv-copy", daemon=True) for g in groups[1:]]
    for t in threads:
        t.start()
    try:
        guarded(groups[0])
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


class CopyEngine:
    """Moves whole pages of one :class:`PageLayout` between the pool and host entries.

    One engine is used by one thread at a time (a lock guards its staging buffers).
    """

    def __init__(
        self,
        layout: PageLayout,
        *,
        chunk_bytes: int | None = None,
        stage: bool | None = None,
        threads: int | None = None,
        capture_lock: CaptureLock | None = None,
    ):
        if chunk_bytes is None:
            chunk_bytes = DEVICE_CHUNK_BYTES if layout.device.type == "cuda" else DEFAULT_CHUNK_BYTES
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.layout = layout
        self.device = layout.device
        self.stage = (self.device.type != "cpu") if stage is None else bool(stage)
        self.page_bytes = layout.page_bytes
        self.chunk_pages = max(1, chunk_bytes // self.page_bytes)  # whole pages, at least one
        self.word = layout.word
        self._dtype = word_dtype(self.word)
        self._lock = threading.Lock()
        self._staging: list[torch.Tensor] = []
        if self.stage:
            size = self.chunk_pages * self.page_bytes
            self._staging = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # The host link's own stream: chunk k's host copy overlaps chunk k+1's gather (or scatter).
        self._xfer = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._ready = [torch.cuda.Event() for _ in range(2)] if self._xfer is not None else []
        self._freed = [torch.cuda.Event() for _ in range(2)] if self._xfer is not None else []
        shared = CAPTURE_LOCK if capture_lock is None else capture_lock
        self._capture_lock = shared if self._stream is not None else None
        # Region views in the engine's word width, and each region's column span in words.
        self._cols = [
            (r.rows.view(self._dtype), col // self.word, r.row_bytes // self.word) for r, col in layout.columns()
        ]
        # Staged (device) copies run on one thread; unstaged CPU copies split the regions.
        self.threads = 1 if self.stage else (default_threads(self.device) if threads is None else int(threads))
        self._groups = _balanced(self._cols, [w for _, _, w in self._cols], self.threads)

    def _groups_for(self, n: int) -> list[list[tuple[torch.Tensor, int, int]]]:
        if len(self._groups) > 1 and n * self.page_bytes >= PARALLEL_MIN_BYTES:
            return self._groups
        return [self._cols]

    @property
    def staging_bytes(self) -> int:
        return sum(s.numel() for s in self._staging)

    def chunks(self, n: int) -> Iterator[tuple[int, int]]:
        """``(start, stop)`` page ranges of an ``n``-page entry: whole pages, ``chunk_pages`` at most."""
        for start in range(0, n, self.chunk_pages):
            yield start, min(n, start + self.chunk_pages)

    def new_entry(self, n: int) -> torch.Tensor:
        """A host entry for ``n`` pages: ordinary pageable memory, never pinned."""
        return torch.empty((n, self.page_bytes), dtype=torch.uint8)

    @contextmanager
    def _on_stream(self, after: object | None, done: list | None = None) -> Iterator[None]:
        """On CUDA: inside the capture lock, on the engine's stream (ordered after ``after``: a CUDA
        event or a list of them; else after the caller's stream). Synchronized before it returns, unless ``done`` is a list: then
        an event recorded after the copy is appended to it and the caller fences on it (a failed
        copy is always synchronized). On CPU: nothing."""
        if self._stream is None:
            yield
            return
        assert self._capture_lock is not None
        with self._capture_lock.copy():  # no global-mode capture is open from here on: the query is safe
            if torch.cuda.is_current_stream_capturing():  # e.g. a thread-local capture on this thread
                raise CaptureConflict("a KV-parking copy was asked for on a thread whose stream is capturing")
            if after is not None:  # one event, or several (the streams whose work it must follow)
                for event in after if isinstance(after, (list, tuple)) else (after,):
                    self._stream.wait_event(event)  # type: ignore[arg-type]
            else:  # ordered after everything already queued on the caller's stream
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            ok = False
            try:
                with torch.cuda.stream(self._stream):
                    yield
                ok = True
            finally:
                if ok and done is not None:
                    done.append(self._stream.record_event())
                else:
                    self._stream.synchronize()  # also after a failed copy: nothing of it outlives the lock

    def _staging_rows(self, chunk: int, pages: int) -> torch.Tensor:
        """The staging half of chunk ``chunk`` (halves alternate) as ``[pages, page words]``."""
        return self._staging[chunk & 1][: pages * self.page_bytes].view(self._dtype).view(pages, -1)

    def _checked_ids(self, page_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Host ids checked on the host (:func:`check_page_ids`); device ids as they are (flat)."""
        if on_a_device(page_ids):
            assert isinstance(page_ids, torch.Tensor)
            return page_ids.reshape(-1)
        return check_page_ids(page_ids, self.layout.num_pages)

    def _device_ids(self, ids: torch.Tensor, *, asynchronous: bool = False) -> torch.Tensor:
        """``ids`` on the engine's device, as int64. ``asynchronous``: through a pinned copy, so the
        host does not wait for the engine's stream (a plain copy from pageable memory synchronizes
        it, and that stream may be waiting for a forward). Ids already on the device are the
        caller's tensor: it is marked used on the engine's stream, so the caching allocator does not
        hand its memory out again before the copy has read it."""
        if self.device.type == "cpu":
            return ids
        if ids.device.type != "cpu":
            ids.record_stream(torch.cuda.current_stream(self.device))
            return ids.to(torch.int64)
        if asynchronous:
            return ids.pin_memory().to(self.device, non_blocking=True)
        return ids.to(self.device)

    def _host_rows(self, rows: HostRows, n: int | None = None) -> list[torch.Tensor]:
        """``rows`` (one entry tensor, or the segments of a pool carving) as a list of ``[k, page_bytes]``
        uint8 tensors, each checked; ``n``: the total row count they must have."""
        segs = [rows] if isinstance(rows, torch.Tensor) else list(rows)
        for s in segs:
            if s.dtype != torch.uint8 or s.dim() != 2 or s.shape[1] != self.page_bytes or not s.is_contiguous():
                raise ValueError(
                    f"host entry must be contiguous uint8 [pages, {self.page_bytes}] tensors, got {s.dtype} {tuple(s.shape)}"
                )
            if s.device.type != "cpu":
                raise ValueError(f"host entry must be in host memory, got {s.device}")
        total = sum(int(s.shape[0]) for s in segs)
        if n is not None and total != n:
            raise ValueError(f"host entry has {total} rows for {n} pages")
        return segs

    def _pieces(self, segs: list[torch.Tensor], lo: int, hi: int, step: int | None) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(start, stop, host words)`` of rows ``[lo, hi)`` of ``segs``: each inside one segment and
        at most ``step`` rows (None: whole segments); ``start`` / ``stop`` count from ``lo``."""
        base = 0
        for s in segs:
            k = int(s.shape[0])
            a, b = max(lo, base), min(hi, base + k)
            while a < b:
                c = b if step is None else min(b, a + step)
                yield a - lo, c - lo, s[a - base : c - base].view(self._dtype)
                a = c
            base += k
            if base >= hi:
                return

    @staticmethod
    def _pinned(segs: list[torch.Tensor]) -> bool:
        return bool(segs) and all(s.is_pinned() for s in segs)

    def save(
        self,
        page_ids: torch.Tensor | Sequence[int],
        out: HostRows | None = None,
        *,
        after: object = None,
        events: list | None = None,
    ) -> HostRows:
        """Copy pages ``page_ids`` into host rows (``out``: an entry tensor or a pool carving's
        segments; None: a new pageable entry) and return ``out``.

        ``after``: a CUDA event (or a list of them) the copy must wait for (the forward that wrote
        the pages); without it the copy follows the caller's current stream. Into
        pinned rows (the park pool) the device-to-host copies are asynchronous on the engine's
        stream; the call returns once the stream has finished them, or, with ``events`` (a list),
        at once: ``events`` receives ``(pages_read, rows_written)``, the CUDA events after which the
        device pages may be written again and the host rows hold the bytes.
        """
        ids = self._checked_ids(page_ids)
        n = ids.numel()
        entry: HostRows = self.new_entry(n) if out is None else out
        segs = self._host_rows(entry, n)
        if n == 0:
            return entry
        asynchronous = events is not None and self.stage and self._stream is not None and self._pinned(segs)
        written: list = []
        with self._lock, self._on_stream(after, written if asynchronous else None):
            if not self.stage:  # CPU: straight into the host rows, regions split over threads
                cpu_ids = self._device_ids(ids)
                pieces = list(self._pieces(segs, 0, n, None))

                def gather(cols: list[tuple[torch.Tensor, int, int]]) -> None:
                    for lo, hi, host in pieces:
                        part = cpu_ids[lo:hi]
                        for rows, col, width in cols:
                            torch.index_select(rows, 0, part, out=host[:, col : col + width])

                _run_groups(self._groups_for(n), gather)
                return entry
            pinned = self._pinned(segs)
            dev_ids = self._device_ids(ids, asynchronous=asynchronous)  # on the engine's stream, inside the capture lock
            self._link_after_engine()
            for k, (lo, hi, host) in enumerate(self._pieces(segs, 0, n, self.chunk_pages)):
                cid = dev_ids[lo:hi]
                target = self._staging_rows(k, hi - lo)
                self._wait(self._stream, self._freed, k, k >= 2)  # the link has read chunk k-2 out of this half
                for rows, col, width in self._cols:
                    torch.index_select(rows, 0, cid, out=target[:, col : col + width])
                self._hand_over(self._stream, self._ready, k, self._xfer)  # the half holds chunk k
                with self._link():
                    host.copy_(target, non_blocking=pinned)  # one copy per chunk (async into pinned rows)
                self._signal(self._xfer, self._freed, k)
            pages_read = self._stream.record_event() if asynchronous else None  # type: ignore[union-attr]
            self._engine_after_link()
            del dev_ids, cid  # the device ids are freed inside the capture lock, not after it
        if asynchronous:
            assert events is not None
            events.append((pages_read, written[0]))
        return entry

    # Two streams on CUDA: the engine's (gathers, scatters) and the link's (host copies), handing the
    # two staging halves to each other with events: ``ready[h]`` (half h holds what the other side
    # needs) and ``freed[h]`` (the other side is done with half h), so chunk k's host copy overlaps
    # chunk k+1's gather (save) or chunk k-1's scatter (restore). On CPU these do nothing.
    def _link_after_engine(self) -> None:
        if self._xfer is not None:
            self._xfer.wait_stream(self._stream)  # type: ignore[arg-type]

    def _engine_after_link(self) -> None:
        if self._xfer is not None:
            self._stream.wait_stream(self._xfer)  # type: ignore[union-attr]

    def _signal(self, stream: object, events: list, k: int) -> None:
        if self._xfer is not None:
            events[k & 1].record(stream)

    def _wait(self, stream: object, events: list, k: int, needed: bool) -> None:
        if self._xfer is not None and needed:
            stream.wait_event(events[k & 1])  # type: ignore[attr-defined]

    def _hand_over(self, src: object, events: list, k: int, dst: object) -> None:
        """``events[k & 1]`` recorded on ``src`` now, and ``dst`` waits for it."""
        if self._xfer is not None:
            events[k & 1].record(src)
            dst.wait_event(events[k & 1])  # type: ignore[attr-defined]

    def _link(self):
        return torch.cuda.stream(self._xfer) if self._xfer is not None else nullcontext()

    def restore(
        self,
        entry: HostRows,
        page_ids: torch.Tensor | Sequence[int],
        *,
        first: int = 0,
        fence: list | None = None,
        after: object = None,
    ) -> None:
        """Write entry rows ``first, first+1, ...`` into pages ``page_ids`` (one row per id).

        ``after``: on CUDA, an event (or a list of them) the copy waits for before it writes the
        pages (work still queued that may touch them); without it, the caller's current stream.

        ``fence``: on CUDA from pinned rows, a list that receives the event after which the pages
        hold the bytes (the call then returns without waiting for the copy: the caller waits on the
        event before the pages are read, and before the host rows are reused). Otherwise the copy
        has finished when the call returns.
        """
        ids = self._checked_ids(page_ids)
        n = ids.numel()
        segs = self._host_rows(entry)
        rows_total = sum(int(s.shape[0]) for s in segs)
        if first < 0 or first + n > rows_total:
            raise IndexError(f"entry rows {first}..{first + n - 1} are outside an entry of {rows_total} pages")
        if n == 0:
            return
        pinned = self.stage and self._stream is not None and self._pinned(segs)
        with self._lock, self._on_stream(after, fence if pinned else None):
            if not self.stage:  # CPU: straight from the host rows, regions split over threads
                cpu_ids = self._device_ids(ids)
                pieces = list(self._pieces(segs, first, first + n, None))

                def scatter(cols: list[tuple[torch.Tensor, int, int]]) -> None:
                    for lo, hi, host in pieces:
                        part = cpu_ids[lo:hi]
                        for rows, col, width in cols:
                            rows.index_copy_(0, part, host[:, col : col + width])

                _run_groups(self._groups_for(n), scatter)
                return
            dev_ids = self._device_ids(ids, asynchronous=pinned)  # on the engine's stream, inside the capture lock
            self._link_after_engine()
            for k, (lo, hi, host) in enumerate(self._pieces(segs, first, first + n, self.chunk_pages)):
                cid = dev_ids[lo:hi]
                source = self._staging_rows(k, hi - lo)
                self._wait(self._xfer, self._freed, k, k >= 2)  # the scatter of chunk k-2 has read this half
                with self._link():
                    source.copy_(host, non_blocking=pinned)  # one host-to-device copy per chunk
                self._hand_over(self._xfer, self._ready, k, self._stream)  # the half holds chunk k
                for rows, col, width in self._cols:
                    rows.index_copy_(0, cid, source[:, col : col + width])
                self._signal(self._stream, self._freed, k)
            self._engine_after_link()
            del dev_ids, cid  # the device ids are freed inside the capture lock, not after it
