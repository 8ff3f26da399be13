"""The engine benchmark's load-independent clock: the scheduler's CPU seconds from /proc."""

from __future__ import annotations

import os
import time

from devkit.bench import BENCHMARKS
from devkit.bench import decode_yield_engine as bench


def test_the_clock_counts_cpu_seconds_of_the_process_not_wall_time_it_waits():
    assert BENCHMARKS["decode-yield-engine"] == "devkit.bench.decode_yield_engine:run"
    clock = bench.SchedulerClock(os.getpid()).start()
    try:
        t0 = time.monotonic()
        time.sleep(0.3)  # waiting: wall time passes, CPU time barely
        t1 = time.monotonic()
        while time.monotonic() - t1 < 0.3:  # busy: CPU time passes too
            sum(range(1000))
        t2 = time.monotonic()
        time.sleep(0.1)
    finally:
        clock.stop()
    waited, busy = clock.at(t1) - clock.at(t0), clock.at(t2) - clock.at(t1)
    assert waited < 0.1 and busy > 0.05  # a busy process on a loaded machine still gets some CPU
    assert clock.at(t0 - 10) == clock.samples[0][1] and clock.at(t2 + 10) == clock.samples[-1][1]


def test_share_and_ttft_in_cpu_seconds_take_the_load_out():
    """Streams decoding 100 tokens per CPU second before and 50 during give a CPU share of 0.5
    whatever the wall rates say (here the machine was twice as loaded during the prefill)."""
    clock = bench.SchedulerClock(0)
    clock.samples = [(0.0, 0.0), (2.0, 1.0), (6.0, 2.0)]  # (wall, CPU): 0.5 CPU/s, then 0.25 CPU/s
    phase = {"times": {"before": 0.0, "send": 2.0, "first": 6.0, "end": 6.0},
             "decode_rate_before": 50.0, "decode_rate_during": 12.5}  # wall tokens/s
    figures = bench.cpu_figures(phase, clock)
    assert figures == {"share_cpu": 0.5, "ttft_cpu_s": 1.0}
