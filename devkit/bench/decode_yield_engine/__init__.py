"""``python -m adapter bench decode-yield-engine [--quick]``: decode yield on the real CPU server.

The tiny Mellum kit (:mod:`devkit.engine_kit`) serves 4 streaming requests; a long prompt (6,000
tokens, chunks of 64: 94 chunks) arrives while they decode. Per boot and round (the gate's yield
phase, :func:`devkit.engine_kit.workload.run_yield_phase`, with a rate measured after the prompt
too): the streams' share, their tokens during the prefill timed at their own rate alone over the
prefill's wall time, with that rate taken at the context they had (a stream's step grows with its
context: :func:`devkit.engine_kit.workload.context_share` interpolates the rates before and after
the prefill in decoded tokens); ``share_before_only`` is over the rate before, as the gate has it,
and ``reference_drift`` how far the rates before and after are apart; ``share_loop``, the share
the switch itself measured over each prompt, final chunk included (its DEBUG ``window`` lines:
:func:`loop_shares`); ``forward_drift``, how much slower (positive) the streams' own
forward ran during the prefill than in the spans the client's reference rates come from (from the
forward-pass metrics: :func:`stream_forwards`; where the machine moves, the client's share moves
with it, the switch's does not); ``first_step_cost`` (column ``fwd_1st``), the streams' first forward
after a chunk over their later ones in the same prefill, less one (what interleaving costs a step,
with no reference span); ``reference_noise``, how far the streams' rate alone moved
within the reference spans themselves, between their halves, at constant work
(:func:`devkit.engine_kit.workload.reference_noise`: the resolution of the client's reference on
this machine); ``step_ratio``, the streams' step as the switch timed it in the prefill over the
step the client's reference values their tokens at, and ``share_at_speed``, the share with the
tokens valued at the switch's step (:func:`speed_figures`: the client's share is the switch's
time share over that ratio, so a miss the ratio explains is the machine's), and per quarter of the
prefill ``share_quarters_at_speed``, each quarter's share at the step the switch timed in it
(:func:`quarter_speed_figures`); ``admission_s``,
from the client's send to the prompt's first chunk, the part of
the client's first quarter where the streams decode alone; the long prompt's time to
first token (TTFT), and total throughput over that TTFT (stream tokens decoded plus prompt tokens
prefilled, per second).

Boots, one at a time, same model, seed and server arguments, in ``boots`` repetitions (3 back to
back in the full run; every repetition's share is judged, not only their median):

1. stock, with forward-pass metrics recorded: the reference TTFT, and the log is fitted with
   ``fit-cost-model`` (as the gate's calibration does: forward and per-iteration wall fits,
   ``--topk 0``), so the repetition's yield boots run on coefficients fitted on this machine minutes
   earlier (its speed moves over minutes: a decode step took 12 ms in one boot, 20 ms ten minutes on);
2. ``DSV41_DECODE_YIELD=<pct>`` per pct, in its default measured mode with no coefficient (the
   closed loop: nothing calibrated); the stock boot's fit feeds only the open-loop row under load;

and once: what a user would try instead, ``--prefill-decode-interval`` 1/2/4,
``--enable-mixed-chunk`` and a smaller ``--chunked-prefill-size`` (a boot that fails to start says
why); then decode yield at pct 50 and 70 on top of ``--enable-mixed-chunk`` (``rows_on_mixed_chunk``:
the window credits the token each stream gets inside a chunk). Each row is the median of all its rounds. A clock-free model cannot see a boot whose decode
steps run faster or slower against its chunks than in its calibration boot, and the share follows
that ratio; so each boot also reports its cost ratio (median forward of a decode step of the streams
over the mean forward of the lone prompt's chunks, from its forward-pass metrics: :func:`cost_ratio`)
over its calibration boot's,
and the share the cost model gives at it (``expected_share``: the odds pct/(100-pct) times that
ratio): measured against expected is the model's error, expected against pct the machine's. Each
boot also times the long prompt alone first (no streams; decode yield leaves a lone prompt as
stock), after an untimed warm-up prompt of the same length (:func:`lone_ttft`):
``ttft_factor_in_boot`` is TTFT over that, free of the drift between boots;
``ttft_factor`` is over the stock boots' median TTFT. Targets (decode yield rows): every boot's share within
±0.03 of pct/100 (±0.05 under load), each quarter of the prefill within the same (the prompt's
last chunks cost several times its first: ``chunk_growth``; ``matching_k`` and its quarters say what
the ``--prefill-decode-interval`` whose share is closest does), both TTFT factors at most
100/(100-pct)+0.10, and a TTFT (in-boot factor) no worse
than 1.05x that of the alternative whose share is closest (within 0.05) to it. Reported beside the
targets, not instead of them: ``steady_share_ok``, the share of the boots whose ``forward_drift``
is within :data:`STEADY` (the machine held its speed) within the same tolerance, and
``share_at_speed_ok``, every boot's ``share_at_speed`` within it, and ``quarters_at_speed_ok``, each
quarter's median ``share_quarters_at_speed`` within it (null where a boot or a quarter has no step
timed: mixed chunk, a boot without window lines); and on the engine's own forward times
(:func:`prefill_forwards`, free of the boots' speeds, which move the client's share and the lone
prompt's TTFT between boots of one run) ``forward_shares`` and ``spans_forwards`` per boot,
``ttft_forward``, ``ttft_factor_forward`` / ``ttft_forward_ok`` (that over stock's, against the
TTFT bound), and ``forward_rival`` / ``forward_rival_ttft`` / ``forward_rival_ok``: the
alternative of the closest forward share (within 0.15), its TTFT over chunk forwards at the row's
own share, and whether the row's is no worse than 1.05x that (:func:`_forward_rival`). Slow (about a minute
per boot on 2 cores, 24 boots): a benchmark, never a timed test. ``--quick``: a 2,048-token prompt,
pct 50 only, one repetition, one round, alternatives interval 1. ``decode-yield-engine-dsv4``: the
same on the DSV4 kit (:class:`Dsv4Engine`).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

from devkit.bench.decode_yield_engine import report
from devkit.bench.decode_yield_engine.prompts import calibration_requests, competing_process, lone_ttft
from devkit.bench.decode_yield_engine.report import (
    ON_MIXED,
    OPEN_LOOP,
    UNDER_LOAD,
    _forward_rival,
    expected_share,
)
from devkit.bench.decode_yield_engine.windows import (
    cycle_quarters,
    loop_shares,
    loop_steps,
    prompt_windows,
    quarter_speed_figures,
    quarter_steps,
    speed_figures,
    windows_step,
)
from devkit.engine_kit.forwards import (
    chunk_growth,
    cost_ratio,
    prefill_forwards,
    stream_forwards,
)
from devkit.engine_kit.scheduler_clock import SchedulerClock, cpu_figures
from devkit.engine_kit.yield_kits import Dsv4YieldKit, MellumYieldKit

__all__ = [  # the bench's entry points, and the parts its unit tests read through this module
    "DSV4", "FULL", "MELLUM", "OUT", "QUICK", "SchedulerClock", "_forward_rival", "boot_rounds", "chunk_growth",
    "cost_ratio", "cpu_figures", "cycle_quarters", "expected_share", "lone_ttft", "loop_shares", "loop_steps",
    "prefill_forwards", "quarter_speed_figures", "quarter_steps", "run", "run_dsv4", "speed_figures",
    "stream_forwards",
]

REPO = Path(__file__).resolve().parents[3]
OUT = REPO / "build" / "bench-decode-yield-engine"
# Three repetitions (stock, then yield at each pct), back to back: every repetition's share must hold.
FULL = {"pcts": (20, 33, 50, 70), "rounds": 1, "boots": 3, "long": 6000,
        "alternatives": (("interval 1", ["--prefill-decode-interval", "1"]),
                         ("interval 2", ["--prefill-decode-interval", "2"]),
                         ("interval 4", ["--prefill-decode-interval", "4"]),
                         ("mixed chunk", ["--enable-mixed-chunk"]),
                         ("chunk 32", "chunk=32")),
        # decode yield on top of --enable-mixed-chunk: the window credits the token each stream got in the chunk
        "on_mixed_chunk": (50, 70),
        # a CPU-bound process competing for a core during the boot: the closed loop and the open-loop model
        # (fitted on the stock boot) side by side
        "under_load": (50,)}
QUICK = {"pcts": (50,), "rounds": 1, "boots": 1, "long": 2048, "alternatives": (("interval 1", ["--prefill-decode-interval", "1"]),)}
# The DSV4 kit: one boot per pct (a DSV4 boot costs minutes here), the alternatives SGLang runs with it.
DSV4_FULL = {"pcts": (20, 33, 50, 70), "rounds": 2, "boots": 1, "long": 16 * 256,
             "alternatives": (("interval 1", ["--prefill-decode-interval", "1"]),
                              ("interval 2", ["--prefill-decode-interval", "2"]),
                              # a one-page chunk admits no prompt beside a decoding row (the mixed rows come off
                              # the chunk budget, the rest is floored to pages: 255 -> 0); at 512 the prompt
                              # still prefills 256 tokens a pass (510 floored) with both streams riding along
                              ("mixed chunk, chunk 512", {"chunk": 512, "extra": ["--enable-mixed-chunk"]}))}
DSV4_QUICK = {"pcts": (50,), "rounds": 1, "boots": 1, "long": 8 * 256,
              "alternatives": (("interval 1", ["--prefill-decode-interval", "1"]),)}
WINDOW_LINES = {"DSV41_DEBUG_LOG": "1"}  # the switch's window lines: the loop's own share (loop_shares)



class Engine(Protocol):
    """A kit the bench boots (:mod:`devkit.engine_kit.yield_kits`) with its grids (``full`` / ``quick``)
    and its log folder."""

    name: str
    chunk: int
    streams: int
    full: dict[str, Any]
    quick: dict[str, Any]

    @property
    def out(self) -> Path: ...

    def model(self) -> Path: ...

    def server(self, model: Path, log: Path, profile: dict[str, str], extra: list[str], chunk: int) -> Any: ...

    def workload(self, long_tokens: int) -> Any: ...


class MellumEngine(MellumYieldKit):
    full, quick = FULL, QUICK

    @property
    def out(self) -> Path:
        return OUT

    def model(self) -> Path:
        return self.build(OUT)


class Dsv4Engine(Dsv4YieldKit):
    full, quick = DSV4_FULL, DSV4_QUICK

    @property
    def out(self) -> Path:
        return OUT.parent / "bench-decode-yield-engine-dsv4"

    def model(self) -> Path:
        return self.build(OUT)


MELLUM, DSV4 = MellumEngine(), Dsv4Engine()


def boot_rounds(label: str, model: Path, w: Any, rounds: int, *, profile: dict[str, str] | None = None,
                extra: list[str] | None = None, chunk: int = MellumYieldKit.chunk, calibrate: bool = False,
                say: Any = print, repeat: int = 0, engine: Engine = MELLUM, load: bool = False) -> dict[str, Any]:
    """One boot: ``rounds`` yield rounds (and the calibration requests first when ``calibrate``);
    ``repeat`` numbers the boots of one label (logs ``<label>.log``, ``<label>-2.log``, ...);
    ``load``: a competing CPU-bound process runs from the first round to the last."""
    from devkit.engine_kit import fpm, launcher

    safe = label.replace(" ", "-") + (f"-{repeat + 1}" if repeat else "")
    ipc = f"ipc://{tempfile.gettempdir()}/dsv41-bench-dy-{os.getpid()}-{safe}"
    server = engine.server(model, engine.out / f"{safe}.log", profile or {},
                           ["--enable-forward-pass-metrics", "--forward-pass-metrics-ipc-name", ipc, *(extra or [])], chunk)
    fpm_log = engine.out / f"fpm-{safe}.jsonl"
    recorder = fpm.Recorder(ipc, fpm_log).start()
    result: dict[str, Any] = {"label": label, "fpm_log": fpm_log, "rounds": []}
    clock: SchedulerClock | None = None
    try:
        try:
            server.start()
        except launcher.ServerFailed as exc:
            tail = [ln for ln in str(exc).splitlines() if ln.strip()]
            result["error"] = next((ln.strip() for ln in reversed(tail) if "Error" in ln), tail[-1] if tail else "?")
            say(f"  {label}: did not start: {result['error']}")
            return result
        pid = SchedulerClock.find(server.proc.pid)
        clock = SchedulerClock(pid).start() if pid is not None else None
        burner = competing_process() if load else None
        try:
            _serve_rounds(server, w, rounds, result, clock, safe, calibrate, say, label, repeat)
        except (RuntimeError, TimeoutError, OSError) as exc:  # a boot that fails under load: said, not fatal
            result["error"] = f"failed while serving: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            say(f"  {label}: {result['error']}")
        finally:
            if burner is not None:
                burner.kill()
                burner.wait(10)
    finally:
        if clock is not None:
            clock.stop()
        result["leftover"] = server.stop()
        recorder.stop()
    result["loop_shares"] = loop_shares(engine.out / f"{safe}.log")
    # one prompt's windows per round when every round's prompt chunked; not on mixed chunk, where the
    # windows also credit the streams with the token they get inside each chunk (no step of theirs to time)
    prompts = [] if "--enable-mixed-chunk" in (extra or []) else prompt_windows(engine.out / f"{safe}.log")
    for r, phase in enumerate(result["rounds"]):  # the whole log is written now: the span after the last round too
        phase.update(stream_forwards(fpm_log, phase["times"], w.streams))
        phase.update(prefill_forwards(fpm_log, phase["times"], w.streams, w.long_prompt_tokens))
        if len(prompts) == len(result["rounds"]):
            phase.update(speed_figures(phase, windows_step(prompts[r]), w.streams))
            phase.update(quarter_speed_figures(phase, prompts[r], w.streams))
            phase.update(cycle_quarters(phase, prompts[r], w.streams))
    return result


def _serve_rounds(server: Any, w: Any, rounds: int, result: dict[str, Any], clock: SchedulerClock | None, safe: str,
                  calibrate: bool, say: Any, label: str, repeat: int) -> None:
    from devkit.engine_kit import workload as wl

    if calibrate:
        calibration_requests(server.base_url, w)
    result["alone_s"], result["alone_cpu_s"] = lone_ttft(server.base_url, w, safe, clock)
    for r in range(rounds):
        phase = wl.run_yield_phase(server.base_url, w, f"{safe}-r{r}")
        ttft = phase["prefill_s"]
        phase["ttft_in_boot"] = round(ttft / result["alone_s"], 3)
        # the share against the streams' own step at the context they had (interpolated between the
        # rates before and after the prefill: workload.context_share), else the bracket's mean rate
        phase["share"] = phase.get("decode_share_context", phase.get("decode_share_bracketed", phase["decode_share"]))
        during = phase["decode_rate_during"]
        if phase.get("share_quarters_context"):
            phase["share_quarters"] = phase["share_quarters_context"]
        elif during and phase["share"] is not None:  # each quarter's rate against the same reference
            phase["share_quarters"] = [round(q * phase["share"] / during, 4) for q in phase["decode_rate_quarters"]]
        if clock is not None and clock.samples:
            time.sleep(0.05)
            try:
                phase.update(cpu_figures(phase, clock))
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # the wall figures still stand
                say(f"  {label}: no CPU-time figures: {type(exc).__name__}: {exc}")
            if result["alone_cpu_s"] and phase.get("ttft_cpu_s"):
                phase["ttft_cpu_in_boot"] = round(phase["ttft_cpu_s"] / result["alone_cpu_s"], 3)
        streamed = (phase["decode_rate_during"] or 0) * phase["measured_s"]
        phase["throughput"] = round((streamed + w.long_prompt_tokens) / ttft, 1) if ttft > 0 else None
        result["rounds"].append(phase)
        say(f"  {label}{f' #{repeat + 1}' if repeat else ''} round {r + 1}: share {phase['share']} "
            f"(before only {phase['decode_share']}, drift {phase.get('reference_drift')}; CPU {phase.get('share_cpu')}), "
            f"TTFT {ttft:.2f} s (alone {result['alone_s']:.2f} s; CPU {phase.get('ttft_cpu_s')} / "
            f"{result.get('alone_cpu_s')}), "
            f"before {phase['decode_rate_before']} tok/s, throughput {phase['throughput']} tok/s")


def _fit(fpm_log: Path) -> tuple[dict[str, str], str]:
    """``fit-cost-model --topk 0`` on the stock boot's log, as the gate's calibration runs it."""
    import contextlib
    import io

    from adapter import cost_model
    from adapter.ops import fit_cost_model

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        code = fit_cost_model.main(str(fpm_log), 0)
    text = buffer.getvalue()
    if code != 0:
        raise RuntimeError(f"fit-cost-model failed on {fpm_log}:\n{text}")
    line = text.strip().splitlines()[-1]
    keys = dict(word.split("=", 1) for word in line.split() if word.startswith(cost_model.KEY_PREFIX))
    return keys, text


def run_dsv4(quick: bool, say: Any = print) -> dict[str, Any]:
    """``python -m adapter bench decode-yield-engine-dsv4 [--quick]``: the same on the DSV4 kit."""
    return run(quick, say, engine=DSV4)


def run(quick: bool, say: Any = print, engine: Engine = MELLUM) -> dict[str, Any]:
    grid = engine.quick if quick else engine.full
    t0 = time.monotonic()
    engine.out.mkdir(parents=True, exist_ok=True)
    model = engine.model()
    w = engine.workload(grid["long"])
    load = os.getloadavg()
    say(f"decode-yield-engine ({engine.name}): {w.long_prompt_tokens}-token prompt in chunks of {engine.chunk}, "
        f"{w.streams} streams, {grid['boots']} boot(s) per pct, {grid['rounds']} round(s); "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; logs in {engine.out}")
    runs: dict[str, list[dict[str, Any]]] = {}

    def boot(label: str, **kwargs: Any) -> dict[str, Any]:
        kwargs.setdefault("chunk", engine.chunk)
        result = boot_rounds(label, model, w, grid["rounds"], say=say, repeat=len(runs.get(label, [])),
                             engine=engine, **kwargs)
        runs.setdefault(label, []).append(result)
        return result

    # Each repetition is calibrated on its own stock boot, right before its yield boots: this
    # machine's speed moves over minutes (a decode step 12 ms in one boot, 20 ms ten minutes later).
    calibrations: list[dict[str, Any]] = []
    for repeat in range(grid["boots"]):
        stock = boot("stock", calibrate=True)
        if "error" in stock or not stock["rounds"]:
            raise RuntimeError(f"the stock boot did not run: {stock.get('error')}")
        keys, fit_text = _fit(stock["fpm_log"])
        for line in fit_text.strip().splitlines() if not repeat else fit_text.strip().splitlines()[-1:]:
            say(f"  | {line}")
        ratio = cost_ratio(stock["fpm_log"], w.streams, engine.chunk)
        calibrations.append({"keys": keys, "cost_ratio": ratio})
        for pct in grid["pcts"]:  # the closed loop: no coefficients, nothing calibrated
            boot(f"yield {pct}", profile={"DSV41_DECODE_YIELD": str(pct), **WINDOW_LINES})
    for label, how in grid["alternatives"]:
        if isinstance(how, dict):  # boot keywords as they are
            boot(label, **how)
        else:
            boot(label, **({"chunk": int(how.split("=")[1])} if isinstance(how, str) else {"extra": list(how)}))
    for pct in grid.get("on_mixed_chunk", ()):
        boot(f"yield {pct} {ON_MIXED}", profile={"DSV41_DECODE_YIELD": str(pct), **WINDOW_LINES}, extra=["--enable-mixed-chunk"])
    for pct in grid.get("under_load", ()):  # side by side: the closed loop, and the open loop fitted minutes before
        last = calibrations[-1]
        boot(f"yield {pct} {UNDER_LOAD}", profile={"DSV41_DECODE_YIELD": str(pct), **WINDOW_LINES}, load=True)
        boot(f"yield {pct} {OPEN_LOOP} {UNDER_LOAD}", load=True,
             profile={"DSV41_DECODE_YIELD": str(pct), "DSV41_DECODE_YIELD_MODE": "model", **last["keys"]},
             )["calibration_ratio"] = last["cost_ratio"]
    for label_boots in runs.values():  # each boot's cost ratio and chunk growth, from its forward-pass metrics
        for b in label_boots:
            if "error" not in b:
                b["cost_ratio"] = cost_ratio(b["fpm_log"], w.streams, engine.chunk)
                b["chunk_growth"] = chunk_growth(b["fpm_log"], w.streams, engine.chunk)
    summary = report.summarize(runs, calibrations[0]["cost_ratio"])
    rows, rows_on_mixed, misses, table = report.judge(summary)

    say(table)
    load = os.getloadavg()
    return {
        "rows": rows,
        "rows_on_mixed_chunk": rows_on_mixed,
        "boots": summary,
        "calibrations": calibrations,
        "targets_missed": misses,
        "engine": engine.name,
        "long_prompt_tokens": w.long_prompt_tokens,
        "load_average_end": [round(x, 2) for x in load],
        "wall_s": round(time.monotonic() - t0, 1),
        "leftover_processes": sum(len(b.get("leftover", [])) for label_boots in runs.values() for b in label_boots),
    }
