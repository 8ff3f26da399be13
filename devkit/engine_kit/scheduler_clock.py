"""A server's scheduler process's CPU seconds (``/proc``): a workload's share and TTFT with the
machine's load taken out (``bench decode-yield-engine``)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any


class SchedulerClock:
    """The scheduler process's CPU time (``/proc/<pid>/stat`` utime + stime), sampled every 20 ms.

    On a shared 2-core machine the wall clock measures the other tenants as much as the engine (their
    load can move several-fold within a boot). The scheduler is one process with one torch thread,
    so its CPU seconds are what its iterations cost whatever the load: the share and the TTFT in
    scheduler CPU time are the same figures with the load taken out (resolution: 10 ms ticks)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.samples: list[tuple[float, float]] = []
        self._tick = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler-clock", daemon=True)

    def cpu(self) -> float | None:
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime, stime

    def _run(self) -> None:
        while not self._stop.is_set():
            value = self.cpu()
            if value is not None:
                self.samples.append((time.monotonic(), value))
            time.sleep(0.02)

    def start(self) -> SchedulerClock:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def at(self, t: float) -> float:
        """CPU seconds at wall instant ``t`` (linear between the samples around it)."""
        import bisect

        i = bisect.bisect_left(self.samples, (t, -1.0))
        if i == 0:
            return self.samples[0][1]
        if i >= len(self.samples):
            return self.samples[-1][1]
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1

    @staticmethod
    def find(group: int) -> int | None:
        """The scheduler's pid among the server's processes (its name is ``sglang::scheduler``)."""
        from devkit.engine_kit import launcher

        for pid in launcher.members(group):
            try:
                if Path(f"/proc/{pid}/comm").read_text().startswith("sglang::schedul"):
                    return pid
            except OSError:
                continue
        return None


def cpu_figures(phase: dict[str, Any], clock: SchedulerClock) -> dict[str, Any]:
    """The phase's share and TTFT in scheduler CPU seconds (see :class:`SchedulerClock`)."""
    t = phase["times"]
    before_cpu = clock.at(t["send"]) - clock.at(t["before"])
    during_cpu = clock.at(t["end"]) - clock.at(t["send"])
    wall_before, wall_during = t["send"] - t["before"], t["end"] - t["send"]
    tokens_before = (phase["decode_rate_before"] or 0) * wall_before
    tokens_during = (phase["decode_rate_during"] or 0) * wall_during
    share = None
    if before_cpu > 0 and during_cpu > 0 and tokens_before > 0:
        share = round((tokens_during / during_cpu) / (tokens_before / before_cpu), 4)
    return {"share_cpu": share, "ttft_cpu_s": round(clock.at(t["first"]) - clock.at(t["send"]), 3)}
