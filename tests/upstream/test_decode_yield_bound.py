"""Decode yield's bound on the prompts (adapter/switches/decode_yield/decision.py's bound, backlog.py's ledger) on the real SGLang
scheduler (devkit.testkit.scheduler) with scripted wall times: a prompt waiting behind the chunked
one is not held beyond what the share allows it, the streams keep their share where the bound
allows it, a cut window leaves no debt, a backlog the share cannot serve says so, and a prompt that
arrives into a backlog the windows have lengthened keeps its bound or is counted."""

from __future__ import annotations

import functools
import importlib
import itertools

import pytest

from adapter.core import boot, receipts
from adapter.switches.decode_yield import clock as yield_clock
from devkit.bench.chat_scripted import Costs
from devkit.testkit.scheduler import ScriptedClock, build_scheduler

CHUNK = 64
LONG = 16 * CHUNK  # the long prompt: 16 chunks of 64
COSTS = Costs()  # a 64-token chunk 6.84 ms, a 2-row decode step 4.8 ms (the Mellum kit's shape)
ATTR = "_dsv41_decode_yield"


@pytest.fixture(autouse=True)
def _clock_restored(monkeypatch):
    monkeypatch.setattr(yield_clock, "now", yield_clock.now)



def _streams_decoding(pct: int | None):
    """A real scheduler on the scripted clock (decode yield at ``pct``, or stock) with two streams
    decoding, their step alone measured. Returns (harness, clock, streams)."""
    importlib.import_module("sglang.srt.managers.scheduler")
    if pct is not None:
        boot.install({"DSV41_DECODE_YIELD": str(pct), "DSV41_DEBUG_LOG": "1"})
    h = build_scheduler(page_size=1, pool_tokens=1 << 15, chunked_prefill_size=CHUNK, max_reqs=16)
    clock = ScriptedClock(COSTS)
    h.on_forward = clock.forward
    yield_clock.now = clock.now
    streams = [h.add_request(32, max_new_tokens=4000) for _ in range(2)]
    h.drain()
    h.run(8)
    return h, clock, streams


def _run(pct: int | None, arrive_after_chunks: int, check=None):
    """Two streams decode; a 16-chunk prompt prefills; a one-chunk prompt arrives after the long
    one's ``arrive_after_chunks``-th chunk. Returns (trace from the long prompt on, long, short,
    the short prompt's TTFT in ns, the clock)."""
    h, clock, streams = _streams_decoding(pct)
    long = h.add_request(LONG, max_new_tokens=2)
    start = len(h.trace)
    short = None
    arrived = ttft = None
    while short is None or not short.output_ids:
        step = h.step()
        if check is not None:
            check(h)
        if short is None and sum(1 for s in h.trace[start:] if s.kind == "prefill" and long.rid in s.rids) \
                == arrive_after_chunks:
            short = h.add_request(40, max_new_tokens=4)
            arrived = clock.t
        if short is not None and short.output_ids and ttft is None:
            ttft = clock.t - arrived
        assert step.kind != "idle"
        assert len(h.trace) - start < 2000
    assert all(not s.finished() for s in streams)
    return h.trace[start:], long, short, ttft, h


def _decodes_between(steps, begin, end):
    return sum(1 for s in steps[begin:end] if s.kind == "decode")


def test_a_prompt_arriving_behind_a_lagging_backlog_gets_no_window_the_share_would_not_allow(debug_lines):
    """At pct 50, after 12 of the long prompt's 16 chunks the windows have delayed it by about 12
    chunks' time; a one-chunk prompt that then arrives would, stock, wait only for the 4 chunks
    left. Every further window would hold it beyond 1 / (1 - pct) of that, so the bound cuts them:
    no decode step between the long prompt's chunks until it is served, a ``burst`` line says the
    share was cut, and the window lines carry ``cut``."""
    steps, long, _, _, _ = _run(50, 12)
    chunks = [i for i, s in enumerate(steps) if s.kind == "prefill" and long.rid in s.rids]
    assert len(chunks) == 16
    before = [_decodes_between(steps, a, b) for a, b in itertools.pairwise(chunks[:12])]
    after = [_decodes_between(steps, a, b) for a, b in itertools.pairwise(chunks[12:])]
    assert sum(before) >= 11  # the streams had their share while nobody else waited ...
    assert after == [0, 0, 0]  # ... and no window once the short prompt would be held past its bound
    bursts = [line for line in debug_lines if "decode_yield burst" in line]
    assert len(bursts) == 1 and "share=50" in bursts[0]
    cut = [receipts.parse_line(line) for line in debug_lines if " window " in line and "cut=" in line]
    assert cut and all(int(w.params["given"]) == 0 for w in cut)


