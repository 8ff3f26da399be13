"""Decode yield's closed loop on the real SGLang scheduler (devkit.testkit.scheduler) against scripted
wall times (``ScriptedClock``): what the loop measures is what the script says each batch cost, so
the share the streams got is known exactly and compared with the asked one.

The share of a cycle (a non-final chunk of the long prompt and the decode steps before the next
one) is what an operator measures: the streams' tokens at their rate alone (the scripted step, no
alternation cost) over the cycle's wall time."""

from __future__ import annotations

import pytest

from adapter.switches.decode_yield import clock as yield_clock
from adapter.switches.decode_yield import decision
from devkit.testkit.decode_yield_scripted import MODEL_10_2, MS, PROMPT_CHUNKS, Script, quarters
from devkit.testkit.decode_yield_scripted import run as _run
from devkit.testkit.decode_yield_scripted import share as _share

# the prompt's last windows, which also pay the final chunk's share (its own test)
LAST = decision.final_span(PROMPT_CHUNKS - 1)


@pytest.fixture(autouse=True)
def _clock_restored(monkeypatch):
    monkeypatch.setattr(yield_clock, "now", yield_clock.now)


def test_a_step_change_in_decode_cost_mid_prompt_is_followed():
    """Decode steps cost 2 ms, then 5 ms from chunk 20 on (a chunk 10 ms): the loop re-estimates the
    step and holds pct 50 on both sides; the open-loop model, right for the first half, is not, and
    only the prompts' bound stops it."""
    def script() -> Script:
        return Script(lambda k: 10 * MS, lambda k: 2 * MS if k < 20 else 5 * MS)

    found = _run(50, script())
    before, after = found[:20], found[22:-LAST]
    assert abs(_share(before) - 0.50) <= 0.03 and abs(_share(after) - 0.50) <= 0.03
    assert {c[1] for c in before[3:]} == {5} and {c[1] for c in after[1:]} == {2}
    # the change lands in window 20, planned at 5 steps of 2 ms that then take 5 ms (0.71 of its
    # cycle): the next window repays what it gave beyond the share
    assert found[20][1] == 5 and found[21][1] == 0
    # the open-loop model with the first half's costs (chunk 10 ms, step 2 ms): 0.71 once the step is 5 ms,
    # until the long prompt's own lag reaches pct of its time: then the prompts' bound cuts its windows
    # (bound.py), so the prompt is not held past its bound and the streams get only the lag it allows
    model = _run(50, script(), mode="model", env=MODEL_10_2)
    assert abs(_share(model[2:20]) - 0.50) <= 0.03 and _share(model[22:26]) > 0.65
    assert [c[1] for c in model[-8:]] == [0] * 8 and _share(model[20:]) < 0.6


def test_a_slow_chunk_is_repaid_by_the_next_window_and_no_more():
    """Chunk 10 costs 4x the others: the next window gives the streams what that cycle owed them,
    the prompt's share stays at pct, and the windows after it are back to the steady length."""
    found = _run(33, Script(lambda k: 40 * MS if k == 10 else 10 * MS, lambda k: 2 * MS))
    steady = [c[1] for c in found[3:10]]
    assert set(steady) == {2, 3}  # 0.33 * 10 / (0.67 * 2) = 2.46 steps a window
    assert found[10][3] / found[10][2] < 0.15  # the slow cycle: the streams fell behind ...
    assert found[11][1] >= 3 + 6  # ... and the next window repaid it at once
    assert set(c[1] for c in found[12:-LAST]) == {2, 3}  # then the steady windows again: no debt left over
    assert abs(_share(found[3:-LAST]) - 0.33) <= 0.01


def test_rounding_is_carried_so_the_share_does_not_drift():
    """Chunk 10 ms, step 4 ms, pct 50: 2.5 steps a window. Windows alternate 2 and 3, and after every
    window the streams are within one step of their share (rounding each window up would give 3
    every time: 0.545)."""
    found = _run(50, Script(lambda k: 10 * MS, lambda k: 4 * MS))
    # the first window runs on the model's ratio and the next two repay its error
    measured = found[3:-LAST]
    assert {c[1] for c in measured} == {2, 3}
    assert sum(c[1] for c in measured) / len(measured) == pytest.approx(2.5, abs=0.05)
    got = owed = 0
    for c in measured:
        got, owed = got + c[3], owed + 0.5 * c[2]
        assert abs(got - owed) <= 4 * MS
    assert abs(_share(measured) - 0.50) <= 0.01


