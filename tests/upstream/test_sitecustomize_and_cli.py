"""sitecustomize in real interpreter starts, and the ``check`` / ``receipts`` commands end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawns  # every test here starts another interpreter


ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], extra_env: dict[str, str] | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(extra_env or {}))
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


PROBE = (
    "import sys; from importlib import import_module; "
    "print(sorted(m for m in sys.modules if m == 'adapter' or m.startswith(('adapter.', 'sglang', 'wrapt')))); "
    "print(sum(type(f).__name__ == 'SwitchFinder' for f in sys.meta_path))"
)


def test_with_no_switch_set_sitecustomize_imports_nothing_of_the_overlay():
    out = _run(["-c", PROBE])
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "0"]
    assert out.stderr == ""


def test_with_a_switch_set_one_finder_is_installed_and_the_engine_is_not_imported_early():
    out = _run(["-c", PROBE], {"DSV41_AUTOTUNE_KEEP": "1"})
    assert out.returncode == 0, out.stderr
    modules, finders = out.stdout.splitlines()
    assert finders == "1"
    assert "'sglang'" not in modules and "adapter.core.boot" in modules


def test_a_bad_value_fails_the_engines_entry_import_naming_key_value_and_allowed():
    out = _run(["-c", "import sglang.launch_server"], {"DSV41_AUTOTUNE_KEEP": "maybe"})
    assert out.returncode != 0
    assert "BootError" in out.stderr
    assert "DSV41_AUTOTUNE_KEEP='maybe' is not valid: expected 1/0, true/false, on/off, yes/no" in out.stderr


def test_a_bad_value_leaves_python_processes_that_are_not_the_engine_running():
    out = _run(["-c", "print('still runs')"], {"DSV41_AUTOTUNE_KEEP": "maybe"})
    assert out.returncode == 0
    assert out.stdout.strip() == "still runs"
    assert "[dsv41] configuration error: DSV41_AUTOTUNE_KEEP='maybe'" in out.stderr


def test_an_unknown_key_is_warned_about_with_the_closest_known_key():
    out = _run(["-c", "pass"], {"DSV41_AUTOTUNE_KEPP": "1"})
    assert out.returncode == 0
    assert "[dsv41] unknown key DSV41_AUTOTUNE_KEPP ignored; did you mean DSV41_AUTOTUNE_KEEP?" in out.stderr


def test_check_installs_a_valid_profile_on_the_real_engine_and_exits_zero():
    out = _run(["-m", "adapter", "check"], {"DSV41_AUTOTUNE_KEEP": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("autotune_keep"))
    assert row.split()[1:] == ["DSV41_AUTOTUNE_KEEP=1", "ok", "installed", "yes"]
    assert out.stdout.strip().endswith("check: ok")


def test_check_exits_nonzero_on_a_bad_value_in_a_profile_file(tmp_path):
    profile = tmp_path / "profile.env"
    profile.write_text("DSV41_AUTOTUNE_KEEP=maybe\n")
    out = _run(["-m", "adapter", "check", "--env-file", str(profile)], {"DSV41_AUTOTUNE_KEEP": "1"})
    assert out.returncode == 1
    assert "DSV41_AUTOTUNE_KEEP='maybe' is not valid" in out.stdout
    assert out.stdout.strip().endswith("check: FAILED")


def _logs(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / f"boot{len(list(tmp_path.iterdir()))}.log"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_receipts_passes_when_every_rank_logged_every_switch(tmp_path):
    profile = tmp_path / "p.env"
    profile.write_text("DSV41_AUTOTUNE_KEEP=1\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    log = _logs(logs, [f"INFO x [dsv41] autotune_keep installed fingerprint=ab rank=tp{r}" for r in range(4)])
    out = _run(["-m", "adapter", "receipts", log, "--env-file", str(profile), "--ranks", "4"])
    assert out.returncode == 0, out.stdout
    assert out.stdout.strip().endswith("receipts: ok")


def test_receipts_names_the_missing_rank_and_any_refusal(tmp_path):
    profile = tmp_path / "p.env"
    profile.write_text("DSV41_AUTOTUNE_KEEP=1\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    a = _logs(logs, ["[dsv41] autotune_keep installed fingerprint=ab rank=tp0"])
    b = _logs(logs, ["[dsv41] autotune_keep refused: engine drifted rank=tp1"])
    out = _run(["-m", "adapter", "receipts", a, b, "--env-file", str(profile), "--ranks", "2"])
    assert out.returncode == 1
    assert "missing: autotune_keep refused on tp1: engine drifted" in out.stdout
    assert "missing: autotune_keep installed on 1 of 2 ranks (tp0)" in out.stdout
