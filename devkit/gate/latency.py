"""The gate's latency leg: ``python -m adapter gate --latency [--quick] [--model mellum|dsv4]``.

Multi-turn chat traffic from SGLang's own client (``sglang.benchmark.serving --backend
sglang-oai-chat --dataset-name generated-shared-prefix``, :mod:`devkit.bench.chat_latency`)
against three boots of the kit with the gate's launcher settings: A1 stock, B the release gate's
profile, A2 stock. Per boot: mean and p99 TTFT, mean and p99 ITL. The profile passes when

* mean and p99 TTFT are at most ``1 / (1 - pct)`` of stock's (the mean of the two controls) plus
  one window (the longest window the profile boot's decode-yield lines report: its steps at its
  step), pct being the profile's ``DSV41_DECODE_YIELD``;
* mean and p99 ITL are no worse than stock's, within :data:`ITL_TOLERANCE`.

The two controls must agree (each TTFT and ITL figure within a factor :data:`CONTROL_FACTOR` of the
other); if they do not, the machine moved under the run and the leg is INVALID, not a pass. The
judgement (:func:`judge`) is a pure function of the recorded figures. The last line printed is one
JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ITL_TOLERANCE = 0.10  # the profile's ITL may read this much above stock's (machine noise)
CONTROL_FACTOR = 2.0  # the two stock boots' figures may differ by this factor (machine noise: 1.9 seen on a quiet one)
TTFT_KEYS = ("mean_ttft_ms", "p99_ttft_ms")
ITL_KEYS = ("mean_itl_ms", "p99_itl_ms")


def judge(a1: dict[str, float], a2: dict[str, float], b: dict[str, float], pct: int | None,
          window_ms: float = 0.0) -> dict[str, Any]:
    """PASS / FAIL / INVALID of the profile boot ``b`` against the stock boots ``a1`` and ``a2``
    (each: :data:`TTFT_KEYS` and :data:`ITL_KEYS` in ms), with the reasons."""
    bound = 1.0 if pct is None else 100 / (100 - pct)
    disagree = [k for k in TTFT_KEYS + ITL_KEYS
                if a1.get(k) is None or a2.get(k) is None
                or max(a1[k], a2[k]) > CONTROL_FACTOR * max(min(a1[k], a2[k]), 1e-9)]
    missing = [k for k in TTFT_KEYS + ITL_KEYS if b.get(k) is None]
    stock = {k: statistics.fmean([a1[k], a2[k]]) for k in TTFT_KEYS + ITL_KEYS if k not in disagree}
    limits: dict[str, float] = {}
    fails: list[str] = []
    for k in TTFT_KEYS:
        if k in stock:
            limits[k] = round(bound * stock[k] + window_ms, 1)
    for k in ITL_KEYS:
        if k in stock:
            limits[k] = round(stock[k] * (1 + ITL_TOLERANCE), 1)
    for k, limit in limits.items():
        if b.get(k) is not None and b[k] > limit:
            fails.append(f"{k} {b[k]:.1f} > {limit:.1f}")
    if missing:
        verdict = "FAIL"
        fails = [f"profile boot has no {', '.join(missing)}", *fails]
    elif disagree:
        verdict = "INVALID"
    else:
        verdict = "FAIL" if fails else "PASS"
    return {"verdict": verdict, "bound": round(bound, 3), "window_ms": window_ms, "stock": stock, "limits": limits,
            "fails": fails, "controls_disagree": disagree}


def run(quick: bool = True, model_kit: str = "mellum", out: str | Path | None = None,
        say: Callable[[str], None] = print, profile: dict[str, str] | None = None) -> dict[str, Any]:
    """Boot A1 stock, B ``profile`` (default the gate's, uncalibrated), A2 stock; chat traffic
    against each; judge."""
    from adapter.ops.table import render
    from devkit.bench import chat_latency as cl

    t0 = time.monotonic()
    profile = dict(profile) if profile is not None else cl.gate_profile(model_kit)
    pct = int(profile["DSV41_DECODE_YIELD"]) if "DSV41_DECODE_YIELD" in profile else None
    traffic = cl.QUICK_TRAFFIC if quick else cl.TRAFFIC
    out = Path(out) if out else cl.OUT.parent / "gate" / f"{model_kit}-latency"
    say(f"gate latency: {model_kit} kit; {traffic['groups'] * traffic['per_group']} conversations of "
        f"{traffic['turns']} turns at {traffic['rate']}/s; profile: " + " ".join(f"{k}={v}" for k, v in profile.items()))
    boots = cl.measure(model_kit, [("A1-stock", {}), ("B-profile", profile), ("A2-stock", {})], 1, traffic, out, say)
    a1, b, a2 = boots
    errors = [f"{x.label}: {x.error}" for x in boots if x.error]
    result = judge(a1.figures, a2.figures, b.figures, pct, b.windows.get("longest_ms", 0.0))
    # per request (informative): B's requests past the bound x their stock TTFT plus its longest
    # window, those the switch counted, and each control's against the other (the noise floor)
    per_boot = {r["row"]: (r["past_bound"] or [None])[0] for r in cl.summarize(boots)}
    if errors:
        result["verdict"], result["fails"] = "FAIL", errors + result["fails"]
    header = ["boot", *TTFT_KEYS, *ITL_KEYS, "windows", "past bound", "counted"]
    rows = [[x.label, *(str(x.figures.get(k, "-")) for k in TTFT_KEYS + ITL_KEYS), str(x.windows.get("windows", 0)),
             str(per_boot.get(x.label, "-")), str(x.counted.get("unbounded", "-") if x.profile else "-")]
            for x in boots]
    rows.append(["limit (B)", *(str(result["limits"].get(k, "-")) for k in TTFT_KEYS + ITL_KEYS), "", "", ""])
    say(render(header, rows, align="left"))
    if result["controls_disagree"]:
        say(f"controls disagree on {', '.join(result['controls_disagree'])} -> INVALID (machine noise)")
    for reason in result["fails"]:
        say(f"FAIL: {reason}")
    say(f"gate latency: {result['verdict']} in {time.monotonic() - t0:.0f} s")
    return {**result, "model": model_kit, "quick": quick, "profile": profile,
            "boots": {x.label: {**{k: x.figures.get(k) for k in TTFT_KEYS + ITL_KEYS}, "windows": x.windows,
                                "past_bound": per_boot.get(x.label), "counted": x.counted, "error": x.error}
                      for x in boots},
            "wall_s": round(time.monotonic() - t0, 1)}


def main(args: Any) -> int:
    try:
        figures = run(quick=args.quick, model_kit=args.model, out=args.out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(figures, sort_keys=False))
    return 0 if figures["verdict"] == "PASS" else 1
