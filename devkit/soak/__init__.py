"""``python -m adapter soak [--minutes M] [--model mellum|dsv4]``: seeded agent-style traffic on the
real CPU engine, stock vs the gate's profile, counting what was lost and what grew.

One boot at a time (every server started and stopped by :mod:`devkit.engine_kit.launcher`):

1. stock (no ``DSV41_*`` key): the probe set (fixed prompts, greedy) and ``--stock-minutes`` of the
   same traffic (default: 1 on Mellum, as long as the profile's on DSV4, whose warm-up outlasts half
   the run: :func:`default_stock_minutes`), a control for the failure and log counts and for memory;
2. the profile: the gate's profile (:func:`devkit.gate.build_profile`, every acting switch with its
   ``gate_role`` keys; decode yield on its default cost model) plus ``DSV41_KV_PARK=ram``, with
   SGLang's own retraction hook forcing retractions (``SGLANG_TEST_RETRACT``, every
   :data:`RETRACT_INTERVAL` decode steps, on both boots): probes, ``M`` minutes of traffic, probes;
3. only when the profile's soak fails (and no leak was planted): one short boot per switch of the
   profile (that switch alone), to name the culprit.

The traffic (:func:`traffic`; one seeded ``random.Random``, so the same seed gives the same order
of scenarios and the same token ids): idle sessions resumed after churn, sub-agent turns sharing a
system prompt (concurrent), long chunked prompts beside streams, branched sessions (a cone inside
an answer), client disconnects mid-stream, ``/abort_request`` of a long prompt while it prefills
in chunks beside streams (inside decode-yield windows on the profile), and idle gaps, during which
SGLang's idle invariants run (``self_check_during_idle``: the pool leak check, raising under its
default ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``, and the tree sanity check, turned on with
``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK=1``). Every loop is bounded (a deadline and a request cap).

What it reads: HTTP outcomes (served / failed, with the first errors), the server log (``ERROR``
lines, tracebacks, ``memory leak detected``, sanity-check failures, overlay receipts), the
scheduler process's RSS (``/proc/<pid>/status``, sampled every :data:`RSS_EVERY_S`), the
``kv_park`` DEBUG lines (parks, restores, refusals, ``disabled``). The RSS series of each boot is
written beside its log (``<leg>.rss.json``) and judged by :mod:`.memory` against the kit's limit
(:func:`.memory.limit_for`): the profile's floor above stock's at the same requests over its second
half when the control is as long, else a plateau over that half, else growth against the stock
control over the same minutes);
``--plant-leak-kib K`` makes the profile's scheduler keep K KiB a request (the kit's ``planted_leak`` seam, :func:`devkit.engine_kit.launcher.with_seams`), to
show that judgement fail. The last line printed is one JSON object (:func:`run`).
"""

from __future__ import annotations

import itertools
import json
import random
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devkit.soak import memory, retractions

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "build" / "soak"
RETRACT_INTERVAL = 25  # SGLANG_TEST_RETRACT_INTERVAL: a forced retraction every N decode steps
RSS_EVERY_S = 2.0
WARMUP_FRACTION = 0.2  # the reported RSS growth is from the sample at this share of the soak (the verdict: .memory)
MAX_REQUESTS = 100_000  # the traffic loop's hard cap, whatever the deadline
MODELS = ("mellum", "dsv4")
SOAK_ENV = {
    "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_TEST_RETRACT": "1",
    "SGLANG_TEST_RETRACT_INTERVAL": str(RETRACT_INTERVAL),
}
# Log lines that are failures wherever they appear.
_LEAK = re.compile(r"memory leak detected|sanity check|sanity_check.*(fail|error)|AssertionError", re.I)
_ERROR = re.compile(r"\bERROR\b|Traceback \(most recent call last\)|\bException\b")
# What SGLang logs for the disconnects and aborts the traffic makes on purpose (not errors).
_EXPECTED = re.compile(r"abort|disconnect|Cancelled|CancelledError", re.I)
# SGLang 0.5.23 posts /freeze_gc to itself right after startup with --skip-server-warmup, sometimes
# before uvicorn listens: a logged traceback at boot, on stock and profile boots alike.
_BOOT_NOISE = "post-warmup freeze_gc failed"


