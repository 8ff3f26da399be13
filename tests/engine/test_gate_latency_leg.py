"""The gate's latency leg on the real engine (``gate --latency --quick``; heavy: three boots of the Mellum
kit, each serving a burst and the judged run, minutes here): the shipped profile's keys on traffic
offered at a fraction of the capacity the first stock boot measured, the switch's windows counted on
the profile boot only. The verdict itself moves with the machine; its logic is tests/unit/test_gate_latency.py."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def test_the_latency_leg_loads_the_kit_at_its_measured_capacity_with_the_shipped_profile(tmp_path):
    from devkit.bench.chat_latency import load
    from devkit.gate import latency, shipped

    lines: list[str] = []
    figures = latency.run(quick=True, out=tmp_path / "latency", say=lines.append)
    print("\n".join(lines))
    boots = figures["boots"]
    assert figures["verdict"] in {"PASS", "FAIL", "INVALID"} and figures["profile"] == shipped.profile("mellum")
    assert all(b["error"] is None for b in boots.values()), boots
    turns = load.load_traffic("mellum", True)["turns"]
    capacity = boots["A1-stock"]["capacity_req_s"]
    assert figures["traffic"]["rate"] == round(latency.LOAD_FRACTION * capacity / turns, 4)
    assert boots["B-profile"]["counters"]["windows"] > 0  # the switch acted on the judged run
    assert boots["A1-stock"]["counters"]["windows"] == boots["A2-stock"]["counters"]["windows"] == 0
    assert figures["limits"]["mean_ttft_ms"] > 0 and figures["slack_ms"] == pytest.approx(latency.WINDOW_STEPS * figures["step_ms"], abs=0.1)
