"""``python -m adapter <command>``: check, receipts, pins, bench.

* ``check [--env-file FILE] [--model PATH] [--json]``: validate a profile against the pinned engine
  and predict what the model and launch line will make each switch do, before a boot.
* ``receipts LOG... --env-file FILE --ranks N [--json]``: verify a boot's logs after it.
* ``pins``: the pinned upstream functions and the hashes installed here.
* ``docs [--check]``: render ``docs/adapters.md`` from the registry.
* ``bench NAME [--quick]``: a named benchmark; last line is one JSON object.
* ``simulate TRACE``: replay a Mooncake-format trace on the real cache, policies side by side
  (``overlay_tools.simulate``, in the wheel).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Mapping, Sequence

from adapter.core import env
from adapter.ops import check


def _devkit_missing(args: argparse.Namespace) -> int:
    print(f"{args.command}: devkit is not installed here (the serving image carries only the overlay); "
          "run it from a checkout", file=sys.stderr)
    return 2


def _add_tool_command(parser: argparse.ArgumentParser, module_name: str) -> None:
    """A command that lives outside the serving path: its arguments and entry point from
    ``module_name`` (an operator tool in ``overlay_tools``, shipped in the wheel; a devkit module in a
    checkout), or a one-line refusal where it is not installed (the serving image carries no devkit).
    The modules are light: the engine kit and SGLang load only when the command runs."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        parts = module_name.split(".")
        if exc.name not in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
            raise  # the module is there and something it imports is not: say so
        parser.set_defaults(run=_devkit_missing)
        return
    module.add_arguments(parser)
    parser.set_defaults(run=module.main)


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        from devkit.bench import BENCHMARKS
    except ModuleNotFoundError as exc:
        if exc.name != "devkit":
            raise
        return _devkit_missing(args)

    if args.name not in BENCHMARKS:
        print(f"unknown benchmark {args.name!r}; known: {', '.join(sorted(BENCHMARKS))}", file=sys.stderr)
        return 2
    module_name, _, function = BENCHMARKS[args.name].partition(":")
    kwargs = {"device": args.device} if args.device is not None else {}
    if args.model is not None:
        kwargs["model"] = args.model
    if args.sweep:
        kwargs["sweep"] = True
    figures = getattr(importlib.import_module(module_name), function)(quick=args.quick, **kwargs)
    print(json.dumps({"bench": args.name, "quick": args.quick, **figures}, sort_keys=False))
    return 0


def cmd_docs(args: argparse.Namespace) -> int:
    from adapter.ops import docs

    return docs.main(check=args.check)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adapter", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="validate a profile, verify pins, install its switches, predict their receipts")
    check.add_arguments(p)
    p.set_defaults(run=check.run)
    p = sub.add_parser("receipts", help="check boot logs for every switch on every rank")
    check.add_receipts_arguments(p)
    p.set_defaults(run=check.run_receipts)
    p = sub.add_parser("pins", help="list pinned upstream functions and their installed hashes")
    p.set_defaults(run=check.run_pins)
    p = sub.add_parser("docs", help="render docs/adapters.md from the registry")
    p.add_argument("--check", action="store_true", help="fail if docs/adapters.md is stale")
    p.set_defaults(run=cmd_docs)
    p = sub.add_parser("bench", help="run a named benchmark")
    p.add_argument("name")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", help="where the benchmark's device tensors live (e.g. cuda); only benchmarks that take it")
    p.add_argument("--model", choices=("mellum", "dsv4"), help="the model kit; only benchmarks that take it")
    p.add_argument("--sweep", action="store_true", help="offered loads up to the kit's stock capacity; only "
                   "benchmarks that take it (chat-latency)")
    p.set_defaults(run=cmd_bench)
    from adapter.ops import fit_cost_model  # light: no engine import until it reads a log

    p = sub.add_parser("fit-cost-model", help="fit the decode-yield cost model from forward-pass-metrics output")
    fit_cost_model.add_arguments(p)
    p.set_defaults(run=fit_cost_model.run)
    for name, module_name, text in (
        ("gate", "devkit.gate", "release gate: stock / profile / stock boots of the real engine on CPU"),
        ("soak", "devkit.soak", "soak: seeded agent traffic on the real engine (CPU), stock vs the release gate's profile"),
        ("simulate", "overlay_tools.simulate",
         "replay a Mooncake-format trace on the real cache, policies side by side"),
    ):
        _add_tool_command(sub.add_parser(name, help=text), module_name)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except env.ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        # A profile or log path that cannot be read: one line naming it, not a traceback.
        where = getattr(exc, "filename", None) or "an input file (not UTF-8 text)"
        print(f"error: cannot read {where}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
