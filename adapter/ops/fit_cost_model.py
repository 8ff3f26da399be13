"""``python -m adapter fit-cost-model LOG``: fit the decode-yield cost model from forward-pass metrics.

Input: SGLang's ``--enable-forward-pass-metrics`` messages, one per line as JSON. The scheduler
publishes each ``ForwardPassMetrics`` (``srt/observability/forward_pass_metrics.py``) msgpack-encoded
over ZMQ PUB; a subscriber that writes ``msgspec.json.encode(decode(payload))`` per message gives
this file. ``wall_time`` is the forward's GPU span in seconds; ``scheduled_requests`` holds
``num_prefill_requests``, ``sum_prefill_tokens`` (new tokens), ``sum_prefill_kv_tokens`` (prefix),
``num_decode_requests`` and ``sum_decode_kv_tokens``. Lines are decoded with the upstream struct,
so a field of the wrong type is an error naming the line and the field.

Fit: non-negative least squares (Lawson-Hanson), separately on
* prefill-only iterations with exactly one prefill request (a chunk: ``c`` new tokens on a
  ``p``-token prefix; with several requests the pairs per request are not in the message):
  ``t = CHUNK_US + TOKEN_NS*c + PAIR_FS*pairs(c, p) + TOPK_PAIR_PS*topk_pairs(c, p, K)``;
* decode-only iterations (``B`` rows, ``sum L`` KV tokens):
  ``t = STEP_US + ROW_NS*B + KV_PS*sum(L) + TOPK_KV_PS*min(sum(L), B*K)`` (the message carries no
  per-row lengths; ``min(sum L, B*K)`` is exact when all rows are on the same side of ``K``).
Mixed iterations and idle heartbeats are skipped. A top-k term the log cannot tell apart from the
linear terms (no prefill with ``p < K``, no decode with mean context below ``K``) is fitted as 0 and
said so.

Iteration fit (the forward is not all a step costs). With ``recv_time`` on each line
(:mod:`devkit.engine_kit.fpm` stamps arrivals; the scheduler emits once per iteration, at the end of
``process_batch_result``), the gap between two consecutive busy messages (``counter_id`` n-1, n) is
iteration n's wall time. Beyond its forward (``wall_time``) it is fitted, also by NNLS, on
* back-to-back chunks (a single-request prefill with ``p > 0`` after a prefill):
  ``gap - wall_time = CHUNK_SCHED_US + TOKEN_SCHED_NS*c``;
* steady decode steps (a decode after a decode): ``gap - wall_time = STEP_SCHED_US + ROW_SCHED_NS*B``;
* ``SWITCH_US``: what alternating adds, once per window: the median of what a decode step right
  after a chunk (same rows as the decode before it: the prompt still chunking) costs beyond the
  whole model of a steady step, plus the median of what a chunk right after a decode step costs
  beyond a back-to-back chunk. The two are summed because the split between them is not the
  engine's: the decode's message is often published late, so its gap is long and the chunk's short
  (on the CPU kit the cost itself is in the chunk's forward: a third more after a decode step). A
  stock boot interleaves none (a handful by chance), so it needs ``MIN_ALTERNATIONS`` of each, else
  it is 0 and said so.
Gaps that hold idle time (a request arriving after a pause) are outliers: each fit is done twice,
the second time without gaps whose residual is more than 5 MADs above the median. Without
``recv_time`` (an older log) the wall terms stay 0 and a note says so. The coefficients are rounded to integers in the units of :mod:`adapter.cost_model`, and
the command prints the profile line to use.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from adapter import cost_model

MIN_ROWS = 8  # per fit: fewer iterations than this cannot pin four coefficients


class FitError(ValueError):
    """The log cannot be fitted; the message names the file, the line and what is wrong."""


MIN_WALL_ROWS = 4  # per iteration fit: fewer gaps than this leave its terms at 0 (noted)
# SWITCH_US needs windows, not a few incidental pairs (a stock boot has a handful, by chance): at
# least this many of each alternation, both, or it stays 0 (noted)
MIN_ALTERNATIONS = 16


@dataclass
class Samples:
    prefill: list[tuple[int, int, float]]  # (new tokens c, prefix p, seconds)
    decode: list[tuple[int, int, float]]  # (rows B, sum of KV tokens, seconds)
    skipped: dict[str, int]
    # iteration wall times (recv_time gaps): (c, p, forward s, iteration s) / (B, sum L, forward s, iteration s)
    chunk_gaps: list[tuple[int, int, float, float]] = field(default_factory=list)  # a chunk after a prefill
    decode_gaps: list[tuple[int, int, float, float]] = field(default_factory=list)  # a decode after a decode
    # the alternation: a decode after a chunk with the rows that decoded before it (the prompt not
    # among them: it is still chunking), and a chunk (p > 0) after a decode
    switch_decode_gaps: list[tuple[int, int, float, float]] = field(default_factory=list)
    switch_chunk_gaps: list[tuple[int, int, float, float]] = field(default_factory=list)
    stamped: int = 0  # lines with recv_time


def read_log(path: str) -> Samples:
    """Parse a forward-pass-metrics JSON-lines log; raise :class:`FitError` naming the bad line."""
    import msgspec
    from sglang.srt.observability.forward_pass_metrics import ForwardPassMetrics

    class Stamp(msgspec.Struct):  # the arrival time the recorder appends to each line
        recv_time: float | None = None

    decoder = msgspec.json.Decoder(ForwardPassMetrics)
    stamps = msgspec.json.Decoder(Stamp)
    samples = Samples([], [], {"idle": 0, "mixed": 0, "multi_prefill": 0, "no_timing": 0})
    previous: tuple[int, str, float | None] | None = None  # (counter_id, kind, recv_time) of the last message
    rows_before = -1  # decode rows of the last decode iteration
    try:
        with open(path, "rb") as handle:
            lines = handle.read().splitlines()
    except OSError as exc:
        raise FitError(f"{path}: cannot read: {exc.strerror}") from None
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith(b"#"):
            continue
        try:
            m = decoder.decode(line)
        except msgspec.DecodeError as exc:
            shown = line[:60].decode("utf-8", "replace")
            raise FitError(
                f"{path}:{number}: not a ForwardPassMetrics JSON object ({exc}); got {shown!r}"
            ) from None
        r = m.scheduled_requests
        for name in ("num_prefill_requests", "sum_prefill_tokens", "sum_prefill_kv_tokens",
                     "num_decode_requests", "sum_decode_kv_tokens"):
            if getattr(r, name) < 0:
                raise FitError(f"{path}:{number}: scheduled_requests.{name}={getattr(r, name)} is negative")
        if not m.wall_time >= 0:  # also rejects NaN
            raise FitError(f"{path}:{number}: wall_time={m.wall_time} is not a duration in seconds")
        prefill, decode = r.num_prefill_requests > 0, r.num_decode_requests > 0
        received = stamps.decode(line).recv_time
        if received is not None and not received >= 0:
            raise FitError(f"{path}:{number}: recv_time={received} is not a time in seconds")
        samples.stamped += received is not None
        kind = "idle" if not prefill and not decode else "mixed" if prefill and decode else (
            "prefill" if prefill else "decode")
        gap = None
        if (previous is not None and received is not None and previous[2] is not None
                and m.counter_id == previous[0] + 1 and previous[1] != "idle" and m.wall_time > 0):
            gap = received - previous[2]
        if gap is not None and gap > 0:
            chunk = (r.sum_prefill_tokens, r.sum_prefill_kv_tokens, m.wall_time, gap)
            if kind == "prefill" and r.num_prefill_requests == 1 and r.sum_prefill_kv_tokens > 0:
                (samples.chunk_gaps if previous[1] == "prefill" else samples.switch_chunk_gaps).append(chunk)
            elif kind == "decode":
                rows = (r.num_decode_requests, r.sum_decode_kv_tokens, m.wall_time, gap)
                if previous[1] == "decode":
                    samples.decode_gaps.append(rows)
                elif previous[1] == "prefill" and r.num_decode_requests == rows_before:
                    samples.switch_decode_gaps.append(rows)
        if kind == "decode":
            rows_before = r.num_decode_requests
        previous = (m.counter_id, kind, received)
        if not prefill and not decode:
            samples.skipped["idle"] += 1
        elif m.wall_time == 0:
            samples.skipped["no_timing"] += 1
        elif prefill and decode:
            samples.skipped["mixed"] += 1
        elif prefill and r.num_prefill_requests != 1:
            samples.skipped["multi_prefill"] += 1
        elif prefill:
            samples.prefill.append((r.sum_prefill_tokens, r.sum_prefill_kv_tokens, m.wall_time))
        else:
            samples.decode.append((r.num_decode_requests, r.sum_decode_kv_tokens, m.wall_time))
    return samples


def nnls(a: list[list[float]], b: list[float], iterations: int = 500) -> list[float]:
    """Lawson-Hanson non-negative least squares: ``min |Ax - b|`` with ``x >= 0``."""
    import numpy as np

    A, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n = A.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(A).max())) * max(A.shape)
    for _ in range(iterations):
        w = A.T @ (y - A @ x)
        if passive.all() or w[~passive].max(initial=-np.inf) <= tol:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            passive &= x > tol
    return [float(v) for v in x]


def _fit(rows: list[list[float]], times_fs: list[float], keep: list[bool]) -> list[float]:
    """NNLS on columns scaled to unit norm (the features span ~10 orders of magnitude)."""
    import numpy as np

    A = np.asarray(rows, dtype=float)[:, keep]
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    x = np.asarray(nnls((A / scale).tolist(), times_fs)) / scale
    out, it = [], iter(x)
    for k in keep:
        out.append(float(next(it)) if k else 0.0)
    return out


def fit(samples: Samples, topk: int) -> tuple[cost_model.Coefficients, list[str]]:
    """Fitted coefficients (integers, cost_model units) and notes on what could not be fitted."""
    notes: list[str] = []
    for kind, rows in (("prefill-only single-request", samples.prefill), ("decode-only", samples.decode)):
        if len(rows) < MIN_ROWS:
            raise FitError(f"only {len(rows)} {kind} iterations in the log; need at least {MIN_ROWS}")
    # Prefill: t[fs] = CHUNK_US*1e9 + TOKEN_NS*1e6*c + PAIR_FS*pairs + TOPK_PAIR_PS*1e3*topk_pairs
    pre = [[1e9, 1e6 * c, float(cost_model.pairs(c, p)), 1e3 * cost_model.topk_pairs(c, p, topk)]
           for c, p, _ in samples.prefill]
    keep_pre = [True, True, True, bool(topk) and any(p < topk for _, p, _ in samples.prefill)]
    if topk and not keep_pre[3]:
        notes.append(f"TOPK_PAIR_PS fitted as 0: no prefill chunk starts below K={topk}, so it is not separable")
    a0, a1, a2, a3 = _trimmed_fit(pre, [t * 1e15 for *_, t in samples.prefill], keep_pre)
    # Decode: t[fs] = STEP_US*1e9 + ROW_NS*1e6*B + KV_PS*1e3*sum(L) + TOPK_KV_PS*1e3*min(sum(L), B*K)
    dec = [[1e9, 1e6 * b, 1e3 * kv, 1e3 * min(kv, b * topk)] for b, kv, _ in samples.decode]
    keep_dec = [True, True, True, bool(topk) and any(kv < b * topk for b, kv, _ in samples.decode)]
    if topk and not keep_dec[3]:
        notes.append(f"TOPK_KV_PS fitted as 0: no decode step has a mean context below K={topk}")
    d0, d1, d2, d3 = _trimmed_fit(dec, [t * 1e15 for *_, t in samples.decode], keep_dec)
    values = [a0, a1, a2, a3, d0, d1, d2, d3]
    coef = cost_model.Coefficients(*(round(v) for v in values), topk=topk, source="fit")
    return fit_wall(samples, coef, notes), notes


def _trimmed_fit(rows: list[list[float]], target_fs: list[float], keep_cols: list[bool] | None = None) -> list[float]:
    """NNLS, then again without the rows more than 5 MADs (and 5 % of their time) above the median
    residual: a gap that holds idle time, a forward the OS descheduled (a loaded 2-core machine
    gives 10x outliers)."""
    cols = keep_cols or [True] * len(rows[0])
    x = _fit(rows, target_fs, cols)
    residuals = [t - sum(a * b for a, b in zip(row, x)) for row, t in zip(rows, target_fs)]
    ordered = sorted(residuals)
    median = ordered[len(ordered) // 2]
    mad = sorted(abs(r - median) for r in residuals)[len(residuals) // 2]
    # never below 5 % of the row's own time: rows span orders of magnitude (64 tokens to 8K at 1M)
    keep = [i for i, (r, t) in enumerate(zip(residuals, target_fs)) if r <= median + max(5 * mad, 0.05 * t)]
    if MIN_WALL_ROWS <= len(keep) < len(rows):
        x = _fit([rows[i] for i in keep], [target_fs[i] for i in keep], cols)
    return x


def fit_wall(samples: Samples, coef: cost_model.Coefficients, notes: list[str]) -> cost_model.Coefficients:
    """``coef`` with the iteration terms (``*_SCHED_*``, ``SWITCH_US``) fitted from the gaps."""
    import dataclasses

    if not samples.stamped:
        notes.append("no recv_time in the log: the iteration terms (*_SCHED_*, SWITCH_US) stay 0, the model "
                     "charges the forward only; record with devkit.engine_kit.fpm to fit them")
        return coef
    wall: dict[str, int] = {}
    for kind, gaps, names, feature in (
        ("back-to-back chunk", samples.chunk_gaps, ("chunk_sched_us", "token_sched_ns"), lambda g: 1e6 * g[0]),
        ("steady decode", samples.decode_gaps, ("step_sched_us", "row_sched_ns"), lambda g: 1e6 * g[0]),
    ):
        if len(gaps) < MIN_WALL_ROWS:
            notes.append(f"{'/'.join(n.upper() for n in names)} fitted as 0: only {len(gaps)} {kind} gaps in the log")
            continue
        x = _trimmed_fit([[1e9, feature(g)] for g in gaps], [(g[3] - g[2]) * 1e15 for g in gaps])
        wall.update(zip(names, (round(v) for v in x)))
    coef = dataclasses.replace(coef, **wall)
    decodes, chunks = samples.switch_decode_gaps, samples.switch_chunk_gaps
    if min(len(decodes), len(chunks)) < MIN_ALTERNATIONS:
        notes.append(f"SWITCH_US fitted as 0: {len(decodes)} decode steps right after a chunk and {len(chunks)} chunks "
                     f"right after a decode step in the log, need {MIN_ALTERNATIONS} of each (a stock boot interleaves "
                     "none); fit on a boot with --prefill-decode-interval or decode yield to include it")
        return coef
    extra_fs = 0.0
    for gaps, cost in (
        (decodes, lambda g: cost_model.decode_cost(g[0], g[1], min(g[1], g[0] * coef.topk), coef)),
        (chunks, lambda g: cost_model.chunk_cost([g[:2]], coef)),
    ):
        residuals = sorted(g[3] * 1e15 - cost(g) for g in gaps)
        extra_fs += residuals[len(residuals) // 2]  # the median: what the alternation adds
    return dataclasses.replace(coef, switch_us=max(0, round(extra_fs / 1e9)))


def _rms(errors: list[float]) -> float:
    return (sum(e * e for e in errors) / len(errors)) ** 0.5 if errors else float("nan")


def forward_only(coef: cost_model.Coefficients) -> cost_model.Coefficients:
    """``coef`` with the iteration terms at 0: the model of the forward alone."""
    import dataclasses

    return dataclasses.replace(coef, **{name: 0 for name in cost_model.WALL_TERMS})


def relative_rms(samples: Samples, coef: cost_model.Coefficients) -> tuple[float, float]:
    """Relative RMS error of the integer forward model on the prefill and the decode forwards."""
    coef = forward_only(coef)
    pre = [cost_model.chunk_cost([(c, p)], coef) / (t * 1e15) - 1 for c, p, t in samples.prefill]
    dec = [cost_model.decode_cost(b, kv, min(kv, b * coef.topk), coef) / (t * 1e15) - 1 for b, kv, t in samples.decode]
    return _rms(pre), _rms(dec)


def iteration_errors(samples: Samples, coef: cost_model.Coefficients) -> dict[str, tuple[float, float]]:
    """Median relative error of the whole model (forward + iteration terms) and of the forward-only
    model against the iteration wall times, per kind: ``{kind: (whole, forward only)}``. Medians,
    because a gap that holds idle time is an outlier the fit dropped too."""
    def median_error(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[len(ordered) // 2] if ordered else float("nan")

    out = {}
    for kind, gaps, cost in (
        ("chunk", samples.chunk_gaps, lambda g, k: cost_model.chunk_cost([(g[0], g[1])], k)),
        ("decode", samples.decode_gaps, lambda g, k: cost_model.decode_cost(g[0], g[1], min(g[1], g[0] * k.topk), k)),
    ):
        out[kind] = tuple(median_error([cost(g, k) / (g[3] * 1e15) - 1 for g in gaps])
                          for k in (coef, forward_only(coef)))
    return out


def main(log: str, topk: int) -> int:
    try:
        samples = read_log(log)
        coef, notes = fit(samples, topk)
    except FitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rms_pre, rms_dec = relative_rms(samples, coef)
    skipped = ", ".join(f"{k} {v}" for k, v in samples.skipped.items() if v) or "none"
    print(f"iterations used: prefill {len(samples.prefill)}, decode {len(samples.decode)}; skipped: {skipped}")
    print(f"{'coefficient':<14}{'fitted':>14}{'default':>14}")
    defaults = dict(cost_model.DEFAULTS.items())
    for name, value in coef.items():
        print(f"{name:<14}{value:>14}{defaults[name]:>14}")
    print(f"forward fit, relative RMS error of the integer model on the forwards: prefill {rms_pre:.4f}, "
          f"decode {rms_dec:.4f}")
    errors = iteration_errors(samples, coef)
    print(f"iteration fit on {len(samples.chunk_gaps)} back-to-back chunk, {len(samples.decode_gaps)} steady decode "
          f"and {len(samples.switch_decode_gaps)}+{len(samples.switch_chunk_gaps)} alternation gaps; median relative error on iteration wall time "
          f"(whole model / forward terms only): chunk {errors['chunk'][0]:+.4f} / {errors['chunk'][1]:+.4f}, "
          f"decode {errors['decode'][0]:+.4f} / {errors['decode'][1]:+.4f}")
    for note in notes:
        print(f"note: {note}")
    print("profile line:")
    print(cost_model.profile_line(coef))
    return 0


def add_arguments(parser: object) -> None:
    """The subcommand's arguments (``adapter/ops/cli.py`` builds the subparser and calls :func:`run`)."""
    parser.add_argument("log", help="forward-pass-metrics log: one ForwardPassMetrics JSON object per line")  # type: ignore[attr-defined]
    parser.add_argument(  # type: ignore[attr-defined]
        "--topk", type=int, default=cost_model.DEFAULTS.topk,
        help=f"K of the sparse attention (default {cost_model.DEFAULTS.topk}; 0 = dense, no top-k terms)",
    )


def run(args: object) -> int:
    topk = args.topk  # type: ignore[attr-defined]
    if topk < 0:
        print(f"error: --topk={topk} is not valid: expected an integer >= 0 (0 = dense)", file=sys.stderr)
        return 2
    return main(args.log, topk)  # type: ignore[attr-defined]

