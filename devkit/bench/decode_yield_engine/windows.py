"""The switch's own view of each prompt (its DEBUG ``window`` lines) and the share arithmetic on it:
the loop's share, the streams' step as the switch timed it, and the client's share valued at that
step, whole and per quarter of the prefill."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def prompt_windows(log: Path) -> list[list[tuple[float, float, int]]]:
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
    (:func:`prompt_windows`): the engine's view beside the client's, one value per chunked prompt
    the streams decoded beside. Over the whole prefill, as the client times it: the streams' part
    of the prompt's served cycles (``streams_us`` over ``cycle_us``) with the final chunk, which no
    window follows and no line times, taken at the median overhead of its cycles (a cycle less the
    streams' part; the DSV4 kit's 16-chunk prompt: the cycles alone read about
    pct * (1 + (1 - pct) / 15), 0.517 at pct 50, since their windows also pay the final chunk's share)."""
    shares = []
    for windows in prompt_windows(log):
        final = statistics.median(cycle - streams for cycle, streams, _ in windows)
        shares.append(round(sum(w[1] for w in windows) / (sum(w[0] for w in windows) + final), 4))
    return shares


def loop_steps(log: Path) -> list[float | None]:
    """The streams' step as the switch timed it in each prompt's windows (:func:`prompt_windows`):
    their time over the steps they were given, in seconds; nothing for a prompt that gave none."""
    return [windows_step(windows) for windows in prompt_windows(log)]


def windows_step(windows: list[tuple[float, float, int]]) -> float | None:
    """One prompt's windows: the streams' time over the steps given, in seconds (None: none given)."""
    given = sum(w[2] for w in windows)
    return round(sum(w[1] for w in windows) / given / 1e6, 7) if given else None


def quarter_steps(windows: list[tuple[float, float, int]], start_s: float, span_s: float) -> list[float | None]:
    """The streams' step as the switch timed it in each quarter of the client's prefill span
    (``span_s`` from the send to the first token): the prompt's cycles (:func:`prompt_windows`) laid
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
