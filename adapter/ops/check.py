"""``python -m adapter check``: what a profile will make each switch do, before a boot.

It validates the ``DSV41_*`` keys, verifies every pin against the installed engine, installs the
requested switches in this process (their install-time decisions are real: pins, this machine's
device, the engine's modules), and then asks each requested switch's predictor (its registry
record's ``predict``) what the decisions taken later in a boot will be, from the model's
``config.json`` and the profile's launch line (``LAUNCH_ARGS``). Cone replay's predictor calls the
switch's own cache-build decision on predicted facts; decode yield's reads the engine mode it
refuses on its first pass. A switch whose record has no predictor is decided at install.

Each switch gets a ``receipt``: the line a boot would log for it (``installed`` or
``refused: <reason>``; ``not decided`` when check cannot tell). Warnings name a profile that works
but not as meant: an option key without its switch key, and whatever a predictor warns about
(decode yield on default coefficients, native SWA decode beside a launch line that lets a decode
call carry more than 64 rows).

``--json`` prints one JSON object instead (a deploy pipeline reads ``"ok"``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adapter.core import api, env, pins, registry
from adapter.ops import table

DSV4_ARCHS = ("DeepseekV4ForCausalLM",)
LAUNCH_KEY = "LAUNCH_ARGS"


def profile_environ(env_file: str | None) -> dict[str, str]:
    """The environment to check: this process's, or its non-DSV41 keys plus the file's keys."""
    if env_file is None:
        return dict(os.environ)
    base = {k: v for k, v in os.environ.items() if not k.startswith(env.PREFIX)}
    base.update(env.read_env_file(env_file))
    return base


# ---------------------------------------------------------------- the launch line and the model
@dataclass
class Launch:
    """The launch arguments check reads (SGLang's own parser; its defaults where unset)."""

    argv: list[str] = field(default_factory=list)
    model_path: str | None = None
    page_size: int | None = None
    max_running_requests: int | None = None
    speculative_algorithm: str | None = None
    kv_cache_dtype: str = "auto"
    namespace: Any = None  # the argparse namespace (unsupported_mode reads it)
    hicache: dict[str, Any] | None = None  # the HiCache flags (None: --enable-hierarchical-cache not set)


def hicache_flags(ns: Any) -> dict[str, Any] | None:
    """The HiCache launch flags SGLang parsed (its defaults where unset); None when it is off."""
    if not getattr(ns, "enable_hierarchical_cache", False):
        return None
    return {"ratio": getattr(ns, "hicache_ratio", None), "size_gb": getattr(ns, "hicache_size", None),
            "write_policy": getattr(ns, "hicache_write_policy", None),
            "storage_backend": getattr(ns, "hicache_storage_backend", None)}


def parse_launch(words: Sequence[str]) -> Launch:
    """``words`` through SGLang's ``ServerArgs.add_cli_args`` parser (no model is loaded)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:  # a launch line without --model-path (check --model PATH) still parses
        action.required = False
    try:
        ns, _unknown = parser.parse_known_args(list(words))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise env.ConfigError(LAUNCH_KEY, " ".join(words), f"launch_server arguments SGLang parses ({exc})") from None
    return Launch(list(words), getattr(ns, "model_path", None), getattr(ns, "page_size", None),
                  getattr(ns, "max_running_requests", None), getattr(ns, "speculative_algorithm", None),
                  str(getattr(ns, "kv_cache_dtype", "auto") or "auto"), ns, hicache_flags(ns))


Model = api.ModelFacts


def read_model(path: str | Path) -> Model:
    """Read ``path/config.json``; a clear error when it is missing or not JSON."""
    config_file = Path(path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise env.ConfigError("--model", str(path), f"a model folder with a readable config.json ({exc})") from None
    arch = (config.get("architectures") or ["?"])[0]
    layers = config.get("num_hidden_layers")
    if arch in DSV4_ARCHS or str(config.get("model_type", "")).startswith("deepseek_v4"):
        window = config.get("sliding_window") or config.get("window_size")
        ratios = tuple(int(r) for r in config.get("compress_ratios") or ())
        sources = tuple(int(x) for x in config.get("kv_source_layer_ids") or ())
        return Model(str(path), arch, "DeepSeekV4TokenToKVPool", window, layers, layers, ratios,
                     str(config.get("model_type", "")), sources)
    types = list(config.get("layer_types") or [])
    window = config.get("sliding_window")
    if window and "sliding_attention" in types and "full_attention" in types:
        return Model(str(path), arch, "SWAKVPool", _sglang_window(arch, config), types.count("sliding_attention"), layers)
    return Model(str(path), arch, "none", None, 0, layers)


def _sglang_window(arch: str, config: Mapping[str, Any]) -> int:
    """The window SGLang's model class reports (some count the current token: Mellum's is W - 1)."""
    window = int(config["sliding_window"])
    try:
        from transformers import PretrainedConfig

        try:  # the module named after the model type (cheap); else SGLang's registry (imports every model)
            module = importlib.import_module(f"sglang.srt.models.{config.get('model_type')}")
        except ImportError:
            from sglang.srt.models.registry import ModelRegistry

            model_cls = ModelRegistry.models.get(arch)
            module = importlib.import_module(model_cls.__module__) if model_cls is not None else None
        fn = getattr(module, "get_attention_sliding_window_size", None)
        if fn is not None:
            return int(fn(PretrainedConfig(**config)))
    except Exception:  # no such model class here: the config's value
        pass
    return window


# ---------------------------------------------------------------- predictions
@dataclass
class Prediction:
    switch: str
    keys: str
    pins: str
    status: str  # this process's install outcome: off | installed | armed | refused | n/a
    receipt: str  # what a boot would log: installed | refused: <reason> | off | not decided (<why>)
    volatile: bool
    params: dict[str, Any] = field(default_factory=dict)


def _predictor(switch: registry.Switch) -> Callable[[api.Profile], api.Prediction] | None:
    if switch.predict is None:
        return None
    module, _, function = switch.predict.partition(":")
    return getattr(importlib.import_module(module), function)


def _install_receipt(outcome: Any) -> str:
    """What a boot logs for an install outcome taken in this process."""
    if outcome.status == "installed":
        return "installed"
    if outcome.status in ("refused", "n/a"):
        return f"refused: {outcome.reason}"
    if outcome.status == "armed":
        return "not decided (armed: decided when the engine builds its cache)"
    return f"not decided ({outcome.status})"


def predict(environ: Mapping[str, str], config: registry.Config, state: Any, model: Model | None,
            launch: Launch) -> tuple[list[Prediction], list[str], list[str]]:
    """One row per registry switch, and the warnings and notes of the requested switches' predictors."""
    out, warnings, notes = [], [], []
    requested = {s.name for s in config.requested}
    for switch in registry.SWITCHES:
        drift = [c for c in (pins.check(t) for t in switch.pinned) if not c.ok]
        outcome = state.outcomes.get(switch.name) if state else None
        status = "off" if outcome is None else outcome.status
        keys = " ".join(f"{k.name}={environ[k.name]}" for k in switch.keys if k.name in environ) or "-"
        receipt, params = "off", {}
        if switch.name in requested:
            if outcome is not None:
                receipt = _install_receipt(outcome)
            predictor = _predictor(switch)
            if predictor is not None:
                said = predictor(api.Profile(environ, config.values, tuple(launch.argv), launch.namespace, model, status,
                                             dict(outcome.params) if outcome is not None else {}))
                if outcome is not None and said.receipt:
                    receipt = said.receipt
                params = dict(said.params)
                warnings += said.warnings
                notes += said.notes
        out.append(Prediction(switch.name, keys, "ok" if not drift else f"drift({len(drift)})", status, receipt,
                              switch.volatile, params))
    return out, warnings, notes


