"""``python -m adapter simulate TRACE``: what the switches would do on a fleet's own traffic.

Replays a Mooncake-format trace (:mod:`.trace`) on SGLang's real ``UnifiedRadixCache``, allocators
and pools at the fleet's geometry (:mod:`.fleet`), requests overlapping on a modelled clock
(:mod:`.engine`), once per policy (stock, SWA thin, SWA thin + cone replay, SGLang's session radix
cache alone and beside thin, and stock and thin + cone with HiCache's host tier), and prints per policy: prompt tokens recomputed (all turns, continuation
turns), continuation turns that re-prefilled their history, the resume-point hit rate, cone plans
and fallbacks, retractions and the tokens they cost, tokens loaded back from host, the
infinite-cache ideal, and the modelled prefill time (:mod:`.report`). It says first how the trace
was split into sessions (requests linked, roots, candidate parents refused and why) and what the
replay leaves out; when one instance cannot keep up with the offered load (its modelled prefill
outlasts the trace), it says so and names the share that keeps up instead of printing queueing
artefacts as TTFT. ``--sweep`` reruns stock and thin over
``--swa-prefix-tails`` and thin + cone over N and prints, per policy, the smallest setting within
1 % of its best.

Ships in the wheel (``overlay_tools``); never imported by a serving process and never importing
devkit (import contracts in pyproject.toml).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from typing import Any

from overlay_tools.simulate.inputs import (
    QUICK_REQUESTS,
    check_time_scale,
    coefficients,
    describe_coefficients,
    first_sessions,
)

SWEEP_TAILS = (128, 256, 384, 512)
SWEEP_N = (2048, 4096, 8192)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="a Mooncake-format trace (JSON lines: timestamp, input_length, output_length, "
                                      "hash_ids)")
    parser.add_argument("--env-file", help="the profile whose launch line and keys give the geometry "
                                           "(default: the repo's .env.tp4.example)")
    parser.add_argument("--model", help="model folder (config.json) for window, layers and the cone's bound "
                                        "(default: DeepSeek-V4.1 as the production profile serves it)")
    parser.add_argument("--kv-tokens", type=int, help="Full KV pool tokens (default: the launch line's "
                                                      "--max-total-tokens, else 4M, an assumption)")
    parser.add_argument("--swa-prefix-tails", type=int, help="override the launch line's --swa-prefix-tails")
    parser.add_argument("--cone-tokens", type=int, help="override the profile's DSV41_SWA_CONE_TOKENS (N)")
    parser.add_argument("--share", type=_fraction, default=1.0, help="replay a seeded fraction of the sessions "
                        "(one instance's share of a cluster's trace), e.g. 0.25 or 1/16")
    parser.add_argument("--seed", type=int, default=0, help="the --share sample's seed")
    parser.add_argument("--session-key", metavar="FIELD", help="the trace's session or conversation id field: "
                        "a request continues the latest earlier one with the same id (instead of the heuristic "
                        "on hash_ids)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's timestamps")
    parser.add_argument("--policies", help="comma-separated subset of " + ", ".join(_policies()) + " (default: "
                        "those without +hicache, and those with it too when the profile's launch line has "
                        "--enable-hierarchical-cache)")
    parser.add_argument("--hicache", action="store_true", help="also run the +hicache policies (HiCache's host "
                        "tier) on a profile that does not enable it")
    parser.add_argument("--hicache-ratio", type=float, help="host pool tokens per device pool token for the "
                        "+hicache policies (default: the launch line's --hicache-ratio, else 2)")
    parser.add_argument("--sweep", action="store_true", help="also sweep --swa-prefix-tails (stock, thin) and N "
                        "(thin+cone)")
    parser.add_argument("--sweep-tails", type=_counts, default=SWEEP_TAILS,
                        help=f"the --swa-prefix-tails values of --sweep (default {','.join(map(str, SWEEP_TAILS))})")
    parser.add_argument("--sweep-n", type=_counts, default=SWEEP_N,
                        help=f"the N values of --sweep (default {','.join(map(str, SWEEP_N))}; below the bound: skipped)")
    parser.add_argument("--quick", action="store_true", help=f"the first whole sessions of the share, up to "
                        f"{QUICK_REQUESTS} requests (under a minute)")
    parser.add_argument("--pd", action="store_true", help="price each retraction as on a DeepSeek-V4 PD decode "
                        "node: SGLang's rebootstrap (the prefill peer recomputes prompt + output and resends the KV) "
                        "against DSV41_KV_PARK's park and restore, in tokens and modelled time")
    parser.add_argument("--pd-link-gbps", type=float, default=None, help="with --pd: prefill -> decode KV transfer "
                        "bandwidth, GB/s (default: an assumed 400 Gb/s NIC)")
    parser.add_argument("--pd-host-gbps", type=float, default=None, help="with --pd: decode node device <-> host "
                        "copy bandwidth, GB/s (default: an assumed value, printed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--plot", help="write a PNG (needs matplotlib: pip install matplotlib)")
    from overlay_tools.simulate.gateway import cli as gateway_cli

    gateway_cli.add_arguments(parser)  # --instances, --router, ...: the fleet behind smg (gateway/)


def _policies() -> tuple[str, ...]:
    from overlay_tools.simulate.fleet import POLICIES

    return POLICIES


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated whole numbers, e.g. 128,256,384")
    return values


def _fraction(text: str) -> float:
    try:
        num, _, den = text.partition("/")
        value = float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"--share={text!r}: expected a fraction in (0, 1], e.g. 0.25 or 1/16") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"--share={text!r}: expected a fraction in (0, 1]")
    return value


def run_policy(policy: str, fleet: Any, requests: list[Any], time_scale: float = 1.0,
               progress: bool = True, coef: Any = None, share: float = 1.0,
               pd: tuple[float, float] | None = None) -> tuple[list[Any], dict[str, Any]]:
    """One policy's replay on a fresh cache: its turns and figures (leak check and load included;
    ``share``: the fraction of the trace ``requests`` are, for the share that keeps up; ``pd``: the link
    and host bandwidths (GB/s) to price its retractions as a DeepSeek-V4 PD decode node's, :mod:`.pd`)."""
    from adapter import cost_model
    from adapter.switches.cone_replay.plan import COUNTERS, FALLBACKS
    from overlay_tools.simulate import engine, report
    from overlay_tools.simulate.fleet import build_kit, uninstall

    max_ctx = max(r.history_len for r in requests) + fleet.page
    bar = report.Progress(policy, len(requests)) if progress else None
    try:
        kit = build_kit(policy, fleet, max_ctx)
        replay = engine.Replay(kit, requests, chunk=fleet.chunk, max_running=fleet.max_running,
                               coef=coef or cost_model.DEFAULTS, time_scale=time_scale, progress=bar,
                               kv_park=getattr(fleet, "kv_park", False),
                               max_prefill_tokens=getattr(fleet, "max_prefill_tokens", 1 << 30),
                               context_len=getattr(fleet, "context_len", None))
        turns, wall = engine.timed(replay.run)
        leak = kit.leak_check()
        kit.cache.sanity_check()
        row = report.summarize(turns, wall, dict(FALLBACKS) if "cone" in policy else None,
                               hicache=kit.cache.cache_controller is not None)
        row.update(report.load_figures(turns, replay.prefill_busy_fs, replay.busy_fs, replay.span_fs, share))
        if "cone" in policy:  # plans whose Full KV of [D, F) the admission loaded back from host
            row.update(cone_loads=COUNTERS.loads, cone_loaded_tokens=COUNTERS.loaded_tokens)
        row["leak"] = leak["full"] + leak["swa"]
        row["clipped_outputs"] = replay.clipped  # outputs the scheduler's max_new_tokens clip shortens
        if pd is not None:
            from overlay_tools.simulate import pd as pd_price

            kv = pd_price.kv_bytes(kit.allocator.get_kvcache(), fleet.dsv4)
            row.update(pd_price.price(pd_price.retractions(replay.events, requests), kv, coef or cost_model.DEFAULTS,
                                      fleet.chunk, *pd))
    finally:
        if bar is not None:
            bar.close()
        uninstall()  # the next policy starts from no switch installed
    del kit, replay
    gc.collect()
    return turns, row


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from adapter.core import env
    from overlay_tools.simulate import engine, fleet, report, trace
    from overlay_tools.simulate import pd as pd_price
    from overlay_tools.simulate.gateway import cli as gateway_cli

    if gateway_cli.wanted(args):
        return gateway_cli.simulate_fleet(args)
    if args.policies is not None:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        for p in policies:
            if p not in fleet.POLICIES:
                raise env.ConfigError("--policies", p, "one of " + ", ".join(fleet.POLICIES))
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):
        raise env.ConfigError("--time-scale", str(args.time_scale), "a finite positive factor")
    # One thread: the replay is sequential, and torch's small index writes on two threads of a
    # shared machine cost 100x more than on one (measured: 11 ms vs 0.05 ms for 8192 slots).
    torch.set_num_threads(1)
    session_key = getattr(args, "session_key", None)
    geo = fleet.resolve(args.env_file, args.model, args.kv_tokens, args.swa_prefix_tails, args.cone_tokens,
                        args.hicache_ratio)
    parsed = trace.read(args.trace, session_key, geo.context_len)  # every length within the model's context
    check_time_scale(parsed, args.time_scale)
    share = args.share
    links = trace.link_sessions(parsed, session_key)
    requests = trace.sample_sessions(parsed, share, args.seed)
    if args.policies is None:
        policies = list(fleet.POLICIES if args.hicache else geo.default_policies())
    trace.TokenBuilder(geo.page).build(requests, {r.index: r for r in requests})
    if args.quick:
        requests = first_sessions(requests, QUICK_REQUESTS)
    ideal = engine.ideal_prefixes(requests, geo.page)
    coef = coefficients(geo.profile)
    print(f"simulate {args.trace}: {len(requests)} requests ({sum(r.parent is None for r in requests)} sessions, "
          f"{sum(r.parent is not None for r in requests)} continuation turns), share {share:g} (seed {args.seed})"
          f"{', --quick sample' if args.quick else ''}, time scale {args.time_scale:g}")
    print(links.describe())
    print(f"geometry: {geo.describe()}")
    for warning in geo.profile_warnings:
        print(f"profile: {warning}")
    pd = pd_bandwidths(args, geo)
    left_out = report.left_out(geo.kv_park, geo.dsv4) + ([pd_price.LEFT_OUT] if pd else [])
    print(f"cost model: {describe_coefficients(coef)}")
    print("left out (the replay's simplifications):")
    for item in left_out:
        print(f"  - {item}")
    rows: dict[str, dict[str, Any]] = {}
    all_turns: dict[str, list[Any]] = {}
    for policy in policies:
        turns, row = run_policy(policy, geo, requests, args.time_scale, coef=coef, share=share, pd=pd)
        rows[policy], all_turns[policy] = row, turns
    ideal_row = report.ideal_summary(next(iter(all_turns.values())), ideal) if all_turns else {}
    print()
    print(report.table(rows, ideal_row))
    print(f"p90: {report.PERCENTILE_METHOD}")
    for line in report.overload_lines(rows):
        print(line)
    if pd:
        print(pd_price.table(rows))
    out: dict[str, Any] = {"trace": str(args.trace), "requests": len(requests), "share": share, "seed": args.seed,
                           "quick": args.quick, "sessions": links.as_dict(), "geometry": geo.as_dict(),
                           "cost_model": dict(coef.items(), source=coef.source),
                           "policies": rows, "ideal": ideal_row, "left_out": left_out,
                           "percentile_method": report.PERCENTILE_METHOD}
    if args.sweep:
        out["sweep"] = sweep(args, geo, requests, coef)
    if args.plot:
        report.plot(args.plot, all_turns, f"{args.trace}: {len(requests)} requests, share {share:g}; "
                    f"{geo.describe()}")
        print(f"plot: {args.plot}")
    return out


