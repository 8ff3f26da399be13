"""Decode yield's closed loop on the real SGLang scheduler (devkit.testkit.scheduler) against scripted
wall times (``ScriptedClock``): what the loop measures is what the script says each batch cost, so
the share the streams got is known exactly and compared with the asked one.

The share of a cycle (a non-final chunk of the long prompt and the decode steps before the next
one) is what an operator measures: the streams' tokens at their rate alone (the scripted step, no
alternation cost) over the cycle's wall time."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import pytest

from adapter.core import boot, receipts
from adapter.switches.decode_yield import controller
from devkit.testkit.scheduler import ScriptedClock, Step, build_scheduler

SCHED = "sglang.srt.managers.scheduler"
CHUNK, PROMPT_CHUNKS, STREAMS = 512, 40, 4
MS = 1_000_000
# the open-loop model's coefficients for a 10 ms chunk and a 2 ms step, whatever the rows and prefix
MODEL_10_2 = {"DSV41_DECODE_YIELD_CHUNK_US": "10000", "DSV41_DECODE_YIELD_TOKEN_NS": "0",
              "DSV41_DECODE_YIELD_PAIR_FS": "0", "DSV41_DECODE_YIELD_TOPK": "0", "DSV41_DECODE_YIELD_STEP_US": "2000",
              "DSV41_DECODE_YIELD_ROW_NS": "0", "DSV41_DECODE_YIELD_KV_PS": "0"}


@pytest.fixture(autouse=True)
def _clock_restored(monkeypatch):
    monkeypatch.setattr(controller, "now", controller.now)


def _install(pct: int, **extra: str) -> None:
    importlib.import_module(SCHED)
    state = boot.install({"DSV41_DECODE_YIELD": str(pct), **extra})
    assert state.outcomes["decode_yield"].status == "installed"


class Script:
    """Scripted wall times: chunk ``k`` of the long prompt costs ``chunk(k)``, a decode step while the
    prompt's chunk ``k`` is the last one run costs ``step(k)``, plus ``switch`` when it follows a
    chunk (the alternation). Other prefills (the streams' own) cost 1 ms."""

    def __init__(self, chunk: Callable[[int], int], step: Callable[[int], int], switch: int = 0):
        self.chunk_ns, self.step_ns, self.switch = chunk, step, switch
        self.long_rid: str | None = None
        self.chunks = 0
        self.after_chunk = False

    def __call__(self, s: Step) -> int:
        if s.kind == "prefill":
            self.after_chunk = self.long_rid in s.rids
            if not self.after_chunk:
                return MS
            self.chunks += 1
            return self.chunk_ns(self.chunks - 1)
        cost = self.step_ns(max(self.chunks - 1, 0)) + (self.switch if self.after_chunk else 0)
        self.after_chunk = False
        return cost


def _run(pct: int, script: Script, *, mode: str = "measured", interval: int = 0, debug: list[str] | None = None,
         env: dict[str, str] | None = None):
    """Streams decode, then the long prompt prefills in ``PROMPT_CHUNKS`` chunks; the cycles as
    ``(chunk index, decode steps, wall ns, streams' reference ns)``."""
    boot.uninstall()
    _install(pct, DSV41_DECODE_YIELD_MODE=mode, **(env or {}))
    h = build_scheduler(page_size=64, pool_tokens=1 << 18, chunked_prefill_size=CHUNK, max_reqs=16,
                        prefill_decode_interval=interval)
    clock = ScriptedClock(script)
    h.on_forward = clock.forward
    controller.now = clock.now
    for _ in range(STREAMS):
        h.add_request(1000, max_new_tokens=100_000)
    h.drain()
    h.run(4)
    long = h.add_request(CHUNK * PROMPT_CHUNKS, max_new_tokens=2)
    script.long_rid = long.rid
    if debug is not None:
        debug.clear()
    start = len(h.trace)
    h.run_until(long.finished, max_passes=50_000)
    return _cycles(h.trace[start:], long.rid, script)


def _cycles(steps: list[Step], rid: str, script: Script) -> list[tuple[int, int, int, int]]:
    replay = Script(script.chunk_ns, script.step_ns, script.switch)
    replay.long_rid = rid
    cycles: list[list[int]] = []
    for s in steps:
        cost = replay(s)
        if s.kind == "prefill" and rid in s.rids:
            cycles.append([replay.chunks - 1, 0, cost, 0])
        elif s.kind == "decode" and cycles:
            cycles[-1][1] += 1
            cycles[-1][2] += cost
            cycles[-1][3] += script.step_ns(replay.chunks - 1)
    return [tuple(c) for c in cycles[:-1]]  # the final chunk arms no window: not a cycle


def _share(cycles) -> float:
    return sum(c[3] for c in cycles) / sum(c[2] for c in cycles)


def _quarters(cycles) -> list[float]:
    q = len(cycles) // 4
    return [round(_share(cycles[i * q:(i + 1) * q]), 4) for i in range(4)]


def test_a_step_change_in_decode_cost_mid_prompt_is_followed():
    """Decode steps cost 2 ms, then 5 ms from chunk 20 on (a chunk 10 ms): the loop re-estimates the
    step and holds pct 50 on both sides; the open-loop model, right for the first half, is not."""
    def script() -> Script:
        return Script(lambda k: 10 * MS, lambda k: 2 * MS if k < 20 else 5 * MS)

    cycles = _run(50, script())
    before, after = cycles[:20], cycles[22:]
    assert abs(_share(before) - 0.50) <= 0.03 and abs(_share(after) - 0.50) <= 0.03
    assert {c[1] for c in before[3:]} == {5} and {c[1] for c in after} == {2}
    assert cycles[21][1] == 0  # the 5 ms steps of the window before gave more than the share: repaid
    # the open-loop model with the first half's costs (chunk 10 ms, step 2 ms): 0.71 once the step is 5 ms
    model = _run(50, script(), mode="model", env=MODEL_10_2)
    assert abs(_share(model[2:20]) - 0.50) <= 0.03 and _share(model[22:]) > 0.65


def test_a_slow_chunk_is_repaid_by_the_next_window_and_no_more():
    """Chunk 10 costs 4x the others: the next window gives the streams what that cycle owed them,
    the prompt's share stays at pct, and the windows after it are back to the steady length."""
    cycles = _run(33, Script(lambda k: 40 * MS if k == 10 else 10 * MS, lambda k: 2 * MS))
    steady = [c[1] for c in cycles[3:10]]
    assert set(steady) == {2, 3}  # 0.33 * 10 / (0.67 * 2) = 2.46 steps a window
    assert cycles[10][3] / cycles[10][2] < 0.15  # the slow cycle: the streams fell behind ...
    assert cycles[11][1] >= 3 + 6  # ... and the next window repaid it at once
    assert set(c[1] for c in cycles[12:]) == {2, 3}  # then the steady windows again: no debt left over
    assert abs(_share(cycles[3:]) - 0.33) <= 0.01


def test_rounding_is_carried_so_the_share_does_not_drift():
    """Chunk 10 ms, step 4 ms, pct 50: 2.5 steps a window. Windows alternate 2 and 3, and after every
    window the streams are within one step of their share (rounding each window up would give 3
    every time: 0.545)."""
    cycles = _run(50, Script(lambda k: 10 * MS, lambda k: 4 * MS))
    measured = cycles[3:]  # the first window runs on the model's ratio; the next two repay its error
    assert {c[1] for c in measured} == {2, 3}
    assert sum(c[1] for c in measured) / len(measured) == pytest.approx(2.5, abs=0.05)
    got = owed = 0
    for c in measured:
        got, owed = got + c[3], owed + 0.5 * c[2]
        assert abs(got - owed) <= 4 * MS
    assert abs(_share(measured) - 0.50) <= 0.01


def test_the_alternation_cost_is_charged_to_the_prompt_not_to_the_streams():
    """The first step after a chunk costs 3 ms more than a step alone: the loop counts the streams'
    tokens at the step alone, so the share at their rate holds; the model with the forward costs
    only falls short."""
    def script() -> Script:
        return Script(lambda k: 10 * MS, lambda k: 2 * MS, switch=3 * MS)

    assert abs(_share(_run(50, script())[2:]) - 0.50) <= 0.03
    model = _run(50, script(), mode="model", env=MODEL_10_2)
    assert _share(model[2:]) < 0.45  # 5 steps of 2 ms against 10 ms + 3 ms: 0.43


def test_a_chunk_that_grows_with_its_prefix_keeps_the_share_in_every_quarter():
    """The prompt's last chunks cost twice its first (a growing context): the share holds in every
    quarter of the prompt, where a fixed interval matching the overall share gives the early
    quarters more and the late ones less."""
    def script() -> Script:
        return Script(lambda k: int(10 * MS * (1 + k / (PROMPT_CHUNKS - 1))), lambda k: 2 * MS)

    quarters = _quarters(_run(33, script())[1:])
    assert all(abs(q - 0.33) <= 0.03 for q in quarters), quarters
    boot.uninstall()  # stock with --prefill-decode-interval 4
    importlib.import_module(SCHED)
    h = build_scheduler(page_size=64, pool_tokens=1 << 18, chunked_prefill_size=CHUNK, max_reqs=16,
                        prefill_decode_interval=4)  # 4 steps of 2 ms against 10..20 ms: 0.44 .. 0.29
    clock = ScriptedClock(fixed := script())
    h.on_forward = clock.forward
    for _ in range(STREAMS):
        h.add_request(1000, max_new_tokens=100_000)
    h.drain()
    long = h.add_request(CHUNK * PROMPT_CHUNKS, max_new_tokens=2)
    fixed.long_rid = long.rid
    start = len(h.trace)
    h.run_until(long.finished, max_passes=50_000)
    k_quarters = _quarters(_cycles(h.trace[start:], long.rid, fixed)[1:])
    assert k_quarters[0] - k_quarters[3] > 0.08  # a fixed K does not follow the growing chunk


def test_one_debug_line_per_window_names_mode_target_measured_share_and_n():
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = receipts.logger()
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        cycles = _run(33, Script(lambda k: 10 * MS, lambda k: 2 * MS), debug=lines)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    windows = [receipts.parse_line(line).params for line in lines if " window " in line]
    assert len(windows) == len(cycles)
    assert all(w["mode"] == "measured" and w["target"] == "33" for w in windows)
    assert [w["source"] for w in windows[:2]] == ["model_ratio", "measured"]
    assert {w["source"] for w in windows[1:]} == {"measured"}
    assert [int(w["n"]) for w in windows] == [c[1] for c in cycles]
    for w, c in zip(windows, cycles):  # the share the line reports is the cycle's, from the same costs
        assert float(w["share"]) == pytest.approx(c[3] / c[2], abs=0.001)
        assert float(w["step_us"]) == 2000.0
    assert abs(float(windows[-1]["prompt_share"]) - 0.33) <= 0.02
