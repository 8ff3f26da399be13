"""``python -m adapter bench metrics-overhead [--quick]``: what the metrics cost a process that does
not export them (SGLang without ``--enable-metrics``).

The metrics add, on the paths a switch runs per action, one call of
:func:`adapter.core.metrics.observe` inside :func:`adapter.core.receipts.event` and one
``api.metrics_on()`` test at the sites that skip a DEBUG line (decode yield's window line, SWA
thin's per-insert totals, native decode's served / fallback calls, KV park's park and restore
lines). With metrics off both return at the first attribute test (the decision is made once the
engine has published its configuration).

Measured side by side in one process, interleaved in rounds (A, B, A, B, ...); each figure is the
least disturbed round's mean per call (the machine is shared), and ``noise_ns`` is how far the
median round of the stock site is above its best:

* ``event_ns``: a DEBUG ``receipts.event`` that the logger drops (the kv_park ``declined`` /
  ``evicted`` line on a production log level), with the metrics hook (A) and with it bypassed (B);
* ``site_test_ns``: the site test ``api.metrics_on()`` (A) against a constant ``False`` (B);
* ``pass_ns``: decode yield's window-end site as it is now, ``if debug or api.metrics_on():``
  with DEBUG and metrics off (A), against the site before the metrics, ``if debug:`` (B).

The figure that answers "no added per-pass cost" is ``added_per_pass_ns`` (A - B of one pass's
worth of the added calls: one site test and one dropped event per window end, which happens at
most once per scheduler pass) next to ``noise_ns``.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

from adapter.core import api, metrics, receipts


class _NoHook:
    @staticmethod
    def observe(switch: str, what: str, params: Any) -> None:
        return None


def _time(fn: Any, n: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - start) / n


def run(quick: bool = False) -> dict[str, Any]:
    n, rounds = (20_000, 7) if quick else (200_000, 15)
    receipts.logger().setLevel(logging.INFO)  # production: DEBUG lines are dropped
    saved = metrics.STATE.decided, metrics.STATE.on
    metrics.STATE.decided, metrics.STATE.on = True, False  # the engine published: metrics off
    real_metrics = receipts.metrics

    debug = False  # production: DSV41_DEBUG_LOG unset

    def event() -> None:
        receipts.event("kv_park", "declined", level=logging.DEBUG, key="r1", bytes=4096, why="parking_disabled")

    def site_test() -> None:
        if api.metrics_on():
            raise AssertionError("metrics are off in this benchmark")

    def stock_site_test() -> None:
        if debug:  # the stock site: a constant test
            raise AssertionError

    def window_end() -> None:  # decode yield's window end now: DEBUG off, metrics off
        if debug or api.metrics_on():
            receipts.event("decode_yield", "window", level=logging.DEBUG, n=4, given=4, ended="served")

    def stock_window_end() -> None:  # the site before the metrics: `if debug:`
        if debug:
            receipts.event("decode_yield", "window", level=logging.DEBUG, n=4, given=4, ended="served")

    figures: dict[str, list[float]] = {k: [] for k in ("event_a", "event_b", "test_a", "test_b", "pass_a", "pass_b")}
    try:
        for _ in range(rounds):
            receipts.metrics = real_metrics
            figures["event_a"].append(_time(event, n))
            figures["pass_a"].append(_time(window_end, n))
            receipts.metrics = _NoHook  # type: ignore[assignment]
            figures["event_b"].append(_time(event, n))
            figures["pass_b"].append(_time(stock_window_end, n))
            figures["test_a"].append(_time(site_test, n))
            figures["test_b"].append(_time(stock_site_test, n))
    finally:
        receipts.metrics = real_metrics
        metrics.STATE.decided, metrics.STATE.on = saved
    med = {k: min(v) for k, v in figures.items()}  # the least disturbed round (a shared machine)
    noise = statistics.median(figures["pass_b"]) - min(figures["pass_b"])
    added = med["pass_a"] - med["pass_b"]
    rows = [("dropped DEBUG event", med["event_a"], med["event_b"]), ("site test", med["test_a"], med["test_b"]),
            ("window end (test + event)", med["pass_a"], med["pass_b"])]
    print(f"{'path':<28}{'metrics hook ns':>16}{'stock ns':>10}{'added ns':>10}")
    for name, a, b in rows:
        print(f"{name:<28}{a:>16.1f}{b:>10.1f}{a - b:>10.1f}")
    print(f"per pass (at most one window end per scheduler pass): added {added:.1f} ns, noise (median - best "
          f"round of stock) {noise:.1f} ns; {rounds} rounds of {n} calls")
    return {
        "event_ns": round(med["event_a"], 1), "event_stock_ns": round(med["event_b"], 1),
        "site_test_ns": round(med["test_a"], 1), "site_test_stock_ns": round(med["test_b"], 1),
        "pass_ns": round(med["pass_a"], 1), "pass_stock_ns": round(med["pass_b"], 1),
        "added_per_pass_ns": round(added, 1), "noise_ns": round(noise, 1), "rounds": rounds, "calls": n,
    }
