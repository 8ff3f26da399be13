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
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parents[2]
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
CHUNK = 64
MAX_TOTAL_TOKENS = 32768  # 4 streams x (32 + 4000) + the long prompt, never short of KV
SHARE_TOL, TTFT_SLACK, SAME_SHARE = 0.03, 0.10, 0.05
WINDOW_LINES = {"DSV41_DEBUG_LOG": "1"}  # the switch's window lines: the loop's own share (loop_shares)
LOAD_SHARE_TOL = 0.05  # under a competing process
STEADY = 0.10  # a boot whose streams' forward in the prefill is within this of its reference's (stream_forwards)
UNDER_LOAD, OPEN_LOOP = "under load", "open loop"  # label words of the load rows
ON_MIXED = "+ mixed chunk"  # the label's tail of a decode-yield boot with --enable-mixed-chunk


class Engine(Protocol):
    """A kit the bench boots: its model, its server, its workload and its grids (``full`` / ``quick``)."""

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


class MellumEngine:
    """The tiny Mellum kit (:mod:`devkit.engine_kit`): 4 streams, chunks of 64."""

    name, chunk, streams = "mellum", CHUNK, 4
    full, quick = FULL, QUICK

    @property
    def out(self) -> Path:
        return OUT

    def model(self) -> Path:
        from devkit.gate import kits

        return kits.kit("mellum").build(OUT)  # the gate's model folder, built once

    def server(self, model: Path, log: Path, profile: dict[str, str], extra: list[str], chunk: int) -> Any:
        from devkit.engine_kit import launcher

        args = launcher.server_args(model, launcher.free_port(), max_total_tokens=MAX_TOTAL_TOKENS, chunk=chunk,
                                    extra=extra)
        return launcher.Server(args, log, profile)

    def workload(self, long_tokens: int) -> Any:
        from devkit.engine_kit import workload as wl

        # Streams long enough never to run out during the slowest prefill (pct 70: ~3.5x stock's TTFT).
        return wl.Workload(streams=self.streams, stream_prompt_tokens=32, stream_max_tokens=4000,
                           long_prompt_tokens=long_tokens, before_s=2.0, after_s=2.0)


class Dsv4Engine:
    """The tiny DeepSeek-V4 kit (:mod:`devkit.engine_kit.dsv4`, the gate's DSV4 model: 3 layers
    C0/C4/C128, 256-token pages, fp8 KV): 2 streams, a prompt of 16 pages in chunks of one page
    (16 windows)."""

    name, chunk, streams = "dsv4", 256, 2
    full, quick = DSV4_FULL, DSV4_QUICK

    @property
    def out(self) -> Path:
        return OUT.parent / "bench-decode-yield-engine-dsv4"

    def model(self) -> Path:
        from devkit.gate import kits

        return kits.kit("dsv4").build(OUT)  # the gate's checkpoint folder, built once

    def server(self, model: Path, log: Path, profile: dict[str, str], extra: list[str], chunk: int) -> Any:
        from devkit.engine_kit.dsv4 import launch
        from devkit.gate import kits

        # the gate's pool and running rows (2 streams and the long prompt); the SWA share sized for the chunk
        return launch.server(model, log, profile, ready_timeout_s=600.0, max_total_tokens=kits.DSV4_MAX_TOTAL_TOKENS,
                             max_running=kits.DSV4_MAX_RUNNING, chunk=chunk, extra=extra)

    def workload(self, long_tokens: int) -> Any:
        from devkit.engine_kit import workload as wl

        return wl.Workload(streams=self.streams, stream_prompt_tokens=32, stream_max_tokens=1500,
                           long_prompt_tokens=long_tokens, before_s=3.0, after_s=3.0, timeout_s=900.0)


MELLUM, DSV4 = MellumEngine(), Dsv4Engine()


def _calibration_requests(base_url: str, w: Any) -> None:
    """Single requests of several lengths: prefill chunks at many prefixes, decode at batch 1."""
    from devkit.engine_kit import client

    for i, n in enumerate((40, 300, 1000, 2500)):
        client.generate(base_url, w.ids(f"calib{i}", n), 24, w.timeout_s)


class SchedulerClock:
    """The scheduler process's CPU time (``/proc/<pid>/stat`` utime + stime), sampled every 20 ms.

    On a shared 2-core machine the wall clock measures the other tenants as much as the engine (the
    load average moves 4 -> 20 within a boot). The scheduler is one process with one torch thread,
    so its CPU seconds are what its iterations cost whatever the load: the share and the TTFT in
    scheduler CPU time are the same figures with the load taken out (resolution: 10 ms ticks)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.samples: list[tuple[float, float]] = []
        self._tick = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler-clock", daemon=True)

    def cpu(self) -> float | None:
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime, stime

    def _run(self) -> None:
        while not self._stop.is_set():
            value = self.cpu()
            if value is not None:
                self.samples.append((time.monotonic(), value))
            time.sleep(0.02)

    def start(self) -> SchedulerClock:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def at(self, t: float) -> float:
        """CPU seconds at wall instant ``t`` (linear between the samples around it)."""
        import bisect

        i = bisect.bisect_left(self.samples, (t, -1.0))
        if i == 0:
            return self.samples[0][1]
        if i >= len(self.samples):
            return self.samples[-1][1]
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1

    @staticmethod
    def find(group: int) -> int | None:
        """The scheduler's pid among the server's processes (its name is ``sglang::scheduler``)."""
        from devkit.engine_kit import launcher

        for pid in launcher.members(group):
            try:
                if Path(f"/proc/{pid}/comm").read_text().startswith("sglang::schedul"):
                    return pid
            except OSError:
                continue
        return None


def cpu_figures(phase: dict[str, Any], clock: SchedulerClock) -> dict[str, Any]:
    """The phase's share and TTFT in scheduler CPU seconds (see :class:`SchedulerClock`)."""
    t = phase["times"]
    before_cpu = clock.at(t["send"]) - clock.at(t["before"])
    during_cpu = clock.at(t["end"]) - clock.at(t["send"])
    wall_before, wall_during = t["send"] - t["before"], t["end"] - t["send"]
    tokens_before = (phase["decode_rate_before"] or 0) * wall_before
    tokens_during = (phase["decode_rate_during"] or 0) * wall_during
    share = None
    if before_cpu > 0 and during_cpu > 0 and tokens_before > 0:
        share = round((tokens_during / during_cpu) / (tokens_before / before_cpu), 4)
    return {"share_cpu": share, "ttft_cpu_s": round(clock.at(t["first"]) - clock.at(t["send"]), 3)}