# ---------------------------------------------------------------- tallies
@dataclass
class Tally:
    served: int = 0
    failed: int = 0
    aborted: int = 0  # aborted on purpose (disconnect, /abort_request) and ended cleanly
    errors: list[str] = field(default_factory=list)
    by_scenario: dict[str, int] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)  # every served request's time to its first token
    itl_s: list[float] = field(default_factory=list)  # every gap between two tokens of a stream, per token
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def ok(self, scenario: str, n: int = 1, aborted: bool = False) -> None:
        with self._lock:
            self.served += n
            self.aborted += n if aborted else 0
            self.by_scenario[scenario] = self.by_scenario.get(scenario, 0) + n

    def fail(self, scenario: str, why: str) -> None:
        with self._lock:
            self.failed += 1
            if len(self.errors) < 20:
                self.errors.append(f"{scenario}: {why}")

    def timed(self, sent: float, ticks: list[tuple[float, int]], first: bool = True) -> None:
        """A stream's arrivals (``ticks``: client time, tokens so far) sent at ``sent``: its TTFT
        (``first``: the stream began at ``sent``) and its inter-token gaps."""
        ticks = [(t, n) for t, n in ticks if n > 0]
        gaps = [(t1 - t0) / (n1 - n0) for (t0, n0), (t1, n1) in itertools.pairwise(ticks) if n1 > n0]
        with self._lock:
            if first and ticks:
                self.ttft_s.append(ticks[0][0] - sent)
            self.itl_s.extend(gaps)

    def latency(self) -> dict[str, Any]:
        """Mean and p99 TTFT and ITL (ms) as SGLang's ``bench_serving`` reports them."""
        return {"requests_timed": len(self.ttft_s), **_mean_p99("ttft", self.ttft_s), **_mean_p99("itl", self.itl_s)}

    @property
    def total(self) -> int:
        return self.served + self.failed


