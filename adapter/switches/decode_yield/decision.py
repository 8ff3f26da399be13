"""Decode yield's decision, pure: :func:`decide` (facts in, window and state out) once per non-final
chunk, :func:`close` when the next chunk runs. A window is three limits, in this order (reasoning in
docs/switches/decode_yield.md): the load guard, the share (measured mode: the smallest ``N`` whose whole
wall time brings the prompt's balance back to zero; model mode: the cost model's ``N``), the bound."""

from __future__ import annotations

from dataclasses import dataclass, replace

from adapter import cost_model


@dataclass(frozen=True)
class Config:
    pct: int
    cap: int = cost_model.MAX_YIELD_STEPS
    measured: bool = True  # the closed loop (False: the open-loop cost model)
    guard: bool = True  # DSV41_DECODE_YIELD_LOAD_GUARD (a diagnostic: 0 turns it off)


@dataclass(frozen=True)
class Waiting:  # a prompt waiting for its first token (the chunked one included)
    wait_ns: int  # since first seen waiting
    lag_ns: int  # the lag it paid: found on arrival, plus every window's wall time since


@dataclass(frozen=True)
class Facts:  # what one arming pass knows: a non-final chunk runs now, decode rows wait for the next
    t: int
    prompt: str  # the chunked prompt's rid: a new one starts its own balance
    tokens: int  # prefill tokens this pass runs (the chunk's and any prompt's admitted beside it)
    floor: int  # the configured interval (what the engine's own arm wrote)
    model: tuple[int, int]  # the cost model's (chunk + switch, step) fs at this window
    rode_along: int = 0  # --enable-mixed-chunk: the rows decoded one token inside the chunk
    final_tokens: int = 0  # the prompt's final chunk, ``windows_left`` windows from now (1: next)
    windows_left: int = 1
    step_ns: int | None = None  # the streams' step alone (or a recent decode step when not fresh)
    fresh: bool = True
    need_run: int = 2  # decode steps a window needs to hold a step alone (a probe's length)
    per_token_ps: int | None = None  # a cycle's overhead per chunk token (measured)
    alternation_ns: int = 0  # what a window costs beyond its steps alone (measured)
    rest_ns: int = 0  # the chunked prompt's prefill still to run, this chunk's included, at stock rate
    waiting: tuple[Waiting, ...] = ()
    load: int | None = None  # permille: prefill arriving behind a chunked prompt over the prefill rate


@dataclass(frozen=True)
class Cycle:  # a chunk (the facts it was armed on) and its window, until the next chunk runs
    facts: Facts
    final_part: int  # ns of the final chunk's overhead this cycle owes the share of
    share: int  # the share this window was planned for (after the guard)
    forgive: bool = False  # the guard or the bound gave less than the share: no debt after it


@dataclass(frozen=True)
class State:  # one scheduler's: the prompt's balance, across its windows
    prompt: str = ""
    balance: int = 0  # ns scaled by 100: sum((100-share)*streams - share*overhead) over served cycles
    windows: int | None = None  # the prompt's windows, counted at its first
    final_paid: int = 0  # thousandths of the final chunk's tokens its windows owed so far
    carry: int = 0  # model mode: the rounding surplus of the prompt's earlier windows
    cycle: Cycle | None = None
    windows_ns: int = 0  # the prompt's served cycles: its windows' wall time and the whole
    elapsed_ns: int = 0


@dataclass(frozen=True)
class Window:
    n: int  # steps to give (before the TP broadcast)
    share: int  # the share planned (pct, or less under the guard)
    source: str  # measured | model_ratio | model (nothing measured) | model_mode
    overhead_ns: int | None = None
    cut: int = 0  # steps the bound cut


@dataclass(frozen=True)
class Served:  # a closed cycle, as the ``window`` line reports it, and the clock's samples from it
    elapsed_ns: int
    window_ns: int  # the window's wall time, whole: the streams' steps and the alternation
    share: float
    prompt_share: float
    per_token_ps: int  # the cycle's overhead per chunk token
    alternation_ns: int | None  # the window's wall time beyond its steps alone (None: no step given)


