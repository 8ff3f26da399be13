"""One boot of the soak (a :class:`Leg`): its server under SGLang's retraction hook and idle
checks, probes, traffic, RSS samples and log read, its figures; and the environment two ranks need
on CPU (:data:`TP2_ENV`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devkit.soak.server import RssSampler, read_log, run_probes, scheduler_pid
from devkit.soak.traffic import Tally, Traffic

RETRACT_INTERVAL = 25  # SGLANG_TEST_RETRACT_INTERVAL: a forced retraction every N decode steps
SOAK_ENV = {
    "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_TEST_RETRACT": "1",
    "SGLANG_TEST_RETRACT_INTERVAL": str(RETRACT_INTERVAL),
}


@dataclass
class Leg:
    label: str
    profile: dict[str, str]
    minutes: float
    figures: dict[str, Any] = field(default_factory=dict)
    rss: list[tuple[float, int, int]] = field(default_factory=list)  # the scheduler's (t_s, served, KiB)
    planted_leak_kib: int = 0

    @property
    def clean(self) -> bool:
        f = self.figures
        return (f.get("failed") == 0 and f.get("leak_reports") == 0 and f.get("log_errors") == 0
                and f.get("probes_stable") is True and f.get("alive_at_end") is True and not f.get("receipt_gaps"))


def _server(model_kind: str, model: Path, log: Path, profile: dict[str, str], max_total_tokens: int, life_s: int,
            planted_leak_kib: int = 0):
    from devkit.engine_kit import launcher

    if model_kind == "dsv4":
        from devkit.engine_kit.dsv4 import launch

        server = launch.server(model, log, profile, load_format="dummy")
        server.max_life_s = life_s
    else:
        args = launcher.server_args(model, launcher.free_port(), max_total_tokens=max_total_tokens, swa_ratio=0.25)
        server = launcher.Server(args, log, profile, max_life_s=life_s)
    server.env.update(SOAK_ENV)
    if planted_leak_kib:
        server.env = launcher.with_seams(server.env, "planted_leak", SOAK_PLANTED_LEAK_KIB=str(planted_leak_kib))
    return server


def run_leg(leg: Leg, model_kind: str, model: Path, out: Path, seed: int, max_total_tokens: int,
            say: Callable[[str], None]) -> Leg:
    from adapter.core import receipts, registry
    from devkit.engine_kit import client

    seconds = leg.minutes * 60
    server = _server(model_kind, model, out / f"{leg.label}.log", leg.profile, max_total_tokens,
                     life_s=int(seconds) + 900, planted_leak_kib=leg.planted_leak_kib)
    traffic = None
    sampler = None
    f: dict[str, Any] = {"label": leg.label, "minutes": leg.minutes}
    t0 = time.monotonic()
    try:
        server.start()
        f["startup_s"] = round(server.startup_s or 0, 1)
        pid = scheduler_pid(server.proc.pid) if server.proc else None
        f["scheduler_pid_found"] = pid is not None
        say(f"  {leg.label}: up in {f['startup_s']} s (scheduler pid {pid}); probes ...")
        before = run_probes(server.base_url, seed)
        traffic = Traffic(server.base_url, seed)
        sampler = RssSampler(pid, traffic.tally).start()
        say(f"  {leg.label}: traffic for {leg.minutes} min ...")
        traffic.run(seconds)
        sampler.stop()
        time.sleep(3)  # an idle gap before the last probes: the idle checks run on what is left
        after = run_probes(server.base_url, seed)
        f.update(probes_before=before, probes_after=after, probes_stable=before == after)
        f["alive_at_end"] = server.proc is not None and server.proc.poll() is None and _healthy(client, server)
    except Exception as exc:  # the server died or a probe failed: reported, the soak goes on
        f["exception"] = f"{type(exc).__name__}: {exc}"[:500]
        f.setdefault("probes_stable", False)
        f["alive_at_end"] = False
    finally:
        leftover = server.stop()
        if sampler is not None:
            sampler.stop()
    f["leftover_processes"] = len(leftover)
    tally = traffic.tally if traffic is not None else Tally()
    f.update(served=tally.served, failed=tally.failed, aborted_on_purpose=tally.aborted, by_scenario=tally.by_scenario,
             request_errors=tally.errors[:8], wall_s=round(time.monotonic() - t0, 1), latency=tally.latency())
    f.update(sampler.figures(seconds) if sampler is not None else RssSampler(None, tally).figures(seconds))
    leg.rss = list(sampler.samples) if sampler is not None else []
    (out / f"{leg.label}.rss.json").write_text(json.dumps({"t_s_served_kib": leg.rss}))
    lines = server.log_lines()
    f.update(read_log(lines))
    # Every switch of the leg's profile installed on the scheduler and none refused (a refused
    # switch soaks nothing: the boot would pass on stock code).
    f["receipt_gaps"] = receipts.audit(lines, registry.resolve(leg.profile), ranks=1) if leg.profile else []
    leg.figures = f
    lat = f["latency"]
    say(f"  {leg.label}: served {tally.served}, failed {tally.failed}, leak reports {f['leak_reports']}, "
        f"log errors {f['log_errors']}, RSS growth {f.get('rss_growth_pct')} %, probes stable {f.get('probes_stable')}; "
        f"TTFT {lat['mean_ttft_ms']} / p99 {lat['p99_ttft_ms']} ms, ITL {lat['mean_itl_ms']} / p99 {lat['p99_itl_ms']} ms"
        + (f"; receipts: {'; '.join(f['receipt_gaps'])}" if f["receipt_gaps"] else ""))
    return leg


def _healthy(client: Any, server: Any) -> bool:
    import requests

    try:
        return requests.get(server.base_url + "/health", timeout=30).status_code == 200
    except Exception:
        return False


# Two ranks on CPU: what SGLang 0.5.23 needs to run ``--tp 2`` on a CPU-only machine with one NUMA node (found here):
# * sglang/srt/utils/numa_utils.py:463 asserts ranks <= NUMA nodes unless the cores of each rank
#   are given: one core per rank;
# * sglang/srt/distributed/parallel_state.py:463 builds a PyNcclCommunicator whenever the NCCL
#   library loads (torch's wheel ships it), and pynccl.py:116 then enters torch.cuda.device("cpu"):
#   "ValueError: Expected a cuda device, but got: cpu". A library path that does not load makes
#   PyNccl disable itself (pynccl.py:73-79), and the CPU all-reduce is torch.distributed's (gloo:
#   parallel_state.py:695-699, no AMX here so no shared-memory all-reduce).
TP2_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2"}
