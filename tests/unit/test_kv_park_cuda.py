"""KV parking on a real CUDA device (``-m cuda``; skipped without one; no SGLang import).

``tools/gpu/check.sh`` runs this file on the GPU machine; CI collects it and skips every test.
Each test states the device-side invariant it checks:

* save and restore through the staged device schedule are byte-identical to the per-view copies;
* without a park pool nothing is pinned (entries are pageable; PyTorch's pinned host allocator is
  untouched); the park pool is page-locked once, in chunks, carving pins nothing, and close unlocks it;
* saves into and restores from pinned pool rows (several segments, pipelined over the engine's two
  streams) are byte-identical to the per-view copies; a pinned restore hands back its event;
* the fence before reuse: pool rows a restore still reads are not carved again until its event is done
  (an offer that needs them meanwhile is refused, never waited for);
* a bad page id raises ``IndexError`` on the host before any device indexing (no device assert,
  the context stays usable);
* the copy stream is fenced before a freed page is written (``fence_pages`` returns only after
  the copy stream has finished reading the pages);
* a park and a restore never synchronize the scheduler thread (every host-side synchronize raises on
  it during the call, and the call returns while the streams it follows are still busy): the park's
  copy follows the forward stream on the device (it holds the bytes the forward wrote after a sleep),
  and the forward stream reads the restored bytes (it waits for the restore's copy on the device);
* the wrapped ``get_next_batch_to_run`` after a ``_park`` whose copy is still in flight restores that
  request under ``torch.cuda.set_sync_debug_mode("error")``: neither call synchronizes the scheduler
  thread, and the forward that reads the restored pages sees the bytes the parked forward wrote;
* a copy and a global-mode CUDA graph capture on another thread never overlap (the capture lock),
  the capture replays correctly and every parked byte is right (pageable and pinned pool rows); a
  thread-local capture needs no lock.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import torch

from adapter.switches.kv_park.capture import CaptureConflict, CaptureLock, locked_capture_begin, locked_capture_end
from adapter.switches.kv_park.engine import CopyEngine
from adapter.switches.kv_park.page_format import PageLayout, page_rows, per_view_save
from adapter.switches.kv_park.store import ParkStore

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tools/gpu/check.sh runs it there)"),
]

PAGE = 4  # tokens per page of the token-major buffers
POOL_PAGES = 40
DEV = "cuda"


def _mixed_layout(seed: int = 0, pool_pages: int = POOL_PAGES) -> PageLayout:
    """bf16 K/V token-major, fp8 rows, an odd-pitch padded page buffer (1-byte words), fp32 state."""
    g = torch.Generator().manual_seed(seed)

    def rand(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(DEV)

    k = rand((pool_pages * PAGE, 2, 32)).view(torch.bfloat16)
    v = rand((pool_pages * PAGE, 2, 32)).view(torch.bfloat16)
    fp8 = rand((pool_pages * PAGE, 1, 48)).view(torch.float8_e4m3fn)
    padded = rand((pool_pages, 4 * 37 + 3))
    state = rand((pool_pages, 6 * 4)).view(torch.float32)
    return PageLayout(
        (
            page_rows("k", k, PAGE),
            page_rows("v", v, PAGE),
            page_rows("fp8", fp8, PAGE),
            page_rows("padded", padded, 1),
            page_rows("state", state, 1),
        )
    )


def _wide_layout(seed: int = 0, pool_pages: int = POOL_PAGES, row: int = 37440, layers: int = 4) -> PageLayout:
    """DSV4-like rows (8-byte words): one tensor per layer, ``row`` bytes per page each."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    regions = []
    for layer in range(layers):
        rows = torch.randint(0, 256, (pool_pages, row), dtype=torch.uint8, device=DEV, generator=g)
        regions.append(page_rows(f"c4_kv.{layer}", rows, 1))
    return PageLayout(tuple(regions))


def _ids(n: int, seed: int, pool_pages: int = POOL_PAGES) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(pool_pages, generator=g)[:n]


def _host_allocs() -> int | None:
    """Pinned blocks PyTorch's host allocator ever created (None where this torch does not say)."""
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    for key in ("num_host_alloc", "allocations.allocated"):
        if key in stats:
            return int(stats[key])
    return None