def pd_bandwidths(args: argparse.Namespace, geo: Any) -> tuple[float, float] | None:
    """``--pd``'s (link, host) bandwidths in GB/s, or None without ``--pd``; a clear error when the fleet's
    model is not DeepSeek-V4 (SGLang rebootstraps only a ``DeepSeekV4TokenToKVPool``) or a bandwidth is not
    a finite positive number."""
    from adapter.core import env
    from overlay_tools.simulate import pd as pd_price

    link, host = getattr(args, "pd_link_gbps", None), getattr(args, "pd_host_gbps", None)
    if not getattr(args, "pd", False):
        for flag, value in (("--pd-link-gbps", link), ("--pd-host-gbps", host)):
            if value is not None:
                raise env.ConfigError(flag, str(value), "used with --pd only")
        return None
    if geo.dsv4 is None:
        raise env.ConfigError("--pd", "set", "a DeepSeek-V4 model (--model or the profile's --model-path): SGLang "
                              "rebootstraps a retracted request only on a DeepSeekV4TokenToKVPool")
    bandwidths = (pd_price.LINK_GBPS if link is None else link, pd_price.HOST_GBPS if host is None else host)
    for flag, value in zip(("--pd-link-gbps", "--pd-host-gbps"), bandwidths, strict=True):
        if not (math.isfinite(value) and value > 0):
            raise env.ConfigError(flag, str(value), "a finite positive bandwidth in GB/s")
    return bandwidths


