"""``tools/gpu/check.sh --dry-run`` runs every step on CPU and writes the JSON a GPU run writes.

The GPU check runs only on a lent device machine; the dry run keeps it from rotting here: the
same steps (env, imports without sglang, the kv-park bench, the CUDA tests collected and skipped,
the capture probe), the same summary keys, ``"device": "cpu"`` and ``"dry_run": true``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawns  # every test here starts another interpreter


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu" / "check.sh"
sys.path.insert(0, str(ROOT / "tools" / "gpu"))
import summarize  # noqa: E402

STEPS = ("env", "imports", "bench", "tests", "probe")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", str(out)], env=_env(), capture_output=True, text=True, timeout=400
    )
    return proc, out


def test_the_dry_run_passes_and_writes_the_summary_with_every_key(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "check.json").read_text())
    assert tuple(summary) == summarize.KEYS
    assert summary["check"] == "kv_park_gpu" and summary["schema"] == summarize.SCHEMA
    assert summary["device"] == "cpu" and summary["dry_run"] is True
    assert summary["ok"] is True and summary["problems"] == []
    assert {name: s["status"] for name, s in summary["steps"].items()} == dict.fromkeys(STEPS, "ok")
    assert summary["elapsed_s"] > 0 and summary["env"]["cuda_available"] in (False, True)
    assert summary["imports_without_sglang"]["ok"] is True


def test_the_dry_run_bench_reports_every_figure_and_each_target_with_met_or_unmet(dry_run):
    _, out = dry_run
    summary = json.loads((out / "check.json").read_text())
    figures = summary["bench"]["figures"]
    assert summary["bench"]["status"] == "ok" and figures["device"] == "cpu" and figures["quick"] is True
    for key in (
        "save_ms",
        "per_view_save_ms",
        "memcpy_ms",
        "restore_ms",
        "memcpy_restore_ms",
        "save_gbps",
        "restore_gbps",
        "memcpy_gbps",
    ):
        assert isinstance(figures[key], (int, float)) and figures[key] > 0, key
    assert summary["bytes_identical"] is True
    for key in ("pool_save_ms", "pool_restore_ms"):
        assert isinstance(figures[key], (int, float)) and figures[key] > 0, key
    assert figures["pool_pinned"] is False, "the CPU dry run's pool is ordinary memory"
    assert set(summary["targets"]) == {
        "save_speedup_vs_perview",
        "save_vs_memcpy",
        "restore_vs_memcpy",
        "restore_vs_perview",
    }
    for name, target in summary["targets"].items():
        assert set(target) == {"value", "op", "limit", "met"} and isinstance(target["met"], bool), name
        assert target["met"] == (
            target["value"] >= target["limit"] if target["op"] == ">=" else target["value"] <= target["limit"]
        )
    assert summary["targets_met"] == all(t["met"] for t in summary["targets"].values())


def test_the_dry_run_collects_the_cuda_tests_and_skips_them_and_the_probe(dry_run):
    _, out = dry_run
    summary = json.loads((out / "check.json").read_text())
    tests = summary["tests"]
    assert tests["status"] == "ran" and tests["passed"] == tests["failed"] == tests["errors"] == 0
    assert tests["skipped"] >= 8 and all(v.startswith("skipped") for v in tests["cases"].values())
    assert any("global_mode_capture" in name for name in tests["cases"])
    probe = summary["capture_probe"]
    assert probe["device"] == "cpu"
    assert set(probe["scenarios"]) == {"global_unlocked", "global_locked", "thread_local_unlocked"}
    assert all(s["status"].startswith("skipped") for s in probe["scenarios"].values())


def test_the_dry_run_log_names_each_step_and_where_the_results_are(dry_run):
    _, out = dry_run
    log = (out / "check.log").read_text()
    assert "kv_park GPU check: device=cpu dry_run=1" in log
    for name in STEPS:
        assert f"[check] {name}: ok rc=0" in log, name
    assert "page-major save" in log and "done in" in log and str(out / "check.json") in log
    assert len([p for p in out.iterdir()]) <= 8, "the device tool returns at most 8 files from $OUT"


def test_without_a_folder_or_out_the_script_refuses():
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "give a results folder (or set OUT)" in proc.stderr


def _cuda_targets(met: bool = True) -> dict:
    return {
        name: {"value": 0.9 if met else 0.5, "op": ">=", "limit": 0.8, "met": met} for name in summarize.CUDA_TARGETS
    }


def _parts(folder: Path, tests_xml: str | None, status: str = "ok", targets: dict | None = None) -> None:
    rows = [f"{n}\t0\t1\tok" for n in ("env", "imports", "bench", "probe")]
    rows.append(f"tests\t{0 if status == 'ok' else 127}\t0\t{status}")
    (folder / "steps.tsv").write_text("\n".join(rows) + "\n")
    (folder / "imports.json").write_text(json.dumps({"ok": True}))
    (folder / "bench.out").write_text(
        "table\n" + json.dumps({"bytes_identical": True, "targets": _cuda_targets() if targets is None else targets,
                                "targets_met": True}) + "\n"
    )
    if tests_xml is not None:
        (folder / "tests.xml").write_text(tests_xml)


def test_a_missing_pytest_is_reported_as_a_problem_not_a_pass(tmp_path):
    _parts(tmp_path, None, status="skipped: pytest missing")
    summary = summarize.summarize(tmp_path, "cuda", dry_run=False, elapsed=1.0)
    assert summary["ok"] is False and summary["tests"]["status"] == "not run"
    assert any("pytest missing" in p for p in summary["problems"])


def test_on_the_device_a_skipped_cuda_test_or_an_unclean_locked_capture_fails_the_check(tmp_path):
    xml = '<testsuites><testsuite><testcase name="a"/><testcase name="b"><skipped message="needs a CUDA device"/></testcase></testsuite></testsuites>'
    _parts(tmp_path, xml)
    clean = {"status": "ran", "capture_errors": [], "copy_errors": [], "replays_ok": True, "saves_identical": True}
    probe = {
        "device": "cuda",
        "scenarios": {"global_locked": clean, "thread_local_unlocked": dict(clean, copy_errors=["x"])},
    }
    (tmp_path / "probe.json").write_text(json.dumps(probe))
    summary = summarize.summarize(tmp_path, "cuda", dry_run=False, elapsed=1.0)
    assert summary["tests"]["passed"] == 1 and summary["tests"]["skipped"] == 1
    assert any("1 skipped, 1 passed on the device" in p for p in summary["problems"])
    assert any(p.startswith("capture probe thread_local_unlocked") for p in summary["problems"])
    assert not any("global_locked" in p for p in summary["problems"])


def test_on_the_device_an_unmet_or_missing_pool_target_fails_the_check(tmp_path):
    xml = '<testsuites><testsuite><testcase name="a"/></testsuite></testsuites>'
    clean = {"status": "ran", "capture_errors": [], "copy_errors": [], "replays_ok": True, "saves_identical": True}
    probe = {"device": "cuda", "scenarios": {"global_locked": clean, "thread_local_unlocked": clean}}
    (tmp_path / "probe.json").write_text(json.dumps(probe))
    _parts(tmp_path, xml)
    assert summarize.summarize(tmp_path, "cuda", dry_run=False, elapsed=1.0)["ok"] is True
    targets = _cuda_targets()
    targets["pool_restore_speed_vs_pinned_memcpy"].update(value=0.5, met=False)
    _parts(tmp_path, xml, targets=targets)
    summary = summarize.summarize(tmp_path, "cuda", dry_run=False, elapsed=1.0)
    assert summary["ok"] is False
    assert summary["problems"] == ["bench target pool_restore_speed_vs_pinned_memcpy unmet: 0.5 (want >= 0.8)"]
    _parts(tmp_path, xml, targets={"save_vs_memcpy": {"value": 1, "op": "<=", "limit": 2.5, "met": True}})
    assert any("not ['pool_" in p for p in summarize.summarize(tmp_path, "cuda", dry_run=False, elapsed=1.0)["problems"])


def test_the_bench_reports_the_pool_targets_on_cuda_and_judges_each(monkeypatch):
    from devkit.bench import kv_park

    assert set(kv_park.CUDA_TARGETS) == set(summarize.CUDA_TARGETS), "check.json and the bench name other targets"
    figures = {"device": "cuda", "pool_save_speed_vs_pinned_memcpy": 0.93, "pool_restore_speed_vs_pinned_memcpy": 0.79,
               "pool_save_vs_stock_get_cpu_copy": 1.0}
    table = kv_park._target_table(figures)
    assert {n: t["met"] for n, t in table.items()} == {
        "pool_save_speed_vs_pinned_memcpy": True, "pool_restore_speed_vs_pinned_memcpy": False,
        "pool_save_vs_stock_get_cpu_copy": True,
    }