@pytest.mark.parametrize("layout_kind", ["mixed", "wide"])
@pytest.mark.parametrize("chunk_pages", [1, 3, 64], ids=["1-page-chunks", "3-page-chunks", "one-chunk"])
def test_save_and_restore_on_the_device_are_byte_identical_to_the_per_view_copies(layout_kind, chunk_pages):
    layout = _mixed_layout(1) if layout_kind == "mixed" else _wide_layout(1)
    engine = CopyEngine(layout, chunk_bytes=chunk_pages * layout.page_bytes)
    assert engine.stage and engine.device.type == "cuda"
    assert engine.word == (1 if layout_kind == "mixed" else 8)
    src = _ids(17, seed=2)
    entry = engine.save(src)
    assert entry.device.type == "cpu" and tuple(entry.shape) == (17, layout.page_bytes)
    oracle = per_view_save(layout, src.tolist(), torch.empty_like(entry))
    assert torch.equal(entry, oracle), "the staged device save differs from the per-view copies"
    for i, page in enumerate(src.tolist()):  # the documented format, row by row
        assert torch.equal(entry[i], torch.cat([r.rows[page].cpu() for r in layout.regions]))
    want = [r.rows[src].clone() for r in layout.regions]
    dst = torch.tensor([p for p in _ids(POOL_PAGES, seed=3).tolist() if p not in set(src.tolist())][:17])
    untouched = torch.tensor([p for p in range(POOL_PAGES) if p not in set(dst.tolist())])
    others = [r.rows[untouched.to(DEV)].clone() for r in layout.regions]
    engine.restore(entry, dst)
    torch.cuda.synchronize()
    for region, w, other in zip(layout.regions, want, others):
        assert torch.equal(region.rows[dst.to(DEV)], w), f"region {region.name} differs after the device restore"
        assert torch.equal(region.rows[untouched.to(DEV)], other), f"region {region.name}: a page outside dst changed"
    # A CPU oracle of the same bytes reads the same entry back (the format does not depend on the device).
    cpu_layout = PageLayout(tuple(type(r)(r.name, r.rows.cpu()) for r in layout.regions))
    assert torch.equal(CopyEngine(cpu_layout).save(dst), entry)


def test_ram_mode_pins_no_host_memory():
    layout = _wide_layout(2)
    engine = CopyEngine(layout)
    before = _host_allocs()
    entry = engine.save(_ids(12, seed=4))
    engine.restore(entry, _ids(12, seed=5))
    store = ParkStore(64 << 20, worker=True)
    try:
        assert store.offer("r1", engine, _ids(8, seed=6)) in {"queued", "saved"}
        parked = store.take("r1")
    finally:
        store.close()
    torch.cuda.synchronize()
    assert parked is not None
    assert not entry.is_pinned() and not parked.data.is_pinned(), "a parked entry is pinned"
    if before is not None:
        assert _host_allocs() == before, "RAM-mode parking allocated pinned host memory"


@pytest.mark.parametrize("bad", [POOL_PAGES, -1, 10**9])
def test_a_bad_page_id_raises_on_the_host_before_any_device_indexing(bad, monkeypatch):
    layout = _mixed_layout(3)
    engine = CopyEngine(layout, chunk_bytes=layout.page_bytes)
    good = engine.save(torch.arange(4))
    moved: list[torch.Tensor] = []
    real = CopyEngine._device_ids
    monkeypatch.setattr(CopyEngine, "_device_ids", lambda self, ids: moved.append(ids) or real(self, ids))
    ids = torch.tensor([3, 0, bad, 1])
    with pytest.raises(IndexError, match=rf"page id {bad} is out of range for a pool of {POOL_PAGES} pages"):
        engine.save(ids)
    with pytest.raises(IndexError, match=rf"page id {bad} "):
        engine.restore(good, ids)
    with pytest.raises(IndexError, match="outside an entry of 4 pages"):
        engine.restore(good, torch.tensor([1, 2]), first=3)
    store = ParkStore(1 << 30, worker=True)
    try:
        with pytest.raises(IndexError, match=rf"page id {bad} "):
            store.offer("r", engine, ids)
    finally:
        store.close()
    assert moved == [], "page ids reached the device before validation"
    torch.cuda.synchronize()  # no device-side assert: the context is still usable
    assert torch.equal(engine.save(torch.arange(4)), good)