def sweep(args: argparse.Namespace, geo: Any, requests: list[Any], coef: Any) -> dict[str, Any]:
    """Stock and thin over --swa-prefix-tails, thin + cone over N: recomputed tokens each, and per
    policy the smallest setting within 1 % of its best."""
    import dataclasses

    from overlay_tools.simulate.fleet import with_tails

    result: dict[str, Any] = {}
    rows: dict[str, Any] = {}
    print("\nsweep (recomputed prompt tokens, all turns)")
    runs = [(policy, "swa_prefix_tails", t) for policy in ("stock", "thin") for t in args.sweep_tails]
    runs += [("thin+cone", "cone_tokens", n) for n in args.sweep_n if n >= geo.cone_bound and n % geo.page == 0]
    for policy, knob, value in runs:
        g = with_tails(geo, value) if knob == "swa_prefix_tails" else dataclasses.replace(geo, cone_tokens=value)
        _, row = run_policy(policy, g, requests, args.time_scale, coef=coef, share=getattr(args, "share", 1.0))
        result.setdefault(f"{policy} {knob}", {})[str(value)] = row["recomputed_tokens"]
        rows.setdefault(f"{policy} {knob}", {})[str(value)] = {
            k: row[k] for k in ("recomputed_tokens", "recomputed_tokens_continuation", "resume_hit_rate",
                                "whole_reprefills", "cone_plans", "cone_fallbacks", "prefill_s_modelled")}
        print(f"  {policy:<10} {knob}={value:<6} recomputed {row['recomputed_tokens']:>14,}  "
              f"resume hit {row['resume_hit_rate']}  cone plans {row['cone_plans']}")
    picks = {}
    for knob, values in result.items():
        best = min(values.values())
        picks[knob] = pick = min((int(v) for v, r in values.items() if r <= best * 1.01), default=None)
        print(f"  {knob}: smallest within 1 % of the best ({best:,} recomputed): {pick}")
    return {"runs": rows, "smallest_within_1pct": picks}


def main(args: argparse.Namespace) -> int:
    from overlay_tools.simulate.trace import ShareError, TraceError

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError:
            print("simulate --plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 2
    start = time.perf_counter()
    try:
        out = simulate(args)
    except (TraceError, ShareError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"wall {out['wall_s']} s")
    if args.json:
        print(json.dumps(out, sort_keys=False))
    return 0
