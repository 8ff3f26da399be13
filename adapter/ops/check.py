"""``python -m adapter check``: what a profile will make each switch do, before a boot.

It validates the ``DSV41_*`` keys, verifies every pin against the installed engine, installs the
requested switches in this process (their install-time decisions are real: pins, this machine's
device, the engine's modules), and then predicts what the decisions taken later in a boot will be
from the model's ``config.json`` and the profile's launch line (``LAUNCH_ARGS``):

* ``cone_replay`` decides when the cache is built: the pool kind follows from the architecture
  (DeepSeek-V4 -> ``DeepSeekV4TokenToKVPool``; sliding-window + full layers -> ``SWAKVPool``; no
  sliding window -> no SWA cache, nothing to decide), the window from the model, the page size from
  the launch line; the switch's own geometry functions give the bound and its own DSV4 rule the
  refusal reason;
* ``decode_yield`` checks the engine's mode on its first pass: its own ``unsupported_mode`` on the
  parsed launch line.

Each switch gets a ``receipt``: the line a boot would log for it (``installed`` or
``refused: <reason>``; ``not decided`` when check cannot tell). Warnings name a profile that works
but not as meant: an option key without its gate key, decode yield on default coefficients, native
SWA decode beside a launch line that lets a decode call carry more than 64 rows.

``--json`` prints one JSON object instead (a deploy pipeline gates on ``"ok"``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adapter.core import env, pins, registry

DSV4_ARCHS = ("DeepseekV4ForCausalLM",)
DSV4_PAGE = 256  # SGLang's DeepSeek-V4 overrides force it (arg_groups/model_overrides/deepseek_v4.py)
DSV4_MAX_RUNNING = 256  # SGLang's DeepSeek-V4 default max_running_requests (arg_groups/deepseek_v4_hook.py)
NATIVE_DECODE_MAX_ROWS = 64  # decode-form calls of more rows take the stock copy path (registry record)
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
                  str(getattr(ns, "kv_cache_dtype", "auto") or "auto"), ns)


@dataclass
class Model:
    """What the model's ``config.json`` says about the pools its cache will be built on."""

    path: str
    architecture: str
    pool: str  # DeepSeekV4TokenToKVPool | SWAKVPool | none (no sliding-window layers)
    window: int | None = None  # the cache's sliding window (tokens), as SGLang derives it
    swa_layers: int | None = None
    layers: int | None = None
    compress_ratios: tuple[int, ...] = ()
    model_type: str = ""
    kv_sources: tuple[int, ...] = ()  # DeepSeek-V4.1's kv_source_layer_ids


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


def dsv4_kv_layout(environ: Mapping[str, str], launch: Launch) -> tuple[str, bool]:
    """(main-cache layout, uniform fp8) a DeepSeek-V4 pool gets on this machine, as SGLang's
    ``select_dsv4_kv_layout`` picks it: ``SGLANG_DSV4_KV_LAYOUT`` (auto: V4.1 only on SM100/SM103),
    the trtllm backend's uniform fp8 pool (``--dsv4-attn-backend trtllm``)."""
    backend = getattr(launch.namespace, "dsv4_attn_backend", None) if launch.namespace is not None else None
    if backend == "trtllm":
        return "v4", True
    mode = environ.get("SGLANG_DSV4_KV_LAYOUT", "auto").lower()
    if backend == "flashmla_mega" and mode != "v41_new":
        mode = "v41"
    if mode in ("v4", "v41", "v41_new"):
        return mode, False
    try:
        import torch

        sm100 = torch.cuda.is_available() and torch.version.cuda is not None and torch.cuda.get_device_capability()[0] == 10
    except Exception:  # no torch CUDA here: the CPU / non-SM100 answer
        sm100 = False
    return ("v41" if sm100 else "v4"), False


def decoder_replay(model: Model, launch: Launch) -> tuple[bool, str]:
    """Whether SGLang's decoder SWA bounded replay will run, as ``validate_deepseek_v41_features``
    resolves it: the flag when set, else on for DeepSeek-V4.1 on CUDA / HIP unless every hidden
    state is returned (the CP, DP-attention and prefill-graph exclusions are not predicted here)."""
    flags = set(launch.argv)
    if "--enable-decoder-swa-bounded-replay" in flags:
        return True, "on (--enable-decoder-swa-bounded-replay)"
    if "--no-enable-decoder-swa-bounded-replay" in flags:
        return False, "off (--no-enable-decoder-swa-bounded-replay)"
    if model.model_type != "deepseek_v41":
        return False, f"off (model_type {model.model_type or '?'}: V4.1 only)"
    if "--enable-return-hidden-states" in flags:
        return False, "off (auto: --enable-return-hidden-states)"
    try:
        import torch

        gpu = torch.cuda.is_available()
    except Exception:  # no torch here: no GPU to resolve it on
        gpu = False
    return (True, "on (auto: V4.1 on CUDA/HIP)") if gpu else (False, "off (auto: no CUDA/HIP on this machine)")


