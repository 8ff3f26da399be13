"""Renamed receipt fields do not break an operator's old logs: kv_park's ``capture_gate=global`` is
now ``capture_lock=global`` and page-rounded admission's last charge ``gate`` is now ``clip``.
``receipts`` reads a switch's install from the event word and the rank, never from these fields,
so a log written before the rename verifies the same as one written after it. What the switches log
now is checked where they install (tests/upstream/test_kv_park_capture_paths.py,
tests/upstream/test_page_rounded_admission.py)."""

from __future__ import annotations

import pytest

from adapter.core import receipts, registry
from adapter.ops import cli

PROFILE = {"DSV41_KV_PARK": "ram", "DSV41_PAGE_ROUNDED_ADMISSION": "1"}
OLD = [
    "[dsv41] kv_park installed mode=ram budget_gib=8 worker=background capture_gate=global rank=tp0\n",
    "[dsv41] page_rounded_admission installed charges=running,mixed,check,reserve,gate scope=single-pool rank=tp0\n",
]
NEW = [
    "[dsv41] kv_park installed mode=ram budget_gib=8 worker=background capture_lock=global rank=tp0\n",
    "[dsv41] page_rounded_admission installed charges=running,mixed,check,reserve,clip scope=single-pool rank=tp0\n",
]


@pytest.mark.parametrize("lines", [OLD, NEW], ids=["before-the-rename", "after-the-rename"])
def test_a_log_from_before_or_after_the_rename_passes_receipts(tmp_path, lines):
    parsed = [receipts.parse_line(line) for line in lines]
    assert [(r.switch, r.event, r.rank) for r in parsed] == [
        ("kv_park", "installed", "tp0"), ("page_rounded_admission", "installed", "tp0")]
    assert receipts.audit(lines, registry.resolve(PROFILE), ranks=1) == []
    log, env_file = tmp_path / "boot.log", tmp_path / "profile.env"
    log.write_text("".join(lines))
    env_file.write_text("".join(f"{k}={v}\n" for k, v in PROFILE.items()))
    assert cli.main(["receipts", str(log), "--env-file", str(env_file), "--ranks", "1"]) == 0

