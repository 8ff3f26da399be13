"""SGLang's HiCache on the CPU kits: one boot per kit, the same request served from device, host and L3 (devkit only).

What SGLang 0.5.23 runs (``--enable-hierarchical-cache``): ``UnifiedRadixCache.init_hicache``
attaches host pools beside the device pools, write-through (the default ``--hicache-write-policy``)
copies each inserted node to host, and ``--hicache-storage-backend file`` writes host pages to a
folder (``HiCacheFile``; the folder comes from ``--hicache-storage-backend-extra-config
'{"file_storage_path": ...}'``). ``/flush_cache`` empties the tree, the device pool and the host pool
but leaves the files, so the next request finds its prefix only in L3.

Phases of one boot (each request is the same prompt P, so every phase resumes at the same prefix;
the reporting is SGLang's own ``meta_info["cached_tokens_details"]``):

* ``cold``: P on an empty tree; ``hit``: P again, a device hit (the reference);
* ``host``: churn prompts evict P from device (it stays on host), then P: loaded from host;
* ``storage`` (with L3): ``/flush_cache``, then P: loaded from the files.

Per phase: the prefix and where it came from, the greedy tokens, each output token's whole
distribution (``top_logprobs_num`` = the vocabulary), the e2e time; on the DSV4 kits also the probe's
dumps of every whole page of the pool after the extend (:mod:`devkit.engine_kit.dsv4.cone_probe`,
``whole``): SWA pages, C4 / C128 latents and C4 index keys.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from devkit.engine_kit import client, launcher

VOCAB = 1024  # both kits' tokenizer


def _ids(tag: str, n: int) -> list[int]:
    rng = random.Random(tag)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def hicache_flags(ratio: float, storage_dir: Path | None = None, *, write_policy: str | None = None,
                  prefetch_policy: str = "wait_complete") -> list[str]:
    """The launch flags: host tier at ``ratio`` x the device pool, and the ``file`` L3 in ``storage_dir``.

    ``wait_complete``: a prefetch from L3 finishes before the request is scheduled (the default
    ``timeout`` gives up after ~1 s + 0.25 s per 1k tokens, which this CPU overruns)."""
    if not ratio > 0:
        raise ValueError(f"ratio={ratio!r} is invalid: expected a positive host/device ratio")
    flags = ["--enable-hierarchical-cache", "--hicache-ratio", str(ratio)]
    if write_policy is not None:
        flags += ["--hicache-write-policy", write_policy]
    if storage_dir is not None:
        flags += ["--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", prefetch_policy,
                  "--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": str(storage_dir)})]
    return flags


@dataclass(frozen=True)
class Geometry:
    """One kit's numbers: the pool, the session prompt, the churn between the turns."""

    max_total_tokens: int
    prompt_tokens: int
    churn_requests: int
    churn_tokens: int
    ratio: float
    new_tokens: int = 2
    extra: dict[str, Any] = field(default_factory=dict)


# Mellum (page 1, 2048-token pool, sliding_window 32): two 1000-token churn prompts evict the 1008-token session
# from device; a host 3x the device keeps it.
MELLUM = Geometry(max_total_tokens=2048, prompt_tokens=1008, churn_requests=2, churn_tokens=1000, ratio=3.0)
# DSV4 / V4.1 (page 256, the cone tests' pool): two 2048-token churn prompts push the session's SWA
# window out of the 12-page device SWA pool; the host (2x) still holds it.
DSV4 = Geometry(max_total_tokens=16384, prompt_tokens=2304, churn_requests=2, churn_tokens=2048, ratio=2.0,
                extra={"max_running": 2, "chunk": 1024, "swa_ratio": 0.19})


def generate(url: str, ids: list[int], new_tokens: int) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": client.greedy(new_tokens), "return_logprob": True,
            "top_logprobs_num": VOCAB}
    t0 = time.monotonic()
    response = requests.post(url + "/generate", json=body, timeout=1800)
    response.raise_for_status()
    out = response.json()
    meta = out["meta_info"]
    return {
        "cached_tokens": int(meta.get("cached_tokens", 0)),
        "details": meta.get("cached_tokens_details") or {},
        "tokens": list(out["output_ids"]),
        # per output token: {token id: logprob} over the whole vocabulary
        "dist": [{int(t): float(lp) for lp, t, _ in row} for row in meta["output_top_logprobs"]],
        "e2e_s": round(time.monotonic() - t0, 3),
    }


def max_logprob_diff(a: dict[str, Any], b: dict[str, Any], tokens: int | None = None) -> float:
    """The largest |logprob| difference over every vocabulary entry of the first ``tokens`` outputs."""
    rows = list(zip(a["dist"], b["dist"]))[:tokens]
    assert rows and all(x.keys() == y.keys() for x, y in rows)
    return max(abs(x[t] - y[t]) for x, y in rows for t in x)


def flush(url: str, timeout_s: float = 120.0) -> None:
    """``/flush_cache``, retried while SGLang refuses it (:func:`devkit.engine_kit.client.flush_cache`)."""
    client.flush_cache(url, timeout_s)