def predict_cone(model: Model | None, launch: Launch, values: Mapping[str, Any], environ: Mapping[str, str]) -> tuple[str, dict[str, Any]]:
    """The line ``cone_replay`` logs when the cache is built (the switch's own rules)."""
    from types import SimpleNamespace

    from adapter.switches.cone_replay import dsv4 as cone_dsv4
    from adapter.switches.cone_replay import geometry
    from adapter.switches.cone_replay.switch import TOKENS_KEY

    if model is None:
        return "not decided (no model config.json to predict the cache from)", {}
    if model.pool == "none":
        return "not decided (the model has no sliding-window layers: no SWA cache is built, the switch never acts)", {}
    tokens = int(values[TOKENS_KEY])
    dsv4 = model.pool == "DeepSeekV4TokenToKVPool"
    page = DSV4_PAGE if dsv4 else int(launch.page_size or 1)
    window, layers = int(model.window or 0), int(model.swa_layers or 0)
    facts: dict[str, Any] = {"pool": model.pool, "window": window, "page": page, "swa_layers": layers, "N": tokens}
    flags = set(launch.argv)
    if "--disable-radix-cache" in flags:
        return "refused: the radix cache is disabled; nothing to replay", facts
    if dsv4 and "--enable-encoder-swa-bounded-replay" in flags:  # the tree keeps no SWA component
        return ("refused: the prefix tree has no SWA component (--enable-encoder-swa-bounded-replay keeps SWA in "
                "per-request window rings and replays min(prefix, 128) tokens on every hit itself); nothing to "
                "replay"), facts
    if window <= 0 or layers <= 0:
        return f"refused: cannot read the sliding window ({window}) or its layer count from {model.pool}", facts
    unified = environ.get("SGLANG_HACK_FLASHMLA_BACKEND") == "unified_kv_triton"
    # The pool as the switch's rules read it: its class name (the family) and the attributes they test.
    pool = type(model.pool, (), {})()
    layout, uniform_fp8 = dsv4_kv_layout(environ, launch) if dsv4 else ("", False)
    pool.__dict__.update(_unified_kv=unified, compression_ratios=list(model.compress_ratios), start_layer=0,
                         layer_num=layers, request_window=None, kv_source_layers=list(model.kv_sources),
                         kv_layout=SimpleNamespace(value=layout), uniform_fp8=uniform_fp8)
    decoder = False
    if dsv4:
        facts["kv_layout"] = "uniform_fp8" if uniform_fp8 else layout
        decoder, facts["decoder_replay"] = decoder_replay(model, launch)
    standin = bool(values.get("DSV41_SWA_CONE_FORWARD_STANDIN"))
    if dsv4 and unified:
        return "refused: " + str(cone_dsv4.unsupported(pool, True)), facts
    tail_start = geometry.decoder_tail_start(pool) if decoder else None
    if decoder and tail_start is None:
        return "refused: " + cone_dsv4.NO_TAIL_LAYER, facts
    bound = geometry.bound_for(pool, window, page, layers, tail_start=tail_start)
    facts["bound"] = bound
    if tokens % page:
        return f"refused: {TOKENS_KEY}={tokens} is not a multiple of the page size {page}", facts
    if tokens < bound:
        return (f"refused: {TOKENS_KEY}={tokens} < bound={bound} (window {window}, page {page}, {layers} sliding-window "
                f"layers): set it to at least {bound}"), facts
    if dsv4:
        why = cone_dsv4.unsupported(pool, standin)
    elif launch.kv_cache_dtype != "auto":
        why = f"the Full KV cache is quantized ({launch.kv_cache_dtype}); the replay rows' K/V cannot be read back exactly"
    else:
        why = None
    return ("refused: " + why if why else "installed"), facts


def predict(environ: Mapping[str, str], config: registry.Config, state: Any, model: Model | None,
            launch: Launch) -> list[Prediction]:
    out = []
    requested = {s.name for s in config.requested}
    for switch in registry.SWITCHES:
        drift = [c for c in (pins.check(t) for t in switch.pinned) if not c.ok]
        outcome = state.outcomes.get(switch.name) if state else None
        status = "off" if outcome is None else outcome.status
        keys = " ".join(f"{k.name}={environ[k.name]}" for k in switch.keys if k.name in environ) or "-"
        receipt, params = "off", {}
        if switch.name in requested and outcome is not None:
            if outcome.status == "installed":
                receipt = "installed"
            elif outcome.status in ("refused", "n/a"):
                receipt = f"refused: {outcome.reason}"
            elif outcome.status == "armed":
                receipt = "not decided (armed: decided when the engine builds its cache)"
            else:
                receipt = f"not decided ({outcome.status})"
            if switch.name == "cone_replay" and outcome.status == "armed":
                receipt, params = predict_cone(model, launch, config.values, environ)
            if switch.name == "decode_yield" and outcome.status == "installed" and launch.namespace is not None:
                from adapter.switches.decode_yield.switch import unsupported_mode

                why = unsupported_mode(launch.namespace)
                if why:
                    receipt = f"refused: {why}"
            if switch.name == "decode_yield" and outcome.status == "installed":
                params = {k: outcome.params[k] for k in ("share", "mode", "cost") if k in outcome.params}
        out.append(Prediction(switch.name, keys, "ok" if not drift else f"drift({len(drift)})", status, receipt,
                              switch.volatile, params))
    return out


