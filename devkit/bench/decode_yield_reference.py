"""``python -m adapter bench decode-yield-reference [--quick]``: how precisely the client's reference
of ``bench decode-yield-engine`` can state the streams' rate alone on this machine, now: its null
test.

``decode-yield-engine`` times the streams' tokens during a prefill against their rate alone in
spans right before and right after it (2 s on the Mellum kit, 3 s on DSV4), at the context they
had (:func:`devkit.engine_kit.workload.context_share`). Here a stock server of the kit runs the
same streams with no prompt at all, and every span of ``span`` seconds is timed the same way
against the reference spans around it. Nothing runs in the span but the streams, so its true share
is 1.0; what it reads is the reference's own error on this machine, with no switch and no prompt in
it.

An error ``e`` of the reference moves a measured share ``p`` to ``p·(1+e)``, so ``decode-yield-engine``'s
±0.03 at pct ``p`` holds only where ``|e| <= 0.03/p``: 0.15 / 0.091 / 0.06 / 0.043 at pct 20 / 33
/ 50 / 70 (``within``: the fraction of spans inside each); ``perfect run``: how often a switch that
held every pct exactly would still read within ±0.03 in every boot of a full ``decode-yield-engine``
run (3 boots per pct on Mellum, 1 on DSV4). Spans start one a second (they overlap).
Mellum: 4 rounds of 25 s of fresh streams, spans of 3 / 6 / 10 s (its prefill takes 1.3-9 s with
the machine's speed); ``--quick``: one round of 16 s, spans of 6 s. ``decode-yield-reference-dsv4``:
the DSV4 kit's 2 streams, 2 rounds of 45 s, spans of 8 / 16 / 28 s (its prefill is 8-30 s);
``--quick``: one round of 20 s, spans of 8 s.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from adapter.ops import table
from devkit.engine_kit import yield_kits

OUT = Path(__file__).resolve().parents[2] / "build" / "bench-decode-yield-reference"

PCTS = (20, 33, 50, 70)
TOLERANCE = 0.03  # decode-yield-engine's target: the share within this of pct/100
# per kit: rounds of fresh streams, seconds recorded in each, the spans timed, each stream's tokens
# (inside the kit's KV pool: Mellum 4 x 6,032 of 32,768, DSV4 2 x 3,032 of 16,384; never run out), and
# decode-yield-engine's boots per pct in its full run (one round each on Mellum): what "perfect run" is over
GRIDS = {
    "mellum": {"full": {"rounds": 4, "record_s": 25.0, "spans": (3.0, 6.0, 10.0)},
               "quick": {"rounds": 1, "record_s": 16.0, "spans": (6.0,)}, "max_tokens": 6000, "engine_boots": 3},
    "dsv4": {"full": {"rounds": 2, "record_s": 45.0, "spans": (8.0, 16.0, 28.0)},
             "quick": {"rounds": 1, "record_s": 20.0, "spans": (8.0,)}, "max_tokens": 3000, "engine_boots": 1},
}


def null_shares(decoded: Any, start: float, end: float, span_s: float, ref_s: float,
                stride_s: float = 1.0) -> list[float]:
    """Each span of ``span_s`` seconds in ``[start + ref_s, end - ref_s]`` timed as a prefill is:
    its tokens against the rate ``ref_s`` seconds before and after it at the context they had
    (``decoded(t)``: the streams' tokens by ``t``); spans start ``stride_s`` apart."""
    from devkit.engine_kit import workload as wl

    shares = []
    t = start
    while t + 2 * ref_s + span_s <= end + 1e-9:
        a, b = t + ref_s, t + ref_s + span_s
        spans = {"before": (t, a), "after": (b, b + ref_s)}
        points = {name: wl.reference_point(decoded, y, z) for name, (y, z) in spans.items()}
        share = wl.context_share(points, [a, b], decoded).get("decode_share_context")
        if share is not None:
            shares.append(share)
        t += stride_s
    return shares


def summarize(shares: list[float], boots: int = 1, pcts: tuple[int, ...] = PCTS) -> dict[str, Any]:
    """The reference's errors ``|share - 1|``; per pct, the fraction of spans within
    :data:`TOLERANCE`/(pct/100), where the target at that pct can be judged at all; and
    ``perfect_run``: how often a switch that held every pct exactly would read within ±0.03 in all
    of a run's ``boots`` boots per pct (one round each, the boots' references independent)."""
    if not shares:
        return {"spans": 0}
    errors = sorted(abs(s - 1) for s in shares)
    within = {str(p): round(sum(e <= TOLERANCE * 100 / p for e in errors) / len(errors), 3) for p in pcts}
    return {"spans": len(errors), "median_error": round(statistics.median(errors), 4),
            "p90_error": round(errors[int(0.9 * (len(errors) - 1))], 4), "max_error": round(errors[-1], 4),
            "range": [round(min(shares), 4), round(max(shares), 4)], "within": within,
            "perfect_run": round(math.prod(f ** boots for f in within.values()), 4)}


def _round(base_url: str, w: Any, tag: str, record_s: float, max_tokens: int) -> tuple[Any, float, float, int]:
    """Fresh streams decoding alone for ``record_s``: (tokens by t, start, end, context reached)."""
    from devkit.engine_kit import client

    client.flush_cache(base_url)
    streams = [client.Stream(base_url, f"{tag}-s{i}", w.ids(f"stream{i}", w.stream_prompt_tokens), max_tokens,
                             w.timeout_s).start() for i in range(w.streams)]
    try:
        client.wait_until(lambda: all(s.tokens >= 8 or s.error for s in streams), w.timeout_s, "streams to decode")
        start = time.monotonic()
        time.sleep(record_s)
        end = time.monotonic()
    finally:
        client.stop_streams(base_url, streams)
    failed = [s.error for s in streams if s.error]
    if failed:
        raise RuntimeError(f"stream failed: {failed[0]}")
    done = [s.rid for s in streams if s.tokens_at(end) >= max_tokens]
    if done:
        raise RuntimeError(f"streams {done} ran out of their {max_tokens} tokens while recorded")

    def decoded(t: float) -> int:
        return sum(s.tokens_at(t) for s in streams)

    return decoded, start, end, w.stream_prompt_tokens + max(s.tokens_at(end) for s in streams)


def run_dsv4(quick: bool, say: Any = print) -> dict[str, Any]:
    """``python -m adapter bench decode-yield-reference-dsv4 [--quick]``: the same on the DSV4 kit."""
    return run(quick, say, engine=yield_kits.Dsv4YieldKit())


def run(quick: bool, say: Any = print, engine: Any = None) -> dict[str, Any]:
    engine = engine or yield_kits.MellumYieldKit()
    kit = GRIDS[engine.name]
    grid = kit["quick" if quick else "full"]
    out = OUT / engine.name
    out.mkdir(parents=True, exist_ok=True)
    model = engine.build(OUT)  # the kits build beside OUT: the gate's model folder, shared
    w = engine.workload(0)
    ref_s = w.before_s  # the kit's reference spans, as decode-yield-engine takes them
    load = os.getloadavg()
    server = engine.server(model, out / "reference-null.log", {}, [], engine.chunk)
    shares: dict[float, list[float]] = {span: [] for span in grid["spans"]}
    contexts = []
    server.start()
    try:
        for r in range(grid["rounds"]):
            decoded, start, end, context = _round(server.base_url, w, f"null{r}", grid["record_s"], kit["max_tokens"])
            contexts.append(context)
            for span in grid["spans"]:
                shares[span] += null_shares(decoded, start, end, span, ref_s)
    finally:
        server.stop()
    boots = kit["engine_boots"]
    rows = {f"{ref_s:g}/{span:g}": summarize(values, boots) for span, values in shares.items()}
    say(f"decode-yield-reference ({engine.name}): stock, {w.streams} streams decoding alone, no prompt; "
        f"{grid['rounds']} round(s) of {grid['record_s']:g} s (contexts up to {max(contexts)} tokens); each span "
        f"timed against the {ref_s:g} s before and after it, as decode-yield-engine times a prefill (true share "
        f"1.0); load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    header = ["ref/span s", "spans", "range", "median |e|", "p90 |e|", "max |e|",
              *(f"within pct {p} (|e|<={TOLERANCE * 100 / p:.3f})" for p in PCTS), f"perfect run ({boots} boots/pct)"]
    cells = [[name, str(row["spans"]), f"{row['range'][0]:.3f}-{row['range'][1]:.3f}", f"{row['median_error']:.3f}",
              f"{row['p90_error']:.3f}", f"{row['max_error']:.3f}", *(f"{row['within'][str(p)]:.2f}" for p in PCTS),
              f"{row['perfect_run']:.3f}"]
             for name, row in rows.items() if row["spans"]]
    say(table.render(header, cells))
    return {"kit": engine.name, "rows": rows, "rounds": grid["rounds"], "record_s": grid["record_s"],
            "reference_s": ref_s, "contexts": contexts, "load_average": [round(x, 2) for x in load]}
