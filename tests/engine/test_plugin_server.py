"""End-to-end: the overlay's wheel, ``pip install``-ed into a fresh venv, loaded by SGLang's own
``load_plugins`` in a real server of the Mellum kit, with no repo on ``sys.path`` (``PYTHONPATH`` is
the ``sgl_kernel`` stand-in alone, the server runs outside the repo): no ``sitecustomize`` fires, the
``adapter`` package is the installed one (slow: one boot, 30-150 s here, and one that fails at once).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from adapter.core import receipts, registry
from devkit.engine_kit import client, launcher, model, workload
from devkit.testkit import wheel

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# The gate's profile: every switch that can act on the CPU engine, with the keys the gate sets.
PROFILE = {key: value for s in registry.SWITCHES for key, value in s.gate_role.profile}
ACTING = [s.name for s in registry.SWITCHES if s.gate_role.acts]


@pytest.fixture(scope="module")
def plugin_python(tmp_path_factory) -> Path:
    """A fresh venv's python with the wheel installed, and that ``adapter`` is the one it imports."""
    folder = tmp_path_factory.mktemp("plugin")
    python = wheel.venv_beside(folder / "venv")
    wheel.install(python, wheel.build(folder / "dist"))
    where = subprocess.run([str(python), "-c", "import adapter; print(adapter.__file__)"], cwd=folder,
                           env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(folder / "venv")), where
    return python


def _server(python: Path, tiny_model: Path, log: Path, profile: dict[str, str]) -> launcher.Server:
    env = launcher.child_env(profile)
    env["PYTHONPATH"] = str(launcher.STUB_PATH)  # the CPU kernel stand-in only: no repo, no sitecustomize
    env["SGLANG_PLUGINS"] = "dsv41"
    args = launcher.server_args(tiny_model, launcher.free_port(), swa_ratio=0.1)  # the gate's Mellum boot
    return launcher.Server(args, log, profile, python=str(python), env=env, cwd=log.parent)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return model.make_model(tmp_path_factory.mktemp("kit") / "model")


def test_the_installed_plugin_installs_every_profile_switch_that_acts_on_cpu_in_a_real_server(
        plugin_python, tiny_model, tmp_path):
    profile = {**PROFILE, "DSV41_STRICT": "1"}
    assert set(ACTING) >= {"decode_yield", "swa_thin", "cone_replay"}
    server = _server(plugin_python, tiny_model, tmp_path / "server.log", profile)
    with server:
        out = client.generate(server.base_url, workload.Workload().ids("plugin", 200), 4)
    assert launcher.members(server.proc.pid) == []
    lines = server.log_lines()
    print("\n".join(line for line in lines if "[dsv41]" in line))  # shown when the test fails
    assert len(out["output_ids"]) == 4
    assert receipts.audit(lines, registry.resolve(profile), ranks=1) == []
    for name in ACTING:
        assert any(line.startswith(f"[dsv41] {name} installed ") and line.endswith(" rank=tp0") for line in lines), name
    assert not any("Failed to execute general plugin" in line for line in lines)
    assert not any(line.startswith("[dsv41]") and " refused" in line for line in lines)


def test_with_the_installed_plugin_a_bad_value_fails_the_boot_with_the_overlays_message(
        plugin_python, tiny_model, tmp_path):
    server = _server(plugin_python, tiny_model, tmp_path / "server.log", {"DSV41_DECODE_YIELD": "150"})
    with pytest.raises(launcher.ServerFailed, match="exited with code 1"):
        server.start()
    assert launcher.members(server.proc.pid) == []
    assert ("[dsv41] configuration error: DSV41_DECODE_YIELD='150' is not valid: expected an integer 1..99"
            in server.log_text())
    assert "The server is fired up" not in server.log_text()