def orphan_options(environ: Mapping[str, str], config: registry.Config) -> list[str]:
    """Option keys set without their switch key: the switch is off and they are ignored."""
    found: list[str] = []
    requested = {s.name for s in config.requested}
    for switch in registry.SWITCHES:
        orphans = [k.name for k in switch.options if k.name in environ]
        if orphans and switch.name not in requested:
            found.append(f"{', '.join(orphans)} set without {switch.on_key.name}: {switch.name} is off and "
                         f"{'they are' if len(orphans) > 1 else 'it is'} ignored")
    return found


# ---------------------------------------------------------------- the command
def evaluate(env_file: str | None, model_path: str | None = None) -> dict[str, Any]:
    """Everything ``check`` reports, as one JSON-ready object (installs the profile's switches in
    this process and leaves them installed, like the command)."""
    from adapter.core import boot

    environ = profile_environ(env_file)
    boot.uninstall()  # a finder from sitecustomize would act on the wrong environment
    for key in [k for k in os.environ if k.startswith(env.PREFIX)]:
        del os.environ[key]
    os.environ.update(env.dsv41_items(environ))  # switches read e.g. the fingerprint from here

    config = registry.resolve(environ)
    problems = list(config.errors)
    # split on blanks, as the container's shell splits an unquoted $LAUNCH_ARGS (a profile holds no quotes)
    launch = parse_launch(environ[LAUNCH_KEY].split()) if environ.get(LAUNCH_KEY) else Launch()
    folder = model_path or launch.model_path
    model = None
    if model_path is not None or (folder and Path(folder).is_dir()):
        model = read_model(folder)
    notes: list[str] = []
    if model is None:
        notes.append(f"no model folder ({folder or 'no --model-path in ' + LAUNCH_KEY}): switches decided at cache build "
                     "are not predicted (pass --model PATH)")
    strict: list[str] = []
    state = None
    if not config.errors:
        state = boot.install(environ)
        for module in sorted({m for s in config.requested for m in s.modules}):
            try:
                importlib.import_module(module)
            except boot.BootError as exc:  # DSV41_STRICT in the profile: the outcome is recorded
                strict.append(str(exc))
    predictions, predicted_warnings, predicted_notes = predict(environ, config, state, model, launch)
    notes += predicted_notes
    for p in predictions:
        outcome = state.outcomes.get(p.switch) if state else None
        problems += [c.describe() for c in (pins.check(t) for t in registry.by_name(p.switch).pinned) if not c.ok]
        if outcome is not None and outcome.status == "n/a":
            notes.append(f"{p.switch}: {outcome.reason} (a boot on this machine would refuse it)")
        elif outcome is not None and outcome.status not in ("installed", "armed"):
            problems.append(f"{p.switch} {outcome.status}: {outcome.reason or 'its modules did not import'}")
    return {
        "ok": not problems,
        "profile": env_file,
        "model": None if model is None else asdict(model),
        "launch": {"model_path": launch.model_path, "page_size": launch.page_size,
                   "max_running_requests": launch.max_running_requests,
                   "speculative_algorithm": launch.speculative_algorithm, "kv_cache_dtype": launch.kv_cache_dtype,
                   "hicache": launch.hicache},
        "switches": [asdict(p) for p in predictions],
        "receipts": {p.switch: p.receipt for p in predictions if p.status != "off"},
        "warnings": [*config.warnings, *orphan_options(environ, config), *predicted_warnings],
        "errors": list(config.errors),
        "notes": notes,
        "strict": strict,
        "problems": problems,
    }


