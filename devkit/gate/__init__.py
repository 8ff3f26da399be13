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
5. boot A2, stock again.

It reads SGLang's own reports: ``cached_tokens`` (``--enable-cache-report``), the scheduler log
(``Prefill batch`` / ``Decode batch`` lines, ``--decode-log-interval 1``) and client-side stream
timings. One row per switch: its effect against both controls, or "not available in this build:
<reason>" / "not applicable here: <reason>" / "not in the profile: <reason>" (never a pass). The two controls must agree (same
greedy tokens on the sequential requests, same cache figures, decode shares within
:data:`SHARE_TOLERANCE`); if they do not, the run is INVALID. Greedy outputs of B must equal the
controls' on every prompt where the controls agree.

The last line printed is one JSON object (see :func:`run`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapter.core import registry

SHARE_TOLERANCE = 0.15  # two stock boots' decode shares may differ by this much (machine noise)
SHARE_MARGIN = 0.10  # the yield must raise the share by at least this over both controls
# fp32 tiny model: a cone replay sums the same terms in another order than a re-prefill, so the
# branch's token logprobs differ by float noise (5e-7 measured); without the Full-side substitution
# the replay rows' inexact K/V moved them by 4e-3.
LOGPROB_TOLERANCE = 1e-4
YIELD_PCT = 50
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "build" / "gate"


def acting() -> list[registry.Switch]:
    """The switches whose registry record says the gate shows them acting (in registry order)."""
    return [s for s in registry.SWITCHES if s.gate_role.acts]


@dataclass
class Boot:
    label: str
    profile: dict[str, str]
    log: Path
    fpm_log: Path | None = None
    startup_s: float | None = None
    cache: dict[str, Any] = field(default_factory=dict)
    yield_: dict[str, Any] = field(default_factory=dict)
    yield_log_from: int = 0
    log_lines: list[str] = field(default_factory=list)
    leftover: list[int] = field(default_factory=list)

    def outputs(self) -> dict[str, list[int]]:
        return {**self.cache.get("outputs", {}), **self.yield_.get("outputs", {})}


# ---------------------------------------------------------------- log readers
_PREFILL = re.compile(r"Prefill batch.*#new-token: (\d+).*#running-req: (\d+).*#pending-token: (\d+)")


def decode_steps_between_chunks(lines: list[str]) -> list[int]:
    """Decode steps the scheduler logged between consecutive chunks of a prefill beside running
    streams (``--decode-log-interval 1``: one ``Decode batch`` line per step)."""
    gaps: list[int] = []
    steps: int | None = None
    for line in lines:
        match = _PREFILL.search(line)
        if match:
            running = int(match.group(2))
            if steps is not None and running > 0:
                gaps.append(steps)
            steps = 0 if running > 0 and int(match.group(3)) > 0 else None
        elif steps is not None and "Decode batch" in line:
            steps += 1
    return gaps


# ---------------------------------------------------------------- profile and calibration
def available(name: str) -> tuple[bool, str]:
    """Whether this build has the switch (registered, its module present); else why not."""
    try:
        switch = registry.by_name(name)
    except KeyError:
        return False, f"{name} is not in adapter/core/registry.py"
    module = switch.install.partition(":")[0]
    try:
        if importlib.util.find_spec(module) is None:
            return False, f"its module {module} is missing"
    except ImportError as exc:
        return False, f"its module {module} does not import: {exc}"
    return True, ""


def build_profile(extra: dict[str, str] | None = None, without: tuple[str, ...] = ()) -> dict[str, str]:
    """The profile boot's keys: every acting switch this build has, less ``without``."""
    names = [s.name for s in acting()]
    unknown = [n for n in without if n not in names]
    if unknown:
        raise ValueError(f"without={unknown!r} is invalid: expected names from {names}")
    profile: dict[str, str] = {}
    for switch in acting():
        ok, _ = available(switch.name)
        if ok and switch.name not in without:
            profile.update(dict(switch.gate_role.profile))
    if "DSV41_DECODE_YIELD" in profile and extra:
        profile.update(extra)
    return profile


def calibrate(fpm_log: Path | None, out: Path) -> dict[str, Any]:
    """Run ``fit-cost-model`` on a forward-pass-metrics log; returns status, coefficients, output."""
    ok, reason = available("decode_yield")
    if not ok:
        return {"status": f"not available in this build: {reason}", "keys": {}}
    if fpm_log is None or not fpm_log.is_file() or fpm_log.stat().st_size == 0:
        return {"status": "failed: no forward-pass metrics were recorded on the control boot", "keys": {}}
    command = [sys.executable, "-m", "adapter", "fit-cost-model", str(fpm_log), "--topk", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("DSV41_")},
                               "OMP_NUM_THREADS": "1"})
    (out / "fit-cost-model.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"status": f"failed (exit {done.returncode}): {tail[0]}", "keys": {}, "output": done.stdout + done.stderr}
    keys = dict(re.findall(r"(DSV41_DECODE_YIELD_[A-Z_]+)=(\d+)", done.stdout))
    if not keys:
        return {"status": "failed: fit-cost-model printed no profile line", "keys": {}, "output": done.stdout}
    return {"status": "fitted on this machine", "keys": keys, "output": done.stdout}


# ---------------------------------------------------------------- boots
@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM stops the gate like Ctrl-C does, so the running server is stopped on the way out."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_boot(boot: Boot, model: Path, workload: Any, out: Path, *, say: Callable[[str], None]) -> Boot:
    from devkit.engine_kit import fpm, launcher
    from devkit.engine_kit import workload as wl

    ipc = f"ipc://{tempfile.gettempdir()}/dsv41-gate-{os.getpid()}-{boot.label}"
    args = launcher.server_args(model, launcher.free_port(), swa_ratio=0.1, extra=[
        "--decode-log-interval", "1", "--enable-forward-pass-metrics", "--forward-pass-metrics-ipc-name", ipc,
    ])
    server = launcher.Server(args, boot.log, boot.profile)
    boot.fpm_log = out / f"fpm-{boot.label}.jsonl"
    recorder = fpm.Recorder(ipc, boot.fpm_log)
    try:
        recorder.start()
    except Exception as exc:  # no pyzmq or no sglang here: the boot still runs, calibration says why
        say(f"  forward-pass metrics not recorded: {type(exc).__name__}: {exc}")
        recorder = None
    try:
        server.start()
        boot.startup_s = server.startup_s
        say(f"  {boot.label}: up in {server.startup_s:.0f} s; cache phases ...")
        boot.cache = wl.run_cache_phases(server.base_url, workload)
        say(f"  {boot.label}: resume cached {boot.cache['resume_cached_frac']:.2f}, "
            f"cone recomputed {boot.cache['cone_recomputed_tokens']}; yield phase ...")
        boot.yield_log_from = len(server.log_lines())
        boot.yield_ = wl.run_yield_phase(server.base_url, workload, boot.label)
        say(f"  {boot.label}: decode share {boot.yield_['decode_share']}")
    finally:
        boot.leftover = server.stop()
        if recorder is not None:
            recorder.stop()
        boot.log_lines = server.log_lines()
    return boot


# ---------------------------------------------------------------- verdict
def compare_outputs(a1: dict[str, list[int]], a2: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, Any]:
    """Per prompt: do the controls agree? Then B must match them. Streams (``stream*``, aborted at
    different lengths on each boot) are compared on the prefix all three generated."""
    agree, differ, controls_differ = [], [], []
    for key in sorted(set(a1) | set(a2)):
        x, y, z = a1.get(key), a2.get(key), b.get(key)
        if key.startswith("stream") and None not in (x, y, z):
            n = min(len(x), len(y), len(z))
            x, y, z = x[:n], y[:n], z[:n]
        if x is None or y is None or x != y:
            controls_differ.append(key)
            continue
        (agree if z == x else differ).append(key)
    return {"compared": len(agree) + len(differ), "equal": len(agree), "differ": differ,
            "controls_differ": controls_differ, "outputs_equal": not differ and bool(agree)}


def controls_agree(a1: Boot, a2: Boot, outputs: dict[str, Any]) -> tuple[bool, list[str]]:
    why = []
    sequential = [k for k in outputs["controls_differ"] if not k.startswith("stream")]
    if sequential:
        why.append(f"stock boots generated different greedy tokens for {', '.join(sequential)}")
    for key in ("resume_cached_tokens", "cone_cached_tokens"):
        if a1.cache.get(key) != a2.cache.get(key):
            why.append(f"{key}: {a1.cache.get(key)} vs {a2.cache.get(key)}")
    s1, s2 = a1.yield_.get("decode_share"), a2.yield_.get("decode_share")
    if s1 is None or s2 is None or abs(s1 - s2) > SHARE_TOLERANCE:
        why.append(f"decode_share: {s1} vs {s2} (tolerance {SHARE_TOLERANCE})")
    return not why, why


def _median(values: list[int]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return float(ordered[len(ordered) // 2])


def rows(a1: Boot, b: Boot, a2: Boot, receipts_gaps: list[str], outputs_equal: bool,
         without: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One row per registry switch, from its record's ``gate_role``."""
    refused = {g.split(" ", 1)[0] for g in receipts_gaps}
    table: list[dict[str, Any]] = []
    for switch in registry.SWITCHES:
        name, role = switch.name, switch.gate_role
        ok, reason = available(name)
        if not role.acts:
            status = (f"not in the profile: {role.not_in_profile}" if role.not_in_profile else
                      f"not applicable here: {role.not_applicable}")
            table.append({"switch": name, "stock": "-", "profile": "-", "status": status})
            continue
        if not ok:
            table.append({"switch": name, "stock": "-", "profile": "-", "status": f"not available in this build: {reason}"})
            continue
        if name in without:
            table.append({"switch": name, "stock": "-", "profile": "-", "status": "not in this run: left out with --without"})
            continue
        if name in refused:  # it did not install on the engine: it cannot act (receipts_ok is false too)
            gap = next(g for g in receipts_gaps if g.startswith(name))
            table.append({"switch": name, "stock": "-", "profile": "-",
                          "status": f"not available in this build: refused at boot: {gap}"})
            continue
        table.append(_effect_row(name, a1, b, a2, outputs_equal))
    return table


def _effect_row(name: str, a1: Boot, b: Boot, a2: Boot, outputs_equal: bool) -> dict[str, Any]:
    if name == "swa_thin":
        s = (a1.cache["resume_cached_frac"], a2.cache["resume_cached_frac"])
        p = b.cache["resume_cached_frac"]
        passed = p >= 0.9 and p > max(s)
        return {"switch": name, "stock": f"{s[0]:.2f} / {s[1]:.2f}", "profile": f"{p:.2f}",
                "status": "pass" if passed else "FAIL: resume not better cached than both controls"}
    if name == "decode_yield":
        s = (a1.yield_["decode_share"], a2.yield_["decode_share"])
        p = b.yield_["decode_share"]
        gaps_s = [_median(decode_steps_between_chunks(x.log_lines[x.yield_log_from:])) for x in (a1, a2)]
        gap_p = _median(decode_steps_between_chunks(b.log_lines[b.yield_log_from:]))
        passed = p is not None and all(x is not None for x in s) and p >= max(s) + SHARE_MARGIN
        return {"switch": name, "stock": f"{s[0]} / {s[1]} (steps/chunk {gaps_s[0]} / {gaps_s[1]})",
                "profile": f"{p} (steps/chunk {gap_p})",
                "status": "pass" if passed else f"FAIL: share not above both controls by {SHARE_MARGIN}"}
    if name == "cone_replay":
        s = (a1.cache["cone_recomputed_tokens"], a2.cache["cone_recomputed_tokens"])
        p = b.cache["cone_recomputed_tokens"]
        # SWA thin alone can shorten the branch's recompute (a surviving checkpoint): the row needs
        # the switch's own plan lines as well.
        plans = sum(1 for line in b.log_lines if "[dsv41] cone_replay DSV41_SWA_CONE plan" in line)
        diff = cone_logprob_diff(a1, b, a2)
        close = diff is not None and diff <= LOGPROB_TOLERANCE
        passed = plans > 0 and p < min(s) and outputs_equal and close
        return {"switch": name, "stock": f"{s[0]} / {s[1]} tokens",
                "profile": f"{p} tokens ({plans} plans, logprob diff {diff if diff is None else f'{diff:.1e}'})",
                "status": "pass" if passed else "FAIL: no replay planned, not cheaper than both controls, outputs "
                f"differ, or the branch's logprobs differ by more than {LOGPROB_TOLERANCE}"}
    if name == "fast_tree_core":  # no figure of its own; identical greedy outputs are its check
        return {"switch": name, "stock": "-", "profile": "-",
                "status": "pass (outputs equal)" if outputs_equal else "FAIL: outputs differ"}
    # A switch the registry says acts here but the gate has no row for: never a pass, never n/a.
    return {"switch": name, "stock": "-", "profile": "-",
            "status": "FAIL: the registry says this switch acts in the gate, but the gate has no row for it"}


def cone_logprob_diff(a1: Boot, b: Boot, a2: Boot) -> float | None:
    """Largest |logprob difference| of the branch's greedy tokens between B and either control
    (None when a boot has none or the lengths differ): the cone's exactness beyond argmax."""
    lp = [x.cache.get("cone_branch_logprobs") or [] for x in (a1, b, a2)]
    if not lp[1] or any(len(x) != len(lp[1]) for x in lp):
        return None
    return max(abs(p - c) for control in (lp[0], lp[2]) for p, c in zip(lp[1], control))


def _mean(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 4) if values else None


def run(quick: bool = True, out: str | Path | None = None, say: Callable[[str], None] = print,
        without: tuple[str, ...] = ()) -> dict[str, Any]:
    """Build, boot A1 / B / A2, judge; returns the figures (the CLI prints them as the last line)."""
    from adapter.core import receipts
    from devkit.engine_kit import model as mk
    from devkit.engine_kit import workload as wl

    t0 = time.monotonic()
    build_profile(without=without)  # a bad --without fails before any boot
    out = Path(out) if out else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    spec = mk.ModelSpec()
    model = mk.make_model(out.parent / f"engine_kit_model_{spec.digest()}", spec)
    workload = wl.Workload.quick() if quick else wl.Workload.full()
    workload.validate()
    say(f"gate: model {model} (window {spec.window}); workload {'quick' if quick else 'full'}; logs in {out}")
    with _terminate_as_interrupt():
        a1 = run_boot(Boot("A1-stock", {}, out / "A1-stock.log"), model, workload, out, say=say)
        calibration = calibrate(a1.fpm_log, out)
        say(f"calibration: {calibration['status']}")
        for line in calibration.get("output", "").splitlines():
            say(f"  | {line}")
        profile = build_profile(calibration["keys"], without)
        say("profile: " + (" ".join(f"{k}={v}" for k, v in profile.items()) or "(empty: no switch available)"))
        b = run_boot(Boot("B-profile", profile, out / "B-profile.log"), model, workload, out, say=say)
        a2 = run_boot(Boot("A2-stock", {}, out / "A2-stock.log"), model, workload, out, say=say)

    config = registry.resolve(profile)
    gaps = receipts.audit(b.log_lines, config, ranks=1) if profile else ["profile is empty"]
    stock_receipts = [line for x in (a1, a2) for line in x.log_lines if "[dsv41]" in line]
    if stock_receipts:
        gaps.append(f"a stock boot logged overlay lines: {stock_receipts[0].strip()}")
    outputs = compare_outputs(a1.outputs(), a2.outputs(), b.outputs())
    valid, invalid_why = controls_agree(a1, a2, outputs)
    table = rows(a1, b, a2, gaps, outputs["outputs_equal"], without)
    leftover = a1.leftover + b.leftover + a2.leftover
    acted = [r for r in table if r["status"].startswith(("pass", "FAIL"))]
    passed = (valid and not gaps and outputs["outputs_equal"] and bool(acted)
              and all(r["status"].startswith("pass") for r in acted))

    print_table(table, say)
    say(f"controls agree: {'yes' if valid else 'NO -> INVALID: ' + '; '.join(invalid_why)}")
    say(f"receipts: {'ok' if not gaps else 'FAILED: ' + '; '.join(gaps)}")
    say(f"greedy outputs: {outputs['equal']}/{outputs['compared']} prompts equal to the controls"
        + (f"; differ: {', '.join(outputs['differ'])}" if outputs["differ"] else "")
        + (f"; controls differ (not compared): {', '.join(outputs['controls_differ'])}" if outputs["controls_differ"] else ""))
    verdict = "PASS" if passed else ("INVALID" if not valid else "FAIL")
    say(f"gate: {verdict} in {time.monotonic() - t0:.0f} s")
    return {
        "verdict": verdict,
        "valid": valid,
        "receipts_ok": not gaps,
        "outputs_equal": outputs["outputs_equal"],
        "decode_share_stock": _mean([a1.yield_.get("decode_share"), a2.yield_.get("decode_share")]),
        "decode_share_profile": b.yield_.get("decode_share"),
        "resume_cached_frac_stock": _mean([a1.cache.get("resume_cached_frac"), a2.cache.get("resume_cached_frac")]),
        "resume_cached_frac_profile": b.cache.get("resume_cached_frac"),
        "cone_recomputed_tokens": b.cache.get("cone_recomputed_tokens"),
        "cone_logprob_max_diff": cone_logprob_diff(a1, b, a2),
        "cone_stock_recomputed_tokens": _mean([a1.cache.get("cone_recomputed_tokens"),
                                               a2.cache.get("cone_recomputed_tokens")]),
        "controls": {x.label: {"decode_share": x.yield_.get("decode_share"),
                               "resume_cached_frac": x.cache.get("resume_cached_frac"),
                               "cone_recomputed_tokens": x.cache.get("cone_recomputed_tokens")} for x in (a1, a2)},
        "calibration": {"status": calibration["status"], **calibration["keys"]},
        "profile": profile,
        "rows": {r["switch"]: r["status"] for r in table},
        "startup_s": [round(x.startup_s or 0, 1) for x in (a1, b, a2)],
        "leftover_processes": len(leftover),
        "quick": quick,
        "without": list(without),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def print_table(table: list[dict[str, Any]], say: Callable[[str], None]) -> None:
    header = ["switch", "stock (A1 / A2)", "profile (B)", "status"]
    cells = [header] + [[r["switch"], r["stock"], r["profile"], r["status"]] for r in table]
    widths = [max(len(row[i]) for row in cells) for i in range(3)]
    for i, row in enumerate(cells):
        say("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3])
        if i == 0:
            say("  ".join("-" * w for w in widths) + "  " + "-" * 6)


def add_arguments(parser: Any) -> None:
    parser.add_argument("--quick", action="store_true", help="the short workload (under 10 minutes on 2 cores)")
    parser.add_argument("--out", help=f"folder for logs and the model (default {DEFAULT_OUT})")
    parser.add_argument("--without", action="append", default=[], metavar="SWITCH",
                        help="leave this acting switch out of the profile boot (repeatable); its row says so")


def main(args: Any) -> int:
    try:
        figures = run(quick=args.quick, out=args.out, without=tuple(args.without))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(figures, sort_keys=False))
    return 0 if figures["verdict"] == "PASS" else 1
