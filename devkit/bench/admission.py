"""``python -m adapter bench admission [--quick]``: page-rounded admission on the real scheduler (CPU).

Two near-full page-64 workloads (:mod:`devkit.testkit.admission`) run to the end, switch off
(stock) and on, in one process; every figure is a deterministic count, so there is nothing to
interleave:

* ``waves`` (the boundary case at scale): waves of short decode rows with page-aligned prompts decoding in
  lockstep, each joined by one prompt sized to the budget the stock raw check reports;
* ``mixed``: independent arrivals with random prompt and output lengths.

Per workload and mode: overcommit pages (after each prefill pass, the page-exact KV live requests
still need beyond free + evictable, summed), decode retractions, recomputed prefill tokens, and
admitted throughput: useful tokens (prompt + output of finished requests) per forward, and per
modelled second (forward costs from :mod:`adapter.cost_model` defaults, placeholders). The
throughput change is switch vs stock in percent.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from adapter.core import boot
from adapter.ops import table
from devkit.testkit.admission import WorkloadSpec, WorkloadStats, run_workload

SCHEDULER = "sglang.srt.managers.scheduler"
FULL = {"waves": WorkloadSpec(kind="waves", waves=24), "mixed": WorkloadSpec(kind="mixed", arrivals=300)}
QUICK = {"waves": WorkloadSpec(kind="waves", waves=8), "mixed": WorkloadSpec(kind="mixed", arrivals=100)}


def _run(spec: WorkloadSpec, switch: bool) -> WorkloadStats:
    boot.uninstall()
    if switch:
        importlib.import_module(SCHEDULER)
        outcome = boot.install({"DSV41_PAGE_ROUNDED_ADMISSION": "1"}).outcomes["page_rounded_admission"]
        if outcome.status != "installed":
            raise RuntimeError(f"page_rounded_admission did not install: {outcome.reason}")
    try:
        return run_workload(spec)
    finally:
        boot.uninstall()


def _change(a: float, b: float) -> float:
    return round((b / a - 1) * 100, 2)


def run(quick: bool = False) -> dict[str, Any]:
    # Stock's "KV cache pool is full. Retract requests" warnings are counted, not printed.
    logging.getLogger("sglang").setLevel(logging.ERROR)
    figures: dict[str, Any] = {}
    rows = []
    for name, spec in (QUICK if quick else FULL).items():
        stock, switch = _run(spec, False), _run(spec, True)
        for mode, s in (("stock", stock), ("switch", switch)):
            rows.append([name, mode, s.admissions, s.overcommit_events, s.overcommit_pages, s.retractions,
                         s.recomputed_tokens, s.forwards, f"{s.useful_tokens_per_forward:.1f}",
                         f"{s.useful_tokens_per_modelled_second:.0f}"])
        per_forward = _change(stock.useful_tokens_per_forward, switch.useful_tokens_per_forward)
        modelled = _change(stock.useful_tokens_per_modelled_second, switch.useful_tokens_per_modelled_second)
        suffix = "" if name == "waves" else f"_{name}"
        figures.update({
            f"overcommit_pages_stock{suffix}": stock.overcommit_pages,
            f"overcommit_pages_switch{suffix}": switch.overcommit_pages,
            f"retractions_stock{suffix}": stock.retractions,
            f"retractions_switch{suffix}": switch.retractions,
            f"recomputed_tokens_stock{suffix}": stock.recomputed_tokens,
            f"recomputed_tokens_switch{suffix}": switch.recomputed_tokens,
            f"throughput_change_pct_per_forward{suffix}": per_forward,
            f"throughput_change_pct_modelled{suffix}": modelled,
        })
    header = ["workload", "mode", "prefills", "overcommit passes", "overcommit pages", "retractions",
              "recomputed tok", "forwards", "useful tok/fwd", "useful tok/modelled s"]
    print(table.render(header, rows))
    print("throughput change, switch vs stock: " + ", ".join(
        f"{k.removeprefix('throughput_change_pct_')} {v:+.2f}%" for k, v in figures.items() if k.startswith("throughput")
    ))
    return figures