def test_a_prompt_arriving_early_lets_the_streams_keep_their_share_and_keeps_its_own_bound():
    """The one-chunk prompt arrives after the long prompt's first chunk: behind 15 chunks it would
    wait stock, the windows the share asks for stay within its bound, so they go on (the bound
    does not cut what the share allows), and its TTFT is at most 1 / (1 - pct) of stock's plus
    one window."""
    steps, long, _, ttft, _ = _run(50, 1)
    _, _, _, stock_ttft, _ = _run(None, 1)
    boot.uninstall()
    chunks = [i for i, s in enumerate(steps) if s.kind == "prefill" and long.rid in s.rids]
    gaps = [_decodes_between(steps, a, b) for a, b in itertools.pairwise(chunks)]
    assert sum(gaps) >= 15  # about 1.4 steps a chunk at pct 50 (a chunk 6.84 ms, a step 4.8 ms)
    window_ns = max(gaps) * COSTS(steps[chunks[0] + 1])
    assert ttft <= stock_ttft / (1 - 0.50) + window_ns, (ttft, stock_ttft)


def test_a_window_cut_by_the_bound_leaves_no_debt_for_later_windows():
    """What the bound cut is not owed: the closed loop's balance never goes below zero after a cut
    window, so no later window repays the cut steps by holding the prompts longer."""
    seen = []

    def check(h):
        state = h.scheduler.__dict__.get(ATTR)
        if state is not None and state.open is None and state.observe.bursting:
            seen.append(state.state.balance)

    _run(50, 12, check)
    assert seen and min(seen) >= 0


def test_the_lag_is_forgotten_once_no_prompt_waits():
    """The lag is the backlog's: when the last prompt is served (nothing queued, nothing chunked)
    the next backlog starts with none, and the burst line may come again."""
    *_, h = _run(50, 12)
    h.run_until(lambda: h.scheduler.chunked_req is None and not h.scheduler.waiting_queue)
    h.run(2)
    state = h.scheduler.__dict__[ATTR]
    assert state.backlog.lag == 0 and not state.observe.bursting and not state.backlog.stamps


@pytest.mark.parametrize("pct", [None, 50])
def test_every_pass_a_prompt_waits_runs_the_policy_over_the_waiting_queue_windows_included(pct, monkeypatch):
    """A stock pass tries prefill while a prompt is chunked, and that runs the policy over the
    waiting queue (its order; the recency of the waiting prompts' cached prefixes). A pass a window
    defers runs it too: from the short prompt's arrival to its admission, every pass runs it once,
    stock and yield alike (else its prefix ages in the LRU through the windows)."""
    from sglang.srt.managers.schedule_policy import SchedulePolicy

    passes = 0
    arrived = None  # passes done when the short prompt arrived
    runs: list[int] = []  # per run with a prompt waiting: passes done before the pass that ran it
    calc_priority = SchedulePolicy.calc_priority

    @functools.wraps(calc_priority)  # the switch pins the original through it
    def counted(self, waiting_queue, *args, **kwargs):
        if waiting_queue:
            runs.append(passes)
        return calc_priority(self, waiting_queue, *args, **kwargs)

    def check(h):
        nonlocal passes, arrived
        passes += 1
        if arrived is None and h.scheduler.waiting_queue:  # added after the previous pass
            arrived = passes - 1

    monkeypatch.setattr(SchedulePolicy, "calc_priority", counted)
    steps, *_ = _run(pct, 4, check)
    deferred = sum(1 for s in steps[len(steps) - (passes - arrived):] if s.kind == "decode")
    assert (deferred > 0) == (pct is not None)  # yield: the windows' decode steps came while it waited
    assert [r for r in runs if r >= arrived] == list(range(arrived, passes))


