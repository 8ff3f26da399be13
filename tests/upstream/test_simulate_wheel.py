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
# A stranger between the turns that outgrows a 32768-token device pool: the session's history leaves
# the device, and only HiCache's host tier (write_through) keeps it.
EVICTING = (4000, 30000, 10, list(range(300, 359)))


@pytest.mark.spawns
def test_the_installed_wheel_replays_a_trace_and_hicaches_host_tier_without_the_checkout(tmp_path):
    """A session of two turns and a stranger at the production profile's geometry: every default
    policy matches the continuation's whole history and leaks nothing, the modules ran from the
    venv (no ``devkit`` importable there); with a stranger that evicts the history from a small
    device pool, stock recomputes it and the ``+hicache`` policies load it back from host, over the
    wheel's own host route and copies."""
    python = wheel_kit.venv_beside(tmp_path / "venv")
    wheel_kit.install(python, wheel_kit.build(tmp_path / "dist"))
    work = tmp_path / "operator"
    work.mkdir()
    shutil.copy(wheel_kit.REPO_ROOT / ".env.tp4.example", work / "fleet.env")
    for name, rows in (("t.jsonl", ROWS), ("h.jsonl", [*ROWS[:2], EVICTING, ROWS[2]])):
        (work / name).write_text("".join(json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                                                     "hash_ids": ids}) + "\n" for ts, n_in, n_out, ids in rows))
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
    assert tuple(result["policies"]) == ("stock", "thin", "thin+cone", "session", "thin+session")
    history = (20224 + 300 - 1) // 256 * 256
    for policy, row in result["policies"].items():
        assert row["leak"] == 0 and row["resume_hit_rate"] == 1.0, policy
        assert row["recomputed_tokens_continuation"] == 26112 - history, policy
    hicache = run("-m", "adapter", "simulate", "h.jsonl", "--env-file", "fleet.env", "--kv-tokens", "32768",
                  "--policies", "stock,stock+hicache,thin+cone+hicache", "--json")
    assert hicache.returncode == 0, hicache.stdout[-2000:] + hicache.stderr[-3000:]
    rows = json.loads(hicache.stdout.strip().splitlines()[-1])["policies"]
    assert rows["stock"]["recomputed_tokens_continuation"] == 26112 and rows["stock"]["resume_hit_rate"] == 0.0
    for policy in ("stock+hicache", "thin+cone+hicache"):
        row = rows[policy]
        assert row["host_loaded_tokens"] == history and row["host_load_backs"] == 1, policy
        assert row["recomputed_tokens_continuation"] == 26112 - history and row["leak"] == 0, policy
    no_profile = run("-m", "adapter", "simulate", "t.jsonl")
    assert no_profile.returncode == 2 and no_profile.stderr.strip().splitlines()[-1].startswith(
        "error: --env-file='(not given)' is not valid"), no_profile.stderr[-2000:]
