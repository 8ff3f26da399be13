"""``bench hicache`` (full run): the benchmark's rows on the kits' real servers (form ``server``).

One boot per (kit, row): HiCache and the profile are launch-time settings. Every boot runs with
``--enable-metrics``; each workload starts from ``/flush_cache``.

Kits (:data:`KITS`):

* ``mellum``: pool 2048, ``--swa-full-tokens-ratio 0.1`` (a 204-token SWA pool), page 1, window 32.
  A 600-token session + 8 greedy tokens goes idle; ``idle_swa``: four 150-token churn prompts
  overflow the SWA pool only; ``idle_full``: four 600-token prompts press the Full pool too; the
  resumed turn is the history + 24 new tokens. ``agent``: three sessions on a shared 256-token
  system prompt (each adds its own 48-token first message), three turns each in rotation (+24
  tokens a turn, 2 greedy tokens), two 200-token churn prompts before every turn.
* ``dsv4``: the gate's DeepSeek-V4.1 kit model (:class:`devkit.engine_kit.model_kits.Dsv4Kit`: page 256,
  window 128, fp8 KV), pool 32 pages, 12 SWA pages, chunk 1024, 2 running rows. A 2304-token
  session + 8 tokens goes idle; ``idle_swa``: two 2048-token churn prompts push its window out of
  the SWA pool (Full pool room for all); ``idle_full``: four press the Full pool; resumed turn
  +24. ``agent`` as Mellum's in whole pages: a 512-token system prompt, 256-token first messages,
  +256 tokens a turn, one 2048-token churn prompt before every turn (at Mellum's sizes a turn's
  growth stays inside one page and every row recomputes the same 378 tokens). HiCache on DSV4
  takes ``--hicache-ratio`` only (SGLang refuses ``--hicache-size`` there).

Rows per kit: ``stock``; ``stock_hicache`` (host ratio: Mellum 4, DSV4 2); ``stock_hicache_small``
(ratio 1: the ``idle_full`` churn evicts the host copy too; Mellum only); ``stock_hicache_l3``
(ratio 1 and the ``file`` L3 in a temporary folder, prefetch policy ``wait_complete``);
``stock_hicache_large_l3`` (the large host and the same L3: the datacenter profile's host with L3
behind it); ``profile`` (the gate's profile with the kit's overrides); ``profile_hicache`` (the profile, the
large host).

Per resumed turn: history tokens prefilled again (``recomputed``: history minus SGLang's
``cached_tokens``, never below 0), and where the prefix came from
(``meta_info["cached_tokens_details"]``: ``host`` = prefix tokens served through a host load-back,
``storage`` = through an L3 prefetch); the bytes and KV tokens per pool (``kv`` = Full, ``swa``)
HiCache copied device->host and host->device over the workload (the server's Prometheus counters
``sglang:hicache_backup_bytes_total`` / ``sglang:load_back_bytes_total`` and
``sglang:hicache_backup_tokens_total`` / ``sglang:load_back_tokens_total``, after minus before);
the turn's e2e time with 2 output tokens (``ttft_s``, CPU, relative only; the agent workload: the
mean over its resumed turns); the largest |logprob| difference over the whole vocabulary of the 2
output tokens against a full re-prefill of the same prompt on the same boot after ``/flush_cache``
(``logprob_max_diff``; the agent workload: the largest over its resumed turns). ``/flush_cache``
leaves the L3 files, so on an L3 row the reference may itself come from L3: ``reference_cached``
says how many prompt tokens the reference did not prefill (0 = a true re-prefill). The control:
the same prompt sent once more right after the re-prefill, a device hit at the same resume point
(``hit_logprob_diff``: the hit against the re-prefill; ``logprob_diff_vs_hit``: the resumed turn
against the hit). Measured on the DSV4 kit: a hit on the re-prefill's KV equals it (0), while a
resume on the idle session's own KV differs from it by 0.18 whether the prefix stayed on device,
came back from host or was replayed by the cone; so compare the rows with each other there.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

NEW, REPLY = 24, 2  # the resumed turn's new tokens, its greedy output tokens
METRICS = {  # row key: Prometheus counter (summed over its label sets)
    "bytes_d2h": "sglang:hicache_backup_bytes_total",
    "bytes_h2d": "sglang:load_back_bytes_total",
}
POOL_METRICS = {"d2h_tokens": "sglang:hicache_backup_tokens_total", "h2d_tokens": "sglang:load_back_tokens_total"}
_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$')


@dataclass(frozen=True)
class Kit:
    """One kit's geometry and its rows' HiCache ratios."""

    name: str
    session: int
    out: int
    churn: dict[str, tuple[int, int]]  # workload -> (prompts, tokens each)
    ratio_large: float
    rows: tuple[str, ...]
    workloads: tuple[str, ...]
    describe: str
    launch: dict[str, Any] = field(default_factory=dict)
    # the agent workload: (shared system prompt, each session's first message, tokens a turn adds)
    agent: tuple[int, int, int] = (256, 48, NEW)


MELLUM = Kit("mellum", session=600, out=8, churn={"idle_swa": (4, 150), "idle_full": (4, 600), "agent": (2, 200)},
             ratio_large=4.0,
             rows=("stock", "stock_hicache", "stock_hicache_small", "stock_hicache_l3", "stock_hicache_large_l3", "profile",
                   "profile_hicache"),
             workloads=("idle_swa", "idle_full", "agent"),
             describe="mellum (pool 2048, SWA 204, page 1, window 32)")
DSV4 = Kit("dsv4", session=2304, out=8, churn={"idle_swa": (2, 2048), "idle_full": (4, 2048), "agent": (1, 2048)},
           ratio_large=2.0,
           rows=("stock", "stock_hicache", "stock_hicache_l3", "stock_hicache_large_l3", "profile", "profile_hicache"),
           workloads=("idle_swa", "idle_full", "agent"),
           describe="dsv4 (V4.1 kit model, pool 32 pages, SWA 12 pages, page 256, window 128, chunk 1024)",
           launch={"max_total_tokens": 32 * 256, "swa_ratio": 12 / 32, "chunk": 1024, "max_running": 2},
           # in whole pages: at Mellum's sizes a turn's growth stays inside one 256-token page
           agent=(512, 256, 256))
KITS = {"mellum": MELLUM, "dsv4": DSV4}
AGENT_SESSIONS, AGENT_TURNS = 3, 3


# a row name's ending: (the kit's large host ratio, else 1x; the ``file`` L3 behind it); longest first
ROW_HOSTS = {"_large_l3": (True, True), "_l3": (False, True), "_small": (False, False), "_hicache": (True, False)}


def row_config(kit: Kit, name: str) -> tuple[bool, float | None, bool]:
    """(profile on, HiCache host ratio or None, L3 ``file`` on) for a row name."""
    if name not in kit.rows:
        raise ValueError(f"row={name!r} is not a {kit.name} row: expected one of {', '.join(kit.rows)}")
    profiled = name.startswith("profile")
    suffix = next((end for end in ROW_HOSTS if name.endswith(end)), None)
    if suffix is None:
        return profiled, None, False
    large, l3 = ROW_HOSTS[suffix]
    return profiled, (kit.ratio_large if large else 1.0), l3


def hicache_label(ratio: float | None, l3: bool) -> str:
    return "-" if ratio is None else f"host {ratio:g}x" + (" + file L3" if l3 else "")


def parse_counters(text: str) -> dict[str, Any]:
    """The transfer counters of a ``/metrics`` page: bytes each way, and KV tokens each way per pool."""
    out: dict[str, Any] = {key: 0.0 for key in METRICS} | {key: {} for key in POOL_METRICS}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        for key, name in METRICS.items():
            if m["name"] == name:
                out[key] += float(m["value"])
        for key, name in POOL_METRICS.items():
            if m["name"] == name:
                pool = re.search(r'pool="([^"]*)"', m["labels"] or "")
                label = pool.group(1) if pool else "?"
                out[key][label] = out[key].get(label, 0.0) + float(m["value"])
    return out


def counters_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after`` minus ``before`` (ints; pools absent before count from 0, pools that moved nothing are left out)."""
    out: dict[str, Any] = {key: int(after[key] - before[key]) for key in METRICS}
    for key in POOL_METRICS:
        delta = {pool: int(v - before[key].get(pool, 0.0)) for pool, v in after[key].items()}
        out[key] = {pool: v for pool, v in sorted(delta.items()) if v}
    return out