def lone_ttft(base_url: str, w: Any, tag: str, clock: SchedulerClock | None = None) -> tuple[float, float | None]:
    """The long prompt's TTFT alone (no streams) on this boot: decode yield leaves a lone prompt as
    stock, so it is the boot's own reference, free of the load drift between boots. A prompt of the
    same length and other tokens runs first, untimed, so the lone prompt is not the boot's first
    long prompt: timed cold, the stock boots' in-boot factor read 0.68-1.44 over four full Mellum
    runs, below 1.0 in 5 of 12 boots (the same prompt beside four nearly starved streams faster
    than alone), and a slow lone prompt flatters every in-boot factor of its boot."""
    from devkit.engine_kit import client

    client.flush_cache(base_url)
    client.generate(base_url, w.ids("warm", w.long_prompt_tokens), 1, w.timeout_s)
    client.flush_cache(base_url)
    long = client.Stream(base_url, f"{tag}-alone", w.ids("long", w.long_prompt_tokens), 1, w.timeout_s)
    t_send = time.monotonic()
    long.start()
    long.join(w.timeout_s)
    if long.error or not long.ticks:
        raise RuntimeError(f"the lone long prompt failed: {long.error}")
    time.sleep(0.05)  # one clock sample past the first token
    t_first = long.ticks[0][0]
    cpu = round(clock.at(t_first) - clock.at(t_send), 3) if clock is not None and clock.samples else None
    return t_first - t_send, cpu


