"""``python -m adapter bench swa-host-demote [--quick]``: what upstream PR #40712's demotion would
give the fleet for the case SGLang 0.5.23 leaves open, on the real cache with HiCache attached.

The case (``devkit/testkit/swa_host_demote.py``): an inner node whose Full KV is on host and whose
SWA window is on device only loses the window on both tiers at its SWA tombstone (no write policy
backs it up there). It arises at steady state, once the SWA host tier is full: the window's host
copy was evicted for room, then a request recomputed through the node. The demotion backs the
window up before the tombstone; with the host tier full, that first evicts the host LRU's oldest
SWA entries (``evict_host``: a host-only leaf goes whole, Full KV included).

The cache kit (page 16, window 8, chunk 128, Full pool 64K tokens, SWA pool 512, host ratio 2),
SWA thin installed as the fleet runs it. Traffic, seeded: ``mixed``: new sessions on a shared
256-token system prompt (40 %), a session's next turn (30 %), a retry of a session's last turn
(30 %: its resume point becomes an inner node); ``retries``: the same with 10 / 20 / 70 %. Rows:
stock and demote, under write-back and write-through (the datacenter profile's policy). Per row,
over every turn: prompt tokens recomputed, KV tokens loaded back host->device, inner windows
dropped while their Full KV was on host, windows the demotion backed up.
"""

from __future__ import annotations

import random
import time
from contextlib import nullcontext
from typing import Any

from adapter.ops import table
from devkit.testkit import radix_cache as rc
from devkit.testkit import swa_host_demote as demote
from devkit.testkit.swa_thin import install_thin
from overlay_tools.simulate import cache_kit

PAGE, OUT = 16, 16
GEOMETRY = cache_kit.Geometry(PAGE, 8, 128, full_tokens=1 << 16, swa_tokens=512, max_reqs=8, max_ctx=1 << 16)
MIXES = {"mixed": (0.4, 0.3), "retries": (0.1, 0.2)}  # P(new session), P(next turn); the rest: retries
POLICIES = ("write_back", "write_through")


def run_row(mix: str, policy: str, demoting: bool, units: int, seed: int) -> dict[str, Any]:
    t0 = time.process_time()
    kit = cache_kit.build(GEOMETRY, backend="python", hicache=cache_kit.HiCache(ratio=2.0, write_policy=policy))
    p_new, p_next = MIXES[mix]
    rng, toks = random.Random(seed), rc.Tokens()
    system, sessions = toks.fresh(256), []
    recomputed = 0
    with demote.record_dropped_windows() as dropped, (
        demote.demote_host_backed_windows() if demoting else nullcontext(demote.DemoteStats())
    ) as stats:
        for _ in range(units):
            r = rng.random()
            if r < p_new or not sessions:
                turn = kit.run_turn(system + toks.fresh(rng.randint(4, 20) * PAGE), OUT)
                sessions.append(turn.history)
            else:
                i = rng.randrange(len(sessions))
                turn = kit.run_turn(sessions[i] + toks.fresh(rng.randint(1, 6) * PAGE), OUT)
                if r < p_new + p_next:
                    sessions[i] = turn.history
            recomputed += turn.reprefilled
    kit.cache.sanity_check()
    leak = sum(kit.leak_check().values())
    kit.cache.release_host_resources()
    return {"recomputed": recomputed, "loaded_from_host": kit.loaded_from_host,
            "dropped_full_on_host": len(dropped.with_full_on_host), "demoted": stats.demoted,
            "demote_failed": stats.failed, "leak": leak, "cpu_s": round(time.process_time() - t0, 2)}


def run(quick: bool) -> dict[str, Any]:
    install_thin()
    units = 120 if quick else 250
    seeds = (1,) if quick else (1, 2, 3)
    mixes = ("mixed",) if quick else tuple(MIXES)
    rows: list[dict[str, Any]] = []
    for mix in mixes:
        for policy in POLICIES:
            for demoting in (False, True):
                per_seed = [run_row(mix, policy, demoting, units, seed) for seed in seeds]
                total = {k: sum(r[k] for r in per_seed) for k in per_seed[0]}
                total["cpu_s"] = round(total["cpu_s"], 2)
                rows.append({"name": "demote" if demoting else "stock", "mix": mix, "policy": policy,
                             "kit": "cache", "turns": units * len(seeds), **total})
    header = ["mix", "policy", "row", "turns", "recomputed", "loaded from host", "dropped (Full on host)",
              "demoted", "failed", "leak", "CPU s"]
    cells = [[r["mix"], r["policy"], r["name"], r["turns"], r["recomputed"], r["loaded_from_host"],
              r["dropped_full_on_host"], r["demoted"], r["demote_failed"], r["leak"], r["cpu_s"]] for r in rows]
    print(f"SWA thin beside HiCache (ratio 2), page {PAGE}, window {GEOMETRY.window}, chunk {GEOMETRY.chunk}, "
          f"Full pool {GEOMETRY.full_tokens}, SWA pool {GEOMETRY.swa_tokens}; seeds {list(seeds)}, {units} turns each. "
          "recomputed / loaded: prompt tokens prefilled / KV tokens loaded host->device over every turn")
    print(table.render(header, cells))
    return {"rows": rows}
