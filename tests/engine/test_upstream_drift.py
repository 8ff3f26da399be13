"""Upstream drift end to end: a temporary copy of the installed SGLang with one pinned function
changed (:mod:`devkit.soak.drift`; the venv is never written) is put first on the server's
``PYTHONPATH``. The boot must refuse exactly the switch that pins the function, naming the drift,
keep every other switch of the gate's profile, and serve stock greedy outputs; with
``DSV41_STRICT=1`` the boot must fail. A renamed or deleted pinned function (which the engine
itself would call, so no server can run on it) is refused by ``python -m adapter check`` naming
the missing function.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from adapter.core import receipts, registry
from devkit import gate, soak
from devkit.engine_kit import launcher, model
from devkit.soak import drift

pytestmark = [pytest.mark.slow, pytest.mark.heavy]
SWA_THIN_PIN = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.checkpoint_into_tree"
DECODE_YIELD_PIN = "sglang.srt.managers.scheduler:Scheduler._reqs_finishing_inflight"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return model.make_model(tmp_path_factory.mktemp("kit") / "model")


def _server(tiny_model, log, profile, site=None):
    server = launcher.Server(launcher.server_args(tiny_model, launcher.free_port(), swa_ratio=0.25), log, profile,
                             ready_timeout_s=420, max_life_s=900)
    if site is not None:
        server.env["PYTHONPATH"] = drift.pythonpath_first(site, server.env["PYTHONPATH"])
    return server


def test_an_edited_pin_refuses_only_its_switch_and_the_engine_serves_stock(tiny_model, tmp_path):
    site = drift.drifted_sglang(tmp_path / "edit", SWA_THIN_PIN, "edit")
    profile = gate.build_profile()
    assert "DSV41_SWA_THIN" in profile
    with _server(tiny_model, tmp_path / "stock.log", {}) as stock:
        expected = soak.run_probes(stock.base_url, seed=1)
    with _server(tiny_model, tmp_path / "drifted.log", profile, site) as drifted:
        got = soak.run_probes(drifted.base_url, seed=1)
    lines = drifted.log_lines()
    refused = [receipts.parse_line(ln) for ln in lines if " refused: " in ln and "[dsv41]" in ln]
    assert {r.switch for r in refused} == {"swa_thin"}, refused
    assert all("drifted from the pin" in r.reason and SWA_THIN_PIN in r.reason for r in refused)
    gaps = receipts.audit(lines, registry.resolve(profile), ranks=1)
    assert gaps and all(g.startswith("swa_thin") for g in gaps), gaps
    installed = {r.switch for r in map(receipts.parse_line, lines) if r is not None and r.event == "installed"}
    assert {"decode_yield", "cone_replay", "fast_tree_core"} <= installed
    assert got == expected, "the drifted boot's greedy outputs differ from stock's"

    strict = _server(tiny_model, tmp_path / "strict.log", {**profile, "DSV41_STRICT": "1"}, site)
    with pytest.raises(launcher.ServerFailed):
        strict.start()
    assert strict.stop() == []
    assert "swa_thin refused under DSV41_STRICT=1" in strict.log_text()


@pytest.mark.parametrize(("mode", "pin", "switch", "env_line"), [
    ("rename", SWA_THIN_PIN, "swa_thin", "DSV41_SWA_THIN=1"),
    ("delete", DECODE_YIELD_PIN, "decode_yield", "DSV41_DECODE_YIELD=50"),
])
def test_a_renamed_or_deleted_pin_is_refused_by_check_naming_the_missing_function(tmp_path, mode, pin, switch, env_line):
    site = drift.drifted_sglang(tmp_path / mode, pin, mode)
    env_file = tmp_path / "profile.env"
    env_file.write_text(env_line + "\nDSV41_SWA_CONE_REPLAY=1\nDSV41_SWA_CONE_TOKENS=64\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env["PYTHONPATH"] = drift.pythonpath_first(site, str(launcher.REPO_ROOT))
    done = subprocess.run([sys.executable, "-m", "adapter", "check", "--env-file", str(env_file)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=launcher.REPO_ROOT)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert f"[dsv41] {switch} refused: {pin}" in out, out
    rows = {ln.split()[0]: ln.split() for ln in done.stdout.splitlines() if ln and ln.split()[0] in
            {s.name for s in registry.SWITCHES}}
    assert rows[switch][-2] == "refused" and rows[switch][-3].startswith("drift")
    assert rows["cone_replay"][-2] == "armed" and rows["cone_replay"][-3] == "ok"