def final_span(windows: int) -> int:
    """A prompt's last windows that pay its final chunk's share (no window follows it): its last quarter."""
    return max(1, (windows + 1) // 4 - 1)


def decide(cfg: Config, facts: Facts, state: State) -> tuple[Window, State]:
    if facts.prompt != state.prompt:
        state = State(prompt=facts.prompt)
    share = cfg.pct
    if cfg.guard and facts.load is not None:  # the guard: pct * (1 - load), whole percents, nearest
        share = (cfg.pct * (1000 - min(max(facts.load, 0), 1000)) + 500) // 1000
    # the cost model's window: model mode's, and the closed loop's until a step is measured (the carry: model mode's)
    n, carry = cost_model.yield_window(share, *facts.model, facts.floor, state.carry, cfg.cap,
                                       facts.rode_along) if share else (facts.floor, 0)
    if cfg.measured:
        window, state = _closed_loop(cfg, facts, state, share, n)
    else:
        window, state = Window(n, share, "model_mode"), replace(state, carry=carry)
    if facts.step_ns and facts.waiting:  # the bound: the most steps no waiting prompt's bound forbids
        room = min(cfg.pct * (w.wait_ns + facts.rest_ns) - 100 * w.lag_ns for w in facts.waiting)
        bound = 0 if room <= 0 else -(-room // ((100 - cfg.pct) * facts.step_ns))
        cut = window.n - max(facts.floor, bound) if bound < window.n else 0
        window = replace(window, n=window.n - cut, cut=cut)
    if state.cycle is not None and (window.cut or share < cfg.pct):  # reduced: it leaves no debt
        state = replace(state, cycle=replace(state.cycle, forgive=True))
    return window, state


def _closed_loop(cfg: Config, facts: Facts, state: State, share: int, model_n: int) -> tuple[Window, State]:
    windows = state.windows or facts.windows_left
    extra = 0  # this window's part of the final chunk, in thousandths of a token
    if facts.final_tokens and facts.windows_left <= final_span(windows):
        extra = (facts.final_tokens * 1000 - state.final_paid) // max(facts.windows_left, 1)
    state = replace(state, windows=windows, final_paid=state.final_paid + extra)
    step, per_token, (chunk_fs, step_fs) = facts.step_ns, facts.per_token_ps, facts.model
    if step is None:  # nothing measured: the cost model's window
        return Window(model_n, share, "model"), replace(state, cycle=Cycle(facts, 0, share))
    if per_token is None:  # a step but no cycle yet: the model's chunk-to-step ratio
        overhead, source = step * chunk_fs // max(step_fs, 1), "model_ratio"
        final_part = overhead * extra // max(facts.tokens * 1000, 1)
    else:
        overhead, source = per_token * facts.tokens // 1000, "measured"
        final_part = per_token * extra // 1_000_000
    overhead += final_part
    rest = 100 - share
    owed = share * overhead - state.balance - rest * facts.rode_along * step
    # a window of n steps takes n steps and the alternation: the smallest n whose wall time pays what is owed
    need = max(1, -(-(owed - rest * facts.alternation_ns) // (rest * step))) if share and owed > 0 else 0
    if 0 < need < facts.need_run and not facts.fresh:
        need = facts.need_run  # a probe: its last step is a fresh step alone; the balance repays it
    n = max(facts.floor, min(cfg.cap, need))
    return Window(n, share, source, overhead), replace(state, cycle=Cycle(facts, final_part, share))


def close(state: State, t: int, given: int, window_ns: int, step_ns: int | None, per_token_ps: int | None,
          need_run: int = 2) -> tuple[Served | None, State]:
    """The cycle ends at ``t`` after ``given`` steps of ``window_ns``, whole (None: nothing to close)."""
    cycle, state = state.cycle, replace(state, cycle=None)
    if cycle is None or step_ns is None or t <= cycle.facts.t:
        return None, state
    elapsed = t - cycle.facts.t
    alternation = max(0, window_ns - given * step_ns) if given else None
    window_ns += cycle.facts.rode_along * step_ns  # a mixed chunk's token: the streams' step inside the chunk
    overhead = max(0, elapsed - window_ns)  # the chunk: what the window's share is owed on
    sampled = overhead * 1000 // max(cycle.facts.tokens, 1)
    s = cycle.share
    balance = state.balance + (100 - s) * window_ns - s * (overhead + cycle.final_part)
    # one cycle's overhead plus a probe's steps either way: a floor, a cap or a spike runs up no debt
    # or credit that later windows would pay for minutes; rounding and a probe are carried in full
    typical = max(overhead, (per_token_ps or sampled) * cycle.facts.tokens // 1000)
    limit = s * (typical + cycle.final_part) + (100 - s) * step_ns * need_run
    balance = max(-limit, min(limit, balance))
    if cycle.forgive:
        balance = max(0, balance)
    state = replace(state, balance=balance, windows_ns=state.windows_ns + window_ns,
                    elapsed_ns=state.elapsed_ns + elapsed)
    return Served(elapsed, window_ns, round(window_ns / elapsed, 4), round(state.windows_ns / state.elapsed_ns, 4),
                  sampled, alternation), state


def abandoned(state: State) -> State:
    """A window that did not give what it planned is no cycle: the prompt's balance starts over."""
    return State()
