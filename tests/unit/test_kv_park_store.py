"""The host store: budget, LRU eviction, the background worker and its failure path (no SGLang import)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from adapter.switches.kv_park.engine import CopyEngine
from adapter.switches.kv_park.page_format import PageLayout, Region
from adapter.switches.kv_park.store import ParkStore

PAGE_BYTES = 64
POOL_PAGES = 32


def _layout(seed: int = 0) -> PageLayout:
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 256, (POOL_PAGES, 48), dtype=torch.uint8, generator=g)
    b = torch.randint(0, 256, (POOL_PAGES, 16), dtype=torch.uint8, generator=g)
    return PageLayout((Region("kv", a), Region("state", b)))


class GatedEngine(CopyEngine):
    """A real copy engine whose save waits until the test lets it go: shows what happens while a copy is in flight."""

    def __init__(self, layout: PageLayout):
        super().__init__(layout, chunk_bytes=2 * PAGE_BYTES)
        self.go = threading.Event()
        self.entered = threading.Event()
        self.copies = 0

    def save(self, page_ids, out=None, *, after=None):
        self.entered.set()
        assert self.go.wait(10), "the test never let the copy go"
        self.copies += 1
        return super().save(page_ids, out=out, after=after)


class BrokenEngine(CopyEngine):
    def save(self, page_ids, out=None, *, after=None):
        raise RuntimeError("device copy failed")


def test_offer_returns_before_the_copy_and_holds_pages_until_it_lands():
    layout = _layout()
    engine = GatedEngine(layout)
    store = ParkStore(1 << 20, worker=True)
    released: list[str] = []
    ids = torch.tensor([5, 2, 9])
    want = torch.cat([torch.cat([r.rows[p] for r in layout.regions]).unsqueeze(0) for p in ids.tolist()])
    try:
        outcome = store.offer("r1", engine, ids, on_landed=lambda: released.append("r1"))
        assert outcome == "queued"
        assert engine.entered.wait(5) and engine.copies == 0, "the copy should be held by the test"
        assert store.poll() == 0 and released == [], "pages released before the copy landed"
        assert "r1" in store and store.pending() == 1
        assert store.reserved_bytes == 3 * PAGE_BYTES
        assert not store.fence(timeout=0.05), "fence returned while the copy was still held"
        assert released == []
        engine.go.set()
        assert store.fence(timeout=5)
        assert released == ["r1"] and store.pending() == 0
        entry = store.take("r1")
        assert entry is not None and torch.equal(entry.data, want)
    finally:
        engine.go.set()
        store.close()


def test_a_full_queue_falls_back_to_a_synchronous_save():
    layout = _layout(1)
    engine = GatedEngine(layout)
    store = ParkStore(1 << 20, worker=True, queue_depth=1)
    released: list[str] = []
    try:
        assert store.offer("a", engine, [1], on_landed=lambda: released.append("a")) == "queued"
        assert engine.entered.wait(5)  # the worker holds "a" (held back); the queue is empty again
        assert store.offer("b", engine, [2], on_landed=lambda: released.append("b")) == "queued"
        sync_engine = CopyEngine(layout)  # a separate engine: the held one is busy
        assert store.offer("c", sync_engine, [3], on_landed=lambda: released.append("c")) == "saved"
        assert released == ["c"], "a synchronous save releases its pages before returning"
        assert store.stats.sync_saves == 1 and store.stats.queued == 2
        assert store.peek("c") is not None
    finally:
        engine.go.set()
        store.close()
    assert sorted(released) == ["a", "b", "c"]


def test_a_store_without_a_worker_saves_synchronously():
    layout = _layout(2)
    store = ParkStore(1 << 20, worker=False)
    released = []
    assert store.offer("a", CopyEngine(layout), [4, 0], on_landed=lambda: released.append(1)) == "saved"
    assert released == [1]
    entry = store.take("a")
    assert entry is not None and entry.pages == 2
    assert store.take("a") is None and store.stats.missed == 1


def test_least_recently_used_entries_are_evicted_to_fit_the_budget():
    layout = _layout(3)
    engine = CopyEngine(layout)
    store = ParkStore(4 * PAGE_BYTES, worker=False)
    assert store.offer("a", engine, [0, 1]) == "saved"
    assert store.offer("b", engine, [2]) == "saved"
    assert store.peek("a") is not None  # "a" is now the most recently used
    assert store.offer("c", engine, [3, 4]) == "saved"  # needs 2 pages: evicts "b" first, which frees enough
    assert store.ready_keys() == ["a", "c"] and store.stats.evicted == 1
    assert store.offer("d", engine, [5, 6, 7]) == "saved"  # evicts "a" then "c"
    assert store.ready_keys() == ["d"] and store.used_bytes == 3 * PAGE_BYTES <= store.budget
    assert store.take("b") is None, "an evicted entry is gone: the request recomputes"


def test_an_entry_larger_than_the_budget_is_refused_and_its_pages_released():
    store = ParkStore(2 * PAGE_BYTES, worker=True)
    released = []
    try:
        outcome = store.offer("big", CopyEngine(_layout(4)), [0, 1, 2], on_landed=lambda: released.append(1))
        assert outcome.startswith("refused:") and "exceed the budget" in outcome
        assert released == [1] and "big" not in store
    finally:
        store.close()


def test_copies_in_flight_hold_their_budget():
    layout = _layout(5)
    engine = GatedEngine(layout)
    store = ParkStore(3 * PAGE_BYTES, worker=True)
    try:
        assert store.offer("a", engine, [0, 1]) == "queued"
        outcome = store.offer("b", CopyEngine(layout), [2, 3])
        assert outcome == "refused: the budget is held by copies in flight"
    finally:
        engine.go.set()
        store.close()
    assert store.ready_keys() == ["a"]


def test_a_worker_failure_disables_parking_with_one_line_and_the_request_recomputes(records):
    layout = _layout(6)
    store = ParkStore(1 << 20, worker=True)
    released = []
    try:
        assert store.offer("ok", CopyEngine(layout), [5]) == "queued"
        assert store.fence(timeout=5) and store.ready_keys() == ["ok"]
        assert store.offer("a", BrokenEngine(layout), [0], on_landed=lambda: released.append("a")) == "queued"
        assert store.fence(timeout=5)
        assert store.ready_keys() == [], "parked entries are dropped with the store: their requests recompute"
        assert released == ["a"], "the failed copy must still release its pages"
        assert store.disabled and "RuntimeError: device copy failed" in store.disabled_reason
        assert store.take("a") is None
        later = store.offer("b", CopyEngine(layout), [1], on_landed=lambda: released.append("b"))
        assert later == "refused: parking disabled" and released == ["a", "b"]
        assert store.offer("c", BrokenEngine(layout), [2]) == "refused: parking disabled"
    finally:
        store.close()
    lines = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and lines[0].startswith("[dsv41] kv_park disabled reason=copy_of_a_failed")


def test_a_synchronous_failure_also_disables_parking():
    store = ParkStore(1 << 20, worker=False)
    outcome = store.offer("a", BrokenEngine(_layout(7)), [0])
    assert outcome == "refused: copy failed (RuntimeError)"
    assert store.disabled and store.take("a") is None


def test_parking_the_same_request_again_replaces_its_entry():
    layout = _layout(8)
    engine = CopyEngine(layout)
    store = ParkStore(1 << 20, worker=False)
    store.offer("a", engine, [0, 1, 2])
    store.offer("a", engine, [9])
    entry = store.take("a")
    assert entry is not None and entry.pages == 1 and store.used_bytes == 0


def test_bad_store_arguments_are_rejected():
    with pytest.raises(ValueError, match="budget_bytes must be positive"):
        ParkStore(0)
    with pytest.raises(ValueError, match="queue_depth must be >= 1"):
        ParkStore(1, worker=False, queue_depth=0)


def test_a_writer_waits_only_for_copies_that_read_its_pages():
    layout = _layout(9)
    engine = GatedEngine(layout)
    store = ParkStore(1 << 20, worker=True)
    try:
        assert store.offer("a", engine, [3, 4]) == "queued"
        assert engine.entered.wait(5)
        t0 = time.perf_counter()
        assert store.fence_pages({7, 8}, timeout=5), "disjoint pages must not wait"
        assert time.perf_counter() - t0 < 1 and store.pending() == 1
        assert not store.fence_pages({8, 4}, timeout=0.05), "a page the copy reads must wait"
        engine.go.set()
        assert store.fence_pages({4}, timeout=5) and store.pending() == 0
        assert store.ready_keys() == ["a"]
    finally:
        engine.go.set()
        store.close()


def test_an_offer_with_an_out_of_range_page_is_rejected_on_the_callers_thread():
    store = ParkStore(1 << 20, worker=True)
    with pytest.raises(IndexError, match=f"page id {POOL_PAGES} is out of range for a pool of {POOL_PAGES} pages"):
        store.offer("a", CopyEngine(_layout(10)), [1, POOL_PAGES])
    assert "a" not in store and not store.disabled