def run(args: argparse.Namespace) -> int:
    report = evaluate(args.env_file, getattr(args, "model", None))
    if getattr(args, "json", False):
        print(json.dumps(report))
        return 0 if report["ok"] else 1
    for warning in report["warnings"]:
        print(f"warning: {warning}")
    for error in report["errors"]:
        print(f"error: {error}")
    for message in report["strict"]:
        print(f"strict: {message}")
    model = report["model"]
    if model is not None:
        print(f"model: {model['path']} ({model['architecture']}; pool {model['pool']}, window {model['window']}, "
              f"{model['swa_layers']} sliding-window layers)")
    hicache = report["launch"]["hicache"]
    if hicache is not None:
        size = f"{hicache['size_gb']} GB per rank" if hicache["size_gb"] else f"ratio {hicache['ratio']}"
        print(f"hicache: on ({size}, {hicache['write_policy']}, L3 {hicache['storage_backend'] or 'none'})")
    rows = [[p["switch"], p["keys"], p["pins"], p["status"], "yes" if p["volatile"] else "no"]
            for p in report["switches"]]
    print(table.render(["switch", "keys", "pins", "status", "volatile"], rows, align="left"))
    for name, receipt in report["receipts"].items():
        print(f"a boot logs: {name} {receipt}")
    for note in report["notes"]:
        print(f"note: {note}")
    for problem in report["problems"]:
        if problem not in report["errors"]:
            print(f"problem: {problem}")
    print("check: " + ("ok" if report["ok"] else "FAILED"))
    return 0 if report["ok"] else 1