def test_the_copy_stream_is_fenced_before_a_freed_page_is_written():
    """A forward writes the pages (async, on the caller's stream), the store parks them after that
    write's event on its worker, ``fence_pages`` returns, and only then the pages are overwritten:
    the entry holds the forward's bytes, and the copy stream had no work left when the fence returned."""
    layout = _wide_layout(4, pool_pages=64, row=1 << 20, layers=2)  # 2 MiB pages: copies take real time
    engine = CopyEngine(layout, chunk_bytes=8 << 20)
    ids = _ids(24, seed=7, pool_pages=64)
    dev_ids = ids.to(DEV)
    pattern = torch.arange(24, device=DEV, dtype=torch.uint8).add_(7).view(-1, 1)
    for r in layout.regions:  # the "forward": async writes on the current stream
        r.rows.index_copy_(0, dev_ids, pattern.expand(-1, r.row_bytes).contiguous())
    written = torch.cuda.Event()
    written.record()
    store = ParkStore(1 << 30, worker=True)
    try:
        assert store.offer("r", engine, ids, after=written) == "queued"
        assert store.fence_pages(set(ids.tolist()), timeout=60)
        assert engine._stream.query(), "the copy stream still had work after the fence"
        for r in layout.regions:  # the pages are freed and reused
            r.rows.index_fill_(0, dev_ids, 0)
        entry = store.take("r")
    finally:
        store.close()
    assert entry is not None
    want = torch.cat([pattern.cpu().expand(-1, r.row_bytes) for r in layout.regions], dim=1)
    assert torch.equal(entry.data, want), "the entry does not hold the bytes the forward wrote"


@contextmanager
def _locked_graphs(lock: CaptureLock, monkeypatch):
    """``torch.cuda.CUDAGraph.capture_begin/_end`` wrapped with the lock (as the switch installs them)."""
    cls = torch.cuda.CUDAGraph
    begin, end = cls.capture_begin, cls.capture_end

    def capture_begin(self, *args, **kwargs):
        return locked_capture_begin(begin.__get__(self), self, args, kwargs, lock=lock)

    def capture_end(self, *args, **kwargs):
        return locked_capture_end(end.__get__(self), self, args, kwargs, lock=lock)

    monkeypatch.setattr(cls, "capture_begin", capture_begin)
    monkeypatch.setattr(cls, "capture_end", capture_end)
    yield


class _RecordingLock(CaptureLock):
    """A capture lock that records when copies held the device and when captures were open."""

    def __init__(self) -> None:
        super().__init__(wait_s=60)
        self.copy_spans: list[tuple[float, float]] = []
        self.capture_spans: list[tuple[float, float]] = []
        self._opened = 0.0

    @contextmanager
    def copy(self):
        with super().copy():
            start = time.perf_counter()
            try:
                yield
            finally:
                self.copy_spans.append((start, time.perf_counter()))

    def begin_capture(self) -> None:
        super().begin_capture()
        self._opened = time.perf_counter()

    def end_capture(self) -> None:
        self.capture_spans.append((self._opened, time.perf_counter()))
        super().end_capture()


def _saves_in_background(engine: CopyEngine, ids: torch.Tensor, stop: threading.Event):
    results: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not stop.is_set():
                results.append(engine.save(ids))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=loop, name="park-worker", daemon=True)
    t.start()
    return t, results, errors


def _capture_and_replay(mode: str | None, hold_s: float) -> bool:
    x = torch.randn(1 << 20, device=DEV)
    y = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    kwargs = {} if mode is None else {"capture_error_mode": mode}
    with torch.cuda.graph(graph, **kwargs):
        y.copy_(x * 2 + 1)
        time.sleep(hold_s)  # keep the capture open while the worker wants the device
        y.mul_(3)
    x.copy_(torch.arange(x.numel(), device=DEV, dtype=x.dtype))
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(y, (x * 2 + 1) * 3))


