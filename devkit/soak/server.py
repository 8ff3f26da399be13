"""What the soak reads from a server under traffic: the probes' greedy outputs, the scheduler
process's RSS (sampled on a thread) and the failures and overlay counts in its log."""

from __future__ import annotations

import random
import re
import threading
import time
from pathlib import Path
from typing import Any

from devkit.soak.traffic import Tally

RSS_EVERY_S = 2.0
WARMUP_FRACTION = 0.2  # the reported RSS growth is from the sample at this share of the soak (the verdict: .memory)
# Log lines that are failures wherever they appear.
_LEAK = re.compile(r"memory leak detected|sanity check|sanity_check.*(fail|error)|AssertionError", re.I)
_ERROR = re.compile(r"\bERROR\b|Traceback \(most recent call last\)|\bException\b")
# What SGLang logs for the disconnects and aborts the traffic makes on purpose (not errors).
_EXPECTED = re.compile(r"abort|disconnect|Cancelled|CancelledError", re.I)
# SGLang 0.5.23 posts /freeze_gc to itself right after startup with --skip-server-warmup, sometimes
# before uvicorn listens: a logged traceback at boot, on stock and profile boots alike.
_BOOT_NOISE = "post-warmup freeze_gc failed"


PROBES = ((64, 12), (200, 12), (700, 12), (1500, 8))  # (prompt tokens, new tokens), seeded ids


def probe_prompts(seed: int, vocab: int = 1024) -> list[tuple[list[int], int]]:
    from devkit.engine_kit.workload import FIRST_ID

    rng = random.Random(f"probe:{seed}")
    return [([rng.randrange(FIRST_ID, vocab) for _ in range(n)], new) for n, new in PROBES]


def run_probes(base_url: str, seed: int, vocab: int = 1024) -> list[list[int]]:
    from devkit.engine_kit import client

    client.flush_cache(base_url)
    return [client.generate(base_url, ids, new, 300)["output_ids"] for ids, new in probe_prompts(seed, vocab)]


def scheduler_pid(group: int) -> int | None:
    """The scheduler process of a server's process group (its title names it)."""
    from devkit.engine_kit import launcher

    for pid in launcher.members(group):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "scheduler" in title.lower():
            return pid
    return None


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class RssSampler:
    """Samples a process's RSS on its own thread: (seconds since start, served so far, KiB)."""

    def __init__(self, pid: int | None, tally: Tally):
        self.pid, self.tally = pid, tally
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)

    def start(self) -> RssSampler:
        self.sample()
        self._thread.start()
        return self

    def sample(self) -> None:
        if self.pid is not None and (kib := rss_kib(self.pid)) is not None:
            self.samples.append((time.monotonic() - self._t0, self.tally.served, kib))

    def _run(self) -> None:
        while not self._stop.wait(RSS_EVERY_S):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sample()

    def figures(self, seconds: float) -> dict[str, Any]:
        if not self.samples:
            return {"rss_peak_mib": None, "rss_final_mib": None, "rss_warm_mib": None, "rss_growth_pct": None,
                    "rss_growth_mib_per_1000_requests": None, "rss_low_water_mib": None}
        warm_at = seconds * WARMUP_FRACTION
        warm = next((s for s in self.samples if s[0] >= warm_at), self.samples[-1])
        final = self.samples[-1]
        after = [s for s in self.samples if s[0] >= warm[0]]
        served = max(final[1] - warm[1], 1)
        return {
            "rss_warm_mib": round(warm[2] / 1024, 1),
            "rss_peak_mib": round(max(s[2] for s in self.samples) / 1024, 1),
            "rss_final_mib": round(final[2] / 1024, 1),
            "rss_low_water_mib": round(min(s[2] for s in after) / 1024, 1),
            "rss_growth_pct": round((final[2] - warm[2]) / warm[2] * 100, 2),
            "rss_growth_mib_per_1000_requests": round((final[2] - warm[2]) / 1024 / served * 1000, 2),
            "rss_samples": len(self.samples),
        }


def read_log(lines: list[str]) -> dict[str, Any]:
    """Failures and overlay counts in a server log (``retraction_split``: what kv_park did with each
    retraction, :func:`adapter.switches.kv_park.outcomes.retraction_split`)."""
    from adapter.switches.kv_park import outcomes

    leaks = [ln.strip() for ln in lines if _LEAK.search(ln)]
    errors, noise = [], False
    for ln in lines:
        if _BOOT_NOISE in ln:  # its traceback runs until the next timestamped line
            noise = True
            continue
        if noise and ln.startswith("[20"):
            noise = False
        if not noise and _ERROR.search(ln) and not _EXPECTED.search(ln):
            errors.append(ln.strip())
    def count(what: str) -> int:
        return sum(1 for ln in lines if f"[dsv41] kv_park {what}" in ln)
    return {
        "leak_reports": len(leaks), "leak_lines": leaks[:5],
        "log_errors": len(errors), "log_error_lines": errors[:8],
        "retractions": sum(1 for ln in lines if "Testing retraction" in ln),
        "kv_park": {w: count(w) for w in ("parked", "restored", "declined", "evicted", "disabled", "unsupported")},
        "retraction_split": outcomes.retraction_split(lines),
        "kv_park_over_budget": sum(1 for ln in lines if "[dsv41] kv_park declined" in ln and "budget" in ln),
        "refused_switches": [ln.strip() for ln in lines if "[dsv41]" in ln and " refused: " in ln][:5],
    }
