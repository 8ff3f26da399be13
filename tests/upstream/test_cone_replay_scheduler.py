"""Cone replay through a real ``Scheduler`` (``devkit.testkit.scheduler``, hybrid SWA pools): the
switch's plan runs in the real match, its admission rule in the real ``PrefillAdder`` selection,
its copy in the real ``ScheduleBatch.prepare_for_extend``; the forward is simulated."""

from __future__ import annotations

from array import array

import pytest

from devkit.testkit import cone_replay_parts as cone_replay
from devkit.testkit import scheduler as harness
from overlay_tools.simulate.cone_turn import install

N = 64  # page 16, window 8, 3 SWA layers: bound 48


def _harness(chunk: int, overlap: bool, page: int = 16):
    from devkit.testkit.scheduler import build_scheduler

    return build_scheduler(page_size=page, pool_tokens=1 << 15, max_reqs=16, chunked_prefill_size=chunk,
                           hybrid_swa=True, swa_pool_tokens=1024, sliding_window=8, overlap=overlap)


def _resume_point(cache, history: list[int], page: int, window: int) -> tuple[int, bool]:
    """(F, lost): F = the page-aligned end of the resident Full KV; lost when F's window has holes."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(array("q", history[: len(history) // page * page]))
    full, _, _ = cache.tree_core.match_full_device_prefix(key)
    f = full // page * page
    return f, bool(cache.tree_core.swa_tombstone_ranges(key, f - window, f))


def _run(h, req):
    h.add_request(req)
    h.run_until(req.finished, max_passes=10_000)
    h.drain()
    h.finish_in_flight()
    return list(req.origin_input_ids) + list(req.output_ids)


def _leak(h) -> tuple[int, int]:
    a, c = h.scheduler.token_to_kv_pool_allocator, h.scheduler.tree_cache
    return (a.full_available_size() + c.full_evictable_size() + c.full_protected_size(),
            a.swa_available_size() + c.swa_evictable_size() + c.swa_protected_size())


def _lose_a(h):
    a_hist = _run(h, h.make_request(400, max_new_tokens=16, prompt_ids=range(10, 410)))
    seed = 1000
    while not _resume_point(h.scheduler.tree_cache, a_hist, 16, 8)[1]:
        seed += 1
        _run(h, h.make_request(512, max_new_tokens=16, seed=seed))
    return a_hist, _resume_point(h.scheduler.tree_cache, a_hist, 16, 8)[0]


@pytest.mark.parametrize("chunk,cone,overlap", [(N, True, False), (N - 16, False, False), (N, True, True)])
def test_scheduler_replays_n_tokens_when_the_chunk_covers_the_cone_else_falls_back(chunk, cone, overlap, monkeypatch):
    # Where the engine builds each forward (ForwardBatch.init_new), the switch finds the batch's
    # replay rows: record them on the real ScheduleBatch the scheduler launches.
    found = []

    def forward(batch):
        rows = cone_replay.replay_rows(batch)
        if rows is not None:
            found.append((list(batch.reqs), list(batch.extend_lens), *rows))
        return simulated(batch)

    simulated = harness.simulated_forward
    monkeypatch.setattr(harness, "simulated_forward", forward)
    state = install(N)
    h = _harness(chunk, overlap)
    assert state.outcomes["cone_replay"].status == "installed"
    cfg = cone_replay.cache_config(h.scheduler.tree_cache)
    assert cfg.enabled and cfg.bound == 48
    baseline = _leak(h)
    a_hist, F = _lose_a(h)
    assert F > N
    cone_replay.reset_counters()
    a2 = h.make_request(0, max_new_tokens=16, prompt_ids=a_hist + list(range(20_000, 20_064)))
    start = len(h.trace)
    a2_hist = _run(h, a2)
    first = next(s for s in h.trace[start:] if a2.rid in s.rids)
    i = first.rids.index(a2.rid)
    c = cone_replay.COUNTERS
    if cone:
        assert (first.prefix_lens[i], first.extend_lens[i]) == (F - N, N)
        assert (c.plans, c.admitted, c.copies, c.copied_pages, c.fallbacks) == (1, 1, 1, N // 16, 0)
        # One forward carries the replay rows: a2's first N rows in the batch's token order, reading
        # the tree's pages of [F - N, F) (the pages its own row pointed at before the checkpoint).
        [(reqs, extend_lens, rows, slots)] = found
        j = [r.rid for r in reqs].index(a2.rid)
        start = sum(extend_lens[:j])
        assert rows.tolist() == list(range(start, start + N))
        tree = h.scheduler.tree_cache.path_device_indices(getattr(a2, cone_replay.REQ_ATTR).anchor)[F - N : F]
        assert slots.tolist() == tree.tolist()
        assert getattr(a2, cone_replay.REQ_ATTR).state == cone_replay.FORWARDED and cone_replay.LIVE.copied == 0
    else:
        assert found == []
        assert first.prefix_lens[i] == 0 and first.extend_lens[i] == chunk
        assert c.plans >= 1 and c.copies == 0 and cone_replay.FALLBACKS == {"first_chunk_short": 1}
    # The next turn resumes at its own end, the tree is sane and nothing leaked.
    a3 = h.make_request(0, max_new_tokens=4, prompt_ids=a2_hist + list(range(30_000, 30_016)))
    start = len(h.trace)
    _run(h, a3)
    first = next(s for s in h.trace[start:] if a3.rid in s.rids)
    # (the last output token has no KV yet: the finished insert ends a token short of the history)
    assert first.prefix_lens[first.rids.index(a3.rid)] == (len(a2_hist) - 1) // 16 * 16
    h.scheduler.tree_cache.sanity_check()
    assert _leak(h) == baseline


@pytest.mark.parametrize("overlap", [False, True])
def test_a_short_first_chunk_falls_back_to_the_stock_admission_so_a_tight_swa_pool_waits_instead_of_running_out(
        overlap):
    """The crash of a fleet worker (``alloc_token_slots``: Out of memory, from ``prepare_for_extend``),
    on a real Scheduler at page 1, window 8, chunk 48 < N: the stock match P keeps its SWA window
    (8 tokens, unlocked: evictable), the resume point F lost its own. With 44 SWA tokens free, the
    fallback's first chunk from P budgets (48 - 8) + 8 + 1 = 49 SWA tokens; admitted under the pin on
    F's node, the budget saw 44 + 8 = 52, then the commit locked P's node (its window protected) and
    the batch found 44 of the 48 it allocates. Stock pins P's node while it selects: 44 < 49, the
    request waits, and runs from P once SWA frees up."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    install(N)
    h = _harness(N - 16, overlap, page=1)
    cache, allocator = h.scheduler.tree_cache, h.scheduler.token_to_kv_pool_allocator
    baseline = _leak(h)
    a_hist = _run(h, h.make_request(0, max_new_tokens=16, prompt_ids=range(10, 410)))
    # While another request's match holds P's node (a checkpoint of A's chunks), every other SWA
    # window is evicted: A's resume point loses its window, P keeps its own, evictable once let go.
    P = 336
    holder = h.make_request(0, max_new_tokens=1, prompt_ids=[*a_hist[:P], 5])
    holder.init_next_round_input(cache)
    assert holder.prefix_len == P
    lock = cache.lock(holder.last_node)
    cache.evict(EvictParams(num_tokens=0, swa_num_tokens=1 << 20))
    cache.unlock(lock)
    assert cache.swa_evictable_size() == 8  # P's window, nothing else
    others = allocator.alloc(allocator.swa_available_size() - 44)  # the running traffic's SWA
    assert allocator.swa_available_size() == 44
    cone_replay.reset_counters()
    a2 = h.add_request(h.make_request(0, max_new_tokens=16, prompt_ids=a_hist + list(range(20_000, 20_064))))
    start = len(h.trace)
    waited = h.run(3)  # Out of memory here without the fallback's stock admission
    assert [step.kind for step in waited] == ["idle"] * 3
    assert cone_replay.FALLBACKS == {"first_chunk_short": 3} and cone_replay.COUNTERS.admitted == 0
    assert (allocator.swa_available_size(), cache.swa_evictable_size()) == (44, 8)  # nothing locked
    allocator.free(others)
    h.run_until(a2.finished, max_passes=10_000)
    h.drain()
    h.finish_in_flight()
    first = next(step for step in h.trace[start:] if a2.rid in step.rids)
    i = first.rids.index(a2.rid)
    assert (first.prefix_lens[i], first.extend_lens[i]) == (P, N - 16)
    cache.sanity_check()
    assert _leak(h) == baseline