def test_parking_copies_wait_out_a_global_mode_capture_on_another_thread(monkeypatch):
    lock = _RecordingLock()
    layout = _wide_layout(5, pool_pages=64, row=1 << 20, layers=2)
    engine = CopyEngine(layout, chunk_bytes=8 << 20, capture_lock=lock)
    ids = _ids(32, seed=8, pool_pages=64)
    want = per_view_save(layout, ids.tolist(), torch.empty((32, layout.page_bytes), dtype=torch.uint8))
    stop = threading.Event()
    with _locked_graphs(lock, monkeypatch):
        worker, results, errors = _saves_in_background(engine, ids, stop)
        try:
            while not results and not errors:  # the worker is copying before the first capture
                time.sleep(0.001)
            replays = [_capture_and_replay(None, hold_s=0.05) for _ in range(4)]  # default mode: global
        finally:
            stop.set()
            worker.join(60)
    assert not errors, f"a parking copy failed during the captures: {errors[0]!r}"
    assert replays == [True] * 4, "a captured graph replayed wrong bytes"
    assert results and all(torch.equal(r, want) for r in results), "a parked entry differs"
    assert lock.waits >= 1, "no copy ever met an open capture: the test did not exercise the lock"
    for c0, c1 in lock.capture_spans:
        for s0, s1 in lock.copy_spans:
            assert s1 <= c0 or s0 >= c1, "a parking copy overlapped a global-mode capture"


def test_a_thread_local_capture_does_not_take_the_lock_and_concurrent_copies_succeed(monkeypatch):
    lock = _RecordingLock()
    layout = _wide_layout(6, pool_pages=64, row=1 << 20, layers=2)
    engine = CopyEngine(layout, chunk_bytes=8 << 20, capture_lock=lock)
    ids = _ids(32, seed=9, pool_pages=64)
    want = per_view_save(layout, ids.tolist(), torch.empty((32, layout.page_bytes), dtype=torch.uint8))
    stop = threading.Event()
    with _locked_graphs(lock, monkeypatch):
        worker, results, errors = _saves_in_background(engine, ids, stop)
        try:
            while not results and not errors:
                time.sleep(0.001)
            replays = [_capture_and_replay("thread_local", hold_s=0.05) for _ in range(4)]
        finally:
            stop.set()
            worker.join(60)
    assert not errors, f"a parking copy failed during a thread-local capture: {errors[0]!r}"
    assert replays == [True] * 4
    assert results and all(torch.equal(r, want) for r in results)
    assert lock.capture_spans == [] and lock.waits == 0  # thread-local captures leave the lock free


def test_a_copy_on_the_capturing_thread_is_refused_without_breaking_the_capture(monkeypatch):
    lock = CaptureLock(wait_s=60)
    layout = _mixed_layout(7)
    engine = CopyEngine(layout, capture_lock=lock)
    good = engine.save(torch.arange(3))
    x = torch.ones(1024, device=DEV)
    graph = torch.cuda.CUDAGraph()
    with _locked_graphs(lock, monkeypatch):
        for mode in ("global", "thread_local"):  # through the lock, and through the stream check
            with torch.cuda.graph(graph, capture_error_mode=mode):
                y = x * 5
                with pytest.raises(CaptureConflict):
                    engine.save(torch.arange(3))
                with pytest.raises(CaptureConflict):
                    engine.restore(good, torch.arange(3))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, x * 5)
            graph = torch.cuda.CUDAGraph()
    assert lock.captures_open == 0
    assert torch.equal(engine.save(torch.arange(3)), good)


# -- the park pool: pinned once, carved per entry, copies async on the engine's two streams ----------

MiB = 1 << 20


def _small_pool(capacity: int, chunk_bytes: int):
    from adapter.switches.kv_park.host_pool import CudaHostRegister, HostPool

    return HostPool.allocate(capacity, chunk_bytes=chunk_bytes, locker=CudaHostRegister())


