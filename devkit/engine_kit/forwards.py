"""The decode-yield workload (:mod:`devkit.engine_kit.workload`) read on the engine's forward-pass
metrics of a boot (``--enable-forward-pass-metrics``, recorded by :class:`devkit.engine_kit.fpm.Recorder`):
the streams' forward in each span, the prefill on forward times, the decode-to-prefill cost ratio and
how the prompt's chunks grow. Used by ``bench decode-yield-engine`` (the figures of record:
docs/benchmarks.md)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from devkit.engine_kit.yield_kits import MellumYieldKit

CHUNK = MellumYieldKit.chunk


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
    costs the step right after it, read inside one prefill with no reference span (the figures of
    record: docs/benchmarks.md, ``decode-yield-engine``). The later steps
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
