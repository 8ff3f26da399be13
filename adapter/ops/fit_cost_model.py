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
said so. The coefficients are rounded to integers in the units of :mod:`adapter.switches.decode_yield.cost_model`, and
the command prints the profile line to use.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from adapter.switches.decode_yield import cost_model

MIN_ROWS = 8  # per fit: fewer iterations than this cannot pin four coefficients


class FitError(ValueError):
    """The log cannot be fitted; the message names the file, the line and what is wrong."""


@dataclass
class Samples:
    prefill: list[tuple[int, int, float]]  # (new tokens c, prefix p, seconds)
    decode: list[tuple[int, int, float]]  # (rows B, sum of KV tokens, seconds)
    skipped: dict[str, int]


def read_log(path: str) -> Samples:
    """Parse a forward-pass-metrics JSON-lines log; raise :class:`FitError` naming the bad line."""
    import msgspec
    from sglang.srt.observability.forward_pass_metrics import ForwardPassMetrics

    decoder = msgspec.json.Decoder(ForwardPassMetrics)
    samples = Samples([], [], {"idle": 0, "mixed": 0, "multi_prefill": 0, "no_timing": 0})
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
    a0, a1, a2, a3 = _fit(pre, [t * 1e15 for *_, t in samples.prefill], keep_pre)
    # Decode: t[fs] = STEP_US*1e9 + ROW_NS*1e6*B + KV_PS*1e3*sum(L) + TOPK_KV_PS*1e3*min(sum(L), B*K)
    dec = [[1e9, 1e6 * b, 1e3 * kv, 1e3 * min(kv, b * topk)] for b, kv, _ in samples.decode]
    keep_dec = [True, True, True, bool(topk) and any(kv < b * topk for b, kv, _ in samples.decode)]
    if topk and not keep_dec[3]:
        notes.append(f"TOPK_KV_PS fitted as 0: no decode step has a mean context below K={topk}")
    d0, d1, d2, d3 = _fit(dec, [t * 1e15 for *_, t in samples.decode], keep_dec)
    values = [a0, a1, a2, a3, d0, d1, d2, d3]
    coef = cost_model.Coefficients(*(round(v) for v in values), topk=topk, source="fit")
    return coef, notes


def relative_rms(samples: Samples, coef: cost_model.Coefficients) -> tuple[float, float]:
    """Relative RMS error of the integer model on the prefill and the decode iterations."""
    def rms(errors: list[float]) -> float:
        return (sum(e * e for e in errors) / len(errors)) ** 0.5

    pre = [cost_model.chunk_cost([(c, p)], coef) / (t * 1e15) - 1 for c, p, t in samples.prefill]
    dec = [cost_model.decode_cost(b, kv, min(kv, b * coef.topk), coef) / (t * 1e15) - 1 for b, kv, t in samples.decode]
    return rms(pre), rms(dec)


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
    print(f"relative RMS error of the integer model: prefill {rms_pre:.4f}, decode {rms_dec:.4f}")
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