def competing_process() -> Any:
    """A CPU-bound process (a Python busy loop) competing for a core; ``.kill()`` it when done."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def boot_rounds(label: str, model: Path, w: Any, rounds: int, *, profile: dict[str, str] | None = None,
                extra: list[str] | None = None, chunk: int = CHUNK, calibrate: bool = False,
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
    prompts = [] if "--enable-mixed-chunk" in (extra or []) else _prompt_windows(engine.out / f"{safe}.log")
    for r, phase in enumerate(result["rounds"]):  # the whole log is written now: the span after the last round too
        phase.update(stream_forwards(fpm_log, phase["times"], w.streams))
        phase.update(prefill_forwards(fpm_log, phase["times"], w.streams, w.long_prompt_tokens))
        if len(prompts) == len(result["rounds"]):
            phase.update(speed_figures(phase, _windows_step(prompts[r]), w.streams))
            phase.update(quarter_speed_figures(phase, prompts[r], w.streams))
            phase.update(cycle_quarters(phase, prompts[r], w.streams))
    return result


def _prompt_windows(log: Path) -> list[list[tuple[float, float, int]]]:
    """The switch's DEBUG ``window`` lines (on with ``DSV41_DEBUG_LOG=1``) that served a cycle,
    grouped by chunked prompt (a new one starts at a window of prefix 0): per window
    ``(cycle_us, streams_us, given)``, the cycle's wall time, the streams' part of it and the steps
    they were given."""
    import re

    prompts: list[list[tuple[float, float, int]]] = []
    if not log.is_file():
        return prompts
    for line in log.read_text(errors="replace").splitlines():
        if "decode_yield window" not in line:
            continue
        fields = dict(re.findall(r" (\w+)=(\S+)", line))
        if fields.get("prefix") == "0" or not prompts:  # a new prompt's first window
            prompts.append([])
        if "cycle_us" in fields and "streams_us" in fields:
            prompts[-1].append((float(fields["cycle_us"]), float(fields["streams_us"]), int(fields.get("given", 0))))
    return [windows for windows in prompts if windows]


def loop_shares(log: Path) -> list[float]:
    """The share each prompt's windows measured, as the switch's own ``window`` lines say it
    (:func:`_prompt_windows`): the engine's view beside the client's, one value per chunked prompt
    the streams decoded beside. Over the whole prefill, as the client times it: the streams' part
    of the prompt's served cycles (``streams_us`` over ``cycle_us``) with the final chunk, which no
    window follows and no line times, taken at the median overhead of its cycles (a cycle less the
    streams' part; the DSV4 kit's 16-chunk prompt: the cycles alone read about
    pct * (1 + (1 - pct) / 15), 0.517 at pct 50, since their windows also pay the final chunk's share)."""
    shares = []
    for windows in _prompt_windows(log):
        final = statistics.median(cycle - streams for cycle, streams, _ in windows)
        shares.append(round(sum(w[1] for w in windows) / (sum(w[0] for w in windows) + final), 4))
    return shares


def loop_steps(log: Path) -> list[float | None]:
    """The streams' step as the switch timed it in each prompt's windows (:func:`_prompt_windows`):
    their time over the steps they were given, in seconds; nothing for a prompt that gave none."""
    return [_windows_step(windows) for windows in _prompt_windows(log)]


def _windows_step(windows: list[tuple[float, float, int]]) -> float | None:
    """One prompt's windows: the streams' time over the steps given, in seconds (None: none given)."""
    given = sum(w[2] for w in windows)
    return round(sum(w[1] for w in windows) / given / 1e6, 7) if given else None


def quarter_steps(windows: list[tuple[float, float, int]], start_s: float, span_s: float) -> list[float | None]:
    """The streams' step as the switch timed it in each quarter of the client's prefill span
    (``span_s`` from the send to the first token): the prompt's cycles (:func:`_prompt_windows`) laid
    end to end from its first chunk, ``start_s`` after the send (``admission_s``), each with its
    window's steps at its end (the chunk runs first) spread evenly over their ``streams_us``; a
    quarter's step is the streams' time in it over the steps in it. None for a quarter that holds
    no step (the final chunk's, when it is longer than a quarter)."""
    time_in = [0.0] * 4
    steps_in = [0.0] * 4
    t = start_s
    for cycle_us, streams_us, given in windows:
        end = t + cycle_us / 1e6
        a = end - streams_us / 1e6  # the window's steps
        for q in range(4):
            lo, hi = span_s * q / 4, span_s * (q + 1) / 4
            part = max(0.0, min(end, hi) - max(a, lo)) / max(end - a, 1e-12)
            time_in[q] += streams_us * part
            steps_in[q] += given * part
        t = end
    return [round(us / n / 1e6, 7) if n > 1e-9 else None for us, n in zip(time_in, steps_in)]


def speed_figures(phase: dict[str, Any], step_s: float | None, streams: int) -> dict[str, Any]:
    """The client's share against the speed the streams' step ran at in the prefill.

    The client values each token the streams got at their cost alone (``reference_token_s``, from
    rates measured seconds before and after the prefill: :func:`devkit.engine_kit.workload.context_share`);
    the switch times the steps it gives (:func:`loop_steps`). ``step_ratio``: the switch's step over
    ``streams`` times that cost (above 1: the step ran slower in the prefill than in the client's
    reference spans). ``share_at_speed``: the share with the tokens valued at the step the switch
    timed, the share times that ratio: what the client's count of tokens and its clock say of the
    streams' time. The client's share is the switch's time share times the inverse ratio (the
    Mellum kit's pct 70 boot that read 0.65: a 26.4 ms step in the prefill, 24.5 ms in the reference
    spans, 0.70 x 24.5 / 26.4 = 0.65), so a boot off by more than the ratio explains is the switch's
    miss, the rest the machine's."""
    reference = phase.get("reference_token_s")
    if not step_s or not reference or phase.get("share") is None:
        return {}
    ratio = step_s / (streams * reference)
    return {"step_ratio": round(ratio, 4), "share_at_speed": round(phase["share"] * ratio, 4)}


def quarter_speed_figures(phase: dict[str, Any], windows: list[tuple[float, float, int]],
                          streams: int) -> dict[str, Any]:
    """:func:`speed_figures` per quarter of the prefill: each quarter's share with its tokens valued
    at the step the switch timed in that quarter (:func:`quarter_steps`) instead of the cost its
    reference gives them there (``reference_token_s_quarters``). ``share_quarters_at_speed``: what the
    client's count of tokens and its clock say of the streams' time in each quarter; None for a
    quarter without a step."""
    quarters, costs = phase.get("share_quarters"), phase.get("reference_token_s_quarters")
    if not quarters or not costs or not phase.get("measured_s"):
        return {}
    steps = quarter_steps(windows, phase.get("admission_s") or 0.0, phase["measured_s"])
    ratios = [step / (streams * cost) if step and cost else None for step, cost in zip(steps, costs)]
    return {"step_ratio_quarters": [None if r is None else round(r, 4) for r in ratios],
            "share_quarters_at_speed": [None if r is None else round(q * r, 4) for q, r in zip(quarters, ratios)]}


def cycle_quarters(phase: dict[str, Any], windows: list[tuple[float, float, int]], streams: int) -> dict[str, Any]:
    """Each quarter of the prefill over whole cycles, on the client's count and clock.

    A cycle runs its chunk first and its window's steps last, so a quarter edge at an arbitrary
    instant cuts one: the span before it ends in a chunk more often than in steps, the span after
    it starts in steps. The client's first quarter (it starts with the first chunk) then reads below
    pct and its last (it ends with the final chunk, whose share the last windows paid) above, by
    about pct * (1 - pct) / 2 of a cycle over a quarter (the DSV4 kit: cycles of 1.4-7 s against
    quarters of 5-17 s, 0.02-0.03; the Mellum kit's 20-90 ms cycles, nothing). Here each interior
    edge moves to the cycle boundary nearest it (a chunk's start, in the layout of
    :func:`quarter_steps`), the first to the first chunk's start (``admission_s``: the streams'
    span alone before it is left out), the last stays at the first token. A quarter's share is the
    streams' tokens the client counted between its edges, each counted from the middle of the
    boundary's chunk (no token arrives in a chunk, so the layout may be off by half a chunk) at
    the switch's step in those windows, over the client's time between the edges.
    ``share_quarters_cycles``: None without the client's token times or with fewer than four
    windows."""
    decoded, span = phase.get("decoded_s"), phase.get("measured_s")
    if not decoded or not span or len(windows) < 4:
        return {}
    start = phase.get("admission_s") or 0.0
    starts, middles, t = [], [], start  # each non-first cycle's start and its chunk's middle
    for cycle_us, streams_us, _ in windows:
        starts.append(t)
        middles.append(t + (cycle_us - streams_us) / 2e6)
        t += cycle_us / 1e6
    starts.append(t)  # the final chunk's
    middles.append(t + max(span - t, 0.0) / 2)
    picked = [min(range(1, len(starts)), key=lambda i: abs(starts[i] - span * q / 4)) for q in (1, 2, 3)]
    if len(set(picked)) < 3:
        return {}
    bounds = [0, *picked, len(windows)]  # window indices: quarter q holds windows bounds[q]..bounds[q+1]-1

    def tokens_by(x: float) -> int:
        return next((k for at, k in reversed(decoded) if at <= x), 0)

    shares = []
    for q in range(4):
        a, b = bounds[q], bounds[q + 1]
        given = sum(w[2] for w in windows[a:b])
        if not given:
            shares.append(None)
            continue
        step = sum(w[1] for w in windows[a:b]) / given / 1e6
        count_from = start if q == 0 else middles[a]
        count_to = span if q == 3 else middles[b]
        wall = (span if q == 3 else starts[b]) - (start if q == 0 else starts[a])
        shares.append(round((tokens_by(count_to) - tokens_by(count_from)) * step / (streams * max(wall, 1e-9)), 4))
    return {"share_quarters_cycles": shares}


def _serve_rounds(server: Any, w: Any, rounds: int, result: dict[str, Any], clock: SchedulerClock | None, safe: str,
                  calibrate: bool, say: Any, label: str, repeat: int) -> None:
    from devkit.engine_kit import workload as wl

    if calibrate:
        _calibration_requests(server.base_url, w)
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


def _records(fpm_log: Path) -> list[tuple[dict[str, Any], float, float | None]]:
    """A forward-pass-metrics log's records: (scheduled batch, forward seconds, arrival time)."""
    import json

    records = []
    if not fpm_log.is_file():
        return records
    for line in fpm_log.read_text().splitlines():
        try:
            record = json.loads(line)
            records.append((record["scheduled_requests"], float(record["wall_time"]), record.get("recv_time")))
        except (ValueError, KeyError, TypeError):
            continue
    return records


def _streams_step(batch: dict[str, Any], streams: int) -> bool:
    """A decode-only batch of the ``streams`` rows: the streams' step, nothing else in it."""
    return batch["num_prefill_requests"] == 0 and batch["num_decode_requests"] == streams


def stream_forwards(fpm_log: Path, times: dict[str, float], streams: int) -> dict[str, Any]:
    """How fast the streams' own forward ran while the client took its reference rates and while
    the prompt prefilled: the median forward of their decode-only batches (``streams`` rows) in the
    spans before, during and after the prefill (the records' arrival time is the client's clock).

    The client's share weighs the streams' tokens in the prefill at their rate alone before and
    after it; the streams' forward is the same work in all three spans (the same rows, whose context
    during the prefill lies between the other two), so when it ran at another speed during the
    prefill, the machine moved, not the switch (the Mellum kit: 20 ms before, 53 ms during, 16 ms
    after in a boot whose client share read 0.11 at pct 20; 19 / 14 / 20 ms in one that read 0.49 at
    pct 33, the loop 0.20 and 0.33): the client's share then moves with that speed ratio (not exactly
    by it: the forward is not the whole iteration). ``forward_drift``: the forward during over the
    mean of before and after, less one (positive: slower during). Nothing for a span without such a
    batch.

    ``first_step_cost``: in the prefill, the median forward of the streams' first step after a
    chunk (the record before it prefilled) over that of their later steps, less one: what a chunk
    costs the step right after it, read inside one prefill with no reference span (the Mellum kit
    on 2026-12-04: +0.06 to +0.20 in all but one of 22 yield prefills at pct 20-70, that one −0.01 in
    a boot slow throughout; +0.10 / +0.11 at ``--prefill-decode-interval`` 2 / 4). The later steps
    include the streams' steps between the send and the first chunk. None where either kind is
    missing.

    ``admission_s``: from the client's send to the start of the prompt's first chunk (the first
    batch after the send that prefills a prompt from prefix 0, less its forward): the HTTP request,
    the tokenizer manager and the scheduler's receive. The client's prefill span starts at the
    send, the switch's windows at the first chunk; in between the streams decode alone, at a share
    of 1.0, all of it inside the client's first quarter."""
    spans = {"before": ("before", "send"), "during": ("send", "end"), "after": ("after", "after_end")}
    found: dict[str, list[float]] = {name: [] for name in spans}
    after_chunk: dict[bool, list[float]] = {True: [], False: []}  # the prefill's steps, by what came before
    admission = None
    chunk_before = False
    for batch, forward, arrived in _records(fpm_log):
        if (admission is None and arrived is not None and "send" in times and arrived > times["send"]
                and batch["num_prefill_requests"] and batch.get("sum_prefill_kv_tokens") == 0):
            admission = round(arrived - forward - times["send"], 3)
        follows_chunk = chunk_before
        if batch["num_prefill_requests"] or batch["num_decode_requests"]:  # an empty batch changes nothing
            chunk_before = bool(batch["num_prefill_requests"])
        if arrived is None or not _streams_step(batch, streams):
            continue
        for name, (a, b) in spans.items():
            if a in times and b in times and times[a] < arrived <= times[b]:
                found[name].append(forward)
                if name == "during":
                    after_chunk[follows_chunk].append(forward)
    median = {name: statistics.median(v) * 1000 if v else None for name, v in found.items()}
    drift = None
    if median["during"] and median["before"] and median["after"]:
        drift = round(median["during"] / ((median["before"] + median["after"]) / 2) - 1, 4)
    first_cost = None
    if after_chunk[True] and after_chunk[False]:
        first_cost = round(statistics.median(after_chunk[True]) / statistics.median(after_chunk[False]) - 1, 4)
    return {"forward_ms": [None if v is None else round(v, 2) for v in median.values()], "forward_drift": drift,
            "first_step_cost": first_cost, "admission_s": admission}


NO_FORWARDS = {"forward_share": None, "ttft_forward": None, "span_forwards": None}
# how far from a row's forward share an alternative is set beside it (_forward_rival): on the Mellum
# kit the span over all forwards held 1.19-1.32 in every boot of a run, stock's at share 0 included;
# on the DSV4 kit it grows with the share (1.01 to 1.07: 2-4 ms a pass, steps of 22-26 ms), which
# favours an alternative of a lower share set at the row's
RIVAL_SHARE = 0.15


def prefill_forwards(fpm_log: Path, times: dict[str, float], streams: int, prompt_tokens: int) -> dict[str, Any]:
    """The prefill on the engine's own forward times, a same-share comparison free of the boot's
    speed: over the records that arrive after the client's send, up to the prompt's final chunk (the
    first prefill-only record whose prefix and tokens reach ``prompt_tokens``; under the overlap
    loop its record can arrive after the client's first token, and on the DSV4 kit it is a 16th of
    the prompt's chunks),
    ``forward_share``, the streams' decode-only forwards over those and the prompt's chunk forwards
    (prefill-only batches); ``ttft_forward``, the client's TTFT over the chunk forwards (TTFT in
    units of the prompt's own prefill work in that boot); ``span_forwards``, the TTFT over both
    (1 / (1 - rest), rest the span's time outside those forwards: scheduling, sampling, output
    processing), so that ``ttft_forward`` = ``span_forwards`` / (1 - ``forward_share``) and a TTFT
    can be set beside another's at one share (:func:`_forward_rival`). The client's share and in-boot TTFT
    value the prefill at the streams' rate and the lone prompt's TTFT of that boot, which move
    between boots of one run (the Mellum kit: a lone chunk 11-21 ms, the streams 519-629 tok/s
    alone); every pass, the switch's or ``--prefill-decode-interval``'s, costs the same work on
    these. None on mixed chunk (the streams ride inside the chunks), or where no chunk or no final
    chunk arrives after the send."""
    chunks = steps = 0.0
    for batch, forward, arrived in _records(fpm_log):
        if arrived is None or arrived <= times.get("send", 0):
            continue
        if batch["num_prefill_requests"] and batch["num_decode_requests"]:
            return dict(NO_FORWARDS)
        if batch["num_prefill_requests"]:
            chunks += forward
            if batch.get("sum_prefill_kv_tokens", 0) + batch["sum_prefill_tokens"] >= prompt_tokens:
                break
        elif _streams_step(batch, streams):
            steps += forward
    else:  # no final chunk after the send
        return dict(NO_FORWARDS)
    span = times["first"] - times["send"]
    return {"forward_share": round(steps / (steps + chunks), 4), "ttft_forward": round(span / chunks, 3),
            "span_forwards": round(span / (steps + chunks), 3)}


def _forwards(fpm_log: Path, streams: int, chunk: int) -> tuple[list[float], list[float]]:
    """From a forward-pass-metrics log: the forwards of the decode-only batches of the ``streams``
    rows, and those of the lone prompt's chunks: the last of the longest runs of back-to-back chunks
    of one prompt (prefill-only batches of ``chunk`` tokens at prefixes 0, chunk, 2 chunk, ... with
    no other batch between them; never a chunk right after a decode step) before the streams' first
    step. Its warm-up twin (:func:`lone_ttft`) runs just before it, the calibration's prompts are
    shorter, and the stock boot's prompt beside the streams, back to back too, comes after."""
    steps: list[float] = []
    best: list[float] = []
    run: list[float] = []
    for batch, forward, _ in _records(fpm_log):
        if _streams_step(batch, streams):
            steps.append(forward)
        is_chunk = batch["num_decode_requests"] == 0 and batch["sum_prefill_tokens"] == chunk
        prefix = batch.get("sum_prefill_kv_tokens", -1)
        if is_chunk and prefix == len(run) * chunk:
            run.append(forward)
        else:
            run = [forward] if is_chunk and prefix == 0 else []
        if not steps and run and len(run) >= len(best):
            best = list(run)
    return steps, best


def cost_ratio(fpm_log: Path, streams: int, chunk: int = CHUNK) -> float | None:
    """The boot's decode-to-prefill cost ratio: the median forward of a decode-only batch of the
    ``streams`` rows over the mean forward of the lone prompt's chunks (:func:`_forwards`; a chunk
    right after a decode step costs more on this engine)."""
    steps, best = _forwards(fpm_log, streams, chunk)
    if not steps or not best:
        return None
    return round(statistics.median(steps) / statistics.fmean(best), 4)


def chunk_growth(fpm_log: Path, streams: int, chunk: int = CHUNK) -> float | None:
    """How much more the lone prompt's last chunks cost than its first: the mean forward of its last
    eighth of chunks over that of its first eighth (the context each chunk attends to grows)."""
    _, best = _forwards(fpm_log, streams, chunk)
    k = len(best) // 8
    if k < 1:
        return None
    return round(statistics.fmean(best[-k:]) / statistics.fmean(best[:k]), 3)


def expected_share(pct: int, ratio: float | None, calibration_ratio: float | None) -> float | None:
    """The share the cost model gives on a boot whose cost ratio is ``ratio`` when its coefficients
    were fitted where it was ``calibration_ratio``: the model grants steps for odds pct/(100-pct) at
    the calibrated ratio, and the odds scale with the ratio (N steps of cost r against a chunk)."""
    if not ratio or not calibration_ratio:
        return None
    odds = pct / (100 - pct) * ratio / calibration_ratio
    return round(odds / (1 + odds), 4)


def _median(rounds: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


def _forward_rival(row: dict[str, Any], alternatives: dict[str, dict[str, Any]],
                   loaded: bool) -> dict[str, Any]:
    """The alternative whose forward share (the median over its boots) is closest to the row's,
    within :data:`RIVAL_SHARE`, set beside the row at the row's own share: its TTFT over chunk
    forwards there is its ``span_forwards`` / (1 - the row's share) (:func:`prefill_forwards`; no K
    lands on yield's share, and near pct 70 a 0.04 lower share is 14 % less TTFT by that alone).
    ``forward_rival_ok``: the row's ``ttft_forward`` no worse than 1.05x that. None under load (the
    alternatives ran without the competing process), on mixed chunk, or where no alternative comes
    that close."""
    def median_of(summary: dict[str, Any], key: str) -> float | None:
        values = [v for v in summary[key] if v is not None]
        return statistics.median(values) if values else None

    none = {"forward_rival": None, "forward_rival_share": None, "forward_rival_ttft": None, "forward_rival_ok": None}
    share = median_of(row, "forward_shares")
    if loaded or share is None or row["ttft_forward"] is None:
        return none
    timed = {name: (median_of(v, "forward_shares"), median_of(v, "spans_forwards")) for name, v in alternatives.items()}
    timed = {name: v for name, v in timed.items() if v[0] is not None and v[1] is not None}
    if not timed:
        return none
    name, (rival_share, rival_span) = min(timed.items(), key=lambda kv: abs(kv[1][0] - share))
    if abs(rival_share - share) > RIVAL_SHARE:
        return none
    at_share = round(rival_span / (1 - share), 3)
    return {"forward_rival": name, "forward_rival_share": rival_share, "forward_rival_ttft": at_share,
            "forward_rival_ok": row["ttft_forward"] <= at_share * 1.05}


def _fit(fpm_log: Path) -> tuple[dict[str, str], str]:
    """``fit-cost-model --topk 0`` on the stock boot's log, as the gate's calibration runs it."""
    import contextlib
    import io

    from adapter.ops import fit_cost_model
    from adapter.switches.decode_yield import cost_model

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        code = fit_cost_model.main(str(fpm_log), 0)
    text = buffer.getvalue()
    if code != 0:
        raise RuntimeError(f"fit-cost-model failed on {fpm_log}:\n{text}")
    line = text.strip().splitlines()[-1]
    keys = dict(word.split("=", 1) for word in line.split() if word.startswith(cost_model.KEY_PREFIX))
    return keys, text


def _quarter_medians(rounds: list[dict[str, Any]], key: str) -> list[float | None] | None:
    """Per quarter, the median over the rounds that have ``key`` (a quarter none of them has: None)."""
    have = [r[key] for r in rounds if r.get(key)]
    if not have:
        return None
    found = [[q[i] for q in have if q[i] is not None] for i in range(4)]
    return [statistics.median(v) if v else None for v in found]


def _all_within(values: list[float | None] | None, target: float, tol: float) -> bool | None:
    """Every value within ``tol`` of ``target``; None (not judged) where there is none or one is missing."""
    if not values or None in values:
        return None
    return all(abs(v - target) <= tol for v in values)


def _table(rows: list[list[str]], header: list[str]) -> str:
    cells = [header, *rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
    first_ratio = calibrations[0]["cost_ratio"]

    stock_rounds = [r for b in runs["stock"] for r in b["rounds"]]
    stock_ttft = _median(stock_rounds, "prefill_s")
    stock_cpu = _median(stock_rounds, "ttft_cpu_s")
    # stock's TTFT over its chunk forwards: the lone prompt's span on forward times, the streams beside it
    stock_forward = _median(stock_rounds, "ttft_forward")
    summary: dict[str, dict[str, Any]] = {}
    for label, label_boots in runs.items():
        ran = [b for b in label_boots if "error" not in b]
        if not ran:
            summary[label] = {"error": label_boots[0]["error"]}
            continue
        rounds = [r for b in ran for r in b["rounds"]]
        ttft = _median(rounds, "prefill_s")
        ratios = [cost_ratio(b["fpm_log"], w.streams, engine.chunk) for b in ran]
        summary[label] = {
            "share": _median(rounds, "share"), "share_before_only": _median(rounds, "decode_share"),
            "reference_drift": _median(rounds, "reference_drift"), "ttft_s": ttft,
            "ttft_factor": round(ttft / stock_ttft, 3) if ttft and stock_ttft else None,
            "ttft_factor_in_boot": _median(rounds, "ttft_in_boot"),
            "alone_s": round(statistics.median(b["alone_s"] for b in ran), 3),
            "share_cpu": _median(rounds, "share_cpu"),
            "ttft_cpu_s": _median(rounds, "ttft_cpu_s"),
            "ttft_cpu_in_boot": _median(rounds, "ttft_cpu_in_boot"),
            "ttft_cpu_factor": (round(_median(rounds, "ttft_cpu_s") / stock_cpu, 3)
                                if stock_cpu and _median(rounds, "ttft_cpu_s") else None),
            "throughput": _median(rounds, "throughput"),
            "rate_before": _median(rounds, "decode_rate_before"),
            "boots": len(ran),
            "boot_shares": [_median(b["rounds"], "share") for b in ran],
            "forward_drifts": [_median(b["rounds"], "forward_drift") for b in ran],
            "first_step_costs": [_median(b["rounds"], "first_step_cost") for b in ran],
            "reference_noises": [_median(b["rounds"], "reference_noise") for b in ran],
            "step_ratios": [_median(b["rounds"], "step_ratio") for b in ran],
            "boot_shares_at_speed": [_median(b["rounds"], "share_at_speed") for b in ran],
            "admission_s": _median(rounds, "admission_s"),
            # the prefill on the engine's forward times (prefill_forwards): a same-share comparison free
            # of the boots' speeds
            "forward_shares": [_median(b["rounds"], "forward_share") for b in ran],
            "spans_forwards": [_median(b["rounds"], "span_forwards") for b in ran],
            "ttft_forward": _median(rounds, "ttft_forward"),
            "ttft_factor_forward": (round(_median(rounds, "ttft_forward") / stock_forward, 3)
                                    if stock_forward and _median(rounds, "ttft_forward") else None),
            # the loop's own measure of each prompt (the switch's window lines), all boots
            "share_loop": (statistics.median(v for b in ran for v in b.get("loop_shares") or [])
                           if any(b.get("loop_shares") for b in ran) else None),
            "share_quarters": _quarter_medians(rounds, "share_quarters"),
            "share_quarters_at_speed": _quarter_medians(rounds, "share_quarters_at_speed"),
            "share_quarters_cycles": _quarter_medians(rounds, "share_quarters_cycles"),
            "chunk_growth": [chunk_growth(b["fpm_log"], w.streams, engine.chunk) for b in ran],
            "cost_ratio": ratios,
            # each boot's ratio over its calibration boot's (the first one's for stock and the alternatives)
            "ratio_vs_calibration": [round(r / b.get("calibration_ratio", first_ratio), 3)
                                     if r and b.get("calibration_ratio", first_ratio) else None
                                     for r, b in zip(ratios, ran)],
        }
        if OPEN_LOOP in label:  # the model's share is for plain chunks, at its calibration boot's ratio
            pct = int(label.split()[1])
            expected = [expected_share(pct, r, b.get("calibration_ratio")) for r, b in zip(ratios, ran)]
            summary[label]["expected_shares"] = expected
            summary[label]["expected_share"] = (statistics.median(e for e in expected if e is not None)
                                                if any(e is not None for e in expected) else None)
    alternatives = {k: v for k, v in summary.items() if not k.startswith("yield") and "error" not in v}
    header = ["boot", "drift", "share", "before_only", "per boot", "fwd_drift", "fwd_1st", "ref_noise", "step_ratio", "at_speed",
              "loop", "expected", "share_cpu", "ttft_s", "alone_s", "ttft_x", "ttft_x_in_boot",
              "ttft_cpu_x", "ratio/cal", "rate_before", "tok/s", "quarters", "q_at_speed", "q_cycles", "chunk_growth",
              "fwd_share", "ttft/fwd", "ttft_x_fwd", "span/fwd", "rival at share", "target"]
    rows, rows_on_mixed, table, misses = [], [], [], []
    for label, s in summary.items():
        if "error" in s:
            table.append([label, *["-"] * (len(header) - 2), f"did not run: {s['error'][:80]}"])
            continue
        verdict, rival_at_share = "", "-"
        if label.startswith("yield"):
            pct = int(label.split()[1])
            share, factor = s["share"], s["ttft_factor"]
            loaded = UNDER_LOAD in label  # the alternatives ran without the competing process: no rival
            tol = LOAD_SHARE_TOL if loaded else SHARE_TOL
            # every boot's share, not only the median: each repetition is a run of its own
            share_ok = share is not None and all(v is not None and abs(v - pct / 100) <= tol for v in s["boot_shares"])
            # the boots whose streams' forward ran at its reference speed during the prefill: there the
            # client's reference is the streams' rate alone (stream_forwards), elsewhere the machine moved
            steady = [v for v, d in zip(s["boot_shares"], s["forward_drifts"]) if d is not None and abs(d) <= STEADY]
            steady_ok = bool(steady) and all(v is not None and abs(v - pct / 100) <= tol for v in steady)
            # every boot with its tokens valued at the step the switch timed in the prefill (speed_figures);
            # not judged (None) where a boot has no step timed (mixed chunk, no window lines)
            at_speed = s["boot_shares_at_speed"]
            at_speed_ok = _all_within(at_speed, pct / 100, tol)
            # the interval K whose share is closest to this row's: what a fixed K does per quarter
            intervals = {k: v for k, v in alternatives.items() if k.startswith("interval")}
            matching_k = (min(intervals.items(), key=lambda kv: abs((kv[1]["share"] or 0) - (share or 0)))
                          if intervals and not loaded else None)
            quarters_ok = bool(s["share_quarters"]) and all(abs(q - pct / 100) <= tol for q in s["share_quarters"])
            # each quarter at the step the switch timed in it; not judged (None) where one has no step
            quarters_at_speed = s["share_quarters_at_speed"]
            quarters_at_speed_ok = _all_within(quarters_at_speed, pct / 100, tol)
            # each quarter over whole cycles (cycle_quarters); not judged where one has no step
            quarters_cycles = s["share_quarters_cycles"]
            quarters_cycles_ok = _all_within(quarters_cycles, pct / 100, tol)
            # the bound on the factor over stock's TTFT, and over the same boot's lone prompt (the load
            # on a shared machine drifts between boots; the in-boot factor does not see that drift)
            bound = 100 / (100 - pct) + TTFT_SLACK
            ttft_ok = factor is not None and factor <= bound
            ttft_in_boot_ok = s["ttft_factor_in_boot"] is not None and s["ttft_factor_in_boot"] <= bound
            # the same bound on forward times (over stock's TTFT over its chunk forwards), free of a
            # chunk's speed moving between the lone prompt and the prompt beside the streams; judged apart
            ttft_forward_ok = None if s["ttft_factor_forward"] is None else s["ttft_factor_forward"] <= bound
            rival = min(alternatives.items(), key=lambda kv: abs((kv[1]["share"] or 0) - (share or 0)))
            near = not loaded and abs((rival[1]["share"] or 0) - (share or 0)) <= SAME_SHARE
            rival_ok = not near or s["ttft_factor_in_boot"] <= rival[1]["ttft_factor_in_boot"] * 1.05
            forward_rival = _forward_rival(s, alternatives, loaded)
            if forward_rival["forward_rival"]:
                rival_at_share = (f"{forward_rival['forward_rival']} {forward_rival['forward_rival_ttft']:.2f} "
                                  + ("ok" if forward_rival["forward_rival_ok"] else "worse"))
            failed = [name for name, ok in (("share", share_ok), ("quarters", quarters_ok), ("ttft", ttft_ok),
                                            ("ttft_in_boot", ttft_in_boot_ok), ("vs " + rival[0], rival_ok)) if not ok]
            verdict = "ok" if not failed else "MISS " + ",".join(failed)
            verdict += f" (same share: {rival[0]})" if near else ""
            if failed:
                misses.append(f"{label}: {','.join(failed)}")
            cpu_ok = (s["share_cpu"] is not None and abs(s["share_cpu"] - pct / 100) <= SHARE_TOL
                      and s["ttft_cpu_factor"] is not None and s["ttft_cpu_factor"] <= bound)
            (rows_on_mixed if label.endswith(ON_MIXED) else rows).append({"pct": pct, "share": share, "ttft_factor": factor,
                         "share_before_only": s["share_before_only"], "reference_drift": s["reference_drift"],
                         "ttft_factor_in_boot": s["ttft_factor_in_boot"], "share_cpu": s["share_cpu"],
                         "ttft_cpu_factor": s["ttft_cpu_factor"], "cpu_targets_met": cpu_ok,
                         "boot_shares": s["boot_shares"], "share_loop": s["share_loop"],
                         "forward_drifts": s["forward_drifts"], "first_step_costs": s["first_step_costs"],
                         "reference_noises": s["reference_noises"],
                         "admission_s": s["admission_s"],
                         "steady_boot_shares": steady,
                         "steady_share_ok": steady_ok,
                         "step_ratios": s["step_ratios"], "boot_shares_at_speed": at_speed,
                         "share_at_speed_ok": at_speed_ok,
                         "expected_share": s.get("expected_share"),
                         "share_quarters": s["share_quarters"], "quarters_ok": quarters_ok,
                         "quarters_at_speed": quarters_at_speed, "quarters_at_speed_ok": quarters_at_speed_ok,
                         "quarters_cycles": quarters_cycles, "quarters_cycles_ok": quarters_cycles_ok,
                         "chunk_growth": s["chunk_growth"],
                         "forward_shares": s["forward_shares"], "ttft_forward": s["ttft_forward"],
                         "spans_forwards": s["spans_forwards"], **forward_rival,
                         "ttft_factor_forward": s["ttft_factor_forward"], "ttft_forward_ok": ttft_forward_ok,
                         "matching_k": matching_k[0] if matching_k else None,
                         "matching_k_share": matching_k[1]["share"] if matching_k else None,
                         "matching_k_quarters": matching_k[1]["share_quarters"] if matching_k else None,
                         "label": label})
        def f(v: Any, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        ratios = [r for r in s["cost_ratio"] if r is not None]
        table.append([label, f(s["reference_drift"], ".2f"), f(s["share"], ".3f"), f(s["share_before_only"], ".3f"),
                      "/".join(f(v, ".2f") for v in s["boot_shares"]),
                      "/".join(f(v, "+.2f") for v in s["forward_drifts"]),
                      "/".join(f(v, "+.2f") for v in s["first_step_costs"]),
                      "/".join(f(v, ".2f") for v in s["reference_noises"]),
                      "/".join(f(v, ".2f") for v in s["step_ratios"]),
                      "/".join(f(v, ".2f") for v in s["boot_shares_at_speed"]), f(s["share_loop"], ".3f"),
                      f(s.get("expected_share"), ".3f"), f(s["share_cpu"], ".3f"), f(s["ttft_s"], ".2f"),
                      f(s["alone_s"], ".2f"), f(s["ttft_factor"], ".2f"), f(s["ttft_factor_in_boot"], ".2f"),
                      f(s["ttft_cpu_factor"], ".2f"),
                      "/".join(f(r, ".2f") for r in s["ratio_vs_calibration"]),
                      f(s["rate_before"], ".1f"), f(s["throughput"], ".0f"),
                      "/".join(f(q, ".2f") for q in s["share_quarters"] or []) or "-",
                      "/".join(f(q, ".2f") for q in s["share_quarters_at_speed"] or []) or "-",
                      "/".join(f(q, ".2f") for q in s["share_quarters_cycles"] or []) or "-",
                      "/".join(f(g, ".2f") for g in s["chunk_growth"]),
                      "/".join(f(v, ".2f") for v in s["forward_shares"]), f(s["ttft_forward"], ".2f"),
                      f(s["ttft_factor_forward"], ".2f"),
                      "/".join(f(v, ".2f") for v in s["spans_forwards"]), rival_at_share, verdict])
    say(_table(table, header))
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
