"""``simulate TRACE --instances N --router POLICY``: the fleet behind smg, and ``--target-ttft-p90``'s
sizing. The trace is prepared as the single-instance replay prepares it; every profile x router runs
on fresh caches; the table is :mod:`.report`'s."""

from __future__ import annotations

import argparse
import gc
import math
from typing import Any

DEFAULT_ROUTERS = ("cache_aware", "round_robin", "power_of_two", "consistent_hashing")
DEFAULT_MAX_INSTANCES = 8  # each instance is a real cache at the profile's pool sizes (about 1 GiB at DSV4's)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from overlay_tools.simulate.gateway.router import POLICIES, SMG_VERSION

    parser.add_argument("--instances", type=_positive, help="replay the whole trace on N instances behind smg's "
                        f"router (smg {SMG_VERSION}'s policies)")
    parser.add_argument("--router", help="comma-separated subset of " + ", ".join(POLICIES) + " (default: "
                        + ", ".join(DEFAULT_ROUTERS) + ")")
    parser.add_argument("--router-arg", action="append", metavar="K=V", help="a router setting (repeatable), e.g. "
                        "cache_threshold=0.5 balance_abs_threshold=32; defaults are smg's CLI's")
    parser.add_argument("--target-ttft-p90", type=float, metavar="MS", help="size the fleet: the smallest N whose "
                        "modelled TTFT p90 is at most MS, per profile and router")
    parser.add_argument("--target-ttft-p99", type=float, metavar="MS", help="... and p99 at most MS")
    parser.add_argument("--max-instances", type=_positive, default=DEFAULT_MAX_INSTANCES,
                        help=f"the largest N sizing tries (default {DEFAULT_MAX_INSTANCES})")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return value


def wanted(args: argparse.Namespace) -> bool:
    return any(getattr(args, name, None) is not None for name in
               ("instances", "router", "router_arg", "target_ttft_p90", "target_ttft_p99"))


def simulate_fleet(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from adapter.core import env
    from overlay_tools.simulate import engine, fleet, inputs, trace
    from overlay_tools.simulate import report as single
    from overlay_tools.simulate.gateway import report, router
    from overlay_tools.simulate.gateway.replay import LEFT_OUT, page_keys, run_fleet

    routers = [r.strip() for r in (args.router or ",".join(DEFAULT_ROUTERS)).split(",") if r.strip()]
    for name in routers:
        if name not in router.POLICIES:
            raise env.ConfigError("--router", name, "one of " + ", ".join(router.POLICIES))
    cfg = router.config_from_args(args.router_arg)
    if args.share != 1.0:
        raise env.ConfigError("--share", str(args.share), "1 with --instances (the router sees the whole trace)")
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):
        raise env.ConfigError("--time-scale", str(args.time_scale), "a finite positive factor")
    for flag, value in (("--sweep", args.sweep), ("--plot", args.plot)):
        if value:
            raise env.ConfigError(flag, str(value), "not with --instances (the single-instance replay's)")
    sizing = args.target_ttft_p90 is not None or args.target_ttft_p99 is not None
    instances = args.instances or (None if sizing else 4)
    torch.set_num_threads(1)
    geo = fleet.resolve(args.env_file, args.model, args.kv_tokens, args.swa_prefix_tails, args.cone_tokens,
                        args.hicache_ratio)
    parsed = trace.read(args.trace, args.session_key, geo.context_len)  # every length within the model's context
    inputs.check_time_scale(parsed, args.time_scale)
    links = trace.link_sessions(parsed, args.session_key)
    # The session radix cache behind a router is not modelled: which instance a client's close reaches,
    # and a session whose turns land on several instances, are the router's business.
    allowed = [p for p in fleet.POLICIES if not p.endswith(fleet.SESSION_SUFFIX)]
    if args.policies is not None:
        profiles = [p.strip() for p in args.policies.split(",") if p.strip()]
        for p in profiles:
            if p not in allowed:
                raise env.ConfigError("--policies", p, "one of " + ", ".join(allowed) + " with --instances (the "
                                      "session radix cache behind a router is not modelled)")
    else:
        profiles = [p for p in (fleet.POLICIES if args.hicache else geo.default_policies()) if p in allowed]
    requests = parsed
    trace.TokenBuilder(geo.page).build(requests, {r.index: r for r in requests})
    if args.quick:
        requests = inputs.first_sessions(requests, inputs.QUICK_REQUESTS)
    ideal = engine.ideal_prefixes(requests, geo.page)
    keys = page_keys(requests, geo.page)
    coef = inputs.coefficients(geo.profile)
    left_out = single.left_out(geo.kv_park, geo.dsv4)[:-1] + LEFT_OUT + router.left_out(cfg)
    print(f"simulate {args.trace} behind smg {router.SMG_VERSION}: {len(requests)} requests "
          f"({sum(r.parent is None for r in requests)} sessions){', --quick sample' if args.quick else ''}, time scale {args.time_scale:g}, seed {args.seed}")
    print(links.describe())
    print(f"geometry (each instance): {geo.describe()}")
    for warning in geo.profile_warnings:
        print(f"profile: {warning}")
    print(f"router settings: {_settings(cfg)}")
    print(f"cost model: {inputs.describe_coefficients(coef)}; the modelled clock (TTFT, overload, sizing) scales with these "
          "coefficients: fit your own GPU's with fit-cost-model and put them in the profile")
    print("left out (the replay's simplifications):")
    for item in left_out:
        print(f"  - {item}")

    def one(profile: str, name: str, n: int) -> dict[str, Any]:
        run = run_fleet(profile, geo, requests, n, router.Router(name, n, cfg, args.seed, page=geo.page),
                        coef=coef, time_scale=args.time_scale, keys=keys)
        row = report.summarize(run, ideal)
        del run
        gc.collect()  # the run's caches (a real pool each) go before the next run's
        return row

    evaluate = Runs(one)

    out: dict[str, Any] = {"trace": str(args.trace), "requests": len(requests), "seed": args.seed,
                           "smg_version": router.SMG_VERSION, "router_settings": _settings(cfg),
                           "sessions": links.as_dict(), "geometry": geo.as_dict(),
                           "cost_model": dict(coef.items(), source=coef.source), "left_out": left_out,
                           "percentile_method": single.PERCENTILE_METHOD}
    if instances is not None:
        rows = {(p, name): evaluate(p, name, instances) for p in profiles for name in routers}
        print(f"\n{instances} instances; prompt tokens {next(iter(rows.values()))['prompt_tokens']:,}, "
              f"recomputed by the ideal (one infinite cache) "
              f"{sum(r.prompt_len - ideal[r.index] for r in requests):,}")
        print(report.table(rows))
        print(f"p90 / p99: {single.PERCENTILE_METHOD}")
        for line in report.overload_lines(rows):
            print(line)
        out["instances"] = instances
        out["rows"] = {f"{p} | {name}": row for (p, name), row in rows.items()}
    if sizing:
        out["sizing"] = size(args, profiles, routers, evaluate, coef)
    return out


