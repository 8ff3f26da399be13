"""SGLang's gateway (``smg`` 1.13.0, pinned in constraints.txt) in front of the bench's workers.

:class:`Gateway` is a :class:`devkit.engine_kit.launcher.Server` whose command is ``python -m smg
launch`` (the same interpreter, so the venv's pinned smg) on loopback: its own process group, the
launcher's stop (SIGTERM, SIGKILL, sweep), a free port from the launcher. It is ready once its log
says ``Router ready``, its ``GET /workers`` lists every worker healthy (smg registers workers in
the background after it starts serving) and its load monitor has polled every worker. Why the last:
the monitor's loop starts when the first worker registers and polls at once, the workers then
``Ready`` only (``worker/monitor.rs:869, 1371-1407``), then every ``--load-monitor-interval`` (10 s);
until a worker's first poll, expected wait scores it as the best reporting peer plus its own
in-flight requests (``policies/least_load.rs:316-323``), so it ties at best and every miss of a
client started earlier goes to the first-polled worker or is drawn. Its Prometheus page is on a
second loopback port.

The settings the bench relies on are the installed CLI's defaults, printed on the router's own
``Starting router ... policy: CacheAware { ... }`` line and pinned in :data:`CACHE_AWARE_DEFAULTS`:
:func:`policy_settings` reads that line back from each boot's log, so a drifted smg is seen in the
bench's output rather than assumed.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devkit.engine_kit import launcher

SMG_VERSION = "1.13.0"
READY_LINE = "Router ready"
# smg 1.13.0's CLI defaults for cache_aware (router_args.py RouterArgs; the boot line prints them)
CACHE_AWARE_DEFAULTS = {"cache_threshold": 0.3, "balance_abs_threshold": 64, "balance_rel_threshold": 1.5,
                        "eviction_interval_secs": 60, "max_tree_size": 2**26}
# smg's own counters the bench reports (label sets summed per the named label)
BRANCH_COUNTERS = {
    "cache_aware": ("smg_cache_aware_policy_branch_total", "branch"),
    "consistent_hashing": ("smg_consistent_hashing_policy_branch_total", "branch"),
}
RETRY_COUNTER = "smg_worker_retries_total"
SETTINGS_RE = re.compile(r"policy: (\w+) \{([^}]*)\}")
# a worker's load as the router last polled it: set per worker on each successful poll (metrics.rs:2772)
POLLED_RE = re.compile(r'^smg_engine_running_requests\{[^}]*worker="([^"]+)"', re.M)
ACTIVE_RE = re.compile(r'^smg_worker_requests_active\{worker="([^"]+)"\} (\S+)$', re.M)
VETO_RE = re.compile(r"^(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d).*Worker overload veto (?P<verdict>set|cleared)"
                     r".*worker_url=(?P<url>\S+) overloaded=\w+ waiting_requests=(?P<waiting>\d+) kv_pressure=(?P<kv>[\d.]+)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


class Gateway(launcher.Server):
    """``smg launch`` with ``policy`` and ``router_args`` in front of ``worker_urls``."""

    def __init__(self, worker_urls: Sequence[str], policy: str, log_path: str | Path,
                 router_args: Sequence[str] = (), ready_timeout_s: float = 120.0, max_life_s: int = 1800):
        self.worker_urls = list(worker_urls)
        self.metrics_port = launcher.free_port()
        args = ["--host", "127.0.0.1", "--port", str(launcher.free_port()), "--worker-urls", *self.worker_urls,
                "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                *router_args]
        super().__init__(args, log_path, ready_timeout_s=ready_timeout_s, max_life_s=max_life_s,
                         ready_line=READY_LINE, env=launcher.child_env({}))

    def command(self) -> list[str]:
        return ["timeout", "-k", "10", str(self.max_life_s), sys.executable, "-m", "smg", "launch", *self.args]

    def _healthy(self) -> bool:
        """Every worker registered and healthy (``GET /workers``) and its load polled (the module's
        docstring says why the bench waits for the poll)."""
        try:
            with urllib.request.urlopen(self.base_url + "/workers", timeout=5) as response:
                listed = json.loads(response.read())
            polled = polled_workers(self.metrics_text())
        except (OSError, ValueError):
            return False
        workers = listed.get("workers") or []
        healthy = [w for w in workers if w.get("is_healthy", True) and w.get("url") in self.worker_urls]
        return len(healthy) == len(self.worker_urls) and polled >= set(self.worker_urls)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            return response.read().decode()


class LoadSampler:
    """The router's in-flight count per worker over time: its ``smg_worker_requests_active`` gauge
    (set on every increment and decrement of a worker's load, ``worker/worker.rs:2377``) read from
    its Prometheus page every ``interval_s`` in a thread, until :meth:`stop`."""

    def __init__(self, router: Gateway, interval_s: float = 0.05):
        import threading

        self.router, self.interval_s = router, interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []  # (wall clock s, {worker url: in flight})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> LoadSampler:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, dict[str, float]]]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        return self.samples

    def _run(self) -> None:
        import time

        while not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                loads = {m.group(1): float(m.group(2)) for m in ACTIVE_RE.finditer(self.router.metrics_text())}
                self.samples.append((time.time(), loads))
            self._stop.wait(self.interval_s)


def polled_workers(metrics_text: str) -> set[str]:
    """The workers whose load the router has polled at least once, from its Prometheus page."""
    return set(POLLED_RE.findall(metrics_text))


def policy_settings(log_lines: Sequence[str]) -> dict[str, str]:
    """The policy and its settings as the router printed them at start (``Starting router ... policy:
    Name { key: value, ... }``); empty when the line is absent."""
    for line in log_lines:
        m = SETTINGS_RE.search(ANSI_RE.sub("", line))
        if m:
            fields = dict(part.split(": ", 1) for part in m.group(2).split(", ") if ": " in part)
            return {"policy": m.group(1), **{k.strip(): v.strip() for k, v in fields.items()}}
    return {}


@dataclass(frozen=True)
class Veto:
    """A worker left out of routing by smg's worker overload protection (on by default: a polled
    ``/v1/loads`` with ``waiting_requests`` >= 8 or KV ``token_usage`` >= 0.8, SGLang's usage being
    max(Full, SWA) on a hybrid-SWA pool), from the poll that set it to the poll that cleared it
    (``worker/monitor.rs:505``; polls every ``--load-monitor-interval`` s, 10 by default)."""

    worker: str
    set_s: float  # wall clock of the log line (the router logs whole seconds)
    cleared_s: float | None  # None: still set when the router stopped
    waiting_requests: int
    kv_pressure: float


def vetoes(log_lines: Sequence[str]) -> list[Veto]:
    """The router's ``Worker overload veto set`` / ``cleared`` lines, paired per worker."""
    import calendar

    opened: dict[str, Veto] = {}
    out = []
    for line in log_lines:
        m = VETO_RE.search(ANSI_RE.sub("", line))
        if not m:
            continue
        when = calendar.timegm(time.strptime(m.group("at"), "%Y-%m-%d %H:%M:%S"))
        url = m.group("url")
        if m.group("verdict") == "set":
            opened[url] = Veto(url, float(when), None, int(m.group("waiting")), float(m.group("kv")))
        elif url in opened:
            v = opened.pop(url)
            out.append(Veto(v.worker, v.set_s, float(when), v.waiting_requests, v.kv_pressure))
    return sorted(out + list(opened.values()), key=lambda v: v.set_s)


def router_counters(text: str, policy: str) -> dict[str, Any]:
    """smg's own counts from its Prometheus page: the policy's selection branches (``branch`` label:
    ``tree_match``, ``spill``, ``expected_wait_fallback``, ...; consistent hashing's ``occupied_hit``,
    ...) and the worker retries."""
    from prometheus_client.parser import text_string_to_metric_families

    branch_name, label = BRANCH_COUNTERS.get(policy, (None, None))
    branches: dict[str, float] = {}
    retries = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == branch_name and sample.value:
                key = sample.labels.get(label, "?")
                branches[key] = branches.get(key, 0.0) + sample.value
            elif sample.name == RETRY_COUNTER:
                retries += sample.value
    return {"branches": {k: int(v) for k, v in sorted(branches.items())}, "retries": int(retries)}