def history_recomputed(history_len: int, cached_tokens: int) -> int:
    """History tokens the resumed turn prefilled again: those past SGLang's cached prefix."""
    return history_len - min(max(cached_tokens, 0), history_len)


def _counters(url: str) -> dict[str, Any]:
    response = requests.get(url + "/metrics", timeout=60)
    response.raise_for_status()
    return parse_counters(response.text)


def _turn(url: str, history: list[int], prompt: list[int]) -> dict[str, Any]:
    """One resumed turn and its reference (a re-prefill of the same prompt after ``/flush_cache``)."""
    from devkit.testkit import hicache as hc

    return judge(url, history, prompt, hc.generate(url, prompt, REPLY))


def judge(url: str, history: list[int], prompt: list[int], resumed: dict[str, Any]) -> dict[str, Any]:
    """A resumed turn's figures, and its references on the same boot: ``/flush_cache`` and a re-prefill
    of ``prompt``, then ``prompt`` again (a device hit on that re-prefill: the control for what a
    resume from cache differs from a one-shot prefill by, whatever tier the prefix came from)."""
    from devkit.testkit import hicache as hc

    hc.flush(url)
    reference = hc.generate(url, prompt, REPLY)
    hit = hc.generate(url, prompt, REPLY)
    details = resumed["details"]
    return {
        "recomputed": history_recomputed(len(history), resumed["cached_tokens"]),
        "loaded_from_host": int(details.get("host", 0)),
        "loaded_from_l3": int(details.get("storage", 0)),
        "ttft_s": resumed["e2e_s"],
        "logprob_max_diff": hc.max_logprob_diff(reference, resumed),
        "hit_logprob_diff": hc.max_logprob_diff(reference, hit),
        "logprob_diff_vs_hit": hc.max_logprob_diff(hit, resumed),
        "reference_cached": reference["cached_tokens"],
        "tokens_equal": resumed["tokens"] == reference["tokens"],
    }