def _window_share(found, chunk_ns):
    """The windows' whole wall time (the streams' steps and the alternation) over the cycles'."""
    return sum(c[2] - chunk_ns for c in found) / sum(c[2] for c in found)


def test_the_alternation_is_charged_to_the_window_so_the_prompt_pays_no_more_than_its_share():
    """The first step after a chunk costs 3 ms more than a step alone: a window's whole wall time is
    what the waiting prompts pay, so the loop holds that at pct (0.5 of the wall time) and the
    streams' own steps get the rest (0.36); the model with the forward costs alone gives the
    windows more than their share."""
    def script() -> Script:
        return Script(lambda k: 10 * MS, lambda k: 2 * MS, switch=3 * MS)

    found = _run(50, script())[3:]
    assert abs(_window_share(found, 10 * MS) - 0.50) <= 0.01
    assert 0.33 <= _share(found) <= 0.40  # the streams' steps at their rate alone: less than pct
    model = _run(50, script(), mode="model", env=MODEL_10_2)
    assert _window_share(model[2:12], 10 * MS) > 0.55  # 5 steps of 2 ms and 3 ms against 10 ms: 0.57


def test_a_chunk_that_grows_with_its_prefix_keeps_the_share_in_every_quarter():
    """The prompt's last chunks cost twice its first (a growing context): the share holds in every
    quarter of the prompt, where a fixed interval matching the overall share gives the early
    quarters more and the late ones less."""
    def script() -> Script:
        return Script(lambda k: int(10 * MS * (1 + k / (PROMPT_CHUNKS - 1))), lambda k: 2 * MS)

    by_quarter = quarters(_run(33, script(), final=True)[1:])
    assert all(abs(q - 0.33) <= 0.03 for q in by_quarter), by_quarter
    # stock with --prefill-decode-interval 4: 4 steps of 2 ms against a 10 .. 20 ms chunk, 0.44 .. 0.29
    k_quarters = quarters(_run(None, script(), interval=4, final=True)[1:])
    assert k_quarters[0] - k_quarters[3] > 0.08  # a fixed K does not follow the growing chunk


@pytest.mark.parametrize("pct", [20, 33])
def test_a_low_share_with_a_cheap_chunk_holds_its_share_over_windows_of_zero_or_one_step(pct):
    """The Mellum kit's regime at a low pct: a chunk costs about 1.5 steps and the first step after
    it 1.5 ms more, so the share asks for a step every two to four chunks. The loop carries the
    fraction of a step a one-step window gave beyond the share (not clamped away), and keeps its
    step alone fresh with an occasional two-step window, so the windows' share of the wall time
    holds over the prompt."""
    found = _run(pct, Script(lambda k: 3 * MS, lambda k: 2 * MS, switch=int(1.5 * MS)), final=True)[3:]
    assert {c[1] for c in found} <= {0, 1, 2} and 2 in {c[1] for c in found}
    assert abs(_window_share(found[:-1], 3 * MS) - pct / 100) <= 0.02, _window_share(found[:-1], 3 * MS)


def test_the_windows_of_the_last_quarter_also_give_the_streams_their_share_of_the_final_chunk():
    """No window follows the prompt's final chunk (its first token does): the windows of the prompt's
    last quarter give the streams their share of it in equal parts, so the share holds over the
    whole prefill, final chunk included (without it: 0.493 here, 0.5 less about half a chunk's
    share over 40 chunks), and in the last quarter too, with no window planned several chunks long."""
    found = _run(50, Script(lambda k: 10 * MS, lambda k: 4 * MS), final=True)[3:]
    steady, last = found[:-LAST - 1], found[-LAST - 1:-1]
    assert {c[1] for c in steady} == {2, 3} and max(c[1] for c in last) <= 3  # 2.5 steps a chunk ...
    assert sum(c[1] for c in last) == pytest.approx(2.5 * LAST + 2.5, abs=1)  # ... and 2.5 more for the final one
    assert abs(_share(found) - 0.50) <= 0.004, _share(found)
    assert abs(quarters(found)[3] - 0.50) <= 0.01, quarters(found)


def test_no_window_gives_fewer_steps_than_the_configured_interval():
    """pct 20 with --prefill-decode-interval 6: every window is planned at the floor of 6 (the share
    asks for about 3), and its re-planned rest, which would end it at once, is held to the floor."""
    found = _run(20, Script(lambda k: 10 * MS, lambda k: 1 * MS), interval=6)
    assert {c[1] for c in found} == {6}