def _mean_p99(name: str, seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {f"mean_{name}_ms": None, f"p99_{name}_ms": None}
    import numpy as np

    ms = np.asarray(seconds) * 1000
    return {f"mean_{name}_ms": round(float(ms.mean()), 1), f"p99_{name}_ms": round(float(np.percentile(ms, 99)), 1)}


# ---------------------------------------------------------------- the traffic
@dataclass
class Traffic:
    """The seeded agent-style scenarios; every request is bounded in tokens and time."""

    base_url: str
    seed: int
    vocab: int = 1024
    timeout_s: float = 120.0
    tally: Tally = field(default_factory=Tally)
    sessions: list[list[int]] = field(default_factory=list)
    _n: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.system = self.ids(384)

    def ids(self, n: int) -> list[int]:
        from devkit.engine_kit.workload import FIRST_ID

        return [self.rng.randrange(FIRST_ID, self.vocab) for _ in range(n)]

    def rid(self, tag: str) -> str:
        self._n += 1
        return f"soak-{self.seed}-{self._n}-{tag}"

    def _generate(self, scenario: str, ids: list[int], new: int) -> list[int] | None:
        """A streamed greedy request (its TTFT and token gaps timed); its output ids, or None."""
        from devkit.engine_kit import client

        stream = client.Stream(self.base_url, self.rid(scenario), ids, new, self.timeout_s)
        sent = time.monotonic()
        stream.start()
        if not stream.join(self.timeout_s + 10):
            self.tally.fail(scenario, f"no end after {self.timeout_s:.0f} s")
            return None
        if stream.error:  # counted, never raised: the soak goes on and reports it
            self.tally.fail(scenario, stream.error[:300])
            return None
        out = stream.output_ids
        if len(out) != new:
            self.tally.fail(scenario, f"{len(out)} tokens instead of {new}")
            return None
        self.tally.timed(sent, stream.ticks)
        self.tally.ok(scenario)
        return out

    # -- scenarios -----------------------------------------------------------------------------
    def session(self) -> None:
        """Resume an idle session (context + a new user message) or open a new one."""
        if self.sessions and self.rng.random() < 0.7:
            i = self.rng.randrange(len(self.sessions))
            context = self.sessions[i] + self.ids(self.rng.randint(8, 40))
            if len(context) > 3000:
                context = context[-1500:]
            out = self._generate("resume", context, 8)
            if out is not None:
                self.sessions[i] = context + out
            return
        context = self.ids(self.rng.randint(200, 800))
        out = self._generate("session", context, 8)
        if out is not None:
            self.sessions.append(context + out)
            del self.sessions[:-6]

    def subagents(self) -> None:
        """Two to four sub-agent turns at once, sharing the system prompt."""
        tasks = [self.system + self.ids(self.rng.randint(16, 64)) for _ in range(self.rng.randint(2, 4))]
        threads = [threading.Thread(target=self._generate, args=("subagent", t, 6)) for t in tasks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s + 10)

    def _streams(self, tag: str, n: int, max_new: int) -> list[Any]:
        from devkit.engine_kit import client

        return [client.Stream(self.base_url, self.rid(f"{tag}{i}"), self.ids(self.rng.randint(16, 48)), max_new,
                              self.timeout_s).start() for i in range(n)]

    def _end_streams(self, scenario: str, streams: list[Any]) -> None:
        from devkit.engine_kit import client

        for s in streams:
            try:
                client.abort(self.base_url, s.rid)
            except Exception:  # it may have finished already
                pass
        for s in streams:
            if not s.join(60):
                self.tally.fail(scenario, f"stream {s.rid} did not end after its abort")
            elif s.error:
                self.tally.fail(scenario, f"stream {s.rid}: {s.error}"[:300])
            elif not s.ticks:
                self.tally.fail(scenario, f"stream {s.rid} produced nothing")
            else:
                self.tally.timed(0.0, s.ticks, first=False)  # decode streams: their gaps (ITL) only
                self.tally.ok(scenario)

    def long_beside_streams(self) -> None:
        """A long prompt prefilled in chunks while streams decode."""
        from devkit.engine_kit import client

        streams = self._streams("ls", 2, 400)
        try:
            client.wait_until(lambda: all(s.tokens >= 2 or s.error for s in streams), self.timeout_s, "streams")
            self._generate("long", self.ids(self.rng.randint(600, 1500)), 4)
        except Exception as exc:
            self.tally.fail("long", f"{type(exc).__name__}: {exc}"[:300])
        finally:
            self._end_streams("stream", streams)

    def cone(self) -> None:
        """Branch a session inside its context (an agent retrying from mid-answer)."""
        if not self.sessions:
            return self.session()
        context = self.rng.choice(self.sessions)
        if len(context) < 160:
            return self.session()
        at = self.rng.randint(96, len(context) - 8)
        self._generate("cone", context[:at] + self.ids(16), 6)

    def disconnect(self) -> None:
        """The client goes away mid-stream (the connection is closed after a few chunks)."""
        import requests

        body = {"input_ids": self.ids(self.rng.randint(32, 200)), "stream": True, "rid": self.rid("dc"),
                "sampling_params": {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}}
        try:
            with requests.post(self.base_url + "/generate", json=body, stream=True, timeout=self.timeout_s) as r:
                r.raise_for_status()
                chunks = 0
                for line in r.iter_lines():
                    if line.startswith(b"data: "):
                        chunks += 1
                    if chunks >= self.rng.randint(2, 6):
                        break
        except Exception as exc:
            self.tally.fail("disconnect", f"{type(exc).__name__}: {exc}"[:300])
            return
        self.tally.ok("disconnect", aborted=True)

    def abort_while_prefilling(self) -> None:
        """``/abort_request`` of a long prompt while it prefills in chunks beside streams."""
        from devkit.engine_kit import client

        streams = self._streams("ab", 2, 400)
        long = client.Stream(self.base_url, self.rid("abort"), self.ids(self.rng.randint(1500, 3000)), 4, self.timeout_s)
        try:
            client.wait_until(lambda: all(s.tokens >= 2 or s.error for s in streams), self.timeout_s, "streams")
            long.start()
            time.sleep(self.rng.uniform(0.2, 1.5))
            client.abort(self.base_url, long.rid)
            if not long.join(60):
                self.tally.fail("abort", "the aborted prompt's request did not end")
            elif long.error:
                self.tally.fail("abort", f"aborted prompt: {long.error}"[:300])
            else:
                self.tally.ok("abort", aborted=long.tokens < 4)
        except Exception as exc:
            self.tally.fail("abort", f"{type(exc).__name__}: {exc}"[:300])
        finally:
            self._end_streams("stream", streams)

    def idle(self) -> None:
        """Nothing to run: the scheduler's idle checks (leak, tree sanity) run."""
        time.sleep(self.rng.uniform(0.5, 2.0))

    SCENARIOS: tuple[tuple[str, int], ...] = (
        ("session", 6), ("subagents", 3), ("long_beside_streams", 2), ("cone", 3),
        ("disconnect", 2), ("abort_while_prefilling", 1), ("idle", 2),
    )

    def next_scenario(self) -> str:
        names = [n for n, _ in self.SCENARIOS]
        return self.rng.choices(names, weights=[w for _, w in self.SCENARIOS])[0]

    def run(self, seconds: float, on_tick: Callable[[], None] | None = None) -> Tally:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.tally.total < MAX_REQUESTS:
            getattr(self, self.next_scenario())()
            if on_tick is not None:
                on_tick()
        return self.tally


# ---------------------------------------------------------------- probes and the process
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


# ---------------------------------------------------------------- the log
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


def parked_bytes_bound(spec: Any, max_total_tokens: int) -> int:
    """What parking could ever hold at once: every KV byte of both pools of the kit's model (K and
    V of every layer, fp32/bf16), since only pages the pool had are parked."""
    width = 4 if spec.dtype == "float32" else 2
    return max_total_tokens * spec.layers * spec.kv_heads * spec.head_dim * 2 * width


# ---------------------------------------------------------------- boots
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


def soak_profile(model: str = "mellum") -> dict[str, str]:
    """The gate's profile (acting switches, default decode-yield cost model) with KV parking on,
    with the engine kit's overrides as the gate applies them (DSV4: a cone depth of at least the
    kit model's bound and a multiple of its 256-token page; the Mellum value is refused there)."""
    from devkit import gate
    from devkit.engine_kit.model_kits import KITS

    profile = gate.build_profile()
    profile.update({k: v for k, v in KITS[model].profile_overrides().items() if k in profile})
    return {**profile, "DSV41_KV_PARK": "ram", "DSV41_DEBUG_LOG": "1"}


def switch_profiles(profile: dict[str, str]) -> dict[str, dict[str, str]]:
    """One profile per switch the soak profile turns on: that switch's keys alone."""
    from adapter.core import registry

    config = registry.resolve(profile)
    out = {}
    for switch in config.requested:
        keys = {k.name: profile[k.name] for k in switch.keys if k.name in profile}
        if keys:
            out[switch.name] = {**keys, "DSV41_DEBUG_LOG": "1"}
    return out


def run(minutes: float = 5.0, model: str = "mellum", seed: int = 1, out: str | Path | None = None,
        stock_minutes: float | None = None, bisect: bool = True, say: Callable[[str], None] = print,
        plant_leak_kib: int = 0) -> dict[str, Any]:
    """Stock, then the profile (``plant_leak_kib``: its scheduler keeps that many KiB a request);
    on a failed profile soak, each switch alone. Returns the figures."""
    if model not in MODELS:
        raise ValueError(f"--model={model!r} is invalid: expected one of {', '.join(MODELS)}")
    if not 0 < minutes <= 240:
        raise ValueError(f"--minutes={minutes!r} is invalid: expected 0 < minutes <= 240")
    if stock_minutes is None:
        stock_minutes = default_stock_minutes(model, minutes)
    if not 0 <= stock_minutes <= 240:
        raise ValueError(f"--stock-minutes={stock_minutes!r} is invalid: expected 0 <= minutes <= 240")
    if not 0 <= plant_leak_kib <= 1 << 20:
        raise ValueError(f"--plant-leak-kib={plant_leak_kib!r} is invalid: expected 0 <= KiB <= {1 << 20}")
    from devkit.engine_kit import model as mk

    t0 = time.monotonic()
    out = Path(out) if out else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    max_total_tokens = 8192
    if model == "dsv4":
        from devkit.engine_kit.dsv4 import launch

        model_dir = launch.write_dummy_model(out.parent / "soak_dsv4_model")
        bound = None
    else:
        spec = mk.ModelSpec()
        model_dir = mk.make_model(out.parent / f"engine_kit_model_{spec.digest()}", spec)
        bound = parked_bytes_bound(spec, max_total_tokens)
    profile = soak_profile(model)
    say(f"soak: model {model} ({model_dir}); {minutes} min of traffic, seed {seed}; logs in {out}")
    say("profile: " + " ".join(f"{k}={v}" for k, v in profile.items()))
    stock = run_leg(Leg("stock", {}, max(stock_minutes, 0.05)), model, model_dir, out, seed, max_total_tokens, say)
    prof = run_leg(Leg("profile", profile, minutes, planted_leak_kib=plant_leak_kib), model, model_dir, out, seed,
                   max_total_tokens, say)
    ps, ss = prof.figures, stock.figures
    probes_equal = (ps.get("probes_stable") is True and ss.get("probes_before") is not None
                    and ps.get("probes_before") == ss.get("probes_before"))
    growth = ps.get("rss_growth_pct")
    budget = parked_budget(ps, bound)
    mem = memory.judge(prof.rss, stock.rss, memory.limit_for(model))
    passed = prof.clean and probes_equal and mem.verdict != "leak" and budget["respected"]
    verdict = soak_verdict(passed, mem.verdict)
    culprits: dict[str, Any] = {}
    if not passed and bisect and not plant_leak_kib:
        say("soak: the profile's soak failed; each switch alone ...")
        for name, keys in switch_profiles(profile).items():
            leg = run_leg(Leg(f"only-{name}", keys, min(minutes, 2.0)), model, model_dir, out, seed, max_total_tokens, say)
            lf = leg.figures
            culprits[name] = {"clean": leg.clean, "failed": lf.get("failed"), "leak_reports": lf.get("leak_reports"),
                              "log_errors": lf.get("log_errors"), "receipt_gaps": lf.get("receipt_gaps"),
                              "probes_equal_stock": lf.get("probes_before") == ss.get("probes_before")}
    figures = {
        "verdict": verdict,
        "served": ps.get("served"),
        "failed": ps.get("failed"),
        "leak_reports": ps.get("leak_reports"),
        "log_errors": ps.get("log_errors"),
        "probe_outputs_equal": probes_equal,
        "memory": mem.as_dict(),
        "planted_leak_kib": plant_leak_kib,
        "rss_growth_pct": growth,
        "rss_warm_mib": ps.get("rss_warm_mib"),
        "rss_peak_mib": ps.get("rss_peak_mib"),
        "rss_final_mib": ps.get("rss_final_mib"),
        "rss_low_water_mib": ps.get("rss_low_water_mib"),
        "rss_growth_mib_per_1000_requests": ps.get("rss_growth_mib_per_1000_requests"),
        "parked_budget": budget,
        "retractions": ps.get("retractions"),
        "kv_park": ps.get("kv_park"),
        "retraction_split": ps.get("retraction_split"),
        "by_scenario": ps.get("by_scenario"),
        "request_errors": ps.get("request_errors"),
        "log_error_lines": ps.get("log_error_lines"),
        "leak_lines": ps.get("leak_lines"),
        "refused_switches": ps.get("refused_switches"),
        "receipt_gaps": ps.get("receipt_gaps"),
        "probes": ps.get("probes_before"),
        "latency": ps.get("latency"),
        "stock": {k: ss.get(k) for k in ("served", "failed", "leak_reports", "log_errors", "probes_stable",
                                         "rss_growth_pct", "retractions", "log_error_lines", "latency")},
        "culprits": culprits,
        "profile": profile,
        "minutes": minutes,
        "stock_minutes": stock_minutes,
        "model": model,
        "seed": seed,
        "leftover_processes": ps.get("leftover_processes", 0) + ss.get("leftover_processes", 0),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    if ps.get("retraction_split") is not None:
        say("retractions on the profile boot, by what kv_park did with each:")
        for row in retractions.table(ps["retraction_split"], ps.get("retractions")):
            say(row)
    say(f"soak: {figures['verdict']}: served {figures['served']}, failed {figures['failed']}, leak reports "
        f"{figures['leak_reports']}, memory {mem.verdict} ({mem.reason}), probes equal to stock: {probes_equal}")
    return figures


def default_stock_minutes(model: str, minutes: float) -> float:
    """The stock control's minutes when ``--stock-minutes`` is not given: as long as the profile's
    on DSV4 (its CPU engine warms up past half of a 10-minute run and hands memory back in steps,
    on its stock boot too, so only a control as long, paired request by request, cancels that
    out), 1 on Mellum (flat after its first minute)."""
    return minutes if model == "dsv4" else 1.0


def soak_verdict(passed: bool, memory_verdict: str) -> str:
    """FAIL on any failure (a leak included); else PASS only when memory was judged and passed:
    INCONCLUSIVE when the run was too short or too noisy to tell a leak (``inconclusive``,
    ``unjudged``), whatever else passed."""
    if not passed:
        return "FAIL"
    return "PASS" if memory_verdict == "pass" else "INCONCLUSIVE"


def parked_budget(f: dict[str, Any], bound: int | None) -> dict[str, Any]:
    """Parking stayed within its budget: no refusal over the budget, and the whole pool (what
    parking could ever hold at once) is under the smallest budget (``DSV41_KV_PARK_GIB=1``)."""
    gib = 1 << 30
    park = f.get("kv_park") or {}
    over = f.get("kv_park_over_budget", 0)
    respected = not over and (bound is None or bound <= gib) and not park.get("disabled")
    return {"respected": respected, "declined_over_budget": over, "pool_bytes_bound": bound, "budget_bytes": gib, "disabled": park.get("disabled", 0)}


def add_arguments(parser: Any) -> None:
    parser.add_argument("--minutes", type=float, default=5.0, help="traffic on the profile boot (default 5)")
    parser.add_argument("--stock-minutes", type=float, default=None,
                        help="traffic on the stock control boot (default: 1 on mellum, --minutes on dsv4)")
    parser.add_argument("--model", default="mellum", help=f"engine kit model: {' or '.join(MODELS)} (default mellum)")
    parser.add_argument("--seed", type=int, default=1, help="document order and token ids (default 1)")
    parser.add_argument("--out", help=f"folder for logs (default {DEFAULT_OUT})")
    parser.add_argument("--no-bisect", action="store_true", help="on a failed soak, do not boot each switch alone")
    parser.add_argument("--plant-leak-kib", type=int, default=0,
                        help="the profile's scheduler keeps this many KiB per request (shows the memory judgement fail)")


def main(args: Any) -> int:
    try:
        figures = run(minutes=args.minutes, model=args.model, seed=args.seed, out=args.out,
                      stock_minutes=args.stock_minutes, bisect=not args.no_bisect, plant_leak_kib=args.plant_leak_kib)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(figures, sort_keys=False))
    return {"PASS": 0, "INCONCLUSIVE": 3}.get(figures["verdict"], 1)


# ---------------------------------------------------------------- two ranks on CPU
# What SGLang 0.5.23 needs to run ``--tp 2`` on a CPU-only machine with one NUMA node (found here):
# * sglang/srt/utils/numa_utils.py:463 asserts ranks <= NUMA nodes unless the cores of each rank
#   are given: one core per rank;
# * sglang/srt/distributed/parallel_state.py:463 builds a PyNcclCommunicator whenever the NCCL
#   library loads (torch's wheel ships it), and pynccl.py:116 then enters torch.cuda.device("cpu"):
#   "ValueError: Expected a cuda device, but got: cpu". A library path that does not load makes
#   PyNccl disable itself (pynccl.py:73-79), and the CPU all-reduce is torch.distributed's (gloo:
#   parallel_state.py:695-699, no AMX here so no shared-memory all-reduce).
TP2_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2"}
