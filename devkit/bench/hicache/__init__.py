"""``python -m adapter bench hicache [--quick]``: resumed turns of idle sessions and of an agent
workload, stock and the profile, each without and with SGLang's HiCache, side by side in one run.

Two forms, one per run, and the output says which ran (``form`` in the JSON):

* full run, form ``server`` (:mod:`devkit.bench.hicache.server`): the Mellum and DSV4 kits' real
  servers, one boot per kit x row (11 boots; a boot is 30-150 s on this machine);
* ``--quick``, form ``cache`` (:mod:`devkit.bench.hicache.cache`): the same rows and workloads on
  SGLang's real ``UnifiedRadixCache`` + HiCache in-process (no model, so ``ttft_s`` and
  ``logprob_max_diff`` are null), under a minute: no server boot fits in one.

Workloads: ``idle_swa`` (an idle session; churn evicts only its SWA window), ``idle_full`` (churn
presses the Full pool: its Full KV leaves the device too) and ``agent`` (sessions on a shared system
prompt taking turns with churn in every idle gap; both kits, DSV4's in whole pages). Rows: ``stock``,
``stock_hicache`` (a large host tier), ``stock_hicache_small`` (a host tier that evicts too),
``stock_hicache_l3`` (small host + the ``file`` L3; server form), ``stock_hicache_large_l3`` (large
host + the ``file`` L3; server form), ``profile``, ``profile_hicache``.

Every row: ``name``, ``kit``, ``workload``, ``recomputed`` (history tokens prefilled again on the
resumed turns), ``loaded_from_host`` / ``loaded_from_l3`` (prefix tokens served through a host
load-back / an L3 prefetch), ``bytes_d2h`` / ``bytes_h2d`` and ``d2h_tokens`` / ``h2d_tokens`` (KV
HiCache copied device->host and back, per pool: ``kv`` = Full, ``swa``), ``logprob_max_diff``,
``ttft_s``. Each module's docstring says where each figure comes from.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from adapter.ops import table

ROW_KEYS = ("name", "kit", "workload", "recomputed", "loaded_from_host", "loaded_from_l3", "bytes_d2h", "bytes_h2d",
            "d2h_tokens", "h2d_tokens", "logprob_max_diff", "ttft_s")
REQUIRED_NAMES = ("stock", "stock_hicache", "profile", "profile_hicache")


def check_rows(rows: list[dict[str, Any]]) -> None:
    """Every row has the schema's keys with values of the right kind, and every kit has the four required rows."""
    for row in rows:
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise ValueError(f"row {row.get('name')!r} ({row.get('kit')}, {row.get('workload')}) lacks {missing}")
        for key in ("recomputed", "loaded_from_host", "loaded_from_l3", "bytes_d2h", "bytes_h2d"):
            if not isinstance(row[key], int) or row[key] < 0:
                raise ValueError(f"row {row['name']!r}: {key}={row[key]!r} is not a count >= 0")
        for key in ("logprob_max_diff", "ttft_s"):
            if row[key] is not None and not (isinstance(row[key], float) and row[key] >= 0):
                raise ValueError(f"row {row['name']!r}: {key}={row[key]!r} is neither null nor a float >= 0")
    for kit in sorted({r["kit"] for r in rows}):
        names = {r["name"] for r in rows if r["kit"] == kit}
        absent = [n for n in REQUIRED_NAMES if n not in names]
        if absent:
            raise ValueError(f"kit {kit!r} has no row named {absent}")


def _tokens(pools: dict[str, int]) -> str:
    return "/".join(f"{pools.get(p, 0)}" for p in ("kv", "swa"))


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def print_table(rows: list[dict[str, Any]], say: Callable[[str], None] = print) -> None:
    header = ["kit", "workload", "row", "recomputed", "from host", "from L3", "D->H bytes", "H->D bytes",
              "D->H kv/swa tok", "H->D kv/swa tok", "ttft_s", "logprob diff", "vs hit"]
    cells = [[r["kit"], r["workload"], r["name"], r["recomputed"], r["loaded_from_host"], r["loaded_from_l3"],
              r["bytes_d2h"], r["bytes_h2d"], _tokens(r["d2h_tokens"]), _tokens(r["h2d_tokens"]),
              "-" if r["ttft_s"] is None else f"{r['ttft_s']:.3f}",
              _g(r["logprob_max_diff"]), _g(r.get("logprob_diff_vs_hit"))] for r in rows]
    for line in table.render(header, cells).splitlines():
        say(line)
    for r in rows:
        if r.get("cone"):
            c = r["cone"]
            say(f"cone: {r['kit']} {r['workload']} {r['name']}: plans {c['plans']}, loads from host {c['loads']} "
                f"({c['loaded_tokens']} Full tokens), replayed {c['replayed']}, fallbacks "
                f"{' '.join(f'{k}={v}' for k, v in c['fallbacks'].items()) or 'none'}")
        if r.get("reference_cached"):
            say(f"note: {r['kit']} {r['workload']} {r['name']}: the reference re-prefill itself found "
                f"{r['reference_cached']} tokens cached (L3 files outlive /flush_cache); its logprob diff is not from a re-prefill")


def run(quick: bool = False) -> dict[str, Any]:
    start = time.perf_counter()
    if quick:
        from devkit.bench.hicache import cache as form

        form_name, rows, describe = "cache", form.rows(), form.describe()
    else:
        from devkit.bench.hicache import server as form

        form_name, rows, describe = "server", form.rows(), form.describe()
    check_rows(rows)
    wall = time.perf_counter() - start
    print(describe)
    print_table(rows)
    load = os.getloadavg()
    print(f"form {form_name}; wall {wall:.1f} s; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return {"form": form_name, "rows": rows, "wall_s": round(wall, 1), "load_average": [round(x, 2) for x in load]}