def test_the_park_pool_is_page_locked_once_in_chunks_and_unlocked_at_close(tmp_path):
    from adapter.switches.kv_park import switch

    pool, _ = switch.boot_pool(1, chunk_bytes=256 * MiB, ledger=tmp_path / "ledger.json")
    try:
        assert len(pool.chunks) == 4 and all(c.is_pinned() for c in pool.chunks), "a chunk is not page-locked"
        assert pool.describe()["pinned"] == "cudaHostRegister" and pool.lock_ms > 0
        before = _host_allocs()
        carving = pool.carve(3, 5000)
        assert all(s.is_pinned() for s in carving.segments)
        if before is not None:
            assert _host_allocs() == before, "carving allocated pinned memory"
    finally:
        pool.close()
    assert not any(c.is_pinned() for c in pool.chunks), "close left a chunk registered"


@pytest.mark.parametrize("chunk_pages", [1, 3, 64], ids=["1-page-chunks", "3-page-chunks", "one-chunk"])
def test_saves_into_and_restores_from_pinned_pool_rows_are_byte_identical_across_segments(chunk_pages):
    layout = _wide_layout(11, row=37440, layers=3)
    engine = CopyEngine(layout, chunk_bytes=chunk_pages * layout.page_bytes)
    row = layout.page_bytes
    per_chunk = 5  # rows a chunk holds: the carving spans several segments
    pool = _small_pool(4 * per_chunk * -(-row // 4096) * 4096, per_chunk * -(-row // 4096) * 4096)
    try:
        src = _ids(17, seed=12)
        carving = pool.carve(17, row)
        assert carving is not None and len(carving.segments) == 4
        engine.save(src, out=carving.segments)
        oracle = per_view_save(layout, src.tolist(), torch.empty((17, row), dtype=torch.uint8))
        assert torch.equal(torch.cat(carving.segments), oracle), "the pinned rows differ from the per-view copies"
        dst = torch.tensor([p for p in _ids(POOL_PAGES, seed=13).tolist() if p not in set(src.tolist())][:15])
        fence: list = []
        engine.restore(carving.segments, dst, first=2, fence=fence)
        assert len(fence) == 1, "a restore from pinned rows hands back its event instead of waiting"
        fence[0].synchronize()
        for i, page in enumerate(dst.tolist()):
            got = torch.cat([r.rows[page].cpu() for r in layout.regions])
            assert torch.equal(got, oracle[i + 2]), f"page {page} differs after the pinned restore"
        pageable: list = []
        engine.restore(oracle, dst[:3], fence=pageable)
        assert pageable == [], "a restore from pageable memory must finish before it returns"
    finally:
        pool.close()


def test_a_restores_pool_rows_are_not_reused_before_its_copy_has_read_them():
    """The fence before reuse: a restore still in flight (its stream held back by a sleep) keeps its
    rows out of the pool; an offer that needs them meanwhile is refused (the store never waits), the
    next one after the restore's event is done carves them, and the restored pages hold the old bytes."""
    layout = _wide_layout(14, row=1 << 20, layers=2)
    engine = CopyEngine(layout, chunk_bytes=4 << 20)
    pool = _small_pool(8 * layout.page_bytes, 8 * layout.page_bytes)  # exactly 8 rows
    store = ParkStore(1, worker=False, host_pool=pool)
    try:
        src, other = _ids(8, seed=15), _ids(8, seed=16)
        assert store.offer("a", engine, src) == "saved"
        want = per_view_save(layout, src.tolist(), torch.empty((8, layout.page_bytes), dtype=torch.uint8))
        entry = store.take("a")
        dst = torch.tensor([p for p in range(POOL_PAGES) if p not in set(src.tolist())][:8])
        torch.cuda._sleep(2_000_000_000)  # hold the caller's stream (the restore is ordered after it)
        fence: list = []
        engine.restore(entry.rows, dst, fence=fence)
        assert not fence[0].query(), "the restore finished before the test could see it in flight"
        store.release(entry, after=fence[0])
        assert pool.used_bytes == pool.capacity, "rows a restore still reads went back to the pool"
        outcome = store.offer("b", engine, other)  # needs those rows: refused while the restore reads them
        assert outcome.startswith("refused") and not fence[0].query(), outcome
        fence[0].synchronize()
        assert store.offer("b", engine, other) == "saved"
        for i, page in enumerate(dst.tolist()):
            got = torch.cat([r.rows[page].cpu() for r in layout.regions])
            assert torch.equal(got, want[i]), "the next save overwrote rows before the restore read them"
    finally:
        store.close()
        pool.close()


def test_a_pinned_pool_save_waits_out_a_global_mode_capture_on_another_thread(monkeypatch):
    lock = _RecordingLock()
    layout = _wide_layout(17, pool_pages=64, row=1 << 20, layers=2)
    engine = CopyEngine(layout, chunk_bytes=8 << 20, capture_lock=lock)
    pool = _small_pool(64 << 20, 64 << 20)
    carving = pool.carve(32, layout.page_bytes)
    ids = _ids(32, seed=18, pool_pages=64)
    want = per_view_save(layout, ids.tolist(), torch.empty((32, layout.page_bytes), dtype=torch.uint8))
    stop = threading.Event()
    results: list[bool] = []
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not stop.is_set():
                engine.save(ids, out=carving.segments)
                results.append(torch.equal(torch.cat(carving.segments), want))
        except BaseException as exc:
            errors.append(exc)

    try:
        with _locked_graphs(lock, monkeypatch):
            worker = threading.Thread(target=loop, daemon=True)
            worker.start()
            try:
                while not results and not errors:
                    time.sleep(0.001)
                replays = [_capture_and_replay(None, hold_s=0.05) for _ in range(4)]
            finally:
                stop.set()
                worker.join(60)
        assert not errors, f"a pinned save failed during the captures: {errors[0]!r}"
        assert replays == [True] * 4 and results and all(results)
        assert lock.waits >= 1, "no copy met an open capture"
        for c0, c1 in lock.capture_spans:
            for s0, s1 in lock.copy_spans:
                assert s1 <= c0 or s0 >= c1, "a pinned save overlapped a global-mode capture"
    finally:
        pool.close()


SLEEP = 2_000_000_000  # cycles of torch.cuda._sleep: about a second on an H200, busy long after any call returns


@contextmanager
def _no_host_sync_on_this_thread(monkeypatch):
    """Every host-side CUDA synchronize raises when called on this thread (other threads, e.g. the park
    worker, may wait for their own copies)."""
    me = threading.get_ident()

    def guard(name: str, real):
        def call(*args, **kwargs):
            if threading.get_ident() == me:
                raise AssertionError(f"{name} on the scheduler thread")
            return real(*args, **kwargs)

        return call

    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "synchronize", guard("torch.cuda.synchronize", torch.cuda.synchronize))
        m.setattr(torch.cuda.Stream, "synchronize", guard("Stream.synchronize", torch.cuda.Stream.synchronize))
        m.setattr(torch.cuda.Event, "synchronize", guard("Event.synchronize", torch.cuda.Event.synchronize))
        yield


def _scheduler_state(store: ParkStore):
    """The switch's state with a scheduler's two streams: ``schedule`` (the thread's current stream)
    and ``forward`` (the overlap loop's forward stream, learned at the first pass)."""
    from adapter.switches.kv_park import switch

    state = switch._State(store)
    state.forward_stream = torch.cuda.Stream()
    return state, torch.cuda.Stream(), state.forward_stream


def test_a_park_never_synchronizes_the_scheduler_thread_and_its_copy_follows_the_forward_stream(monkeypatch):
    from adapter.switches.kv_park import switch

    layout = _wide_layout(21, pool_pages=64, row=1 << 20, layers=2)
    engine = CopyEngine(layout, chunk_bytes=8 << 20)
    pool = _small_pool(32 * layout.page_bytes, 32 * layout.page_bytes)
    store = ParkStore(1, worker=True, host_pool=pool, queue_depth=None)
    state, schedule, forward = _scheduler_state(store)
    ids = _ids(24, seed=22, pool_pages=64)
    dev_ids = ids.to(DEV)  # the switch parks the allocator's own device ids: nothing is read back
    pattern = torch.arange(24, device=DEV, dtype=torch.uint8).add_(31).view(-1, 1)
    torch.cuda.synchronize()
    try:
        with torch.cuda.stream(forward):  # the forward still in flight: it writes the pages after a while
            torch.cuda._sleep(SLEEP)
            for r in layout.regions:
                r.rows.index_copy_(0, dev_ids, pattern.expand(-1, r.row_bytes).contiguous())
        with torch.cuda.stream(schedule), _no_host_sync_on_this_thread(monkeypatch):
            outcome = switch.save_pages(state, "r", switch._Engines(engine, None), dev_ids, None, {"swa_from": None})
            assert not forward.query(), "the park returned only after the forward had finished"
        assert outcome == "queued"
        assert store.fence("r", timeout=60)
        entry = store.take("r")
        assert entry is not None
        want = torch.cat([pattern.cpu().expand(-1, r.row_bytes) for r in layout.regions], dim=1)
        assert torch.equal(entry.bytes(), want), "the park's copy read the pages before the forward wrote them"
        store.release(entry)
    finally:
        store.close()
        pool.close()


def test_a_restore_never_synchronizes_the_scheduler_thread_and_the_forward_stream_reads_its_bytes(monkeypatch):
    from adapter.switches.kv_park import switch

    layout = _wide_layout(23, pool_pages=64, row=1 << 20, layers=2)
    engine = CopyEngine(layout, chunk_bytes=8 << 20)
    pool = _small_pool(16 * layout.page_bytes, 16 * layout.page_bytes)
    store = ParkStore(1, worker=False, host_pool=pool)
    state, schedule, forward = _scheduler_state(store)
    src = _ids(16, seed=24, pool_pages=64)
    try:
        assert store.offer("r", engine, src) == "saved"
        want = per_view_save(layout, src.tolist(), torch.empty((16, layout.page_bytes), dtype=torch.uint8))
        dst = torch.tensor([p for p in range(64) if p not in set(src.tolist())][:16])
        dev_dst = dst.to(DEV)
        for r in layout.regions:
            r.rows.index_fill_(0, dev_dst, 0)
        torch.cuda.synchronize()
        with torch.cuda.stream(schedule):
            torch.cuda._sleep(SLEEP)  # work still queued on the scheduler's stream: the restore follows it
            with _no_host_sync_on_this_thread(monkeypatch):
                switch.restore_pages(state, [("r", engine, dst, 0)])
                assert not schedule.query(), "the restore returned only after the queued work had finished"
        with torch.cuda.stream(forward):  # the next forward reads the restored pages
            seen = [r.rows.index_select(0, dev_dst) for r in layout.regions]
        forward.synchronize()
        got = torch.cat([s.cpu() for s in seen], dim=1)
        assert torch.equal(got, want), "the forward stream read the pages before the restore wrote them"
        torch.cuda.synchronize()
        store.poll()
        assert pool.used_bytes == 0, "the restore's pool rows did not go back once its copy was done"
    finally:
        store.close()
        pool.close()


def test_the_wrapped_pass_restores_while_the_parks_copy_is_in_flight_and_never_synchronizes(monkeypatch):
    """The device side of tests/upstream/test_kv_park_scheduler.py::
    test_a_park_and_the_next_pass_with_copies_in_flight_never_wait_on_the_scheduler_thread (the GPU
    machine has no SGLang: the request, its ``req_to_token`` row and the scheduler are plain objects,
    and ``_restore_one``'s tree work is replaced by its device part: pages the allocator would hand
    out, written by ``restore_pages``). ``_park`` parks a row whose forward is still running, then the
    wrapped ``get_next_batch_to_run`` restores that request while the park's copy is still in flight
    and its stock pass queues a forward that reads the restored pages. Under
    ``torch.cuda.set_sync_debug_mode("error")``, with every Python-level synchronize raising on this
    thread, both return while the forward stream is still busy; the forward reads the bytes the
    first forward wrote (the park read them after it, the restore wrote them after the park's copy
    landed, the reading forward ran after the restore); the store lets go of the pool rows only after."""
    from types import SimpleNamespace

    from adapter.switches.kv_park import park, restore, switch

    layout = _wide_layout(25, pool_pages=64, row=1 << 20, layers=2)
    engine = CopyEngine(layout, chunk_bytes=8 << 20)
    pool = _small_pool(32 * layout.page_bytes, 32 * layout.page_bytes)
    store = ParkStore(1, worker=False, host_pool=pool)
    state, schedule, forward = _scheduler_state(store)
    engines = switch._Engines(engine, None)
    monkeypatch.setattr(state, "engines_for", lambda kv_pool: engines)
    monkeypatch.setattr(park, "_why_not_parkable", lambda *args: None)  # SGLang's runtime context is not here
    monkeypatch.setattr(park, "_held_by_tree", lambda *args: (0, 0))  # nor its tree: it holds nothing of the row
    page, n = 4, 24  # tokens per page, pages parked
    src = _ids(n, seed=26, pool_pages=64)
    dst = torch.tensor([p for p in range(64) if p not in set(src.tolist())][:n], device=DEV)
    req_to_token = torch.zeros((2, 128), dtype=torch.int32, device=DEV)
    req_to_token[1, : n * page] = (src.view(-1, 1) * page + torch.arange(page)).view(-1).to(DEV, torch.int32)
    req = SimpleNamespace(
        rid="r", origin_input_ids=list(range(n * page + 1)), output_ids=[], extra_key=None, cache_salt=None,
        kv=SimpleNamespace(kv_committed_len=n * page + 1, req_pool_idx=1), _compute_max_prefix_len=lambda fill: fill - 1,
    )
    allocator = SimpleNamespace(page_size=page, get_kvcache=lambda: None)
    tree = SimpleNamespace(supports_swa=lambda: False)
    pattern = torch.arange(n, device=DEV, dtype=torch.uint8).add_(77).view(-1, 1)
    for r in layout.regions:
        r.rows.index_fill_(0, dst, 0)
    restored: list = []

    def restore_one(state_, scheduler, waiting, *, may_evict):
        switch.restore_pages(state_, [(waiting.rid, engine, dst, 0)])
        restored.append(waiting.rid)
        return True

    def stock_pass():  # the batch's forward reads the restored pages on the forward stream
        with torch.cuda.stream(forward):
            return SimpleNamespace(batch_to_run=[r.rows.index_select(0, dst) for r in layout.regions])

    monkeypatch.setattr(restore, "_restore_one", restore_one)
    monkeypatch.setattr(switch, "STATE", state)  # what install() sets
    scheduler = SimpleNamespace(forward_stream=forward, waiting_queue=[req], running_batch=None,
                                token_to_kv_pool_allocator=None, tree_cache=None)
    torch.cuda.synchronize()
    try:
        with torch.cuda.stream(forward):  # the forward that wrote the row, still running
            torch.cuda._sleep(SLEEP)
            for r in layout.regions:
                r.rows.index_copy_(0, src.to(DEV), pattern.expand(-1, r.row_bytes).contiguous())
        with torch.cuda.stream(schedule), _no_host_sync_on_this_thread(monkeypatch):
            torch.cuda.set_sync_debug_mode("error")
            try:
                switch._park(state, req, SimpleNamespace(req_to_token=req_to_token), allocator, tree)
                assert store.pending() == 1, "the park's copy should still be in flight"
                plan = switch._get_next_batch_to_run(stock_pass, scheduler, (), {})
                assert not forward.query(), "the park or the pass returned only after the forward had finished"
                assert restored == ["r"] and store.pending() == 1, "the restore did not run beside the copy in flight"
            finally:
                torch.cuda.set_sync_debug_mode(0)
        forward.synchronize()
        got = torch.cat([seen.cpu() for seen in plan.batch_to_run], dim=1)
        want = torch.cat([pattern.cpu().expand(-1, r.row_bytes) for r in layout.regions], dim=1)
        assert torch.equal(got, want), "the forward read the restored pages before the park and the restore were done"
        torch.cuda.synchronize()
        store.poll()
        assert store.pending() == 0 and pool.used_bytes == 0, "the rows did not go back once the copies were done"
    finally:
        store.close()
        pool.close()
