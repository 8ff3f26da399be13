"""``python -m adapter gate [--quick]``: the release gate on SGLang 0.5.23's real HTTP server (CPU).

What it does, in order (every server is started and stopped by :mod:`devkit.engine_kit.launcher`;
one at a time; all share the model, the seed, the server arguments and the workload):

1. builds the tiny hybrid SWA model (:mod:`devkit.engine_kit.model`, reused when it exists);
2. boot A1, stock (no ``DSV41_*`` key): runs the workload of :mod:`devkit.engine_kit.workload`
   with SGLang's forward-pass metrics recorded (:mod:`devkit.engine_kit.fpm`);
3. calibration: ``python -m adapter fit-cost-model`` on A1's forward-pass metrics, so the profile
   boot's decode-yield coefficients are fitted on this machine (printed); done once A1 is over,
   before the profile boot, instead of on a boot of its own (one boot less on a 2-core machine);
4. boot B, the profile: every switch whose registry record's ``gate_role`` acts on this engine
   (its ``profile`` keys); its receipts are checked with :func:`adapter.core.receipts.audit`;
5. boot A2, stock again;
6. the latency leg (:mod:`devkit.gate.latency`): SGLang's ``bench_serving`` multi-turn chat that
   loads the kit, against three more boots, stock / the shipped profile's switch keys / stock: TTFT,
   throughput and ITL against decode yield's bound; the gate's verdict is the worse of the two legs'
   (FAIL over INVALID over PASS). Run with the import hook and the whole profile only (not under
   ``--hicache``, ``--via plugin``, ``--without`` or ``--drop-key``, whose runs judge the switch
   rows); ``--no-latency`` skips it.

``--hicache``: every boot (A1, B, A2) runs with the datacenter profile's HiCache flags and churn that
outruns its host tier (:mod:`devkit.gate.hicache_leg`), so each row judges a switch beside HiCache
against stock beside HiCache, on a workload where stock + HiCache loses the idle session; a host phase
then presses the device Full pool so a session's Full KV goes to host, and one more row,
``cone_replay (Full KV from host)``, passes only where the cone's ``load`` line says that Full KV came
back from host for the session's resume and the replay stayed at N.
``--drop-key KEY``: the profile boot runs without KEY while every row is still judged (a row seen
failing when its switch is off); ``--without SWITCH`` leaves the switch and its row out;
``--set-key KEY=VALUE``: both legs' profile boots run with KEY set (a registry key, its value
checked), e.g. a switch's guard turned off to see the latency leg fail without it.

It reads SGLang's own reports: ``cached_tokens`` (``--enable-cache-report``), the scheduler log
(``Prefill batch`` / ``Decode batch`` lines, ``--decode-log-interval 1``) and client-side stream
timings. One row per switch: its effect against both controls, or "not available in this build:
<reason>" / "not applicable here: <reason>" / "not in the profile: <reason>" (never a pass); a row whose
switch could not act on the leg's workload says so and makes the run INVALID (:func:`overall`). The two controls must agree (same
greedy tokens on the sequential requests, same cache figures, decode shares within
:data:`SHARE_TOLERANCE`); if they do not, the run is INVALID. Greedy outputs of B must equal the
controls' on every prompt where the controls agree.

The last line printed is one JSON object (see :func:`run`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adapter.core import registry
from devkit.gate import boots, hicache_leg
from devkit.gate.boots import calibrate, run_boot
from devkit.gate.record import Boot
from devkit.gate.verdict import (
    CANNOT_ACT,
    LOGPROB_TOLERANCE,
    SHARE_MARGIN,
    SHARE_TOLERANCE,
    _effect_row,
    acting,
    available,
    build_profile,
    compare_outputs,
    cone_logprob_diff,
    controls_agree,
    decode_steps_between_chunks,
    drop_keys,
    mean_present,
    overall,
    print_table,
    rows,
)

__all__ = ["CANNOT_ACT", "LOGPROB_TOLERANCE", "SHARE_MARGIN", "SHARE_TOLERANCE", "Boot", "_effect_row", "acting", "available",
           "build_profile", "calibrate", "compare_outputs", "cone_logprob_diff", "controls_agree",
           "decode_steps_between_chunks", "drop_keys", "main", "overall", "print_table", "rows", "run", "run_boot"]

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "build" / "gate"


def run(quick: bool = True, out: str | Path | None = None, say: Callable[[str], None] = print,
        without: tuple[str, ...] = (), model_kit: str = "mellum", via: str = "import-hook",
        hicache: bool = False, drop: tuple[str, ...] = (), latency: bool = True,
        set_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """Build, boot A1 / B / A2, judge; then the latency leg (``latency``, where it applies: see
    :func:`latency_skipped`); returns the figures (the CLI prints them as the last line)."""
    from adapter.core import receipts
    from devkit.engine_kit import model_kits
    from devkit.gate import shipped, ways

    t0 = time.monotonic()
    kit = model_kits.kit(model_kit)  # a bad --model fails before any boot
    ways.check(via, kit.name)  # so does a way this kit cannot boot
    drop_keys(build_profile(without=without), drop)  # a bad --without or --drop-key fails before any boot
    shipped.with_set_keys({}, set_keys)  # so does a bad --set-key
    launch_extra = hicache_leg.launch_args() if hicache else ()
    workload = (kit.workload(quick, hicache_leg.host_ratio(launch_extra), hicache_leg.write_policy(launch_extra))
                if hicache else kit.workload(quick))
    workload.validate()
    out = Path(out) if out else DEFAULT_OUT / (kit.name + ("-hicache" if hicache else ""))
    out.mkdir(parents=True, exist_ok=True)
    model = kit.build(out)
    say(f"gate: model {model} ({kit.describe()}); workload {'quick' if quick else 'full'}; via {via}"
        f"{'; HiCache on every boot (' + hicache_leg.PROFILE.name + '): ' + ' '.join(launch_extra) if hicache else ''}"
        f"{f'; churn {workload.churn_requests} x {workload.churn_tokens} tokens' if hicache else ''}"
        f"{f'; host phase churn {workload.host_churn_requests} x {workload.churn_tokens} tokens' if hicache else ''}"
        f"; logs in {out}")
    plugin = ways.prepare(via, out, say)
    with boots._terminate_as_interrupt():
        a1 = run_boot(Boot("A1-stock", {}, out / "A1-stock.log"), model, workload, out, say=say, kit=kit,
                      plugin=plugin, launch_extra=launch_extra)
        calibration = calibrate(a1.fpm_log, out)
        say(f"calibration: {calibration['status']}")
        for line in calibration.get("output", "").splitlines():
            say(f"  | {line}")
        profile = build_profile(calibration["keys"], without)
        profile.update({k: v for k, v in kit.profile_overrides().items() if k in profile})
        profile = shipped.with_set_keys(drop_keys(profile, drop), set_keys)
        say("profile: " + (" ".join(f"{k}={v}" for k, v in profile.items()) or "(empty: no switch available)")
            + (f"; dropped with --drop-key (rows still judged): {' '.join(drop)}" if drop else "")
            + (f"; set with --set-key: {' '.join(set_keys)}" if set_keys else ""))
        b = run_boot(Boot("B-profile", profile, out / "B-profile.log"), model, workload, out, say=say, kit=kit,
                     plugin=plugin, launch_extra=launch_extra)
        a2 = run_boot(Boot("A2-stock", {}, out / "A2-stock.log"), model, workload, out, say=say, kit=kit,
                      plugin=plugin, launch_extra=launch_extra)

    config = registry.resolve(profile)
    gaps = receipts.audit(b.log_lines, config, ranks=1) if profile else ["profile is empty"]
    stock_receipts = [line for x in (a1, a2) for line in x.log_lines if "[dsv41]" in line]
    if stock_receipts:
        gaps.append(f"a stock boot logged overlay lines: {stock_receipts[0].strip()}")
    outputs = compare_outputs(a1.outputs(), a2.outputs(), b.outputs())
    valid, invalid_why = controls_agree(a1, a2, outputs)
    table = rows(a1, b, a2, gaps, outputs["outputs_equal"], without)
    leftover = a1.leftover + b.leftover + a2.leftover
    verdict, verdict_why = overall(valid, not gaps, outputs["outputs_equal"], table)

    print_table(table, say)
    say(f"controls agree: {'yes' if valid else 'NO -> INVALID: ' + '; '.join(invalid_why)}")
    say(f"receipts: {'ok' if not gaps else 'FAILED: ' + '; '.join(gaps)}")
    say(f"greedy outputs: {outputs['equal']}/{outputs['compared']} prompts equal to the controls"
        + (f"; differ: {', '.join(outputs['differ'])}" if outputs["differ"] else "")
        + (f"; controls differ (not compared): {', '.join(outputs['controls_differ'])}" if outputs["controls_differ"] else ""))
    skipped = latency_skipped(latency, via, hicache, without, drop)
    if skipped is None:
        from devkit.gate import latency as latency_leg

        latency_figures = latency_leg.run(quick=quick, model_kit=kit.name, say=say, set_keys=set_keys,
                                          out=out.parent / f"{out.name}-latency")
        verdict, verdict_why = with_latency(verdict, verdict_why, latency_figures["verdict"])
    else:
        latency_figures = {"verdict": "not run", "why": skipped}
        say(f"latency leg: not run ({skipped})")
    say(f"gate: {verdict}{' (' + verdict_why + ')' if verdict_why else ''} in {time.monotonic() - t0:.0f} s")
    return {
        "verdict": verdict,
        "verdict_why": verdict_why,
        "valid": valid,
        "receipts_ok": not gaps,
        "outputs_equal": outputs["outputs_equal"],
        "decode_share_stock": mean_present([a1.yield_.get("decode_share"), a2.yield_.get("decode_share")]),
        "decode_share_profile": b.yield_.get("decode_share"),
        "resume_cached_frac_stock": mean_present([a1.cache.get("resume_cached_frac"), a2.cache.get("resume_cached_frac")]),
        "resume_cached_frac_profile": b.cache.get("resume_cached_frac"),
        "cone_recomputed_tokens": b.cache.get("cone_recomputed_tokens"),
        "cone_logprob_max_diff": cone_logprob_diff(a1, b, a2),
        "cone_stock_recomputed_tokens": mean_present([a1.cache.get("cone_recomputed_tokens"),
                                               a2.cache.get("cone_recomputed_tokens")]),
        "controls": {x.label: {"decode_share": x.yield_.get("decode_share"),
                               "resume_cached_frac": x.cache.get("resume_cached_frac"),
                               "cone_recomputed_tokens": x.cache.get("cone_recomputed_tokens")} for x in (a1, a2)},
        "calibration": {"status": calibration["status"], **calibration["keys"]},
        "profile": profile,
        "rows": {r["switch"]: r["status"] for r in table},
        "startup_s": [round(x.startup_s or 0, 1) for x in (a1, b, a2)],
        "leftover_processes": len(leftover),
        "model": kit.name,
        "via": via,
        "hicache": list(launch_extra),
        "quick": quick,
        "without": list(without),
        "drop_keys": list(drop),
        "set_keys": list(set_keys),
        "churn_requests": workload.churn_requests,
        "latency": latency_figures,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def latency_skipped(latency: bool, via: str, hicache: bool, without: tuple[str, ...],
                    drop: tuple[str, ...]) -> str | None:
    """Why the latency leg does not run in this gate run (None: it runs)."""
    if not latency:
        return "--no-latency"
    if via != "import-hook":
        return f"--via {via}: the leg boots through the import hook"
    if hicache:
        return "--hicache: the leg judges the gate's profile without HiCache"
    if without or drop:
        return "--without / --drop-key: the leg judges the gate's whole profile"
    return None


def with_latency(verdict: str, why: str, latency_verdict: str) -> tuple[str, str]:
    """The gate's verdict with the latency leg's: the worse of the two (FAIL over INVALID over PASS)."""
    if latency_verdict == "PASS":
        return verdict, why
    rank = {"PASS": 0, "INVALID": 1, "FAIL": 2}
    reason = f"latency leg {latency_verdict}"
    if rank.get(latency_verdict, 2) > rank[verdict]:
        return latency_verdict if latency_verdict in rank else "FAIL", reason
    return verdict, "; ".join(x for x in (why, reason) if x)


def add_arguments(parser: Any) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="the short workload (about 4-5 minutes on a quiet 2-core machine, the latency leg included; "
                        "--model dsv4: longer)")
    parser.add_argument("--out", help=f"folder for logs and the model (default {DEFAULT_OUT}/<model>)")
    parser.add_argument("--model", default="mellum", choices=("mellum", "dsv4"),
                        help="the model kit: the tiny hybrid SWA Mellum (default) or the tiny DeepSeek-V4.1")
    parser.add_argument("--via", default="import-hook", choices=("import-hook", "plugin"),
                        help="how the servers load the overlay: sitecustomize.py on PYTHONPATH (default) or the "
                        "wheel installed in a fresh venv as SGLang's plugin (SGLANG_PLUGINS=dsv41; mellum only)")
    parser.add_argument("--without", action="append", default=[], metavar="SWITCH",
                        help="leave this acting switch out of the profile boot (repeatable); its row says so")
    parser.add_argument("--drop-key", action="append", default=[], metavar="KEY",
                        help="run the profile boot without this key of the gate's profile (repeatable); every row "
                        "is still judged, so the switch's row shows what the boot without it measured")
    parser.add_argument("--set-key", action="append", default=[], metavar="KEY=VALUE",
                        help="run the profile boots (both legs) with KEY set to VALUE (repeatable; a registry key), "
                        "e.g. DSV41_DECODE_YIELD_LOAD_GUARD=0 to see the latency leg without decode yield's load guard")
    parser.add_argument("--latency", action="store_true",
                        help="the latency leg alone (devkit/gate/latency.py): bench_serving multi-turn chat that loads "
                        "the kit against stock / shipped profile / stock boots: TTFT, throughput and ITL against the bound")
    parser.add_argument("--no-latency", action="store_true",
                        help="the switch legs only: skip the latency leg that follows them (three more boots)")
    parser.add_argument("--hicache", action="store_true",
                        help=f"every boot with the HiCache flags of {hicache_leg.PROFILE.name} and churn that outruns "
                        "its host tier: the switches beside HiCache")


def main(args: Any) -> int:
    if getattr(args, "latency", False):
        from devkit.gate import latency

        return latency.main(args)
    try:
        figures = run(quick=args.quick, out=args.out, without=tuple(args.without), model_kit=args.model,
                      via=args.via, hicache=getattr(args, "hicache", False), drop=tuple(getattr(args, "drop_key", ())),
                      latency=not getattr(args, "no_latency", False), set_keys=tuple(getattr(args, "set_key", ())))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(figures, sort_keys=False))
    return 0 if figures["verdict"] == "PASS" else 1
