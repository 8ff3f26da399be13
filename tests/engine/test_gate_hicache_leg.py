"""The release gate's HiCache leg on the real engine (``gate --quick --hicache [--model dsv4]``; heavy:
three boots per run, minutes here on the Mellum kit, more on the DSV4 kit): every boot runs the
datacenter profile's HiCache flags and churn past its host tier, so stock + HiCache loses the idle session; thin's row passes only where thin kept it, and fails when the
profile boot runs without ``DSV41_SWA_THIN`` while the row is still judged (``--drop-key``). The host
phase presses the device Full pool: the row ``cone_replay (Full KV from host)`` passes only on the
cone's load line for the session's resume, and fails without ``DSV41_SWA_CONE_REPLAY``."""

from __future__ import annotations

import pytest

from devkit.engine_kit.workload import HOST_RESUME_RID
from devkit.gate.verdict import HOST_ROW

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def _run(tmp_path, drop=(), model="mellum"):
    import devkit.gate as gate
    from devkit.gate import hicache_leg

    lines: list[str] = []
    figures = gate.run(quick=True, out=tmp_path / "gate", say=lines.append, hicache=True, drop=drop, model_kit=model)
    print("\n".join(lines))
    assert figures["hicache"] == list(hicache_leg.launch_args())
    assert "--hicache-write-policy" in figures["hicache"] and figures["leftover_processes"] == 0
    assert figures["valid"] and figures["receipts_ok"] and figures["outputs_equal"], figures
    # both stock + HiCache controls lost the idle session: the churn outran the host tier
    assert all(c["resume_cached_frac"] < 0.5 for c in figures["controls"].values()), figures["controls"]
    return figures


@pytest.mark.parametrize("model", ["mellum", "dsv4"])
def test_the_hicache_legs_thin_row_passes_where_thin_kept_what_stock_and_hicache_lost(tmp_path, model):
    figures = _run(tmp_path, model=model)
    assert figures["resume_cached_frac_profile"] == 1.0
    assert figures["rows"]["swa_thin"] == "pass" and figures["rows"]["fast_tree_core"] == "pass (outputs equal)"
    assert figures["rows"]["cone_replay"] == "pass", figures["rows"]
    # the host phase: the session's Full KV came back from host through the cone, N replayed
    assert figures["rows"][HOST_ROW] == "pass", figures["rows"]
    log = (tmp_path / "gate" / "B-profile.log").read_text()
    assert f"DSV41_SWA_CONE load rid={HOST_RESUME_RID} tokens=" in log
    assert figures["verdict"] == "PASS", figures["verdict_why"]


def test_the_hicache_legs_thin_row_fails_when_the_profile_boot_runs_without_swa_thin(tmp_path):
    figures = _run(tmp_path, drop=("DSV41_SWA_THIN",))
    assert "DSV41_SWA_THIN" not in figures["profile"] and figures["drop_keys"] == ["DSV41_SWA_THIN"]
    assert figures["rows"]["swa_thin"].startswith("FAIL"), figures["rows"]
    assert figures["verdict"] == "FAIL"


@pytest.mark.parametrize("model", ["mellum", "dsv4"])
def test_the_hicache_legs_host_row_fails_when_the_profile_boot_runs_without_the_cone(tmp_path, model):
    figures = _run(tmp_path, drop=("DSV41_SWA_CONE_REPLAY",), model=model)
    assert figures["rows"][HOST_ROW].startswith("FAIL: no replay planned for the resume"), figures["rows"]
    assert "DSV41_SWA_CONE load" not in (tmp_path / "gate" / "B-profile.log").read_text()
    assert figures["verdict"] == "FAIL"

