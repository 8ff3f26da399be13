"""Fold the parts ``tools/gpu/check.sh`` wrote into one ``check.json`` (stdlib only).

``python tools/gpu/summarize.py DIR --device cuda|cpu [--dry-run] --elapsed S``; reads, in DIR:
``steps.tsv`` (name, rc, seconds, status per step), ``env.json``, ``imports.json``, ``bench.out``
(the bench's stdout, whose last line is its JSON), ``tests.xml`` (pytest's JUnit XML) and
``probe.json``; any of them may be missing (the step did not run): the summary says so.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SCHEMA = 3  # 3: the device run's targets are the park pool's (and an unmet one is a problem)
# The targets a device run must report (devkit/bench/kv_park.py CUDA_TARGETS; stdlib only here).
CUDA_TARGETS = ("pool_save_speed_vs_pinned_memcpy", "pool_restore_speed_vs_pinned_memcpy", "pool_save_vs_stock_get_cpu_copy")
KEYS = (
    "check", "schema", "device", "dry_run", "elapsed_s", "env", "steps", "imports_without_sglang",
    "bench", "targets", "targets_met", "bytes_identical", "tests", "capture_probe", "ok", "problems",
)  # fmt: skip


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _steps(path: Path) -> dict[str, dict]:
    steps: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 4:
                name, rc, seconds, status = parts
                steps[name] = {"rc": int(rc), "seconds": float(seconds), "status": status}
    return steps


def _bench(path: Path) -> dict:
    if not path.exists():
        return {"status": "not run", "figures": None}
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("{")]
    if not lines:
        return {"status": "no JSON line", "figures": None}
    try:
        return {"status": "ok", "figures": json.loads(lines[-1])}
    except ValueError:
        return {"status": "bad JSON line", "figures": None}


def _tests(path: Path) -> dict:
    out = {"status": "not run", "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "cases": {}}
    if not path.exists():
        return out
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        out["status"] = "bad JUnit XML"
        return out
    for case in root.iter("testcase"):
        name = case.get("name", "?")
        if case.find("failure") is not None:
            outcome = "failed"
        elif case.find("error") is not None:
            outcome = "errors"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        out[outcome] += 1
        detail = next((case.find(t) for t in ("failure", "error", "skipped") if case.find(t) is not None), None)
        out["cases"][name] = outcome if detail is None else f"{outcome}: {(detail.get('message') or '')[:200]}"
    out["status"] = "ran"
    return out


def summarize(folder: Path, device: str, dry_run: bool, elapsed: float) -> dict:
    problems: list[str] = []
    steps = _steps(folder / "steps.tsv")
    for name, step in steps.items():
        if step["status"] != "ok":
            problems.append(f"step {name}: {step['status']} (rc {step['rc']})")
    env = _json(folder / "env.json") or {}
    imports = _json(folder / "imports.json") or {"ok": False, "error": "not run"}
    if not imports.get("ok"):
        problems.append(f"kv_park does not import without sglang: {imports.get('error')}")
    bench = _bench(folder / "bench.out")
    figures = bench["figures"] or {}
    targets = figures.get("targets", {})
    identical = figures.get("bytes_identical")
    if bench["status"] != "ok":
        problems.append(f"bench: {bench['status']}")
    elif identical is not True:
        problems.append("bench: parked bytes differ from the per-view copies")
    if not dry_run:  # on the device every target must be met (the CPU dry run only shows them)
        for name, t in sorted(targets.items()):
            if not t.get("met"):
                problems.append(f"bench target {name} unmet: {t.get('value')} (want {t.get('op')} {t.get('limit')})")
        if bench["status"] == "ok" and set(targets) != set(CUDA_TARGETS):
            problems.append(f"bench: the device run reported targets {sorted(targets)}, not {sorted(CUDA_TARGETS)}")
    tests = _tests(folder / "tests.xml")
    if tests["status"] != "ran":
        problems.append(f"tests: {tests['status']}")
    if tests["failed"] or tests["errors"]:
        problems.append(f"tests: {tests['failed']} failed, {tests['errors']} errors")
    if tests["status"] == "ran":
        if dry_run and tests["passed"]:
            problems.append("tests: CUDA tests passed on a dry run (they must skip without CUDA)")
        if not dry_run and (tests["skipped"] or not tests["passed"]):
            problems.append(f"tests: {tests['skipped']} skipped, {tests['passed']} passed on the device")
    probe = _json(folder / "probe.json") or {"device": device, "scenarios": {}, "status": "not run"}
    if not dry_run:
        for name in ("global_locked", "thread_local_unlocked"):
            s = probe.get("scenarios", {}).get(name, {})
            if (
                s.get("status") != "ran"
                or s.get("capture_errors")
                or s.get("copy_errors")
                or not s.get("replays_ok")
                or not s.get("saves_identical")
            ):
                problems.append(f"capture probe {name}: {json.dumps(s)[:300]}")
    summary = {
        "check": "kv_park_gpu",
        "schema": SCHEMA,
        "device": device,
        "dry_run": dry_run,
        "elapsed_s": round(elapsed, 1),
        "env": env,
        "steps": steps,
        "imports_without_sglang": imports,
        "bench": bench,
        "targets": targets,
        "targets_met": figures.get("targets_met"),
        "bytes_identical": identical,
        "tests": tests,
        "capture_probe": probe,
        "ok": not problems,
        "problems": problems,
    }
    assert tuple(summary) == KEYS
    return summary


def main(argv: list[str]) -> int:
    folder = Path(argv[0])
    device = argv[argv.index("--device") + 1]
    elapsed = float(argv[argv.index("--elapsed") + 1])
    summary = summarize(folder, device, "--dry-run" in argv, elapsed)
    (folder / "check.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        json.dumps({k: summary[k] for k in ("device", "dry_run", "ok", "targets_met", "bytes_identical", "problems")})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
