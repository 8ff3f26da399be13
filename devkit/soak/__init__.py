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

The traffic (:mod:`.traffic`; one seeded ``random.Random``, so the same seed gives the same order
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

Modules: :mod:`.traffic` (the scenarios and what each request came to), :mod:`.server` (the probes,
the scheduler's RSS, the server log), :mod:`.boots` (one boot: a :class:`Leg`; the two-rank CPU
environment), :mod:`.verdict` (the verdict and the parking budget), :mod:`.memory` (the memory
judgement), :mod:`.retractions` (kv_park's retraction table); :mod:`.drift` and :mod:`.bad_inputs`
stand on their own (reliability.md). This module: the soak's plan (:func:`run`) and its command line.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devkit.soak import memory, retractions
from devkit.soak.boots import RETRACT_INTERVAL, SOAK_ENV, TP2_ENV, Leg, run_leg
from devkit.soak.server import (
    PROBES,
    RSS_EVERY_S,
    WARMUP_FRACTION,
    RssSampler,
    probe_prompts,
    read_log,
    rss_kib,
    run_probes,
    scheduler_pid,
)
from devkit.soak.traffic import MAX_REQUESTS, Tally, Traffic
from devkit.soak.verdict import parked_budget, parked_bytes_bound, soak_verdict

__all__ = ["DEFAULT_OUT", "MAX_REQUESTS", "MODELS", "PROBES", "RETRACT_INTERVAL", "RSS_EVERY_S", "SOAK_ENV",
           "TP2_ENV", "WARMUP_FRACTION", "Leg", "RssSampler", "Tally", "Traffic", "add_arguments",
           "default_stock_minutes", "main", "parked_budget", "parked_bytes_bound", "probe_prompts", "read_log",
           "rss_kib", "run", "run_leg", "run_probes", "scheduler_pid", "soak_profile", "soak_verdict",
           "switch_profiles"]

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "build" / "soak"
MODELS = ("mellum", "dsv4")


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