def idle_session(url: str, kit: Kit, workload: str, tag: str) -> list[dict[str, Any]]:
    from devkit.engine_kit import client
    from devkit.testkit import hicache as hc

    session = hc._ids(f"{tag}.session", kit.session)
    history = session + client.generate(url, session, kit.out)["output_ids"]
    count, tokens = kit.churn[workload]
    for i in range(count):
        client.generate(url, hc._ids(f"{tag}.churn{i}", tokens), 1)
    time.sleep(1.0)  # write-through acks drain on the scheduler's next passes
    return [_turn(url, history, history + hc._ids(f"{tag}.new", NEW))]


def agent(url: str, kit: Kit, workload: str, tag: str) -> list[dict[str, Any]]:
    """Sessions on a shared system prompt take turns; churn in every idle gap. The references run
    after the whole workload (each flushes the cache), one per resumed turn."""
    from devkit.engine_kit import client
    from devkit.testkit import hicache as hc

    system_tokens, first_tokens, turn_tokens = kit.agent
    system = hc._ids(f"{tag}.system", system_tokens)
    histories = []
    for s in range(AGENT_SESSIONS):
        prompt = system + hc._ids(f"{tag}.s{s}.first", first_tokens)
        histories.append(prompt + client.generate(url, prompt, REPLY)["output_ids"])
    count, tokens = kit.churn[workload]
    turns: list[tuple[list[int], list[int], dict[str, Any]]] = []
    for t in range(1, AGENT_TURNS):
        for s in range(AGENT_SESSIONS):
            for i in range(count):
                client.generate(url, hc._ids(f"{tag}.t{t}.s{s}.churn{i}", tokens), 1)
            time.sleep(0.5)
            prompt = histories[s] + hc._ids(f"{tag}.t{t}.s{s}.new", turn_tokens)
            resumed = hc.generate(url, prompt, REPLY)
            turns.append((histories[s], prompt, resumed))
            histories[s] = prompt + resumed["tokens"]
    return [judge(url, history, prompt, resumed) for history, prompt, resumed in turns]


WORKLOADS: dict[str, Callable[[str, Kit, str, str], list[dict[str, Any]]]] = {
    "idle_swa": idle_session, "idle_full": idle_session, "agent": agent}


