"""``bench hicache --quick``: the benchmark's rows on SGLang's real cache in-process (form ``cache``).

A server boot costs 30-150 s on this machine, so no run that boots one stays under a minute. This
form drives the cache kit (:mod:`overlay_tools.simulate.cache_kit`: the real ``UnifiedRadixCache`` with
``init_hicache``, SGLang's host pools, controller and transfers on the engine kit's CPU routes) at a
scaled DSV4 shape (page 16, window 8, chunk 128, SWA pool 1,024 tokens), sized so that the run
stays under a minute on this shared machine (measured 20 s at load 1.7, 44 s at load 5; the
imports are about half of it).
No model runs: there are no logits and no forward time, so ``logprob_max_diff`` and ``ttft_s`` are
null in its rows.

Workloads (each row builds a fresh cache):

* ``idle_swa``: two idle 2,048-token sessions, then 8x the SWA pool of other traffic (sub-agent
  turns and new 4K sessions) with a Full pool of 1M tokens: only the sessions' windows go;
* ``idle_full``: the same with a Full pool of 8K tokens: the churn evicts their Full KV too;
* ``branch``: two idle 2,048-token sessions, each continued once by a branch (a retried or forked
  agent turn: the session's resume point becomes an inner node), the same traffic, then each
  resumes from its own history; Full pool 8K;
* ``agent``: four sessions share a 1,024-token system prompt (each adds its own 256-token first
  message), take three turns each in rotation (+128 tokens a turn), with one SWA pool of other
  traffic before every turn; Full pool 8K.

Rows: ``stock``; ``stock_hicache`` (write-through, the server's default policy, host 4x the device
pools); ``stock_hicache_small`` (host 0.5x: the host evicts too); ``profile`` (the profile switches
that act at cache level: SWA thin and cone replay at ``N = CONE_TOKENS``, 8 pages as the datacenter
profile's 2,048 at page 256; every turn of a cone row goes through :func:`devkit.testkit.cone.cone_turn`,
a real ``PrefillAdder`` admission with the cone's copy and, beside HiCache, its load-back; decode
yield needs a forward) and ``profile_hicache`` / ``profile_hicache_small`` (thin + cone, host 4x /
0.5x); ``stock_hicache_wb`` / ``profile_hicache_wb``: write-back, host 1x (the host keeps the Full KV
that leaves the device, and drops windows it never got: the cone loads the Full KV back). No L3 row here: the kit's cache has no scheduler to run the L3 prefetch, so
``loaded_from_l3`` is 0 by construction (the server form has the L3 row). Cone rows also report
``cone`` (plans, loads from host, the Full tokens loaded, replayed turns, fallbacks by reason).

Per row: history tokens prefilled again on the resumed turns (``recomputed``: prompt minus the
matched prefix minus the turn's new tokens), prefix tokens served through a host load-back
(``loaded_from_host``: what ``init_load_back`` added to the prefix, as the server's
``cached_tokens_details["host"]`` counts it: a load-back of a window alone counts the whole prefix
it made usable), and over the whole row the
KV tokens and bytes HiCache copied each way (its ``metrics_collector`` calls: ``d2h`` / ``h2d``
tokens per pool, ``kv`` = Full and ``swa``, and bytes of the kit's pools).
"""

from __future__ import annotations

import random
import time
from typing import Any

from devkit.testkit import radix_cache as rc
from devkit.testkit.swa_thin import CHUNK, PAGE, WINDOW, cache_kit, traffic_unit
from overlay_tools.simulate.cache_kit import CacheKit, HiCache, TurnResult

