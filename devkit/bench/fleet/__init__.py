"""``python -m adapter bench fleet [--quick] [--model mellum|dsv4]``: SGLang's gateway (``smg``) in
front of two kit servers, SGLang's own multi-turn chat client through it; stock fleet against profile
fleets, router policy against router policy, side by side in one run.

A fleet is two workers booted together with one profile (the Mellum kit at the reference geometry:
``--max-total-tokens 8192``, chunk 64, ``--swa-full-tokens-ratio 0.05``; the DSV4 kit at the gate's
pool with a page a chunk). Against each fleet every policy runs once (:data:`POLICIES`): a fresh
router (:mod:`.gateway`) with that policy, the client's seeded traffic through it
(``python -m sglang.benchmark.serving --backend sglang-oai-chat --dataset-name generated-shared-prefix``,
conversations of several turns sharing a system prompt per group; ``consistent_hashing`` gets the
client's per-group routing key, ``--gsp-send-routing-key``, named by :func:`routing_run` so that every
fleet gets the same keys and the ring spreads the groups evenly; every fleet's workers take the same
ports, so the ring is the same), then the router stops and each worker's
prefix cache is flushed (``POST /flush_cache``), so every policy starts from empty caches and the
same requests (same seed).

Per fleet x policy: the client's mean / p99 TTFT and mean ITL; per worker, from its own request log
(:mod:`.served`): requests, conversations, prompt / cached / prefilled tokens, server-side TTFT and
ITL, and the prefill tokens its log's ``Prefill batch`` lines counted (chunks and recomputes
included: the work the worker did); turns that moved to another worker than their conversation's
previous turn; the router's own counts (its selection branches: ``tree_match``, ``spill``, ...; its
retries) and its settings as its start line printed them. Per fleet: receipts (``adapter receipts``'
audit over each worker's log: every worker installed every switch of the profile). A worker whose
scheduler dies fails its run (the error names the worker and the exception from its log; the client
does not see it, the router retries its requests on the other worker) and the fleet's later
policies are not run.

Each run writes the requests it sent, in arrival order, as a Mooncake-format trace beside its logs
(``<fleet>-<policy>.trace.jsonl``, :func:`.served.mooncake_lines`): ``simulate --instances 2 --router
P --session-key session`` replays it. Nothing is left running: each worker and the router are
:class:`devkit.engine_kit.launcher.Server` process groups stopped in ``finally`` (loopback ports from
the launcher's free-port logic). The table is printed, then the last line is one JSON object.

``--quick``: the stock fleet and the release gate's profile fleet, the three policies, fewer
conversations (4 boots of a worker, 6 client runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devkit.bench.fleet import gateway, pressure, served
from devkit.engine_kit import launcher
from devkit.engine_kit.serving_client import ServingClient, client_args, client_env, routing_key
from overlay_tools.simulate.gateway.router import HashRing, RouterConfig

OUT = Path(__file__).resolve().parents[3] / "build" / "bench-fleet"
WORKERS = 2
# 16 conversations x 3 turns (the reference traffic), Poisson arrivals; --quick: 8 conversations
TRAFFIC = {"groups": 4, "per_group": 4, "system": 512, "question": 64, "output": 16, "turns": 3, "rate": 4.0}
QUICK_TRAFFIC = {**TRAFFIC, "groups": 2}
CLIENT_TIMEOUT_S = 900
BOOT_TIMEOUT_S = 600.0  # two boots at once on a loaded 2-core machine: past the launcher's 300 s
MELLUM = {"max_total_tokens": 8192, "chunk": 64, "swa_ratio": 0.05}
DSV4_CHUNK = 256  # a page a chunk: chat prompts are multi-chunk prefills (bench chat-latency's choice)
YIELD_PCT = "33"
THIN_CONE = {"DSV41_SWA_THIN": "1", "DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": "64"}
PREFILL_RE = re.compile(r"Prefill batch.*?#new-token: (\d+), #cached-token: (\d+)")
SCHEDULER_DIED = "Scheduler hit an exception"


@dataclass(frozen=True)
class Policy:
    label: str
    policy: str  # smg --policy
    router_args: tuple[str, ...] = ()
    routing_key: bool = False  # the client sends its per-group key (--gsp-send-routing-key)


POLICIES = (
    Policy("cache_aware", "cache_aware"),
    Policy("round_robin", "round_robin"),
    Policy("consistent_hashing", "consistent_hashing", routing_key=True),
)
# cache_aware without the worker overload veto (on by default in smg 1.13.0: a polled /v1/loads with
# 8 waiting requests or KV usage 0.8, SGLang's max(Full, SWA) usage, leaves the worker out of routing,
# its cache holders included, until a later poll clears it)
NO_VETO = Policy("cache_aware no-veto", "cache_aware", ("--disable-worker-overload-protection",))
# ... and without its count-pressure spill: with two workers a holder never carries more than twice the
# fleet's mean in-flight count, so a relative threshold of 2 never trips (cache_aware.rs:1805)
NO_VETO_NO_SPILL = Policy("cache_aware no-veto rel 2", "cache_aware",
                          ("--disable-worker-overload-protection", "--balance-rel-threshold", "2"))
FULL_POLICIES = (*POLICIES, NO_VETO, NO_VETO_NO_SPILL)


def fleets(kit_name: str, quick: bool) -> list[tuple[str, dict[str, str]]]:
    """(label, profile) per fleet; the first is stock. Full runs add thin + cone alone and decode
    yield 33 + thin + cone (the reference rows)."""
    from devkit.gate.verdict import kit_profile

    profile = kit_profile(kit_name)
    if quick:
        return [("stock", {}), ("profile", profile)]
    cone = profile.get("DSV41_SWA_CONE_TOKENS", THIN_CONE["DSV41_SWA_CONE_TOKENS"])
    thin_cone = {**THIN_CONE, "DSV41_SWA_CONE_TOKENS": cone}
    return [("stock", {}), ("thin+cone", thin_cone), (f"yield {YIELD_PCT}+thin+cone",
                                                        {**thin_cone, "DSV41_DECODE_YIELD": YIELD_PCT}),
            ("profile", profile)]


@dataclass(frozen=True)
class MellumFleet:
    """The Mellum kit's workers at a pool geometry (default: :data:`MELLUM`)."""

    name: str = "mellum"
    max_total_tokens: int = MELLUM["max_total_tokens"]
    chunk: int = MELLUM["chunk"]
    swa_ratio: float = MELLUM["swa_ratio"]

    def model(self, out: Path) -> Path:
        from devkit.engine_kit import model_kits

        return model_kits.kit("mellum").build(out).resolve()

    def worker(self, model: Path, log: Path, profile: dict[str, str], extra: list[str], port: int) -> launcher.Server:
        args = launcher.server_args(model, port, max_total_tokens=self.max_total_tokens,
                                    chunk=self.chunk, swa_ratio=self.swa_ratio, extra=extra)
        return launcher.Server(args, log, profile, ready_timeout_s=BOOT_TIMEOUT_S)