@pytest.mark.parametrize("overlap", [False, True])
def test_a_first_chunk_cut_short_by_a_request_before_it_in_the_pass_waits_one_pass_and_replays_n(overlap):
    """A fresh 40-token prompt admitted first leaves 24 of the pass's 64 chunk tokens: the cone's
    first chunk [s, F) needs 64, so the request waits (nothing committed, no fallback) and the next
    pass replays N from s instead of recomputing from the stock match."""
    install(N)
    h = _harness(N, overlap)
    baseline = _leak(h)
    a_hist, F = _lose_a(h)
    cone_replay.reset_counters()
    other = h.add_request(h.make_request(40, max_new_tokens=4, seed=77))
    a2 = h.add_request(h.make_request(0, max_new_tokens=16, prompt_ids=a_hist + list(range(20_000, 20_064))))
    start = len(h.trace)
    h.run_until(a2.finished, max_passes=10_000)
    h.drain()
    h.finish_in_flight()
    steps = [s for s in h.trace[start:] if s.rids]
    assert other.rid in steps[0].rids and a2.rid not in steps[0].rids  # waited while the other ran
    first = next(s for s in steps if a2.rid in s.rids)
    assert (first.prefix_lens[first.rids.index(a2.rid)], first.extend_lens[first.rids.index(a2.rid)]) == (F - N, N)
    c = cone_replay.COUNTERS
    assert (c.waits, c.admitted, c.copies, c.fallbacks) == (1, 1, 1, 0) and cone_replay.FALLBACKS == {}
    h.scheduler.tree_cache.sanity_check()
    assert _leak(h) == baseline


def test_a_cone_waits_for_a_whole_chunk_only_once_then_falls_back_to_the_stock_match():
    install(N)
    h = _harness(N, False)
    baseline = _leak(h)
    a_hist, F = _lose_a(h)
    cone_replay.reset_counters()
    h.add_request(h.make_request(40, max_new_tokens=4, seed=77))
    a2 = h.add_request(h.make_request(0, max_new_tokens=16, prompt_ids=a_hist + list(range(20_000, 20_064))))
    h.step()  # a2 waits behind the first
    h.scheduler.waiting_queue.insert(0, h.make_request(40, max_new_tokens=4, seed=78))  # ahead of it again
    start = len(h.trace)
    h.run_until(a2.finished, max_passes=10_000)
    h.drain()
    h.finish_in_flight()
    first = next(s for s in h.trace[start:] if a2.rid in s.rids)
    assert first.prefix_lens[first.rids.index(a2.rid)] < F - N  # the stock match's point, not s
    c = cone_replay.COUNTERS
    assert (c.waits, c.admitted, c.copies) == (1, 0, 0) and cone_replay.FALLBACKS == {"first_chunk_short": 1}
    h.scheduler.tree_cache.sanity_check()
    assert _leak(h) == baseline
