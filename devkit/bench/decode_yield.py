"""``python -m adapter bench decode-yield [--quick]``: decode yield on the real scheduler (CPU).

A long prompt arrives while streams decode; the real ``Scheduler`` (devkit.testkit.scheduler)
schedules it in 8192-token chunks on a page-64 pool, with the switch off (pct 0, stock) and on.
Per row: decode steps between chunks (min/mean/max); the modelled decode share while the prompt
prefills, from its first chunk to the end of its final chunk (the span a client times as the
prompt's TTFT, over which the switch holds the share: no window follows the final chunk, so the
windows before it pay the final chunk's part): cost of the decode steps / (that + cost of all the
prompt's chunks), costs from :mod:`adapter.cost_model` defaults; the modelled
TTFT factor of the long prompt (the same span, against the stock run of the same row); whether the 128-step cap
bound a window; idle passes; streams retracted (pool pressure; 0 means the pool was sized right).

Overhead: the wrappers' cost per scheduler pass, measured A/B interleaved in one run: the same
trace (``--prefill-decode-interval 1`` and pct 1, so the switch arms every window and the
decisions equal stock's) with the wrappers swapped in on even passes and out on odd ones; the
figure is median(wrapped) - median(unwrapped) of ``get_next_batch_to_run`` per pass.

The harness's forwards take the cost model's time (a ``ScriptedClock``), which the switch's closed
loop measures (its default mode), so the modelled share is the measured one. Then the controller
against scripted costs (:mod:`devkit.testkit.decode_yield_scripted`): a step change in the decode
cost mid-prompt, a slow chunk, an alternation cost, a chunk that doubles over the prompt; the share
per quarter of the prompt, closed loop beside the open-loop model fitted to the scenario's start.
"""

from __future__ import annotations

import copy
import importlib
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from adapter import cost_model
from adapter.core import boot
from adapter.ops import table

CHUNK, PAGE, STREAM_PROMPT = 8192, 64, 4000
FULL = {"prompts": (65536, 262144, 1048576), "streams": (1, 4, 16, 64), "pcts": (0, 33, 50)}
QUICK = {"prompts": (262144,), "streams": (4, 16), "pcts": (0, 33, 50)}
SCHEDULER = "sglang.srt.managers.scheduler"


def _install(pct: int) -> None:
    boot.uninstall()
    if pct:
        importlib.import_module(SCHEDULER)
        state = boot.install({"DSV41_DECODE_YIELD": str(pct)})  # the module is imported: installs now
        outcome = state.outcomes["decode_yield"]
        if outcome.status != "installed":
            raise RuntimeError(f"decode_yield did not install: {outcome.reason}")