@dataclass(frozen=True)
class Dsv4Fleet:
    name: str = "dsv4"

    def model(self, out: Path) -> Path:
        from devkit.engine_kit import model_kits

        return model_kits.kit("dsv4").build(out).resolve()

    def worker(self, model: Path, log: Path, profile: dict[str, str], extra: list[str], port: int) -> launcher.Server:
        from devkit.engine_kit import model_kits

        return model_kits.kit("dsv4").server(model, log, profile, extra, chunk=DSV4_CHUNK, port=port)


FLEET_KITS = {"mellum": MellumFleet(), "dsv4": Dsv4Fleet()}


@dataclass
class PolicyRun:
    fleet: str
    policy: str
    urls: list[str] = field(default_factory=list)  # the workers, in --worker-urls order (trace's worker)
    client: dict[str, Any] = field(default_factory=dict)
    workers: list[dict[str, Any]] = field(default_factory=list)
    moved_turns: int = 0
    conversations: int = 0
    router: dict[str, Any] = field(default_factory=dict)
    trace: str | None = None
    gate: dict[str, Any] | None = None  # cache_aware: each turn against the spill gate (.pressure)
    died: list[dict[str, Any]] = field(default_factory=list)  # workers whose scheduler died in this run
    error: str | None = None
    wall_s: float = 0.0

    @property
    def prefilled(self) -> int:
        return sum(w.get("prefill_log_tokens", 0) for w in self.workers)


@dataclass
class FleetResult:
    label: str
    profile: dict[str, str]
    receipts: list[dict[str, Any]] = field(default_factory=list)
    runs: list[PolicyRun] = field(default_factory=list)
    boot_s: float | None = None
    survivors: list[int] = field(default_factory=list)
    error: str | None = None


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-")


def _post(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, b"", method="POST"), timeout=30) as response:
        response.read()


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def request_log(folder: Path) -> Path:
    """The file SGLang's request logger writes in ``folder`` (``<hostname>_<rank>.log``)."""
    found = sorted(folder.glob("*.log"))
    return found[0] if found else folder / "missing.log"


