"""``DSV41_KV_PARK=ram`` on a real ``DeepSeekV4TokenToKVPool`` (CPU): every region, save -> free -> restore.

The scheduler tests run the real SGLang scheduler (:mod:`devkit.testkit.scheduler` with
``dsv4=True``: a real DSV4 pool sized as SGLang sizes it, its real ``SWATokenToKVPoolAllocator``
and a FULL+SWA radix tree). Only the model forward is simulated and writes no KV, so the test
sets the bytes: random bytes in every buffer before the requests run, zeros in every free page
after the retraction. A request that comes back with its old bytes in every region can only have
got them from the parked copy.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from adapter.core import boot
from adapter.switches.kv_park import engine as engine_mod
from adapter.switches.kv_park import regions

importlib.import_module("sglang.srt.managers.scheduler")
from devkit.testkit.scheduler import build_scheduler  # noqa: E402

PAGE = 256
WINDOW = 128


def _switch():
    return importlib.import_module("adapter.switches.kv_park.switch")


def _build():
    return build_scheduler(
        page_size=PAGE, pool_tokens=16 * PAGE, swa_pool_tokens=8 * PAGE, max_reqs=4, chunked_prefill_size=1024,
        sliding_window=WINDOW, dsv4=True,
    )


def _layouts(h):
    return regions.layouts_for(h.scheduler.token_to_kv_pool_allocator.get_kvcache())


def _randomize(h, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for layout in _layouts(h):
        for r in layout.regions:
            r.rows.copy_(torch.randint(0, 256, r.rows.shape, dtype=torch.uint8, generator=g))


def _region_bytes(layout, pages: torch.Tensor) -> list[torch.Tensor]:
    return [r.rows[pages].clone() for r in layout.regions]


def _pages(h, req, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(full page ids of the first ``n`` tokens, SWA page ids of the window pages before ``n``)."""
    s = h.scheduler
    slots = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()
    full = torch.div(slots[::PAGE], PAGE, rounding_mode="floor")
    window = s.token_to_kv_pool_allocator.full_to_swa_index_mapping[slots[n - WINDOW :]].long()
    assert bool((window != 0).all()), "the sliding window before the resume point is not live"
    return full, torch.div(window, PAGE, rounding_mode="floor").unique()


def _evict_tree_and_zero_free_pages(h) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h.scheduler.tree_cache.evict(EvictParams(num_tokens=1 << 30))
    _zero_free_pages(h)


def _zero_free_pages(h) -> None:
    """Other traffic overwrote every free page (the tree keeps what it holds)."""
    s = h.scheduler
    state = _switch().STATE
    if state is not None:
        state.store.fence()
    alloc = s.token_to_kv_pool_allocator
    full, swa = _layouts(h)
    for layout, side in ((full, alloc.full_attn_allocator), (swa, alloc.swa_attn_allocator)):
        free = side.get_all_free_pages().long()
        for r in layout.regions:
            r.rows[free] = 0


def test_a_deepseek_v4_pool_parks_exactly_the_regions_it_ships_to_pd_in_the_same_order():
    """Full-page side = ``get_contiguous_buf_infos`` (C4 KV, C4 indexer, C128 KV); SWA-page side =
    ``get_state_buf_infos`` (main cache, then the C4 attention and indexer compressor states)."""
    h = _build()
    pool = h.scheduler.token_to_kv_pool_allocator.get_kvcache()
    full, swa = regions.layouts_for(pool)
    for layout, (ptrs, _, items) in ((full, pool.get_contiguous_buf_infos()), (swa, pool.get_state_buf_infos())):
        assert [r.rows.data_ptr() for r in layout.regions] == ptrs
        assert [r.row_bytes for r in layout.regions] == items
    assert [r.name for r in full.regions] == ["c4_kv.0", "c4_kv.1", "c4_index.0", "c4_index.1", "c128_kv.0"]
    assert [r.name for r in swa.regions][4:] == ["c4_state.1", "c4_state.3", "c4_index_state.1", "c4_index_state.3"]
    # Every page id the allocator can hand out is inside every region (padding pages differ).
    assert full.num_pages > 16 and swa.num_pages > 8