def _churn(url: str, g: Geometry, tag: str) -> None:
    for i in range(g.churn_requests):
        client.generate(url, _ids(f"{tag}{i}", g.churn_tokens), 1)


def run_phases(url: str, g: Geometry, *, storage: bool, on_phase: Any = None) -> dict[str, Any]:
    """``cold``, ``hit``, ``host`` and (``storage``) ``storage`` on one booted server (module docstring).
    ``on_phase(name)`` runs before each phase's measured request (the DSV4 probe's dump switch)."""
    prompt = _ids("session", g.prompt_tokens)
    hook = on_phase or (lambda name: None)
    flush(url)
    out: dict[str, Any] = {}
    hook("cold")
    out["cold"] = generate(url, prompt, g.new_tokens)
    hook("hit")
    out["hit"] = generate(url, prompt, g.new_tokens)
    hook(None)
    _churn(url, g, "churn")
    time.sleep(1.0)  # write-through acks drain on the scheduler's next passes
    hook("host")
    out["host"] = generate(url, prompt, g.new_tokens)
    if storage:
        hook(None)
        flush(url)
        hook("storage")
        out["storage"] = generate(url, prompt, g.new_tokens)
    hook(None)
    return out


def run_mellum(workdir: Path, model: Path, *, profile: dict[str, str] | None = None, storage: bool = True,
               g: Geometry = MELLUM) -> dict[str, Any]:
    """One Mellum kit boot with HiCache (L2, and the ``file`` L3 in ``workdir/l3``), its phases and log."""
    store = workdir / "l3"
    shutil.rmtree(store, ignore_errors=True)
    flags = hicache_flags(g.ratio, store if storage else None)
    args = launcher.server_args(model, launcher.free_port(), max_total_tokens=g.max_total_tokens, extra=flags)
    server = launcher.Server(args, workdir / "mellum_hicache.log", profile or {}, ready_timeout_s=600)
    with server:
        out = run_phases(server.base_url, g, storage=storage)
        out["log"] = server.log_lines()
    out["l3_files"] = len(list(store.glob("*.bin"))) if storage else 0
    return out


def run_dsv4(workdir: Path, model: Path, *, profile: dict[str, str] | None = None, storage: bool = True,
             g: Geometry = DSV4, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One DSV4-kit boot (V4 or V4.1 checkpoint ``model``; ``extra``: more launch flags, the V4.1 kit's
    decoder replay) through the pool probe, with HiCache; per phase also the probe's dumps of every
    whole page after the measured request's extend."""
    from devkit.engine_kit.dsv4 import launch
    from devkit.testkit.dsv4_cone import ProbeServer

    probe, store = workdir / "probe", workdir / "l3"
    for folder in (probe, store):
        shutil.rmtree(folder, ignore_errors=True)
    probe.mkdir(parents=True)
    flags = [*extra, *hicache_flags(g.ratio, store if storage else None)]
    args = launch.server_args(model, launcher.free_port(), max_total_tokens=g.max_total_tokens, extra=flags,
                              **g.extra)
    server = ProbeServer(args, workdir / "dsv4_hicache.log", profile or {}, ready_timeout_s=900)
    server.env = launch.child_env(profile or {})
    server.env["CONE_PROBE_DIR"] = str(probe)

    def dump_as(name: str | None) -> None:
        (probe / "control.json").write_text(json.dumps({"dump": name, "whole": True} if name else {}))

    dump_as(None)
    with server:
        out = run_phases(server.base_url, g, storage=storage, on_phase=dump_as)
        out["log"] = server.log_lines()
    import torch

    for name in ("cold", "hit", "host", "storage"):
        if name in out:
            paths = sorted(probe.glob(f"{name}-*.pt"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
            out[name]["dumps"] = [torch.load(p, weights_only=False) for p in paths]
    out["l3_files"] = len(list(store.glob("*.bin"))) if storage else 0
    return out


def last_pages(phase: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Every whole page the phase's extend forwards left in the pool (from 0; the last dump of each)."""
    found: dict[int, dict[str, Any]] = {}
    for dump in phase["dumps"]:
        for req in dump["reqs"]:
            found.update({int(start): page for start, page in req["pages"].items()})
    return found


def region_diffs(a: dict[int, Any], b: dict[int, Any], *, prefix: int, page: int = 256,
                 window: int = 128) -> dict[str, int]:
    """Per region (``full.<buffer>`` over every page; ``swa.<layer>`` over the pages holding the
    window before ``prefix`` and every page after it, which must be mapped in both): bytes that differ."""
    import torch

    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    out: dict[str, int] = {}
    for start in sorted(a):
        kinds = ["full"]
        if start + page > prefix - window:
            assert a[start]["swa"] is not None and b[start]["swa"] is not None, f"page {start}: SWA not mapped"
            kinds.append("swa")
        for kind in kinds:
            for i, (x, y) in enumerate(zip(a[start][kind], b[start][kind])):
                key = f"{kind}.{i}"
                out[key] = out.get(key, 0) + int((x.view(torch.uint8) != y.view(torch.uint8)).sum())
    return out
