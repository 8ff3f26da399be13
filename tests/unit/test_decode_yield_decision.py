"""Decode yield's decision (adapter.switches.decode_yield.decision) and its clock, on their own:
facts in, window out; the balance a served cycle leaves; the samples the pass clock takes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from adapter import cost_model
from adapter.switches.decode_yield import clock
from adapter.switches.decode_yield.backlog import Arrivals
from adapter.switches.decode_yield.decision import Config, Facts, State, Waiting, abandoned, close, decide, final_span

MS = 1_000_000
PROMPT = "r7"
# a 10 ms chunk of 512 tokens, 2 ms steps alone, measured: the plain case the rows below change
BASE = Facts(t=0, prompt=PROMPT, tokens=512, floor=0, model=(10, 10), step_ns=2 * MS, per_token_ps=10 * MS * 1000 // 512)


@pytest.mark.parametrize(("why", "cfg", "facts", "n", "share", "cut"), [
    ("the share: 0.5 of 10 ms over 2 ms steps", Config(50), BASE, 5, 50, 0),
    ("pct 33: ceil(0.33 * 10 / (0.67 * 2))", Config(33), BASE, 3, 33, 0),
    ("the alternation is part of the window's wall time", Config(50), replace(BASE, alternation_ns=4 * MS), 3, 50, 0),
    ("the configured interval is a floor", Config(50), replace(BASE, floor=9), 9, 50, 0),
    ("the cap", Config(50, cap=3), BASE, 3, 50, 0),
    ("a mixed chunk's token counts for the streams", Config(50), replace(BASE, rode_along=1), 4, 50, 0),
    ("nothing measured: the cost model's window", Config(33), replace(BASE, step_ns=None, model=(30 * 10**9, 4 * 10**9)),
     cost_model.yield_steps(33, 30 * 10**9, 4 * 10**9), 33, 0),
    ("a step, no cycle: the model's ratio times the step (3 steps: 6 ms)", Config(50),
     replace(BASE, per_token_ps=None, model=(30, 10)), 3, 50, 0),
    ("a stale step alone: a one-step window becomes a probe of two", Config(20),
     replace(BASE, per_token_ps=4 * MS * 1000 // 512, fresh=False), 2, 20, 0),
    ("... of three in the overlap loop", Config(20), replace(BASE, per_token_ps=4 * MS * 1000 // 512, fresh=False,
                                                            need_run=3), 3, 20, 0),
    ("the guard: load 0.5 halves the share", Config(50), replace(BASE, load=500), 2, 25, 0),
    ("the guard: load at the prefill rate gives none (stock)", Config(50), replace(BASE, load=1000), 0, 0, 0),
    ("... but never below the configured interval", Config(50), replace(BASE, load=1200, floor=2), 2, 0, 0),
    ("the guard off (the gate's negative check)", Config(50, guard=False), replace(BASE, load=1000), 5, 50, 0),
    ("the bound: a prompt with room for 2 steps cuts the window to 2", Config(50),
     replace(BASE, waiting=(Waiting(wait_ns=8 * MS, lag_ns=2 * MS),)), 2, 50, 3),
    ("a prompt past its share: no window", Config(50), replace(BASE, waiting=(Waiting(10 * MS, 9 * MS),)), 0, 50, 5),
    ("... the configured interval still", Config(50), replace(BASE, floor=1, waiting=(Waiting(10 * MS, 9 * MS),)),
     1, 50, 4),
    ("the chunked prompt's rest counts in every waiting prompt's time", Config(50),
     replace(BASE, rest_ns=100 * MS, waiting=(Waiting(10 * MS, 9 * MS),)), 5, 50, 0),
    ("the tightest prompt decides", Config(50),
     replace(BASE, waiting=(Waiting(100 * MS, 0), Waiting(8 * MS, 2 * MS))), 2, 50, 3),
])
def test_facts_in_window_out(why, cfg, facts, n, share, cut):
    window, _ = decide(cfg, facts, State())
    assert (window.n, window.share, window.cut) == (n, share, cut), why


@pytest.mark.parametrize(("raw", "guard"), [(None, True), ("1", True), ("0", False), ("off", False)])
def test_the_load_guard_key_is_on_by_default_and_0_turns_it_off(raw, guard):
    from adapter.core import registry

    environ = {"DSV41_DECODE_YIELD": "33", **({"DSV41_DECODE_YIELD_LOAD_GUARD": raw} if raw else {})}
    config = registry.resolve(environ)
    assert not config.errors and config.values["DSV41_DECODE_YIELD_LOAD_GUARD"] is guard


def test_a_bad_load_guard_value_is_refused_naming_the_key_the_value_and_what_is_allowed():
    from adapter.core import registry

    errors = registry.resolve({"DSV41_DECODE_YIELD": "33", "DSV41_DECODE_YIELD_LOAD_GUARD": "maybe"}).errors
    assert len(errors) == 1 and "DSV41_DECODE_YIELD_LOAD_GUARD" in errors[0] and "'maybe'" in errors[0]
    assert "1/0" in errors[0]


def test_model_mode_is_the_cost_models_window_with_its_rounding_carried():
    cfg = Config(50, measured=False)
    facts = replace(BASE, model=(25, 10))  # a chunk of 2.5 steps
    window, state = decide(cfg, facts, State())
    assert window.n == 3 and window.source == "model_mode" and state.carry > 0
    assert decide(cfg, facts, state)[0].n == 2  # the half step the first gave beyond its share


def _served(cfg: Config, state: State, facts: Facts, chunk_ms: int, window_ms: int, step_ms: int = 2):
    """Decide, then close the cycle: the chunk took ``chunk_ms`` and the window ``window_ms``."""
    window, state = decide(cfg, facts, state)
    served, state = close(state, facts.t + (chunk_ms + window_ms) * MS, window.n, window_ms * MS, step_ms * MS,
                          facts.per_token_ps)
    return window, served, state


def test_a_served_cycle_gives_its_share_and_the_next_window_closes_the_balance():
    cfg = Config(50)
    facts = replace(BASE, per_token_ps=None, model=(10, 10))  # the model's ratio: one step, 2 ms
    window, served, state = _served(cfg, State(), facts, chunk_ms=10, window_ms=2)
    assert window.n == 1 and served.share == round(2 / 12, 4) and served.elapsed_ns - served.window_ns == 10 * MS
    assert (served.per_token_ps, served.alternation_ns) == (10 * MS * 1000 // 512, 0)
    # owed: 0.5 * 10 ms of the next chunk, plus the 0.5 * 10 - 0.5 * 2 ms the first cycle fell short
    assert decide(cfg, replace(BASE, t=12 * MS), state)[0].n == 5 + 4


def test_a_windows_whole_wall_time_is_what_it_gave_a_descheduled_step_and_the_alternation_included():
    """A window of 5 steps took 20 ms of wall time (one step descheduled, the first after the chunk
    slower): the prompts waited all of it, so the share counts all of it; the alternation sample is
    its wall time beyond 5 steps alone."""
    _, served, state = _served(Config(50), State(), BASE, chunk_ms=10, window_ms=20)
    assert served.window_ns == 20 * MS and served.share == round(20 / 30, 4) and served.alternation_ns == 10 * MS
    assert state.balance > 0 and decide(Config(50), replace(BASE, t=30 * MS), state)[0].n < 5  # repaid


def test_the_balance_is_bounded_by_one_cycles_overhead_and_a_probe_so_a_cap_runs_up_no_debt():
    cfg, state = Config(90, cap=4), State()  # pct 90 with a cap of 4 steps: every window short
    facts = replace(BASE, step_ns=MS, per_token_ps=10 * MS * 1000 // 512)
    for k in range(10):
        window, _, state = _served(cfg, state, replace(facts, t=k * 20 * MS), 10, 4, step_ms=1)
        assert window.n == 4
    assert -state.balance <= 90 * 10 * MS + 10 * 1 * MS * 2


def test_a_cycle_the_guard_or_the_bound_cut_leaves_no_debt():
    for facts in (replace(BASE, load=500), replace(BASE, waiting=(Waiting(10 * MS, 9 * MS),))):
        _, _, state = _served(Config(50), State(), facts, chunk_ms=10, window_ms=0)
        assert state.balance == 0


def test_a_window_that_was_not_served_resets_the_prompts_balance():
    _, _, state = _served(Config(50), State(), BASE, chunk_ms=30, window_ms=2)
    assert state.balance < 0 and abandoned(state) == State()


def test_a_new_prompt_starts_its_own_balance():
    _, _, state = _served(Config(50), State(), BASE, chunk_ms=30, window_ms=2)
    assert decide(Config(50), replace(BASE, prompt="r8"), state)[1].balance == 0


def test_the_final_chunks_share_is_paid_in_equal_parts_by_the_windows_of_the_last_quarter():
    """A prompt of 16 chunks (15 windows of 500 tokens, 10 ms each; the final chunk 300 tokens, 6 ms):
    the windows before the last quarter owe their own chunk only, the last three a third of the
    final chunk each (2 ms), at the measured overhead per token."""
    assert final_span(15) == 3 and final_span(93) == 22 and final_span(2) == 1
    cfg, state, t, overheads = Config(50), State(), 0, []
    facts = replace(BASE, tokens=500, step_ns=MS, per_token_ps=20 * MS, final_tokens=300)
    for left in range(15, 0, -1):
        window, state = decide(cfg, replace(facts, t=t, windows_left=left), state)
        overheads.append(window.overhead_ns)
        t += 10 * MS + window.n * MS
        _, state = close(state, t, window.n, window.n * MS, MS, 20 * MS)
    assert set(overheads[:12]) == {10 * MS} and overheads[12:] == [12 * MS] * 3
    assert state.final_paid == 300 * 1000


def _passes(pc: clock.PassClock, t: int, kinds: list[tuple[str, int]]) -> int:
    """Passes that run ``kinds`` ((decode|prefill|window, ns) each); returns the time after them."""
    for kind, took in kinds:
        pc.on_pass(t)
        pc.deferred = kind == "window"
        pc.ran(kind != "prefill", 512 if kind == "prefill" else 0)
        t += took
    pc.on_pass(t)
    return t


def test_only_a_decode_pass_after_a_decode_pass_is_a_step_alone():
    pc = clock.PassClock(overlap=False)
    _passes(pc, 0, [("prefill", 10 * MS), ("decode", 5 * MS)])  # the first step after a chunk: the alternation
    assert clock.median(pc.alone) is None and pc.step_ns() == 5 * MS and pc.per_token_ns() == 10 * MS // 512
    pc = clock.PassClock(overlap=False)
    _passes(pc, 0, [("prefill", 10 * MS), ("decode", 5 * MS), ("decode", 2 * MS)])
    assert pc.step_ns() == 2 * MS
    pc = clock.PassClock(overlap=True)  # three in a row in the overlap loop
    _passes(pc, 0, [("prefill", 10 * MS), ("decode", 5 * MS), ("decode", 2 * MS)])
    assert clock.median(pc.alone) is None


def test_the_step_is_a_median_so_one_descheduled_step_does_not_move_it():
    pc = clock.PassClock(overlap=False)
    _passes(pc, 0, [("decode", 2 * MS)] * 4 + [("decode", 40 * MS)])
    assert pc.step_ns() == 2 * MS


def test_a_stale_step_alone_gives_way_to_recent_decode_steps_and_a_probe_replaces_it():
    """Windows of one step give no step alone; after FRESH_CYCLES windows the recent decode steps
    (each the first after a chunk, 10 ms) stand in; a probe's step alone (8 ms) then replaces the
    stale samples at once, but a descheduled one (380 ms) only joins them."""
    def stale() -> tuple[clock.PassClock, int]:
        pc = clock.PassClock(overlap=False)
        t = _passes(pc, 0, [("decode", 2 * MS)] * 4)
        for _ in range(clock.FRESH_CYCLES + 1):
            pc.windows += 1
            t = _passes(pc, t, [("prefill", 50 * MS), ("window", 10 * MS)])
        return pc, t

    pc, t = stale()
    assert not pc.fresh() and pc.step_ns() == 10 * MS
    _passes(pc, t, [("window", 8 * MS)])  # the window's second step: a step alone
    assert pc.fresh() and pc.step_ns() == 8 * MS  # the probe's sample replaced the stale ones
    pc, t = stale()
    _passes(pc, t, [("window", 380 * MS)])
    assert pc.step_ns() == 2 * MS and len(pc.alone) == clock.SAMPLES  # joined the median


def _traffic(arrivals: Arrivals, t: int, seconds: float, rate: int, chunked_ms: int, window_ms: int,
             period_ms: int) -> int:
    """``seconds`` of 10 ms passes: each ``period_ms`` a prompt chunked for ``chunked_ms`` of chunks and
    ``window_ms`` of its windows' steps, then none; prompts arriving at ``rate`` a second throughout
    (counted by the meter only while one is chunked). Returns the time after them."""
    due = 0  # thousandths of a prompt
    for k in range(round(seconds * 100)):
        phase = k * 10 % period_ms
        due += rate * 10
        arrived, due = divmod(due, 1000)
        t += 10 * MS
        arrivals.passed(t, 10 * MS, phase < chunked_ms + window_ms, arrived)
    return t


def _kit_quarter_load(arrivals: Arrivals, t: int) -> int:
    # what the Mellum kit sees at a quarter of its stock capacity (the probe's window lines): prefill
    # 6 % of the wall time, windows a third of the time a prompt is chunked
    return _traffic(arrivals, t, 60, rate=60, chunked_ms=60, window_ms=30, period_ms=1000)


@pytest.mark.parametrize(("why", "traffic", "prompt_ms", "low", "high", "share"), [
    ("the seed: a lone long prompt chunked for a minute beside streams, nothing arriving: the whole share",
     lambda a, t: _traffic(a, t, 60, rate=0, chunked_ms=667, window_ms=333, period_ms=1000), 90, 0, 0, 33),
    ("a boot's first arrival is no saturation", lambda a, t: _traffic(a, t, 0.1, rate=10, chunked_ms=100,
                                                                     window_ms=0, period_ms=100), 90, 100, 200, 28),
    ("a quarter of the kit's capacity (prefill 6 % of the time): at most 6 %, not the 9 % its windows made of it",
     _kit_quarter_load, 1, 30, 60, 32),
    ("load 0.3 with windows a third of the chunked time: at most 0.3, not 1 / (1 - 1/3) of it",
     lambda a, t: _traffic(a, t, 60, rate=300, chunked_ms=300, window_ms=150, period_ms=1000), 1, 225, 300, 24),
    ("a saturated minute, then a minute at a quarter load: the burst is forgotten",
     lambda a, t: _kit_quarter_load(a, _traffic(a, t, 60, rate=1200, chunked_ms=1000, window_ms=0, period_ms=1000)),
     1, 30, 60, 32),
    ("saturation: prompts arrive faster than prefill serves them: none", lambda a, t: _traffic(
        a, t, 60, rate=1200, chunked_ms=1000, window_ms=0, period_ms=1000), 1, 1000, 1200, 0),
])
def test_the_load_guard_reads_the_rate_prefill_arrives_behind_a_chunked_prompt(why, traffic, prompt_ms, low, high,
                                                                             share):
    """Arrivals over the wall time a prompt was chunked (its windows included), times a prompt's
    prefill time, over the last seconds of wall time (shrunk by half a second of arrival-free time:
    at most the load); the window then gives ``pct x (1 - load)``."""
    arrivals = Arrivals()
    traffic(arrivals, 10**9)
    reading = arrivals.load(prompt_ms * MS)
    assert low <= reading <= high, (why, reading)
    assert decide(Config(33), replace(BASE, load=reading), State())[0].share == share, why
