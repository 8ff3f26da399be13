"""Chat traffic that loads a kit: its stock capacity measured in the same run, offered loads as
fractions of it (the gate's latency leg, :mod:`devkit.gate.latency`, and ``bench chat-latency --sweep``).

One boot of a kit serves several client runs (:class:`Session`). SGLang's client flushes the
server's cache before each (``--flush-cache``), so every run starts from an empty cache, and the
switch's counters are read from ``/metrics`` before and after it: their difference is the run's.

The capacity is the request throughput a stock boot sustains when every conversation arrives at
once (``--request-rate inf``, :func:`burst`). An offered load is a fraction of it: conversations
arrive at ``fraction x capacity / turns`` a second (a conversation sends its turns one after
another, each when the previous answer completes, so it offers ``turns`` requests).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devkit.bench.chat_latency import METRICS_ARGS, client_args, run_client, window_counts
from devkit.engine_kit import metrics_page
from devkit.engine_kit.serving_client import ServingClient

# Longer answers than the light chat shape, lengths drawn per conversation (bench_serving's
# --gsp-range-ratio: each length from [ratio x it, it]) and several turns, so streams decode beside
# most prefills. DSV4: its kit runs 3 rows at about 50 ms a step, so shorter answers and fewer turns
# keep a run within a minute there.
LOAD_TRAFFIC = {
    "mellum": {"groups": 3, "per_group": 4, "system": 768, "question": 96, "output": 64, "turns": 4, "range_ratio": 0.5},
    "dsv4": {"groups": 2, "per_group": 4, "system": 512, "question": 64, "output": 32, "turns": 3, "range_ratio": 0.5},
}
FULL_SCALE = 2  # the full (not --quick) traffic: this many times the quick one's conversations
# The switch's counters per run (docs/metrics.md); a counter the page lacks reads 0.
YIELD_COUNTERS = {
    "windows": "dsv41_decode_yield_windows_total",
    "windows_cut": "dsv41_decode_yield_windows_cut_total",
    "windows_guarded": "dsv41_decode_yield_windows_guarded_total",  # armed below pct by the load guard
    "steps_given": "dsv41_decode_yield_steps_given_total",
    "steps_cut": "dsv41_decode_yield_steps_cut_total",
    "bursts": "dsv41_decode_yield_bursts_total",
    "unbounded": "dsv41_decode_yield_prompts_unbounded_total",
}


def load_traffic(kit_name: str, quick: bool) -> dict[str, Any]:
    """The loading chat traffic of a kit (its rate set per run)."""
    if kit_name not in LOAD_TRAFFIC:
        raise ValueError(f"--model {kit_name!r} is invalid: expected one of {', '.join(LOAD_TRAFFIC)}")
    traffic = dict(LOAD_TRAFFIC[kit_name])
    if not quick:
        traffic["per_group"] *= FULL_SCALE
    return traffic


def burst(traffic: dict[str, Any]) -> dict[str, Any]:
    """``traffic`` with every conversation arriving at once: what a boot sustains saturated."""
    return {**traffic, "rate": "inf"}


def capacity(figures: dict[str, Any]) -> float:
    """The request throughput of a burst run (requests a second, every turn counted)."""
    value = figures.get("request_throughput")
    if not value or value <= 0:
        raise ValueError(f"the capacity run measured request_throughput={value!r}: expected a positive figure")
    return float(value)


def load_schedule(capacity_req_s: float, turns: int, fractions: Sequence[float]) -> list[dict[str, float]]:
    """Per fraction of ``capacity_req_s``: the offered requests a second and the conversations a
    second that offer them (``--request-rate``)."""
    if not capacity_req_s > 0:
        raise ValueError(f"capacity={capacity_req_s!r} is invalid: expected requests a second > 0")
    if not isinstance(turns, int) or turns < 1:
        raise ValueError(f"turns={turns!r} is invalid: expected an integer >= 1")
    bad = [f for f in fractions if not 0 < f <= 1]
    if bad or not fractions:
        raise ValueError(f"fractions={list(fractions)!r} are invalid: expected fractions of the capacity in (0, 1]")
    return [{"fraction": f, "offered_req_s": round(f * capacity_req_s, 3), "rate": round(f * capacity_req_s / turns, 4)}
            for f in fractions]


@dataclass
class Run:
    """One client run against a boot: bench_serving's figures and the switch's counters over it."""

    name: str
    traffic: dict[str, Any]
    figures: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None


class Session:
    """One boot of a chat kit (``with``: started, then stopped with its whole process group) and the
    client runs sent to it (:meth:`send`)."""

    def __init__(self, kit: Any, model: Path, label: str, profile: dict[str, str], out: Path,
                 client: ServingClient, say: Callable[[str], None] = print):
        self.label, self.profile, self.out, self.client, self.say = label, profile, out, client, say
        self.safe = re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-")
        self.model = model
        boot_profile = {**profile, "DSV41_DEBUG_LOG": "1"} if profile else {}  # window lines; stock stays stock
        self.server = kit.server(model, out / f"{self.safe}.log", boot_profile, list(METRICS_ARGS))
        self.error: str | None = None
        self.windows: dict[str, Any] = {}

    def __enter__(self) -> Session:
        try:
            self.server.start()
        except Exception as exc:  # a failed boot is a boot that says so; the caller's other boots still run
            self.error = _why(exc)
        return self

    def __exit__(self, *exc: Any) -> None:
        leftover = self.server.stop()
        if leftover:
            self.say(f"  {self.label}: had to kill {len(leftover)} late processes")
        self.windows = window_counts(self.server.log_lines())

    def send(self, name: str, traffic: dict[str, Any]) -> Run:
        """One client run of ``traffic`` from an empty cache; its figures and counters."""
        run = Run(name, traffic)
        if self.error:
            run.error = f"boot failed: {self.error}"
            self.say(f"  {self.label} {name}: {run.error}")
            return run
        stem = self.out / f"{self.safe}-{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-')}"
        out_file, client_log = stem.with_suffix(".json"), stem.with_suffix(".client.txt")
        out_file.unlink(missing_ok=True)
        t0 = time.monotonic()
        try:
            before = self._counters()
            argv = [*client_args(self.server.base_url, self.model, out_file, traffic), "--flush-cache"]
            run.figures, run.error = run_client(self.client, argv, out_file, client_log)
            if run.error is None:
                after = self._counters()
                run.counters = {k: int(after[k] - before[k]) for k in YIELD_COUNTERS}
        except Exception as exc:
            run.error = _why(exc)
        run.wall_s = round(time.monotonic() - t0, 1)
        f = run.figures
        self.say(f"  {self.label} {name} (rate {traffic['rate']}/s): " + (run.error or (
            f"TTFT {f['mean_ttft_ms']} / p99 {f['p99_ttft_ms']} ms, ITL {f['mean_itl_ms']} / p99 {f['p99_itl_ms']} ms, "
            f"{f['request_throughput']} req/s; windows {run.counters.get('windows', 0)} "
            f"(cut {run.counters.get('windows_cut', 0)}) ({run.wall_s:.0f} s)")))
        return run

    def _counters(self) -> dict[str, float]:
        values = metrics_page.read_counters(self.server.base_url, YIELD_COUNTERS.values())
        return {key: values[name] for key, name in YIELD_COUNTERS.items()}


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