def _run_at(pct: int | None, after_ms: int):
    """Two streams decode; a 16-chunk prompt prefills; a one-chunk prompt arrives ``after_ms`` of
    clock after it (the same moment with and without the switch: stock has then served more of
    the long prompt). Returns (trace from the long prompt on, long, the short prompt's TTFT in
    ns, the ledger's lag when it arrived, the trace index it arrived at, the harness); one pass
    runs after its first token."""
    h, clock, _ = _streams_decoding(pct)
    long = h.add_request(LONG, max_new_tokens=2)
    start, t0 = len(h.trace), clock.t
    short = arrived = lag = at = None
    while short is None or not short.output_ids:
        assert h.step().kind != "idle" and len(h.trace) - start < 2000
        if short is None and clock.t - t0 >= after_ms * 10**6:
            short, arrived, at = h.add_request(40, max_new_tokens=4), clock.t, len(h.trace) - start
            state = h.scheduler.__dict__.get(ATTR)
            lag = state.backlog.lag if state is not None else 0
    ttft = clock.t - arrived
    h.step()  # the pass after its first token: the ledger weighs the prompt it served
    return h.trace[start:], long, ttft, lag, at, h


def _against_stock(pct: int, after_ms: int):
    """(short's TTFT, its stock TTFT, one window in ns, the ledger's lag on its arrival, the decode
    steps between the long prompt's chunks after its arrival, the ledger)."""
    steps, long, ttft, lag, at, h = _run_at(pct, after_ms)
    boot.uninstall()
    stock_ttft = _run_at(None, after_ms)[2]
    chunks = [i for i, s in enumerate(steps) if s.kind == "prefill" and long.rid in s.rids]
    gaps = [_decodes_between(steps, a, b) for a, b in itertools.pairwise(chunks)]
    window_ns = max(gaps) * COSTS(steps[chunks[0] + 1])
    after = [_decodes_between(steps, a, b) for a, b in itertools.pairwise(chunks) if a >= at]
    return ttft, stock_ttft, window_ns, lag, after, h.scheduler.__dict__[ATTR].observe


@pytest.mark.parametrize("after_ms", [30, 50, 210])
def test_a_prompt_arriving_into_a_lagged_backlog_within_its_share_keeps_its_bound_uncounted(after_ms, debug_lines):
    """The windows have already delayed the long prompt when the short one arrives (a lag it
    finds), but the long prompt's rest ahead of it is long enough that the lag is within its
    share (at 210 ms it arrives in the last window: the lag it finds is that rest, not the
    ledger's): its TTFT stays within 1 / (1 - pct) of stock's plus one window, and nothing counts it."""
    ttft, stock_ttft, window_ns, lag, _, seen = _against_stock(50, after_ms)
    assert lag > 0  # it arrived into a backlog the windows had lengthened
    assert ttft <= stock_ttft / (1 - 0.50) + window_ns, (ttft, stock_ttft, window_ns)
    assert seen.unbounded == 0
    assert not [line for line in debug_lines if "decode_yield unbounded" in line]


@pytest.mark.parametrize("after_ms", [100, 150])
def test_a_prompt_that_inherits_more_lag_than_its_share_allows_is_counted_and_stops_the_windows(after_ms,
                                                                                            debug_lines):
    """Stock has almost served the long prompt when the short one arrives; with the switch about
    half of it is still ahead, a lag no window of the short prompt's own added (the engine admits
    one chunked prompt at a time, so it cannot go first). Its TTFT is past 1 / (1 - pct) of stock's
    plus one window: the ledger counts it (``unbounded`` line with its TTFT and lag, the metric's
    count), and no window is given while it waits, so the lag it pays is only what it found."""
    ttft, stock_ttft, window_ns, _, after, seen = _against_stock(50, after_ms)
    assert ttft > stock_ttft / (1 - 0.50) + window_ns, (ttft, stock_ttft, window_ns)
    assert seen.unbounded == 1
    lines = [receipts.parse_line(line) for line in debug_lines if "decode_yield unbounded" in line]
    assert len(lines) == 1 and lines[0].params["share"] == "50"
    assert abs(float(lines[0].params["ttft_ms"]) * 1e6 - ttft) <= 0.1e6  # stamped on the pass it arrived at
    assert float(lines[0].params["lag_ms"]) * 1e6 > 0.5 * ttft  # the lag it paid: past pct of its TTFT
    assert after and after == [0] * len(after)  # no window while it waits
