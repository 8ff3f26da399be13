"""Injected faults on the real SGLang scheduler (devkit.testkit.scheduler): a fault in a switch's
work must cost at most a recompute, never a request, a page or a hung scheduler.

Covered elsewhere and not repeated here: a kv_park copy that raises (the park catches it:
tests/upstream/test_kv_park_scheduler.py::test_a_failed_copy_disables_parking_with_one_line_and_the_request_recomputes;
the switch has no park worker that could die: copies are queued on the device by the scheduler thread),
a restore that fails after its pages are allocated
(::test_a_failed_restore_gives_its_pages_back_disables_parking_and_the_request_recomputes) and a
decode-yield prompt aborted through the harness's chunked-abort hook
(tests/upstream/test_decode_yield.py::test_aborting_the_chunked_prompt_mid_window_ends_the_window_at_once).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import types

import pytest

importlib.import_module("sglang.srt.managers.scheduler")
from devkit.testkit.scheduler import build_scheduler  # noqa: E402

PAGE = 16


def _kv_park():
    return importlib.import_module("adapter.switches.kv_park.switch")


def _harness(**kwargs):
    return build_scheduler(**{"page_size": PAGE, "pool_tokens": 1024, "max_reqs": 8, "chunked_prefill_size": 256,
                              **kwargs})


def _free_everything(h) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h.scheduler.tree_cache.evict(EvictParams(num_tokens=1 << 30))


def _bounded_step(h, timeout_s: float = 30.0):
    """One pass on a thread: a scheduler that hangs on a dead worker fails the test, not the run."""
    done: dict[str, object] = {}

    def run() -> None:
        try:
            done["step"] = h.step()
        except BaseException as exc:  # reported below
            done["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"the scheduler pass hung for {timeout_s:.0f} s (waiting on a dead park worker?)"
    if "error" in done:
        raise done["error"]  # type: ignore[misc]
    return done["step"]


# -- cone replay: the anchor between the replay's admission and the rest of the prompt ---------
CONE_N = 64  # page 16, window 8, 3 SWA layers: bound 48


def _cone_harness(overlap: bool):
    return build_scheduler(page_size=16, pool_tokens=1 << 15, max_reqs=16, chunked_prefill_size=CONE_N,
                           hybrid_swa=True, swa_pool_tokens=1024, sliding_window=8, overlap=overlap)


def _resume_point(cache, history: list[int]) -> tuple[int, bool]:
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(array("q", history[: len(history) // 16 * 16]))
    full, _, _ = cache.tree_core.match_full_device_prefix(key)
    f = full // 16 * 16
    return f, f >= 8 and bool(cache.tree_core.swa_tombstone_ranges(key, f - 8, f))


def _run_to_end(h, req) -> list[int]:
    h.add_request(req)
    h.run_until(req.finished, max_passes=10_000)
    h.drain()
    h.finish_in_flight()
    return list(req.origin_input_ids) + list(req.output_ids)


def _accounted(h) -> tuple[int, int]:
    """Full and SWA slots that are free, evictable or protected (a leak makes these shrink)."""
    a, c = h.scheduler.token_to_kv_pool_allocator, h.scheduler.tree_cache
    return (a.full_available_size() + c.full_evictable_size() + c.full_protected_size(),
            a.swa_available_size() + c.swa_evictable_size() + c.swa_protected_size())


def _cone_session(overlap: bool):
    """A session whose SWA window at F was evicted by churn (its Full KV of [0, F) resident)."""
    from devkit.testkit import cone_replay_parts as cone_replay
    from overlay_tools.simulate.cone_turn import install

    state = install(CONE_N)
    h = _cone_harness(overlap)
    assert state.outcomes["cone_replay"].status == "installed"
    baseline = _accounted(h)
    history = _run_to_end(h, h.make_request(400, max_new_tokens=16, prompt_ids=range(10, 410)))
    seed = 1000
    while not _resume_point(h.scheduler.tree_cache, history)[1]:
        seed += 1
        _run_to_end(h, h.make_request(512, max_new_tokens=16, seed=seed))
    F = _resume_point(h.scheduler.tree_cache, history)[0]
    cone_replay.reset_counters()
    return h, history, F, baseline


def _cone_in_flight(overlap: bool):
    """The session resumed with a prompt longer than one chunk: after one pass its replay chunk
    [F - N, F) ran and the rest of its prompt waits."""
    from devkit.testkit import cone_replay_parts as cone_replay

    h, history, F, baseline = _cone_session(overlap)
    req = h.add_request(h.make_request(0, max_new_tokens=8, prompt_ids=history + list(range(20_000, 20_160))))
    first = h.step()
    assert first.rids == (req.rid,) and (first.prefix_lens, first.extend_lens) == ((F - CONE_N,), (CONE_N,))
    assert cone_replay.COUNTERS.copies == 1 and h.scheduler.chunked_req is req
    return h, req, history, F, baseline


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_cone_request_aborted_after_its_replay_chunk_releases_its_anchor_and_leaks_nothing(overlap):
    """An abort arrives after the replay chunk was launched (``Scheduler.abort_request`` marks the
    chunked prompt ``_pending_chunked_abort_req``, as the harness's ``abort_chunked`` does; the
    real ``process_pending_chunked_abort`` runs it on the next pass); then other traffic evicts
    everything it can. The request ends aborted, the anchor's
    lock is gone (the whole tree is evictable again), the tree is sane and no slot leaked."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h, req, history, _, baseline = _cone_in_flight(overlap)
    assert h.abort_chunked() is req
    h.run_until(lambda: h.scheduler.chunked_req is None and req.finished(), max_passes=50)
    h.finish_in_flight()
    h.run(2)
    h.scheduler.tree_cache.evict(EvictParams(num_tokens=1 << 30))
    assert req.finished() and req.finished_reason is not None
    h.scheduler.tree_cache.sanity_check()
    assert h.scheduler.tree_cache.full_protected_size() == 0, "the aborted cone still holds a lock"
    assert _accounted(h) == baseline
    # The session comes back later: served (stock or cone), and still nothing leaked.
    again = _run_to_end(h, h.make_request(0, max_new_tokens=4, prompt_ids=history + list(range(30_000, 30_016))))
    assert len(again) == len(history) + 16 + 4
    h.scheduler.tree_cache.sanity_check()
    assert _accounted(h) == baseline


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_evicting_the_tree_between_the_replay_chunk_and_the_next_cannot_take_the_anchor(overlap):
    """Eviction pressure between the cone's chunks: the request's lock keeps [0, F) resident (the
    Full KV the replay read), the request finishes from where it was, and its next turn resumes
    at its own end; the tree is sane and nothing leaked."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h, req, history, F, baseline = _cone_in_flight(overlap)
    h.scheduler.tree_cache.evict(EvictParams(num_tokens=1 << 30))
    assert _resume_point(h.scheduler.tree_cache, history)[0] >= F, "eviction took the locked anchor's path"
    h.run_until(req.finished, max_passes=1000)
    h.drain()
    h.finish_in_flight()
    assert len(req.output_ids) == 8
    turn2 = list(req.origin_input_ids) + list(req.output_ids)
    nxt = h.add_request(h.make_request(0, max_new_tokens=4, prompt_ids=turn2 + list(range(40_000, 40_016))))
    step = h.step()
    assert step.rids[0] == nxt.rid and step.prefix_lens[0] == (len(turn2) - 1) // 16 * 16
    h.run_until(nxt.finished, max_passes=1000)
    h.drain()
    h.finish_in_flight()
    h.scheduler.tree_cache.sanity_check()
    assert _accounted(h) == baseline


@contextlib.contextmanager
def _one_prefill_per_pass():
    """``--prefill-max-requests 1`` (SGLang's own knob, set through its runtime-context override):
    the second request of a pass is matched (so planned) and then turned away by the PrefillAdder
    (``AddReqResult.OTHER``) before its admission is selected: it waits, planned, unlocked."""
    from sglang.srt.runtime_context import get_context, get_schedule

    before = get_schedule().prefill_max_requests
    get_context().override("tests: one prefill per pass", prefill_max_requests=1)
    try:
        yield
    finally:
        get_context().override("tests: restore", prefill_max_requests=before)


def _planned_but_waiting(overlap: bool):
    """One pass with a short request ahead of the resumed session: the session is planned (s, the
    anchor at F) but not admitted; nothing of it is locked."""
    from devkit.testkit import cone_replay_parts as cone_replay

    h, history, F, baseline = _cone_session(overlap)
    ahead = h.add_request(h.make_request(16, max_new_tokens=4, seed=7))
    req = h.add_request(h.make_request(0, max_new_tokens=8, prompt_ids=history + list(range(20_000, 20_160))))
    with _one_prefill_per_pass():
        first = h.step()
    assert first.rids == (ahead.rid,) and req in h.scheduler.waiting_queue
    plan = getattr(req, cone_replay.REQ_ATTR)
    assert (plan.state, plan.F, req.prefix_len) == (cone_replay.PLANNED, F, F - CONE_N)
    assert (cone_replay.COUNTERS.plans, cone_replay.COUNTERS.admitted) == (1, 0)
    return h, req, ahead, history, F, baseline


def _nothing_leaked(h, baseline) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h.scheduler.tree_cache.evict(EvictParams(num_tokens=1 << 30))
    h.scheduler.tree_cache.sanity_check()
    cache = h.scheduler.tree_cache
    assert (cache.full_protected_size(), cache.swa_protected_size()) == (0, 0), "a lock was left behind"
    assert _accounted(h) == baseline
    assert h.scheduler.token_to_kv_pool_allocator.full_available_size() == baseline[0]
    assert h.scheduler.token_to_kv_pool_allocator.swa_available_size() == baseline[1]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_waiting_cone_plan_whose_anchor_is_evicted_before_admission_is_dropped_and_the_request_runs_stock(overlap):
    """The plan is made at the match, the request is turned away for this pass, and before the
    next pass eviction takes the whole unlocked tree (the anchor's node and its Full KV). The next
    pass matches again: the stale plan is dropped, no replay and no copy run (the anchor's slots
    may be reused by then), the request prefills from 0 and finishes; nothing leaked."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from devkit.testkit import cone_replay_parts as cone_replay

    h, req, ahead, history, F, baseline = _planned_but_waiting(overlap)
    h.scheduler.tree_cache.evict(EvictParams(num_tokens=1 << 30))
    assert _resume_point(h.scheduler.tree_cache, history)[0] < F, "a waiting plan locked its anchor"
    steps = h.run_until(lambda: req.finished() and ahead.finished(), max_passes=1000)
    h.drain()
    h.finish_in_flight()
    assert getattr(req, cone_replay.REQ_ATTR) is None
    ran = [s for s in steps if s.kind == "prefill" and req.rid in s.rids]
    assert ran and ran[0].prefix_lens[ran[0].rids.index(req.rid)] == 0
    assert (cone_replay.COUNTERS.admitted, cone_replay.COUNTERS.copies, cone_replay.COUNTERS.forwards) == (0, 0, 0)
    assert len(req.output_ids) == 8 and len(ahead.output_ids) == 4
    _nothing_leaked(h, baseline)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_cone_request_aborted_while_it_waits_planned_leaves_the_queue_and_leaks_nothing(overlap):
    """``Scheduler.abort_request`` (the real one, with ``_release_aborted_request``) on a request
    planned but still in the waiting queue: it leaves the queue, its plan never admits, copies or
    locks anything, the anchor stays evictable, the request ahead finishes, and nothing leaked."""
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.scheduler import Scheduler

    from devkit.testkit import cone_replay_parts as cone_replay

    h, req, ahead, history, F, baseline = _planned_but_waiting(overlap)
    s = h.scheduler
    s.mm_receiver = None  # no EPD encoder: what Scheduler.__init__ sets on a language-only server
    s.enable_continuous_input_polling = False  # Scheduler.__init__'s value
    s.grammar_manager.abort_requests = lambda recv: None  # no grammar request is queued
    s._release_aborted_request = types.MethodType(Scheduler._release_aborted_request, s)  # the real one
    s.abort_request(AbortReq(rid=req.rid))
    assert req not in s.waiting_queue
    h.run_until(ahead.finished, max_passes=1000)
    h.drain()
    h.finish_in_flight()
    assert getattr(req, cone_replay.REQ_ATTR).state == cone_replay.PLANNED  # never went further
    assert (cone_replay.COUNTERS.admitted, cone_replay.COUNTERS.copies, cone_replay.COUNTERS.forwards) == (0, 0, 0)
    assert _resume_point(s.tree_cache, history)[0] >= F  # the session's prefix is still cached, unlocked
    _nothing_leaked(h, baseline)
    assert _resume_point(s.tree_cache, history)[0] == 0
