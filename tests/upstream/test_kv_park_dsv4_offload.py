"""SGLang's own DSV4 retraction offload with ``DSV41_KV_PARK`` set (sglang#33385), on the real
scheduler, ``Req``, ``SWATokenToKVPoolAllocator`` and ``DeepSeekV4TokenToKVPool`` (CPU).

``Req.offload_kv_cache`` / ``load_kv_cache`` (what the PD decode node's ``cpu_tensor`` retraction
backup calls) reach the pool's ``get_cpu_copy`` / ``load_cpu_copy``; stock raises
``NotImplementedError`` there and marks the pool as needing a rebootstrap. With the switch the copy
engine serves both, and the round trip puts back every byte of every region: the full-page
regions (C4 / C128 latents, C4 index keys), the SWA window pages with their compressor state rings,
and the request-scoped state rings."""

from __future__ import annotations

import importlib

import pytest
import torch

from adapter.core import boot
from adapter.switches.kv_park import regions

importlib.import_module("sglang.srt.managers.scheduler")
from devkit.testkit.scheduler import build_scheduler  # noqa: E402

PAGE = 256
WINDOW = 128


def _build():
    return build_scheduler(
        page_size=PAGE, pool_tokens=16 * PAGE, swa_pool_tokens=8 * PAGE, max_reqs=4, chunked_prefill_size=1024,
        sliding_window=WINDOW, dsv4=True,
    )


def _pool(h):
    return h.scheduler.token_to_kv_pool_allocator.get_kvcache()


def _states(pool):
    return [s for s in list(pool.compress_state_pools) + list(pool.indexer_compress_state_pools)
            if s is not None and s.request_scoped]


def _randomize(h, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    pool = _pool(h)
    for layout in regions.layouts_for(pool):
        for r in layout.regions:
            r.rows.copy_(torch.randint(0, 256, r.rows.shape, dtype=torch.uint8, generator=g))
    for s in _states(pool):
        raw = s.kv_score_buffer.kv_score.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def _zero(h) -> None:
    pool = _pool(h)
    for layout in regions.layouts_for(pool):
        for r in layout.regions:
            r.rows.zero_()
    for s in _states(pool):
        s.kv_score_buffer.kv_score.view(torch.uint8).zero_()


def _snapshot(h, slots: torch.Tensor, req_pool_idx: int, swa_from: int) -> list[torch.Tensor]:
    """Every byte a request's first ``len(slots)`` tokens own: full pages, SWA pages from
    ``swa_from``, its request-scoped state rings."""
    pool = _pool(h)
    full, swa = regions.layouts_for(pool)
    full_pages = torch.div(slots[::PAGE], PAGE, rounding_mode="floor")
    swa_slots = pool.translate_loc_from_full_to_swa(slots[swa_from:]).long()
    swa_pages = torch.div(swa_slots[::PAGE], PAGE, rounding_mode="floor")
    out = [r.rows[full_pages].clone() for r in full.regions] + [r.rows[swa_pages].clone() for r in swa.regions]
    for s in _states(pool):
        ring = int(s.ring_size)
        out.append(s.kv_score_buffer.kv_score[req_pool_idx * ring : (req_pool_idx + 1) * ring].view(torch.uint8).clone())
    return out


def _slots(h, req, n: int) -> torch.Tensor:
    return h.scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()


def _two_rows(h):
    a = h.add_request(600, max_new_tokens=200)
    b = h.add_request(600, max_new_tokens=200)  # same length: b's window is at a's positions
    h.run(8)
    _randomize(h)
    return a, b


def test_without_the_switch_the_dsv4_pool_has_no_cpu_copy_and_needs_a_rebootstrap():
    from sglang.srt.mem_cache.common import dsv4_needs_rebootstrap

    h = _build()
    a, _ = _two_rows(h)
    alloc = h.scheduler.token_to_kv_pool_allocator
    assert dsv4_needs_rebootstrap(alloc) is True
    with pytest.raises(NotImplementedError):
        a.offload_kv_cache(h.scheduler.req_to_token_pool, alloc)


def test_with_the_switch_offload_and_load_kv_cache_round_trip_every_region_of_the_dsv4_pool():
    boot.install({"DSV41_KV_PARK": "ram"})
    from sglang.srt.disaggregation import decode
    from sglang.srt.mem_cache import common

    h = _build()
    a, _ = _two_rows(h)
    s = h.scheduler
    alloc = s.token_to_kv_pool_allocator
    assert common.dsv4_needs_rebootstrap(alloc) is False and decode.dsv4_needs_rebootstrap(alloc) is False
    n = a.seqlen - 1  # what offload_kv_cache saves
    slots = _slots(h, a, n)
    assert n % PAGE, "the row ends inside a page: the partial last page and the pending C128 ring travel too"
    a.offload_kv_cache(s.req_to_token_pool, alloc)
    backup = a.kv.retraction_backup.cpu_tensors
    assert backup.tokens == n and backup.swa is not None and backup.swa_from <= n - WINDOW
    before = _snapshot(h, slots, int(a.kv.req_pool_idx), backup.swa_from)
    _zero(h)
    assert not all(torch.equal(x, y) for x, y in zip(_snapshot(h, slots, int(a.kv.req_pool_idx), backup.swa_from), before, strict=True))
    a.load_kv_cache(s.req_to_token_pool, alloc)
    after = _snapshot(h, slots, int(a.kv.req_pool_idx), backup.swa_from)
    for i, (x, y) in enumerate(zip(after, before, strict=True)):
        assert torch.equal(x, y), f"region {i} differs after load_kv_cache"
    assert a.kv.retraction_backup is None


def test_a_dsv4_backup_loads_into_other_slots_and_another_request_slot_byte_for_byte():
    boot.install({"DSV41_KV_PARK": "ram"})
    h = _build()
    a, b = _two_rows(h)
    pool = _pool(h)
    alloc = h.scheduler.token_to_kv_pool_allocator
    n = a.seqlen - 1
    src = _slots(h, a, n)
    dst = _slots(h, b, n)  # b's first n positions: other pages, other SWA pages, another ring
    assert not torch.equal(torch.div(src, PAGE, rounding_mode="floor"), torch.div(dst, PAGE, rounding_mode="floor"))
    backup = alloc.get_cpu_copy(src, req_pool_index=int(a.kv.req_pool_idx))
    before = _snapshot(h, src, int(a.kv.req_pool_idx), backup.swa_from)
    _zero(h)
    alloc.load_cpu_copy(backup, dst, req_pool_index=int(b.kv.req_pool_idx))
    after = _snapshot(h, dst, int(b.kv.req_pool_idx), backup.swa_from)
    for i, (x, y) in enumerate(zip(after, before, strict=True)):
        assert torch.equal(x, y), f"region {i} differs at the new slots"
    assert type(pool).__name__ == "DeepSeekV4TokenToKVPool"


def test_a_load_into_slots_of_another_length_is_refused_with_both_lengths():
    boot.install({"DSV41_KV_PARK": "ram"})
    h = _build()
    a, b = _two_rows(h)
    alloc = h.scheduler.token_to_kv_pool_allocator
    backup = alloc.get_cpu_copy(_slots(h, a, a.seqlen - 1), req_pool_index=int(a.kv.req_pool_idx))
    with pytest.raises(ValueError, match=rf"{a.seqlen} slots of page {PAGE} for a backup of {a.seqlen - 1} tokens"):
        alloc.load_cpu_copy(backup, _slots(h, b, a.seqlen), req_pool_index=int(b.kv.req_pool_idx))