def combine(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a workload's resumed turns: sums, the largest logprob distance, the mean e2e time."""
    return {
        "resumed_turns": len(turns),
        "recomputed": sum(t["recomputed"] for t in turns),
        "loaded_from_host": sum(t["loaded_from_host"] for t in turns),
        "loaded_from_l3": sum(t["loaded_from_l3"] for t in turns),
        "logprob_max_diff": max(t["logprob_max_diff"] for t in turns),
        "hit_logprob_diff": max(t["hit_logprob_diff"] for t in turns),
        "logprob_diff_vs_hit": max(t["logprob_diff_vs_hit"] for t in turns),
        "ttft_s": round(sum(t["ttft_s"] for t in turns) / len(turns), 3),
        "reference_cached": max(t["reference_cached"] for t in turns),
        "tokens_equal": all(t["tokens_equal"] for t in turns),
    }


def _server(kit: Kit, work: Path, name: str, profile: dict[str, str], extra: list[str]) -> Any:
    from devkit.engine_kit import launcher

    log = work / f"{kit.name}.{name}.log"
    if kit.name == "dsv4":
        from devkit.engine_kit.dsv4 import launch

        return launch.server(_model(kit, work), log, profile, ready_timeout_s=900.0, extra=extra, **kit.launch)
    args = launcher.server_args(_model(kit, work), launcher.free_port(), max_total_tokens=2048,
                                extra=["--swa-full-tokens-ratio", "0.1", *extra])
    return launcher.Server(args, log, profile, ready_timeout_s=600)


_MODELS: dict[str, Path] = {}


def _model(kit: Kit, work: Path) -> Path:
    if kit.name not in _MODELS:
        if kit.name == "dsv4":
            from devkit.engine_kit import model_kits

            _MODELS[kit.name] = model_kits.kit("dsv4").build(work / "dsv4")
        else:
            from devkit.engine_kit import model as mk

            _MODELS[kit.name] = mk.make_model(work / "mellum_model")
    return _MODELS[kit.name]


def profile_for(kit: Kit) -> dict[str, str]:
    """The gate's profile (every acting switch) with the kit's overrides."""
    from devkit.engine_kit import model_kits
    from devkit.gate.verdict import build_profile

    profile = build_profile()
    profile.update({k: v for k, v in model_kits.kit(kit.name).profile_overrides().items() if k in profile})
    return profile


def boot_rows(kit: Kit, name: str, work: Path, say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One boot of ``kit`` set up as row ``name``, every workload of the kit on it."""
    from devkit.testkit import hicache as hc

    profiled, ratio, l3 = row_config(kit, name)
    extra = ["--enable-metrics"]
    if ratio is not None:
        extra += hc.hicache_flags(ratio, work / f"{kit.name}.{name}.l3" if l3 else None)
    profile = profile_for(kit) if profiled else {}
    t0 = time.monotonic()
    server = _server(kit, work, name, profile, extra)
    rows = []
    with server:
        boot_s = time.monotonic() - t0
        for workload in kit.workloads:
            hc.flush(server.base_url)
            before = _counters(server.base_url)
            turns = WORKLOADS[workload](server.base_url, kit, workload, f"{kit.name}.{workload}")
            time.sleep(0.5)
            moved = counters_delta(before, _counters(server.base_url))
            row = {"name": name, "kit": kit.name, "workload": workload, "hicache": hicache_label(ratio, l3),
                   **combine(turns), **moved, "boot_s": round(boot_s, 1)}
            rows.append(row)
            say(f"[bench hicache] {kit.name} {name} {workload}: recomputed {row['recomputed']} host "
                f"{row['loaded_from_host']} l3 {row['loaded_from_l3']} d2h {row['bytes_d2h']} B h2d {row['bytes_h2d']} B "
                f"ttft {row['ttft_s']} s diff {row['logprob_max_diff']:.3g}")
    return rows


def rows(kits: tuple[str, ...] = ("mellum", "dsv4"), names: tuple[str, ...] | None = None,
         work: Path | None = None) -> list[dict[str, Any]]:
    """Every row of every kit (``names``: only those rows), one boot at a time."""
    import tempfile

    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_hicache_") as tmp:
        base = Path(tmp) if work is None else work
        for kit_name in kits:
            kit = KITS[kit_name]
            for name in kit.rows:
                if names is None or name in names:
                    out.extend(boot_rows(kit, name, base))
        _MODELS.clear()
    return out


def describe(kits: tuple[str, ...] = ("mellum", "dsv4")) -> str:
    profiles = "; ".join(f"{k}: {' '.join(f'{n}={v}' for n, v in profile_for(KITS[k]).items())}" for k in kits)
    return (f"form server (the kits' real servers, one boot per kit x row): {'; '.join(KITS[k].describe for k in kits)}; "
            f"profile on {profiles}; bytes / tokens moved: the server's Prometheus counters")