class Runs:
    """Each (profile, router, N) run once: the table, the sizing search and the comparison share them."""

    def __init__(self, run: Any):
        self.run, self.rows = run, {}

    def __call__(self, profile: str, router: str, n: int) -> dict[str, Any]:
        if (profile, router, n) not in self.rows:
            self.rows[profile, router, n] = self.run(profile, router, n)
        return self.rows[profile, router, n]

    def counts(self, profile: str, routers: tuple[str, ...]) -> list[int]:
        return sorted({n for (p, r, n) in self.rows if p == profile and r in routers})


def size(args: argparse.Namespace, profiles: list[str], routers: list[str], evaluate: Runs, coef: Any) -> dict[str, Any]:
    from overlay_tools.simulate.gateway import report

    p90, p99 = args.target_ttft_p90, args.target_ttft_p99
    target = " and ".join(f"TTFT {name} <= {ms:g} ms" for name, ms in (("p90", p90), ("p99", p99)) if ms is not None)
    print(f"\nsizing: the smallest N with {target} (modelled, {coef.source} coefficients; the answer scales with "
          f"them), no instance overloaded, up to {args.max_instances} instances")
    result: dict[str, Any] = {"target_ttft_p90_ms": p90, "target_ttft_p99_ms": p99, "coefficients": coef.source,
                              "max_instances": args.max_instances, "smallest": {}, "cache_aware_vs_round_robin": {}}
    for profile in profiles:
        for name in routers:
            n = report.smallest_meeting(lambda k, p=profile, r=name: evaluate(p, r, k), p90, p99, args.max_instances)
            result["smallest"][f"{profile} | {name}"] = n
            row = evaluate(profile, name, n) if n else None
            print(f"  {profile:<18} {name:<19} " + (f"N = {n} (TTFT p90 {row['ttft_s_p90']} s, p99 {row['ttft_s_p99']} s)"
                                                 if n else f"not met by N = {args.max_instances}"))
        if "cache_aware" in routers and "round_robin" in routers:
            ns = evaluate.counts(profile, ("cache_aware", "round_robin"))
            ca = {n: evaluate(profile, "cache_aware", n) for n in ns}
            rr = {n: evaluate(profile, "round_robin", n) for n in ns}
            edge = report.cache_aware_edge(ca, rr)
            result["cache_aware_vs_round_robin"][profile] = edge
            if edge["beyond"] is None:
                said = f"cache_aware still beats round_robin at N = {max(ns)}"
            elif not any(edge["beats"].values()):
                said = "cache_aware beats round_robin (TTFT p90 lower by more than 1 %) at no N run"
            else:
                said = f"cache_aware no longer beats round_robin (TTFT p90 lower by more than 1 %) from N = {edge['beyond']}"
            print(f"  {profile}: {said}; p90 by N: " + ", ".join(
                f"{n}: {edge['cache_aware'][str(n)]} vs {edge['round_robin'][str(n)]} s" for n in ns))
    return result


def _settings(cfg: Any) -> str:
    from dataclasses import asdict

    return ", ".join(f"{k}={v}" for k, v in asdict(cfg).items())