def test_every_region_of_a_real_deepseek_v4_pool_survives_save_free_restore_into_other_pages():
    """Each region of both page-id spaces: pages saved, overwritten (freed and reused), restored
    into other pages; the restored rows equal the saved ones byte for byte."""
    h = _build()
    _randomize(h, seed=4)
    g = torch.Generator().manual_seed(9)
    for layout in _layouts(h):
        eng = engine_mod.CopyEngine(layout, chunk_bytes=max(1, layout.page_bytes * 3 // 2), stage=True)
        src = torch.randperm(layout.num_pages, generator=g)[:5]
        before = _region_bytes(layout, src)
        entry = eng.save(src)
        for r in layout.regions:
            r.rows[src] = 0  # freed and overwritten by other traffic
        dst = torch.randperm(layout.num_pages, generator=g)[:5]
        eng.restore(entry, dst)
        for r, old in zip(layout.regions, before):
            assert torch.equal(r.rows[dst], old), r.name


@pytest.mark.parametrize("parked", [True, False], ids=["parked", "stock"])
def test_a_retracted_deepseek_v4_request_resumes_with_every_region_byte_it_had(parked):
    """Retraction parks the row's whole full pages past what the tree holds (C4/C128 latents,
    indexer keys) and its window SWA pages (main cache and C4 compressor states): r1's second page
    (its first, the prompt's, stays in the tree), r2's first (its prompt is shorter than a page);
    re-admission is a prefix hit over them with the old bytes in every region. Stock re-prefills
    what the tree does not hold."""
    if parked:
        assert boot.install({"DSV41_KV_PARK": "ram"}).outcomes["kv_park"].status == "installed"
    h = _build()
    a = h.add_request(480, max_new_tokens=400)
    b = h.add_request(230, max_new_tokens=400)
    _randomize(h)
    h.run(40)
    committed = {r.rid: int(r.kv.kv_committed_len) for r in (a, b)}
    whole = {rid: n // PAGE * PAGE for rid, n in committed.items()}
    assert whole == {"r1": 2 * PAGE, "r2": PAGE}
    full, swa = _layouts(h)
    before = {}
    for r in (a, b):
        fp, sp = _pages(h, r, whole[r.rid])
        before[r.rid] = (_region_bytes(full, fp), _region_bytes(swa, sp))

    retracted = h.retract_all()
    assert {r.rid for r in retracted} == {"r1", "r2"}
    _zero_free_pages(h)
    step = h.step()
    assert step.kind == "prefill" and set(step.rids) == {"r1", "r2"}
    prefix = dict(zip(step.rids, step.prefix_lens))
    for r in (a, b):
        if not parked:
            assert prefix[r.rid] == whole[r.rid] - PAGE, "stock serves only the tree's prompt pages"
            continue
        assert prefix[r.rid] == whole[r.rid], "the parked pages were not found as a cached prefix"
        fp, sp = _pages(h, r, whole[r.rid])
        for layout, now_pages, then in ((full, fp, before[r.rid][0]), (swa, sp, before[r.rid][1])):
            for region, old in zip(layout.regions, then):
                assert torch.equal(region.rows[now_pages], old), f"{r.rid}: other bytes in {region.name}"
    if parked:
        stats = _switch().STATE.store.stats
        assert stats.restored == 4 and stats.failed == 0  # full + SWA entry per request
    h.run_until(lambda: a.finished() and b.finished(), max_passes=2000)
    _evict_tree_and_zero_free_pages(h)
    alloc = h.scheduler.token_to_kv_pool_allocator
    for side in (alloc.full_attn_allocator, alloc.swa_attn_allocator):
        assert side.available_size() == side.size, "pages leaked"


def test_the_unified_and_hisparse_deepseek_v4_layouts_are_refused_with_a_one_line_reason(monkeypatch):
    """Real pools of both layouts (the unified layout is HIP-only, so its platform check is forced
    to pass to build one on CPU); each refusal names why, and the retraction stays stock."""
    import sglang.srt.layers.attention.dsv4.unified_kv_gate as unified_kv_gate
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    _build()  # publishes the server args the pool reads
    kwargs = dict(
        max_num_reqs=4, swa_size=8 * PAGE, c4_size=4 * PAGE, c128_size=32, c4_state_pool_size=64,
        c128_state_pool_size=0, page_size=PAGE, swa_page_size=PAGE, dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64,
        indexer_head_dim=128, layer_num=4, device="cpu", enable_memory_saver=False,
        compression_ratios=[0, 4, 128, 4], sliding_window=WINDOW,
    )
    hisparse = DeepSeekV4TokenToKVPool(**kwargs, enable_hisparse=True)
    with pytest.raises(regions.Unsupported, match=r"^DeepSeek-V4 pool not parked: HiSparse C4 pool"):
        regions.layouts_for(hisparse)
    monkeypatch.setattr(unified_kv_gate, "is_unified_kv_triton", lambda: True)
    unified = DeepSeekV4TokenToKVPool(**{**kwargs, "dtype": torch.bfloat16})
    with pytest.raises(regions.Unsupported, match=r"^DeepSeek-V4 pool not parked: unified KV layout") as info:
        regions.layouts_for(unified)
    assert "\n" not in str(info.value)


def _crowd_until_a_pool_full_retraction(overlap: bool):
    """The server's crowd in-process: three 480-token prompts decoding on an 8-page pool; the third
    row needs a third page at 512 tokens and the full pool retracts one row (a page boundary)."""
    assert boot.install({"DSV41_KV_PARK": "ram"}).outcomes["kv_park"].status == "installed"
    h = build_scheduler(
        page_size=PAGE, pool_tokens=8 * PAGE, swa_pool_tokens=8 * PAGE, max_reqs=3, chunked_prefill_size=512,
        sliding_window=WINDOW, dsv4=True, overlap=overlap,
    )
    reqs = [h.add_request(480, max_new_tokens=64) for _ in range(3)]
    _randomize(h)
    full, swa = _layouts(h)
    before: dict[str, tuple] = {}
    for _ in range(400):
        h.step()
        for r in reqs:  # each row's first two pages, while it holds them (the forward writes no KV)
            if r.rid not in before and r.kv.holds_kv and int(r.kv.kv_committed_len) >= 2 * PAGE:
                fp, sp = _pages(h, r, 2 * PAGE)
                before[r.rid] = (_region_bytes(full, fp), _region_bytes(swa, sp))
        retracted = [r for r in reqs if r.retraction_count]
        if retracted:
            return h, reqs, retracted, before
    raise AssertionError("the 8-page pool never retracted a row")


def test_a_pool_full_retraction_at_a_page_boundary_restores_both_pages_under_the_normal_loop(records):
    """Normal loop: the retracted row's fill is one token past its KV, so the tree can serve all 512
    tokens: the prompt's page stayed in the tree, the second page is parked (one page, not the
    tree's too); the re-admission is a prefix hit at 512 with the old bytes in every region."""
    h, reqs, retracted, before = _crowd_until_a_pool_full_retraction(overlap=False)
    (req,) = retracted
    assert int(req.kv.kv_committed_len) == 0 and len(req.origin_input_ids) + len(req.output_ids) == 2 * PAGE + 1
    _zero_free_pages(h)
    for _ in range(50):
        step = h.step()
        if step.kind == "prefill" and req.rid in step.rids:
            break
    assert dict(zip(step.rids, step.prefix_lens))[req.rid] == 2 * PAGE, "the parked pages were not a cached prefix"
    full, swa = _layouts(h)
    fp, sp = _pages(h, req, 2 * PAGE)
    for layout, now_pages, then in ((full, fp, before[req.rid][0]), (swa, sp, before[req.rid][1])):
        for region, old in zip(layout.regions, then):
            assert torch.equal(region.rows[now_pages], old), f"other bytes in {region.name}"
    lines = [r.getMessage() for r in records if "kv_park" in r.getMessage()]
    assert any(f"kv_park parked rid={req.rid} pages=1 " in m for m in lines), lines
    assert any(f"kv_park restored rid={req.rid} pages=" in m and "tokens=512" in m for m in lines), lines
    h.run_until(lambda: all(r.finished() for r in reqs), max_passes=3000)


def test_under_the_overlap_loop_a_pool_full_retraction_parks_only_the_servable_page_and_says_why_it_drops(records):
    """Overlap loop (the server's): the in-flight token is dropped with the row, so its fill ends at
    its KV and the tree can serve only whole pages before the last token (256 of 512), which is the
    prompt's page the tree already holds: nothing is parked (no wasted copy; one ``not_parked
    reason=tree_holds_it`` line), and at the re-admission pass the tree's page is pinned until the
    admission takes it (``resumed_from_tree``)."""
    h, reqs, retracted, _ = _crowd_until_a_pool_full_retraction(overlap=True)
    (req,) = retracted
    assert len(req.origin_input_ids) + len(req.output_ids) == 2 * PAGE, "the fill ends at the retracted KV"
    steps = h.run_until(lambda: all(r.finished() for r in reqs), max_passes=3000)
    again = [dict(zip(s.rids, s.prefix_lens))[req.rid] for s in steps if s.kind == "prefill" and req.rid in s.rids]
    # The servable page (the tree's own) is kept until the re-admission takes it: one page, not zero.
    assert again[0] == PAGE, again
    h.finish_in_flight()
    lines = [r.getMessage() for r in records if "kv_park" in r.getMessage()]
    assert not any(f"kv_park parked rid={req.rid} " in m for m in lines), lines
    assert any(f"kv_park not_parked rid={req.rid} reason=tree_holds_it servable=256" in m for m in lines), lines
    assert any(f"kv_park resumed_from_tree rid={req.rid} tokens=256" in m for m in lines), lines
    stats = _switch().STATE.store.stats
    assert stats.restored == 0 and stats.queued + stats.sync_saves == 0


def test_a_pin_on_a_waiting_requests_pages_is_released_when_no_row_runs(records):
    """A pin keeps running rows' decode from evicting a waiting request's pages; with no row running
    nothing decodes, and a pin kept then could hold an idle engine's pool away from the request
    ahead of it in the queue: the next pass releases it (one DEBUG line), the pages evictable again."""
    assert boot.install({"DSV41_KV_PARK": "ram", "DSV41_DEBUG_LOG": "1"}).outcomes["kv_park"].status == "installed"
    sw = _switch()
    h = _build()
    done = h.add_request(3 * PAGE, max_new_tokens=4)
    h.run_until(done.finished, max_passes=200)
    h.finish_in_flight()
    h.run_until(h.scheduler.running_batch.is_empty, max_passes=5)  # the finished row leaves the batch
    tree = h.scheduler.tree_cache
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    prefix = list(done.origin_input_ids[: 2 * PAGE])
    waiting = h.add_request(2 * PAGE + 8, max_new_tokens=4, prompt_ids=prefix + [7] * 8)
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=waiting.origin_input_ids[: 2 * PAGE])))
    assert int(match.device_prefix_len) == 2 * PAGE
    evictable = tree.evictable_size()
    sw._pin(sw.STATE, waiting.rid, tree, match.last_device_node)
    assert tree.evictable_size() == evictable - 2 * PAGE, "the pin locks the waiting request's pages"
    assert h.scheduler.running_batch.is_empty() and waiting in h.scheduler.waiting_queue
    sw._release_pins(sw.STATE, h.scheduler)
    assert sw.STATE.pins == {} and tree.evictable_size() == evictable
    lines = [r.getMessage() for r in records if "kv_park unpinned" in r.getMessage()]
    assert lines and f"rid={waiting.rid} reason=no_running_rows" in lines[0], lines