# ---------------------------------------------------------------- after the boot: receipts, pins
def _positive_ranks(raw: str) -> int:
    import argparse

    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--ranks={raw!r} is invalid: expected an integer >= 1")
    return value


def receipts_report(logs: Sequence[str], env_file: str, ranks: int) -> dict[str, Any]:
    """A boot's receipt lines against the profile: the gaps (:func:`receipts.audit`) and, per
    requested switch and rank, its decision (``installed``, ``armed`` or ``refused: <reason>``)."""
    from adapter.core import receipts

    config = registry.resolve(profile_environ(env_file))
    lines: list[str] = []
    for path in logs:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines.extend(handle)
    decided: dict[str, dict[str, str]] = {s.name: {} for s in config.requested}
    for line in lines:
        receipt = receipts.parse_line(line)
        if receipt is None or receipt.switch not in decided:
            continue
        seen = decided[receipt.switch]
        if receipt.refusal:
            seen[receipt.rank] = f"refused: {receipt.reason}"
        elif receipt.event == "installed" and not seen.get(receipt.rank, "").startswith("refused"):
            seen[receipt.rank] = "installed"
        elif receipt.event == "armed" and receipt.rank not in seen:
            seen[receipt.rank] = "armed"
    gaps = receipts.audit(lines, config, ranks)
    return {"ok": not gaps, "profile": env_file, "ranks": ranks, "switches": [s.name for s in config.requested],
            "receipts": decided, "gaps": gaps}


def run_receipts(args: argparse.Namespace) -> int:
    report = receipts_report(args.logs, args.env_file, args.ranks)
    if getattr(args, "json", False):
        print(json.dumps(report))
        return 0 if report["ok"] else 1
    print(f"profile switches: {', '.join(report['switches']) or 'none'}; ranks expected: {args.ranks}")
    for gap in report["gaps"]:
        print(f"missing: {gap}")
    print("receipts: " + ("ok" if report["ok"] else "FAILED"))
    return 0 if report["ok"] else 1


def run_pins(args: argparse.Namespace) -> int:
    rows, bad = [], 0
    owned = [(s.name, t) for s in registry.SWITCHES for t in s.pinned]
    from adapter.core import plugin

    core = [("(boot rank hook)", t) for t in registry.BOOT_PINNED] + [("(plugin)", t) for t in plugin.PINNED]
    for owner, target in owned + core:
        c = pins.check(target)
        bad += not c.ok
        rows.append([owner, target, "ok" if c.ok else "DRIFT", c.found[:16]])
    print(table.render(["switch", "function", "pin", "installed sha256"], rows, align="left"))
    return 1 if bad else 0


def add_receipts_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--env-file", required=True)
    parser.add_argument("--ranks", type=_positive_ranks, required=True,
                        help="scheduler ranks the boot ran (every one must log every switch); at least 1")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env-file", help="profile file (docker --env-file format: KEY=VALUE lines); default: this environment")
    parser.add_argument("--model", help="model folder to predict from (default: --model-path of the profile's LAUNCH_ARGS)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
