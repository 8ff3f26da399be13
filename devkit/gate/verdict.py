"""The gate's judgement: pure functions of the boots' recorded figures (no server, no clock).

Log reading (decode steps between chunks), output comparison, control agreement, and one row per
registry switch from its record's ``gate_role``: its effect against both controls, or why it cannot
act here. An acting switch the gate has no row for is a FAIL, never "not applicable".

A row of an acting switch is "pass", "FAIL: <why>" or "cannot act on this leg's workload: <why>"
(:data:`CANNOT_ACT`): the controls already did what the switch is there to do, or the workload gave it
nothing to do, so the row shows neither that it works nor that it is broken. :func:`overall` makes such
a run INVALID (never PASS): the leg, not the switch, has to change.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from typing import Any

from adapter.core import registry
from adapter.ops.table import render
from devkit.gate.record import Boot

SHARE_TOLERANCE = 0.15  # two stock boots' decode shares may differ by this much (machine noise)


SHARE_MARGIN = 0.10  # the yield must raise the share by at least this over both controls
# fp32 tiny model: a cone replay sums the same terms in another order than a re-prefill, so the
# branch's token logprobs differ by float noise (5e-7 measured); without the Full-side substitution
# the replay rows' inexact K/V moved them by 4e-3.


LOGPROB_TOLERANCE = 1e-4
# The idle session's resume: its whole context cached (RESUME_KEPT) is its resume point kept; below
# RESUME_LOST a control lost it. SWA thin passes only where it kept what both controls lost. Whole,
# not nearly: a cone replay resumes the same session N tokens before its resume point (0.94 on the
# Mellum kit with thin dropped from the profile boot), which is the cone's work, not thin's.
RESUME_KEPT = 1.0
RESUME_LOST = 0.5
CANNOT_ACT = "cannot act on this leg's workload: "


def acting() -> list[registry.Switch]:
    """The switches whose registry record says the gate shows them acting (in registry order)."""
    return [s for s in registry.SWITCHES if s.gate_role.acts]


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


def kit_profile(kit_name: str) -> dict[str, str]:
    """The release gate's profile boot keys on the kit ``kit_name`` (without its calibration, which
    only shapes the first windows of measured mode)."""
    from devkit.engine_kit import model_kits

    profile = build_profile()
    profile.update({k: v for k, v in model_kits.kit(kit_name).profile_overrides().items() if k in profile})
    return profile


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
    if b.host:  # the HiCache leg's host phase: the cone's row over it, or the cone's status where it was not judged
        cone = next(r for r in table if r["switch"] == "cone_replay")
        judged = not cone["status"].startswith("not ")  # not available / in this run / in the profile / applicable
        table.append(_cone_host_row("cone_replay", a1, b, a2, outputs_equal) if judged
                     else {**cone, "switch": HOST_ROW})
    return table


def _thin_row(name: str, a1: Boot, b: Boot, a2: Boot, outputs_equal: bool) -> dict[str, Any]:
    """Passes only when the profile kept the idle session's resume point and both controls lost it
    (beside HiCache too: the HiCache leg's churn outruns the host tier, so stock + HiCache loses it)."""
    s = (a1.cache["resume_cached_frac"], a2.cache["resume_cached_frac"])
    p = b.cache["resume_cached_frac"]
    row = {"switch": name, "stock": f"{s[0]:.2f} / {s[1]:.2f}", "profile": f"{p:.2f}"}
    if max(s) >= RESUME_LOST:
        return {**row, "status": CANNOT_ACT + f"the controls resumed the idle session {max(s):.2f} cached (at least "
                f"{RESUME_LOST}): nothing lost for SWA thin to keep"}
    if p >= RESUME_KEPT:
        return {**row, "status": "pass"}
    return {**row, "status": f"FAIL: the profile resumed {p:.2f} cached (not its whole context) where both controls lost "
            "the session"}


def _yield_row(name: str, a1: Boot, b: Boot, a2: Boot, outputs_equal: bool) -> dict[str, Any]:
    s = (a1.yield_["decode_share"], a2.yield_["decode_share"])
    p = b.yield_["decode_share"]
    gaps_s = [_median(decode_steps_between_chunks(x.log_lines[x.yield_log_from:])) for x in (a1, a2)]
    gap_p = _median(decode_steps_between_chunks(b.log_lines[b.yield_log_from:]))
    passed = p is not None and all(x is not None for x in s) and p >= max(s) + SHARE_MARGIN
    row = {"switch": name, "stock": f"{s[0]} / {s[1]} (steps/chunk {gaps_s[0]} / {gaps_s[1]})",
           "profile": f"{p} (steps/chunk {gap_p})"}
    if gaps_s == [None, None]:
        return {**row, "status": CANNOT_ACT + "the controls logged no chunk of a prefill beside running streams"}
    return {**row, "status": "pass" if passed else f"FAIL: share not above both controls by {SHARE_MARGIN}"}


_CONE_PLAN = "[dsv41] cone_replay DSV41_SWA_CONE plan"
_CONE_FALLBACK = re.compile(r"\[dsv41\] cone_replay DSV41_SWA_CONE fallback .*reason=(\w+)")


def _cone_row(name: str, a1: Boot, b: Boot, a2: Boot, outputs_equal: bool) -> dict[str, Any]:
    """Passes only when the cone planned a replay, recomputed fewer of the branch's tokens than both
    controls, and the branch's outputs and logprobs match theirs. Where the controls recomputed no
    more than the replay's depth N, a replay cannot be cheaper: the row cannot act."""
    s = (a1.cache["cone_recomputed_tokens"], a2.cache["cone_recomputed_tokens"])
    p = b.cache["cone_recomputed_tokens"]
    n = int(b.profile.get("DSV41_SWA_CONE_TOKENS") or 0)
    # SWA thin alone can shorten the branch's recompute (a surviving checkpoint): the row needs
    # the switch's own plan lines as well.
    # (the host phase's resume plans too: its own row judges it)
    host = f"rid={b.host['rid']} " if b.host else None
    plans = sum(1 for line in b.log_lines if _CONE_PLAN in line and not (host and host in line))
    fallbacks = [m.group(1) for line in b.log_lines if (m := _CONE_FALLBACK.search(line))]
    diff = cone_logprob_diff(a1, b, a2)
    row = {"switch": name, "stock": f"{s[0]} / {s[1]} tokens",
           "profile": f"{p} tokens ({plans} plans, logprob diff {diff if diff is None else f'{diff:.1e}'})"}
    if min(s) <= n:
        return {**row, "status": CANNOT_ACT + f"the controls recomputed {min(s)} of the branch's tokens, no more than "
                f"the replay's N = {n}"}
    why = []
    if not plans:
        why.append("no replay planned" + (f" (fallback: {', '.join(sorted(set(fallbacks)))})" if fallbacks else ""))
    if p >= min(s):
        why.append(f"{p} tokens recomputed, not fewer than the controls' {min(s)}")
    if not outputs_equal:
        why.append("outputs differ")
    if diff is None or diff > LOGPROB_TOLERANCE:
        why.append(f"the branch's logprobs differ by {diff} (tolerance {LOGPROB_TOLERANCE})")
    return {**row, "status": "FAIL: " + "; ".join(why) if why else "pass"}


HOST_ROW = "cone_replay (Full KV from host)"  # the HiCache leg's host phase (workload phase 3)
_CONE_EVENT = re.compile(r"\[dsv41\] cone_replay DSV41_SWA_CONE (plan|load|fallback) (.*)")


def cone_events(lines: list[str], rid: str) -> dict[str, list[dict[str, str]]]:
    """The cone's ``plan`` / ``load`` / ``fallback`` lines of request ``rid``, each as its fields."""
    events: dict[str, list[dict[str, str]]] = {"plan": [], "load": [], "fallback": []}
    for line in lines:
        match = _CONE_EVENT.search(line)
        if match:
            fields = dict(re.findall(r"(\w+)=(\S+)", match.group(2)))
            if fields.get("rid") == rid:
                events[match.group(1)].append(fields)
    return events


def host_load_gaps(lines: list[str], rid: str, n: int, cached_tokens: int) -> list[str]:
    """Why the log does not show request ``rid`` resuming with its Full KV loaded back from host by
    the cone and a replay of ``n`` tokens (empty: it does). It needs a ``plan`` line with a host
    load (``load=``) and ``N=n``, a ``load`` line of that F and s with ``tokens`` > 0 (HiCache
    brought the Full KV back), no fallback, and the server's ``cached_tokens`` at the plan's s (the
    replay started there: the engine recomputed N of the context, not more)."""
    events = cone_events(lines, rid)
    gaps = []
    if events["fallback"]:
        gaps.append("the cone fell back (" + ", ".join(sorted({f.get("reason", "?") for f in events["fallback"]})) + ")")
    if not events["plan"]:
        return [*gaps, "no replay planned for the resume"]
    plan = events["plan"][-1]
    F, s, depth = (int(plan.get(k, -1)) for k in ("F", "s", "N"))
    if depth != n or F - s != n:
        gaps.append(f"the plan replays N={depth} (F={F} s={s}), not the profile's N={n}")
    if int(plan.get("load", 0)) <= 0:
        gaps.append("the plan had no host load: the resume's Full KV was on device")
    loads = [x for x in events["load"] if (int(x.get("F", -1)), int(x.get("s", -1))) == (F, s)]
    if not loads:
        gaps.append(f"no load line for F={F} s={s}: the Full KV did not come back from host through the cone")
    elif int(loads[-1].get("tokens", 0)) <= 0:
        gaps.append("the load line brought 0 tokens back from host")
    if cached_tokens != s:
        gaps.append(f"the server reported {cached_tokens} tokens cached, not the plan's s={s}")
    return gaps


def _cone_host_row(name: str, a1: Boot, b: Boot, a2: Boot, outputs_equal: bool) -> dict[str, Any]:
    """The host phase: passes only when the profile's resume loaded the session's Full KV back from
    host through the cone and replayed N (:func:`host_load_gaps`), recomputing less than both
    stock + HiCache controls. Where a control recomputed no more than N, HiCache alone brought the
    session back: the row cannot act."""
    s = (a1.host["recomputed_tokens"], a2.host["recomputed_tokens"])
    p = b.host["recomputed_tokens"]
    n = int(b.profile.get("DSV41_SWA_CONE_TOKENS") or 0)
    loads = cone_events(b.log_lines, b.host["rid"])["load"]
    row = {"switch": HOST_ROW, "stock": f"{s[0]} / {s[1]} tokens",
           "profile": f"{p} tokens" + (f" (load tokens={loads[-1].get('tokens')} D={loads[-1].get('D')} "
                                      f"F={loads[-1].get('F')} s={loads[-1].get('s')})" if loads else " (no load line)")}
    if min(s) <= n:
        return {**row, "status": CANNOT_ACT + f"the controls recomputed {min(s)} of the session's tokens, no more than "
                f"the replay's N = {n}: HiCache brought it back from host"}
    why = host_load_gaps(b.log_lines, b.host["rid"], n, b.host["cached_tokens"])
    if p >= min(s):
        why.append(f"{p} tokens recomputed, not fewer than the controls' {min(s)}")
    return {**row, "status": "FAIL: " + "; ".join(why) if why else "pass"}


def _outputs_row(name: str, a1: Boot, b: Boot, a2: Boot, outputs_equal: bool) -> dict[str, Any]:
    """A switch with no figure of its own: identical greedy outputs are its check, on a profile boot
    that installed it (a switch another key turns on is off when ``--drop-key`` drops that key)."""
    receipt = f"[dsv41] {name} installed"
    if not any(receipt in line for line in b.log_lines):
        return {"switch": name, "stock": "-", "profile": "-",
                "status": f"FAIL: not installed on the profile boot (no '{receipt}' line)"}
    return {"switch": name, "stock": "-", "profile": "-",
            "status": "pass (outputs equal)" if outputs_equal else "FAIL: outputs differ"}


Row = Callable[[str, Boot, Boot, Boot, bool], dict[str, Any]]
# The gate's row of each switch whose registry record says it acts here (``gate_role.acts``): one
# entry per such switch (tests/unit/test_one_place_per_switch.py fails on a missing or extra one).
ROWS: dict[str, Row] = {
    "decode_yield": _yield_row,
    "fast_tree_core": _outputs_row,
    "swa_thin": _thin_row,
    "cone_replay": _cone_row,
}


def _effect_row(name: str, a1: Boot, b: Boot, a2: Boot, outputs_equal: bool) -> dict[str, Any]:
    row = ROWS.get(name)
    if row is None:  # the registry says it acts here but the gate has no row for it: never a pass, never n/a
        return {"switch": name, "stock": "-", "profile": "-",
                "status": "FAIL: the registry says this switch acts in the gate, but the gate has no row for it"}
    return row(name, a1, b, a2, outputs_equal)


def overall(valid: bool, receipts_ok: bool, outputs_equal: bool, table: list[dict[str, Any]]) -> tuple[str, str]:
    """The run's verdict and why: INVALID when the controls disagree; FAIL on a failed row, receipt gap
    or differing outputs, or when no switch acted; INVALID when an acting switch's row could not act
    on the leg's workload (the leg did not show it, so the run proves nothing about it); else PASS."""
    if not valid:
        return "INVALID", "the stock controls disagree"
    failed = [r["switch"] for r in table if r["status"].startswith("FAIL")]
    if failed or not receipts_ok or not outputs_equal:
        return "FAIL", "; ".join([f"rows failed: {', '.join(failed)}"] * bool(failed) + ["receipts"] * (not receipts_ok)
                                 + ["greedy outputs differ from the controls"] * (not outputs_equal))
    idle = [r["switch"] for r in table if r["status"].startswith(CANNOT_ACT)]
    if idle:
        return "INVALID", f"cannot act on this leg's workload: {', '.join(idle)}"
    if not any(r["status"].startswith("pass") for r in table):
        return "FAIL", "no switch acted"
    return "PASS", ""


def drop_keys(profile: dict[str, str], keys: tuple[str, ...]) -> dict[str, str]:
    """The profile boot's keys less ``keys`` (``--drop-key``: the boot runs without them while every
    row is still judged, so a row can be seen failing when its switch is off)."""
    unknown = [k for k in keys if k not in profile]
    if unknown:
        raise ValueError(f"--drop-key {unknown[0]!r} is invalid: expected a key of the gate's profile "
                         f"({', '.join(profile)})")
    return {k: v for k, v in profile.items() if k not in keys}


def cone_logprob_diff(a1: Boot, b: Boot, a2: Boot) -> float | None:
    """Largest |logprob difference| of the branch's greedy tokens between B and either control
    (None when a boot has none or the lengths differ): the cone's exactness beyond argmax."""
    lp = [x.cache.get("cone_branch_logprobs") or [] for x in (a1, b, a2)]
    if not lp[1] or any(len(x) != len(lp[1]) for x in lp):
        return None
    return max(abs(p - c) for control in (lp[0], lp[2]) for p, c in zip(lp[1], control))


def mean_present(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 4) if values else None


def print_table(table: list[dict[str, Any]], say: Callable[[str], None]) -> None:
    rows = [[r["switch"], r["stock"], r["profile"], r["status"]] for r in table]
    for line in render(["switch", "stock (A1 / A2)", "profile (B)", "status"], rows, align="left").splitlines():
        say(line)
