"""``python -m adapter <command>``: check, receipts, pins, bench.

* ``check [--env-file FILE]``: validate a profile against the pinned engine before a boot.
* ``receipts LOG... --env-file FILE --ranks N``: verify a boot's logs after it.
* ``pins``: the pinned upstream functions and the hashes installed here.
* ``docs [--check]``: render ``docs/adapters.md`` from the registry.
* ``bench NAME [--quick]``: a named benchmark; last line is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Mapping, Sequence

from adapter.core import env, pins, receipts, registry


def _profile_environ(env_file: str | None) -> dict[str, str]:
    """The environment to check: this process's, or its non-DSV41 keys plus the file's keys."""
    if env_file is None:
        return dict(os.environ)
    base = {k: v for k, v in os.environ.items() if not k.startswith(env.PREFIX)}
    base.update(env.read_env_file(env_file))
    return base


def _table(header: Sequence[str], rows: list[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_check(args: argparse.Namespace) -> int:
    from adapter.core import boot

    environ = _profile_environ(args.env_file)
    boot.uninstall()  # a finder from sitecustomize would act on the wrong environment
    for key in [k for k in os.environ if k.startswith(env.PREFIX)]:
        del os.environ[key]
    os.environ.update(env.dsv41_items(environ))  # switches read e.g. the fingerprint from here

    config = registry.resolve(environ)
    problems = list(config.errors)
    for warning in config.warnings:
        print(f"warning: {warning}")
    for error in config.errors:
        print(f"error: {error}")
    state = None
    if not config.errors:
        state = boot.install(environ)
        for module in sorted({m for s in config.requested for m in s.modules}):
            try:
                importlib.import_module(module)
            except boot.BootError as exc:  # DSV41_STRICT in the profile: the outcome is recorded
                print(f"strict: {exc}")
    rows = []
    notes: list[str] = []
    for switch in registry.SWITCHES:
        checks = [pins.check(t) for t in switch.pinned]
        drift = [c for c in checks if not c.ok]
        outcome = state.outcomes.get(switch.name) if state else None
        status = "off" if outcome is None else outcome.status
        keys = " ".join(f"{k.name}={environ[k.name]}" for k in switch.keys if k.name in environ) or "-"
        rows.append(
            [switch.name, keys, "ok" if not drift else f"drift({len(drift)})", status,
             "yes" if switch.volatile else "no"]
        )
        problems += [c.describe() for c in drift]
        if outcome is not None and outcome.status == "armed":
            notes.append(f"{switch.name}: armed; it logs installed or refused when the engine builds its cache")
        elif outcome is not None and outcome.status == "n/a":
            notes.append(f"{switch.name}: {outcome.reason} (a boot on this machine would refuse it)")
        elif outcome is not None and outcome.status != "installed":
            problems.append(f"{switch.name} {outcome.status}: {outcome.reason or 'its modules did not import'}")
    print(_table(["switch", "keys", "pins", "status", "volatile"], rows))
    for note in notes:
        print(f"note: {note}")
    for problem in problems:
        print(f"problem: {problem}")
    print("check: " + ("FAILED" if problems else "ok"))
    return 1 if problems else 0


def cmd_receipts(args: argparse.Namespace) -> int:
    config = registry.resolve(_profile_environ(args.env_file))
    lines: list[str] = []
    for path in args.logs:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines.extend(handle)
    gaps = receipts.audit(lines, config, args.ranks)
    print(f"profile switches: {', '.join(s.name for s in config.requested) or 'none'}; ranks expected: {args.ranks}")
    for gap in gaps:
        print(f"missing: {gap}")
    print("receipts: " + ("FAILED" if gaps else "ok"))
    return 1 if gaps else 0


def cmd_pins(args: argparse.Namespace) -> int:
    rows, bad = [], 0
    for switch in registry.SWITCHES:
        for target in switch.pinned:
            c = pins.check(target)
            bad += not c.ok
            rows.append([switch.name, target, "ok" if c.ok else "DRIFT", c.found[:16]])
    print(_table(["switch", "function", "pin", "installed sha256"], rows))
    return 1 if bad else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from devkit.bench import BENCHMARKS

    if args.name not in BENCHMARKS:
        print(f"unknown benchmark {args.name!r}; known: {', '.join(sorted(BENCHMARKS))}", file=sys.stderr)
        return 2
    module_name, _, function = BENCHMARKS[args.name].partition(":")
    kwargs = {"device": args.device} if args.device is not None else {}
    figures = getattr(importlib.import_module(module_name), function)(quick=args.quick, **kwargs)
    print(json.dumps({"bench": args.name, "quick": args.quick, **figures}, sort_keys=False))
    return 0


def cmd_docs(args: argparse.Namespace) -> int:
    from adapter.ops import docs

    return docs.main(check=args.check)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adapter", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="validate a profile, verify pins, install its switches")
    p.add_argument("--env-file", help="profile file (KEY=VALUE words); default: this environment")
    p.set_defaults(run=cmd_check)
    p = sub.add_parser("receipts", help="check boot logs for every switch on every rank")
    p.add_argument("logs", nargs="+")
    p.add_argument("--env-file", required=True)
    p.add_argument("--ranks", type=int, required=True)
    p.set_defaults(run=cmd_receipts)
    p = sub.add_parser("pins", help="list pinned upstream functions and their installed hashes")
    p.set_defaults(run=cmd_pins)
    p = sub.add_parser("docs", help="render docs/adapters.md from the registry")
    p.add_argument("--check", action="store_true", help="fail if docs/adapters.md is stale")
    p.set_defaults(run=cmd_docs)
    p = sub.add_parser("bench", help="run a named benchmark")
    p.add_argument("name")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", help="where the benchmark's device tensors live (e.g. cuda); only benchmarks that take it")
    p.set_defaults(run=cmd_bench)
    from adapter.ops import fit_cost_model  # light: no engine import until it reads a log

    p = sub.add_parser("fit-cost-model", help="fit the decode-yield cost model from forward-pass-metrics output")
    fit_cost_model.add_arguments(p)
    p.set_defaults(run=fit_cost_model.run)
    from devkit import gate  # light: the engine kit and SGLang load only when the gate runs

    p = sub.add_parser("gate", help="release gate: stock / profile / stock boots of the real engine on CPU")
    gate.add_arguments(p)
    p.set_defaults(run=gate.main)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except env.ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
