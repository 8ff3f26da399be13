"""``python -m adapter bench chat-latency --sweep [--quick] [--model mellum|dsv4]``: stock, decode
yield alone and the shipped profile at offered loads from a quarter of the kit's stock capacity to
all of it.

The traffic is the gate's latency leg's (:mod:`devkit.bench.chat_latency.load`). One boot per row;
each boot first serves a burst (every conversation at once); the stock row's burst throughput is
the capacity, and every row then serves the same schedule (:func:`load.load_schedule` of
:data:`FRACTIONS`), lowest load first, each run from an empty cache. Per row and load: mean / p99
TTFT, mean / p99 ITL, request throughput, the TTFT over stock's at that load against the bound
``1 / (1 - pct)``, and from the switch's counters the windows given, cut by the prompts' bound and armed
below pct by the load guard, the steps given and cut, and the prompts it counted past their bound. One boot of each row (no second stock boot): the
figures carry this machine's noise, which the gate's latency leg measures with its two controls.
"""

from __future__ import annotations

import time
from typing import Any

from devkit.bench.chat_latency import CHAT_KITS, OUT, bound, client_env
from devkit.bench.chat_latency import load as chat_load
from devkit.engine_kit.serving_client import ServingClient

FRACTIONS = (0.25, 0.5, 0.75, 1.0)
QUICK_FRACTIONS = (0.25, 1.0)
COLUMNS = ("mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "request_throughput")
COUNTERS = ("windows", "windows_cut", "windows_guarded", "steps_given", "steps_cut", "unbounded")


def rows(kit_name: str, quick: bool) -> list[tuple[str, dict[str, str]]]:
    """(label, profile) per row, stock first: the shipped profile's keys and its decode yield alone."""
    from devkit.gate import shipped

    profile = shipped.profile(kit_name)
    pct = profile["DSV41_DECODE_YIELD"]
    if quick:
        return [("stock", {}), ("profile", profile)]
    return [("stock", {}), (f"yield {pct}", {"DSV41_DECODE_YIELD": pct}), ("profile", profile)]


def run(quick: bool = False, model: str = "mellum") -> dict[str, Any]:
    t0 = time.monotonic()
    if model not in CHAT_KITS:
        raise ValueError(f"--model {model!r} is invalid: expected one of {', '.join(CHAT_KITS)}")
    traffic = chat_load.load_traffic(model, quick)
    labelled = rows(model, quick)
    fractions = QUICK_FRACTIONS if quick else FRACTIONS
    out = (OUT / f"{model}-sweep").resolve()
    out.mkdir(parents=True, exist_ok=True)
    kit = CHAT_KITS[model]
    kit_model = kit.model(out)
    print(f"chat-latency --sweep: {model} kit, rows {', '.join(x for x, _ in labelled)}; "
          f"{traffic['groups'] * traffic['per_group']} conversations of {traffic['turns']} turns a run "
          f"(answers up to {traffic['output']} tokens), loads {', '.join(map(str, fractions))} of stock's burst "
          f"throughput; logs in {out}")
    schedule: list[dict[str, float]] | None = None
    stock_capacity = 0.0
    results: list[dict[str, Any]] = []
    bursts: dict[str, Any] = {}  # each row's request throughput with every conversation at once
    with ServingClient(client_env(), out) as client:
        for label, profile in labelled:
            with chat_load.Session(kit, kit_model, label, profile, out, client) as session:
                saturated = session.send("burst", chat_load.burst(traffic))
                bursts[label] = saturated.figures.get("request_throughput")
                if schedule is None:  # the stock row: its burst is the capacity
                    if saturated.error:
                        raise ValueError(f"the stock burst failed ({saturated.error}): no capacity to sweep from")
                    stock_capacity = chat_load.capacity(saturated.figures)
                    schedule = chat_load.load_schedule(stock_capacity, traffic["turns"], fractions)
                for point in schedule:
                    r = session.send(f"load {point['fraction']}", {**traffic, "rate": point["rate"]})
                    results.append({"row": label, **point, **{k: r.figures.get(k) for k in COLUMNS},
                                    "counters": r.counters, "error": r.error, "bound": bound(profile)})
    stock = {x["fraction"]: x["mean_ttft_ms"] for x in results if x["row"] == "stock"}
    for x in results:
        ttft, base = x["mean_ttft_ms"], stock.get(x["fraction"])
        x["ttft_ratio"] = round(ttft / base, 2) if ttft is not None and base else None
    print_table(results)
    wall = round(time.monotonic() - t0, 1)
    print("burst request throughput (every conversation at once): "
          + ", ".join(f"{label} {value}" for label, value in bursts.items()))
    print(f"chat-latency --sweep: stock capacity {stock_capacity} req/s; {wall:.0f} s")
    return {"model": model, "sweep": True, "traffic": traffic, "capacity_req_s": stock_capacity, "bursts": bursts,
            "schedule": schedule, "rows": results, "wall_s": wall}


def print_table(results: list[dict[str, Any]]) -> None:
    from adapter.ops.table import render

    header = ["row", "load", "offered req/s", "mean TTFT ms", "p99 TTFT", "mean ITL", "p99 ITL", "req/s",
              "TTFT / stock", "bound", "windows", "cut", "guarded", "steps given", "steps cut", "counted"]

    def cell(value: Any) -> str:
        return "-" if value is None else str(value)

    lines = [[x["row"], cell(x["fraction"]), cell(x["offered_req_s"]), *(cell(x[k]) for k in COLUMNS),
              cell(x["ttft_ratio"]), cell(x["bound"]), *(cell(x["counters"].get(k)) for k in COUNTERS)]
             for x in results]
    print(render(header, lines, align="left"))
    for x in results:
        if x["error"]:
            print(f"{x['row']} at {x['fraction']}: {x['error']}")
