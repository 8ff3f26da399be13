"""The gate's latency leg: ``python -m adapter gate --latency [--quick] [--model mellum|dsv4] [--set-key K=V]``.

SGLang's own client (``sglang.benchmark.serving --backend sglang-oai-chat --dataset-name
generated-shared-prefix``) sends chat traffic that loads the kit (:mod:`devkit.bench.chat_latency.load`:
long answers of drawn lengths, several turns) to three boots: A1 stock, B the shipped profile's
switch keys (:mod:`devkit.gate.shipped`, plus ``--set-key``), A2 stock. Each boot first serves a
burst (every conversation at once: its capacity, and the same warm-up on every boot), then the
judged run at :data:`LOAD_FRACTION` of A1's burst throughput, each from an empty cache.

Limits come from the configuration and the controls, never from B (:func:`judge`), pct being the
profile's ``DSV41_DECODE_YIELD``, bound ``1 / (1 - pct)``, slack one window (:data:`WINDOW_STEPS`)
of the step the controls measured (their median ITL):

* the controls agree: mean TTFT and request throughput, and the throughput of their bursts (the
  capacity the load was set from), within :data:`CONTROL_FACTOR` of each other, else INVALID (the
  machine moved under the run);
* B's mean TTFT at most bound x the controls' mean plus the slack;
* B's first turns past bound x that request's TTFT in the controls plus the slack, less those the
  switch counted itself (its ``unbounded`` count: the contract's "within the floor, or counted"), at
  most the stock-vs-stock floor (each control's first turns against the other's); first turns because
  each is sent on the client's schedule in every boot, where a later turn follows its own answer;
* B's request throughput at least the lower control's and its p99 ITL at most the higher one's, each
  within the controls' own spread (at least :data:`FLOOR_MIN`);
* the load guard backs off in B's burst (saturated by construction: every conversation at once): at
  least :data:`BURST_GUARDED` of its windows armed below pct (from :data:`BURST_WINDOWS_MIN` windows).
  Per-prompt bounds already keep B's TTFT within its limit, guard or not; what the guard adds (giving
  less as prefill nears its rate) shows in its own reading, not in the judged run's TTFT.

The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CONTROL_FACTOR = 1.3  # the two stock boots' mean TTFT and throughput may differ by this factor
FLOOR_MIN = 1.05  # the smallest spread granted B against the controls (two stock boots rarely read closer)
LOAD_FRACTION = 0.9  # the judged run's offered load: this fraction of the stock capacity A1 measured
# The slack, one window, in decode steps: what the share at pct 33 asks for a chunk costing 16 steps, twice
# the costliest chunk the kits' window lines report (Mellum chunk 64: 1-2 steps; its windows gave 0-5).
# Not the switch's cap of 128 steps: at the controls' step that is 0.6-11 s on the Mellum kit, 2-40x
# stock's mean TTFT there, and no limit plus it could fail.
WINDOW_STEPS = 8
BURST_GUARDED = 0.5  # of B's burst windows, armed below pct by the load guard
BURST_WINDOWS_MIN = 10  # fewer windows in B's burst: the guard is not judged (said)
# the controls' figures that must agree: the judged run's, and the burst's (the capacity the load is set from)
AGREE_KEYS = ("mean_ttft_ms", "request_throughput", "burst_request_throughput")
SHOWN_KEYS = ("mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "request_throughput")


def first_turns(figures: dict[str, Any], turns: int) -> list[float | None]:
    """Each conversation's first-turn TTFT (bench_serving lists a conversation's turns together)."""
    return list(figures.get("ttfts_ms") or [])[::turns]


def judge(a1: dict[str, Any], a2: dict[str, Any], b: dict[str, Any], pct: int | None, turns: int,
          window_steps: int = WINDOW_STEPS, counted: int = 0, burst: dict[str, int] | None = None) -> dict[str, Any]:
    """PASS / FAIL / INVALID of the profile boot ``b`` against the stock boots ``a1`` and ``a2``, with
    the limits and reasons (each boot: bench_serving's figures, :func:`devkit.bench.chat_latency.figures_of`;
    ``counted``: the prompts B's switch counted past their bound, its ``unbounded`` counter; ``burst``:
    B's switch counters over its burst, ``windows`` and ``windows_guarded``)."""
    from devkit.bench.chat_latency import past_bound

    bound = 1.0 if pct is None else 100 / (100 - pct)
    disagree = [k for k in AGREE_KEYS if not _agree(a1.get(k), a2.get(k))]
    steps = [x.get("median_itl_ms") for x in (a1, a2)]
    step = statistics.fmean([s for s in steps if s is not None]) if any(s is not None for s in steps) else 0.0
    slack = window_steps * step
    limits: dict[str, float] = {}
    fails: list[str] = []
    firsts = {"A1": None, "A2": None, "B": None, "floor": None}
    if not disagree:
        limits["mean_ttft_ms"] = round(bound * statistics.fmean([a1["mean_ttft_ms"], a2["mean_ttft_ms"]]) + slack, 1)
        lo, hi = sorted([a1["request_throughput"], a2["request_throughput"]])
        limits["request_throughput"] = round(lo / max(hi / lo, FLOOR_MIN), 3)
        itl = [x["p99_itl_ms"] for x in (a1, a2) if x.get("p99_itl_ms") is not None]
        if len(itl) == 2:
            limits["p99_itl_ms"] = round(max(itl) * max(max(itl) / max(min(itl), 1e-9), FLOOR_MIN), 1)
        t1, t2, tb = (first_turns(x, turns) for x in (a1, a2, b))
        firsts["A1"] = past_bound(t1, t2, bound, slack)
        firsts["A2"] = past_bound(t2, t1, bound, slack)
        firsts["B"] = past_bound(tb, [_mean2(x, y) for x, y in zip(t1, t2)], bound, slack)
        if firsts["A1"] is not None and firsts["A2"] is not None:
            firsts["floor"] = max(firsts["A1"], firsts["A2"])
    for key, limit in limits.items():
        value = b.get(key)
        if value is None:
            continue
        if key == "request_throughput" and value < limit:
            fails.append(f"{key} {value:.3f} < {limit:.3f}")
        elif key != "request_throughput" and value > limit:
            fails.append(f"{key} {value:.1f} > {limit:.1f}")
    if firsts["B"] is not None:
        firsts["uncounted"] = max(0, firsts["B"] - counted)
        if firsts["floor"] is not None and firsts["uncounted"] > firsts["floor"]:
            fails.append(f"first turns past the bound and not counted by the switch {firsts['uncounted']} "
                         f"({firsts['B']} past, {counted} counted) > the stock-vs-stock floor {firsts['floor']}")
    guard = _burst_guard(pct, burst)
    if guard.get("fail"):
        fails.append(guard["fail"])
    missing = [k for k in ("mean_ttft_ms", "p99_itl_ms", "request_throughput") if b.get(k) is None]
    if missing:
        verdict, fails = "FAIL", [f"profile boot has no {', '.join(missing)}", *fails]
    elif disagree:
        verdict = "INVALID"
    else:
        verdict = "FAIL" if fails else "PASS"
    return {"verdict": verdict, "bound": round(bound, 3), "step_ms": round(step, 2), "window_steps": window_steps,
            "slack_ms": round(slack, 1), "limits": limits, "first_turns_past": firsts, "fails": fails,
            "controls_disagree": disagree, "burst_guard": guard}


def _burst_guard(pct: int | None, burst: dict[str, int] | None) -> dict[str, Any]:
    """The load guard in B's burst: its windows, those it armed below pct, and a failure when fewer
    than :data:`BURST_GUARDED` of them were (not judged without decode yield or with too few windows)."""
    if pct is None or not burst:
        return {"judged": False}
    windows, guarded = int(burst.get("windows") or 0), int(burst.get("windows_guarded") or 0)
    found = {"windows": windows, "guarded": guarded, "judged": windows >= BURST_WINDOWS_MIN}
    if found["judged"] and guarded < BURST_GUARDED * windows:
        found["fail"] = (f"the load guard did not back off in B's burst: {guarded} of {windows} windows armed "
                         f"below pct {pct} (at least {BURST_GUARDED:.0%} expected at saturation)")
    return found


def _agree(x: float | None, y: float | None) -> bool:
    return x is not None and y is not None and min(x, y) > 0 and max(x, y) <= CONTROL_FACTOR * min(x, y)


def _mean2(x: float | None, y: float | None) -> float | None:
    present = [v for v in (x, y) if v is not None]
    return statistics.fmean(present) if present else None


def run(quick: bool = True, model_kit: str = "mellum", out: str | Path | None = None,
        say: Callable[[str], None] = print, set_keys: Sequence[str] = ()) -> dict[str, Any]:
    """Boot A1 stock, B the shipped profile (with ``set_keys``), A2 stock; a burst then the judged run
    against each; judge."""
    from adapter.ops.table import render
    from devkit.bench import chat_latency as cl
    from devkit.bench.chat_latency import load
    from devkit.engine_kit.serving_client import ServingClient
    from devkit.gate import shipped

    t0 = time.monotonic()
    profile = shipped.with_set_keys(shipped.profile(model_kit), set_keys)
    pct = int(profile["DSV41_DECODE_YIELD"]) if "DSV41_DECODE_YIELD" in profile else None
    traffic = load.load_traffic(model_kit, quick)
    out = (Path(out) if out else cl.OUT.parent / "gate" / f"{model_kit}-latency").resolve()
    out.mkdir(parents=True, exist_ok=True)
    kit = cl.CHAT_KITS[model_kit]
    model = kit.model(out)
    say(f"gate latency: {model_kit} kit; {traffic['groups'] * traffic['per_group']} conversations of "
        f"{traffic['turns']} turns (answers up to {traffic['output']} tokens, lengths x{traffic['range_ratio']}-1) "
        f"at {LOAD_FRACTION} of A1's burst throughput; profile ({shipped.PROFILE.name}"
        f"{', --set-key' if set_keys else ''}): " + " ".join(f"{k}={v}" for k, v in profile.items()))
    boots: dict[str, dict[str, Any]] = {}
    rate: float | None = None
    with ServingClient(cl.client_env(), out) as client:
        for label, keys in (("A1-stock", {}), ("B-profile", profile), ("A2-stock", {})):
            if label != "A1-stock" and rate is None:  # A1 measured no capacity: nothing to offer the others
                boots[label] = {"figures": {}, "counters": {}, "error": "not run: A1 measured no capacity",
                                "capacity_req_s": None, "windows": {}}
                continue
            with load.Session(kit, model, label, keys, out, client, say) as session:
                saturated = session.send("burst", load.burst(traffic))
                if label == "A1-stock" and not saturated.error:  # the stock capacity sets every boot's load
                    rate = load.load_schedule(load.capacity(saturated.figures), traffic["turns"], [LOAD_FRACTION])[0]["rate"]
                judged = session.send("load", {**traffic, "rate": rate}) if rate else load.Run("load", traffic, error="no capacity")
            judged.figures["burst_request_throughput"] = saturated.figures.get("request_throughput")
            boots[label] = {"figures": judged.figures, "counters": judged.counters, "error": judged.error,
                            "capacity_req_s": saturated.figures.get("request_throughput"), "windows": session.windows,
                            "burst_counters": saturated.counters}
    a1, b, a2 = (boots[k]["figures"] for k in ("A1-stock", "B-profile", "A2-stock"))
    result = judge(a1, a2, b, pct, traffic["turns"], counted=int(boots["B-profile"]["counters"].get("unbounded") or 0),
                   burst=boots["B-profile"].get("burst_counters"))
    errors = [f"{label}: {x['error']}" for label, x in boots.items() if x["error"]]
    if errors:
        b_failed = boots["B-profile"]["error"] and not boots["B-profile"]["error"].startswith("not run")
        result["verdict"], result["fails"] = "FAIL" if b_failed else "INVALID", errors + result["fails"]
    firsts = result["first_turns_past"]
    header = ["boot", *SHOWN_KEYS, "burst req/s", "windows", "cut", "guarded", "first turns past", "counted"]
    rows = [[label, *(str(x["figures"].get(k, "-")) for k in SHOWN_KEYS), str(x["capacity_req_s"] or "-"),
             *(str(x["counters"].get(k, "-")) for k in ("windows", "windows_cut", "windows_guarded")),
             str(firsts.get(label.partition("-")[0], "-")), str(x["counters"].get("unbounded", "-") if label.startswith("B") else "-")]
            for label, x in boots.items()]
    limit_row = {k: result["limits"].get(k, "-") for k in SHOWN_KEYS}
    rows.append(["limit (B)", *(("≥ " if k == "request_throughput" and v != "-" else "") + str(v)
                                for k, v in limit_row.items()), "", "", "", "", f"≤ {firsts['floor']}", ""])
    say(render(header, rows, align="left"))
    say(f"offered {rate} conversations/s; bound {result['bound']} (pct {pct}); slack {result['slack_ms']} ms "
        f"({WINDOW_STEPS} steps x {result['step_ms']} ms, the controls' median ITL)")
    guard = result["burst_guard"]
    if guard.get("windows") is not None:
        say(f"B's burst: {guard['guarded']} of {guard['windows']} windows armed below pct by the load guard "
            f"(at least {BURST_GUARDED:.0%}" + ("" if guard["judged"] else f"; not judged under {BURST_WINDOWS_MIN} windows") + ")")
    if result["controls_disagree"]:
        say(f"controls disagree on {', '.join(result['controls_disagree'])} (more than x{CONTROL_FACTOR}) -> INVALID")
    for reason in result["fails"]:
        say(f"FAIL: {reason}")
    say(f"gate latency: {result['verdict']} in {time.monotonic() - t0:.0f} s")
    return {**result, "model": model_kit, "quick": quick, "profile": profile, "traffic": {**traffic, "rate": rate},
            "load_fraction": LOAD_FRACTION,
            "boots": {label: {**{k: x["figures"].get(k) for k in SHOWN_KEYS}, "capacity_req_s": x["capacity_req_s"],
                              "counters": x["counters"], "burst_counters": x.get("burst_counters"),
                              "longest_window_ms": x["windows"].get("longest_ms"),
                              "error": x["error"]} for label, x in boots.items()},
            "wall_s": round(time.monotonic() - t0, 1)}


def main(args: Any) -> int:
    try:
        figures = run(quick=args.quick, model_kit=args.model, out=args.out, set_keys=tuple(getattr(args, "set_key", ())))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(figures, sort_keys=False))
    return 0 if figures["verdict"] == "PASS" else 1