def warnings_for(environ: Mapping[str, str], config: registry.Config, model: Model | None, launch: Launch) -> list[str]:
    """A profile that works, but not as its author likely meant."""
    found: list[str] = []
    requested = {s.name for s in config.requested}
    for switch in registry.SWITCHES:
        orphans = [k.name for k in switch.options if k.name in environ]
        if orphans and switch.name not in requested:
            found.append(f"{', '.join(orphans)} set without {switch.gate.name}: {switch.name} is off and "
                         f"{'they are' if len(orphans) > 1 else 'it is'} ignored")
    coefficients = [k for k in environ if k.startswith("DSV41_DECODE_YIELD_") and k != "DSV41_DECODE_YIELD_MODE"]
    if "decode_yield" in requested and config.values.get("DSV41_DECODE_YIELD_MODE") == "model" and not coefficients:
        found.append("decode_yield runs open-loop (DSV41_DECODE_YIELD_MODE=model) on its default cost coefficients "
                     "(no DSV41_DECODE_YIELD_* coefficient key): fit them on this machine with `python -m adapter "
                     "fit-cost-model` (docs/operating.md), or unset the mode (measured: no coefficients needed)")
    if "swa_native_decode" in requested:
        dsv4 = model is not None and model.pool == "DeepSeekV4TokenToKVPool"
        rows = launch.max_running_requests
        if rows is None and dsv4:
            rows = DSV4_MAX_RUNNING
        if launch.speculative_algorithm:
            found.append(f"--speculative-algorithm {launch.speculative_algorithm}: a decode call carries the draft "
                         f"tokens of every row, beyond {NATIVE_DECODE_MAX_ROWS} rows such calls take the stock copy path")
        elif rows is not None and rows > NATIVE_DECODE_MAX_ROWS:
            origin = "--max-running-requests" if launch.max_running_requests is not None else "SGLang's DeepSeek-V4 default max_running_requests"
            found.append(f"{origin} = {rows} > {NATIVE_DECODE_MAX_ROWS}: decode calls of more than "
                         f"{NATIVE_DECODE_MAX_ROWS} rows take the stock copy path (set --max-running-requests "
                         f"{NATIVE_DECODE_MAX_ROWS} to serve every decode call in place)")
    return found


# ---------------------------------------------------------------- the command
def _table(header: Sequence[str], rows: list[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
    launch = parse_launch(shlex.split(environ.get(LAUNCH_KEY, ""))) if environ.get(LAUNCH_KEY) else Launch()
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
    predictions = predict(environ, config, state, model, launch)
    for p in predictions:
        outcome = state.outcomes.get(p.switch) if state else None
        problems += [c.describe() for c in (pins.check(t) for t in registry.by_name(p.switch).pinned) if not c.ok]
        if outcome is not None and outcome.status == "n/a":
            notes.append(f"{p.switch}: {outcome.reason} (a boot on this machine would refuse it)")
        elif outcome is not None and outcome.status not in ("installed", "armed"):
            problems.append(f"{p.switch} {outcome.status}: {outcome.reason or 'its modules did not import'}")
        if p.switch == "decode_yield" and p.params.get("mode"):  # which mode a boot runs
            notes.append(f"decode_yield: share {p.params['share']} % in {p.params['mode']} mode ("
                         + ("windows from measured iteration times, closed on the measured share; rank 0 decides "
                            "under TP" if p.params["mode"] == "measured" else
                            f"open-loop integer cost model, coefficients {p.params['cost']}") + ")")
    return {
        "ok": not problems,
        "profile": env_file,
        "model": None if model is None else asdict(model),
        "launch": {"model_path": launch.model_path, "page_size": launch.page_size,
                   "max_running_requests": launch.max_running_requests,
                   "speculative_algorithm": launch.speculative_algorithm, "kv_cache_dtype": launch.kv_cache_dtype},
        "switches": [asdict(p) for p in predictions],
        "receipts": {p.switch: p.receipt for p in predictions if p.status != "off"},
        "warnings": [*config.warnings, *warnings_for(environ, config, model, launch)],
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
    rows = [[p["switch"], p["keys"], p["pins"], p["status"], "yes" if p["volatile"] else "no"]
            for p in report["switches"]]
    print(_table(["switch", "keys", "pins", "status", "volatile"], rows))
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
    for owner, target in owned + [("(boot rank hook)", t) for t in registry.BOOT_PINNED]:
        c = pins.check(target)
        bad += not c.ok
        rows.append([owner, target, "ok" if c.ok else "DRIFT", c.found[:16]])
    print(_table(["switch", "function", "pin", "installed sha256"], rows))
    return 1 if bad else 0


def add_receipts_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--env-file", required=True)
    parser.add_argument("--ranks", type=_positive_ranks, required=True,
                        help="scheduler ranks the boot ran (every one must log every switch); at least 1")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env-file", help="profile file (KEY=VALUE words); default: this environment")
    parser.add_argument("--model", help="model folder to predict from (default: --model-path of the profile's LAUNCH_ARGS)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