SWA_POOL = 1024  # half swa-thin-hicache's: the quick form's rows in seconds
IDLE_LEN, LONG_LEN, NEW_TURN = 2048, 4096, 128
TRAFFIC = 8 * SWA_POOL  # SWA slots of other traffic before the idle sessions resume
FULL_POOL = {"idle_swa": 1 << 20, "idle_full": 8 * 1024, "agent": 8 * 1024, "branch": 8 * 1024}
SYSTEM, FIRST_MESSAGE, SESSIONS, TURNS = 1024, 256, 4, 3
CONE_TOKENS = 8 * PAGE  # the datacenter profile's N = 2,048 is 8 pages of 256
ROWS = (  # name, profile (thin + cone), HiCache
    ("stock", False, None),
    ("stock_hicache", False, HiCache(ratio=4.0, write_policy="write_through")),
    ("stock_hicache_small", False, HiCache(ratio=0.5, write_policy="write_through")),
    ("profile", True, None),
    ("profile_hicache", True, HiCache(ratio=4.0, write_policy="write_through")),
    ("profile_hicache_small", True, HiCache(ratio=0.5, write_policy="write_through")),
    ("stock_hicache_wb", False, HiCache(ratio=1.0, write_policy="write_back")),
    ("profile_hicache_wb", True, HiCache(ratio=1.0, write_policy="write_back")),
)
WHY_NULL = "form cache: no model runs, so no TTFT and no logprobs (the server form measures them)"


def _traffic(kit: CacheKit, tok: rc.Tokens, rng: random.Random, slots: int) -> None:
    """Other traffic until ``slots`` SWA slots were handed out: sub-agents (a chunked turn and a
    short follow-up) and, every sixth unit, a new long session."""
    start, unit = kit.swa_alloc_tokens, 0
    while kit.swa_alloc_tokens - start < slots:
        unit += 1
        traffic_unit(kit, tok, rng, unit, LONG_LEN)


def _idle(kit: CacheKit, tok: rc.Tokens, rng: random.Random) -> list[TurnResult]:
    idle = [kit.run_turn(tok.fresh(IDLE_LEN), PAGE).history for _ in range(2)]
    _traffic(kit, tok, rng, TRAFFIC)
    return [kit.run_turn(history + tok.fresh(NEW_TURN), PAGE) for history in idle]


def _agent(kit: CacheKit, tok: rc.Tokens, rng: random.Random) -> list[TurnResult]:
    system = tok.fresh(SYSTEM)
    histories = [kit.run_turn(system + tok.fresh(FIRST_MESSAGE), PAGE).history for _ in range(SESSIONS)]
    resumed = []
    for _ in range(TURNS - 1):
        for i, history in enumerate(histories):
            _traffic(kit, tok, rng, SWA_POOL)  # the idle gap: other traffic
            turn = kit.run_turn(history + tok.fresh(NEW_TURN), PAGE)
            histories[i] = turn.history
            resumed.append(turn)
    return resumed


def _branch(kit: CacheKit, tok: rc.Tokens, rng: random.Random) -> list[TurnResult]:
    """Two idle sessions, each continued once by a branch (a retried or forked agent turn: its resume
    point becomes an inner node, whose window HiCache keeps on neither tier once it leaves the device),
    traffic, then each session resumes from its own history."""
    idle = [kit.run_turn(tok.fresh(IDLE_LEN), PAGE).history for _ in range(2)]
    for history in idle:
        kit.run_turn(history + tok.fresh(NEW_TURN), PAGE)
    _traffic(kit, tok, rng, TRAFFIC)
    return [kit.run_turn(history + tok.fresh(NEW_TURN), PAGE) for history in idle]


WORKLOADS = {"idle_swa": _idle, "idle_full": _idle, "agent": _agent, "branch": _branch}


def _with_cone(kit: CacheKit, on: bool) -> None:
    """Cone replay on this kit (every turn through ``cone_turn``), or off (the switch's config taken
    off the cache: its match is stock)."""
    from devkit.testkit import cone_replay_parts as cone
    from devkit.testkit.cone import cone_turn

    if not on:
        if hasattr(kit.cache, cone.CACHE_ATTR):
            delattr(kit.cache, cone.CACHE_ATTR)
        return
    assert cone.cache_config(kit.cache).enabled, cone.cache_config(kit.cache)

    def run_turn(tokens: list[int], out_len: int, chunk: int | None = None, session_id: str | None = None) -> Any:
        turn = cone_turn(kit, tokens, out_len, chunk)
        return TurnResult(turn.rid, turn.prefix_len, turn.F, turn.recomputed, turn.history)

    kit.run_turn = run_turn  # the workloads' turns, traffic included


