"""The release gate passes with the overlay loaded as SGLang's plugin: the wheel installed in a fresh
venv, ``SGLANG_PLUGINS=dsv41``, no repo on the servers' path (``gate --via plugin``; heavy: three
boots, minutes here)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def test_the_quick_gate_passes_with_the_overlay_loaded_as_sglangs_plugin(tmp_path):
    import devkit.gate as gate

    lines: list[str] = []
    figures = gate.run(quick=True, out=tmp_path / "gate", say=lines.append, via="plugin")
    print("\n".join(lines))
    assert figures["via"] == "plugin"
    assert any("via plugin: dsv41_overlay-" in line for line in lines)
    assert figures["verdict"] == "PASS", figures["rows"]
    assert figures["receipts_ok"] and figures["leftover_processes"] == 0
