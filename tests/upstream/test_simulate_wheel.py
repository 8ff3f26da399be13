"""``simulate`` from the wheel alone: the built ``dsv41_overlay`` wheel installed in a fresh venv (which
sees the shared venv's SGLang and torch, not this checkout), run on a trace and a profile an operator
would bring, from a folder outside the repo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from devkit.testkit import wheel as wheel_kit

ROWS = [(0, 20000, 300, list(range(40))), (50, 3000, 10, list(range(100, 106))),
        (9000, 26000, 20, list(range(39)) + list(range(200, 212)))]


@pytest.mark.spawns
def test_the_installed_wheel_replays_a_trace_without_the_checkout_and_refuses_hicache_in_one_line(tmp_path):
    """A session of two turns and a stranger at the production profile's geometry: every default
    policy matches the continuation's whole history and leaks nothing, the modules ran from the
    venv (no ``devkit`` importable there), and what needs the checkout is refused, naming why."""
    python = wheel_kit.venv_beside(tmp_path / "venv")
    wheel_kit.install(python, wheel_kit.build(tmp_path / "dist"))
    work = tmp_path / "operator"
    work.mkdir()
    shutil.copy(wheel_kit.REPO_ROOT / ".env.tp4.example", work / "fleet.env")
    (work / "t.jsonl").write_text("".join(json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                                                      "hash_ids": ids}) + "\n" for ts, n_in, n_out, ids in ROWS))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_") and k != "PYTHONPATH"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(python), *args], cwd=work, env=env, capture_output=True, text=True, timeout=600)

    where = run("-c", "import importlib.util as u, overlay_tools.simulate as s; print(s.__file__); "
                      "print(u.find_spec('devkit'))")
    assert where.returncode == 0, where.stderr[-2000:]
    assert where.stdout.split() == [str(next((tmp_path / "venv").rglob("overlay_tools/simulate/__init__.py"))),
                                    "None"]
    done = run("-m", "adapter", "simulate", "t.jsonl", "--env-file", "fleet.env", "--json")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["sessions"]["linked"] == 1 and result["geometry"]["page"] == 256
    assert tuple(result["policies"]) == ("stock", "thin", "thin+cone")
    history = (20224 + 300 - 1) // 256 * 256
    for policy, row in result["policies"].items():
        assert row["leak"] == 0 and row["resume_hit_rate"] == 1.0, policy
        assert row["recomputed_tokens_continuation"] == 26112 - history, policy
    refused = run("-m", "adapter", "simulate", "t.jsonl", "--env-file", "fleet.env", "--hicache")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        "error: --policies='stock+hicache,thin+cone+hicache' is not valid"), refused.stderr[-2000:]
    assert "devkit/engine_kit/stub" in refused.stderr and "Traceback" not in refused.stderr
    no_profile = run("-m", "adapter", "simulate", "t.jsonl")
    assert no_profile.returncode == 2 and no_profile.stderr.strip().splitlines()[-1].startswith(
        "error: --env-file='(not given)' is not valid"), no_profile.stderr[-2000:]