def scheduler_death(log_text: str) -> str | None:
    """The exception that killed a worker's scheduler in this log text (its last line and the
    allocator's figures after it), or None. The router retries a dead worker's requests on the
    other, so the client sees every request served: only the worker's log says one died."""
    at = log_text.find(SCHEDULER_DIED)
    if at < 0:
        return None
    lines = [x.strip() for x in log_text[at:].splitlines()[1:80]]
    error = next((i for i, x in enumerate(lines) if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", x)), None)
    if error is None:
        return SCHEDULER_DIED
    detail = [x for x in lines[error + 1:error + 5] if x and not x.startswith("[")]
    return " ".join([lines[error], *detail])


def routing_run(urls: Sequence[str], groups: int) -> str:
    """The name of a key-hashing run's routing keys: the first of ``fleet0``, ``fleet1``, ... whose
    groups smg's ring over the workers' URLs (:class:`HashRing`, ``hash_ring.rs``) spreads as evenly
    as the count allows. The client's own keys are new every run, and with few groups two of them
    share a worker as often as not, so one run's key hashing would place by luck and two fleets
    would place differently; these keys are the same for every fleet on the same ports."""
    ring = HashRing(list(urls))
    for n in range(1000):
        name = f"fleet{n}"
        placed = Counter(ring.find(routing_key(name, g)) for g in range(groups))
        if max(placed.values()) - min(placed.get(i, 0) for i in range(len(urls))) <= 1:
            return name
    raise RuntimeError(f"no routing keys spread {groups} groups over {len(urls)} workers")


def unpinned_keys(records: Sequence[served.Served], name: str, groups: int) -> list[str]:
    """The routing keys the workers received that are not the run's (``name``, :func:`routing_run`):
    a client whose keys were not pinned places the groups anew and its fleets do not compare."""
    return sorted({r.routing_key or "none" for r in records} - {routing_key(name, g) for g in range(groups)})


def prefill_tokens(log_text: str) -> tuple[int, int]:
    """(prefill batches, tokens they computed) from a worker log's ``Prefill batch`` lines."""
    found = PREFILL_RE.findall(log_text)
    return len(found), sum(int(n) for n, _ in found)


def run_policy(fleet_label: str, policy: Policy, workers: Sequence[launcher.Server], req_dirs: Sequence[Path],
               model: Path, traffic: dict[str, Any], out: Path, client: ServingClient,
               say: Callable[[str], None]) -> PolicyRun:
    """One router with ``policy`` in front of ``workers``, the client's traffic through it, the
    figures; the router stops and the workers' caches are flushed whatever happened."""
    run = PolicyRun(fleet_label, policy.label, [w.base_url for w in workers])
    name = f"{_safe(fleet_label)}-{_safe(policy.label)}"
    logs = [w.log_path for w in workers]
    log_at = [_size(p) for p in logs]
    req_logs = [request_log(d) for d in req_dirs]
    req_at = [_size(p) for p in req_logs]
    router = gateway.Gateway([w.base_url for w in workers], policy.policy, out / f"{name}.router.log",
                             policy.router_args)
    keys = routing_run(run.urls, traffic["groups"]) if policy.routing_key else None
    t0 = time.monotonic()
    sampler = gateway.LoadSampler(router)
    try:
        router.start()
        sampler.start()
        out_file = out / f"{name}.json"
        out_file.unlink(missing_ok=True)
        argv = client_args(router.base_url, model, out_file, traffic) + (
            ["--gsp-send-routing-key"] if policy.routing_key else [])
        rc = client.run(argv, out / f"{name}.client.txt", CLIENT_TIMEOUT_S, routing_run=keys)
        if rc != 0 or not out_file.is_file():
            tail = (out / f"{name}.client.txt").read_text(errors="replace").strip().splitlines()[-3:]
            run.error = f"client exit {rc}: {' | '.join(tail)}"
        else:
            record = [json.loads(x) for x in out_file.read_text().splitlines() if x.strip()][-1]
            run.client = {"completed": record.get("completed"), "mean_ttft_ms": _r(record.get("mean_ttft_ms")),
                          "p99_ttft_ms": _r(record.get("p99_ttft_ms")), "mean_itl_ms": _r(record.get("mean_itl_ms"))}
        with contextlib.suppress(OSError):
            run.router = gateway.router_counters(router.metrics_text(), policy.policy)
    except Exception as exc:  # a failed run is a row that says so; the other runs still go
        run.error = run.error or f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        samples = sampler.stop()
        router.stop()
        run.router["settings"] = gateway.policy_settings(router.log_lines())
        vetoed = gateway.vetoes(router.log_lines())
        run.router["vetoes"] = [{"worker": run.urls.index(v.worker) if v.worker in run.urls else v.worker,
                                 "seconds": None if v.cleared_s is None else v.cleared_s - v.set_s,
                                 "waiting_requests": v.waiting_requests, "kv_pressure": v.kv_pressure} for v in vetoed]
        for w in workers:
            with contextlib.suppress(OSError):
                _post(w.base_url + "/flush_cache")
    time.sleep(1.0)  # the request logger's last lines
    records = served.read_served([_read_from(p, at) for p, at in zip(req_logs, req_at)])
    run.workers = served.per_worker(records, len(workers))
    for worker, (row, path, at) in enumerate(zip(run.workers, logs, log_at)):
        text = _read_from(path, at)
        row["prefill_batches"], row["prefill_log_tokens"] = prefill_tokens(text)
        if (death := scheduler_death(text)) is not None:
            run.died.append({"worker": worker, "error": death})
    if run.died:
        run.error = "; ".join(f"worker {d['worker']} died: {d['error']}" for d in run.died) + (
            f" (the router retried {run.router.get('retries', 0)} requests on the others)")
    if keys is not None and (unpinned := unpinned_keys(records, keys, traffic["groups"])):
        run.error = run.error or f"the client sent other routing keys than the bench's: {unpinned}"
    run.moved_turns = served.moved_turns(records)
    if policy.policy == "cache_aware" and records:
        loads = pressure.sampled_loads(records, samples, run.urls)
        windows = [pressure.VetoWindow(run.urls.index(v.worker), v.set_s, v.cleared_s) for v in vetoed
                   if v.worker in run.urls]
        run.gate = pressure.summary(pressure.turns(records, len(workers), gate_settings(policy), loads, windows))
    (out / f"{name}.loads.jsonl").write_text("".join(json.dumps([t, loads]) + "\n" for t, loads in samples))
    run.conversations = len({s.session for s in records})
    trace = out / f"{name}.trace.jsonl"
    trace.write_text("".join(line + "\n" for line in served.mooncake_lines(records)))
    run.trace = str(trace)
    run.wall_s = round(time.monotonic() - t0, 1)
    say(f"  {fleet_label} / {policy.label}: " + (run.error or (
        f"TTFT {run.client['mean_ttft_ms']} ms, prefilled {run.prefilled} "
        f"({' + '.join(str(w['prefill_log_tokens']) for w in run.workers)}), moved turns {run.moved_turns}, "
        f"router {run.router.get('branches')} ({run.wall_s:.0f} s)")))
    return run


def gate_settings(policy: Policy) -> RouterConfig:
    """The gate's settings for a run: smg's defaults, less what the policy's router arguments set."""
    args = list(policy.router_args)
    given = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--") and not args[i + 1].startswith("--")}
    defaults = RouterConfig()
    return dataclasses.replace(
        defaults, cache_threshold=float(given.get("--cache-threshold", defaults.cache_threshold)),
        balance_abs_threshold=int(given.get("--balance-abs-threshold", defaults.balance_abs_threshold)),
        balance_rel_threshold=float(given.get("--balance-rel-threshold", defaults.balance_rel_threshold)))


def receipts_of(profile: dict[str, str], logs: Sequence[Path], out: Path, label: str) -> list[dict[str, Any]]:
    """``adapter receipts``' report of each worker's log against the fleet's profile (one rank each)."""
    from adapter.ops.check import receipts_report

    env_file = out / f"{_safe(label)}.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in profile.items()))
    reports = []
    for worker, log in enumerate(logs):
        report = receipts_report([str(log)], str(env_file), 1)
        reports.append({"worker": worker, "ok": report["ok"], "switches": report["switches"], "gaps": report["gaps"]})
    return reports


def run_fleet(kit: Any, model: Path, label: str, profile: dict[str, str], policies: Sequence[Policy],
              traffic: dict[str, Any], out: Path, client: ServingClient, say: Callable[[str], None],
              ports: Sequence[int]) -> FleetResult:
    """Boot the fleet's workers (together) on ``ports``, run every policy against them, stop them."""
    result = FleetResult(label, profile)
    safe = _safe(label)
    req_dirs = [out / f"{safe}-w{i}.requests" for i in range(WORKERS)]
    for d in req_dirs:
        if d.is_dir():
            for f in d.glob("*.log"):
                f.unlink()
    boot_profile = {**profile, "DSV41_DEBUG_LOG": "1"} if profile else {}
    workers = [kit.worker(model, out / f"{safe}-w{i}.log", boot_profile,
                          ["--enable-metrics", *served.request_log_args(req_dirs[i])], ports[i]) for i in range(WORKERS)]
    t0 = time.monotonic()
    try:
        _start_together(workers)
        result.boot_s = round(time.monotonic() - t0, 1)
        say(f"{label}: {WORKERS} workers up in {result.boot_s:.0f} s ({', '.join(w.base_url for w in workers)})")
        for policy in policies:
            result.runs.append(run_policy(label, policy, workers, req_dirs, model, traffic, out, client, say))
            if result.runs[-1].died:  # the fleet is one worker short: later runs would not compare
                result.error = f"{policy.label}: {result.runs[-1].error}; the fleet's later policies not run"
                break
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        say(f"{label}: {result.error}")
    finally:
        groups = [w.proc.pid for w in workers if w.proc is not None]
        for w in workers:
            w.stop()
        result.survivors = launcher.survivors(groups)
    result.receipts = receipts_of(profile, [w.log_path for w in workers], out, label)
    return result


def _start_together(workers: Sequence[launcher.Server]) -> None:
    """Boot the workers in parallel threads (two boots overlap their imports); any failure stops all."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(workers)) as pool:
        futures = [pool.submit(w.start) for w in workers]
        errors = [f.exception() for f in futures]
    failed = [e for e in errors if e is not None]
    if failed:
        for w in workers:
            w.stop()
        raise failed[0]


def _r(x: Any) -> float | None:
    return None if x is None else round(float(x), 1)


def summarize(results: Sequence[FleetResult]) -> list[dict[str, Any]]:
    """One row per fleet x policy: the client's figures, per-worker figures, prefilled against the
    stock fleet's same policy."""
    stock = {r.policy: r.prefilled for f in results[:1] for r in f.runs if not r.error}
    rows = []
    for f in results:
        receipts_ok = all(r["ok"] for r in f.receipts) if f.receipts else None
        for r in f.runs:
            total = r.prefilled
            top = max((w.get("prefill_log_tokens", 0) for w in r.workers), default=0)
            rows.append({
                "fleet": f.label, "policy": r.policy, "error": r.error, **r.client,
                "prefilled": total, "prefilled_vs_stock": _ratio(total, stock.get(r.policy)),
                "top_worker_share": _ratio(top, total), "cached": sum(w["cached_tokens"] for w in r.workers),
                "moved_turns": r.moved_turns, "conversations": r.conversations, "receipts_ok": receipts_ok,
                "gate": r.gate, "workers": r.workers, "router": r.router, "trace": r.trace, "died": r.died,
            })
    return rows


def fleet_totals(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fleet: prefilled tokens over the policies every fleet ran without error, against the
    stock fleet's (the first) over the same policies, and the policies where it prefilled more."""
    fleets = list(dict.fromkeys(r["fleet"] for r in rows))
    by = {(r["fleet"], r["policy"]): r["prefilled"] for r in rows if not r["error"]}
    shared = [p for p in dict.fromkeys(r["policy"] for r in rows) if all((f, p) in by for f in fleets)]
    stock = sum(by[(fleets[0], p)] for p in shared) if fleets else 0
    return [{"fleet": f, "policies": shared, "prefilled": (mine := sum(by[(f, p)] for p in shared)),
             "vs_stock": _ratio(mine, stock), "above_stock": [p for p in shared if by[(f, p)] > by[(fleets[0], p)]]}
            for f in fleets]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)


def print_table(rows: Sequence[dict[str, Any]], say: Callable[[str], None] = print) -> None:
    from adapter.ops.table import render

    def per(row: dict[str, Any], key: str) -> str:
        return " / ".join("-" if w.get(key) is None else f"{w[key]:.0f}" for w in row["workers"]) or "-"

    header = ["fleet", "policy", "TTFT ms", "p99 TTFT", "ITL ms", "prefilled (w0 / w1)", "vs stock", "top share",
              "cached (w0 / w1)", "requests", "convs", "moved", "moved by", "vetoes", "TTFT w0 / w1", "router branches",
              "receipts"]
    lines = []
    for r in rows:
        branches = ", ".join(f"{k} {v}" for k, v in (r["router"].get("branches") or {}).items()) or "-"
        lines.append([r["fleet"], r["policy"], r.get("mean_ttft_ms", "-"), r.get("p99_ttft_ms", "-"),
                      r.get("mean_itl_ms", "-"), f"{r['prefilled']} ({per(r, 'prefill_log_tokens')})",
                      r["prefilled_vs_stock"] or "-", r["top_worker_share"] or "-",
                      f"{r['cached']} ({per(r, 'cached_tokens')})", per(r, "requests"), per(r, "conversations"),
                      r["moved_turns"], moved_by(r), vetoes(r), per(r, "mean_ttft_ms"), branches,
                      {True: "ok", False: "MISSING", None: "-"}[r["receipts_ok"]]])
    say(render(header, lines, align="left"))
    for r in rows:
        if r["error"]:
            say(f"{r['fleet']} / {r['policy']}: {r['error']}")
    for t in fleet_totals(rows)[1:]:
        say(f"{t['fleet']}: prefilled {t['prefilled']} over {', '.join(t['policies'])}, {t['vs_stock']} x the stock "
            f"fleet's; above stock at {', '.join(t['above_stock']) or 'no policy'}")


def moved_by(row: dict[str, Any]) -> str:
    """cache_aware: the moved turns by cause (the spill gate, the overload veto, neither)."""
    kinds = (row.get("gate") or {}).get("kinds") or {}
    parts = [f"{kinds[k]} {k}" for k in ("spill", "veto", "moved, not gated") if kinds.get(k)]
    return ", ".join(parts) or "-"


def vetoes(row: dict[str, Any]) -> str:
    """The router's overload vetoes: worker, seconds, what the poll read (waiting requests, KV usage)."""
    return "; ".join(f"w{v['worker']} {v['seconds'] or 'to end'} s (waiting {v['waiting_requests']}, usage "
                     f"{v['kv_pressure']:.2f})" for v in row["router"].get("vetoes") or []) or "-"


def measure(kit_name: str, labelled: Sequence[tuple[str, dict[str, str]]], policies: Sequence[Policy],
            traffic: dict[str, Any], out: Path, say: Callable[[str], None] = print) -> list[FleetResult]:
    """Every fleet in turn (one fleet up at a time), every policy against it. Every fleet's workers
    take the same ports: the router knows a worker by its URL (key hashing's ring is built over the
    URLs, ``hash_ring.rs:62``), so two fleets on other ports would place the same keys differently."""
    if kit_name not in FLEET_KITS:
        raise ValueError(f"--model {kit_name!r} is invalid: expected one of {', '.join(FLEET_KITS)}")
    kit = FLEET_KITS[kit_name]
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = kit.model(out)
    ports = fleet_ports(WORKERS)
    with ServingClient(client_env(), out) as client:  # its imports while the first fleet boots
        return [run_fleet(kit, model, label, profile, policies, traffic, out, client, say, ports)
                for label, profile in labelled]


def fleet_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports."""
    ports: list[int] = []
    while len(ports) < n:
        if (port := launcher.free_port()) not in ports:
            ports.append(port)
    return ports


def run(quick: bool = False, model: str = "mellum") -> dict[str, Any]:
    t0 = time.monotonic()
    traffic = QUICK_TRAFFIC if quick else TRAFFIC
    labelled = fleets(model, quick)
    out = OUT / model
    conversations = traffic["groups"] * traffic["per_group"]
    print(f"fleet: {model} kit, smg {gateway.SMG_VERSION} in front of {WORKERS} workers; {len(labelled)} fleets x "
          f"{len(POLICIES)} policies; {conversations} conversations of {traffic['turns']} turns at "
          f"{traffic['rate']}/s; logs and traces in {out}")
    results = measure(model, labelled, POLICIES, traffic, out)
    rows = summarize(results)
    print_table(rows)
    for f in results:
        gaps = [g for r in f.receipts for g in r["gaps"]]
        if gaps or f.survivors or f.error:
            print(f"{f.label}: receipts gaps {gaps}; survivors {f.survivors}; {f.error or ''}")
    wall = round(time.monotonic() - t0, 1)
    print(f"fleet: {wall:.0f} s")
    return {"model": model, "traffic": traffic, "smg": gateway.SMG_VERSION, "rows": rows, "totals": fleet_totals(rows),
            "fleets": [{"fleet": f.label, "profile": f.profile, "boot_s": f.boot_s, "receipts": f.receipts,
                        "survivors": f.survivors, "error": f.error} for f in results], "wall_s": wall}
