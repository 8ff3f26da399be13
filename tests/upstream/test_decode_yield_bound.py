"""Decode yield's bound on the prompts (adapter/switches/decode_yield/bound.py) on the real SGLang
scheduler (devkit.testkit.scheduler) with scripted wall times: a prompt waiting behind the chunked
one is not held beyond what the share allows it, the streams keep their share where the bound
allows it, a cut window leaves no debt, and a backlog the share cannot serve says so."""

from __future__ import annotations

import importlib
import itertools

import pytest

from adapter.core import boot, receipts
from adapter.switches.decode_yield import controller
from devkit.bench.chat_scripted import Costs
from devkit.testkit.scheduler import ScriptedClock, build_scheduler

CHUNK = 64
LONG = 16 * CHUNK  # the long prompt: 16 chunks of 64
COSTS = Costs()  # a 64-token chunk 6.84 ms, a 2-row decode step 4.8 ms (the Mellum kit's shape)
ATTR = "_dsv41_decode_yield"


@pytest.fixture(autouse=True)
def _clock_restored(monkeypatch):
    monkeypatch.setattr(controller, "now", controller.now)



def _run(pct: int | None, arrive_after_chunks: int, check=None):
    """Two streams decode; a 16-chunk prompt prefills; a one-chunk prompt arrives after the long
    one's ``arrive_after_chunks``-th chunk. Returns (trace from the long prompt on, long, short,
    the short prompt's TTFT in ns, the clock)."""
    importlib.import_module("sglang.srt.managers.scheduler")
    if pct is not None:
        boot.install({"DSV41_DECODE_YIELD": str(pct), "DSV41_DEBUG_LOG": "1"})
    h = build_scheduler(page_size=1, pool_tokens=1 << 15, chunked_prefill_size=CHUNK, max_reqs=16)
    clock = ScriptedClock(COSTS)
    h.on_forward = clock.forward
    controller.now = clock.now
    streams = [h.add_request(32, max_new_tokens=4000) for _ in range(2)]
    h.drain()
    h.run(8)  # the streams' step alone is measured
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
        if state is not None and state.window is None and state.bound.bursting:
            seen.append(state.ctl.balance)

    _run(50, 12, check)
    assert seen and min(seen) >= 0


def test_the_lag_is_forgotten_once_no_prompt_waits():
    """The lag is the backlog's: when the last prompt is served (nothing queued, nothing chunked)
    the next backlog starts with none, and the burst line may come again."""
    *_, h = _run(50, 12)
    h.run_until(lambda: h.scheduler.chunked_req is None and not h.scheduler.waiting_queue)
    h.run(2)
    bound = h.scheduler.__dict__[ATTR].bound
    assert bound.lag == 0 and not bound.bursting and not bound.stamps
