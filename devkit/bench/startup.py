"""``bench startup``: interpreter start cost of ``sitecustomize.py``, against the hook absent.

Three variants of ``python -c pass`` run round-robin (A/B/C interleaved, so machine noise hits all
alike): the repo not on ``PYTHONPATH`` (hook absent), on it with no ``DSV41_*`` key (the stock
fleet's case), and on it with a switch set (the overlay's boot and finder, no engine import).
Figures are medians of the per-round differences against the absent hook.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _env(pythonpath: str | None, switches: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_") and k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env.update(switches)
    return env


def _start_ms(env: dict[str, str]) -> float:
    begin = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    return (time.perf_counter() - begin) * 1e3


def run(quick: bool = False) -> dict[str, object]:
    rounds = 15 if quick else 80
    variants = {
        "absent": _env(None, {}),
        "no_switch": _env(str(ROOT), {}),
        "switch_set": _env(str(ROOT), {"DSV41_AUTOTUNE_KEEP": "1"}),
    }
    for env in variants.values():  # warm the page cache
        _start_ms(env)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, env in variants.items():
            samples[name].append(_start_ms(env))
    deltas = {
        name: statistics.median(s - a for s, a in zip(samples[name], samples["absent"]))
        for name in ("no_switch", "switch_set")
    }
    print(f"interpreter start, {rounds} interleaved rounds (median ms)")
    print(f"{'variant':<12} {'median':>8} {'vs absent':>10}")
    print(f"{'absent':<12} {statistics.median(samples['absent']):>8.2f} {'':>10}")
    for name in ("no_switch", "switch_set"):
        print(f"{name:<12} {statistics.median(samples[name]):>8.2f} {deltas[name]:>+10.2f}")
    return {
        "rounds": rounds,
        "absent_ms": round(statistics.median(samples["absent"]), 2),
        "no_switch_overhead_ms": round(deltas["no_switch"], 2),
        "switch_set_overhead_ms": round(deltas["switch_set"], 2),
        "target_no_switch_ms": 5.0,
        "ok": deltas["no_switch"] < 5.0,
    }
