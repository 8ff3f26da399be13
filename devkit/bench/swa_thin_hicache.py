"""``python -m adapter bench swa-thin-hicache [--quick]``: SWA thin beside HiCache, on the real cache.

The cache kit (:mod:`overlay_tools.simulate.cache_kit`) with HiCache attached (``init_hicache``: SGLang's
host pools, controller and transfers on the engine kit's CPU routes), at a scaled DSV4 shape (page
16, window 8, chunk 128). Two idle sessions (4K tokens, one chunked turn each) go quiet; sub-agent
turns (256-768 tokens, two turns each) and new 8K-token sessions run beside them; then each idle
session sends its next turn (+128 tokens). Two forms:

* ``swa``: the churn evicts only SWA windows (Full pool of 1M tokens);
* ``full``: the churn presses the Full pool too (Full pool of 24K tokens), so the idle sessions'
  Full KV leaves the device.

Rows per form: ``stock`` and ``thin`` without HiCache, beside HiCache write-back with a host tier
large enough to keep everything (``--hicache-ratio 4``) and small enough that the host evicts too
(ratio 0.5), and beside write-through (ratio 4). Per row, over the two resumed turns: prompt tokens
recomputed and KV tokens loaded back from host, and over the whole run the KV tokens copied
device->host and host->device (what HiCache reports to its metrics collector) and CPU seconds.
Traffic: 8x the SWA pool (``--quick``: that level, form ``swa``, the six write-back rows) and 24x.
"""

from __future__ import annotations

import random
import time
from typing import Any

from adapter.ops import table
from devkit.testkit import radix_cache as rc
from devkit.testkit.swa_thin import CHUNK, PAGE, WINDOW, cache_kit, install_thin, traffic_unit
from overlay_tools.simulate.cache_kit import HiCache

IDLE_LEN, LONG_LEN, NEW_TURN = 4096, 8192, 128
FORMS = {"swa": 1 << 20, "full": 24 * 1024}  # Full pool tokens
SWA_POOL = 2048
ROWS = (  # name, thin, HiCache
    ("stock", False, None),
    ("thin", True, None),
    ("stock_hicache", False, HiCache(ratio=4.0, write_policy="write_back")),
    ("thin_hicache", True, HiCache(ratio=4.0, write_policy="write_back")),
    ("stock_hicache_small", False, HiCache(ratio=0.5, write_policy="write_back")),
    ("thin_hicache_small", True, HiCache(ratio=0.5, write_policy="write_back")),
    ("stock_hicache_wt", False, HiCache(ratio=4.0, write_policy="write_through")),
    ("thin_hicache_wt", True, HiCache(ratio=4.0, write_policy="write_through")),
)


def _h2d(counter: Any) -> int:
    return sum(counter.h2d_tokens.values()) if counter is not None else 0


def run_row(form: str, thin: bool, hicache: HiCache | None, traffic: int, seed: int = 1) -> dict[str, Any]:
    t0 = time.process_time()
    kit = cache_kit(FORMS[form], SWA_POOL, thin, hicache)
    rng, tok = random.Random(seed), rc.Tokens()
    idle = [kit.run_turn(tok.fresh(IDLE_LEN), PAGE).history for _ in range(2)]
    start, unit = kit.swa_alloc_tokens, 0
    while kit.swa_alloc_tokens - start < traffic:
        unit += 1
        traffic_unit(kit, tok, rng, unit, LONG_LEN)
    counter = kit.cache.metrics_collector
    h2d_before = _h2d(counter)
    resumed = [kit.run_turn(history + tok.fresh(NEW_TURN), PAGE) for history in idle]
    kit.cache.sanity_check()
    out = {
        "recomputed": sum(r.reprefilled for r in resumed),
        # KV tokens (Full and SWA pools) the resumed turns' load-backs copied host->device
        "loaded_from_host": _h2d(counter) - h2d_before,
        "loaded_from_l3": 0,  # no L3 backend in these rows
        "d2h_tokens": sum(counter.d2h_tokens.values()) if counter is not None else 0,
        "h2d_tokens": _h2d(counter),
        "leak": sum(kit.leak_check().values()),
        "cpu_s": round(time.process_time() - t0, 2),
    }
    if hicache is not None:
        kit.cache.release_host_resources()
    return out


def run(quick: bool) -> dict[str, Any]:
    install_thin()
    # SWA slots of other traffic before the idle sessions resume: 8x and 24x the SWA pool
    levels = (8 * SWA_POOL,) if quick else (8 * SWA_POOL, 24 * SWA_POOL)
    forms = ("swa",) if quick else tuple(FORMS)
    rows: list[dict[str, Any]] = []
    for form in forms:
        for traffic in levels:
            for name, thin, hicache in ROWS[:6] if quick else ROWS:
                rows.append({"name": name, "form": form, "traffic": traffic, "kit": "cache",
                             **run_row(form, thin, hicache, traffic)})
    header = ["form", "traffic", "row", "recomputed", "loaded from host", "D->H (all runs)", "H->D", "leak", "CPU s"]
    cells = [[r["form"], r["traffic"], r["name"], r["recomputed"], r["loaded_from_host"], r["d2h_tokens"],
              r["h2d_tokens"], r["leak"], r["cpu_s"]] for r in rows]
    print(f"two idle {IDLE_LEN}-token sessions resume (+{NEW_TURN} each) after 'traffic' SWA slots of other traffic; "
          f"page {PAGE}, window {WINDOW}, chunk {CHUNK}, SWA pool {SWA_POOL}; form swa: Full pool {FORMS['swa']}, "
          f"form full: {FORMS['full']}. recomputed / loaded: prompt tokens prefilled / KV tokens loaded host->device "
          f"on the two resumed turns; D->H, H->D: KV tokens (Full + SWA pools) over the whole run")
    print(table.render(header, cells))
    return {"idle_len": IDLE_LEN, "swa_pool": SWA_POOL, "rows": rows}