def _pool_tokens(prompt: int, streams: int, pct: int) -> int:
    chunks = -(-prompt // CHUNK)
    worst = cost_model.chunk_cost([(CHUNK, prompt)])
    n = cost_model.yield_steps(pct, worst, cost_model.step_cost([STREAM_PROMPT] * streams)) if pct else 1
    growth = n * chunks + 2 * CHUNK
    return prompt + 2 * CHUNK + streams * (STREAM_PROMPT + PAGE + growth)


@dataclass
class PromptTimes:
    """Modelled times (cost_model defaults, fs) around one chunked prompt, from a scheduler trace."""

    gaps: list[int]  # decode passes between consecutive chunks of the prompt
    cycle_chunk_fs: int  # the non-final chunks
    cycle_decode_fs: int  # decode steps between the first chunk and the final chunk
    final_chunk_fs: int  # the final chunk (by design followed by no window)
    idle: int  # passes with no batch between the first and the final chunk

    @property
    def share(self) -> float:
        """Decode share of the prefill, first chunk to the end of the final one (the final chunk's
        part is paid by the windows before it, so the cycles alone read above pct)."""
        total = self.prefill_fs
        return self.cycle_decode_fs / total if total else 0.0

    def rate_share(self, rode_along: int) -> float:
        """The rows' token rate over the prefill, over their rate alone at its mean step cost: one
        token a decode step plus ``rode_along`` a chunk, the final one too (1 under ``--enable-mixed-chunk``)."""
        steps = sum(self.gaps)
        total = self.prefill_fs
        if not steps or not total:
            return 0.0
        tokens = steps + rode_along * (len(self.gaps) + 1)
        return tokens * (self.cycle_decode_fs / steps) / total

    @property
    def prefill_fs(self) -> int:
        """First chunk to the end of the final chunk: the prompt's time to first token."""
        return self.cycle_chunk_fs + self.cycle_decode_fs + self.final_chunk_fs


def modelled_ns(step: Any) -> int:
    """A pass's modelled wall time in ns (cost_model defaults): the scripted clock of the harness."""
    if step.kind == "prefill":
        return cost_model.chunk_cost(zip(step.extend_lens, step.prefix_lens)) // 10**6
    return cost_model.step_cost(step.decode_context_lens) // 10**6


def prompt_times(steps: list[Any], rid: str) -> PromptTimes:
    chunk_steps = [i for i, s in enumerate(steps) if s.kind == "prefill" and rid in s.rids]
    if not chunk_steps:
        raise ValueError(f"request {rid} was not prefilled in this trace")
    first, last = chunk_steps[0], chunk_steps[-1]
    gaps, cycle_chunk, cycle_decode, idle = [], 0, 0, 0
    for i in range(first, last):
        s = steps[i]
        if i in chunk_steps:
            gaps.append(0)
            cycle_chunk += cost_model.chunk_cost(zip(s.extend_lens, s.prefix_lens))
        elif s.kind == "decode":
            gaps[-1] += 1
            cycle_decode += cost_model.step_cost(s.decode_context_lens)
        elif s.kind == "idle":
            idle += 1
    final = steps[last]
    return PromptTimes(gaps, cycle_chunk, cycle_decode, cost_model.chunk_cost(zip(final.extend_lens, final.prefix_lens)),
                       idle)


def run_case(prompt: int, streams: int, pct: int) -> dict[str, Any]:
    from devkit.testkit.scheduler import build_scheduler

    _install(pct)
    pool = _pool_tokens(prompt, streams, pct)
    h = build_scheduler(page_size=PAGE, pool_tokens=pool, chunked_prefill_size=CHUNK, max_context_len=prompt + CHUNK,
                        max_reqs=streams + 8)
    _modelled_clock(h)
    rows = [h.add_request(STREAM_PROMPT, max_new_tokens=pool) for _ in range(streams)]
    h.drain()
    h.run(2)
    long = h.add_request(prompt, max_new_tokens=2)
    start = len(h.trace)
    t0 = time.perf_counter()
    h.run_until(long.finished)
    wall = time.perf_counter() - t0
    times = prompt_times(h.trace[start:], long.rid)
    retracted = sum(r.is_retracted for r in rows)
    _install(0)
    return {
        "prompt": prompt, "streams": streams, "pct": pct, "times": times, "wall_s": wall, "retracted": retracted,
        "capped": bool(times.gaps) and max(times.gaps) >= cost_model.MAX_YIELD_STEPS,
    }


def _modelled_clock(h: Any) -> None:
    """The harness's forwards take the cost model's time, and the closed loop reads that clock."""
    from adapter.switches.decode_yield import clock as yield_clock
    from devkit.testkit.scheduler import ScriptedClock

    clock = ScriptedClock(modelled_ns)
    h.on_forward = clock.forward
    yield_clock.now = clock.now


def _ab(a: Any, b: Any, reset: Any, reps: int) -> tuple[float, float]:
    """Median ns of ``a()`` and ``b()``, interleaved A, B, A, B ...; ``reset()`` runs untimed before each."""
    times: tuple[list[int], list[int]] = ([], [])
    clock = time.perf_counter_ns
    for _ in range(reps):
        for side, fn in enumerate((a, b)):
            reset()
            t = clock()
            fn()
            times[side].append(clock() - t)
    return statistics.median(times[0]), statistics.median(times[1])


def _recorded(y: Any) -> tuple[Any, ...]:
    """What decode yield's per-scheduler state holds (decision state, open window, clock, backlog
    ledger), copied so that later passes cannot change it (requests shared, not copied)."""
    backlog = copy.copy(y.backlog)
    backlog.stamps, backlog._served, backlog.work = dict(y.backlog.stamps), list(y.backlog._served), \
        copy.deepcopy(y.backlog.work)
    return y.state, copy.copy(y.open), copy.deepcopy(y.clock), backlog


def _restore(y: Any, recorded: tuple[Any, ...]) -> None:
    state, opened, clock, backlog = recorded
    y.state, y.open, y.clock, y.backlog = _recorded(SimpleNamespace(state=state, open=opened, clock=clock,
                                                                    backlog=backlog))


def measure_overhead(reps: int, streams: int = 16) -> dict[str, float]:
    """The wrappers' cost per scheduler pass on real state, A/B interleaved in this run.

    A pass calls both wrapped methods once. On a recorded real pass (``streams`` rows, a long prompt
    in flight) each wrapped method is called through its installed ``wrapt`` wrapper (B) and as the
    bare function (A) with the same arguments and the same inner result, so B - A is exactly what
    the switch adds: wrapt dispatch plus the switch's own logic.
    """
    import wrapt

    from adapter.switches.decode_yield.switch import _ATTR
    from devkit.testkit.scheduler import build_scheduler, simulated_forward

    scheduler_cls = importlib.import_module(SCHEDULER).Scheduler
    _install(33)
    try:
        h = build_scheduler(page_size=PAGE, pool_tokens=1 << 20, chunked_prefill_size=CHUNK, max_context_len=1 << 19,
                            max_reqs=streams + 8)
        _modelled_clock(h)
        for _ in range(streams):
            h.add_request(STREAM_PROMPT, max_new_tokens=1 << 16)
        h.drain()
        h.add_request(1 << 18, max_new_tokens=2)
        h.run(3)  # the long prompt is in flight; a window is open
        s = h.scheduler
        gnb = scheduler_cls.__dict__["get_next_batch_to_run"]
        dfp = scheduler_cls.__dict__["_should_defer_prefill"]
        original_defer = dfp.__wrapped__
        state = s.__dict__[_ATTR]
        figures: dict[str, float] = {}

        def measure(name: str, inner: Any, wrapper: Any, args: tuple[Any, ...], reset: Any) -> None:
            bare = inner.__get__(s, scheduler_cls)
            wrapped = wrapt.FunctionWrapper(inner, wrapper).__get__(s, scheduler_cls)
            a_ns, b_ns = _ab(lambda: bare(*args), lambda: wrapped(*args), reset, reps)
            figures[f"{name}_us"] = round((b_ns - a_ns) / 1000, 2)

        while s._prefill_decode_interval_remaining > 0:  # to the end of the open window: the next pass arms
            h.step()
        rb, lb = s.running_batch, s.last_batch
        recorded = _recorded(state)  # the switch's state as recorded: a replay must not feed it
        chunk_plan = s.get_next_batch_to_run(running_batch=rb, last_batch=lb)  # a real arming pass
        window, counter = state.open, s._prefill_decode_interval_remaining
        if window is None or counter == 0:
            raise RuntimeError("overhead bench: the recorded pass did not arm a window")

        def reset() -> None:
            state.open = window
            s._prefill_decode_interval_remaining = counter
            s.chunked_req = window.req

        def reset_unarmed() -> None:
            _restore(state, recorded)
            state.open = None
            s._prefill_decode_interval_remaining = 0

        # get_next_batch_to_run on a non-final chunk: the switch computes N and arms a window
        measure("arm", lambda self, running_batch, last_batch: chunk_plan, gnb._self_wrapper, (rb, lb), reset_unarmed)
        # the bound reads the clock, so a replay may arm a window of another length: it must arm one
        if state.open is None or s._prefill_decode_interval_remaining == 0:
            raise RuntimeError("overhead bench: the replayed arming pass did not arm")
        # _should_defer_prefill before the chunk ran: no window open (passes through)
        measure("defer_plain", original_defer, dfp._self_wrapper, (rb,), reset_unarmed)

        reset()
        s.running_batch = chunk_plan.running_batch
        s.process_batch_result(chunk_plan.batch_to_run, simulated_forward(chunk_plan.batch_to_run))
        s.last_batch = chunk_plan.batch_to_run
        rb, lb = s.running_batch, s.last_batch
        decode_plan = s.get_next_batch_to_run(running_batch=rb, last_batch=lb)  # a real deferred pass
        if decode_plan.batch_to_run is None or decode_plan.batch_to_run.forward_mode.is_extend():
            raise RuntimeError("overhead bench: the recorded pass after the chunk was not deferred")
        # _should_defer_prefill inside the open window (counts a deferral), then
        # get_next_batch_to_run on that pass (prompt in flight, no chunk in the batch)
        measure("defer_window", original_defer, dfp._self_wrapper, (rb,), reset)
        measure("next_no_chunk", lambda self, running_batch, last_batch: decode_plan, gnb._self_wrapper, (rb, lb), reset)
        # the everyday decode pass: no chunked prompt at all
        s.chunked_req = None
        measure("next_plain", lambda self, running_batch, last_batch: decode_plan, gnb._self_wrapper, (rb, lb),
                reset_unarmed)
    finally:
        _install(0)
    figures["arm_pass_us"] = round(figures["arm_us"] + figures["defer_plain_us"], 2)
    figures["deferred_pass_us"] = round(figures["next_no_chunk_us"] + figures["defer_window_us"], 2)
    figures["plain_pass_us"] = round(figures["next_plain_us"] + figures["defer_plain_us"], 2)
    figures["overhead_us"] = max(figures["arm_pass_us"], figures["deferred_pass_us"], figures["plain_pass_us"])
    return figures


def run(quick: bool) -> dict[str, Any]:
    grid = QUICK if quick else FULL
    results = {}
    for prompt in grid["prompts"]:
        for streams in grid["streams"]:
            for pct in grid["pcts"]:
                results[prompt, streams, pct] = run_case(prompt, streams, pct)
    cells, misses = [], []
    for (prompt, streams, pct), r in results.items():
        times: PromptTimes = r["times"]
        share = times.share
        ttft = times.prefill_fs / results[prompt, streams, 0]["times"].prefill_fs
        r["share"], r["ttft"] = share, ttft
        gaps = times.gaps or [0]
        ok = ""
        if pct:
            share_ok = streams < 4 or r["capped"] or abs(share - pct / 100) <= 0.03
            ttft_ok = ttft <= 100 / (100 - pct) + 0.05
            ok = "ok" if share_ok and ttft_ok else "MISS"
            if ok == "MISS":
                misses.append(f"{prompt // 1024}K/{streams}/{pct}")
        cells.append([
            f"{prompt // 1024}K", str(streams), str(pct), str(min(gaps)), f"{statistics.mean(gaps):.1f}", str(max(gaps)),
            f"{share:.3f}", f"{ttft:.3f}", "yes" if r["capped"] else "no", str(times.idle), str(r["retracted"]),
            f"{r['wall_s']:.2f}", ok,
        ])
    print(table.render(["prompt", "streams", "pct", "gap_min", "gap_mean", "gap_max", "share", "ttft_x",
                        "capped", "idle", "retr", "sim_s", "target"], cells))
    overhead = measure_overhead(1000 if quick else 5000)
    wide = measure_overhead(500 if quick else 2000, streams=64)
    for rows, o in ((16, overhead), (64, wide)):
        print(f"wrapper overhead per scheduler pass, {rows} streams (median wrapped - bare, A/B interleaved on real "
              f"state): arming pass {o['arm_pass_us']} µs, deferred pass {o['deferred_pass_us']} µs, "
              f"plain pass {o['plain_pass_us']} µs")
    from devkit.testkit import decode_yield_scripted

    scripted = decode_yield_scripted.table_rows()
    print(f"\nthe controller against scripted costs ({decode_yield_scripted.PROMPT_CHUNKS} chunks, "
          f"{decode_yield_scripted.STREAMS} streams; the windows' share of the wall time (steps and alternation) "
          "over the prompt after its first 3 cycles, per quarter, and the streams' steps' own; "
          "model: the open-loop cost model fitted to chunk 10 ms, step 2 ms; the step change's transition windows, "
          "one over and one repaying it, left out of the quarters)")
    print(table.render(["scenario", "costs", "pct", "mode", "share", "per quarter", "streams", "±0.03"],
                       [[r["scenario"], r["what"], str(r["pct"]), r["mode"], f"{r['share']:.3f}",
                         " / ".join(f"{q:.3f}" for q in r["quarters"]), f"{r['streams_share']:.3f}",
                         "ok" if all(abs(q - r["pct"] / 100) <= 0.03 for q in r["quarters"]) else "MISS"]
                        for r in scripted]))
    for r in scripted:
        if r["mode"] == "measured" and any(abs(q - r["pct"] / 100) > 0.03 for q in r["quarters"]):
            misses.append(f"scripted {r['scenario']}")
    key = (262144, 16)
    figures: dict[str, Any] = {
        "share_33": round(results[(*key, 33)]["share"], 4),
        "share_50": round(results[(*key, 50)]["share"], 4),
        "ttft_factor_33": round(results[(*key, 33)]["ttft"], 4),
        "ttft_factor_50": round(results[(*key, 50)]["ttft"], 4),
        "gap_mean_33": round(statistics.mean(results[(*key, 33)]["times"].gaps), 2),
        "stock_gap_mean": round(statistics.mean(results[(*key, 0)]["times"].gaps), 2),
        **overhead,
        "overhead_us_64_streams": wide["overhead_us"],
        "scripted": [{k: r[k] for k in ("scenario", "pct", "mode", "share", "quarters")} for r in scripted],
        "targets_missed": misses,
    }
    return figures
