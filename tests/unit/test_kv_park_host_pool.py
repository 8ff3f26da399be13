"""The park pool's accounting on CPU, with the same class over ordinary memory (no SGLang import).

The page-locking itself needs CUDA (``tests/unit/test_kv_park_cuda.py``); here the pool is the same
:class:`HostPool` without a locker, and the boot failure is injected at the one call that pins.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from adapter.core.api import BootError
from adapter.switches.kv_park import switch
from adapter.switches.kv_park.engine import CopyEngine
from adapter.switches.kv_park.host_pool import HOST_PAGE, HostPool, PageLocker, PoolError
from adapter.switches.kv_park.page_format import PageLayout, Region, per_view_save
from adapter.switches.kv_park.store import ParkStore

MiB = 1 << 20


def _spans(pool: HostPool, carvings) -> list[tuple[int, int, int]]:
    """(chunk, start address, end address) of every live segment."""
    out = []
    for c in carvings:
        for seg in c.segments:
            start = seg.data_ptr()
            end = start + seg.numel()
            chunk = [i for i, ch in enumerate(pool.chunks) if ch.data_ptr() <= start and end <= ch.data_ptr() + ch.numel()]
            assert len(chunk) == 1, f"segment {start:#x}..{end:#x} is not inside one chunk of the pool"
            out.append((chunk[0], start, end))
    return out


def _assert_consistent(pool: HostPool, live) -> None:
    spans = sorted(_spans(pool, live), key=lambda s: s[1])
    for (_, _, end), (_, start, _) in itertools.pairwise(spans):
        assert end <= start, "two live segments overlap"
    for _, start, _ in spans:
        assert start % HOST_PAGE == 0, "a segment does not start on a host page"
    assert pool.used_bytes + pool.free_bytes == pool.capacity
    assert pool.used_bytes == sum(c.nbytes for c in live)
    assert pool.live_carvings == len(live)


def test_chunks_start_on_a_host_page_and_sum_to_the_capacity_rounded_to_a_page():
    pool = HostPool.allocate(5 * MiB + 100, chunk_bytes=2 * MiB)
    assert [c.numel() for c in pool.chunks] == [2 * MiB, 2 * MiB, MiB + HOST_PAGE]
    assert all(c.data_ptr() % HOST_PAGE == 0 for c in pool.chunks)
    assert pool.capacity == 5 * MiB + HOST_PAGE and pool.used_bytes == 0
    assert pool.describe()["pinned"] == "no"


def test_an_entry_is_carved_page_by_page_across_chunks_and_every_row_is_inside_the_pool():
    pool = HostPool.allocate(4 * MiB, chunk_bytes=MiB)
    row = 300_000  # three rows a 1 MiB chunk
    c = pool.carve(10, row)
    assert c is not None and c.rows == 10
    assert [int(s.shape[0]) for s in c.segments] == [3, 3, 3, 1], "whole rows per chunk, first fit"
    assert all(s.shape[1] == row for s in c.segments)
    _assert_consistent(pool, [c])
    assert pool.carve(3, row) is None, "only the last chunk has room left, for two rows"
    assert pool.carve(2, row) is not None


def test_churn_leaves_no_overlap_no_leak_and_one_free_extent_per_chunk_once_everything_is_released():
    pool = HostPool.allocate(8 * MiB, chunk_bytes=2 * MiB)
    rnd = random.Random(7)
    live = []
    for _ in range(600):
        if live and (rnd.random() < 0.45 or pool.free_bytes < MiB):
            live.pop(rnd.randrange(len(live))).release()
        else:
            c = pool.carve(rnd.randint(1, 12), rnd.choice([4096, 10_000, 65_536, 200_000]))
            if c is not None:
                live.append(c)
        _assert_consistent(pool, live)
    for c in live:
        c.release()
    assert pool.used_bytes == 0 and pool.live_carvings == 0
    assert pool.free_extents() == [[(0, ch.numel())] for ch in pool.chunks], "released extents did not merge back"


def test_a_carve_that_does_not_fit_returns_none_and_changes_nothing():
    pool = HostPool.allocate(2 * MiB, chunk_bytes=MiB)
    held = pool.carve(1, 700_000)
    before = (pool.used_bytes, pool.free_extents())
    assert pool.carve(3, 700_000) is None, "only two 700 kB rows fit in the two chunks"
    assert (pool.used_bytes, pool.free_extents()) == before
    assert pool.fits(1, 700_000) and not pool.fits(2, 700_000)
    held.release()


def test_a_carving_is_released_once_and_only_to_its_own_pool():
    a, b = HostPool.allocate(MiB, chunk_bytes=MiB), HostPool.allocate(MiB, chunk_bytes=MiB)
    c = a.carve(2, 1000)
    with pytest.raises(ValueError, match="another pool"):
        b.release(c)
    c.release()
    with pytest.raises(ValueError, match="already released"):
        c.release()
    assert a.used_bytes == 0


def _layout(pages: int = 24, seed: int = 0) -> PageLayout:
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, 256, (pages, 3000), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 256, (pages, 1096), dtype=torch.uint8, generator=g)
    return PageLayout((Region("kv", k), Region("state", s)))


@pytest.mark.parametrize("stage", [False, True], ids=["cpu-schedule", "staged-schedule"])
def test_a_carving_over_several_segments_holds_the_same_bytes_as_one_entry_and_restores_them(stage):
    layout = _layout()
    engine = CopyEngine(layout, chunk_bytes=3 * layout.page_bytes, stage=stage)
    pool = HostPool.allocate(3 * 4096 * 3, chunk_bytes=3 * 4096)  # 4096-byte rows: three per chunk
    ids = [7, 1, 20, 3, 11, 5, 0]
    carving = pool.carve(len(ids), layout.page_bytes)
    assert carving is not None and len(carving.segments) == 3
    engine.save(ids, out=carving.segments)
    want = per_view_save(layout, ids, torch.empty((len(ids), layout.page_bytes), dtype=torch.uint8))
    assert torch.equal(torch.cat(carving.segments), want), "the carving's bytes differ from the byte format"
    dst = [2, 4, 6, 8, 10]
    engine.restore(carving.segments, dst, first=2)
    for row, page in zip(range(2, 7), dst, strict=True):
        got = torch.cat([r.rows[page] for r in layout.regions])
        assert torch.equal(got, want[row]), f"restored page {page} differs from entry row {row}"


def test_a_full_pool_evicts_least_recently_used_entries_and_no_entry_lives_outside_it():
    layout = _layout(pages=64)
    engine = CopyEngine(layout)
    pool = HostPool.allocate(12 * 4096, chunk_bytes=6 * 4096)  # room for 12 one-page rows
    store = ParkStore(1, worker=False, host_pool=pool)
    assert store.budget == pool.capacity
    assert store.offer("a", engine, [0, 1, 2, 3, 4]) == "saved"
    assert store.offer("b", engine, [5, 6, 7, 8, 9]) == "saved"
    store.peek("a")  # a is now the most recently used
    assert store.offer("c", engine, [10, 11, 12, 13]) == "saved"
    assert "b" not in store and "a" in store and store.stats.evicted == 1, "the least recently used entry goes first"
    live = [store._entries[k].carving for k in store.ready_keys()]
    _assert_consistent(pool, live)
    assert store.used_bytes == pool.used_bytes
    assert store.offer("huge", engine, list(range(13))).startswith("refused"), "more than the pool: refused"
    entry = store.take("c")
    assert torch.equal(entry.bytes(), per_view_save(layout, [10, 11, 12, 13], torch.empty((4, layout.page_bytes), dtype=torch.uint8)))
    assert pool.used_bytes == store.used_bytes + entry.nbytes, "a taken entry keeps its rows until released"
    store.release(entry)
    assert pool.used_bytes == store.used_bytes


def test_nothing_is_leaked_after_churn_through_the_store():
    layout = _layout(pages=64)
    engine = CopyEngine(layout)
    pool = HostPool.allocate(20 * 4096, chunk_bytes=5 * 4096)
    store = ParkStore(1, worker=True, host_pool=pool)
    rnd = random.Random(3)
    try:
        for i in range(200):
            op = rnd.random()
            if op < 0.55:
                store.offer(f"r{i}", engine, rnd.sample(range(64), rnd.randint(1, 6)))
            elif op < 0.8 and store.ready_keys():
                e = store.take(rnd.choice(store.ready_keys()))
                if e is not None:
                    store.release(e)
            elif store.ready_keys():
                store.discard(rnd.choice(store.ready_keys()))
            store.poll()
            assert pool.used_bytes <= pool.capacity
        store.fence()
        assert pool.used_bytes == store.used_bytes, "pool rows held by no entry"
        for key in store.ready_keys():
            store.discard(key)
        assert pool.used_bytes == 0 and pool.live_carvings == 0
        assert pool.free_extents() == [[(0, ch.numel())] for ch in pool.chunks]
    finally:
        store.close()


def test_a_disabled_store_gives_every_row_back_to_the_pool():
    layout = _layout(pages=16)
    pool = HostPool.allocate(8 * 4096, chunk_bytes=8 * 4096)
    store = ParkStore(1, worker=False, host_pool=pool)
    store.offer("a", CopyEngine(layout), [1, 2, 3])
    assert pool.used_bytes > 0
    store.disable("test")
    assert pool.used_bytes == 0


class FailsAtChunk(PageLocker):
    """The page-locking call, failing at chunk ``n`` (1-based) the way cudaHostRegister reports it."""

    name = "injected"

    def __init__(self, n: int):
        self.n, self.locked, self.unlocked = n, 0, 0

    def lock(self, tensor: torch.Tensor) -> None:
        if self.locked + 1 == self.n:
            raise PoolError("cudaHostRegister returned cudaErrorMemoryAllocation (error 2)")
        self.locked += 1

    def unlock(self, tensor: torch.Tensor) -> None:
        self.unlocked += 1


def test_a_boot_that_cannot_pin_its_pool_fails_naming_the_key_the_size_and_how_far_it_got(tmp_path):
    locker = FailsAtChunk(3)
    with pytest.raises(BootError) as info:
        switch.boot_pool(1, locker=locker, chunk_bytes=256 * MiB, ledger=tmp_path / "ledger.json")
    msg = str(info.value)
    assert "DSV41_KV_PARK_GIB=1" in msg and "could not page-lock 1.00 GiB" in msg
    assert "0.50 GiB in 2 chunk(s)" in msg and "chunk 3 of 4 failed" in msg and "cudaErrorMemoryAllocation" in msg
    assert "MemAvailable" in msg or "cgroup" in msg, "the message names the host limit"
    assert locker.unlocked == 2, "the chunks locked before the failure stay locked"


def test_a_pool_larger_than_the_host_can_give_fails_at_boot_before_touching_memory(tmp_path):
    locker = FailsAtChunk(10**9)
    with pytest.raises(BootError) as info:
        switch.boot_pool(4096, locker=locker, ledger=tmp_path / "ledger.json")
    msg = str(info.value)
    assert "DSV41_KV_PARK_GIB=4096" in msg and "4096.00 GiB" in msg and "more than the host can give" in msg
    assert locker.locked == 0, "nothing was locked before the limit check"


def test_a_pool_that_pins_records_how_long_pinning_took(tmp_path):
    locker = FailsAtChunk(10**9)
    pool, facts = switch.boot_pool(1, locker=locker, chunk_bytes=512 * MiB, ledger=tmp_path / "ledger.json")
    assert locker.locked == 2 and pool.describe()["pinned"] == "injected" and pool.lock_ms >= 0
    assert facts["group_ranks"] == 1 and facts["group_need_gib"] == 1.0
    pool.close()
    assert locker.unlocked == 2