def _cone_figures() -> dict[str, Any]:
    from devkit.testkit import cone_replay_parts as cone

    c = cone.COUNTERS
    return {"plans": c.plans, "loads": c.loads, "loaded_tokens": c.loaded_tokens, "replayed": c.copies,
            "fallbacks": dict(sorted(cone.FALLBACKS.items()))}


def run_row(workload: str, thin: bool, hicache: HiCache | None, seed: int = 1) -> dict[str, Any]:
    from devkit.testkit import cone_replay_parts as cone

    t0 = time.process_time()
    kit = cache_kit(FULL_POOL[workload], SWA_POOL, thin, hicache)
    _with_cone(kit, thin)
    cone.reset_counters()
    loaded_before = kit.loaded_from_host
    resumed = WORKLOADS[workload](kit, rc.Tokens(), random.Random(seed))
    kit.cache.sanity_check()
    counter = kit.cache.metrics_collector
    out = {
        "recomputed": sum(r.reprefilled - NEW_TURN for r in resumed),
        "resumed_turns": len(resumed),
        "loaded_from_host": kit.loaded_from_host - loaded_before,
        "loaded_from_l3": 0,
        "d2h_tokens": dict(counter.d2h_tokens) if counter is not None else {},
        "h2d_tokens": dict(counter.h2d_tokens) if counter is not None else {},
        "bytes_d2h": counter.d2h_bytes if counter is not None else 0,
        "bytes_h2d": counter.h2d_bytes if counter is not None else 0,
        "leak": sum(kit.leak_check().values()),
        "cpu_s": round(time.process_time() - t0, 2),
    }
    if thin:
        out["cone"] = _cone_figures()
    if hicache is not None:
        kit.cache.release_host_resources()
    return out


def rows() -> list[dict[str, Any]]:
    """Every workload x row of this form, in the benchmark's row schema."""
    import importlib
    import os

    from overlay_tools.simulate.cone_turn import install

    os.environ.pop("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", None)  # SWA thin chooses the Python core
    state = install(CONE_TOKENS, DSV41_SWA_THIN="1")
    importlib.import_module("sglang.srt.mem_cache.unified_radix_cache")
    for name in ("fast_tree_core", "swa_thin"):
        if state.outcomes[name].status != "installed":
            raise RuntimeError(f"{name} did not install: {state.outcomes[name].reason}")
    out = []
    for workload in WORKLOADS:
        for name, thin, hicache in ROWS:
            out.append({"name": name, "kit": "cache", "workload": workload, **run_row(workload, thin, hicache),
                        "logprob_max_diff": None, "ttft_s": None})
    return out


def describe() -> str:
    return (f"form cache (SGLang's UnifiedRadixCache + HiCache in-process, no model): page {PAGE}, window {WINDOW}, "
            f"chunk {CHUNK}, SWA pool {SWA_POOL}; idle: two {IDLE_LEN}-token sessions resume (+{NEW_TURN}) after "
            f"{TRAFFIC} SWA slots of traffic, Full pool {FULL_POOL['idle_swa']} (idle_swa) / {FULL_POOL['idle_full']} "
            f"(idle_full); branch: the idle sessions each continued once by a branch first, Full pool {FULL_POOL['branch']}; agent: {SESSIONS} sessions on a shared {SYSTEM}-token system prompt, {TURNS} turns each, "
            f"one SWA pool of traffic before each turn, Full pool {FULL_POOL['agent']}. HiCache write-through "
            f"(host 4x; _small 0.5x; _wb: write-back, host 1x); profile = SWA thin + cone replay N={CONE_TOKENS}. ttft_s / logprob_max_diff null: {WHY_NULL}")
