"""The page-major copy engine: byte format, chunking and page-id validation (no SGLang import)."""

from __future__ import annotations

import itertools

import pytest
import torch

from adapter.switches.kv_park.engine import CopyEngine
from adapter.switches.kv_park.page_format import (
    PageLayout,
    Region,
    check_page_ids,
    page_rows,
    per_view_restore,
    per_view_save,
)

PAGE = 4  # tokens per page in the token-major buffers below
POOL_PAGES = 24


def _mixed_layout(seed: int = 0) -> PageLayout:
    """A pool with the region kinds a DSV4 / hybrid SWA pool exposes, filled with random bytes.

    bf16 token-major K and V buffers, an fp8 (e4m3) buffer moved as its uint8 view, a padded
    page-major byte buffer (odd row size, so the engine falls back to 1-byte words), and an fp32
    state buffer with one row per page.
    """
    g = torch.Generator().manual_seed(seed)

    def rand_bytes(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    k = rand_bytes((POOL_PAGES * PAGE, 2, 8 * 2)).view(torch.bfloat16)  # [tokens, heads, dim] bf16
    v = rand_bytes((POOL_PAGES * PAGE, 2, 8 * 2)).view(torch.bfloat16)
    fp8 = rand_bytes((POOL_PAGES * PAGE, 1, 24)).view(torch.float8_e4m3fn)  # fp8 KV rows
    padded = rand_bytes((POOL_PAGES, 4 * 37 + 3))  # [pages, padded_page_bytes], odd pitch
    state = rand_bytes((POOL_PAGES, 6 * 4)).view(torch.float32)
    return PageLayout(
        (
            page_rows("k", k, PAGE),
            page_rows("v", v, PAGE),
            page_rows("fp8", fp8, PAGE),
            page_rows("padded", padded, 1),
            page_rows("state", state, 1),
        )
    )


def _shuffled(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(POOL_PAGES, generator=g)[:n]


def _snapshot(layout: PageLayout) -> list[torch.Tensor]:
    return [r.rows.clone() for r in layout.regions]


@pytest.mark.parametrize("stage", [False, True], ids=["direct", "staged"])
def test_saved_entry_is_the_documented_page_major_byte_format_for_shuffled_pages(stage):
    layout = _mixed_layout()
    ids = _shuffled(17, seed=1)
    engine = CopyEngine(layout, chunk_bytes=3 * layout.page_bytes, stage=stage)
    entry = engine.save(ids)
    assert entry.dtype == torch.uint8 and tuple(entry.shape) == (17, layout.page_bytes)
    # Row i = region_0[ids[i]] || region_1[ids[i]] || ... with no padding.
    for i, page in enumerate(ids.tolist()):
        expected = torch.cat([r.rows[page] for r in layout.regions])
        assert torch.equal(entry[i], expected), f"row {i} (page {page}) differs"
    # The stock per-view serialization writes the same bytes.
    assert torch.equal(entry, per_view_save(layout, ids.tolist(), torch.empty_like(entry)))


@pytest.mark.parametrize("stage", [False, True], ids=["direct", "staged"])
def test_restore_puts_every_region_byte_back_into_other_pages(stage):
    layout = _mixed_layout()
    src = _shuffled(10, seed=2)
    engine = CopyEngine(layout, chunk_bytes=4 * layout.page_bytes, stage=stage)
    entry = engine.save(src)
    before = [r.rows[src].clone() for r in layout.regions]
    dst = torch.tensor([p for p in _shuffled(POOL_PAGES, seed=3).tolist() if p not in set(src.tolist())][:10])
    untouched = [p for p in range(POOL_PAGES) if p not in set(dst.tolist())]
    others = [r.rows[untouched].clone() for r in layout.regions]
    engine.restore(entry, dst)
    for region, want, other in zip(layout.regions, before, others):
        assert torch.equal(region.rows[dst], want), f"region {region.name} differs after restore"
        assert torch.equal(region.rows[untouched], other), f"region {region.name}: a page outside dst changed"


def test_bf16_and_fp8_values_survive_the_round_trip_bit_for_bit():
    g = torch.Generator().manual_seed(4)
    kb = torch.randn((POOL_PAGES * PAGE, 2, 8), generator=g).to(torch.bfloat16)
    k8 = torch.randn((POOL_PAGES * PAGE, 1, 16), generator=g).to(torch.float8_e4m3fn)
    layout = PageLayout((page_rows("bf16", kb, PAGE), page_rows("fp8", k8, PAGE)))
    engine = CopyEngine(layout, chunk_bytes=2 * layout.page_bytes)
    ids = torch.tensor([5, 1, 9, 2])
    want_b = kb.view(POOL_PAGES, PAGE, 2, 8)[ids].clone()
    want_8 = k8.view(POOL_PAGES, PAGE, 1, 16)[ids].view(torch.uint8).clone()
    entry = engine.save(ids)
    kb.zero_()
    k8.view(torch.uint8).zero_()
    engine.restore(entry, ids)
    assert torch.equal(kb.view(POOL_PAGES, PAGE, 2, 8)[ids].view(torch.int16), want_b.view(torch.int16))
    assert torch.equal(k8.view(POOL_PAGES, PAGE, 1, 16)[ids].view(torch.uint8), want_8)


@pytest.mark.parametrize(
    ("chunk_pages_x2", "expected_chunk_pages"),
    [(1, 1), (5, 2), (6, 3), (100, 50)],
    ids=["sub-page", "fractional", "exact", "larger-than-entry"],
)
@pytest.mark.parametrize("stage", [False, True], ids=["direct", "staged"])
def test_chunks_hold_whole_pages_for_every_chunk_size(chunk_pages_x2, expected_chunk_pages, stage):
    """Chunk budgets of half a page, 2.5 pages, exactly 3 pages and more than the entry."""
    layout = _mixed_layout(seed=5)
    chunk_bytes = chunk_pages_x2 * layout.page_bytes // 2
    engine = CopyEngine(layout, chunk_bytes=chunk_bytes, stage=stage)
    n = 13
    assert engine.chunk_pages == expected_chunk_pages
    ranges = list(engine.chunks(n))
    assert len(ranges) == -(-n // expected_chunk_pages)  # one chunk when it is larger than the entry
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(hi - lo <= engine.chunk_pages for lo, hi in ranges)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    if stage:  # the staging halves hold exactly one chunk of whole pages
        assert engine.staging_bytes == 2 * engine.chunk_pages * layout.page_bytes
    ids = _shuffled(n, seed=6)
    entry = engine.save(ids)
    assert torch.equal(entry, per_view_save(layout, ids.tolist(), torch.empty_like(entry)))
    # Another chunking reads the same format back.
    other = CopyEngine(layout, chunk_bytes=7 * layout.page_bytes, stage=not stage)
    dst = _shuffled(n, seed=7)
    other.restore(entry, dst)
    assert torch.equal(engine.save(dst), entry)


def test_restore_of_a_slice_of_the_entry_uses_the_rows_after_first():
    layout = _mixed_layout(seed=8)
    engine = CopyEngine(layout, chunk_bytes=2 * layout.page_bytes)
    entry = engine.save(torch.arange(6))
    engine.restore(entry, torch.tensor([20, 21]), first=4)
    assert torch.equal(engine.save(torch.tensor([20, 21])), entry[4:6])
    with pytest.raises(IndexError, match="outside an entry of 6 pages"):
        engine.restore(entry, torch.tensor([20, 21]), first=5)


@pytest.mark.parametrize("bad", [POOL_PAGES, -1, 10**9])
def test_an_out_of_range_page_id_raises_index_error_naming_it_before_any_copy(bad):
    layout = _mixed_layout(seed=9)
    engine = CopyEngine(layout, chunk_bytes=layout.page_bytes, stage=True)
    before = _snapshot(layout)
    entry = engine.save(torch.arange(4))
    mark = entry.clone()
    ids = torch.tensor([3, 0, bad, 1])  # the bad id sits after good ones in a later chunk
    with pytest.raises(IndexError, match=rf"page id {bad} is out of range for a pool of {POOL_PAGES} pages"):
        engine.restore(entry, ids)
    assert all(torch.equal(a, r.rows) for a, r in zip(before, layout.regions)), "restore wrote before validating"
    out = torch.zeros_like(entry)
    with pytest.raises(IndexError, match=rf"page id {bad} "):
        engine.save(ids, out=out)
    assert not out.any(), "save copied before validating"
    assert torch.equal(entry, mark)


def test_check_page_ids_accepts_lists_and_reports_the_count_of_bad_ids():
    assert check_page_ids([2, 0, 1], 3).tolist() == [2, 0, 1]
    with pytest.raises(IndexError, match=r"page id 5 is out of range for a pool of 3 pages .*2 bad id"):
        check_page_ids([5, 1, 7], 3)


def test_engine_uses_the_widest_word_that_divides_every_row():
    g = torch.Generator().manual_seed(10)
    rows8 = torch.randint(0, 256, (8, 64), dtype=torch.uint8, generator=g)
    rows4 = torch.randint(0, 256, (8, 12), dtype=torch.uint8, generator=g)
    assert PageLayout((Region("a", rows8),)).word == 8
    assert PageLayout((Region("a", rows8), Region("b", rows4))).word == 4
    assert _mixed_layout().word == 1  # the odd-pitch region


def test_layouts_reject_regions_that_disagree_on_pages_or_are_not_byte_rows():
    with pytest.raises(ValueError, match="disagree on the number of pages"):
        PageLayout((Region("a", torch.zeros(4, 8, dtype=torch.uint8)), Region("b", torch.zeros(5, 8, dtype=torch.uint8))))
    with pytest.raises(ValueError, match="not a whole number"):
        page_rows("k", torch.zeros(10, 2), 4)
    with pytest.raises(ValueError, match="not contiguous"):
        page_rows("k", torch.zeros(8, 4).t(), 4)


def test_per_view_restore_is_the_inverse_of_per_view_save():
    layout = _mixed_layout(seed=11)
    entry = per_view_save(layout, [4, 2], torch.empty((2, layout.page_bytes), dtype=torch.uint8))
    per_view_restore(layout, entry, [7, 8])
    assert torch.equal(CopyEngine(layout).save([7, 8]), entry)


@pytest.mark.parametrize("threads", [2, 3])
def test_the_entry_bytes_do_not_depend_on_the_copy_thread_count_and_no_thread_outlives_a_call(threads, monkeypatch):
    """Unstaged CPU copies split the regions over threads (one index op per region still); the
    entry equals the one-thread entry, restore writes the same bytes, and the threads are joined."""
    import threading

    from adapter.switches.kv_park import engine as engine_mod

    monkeypatch.setattr(engine_mod, "PARALLEL_MIN_BYTES", 0)  # the small test pool takes the threaded path
    layout = _mixed_layout(seed=7)
    one, many = CopyEngine(layout, threads=1), CopyEngine(layout, threads=threads)
    assert len(many._groups_for(1)) == min(threads, len(layout.regions))
    assert sorted(c[1] for g in many._groups for c in g) == sorted(c[1] for c in one._cols)  # each region once
    src, dst = _shuffled(9, seed=1), _shuffled(9, seed=2)
    entry = many.save(src)
    assert torch.equal(entry, one.save(src))
    assert torch.equal(entry, per_view_save(layout, src.tolist(), torch.empty_like(entry)))
    many.restore(entry, dst)
    assert torch.equal(one.save(dst), entry)
    assert not [t for t in threading.enumerate() if t.name == "dsv41-kv-copy"]


def test_a_failure_on_a_copy_thread_is_raised_on_the_calling_thread_after_every_thread_joined():
    import threading

    from adapter.switches.kv_park.engine import _run_groups

    ran: list[str] = []

    def work(group: str) -> None:
        ran.append(group)
        if group == "second":
            assert threading.current_thread().name == "dsv41-kv-copy"
            raise RuntimeError("copy failed on a worker thread")

    with pytest.raises(RuntimeError, match="copy failed on a worker thread"):
        _run_groups(["first", "second", "third"], work)
    assert sorted(ran) == ["first", "second", "third"]
    assert not [t for t in threading.enumerate() if t.name == "dsv41-kv-copy"]
