"""Only the ``<switch> refused: <reason>`` form (with the colon) is a switch's refusal: a per-action
line of a switch (kv_park's store declining one entry) never counts as the switch refusing."""

from __future__ import annotations

import logging

import pytest
import torch

from adapter.core import receipts, registry
from adapter.switches.kv_park.engine import CopyEngine
from adapter.switches.kv_park.page_format import PageLayout, Region
from adapter.switches.kv_park.store import ParkStore

PROFILE = registry.resolve({"DSV41_KV_PARK": "ram"})
INSTALLED = "[dsv41] kv_park installed mode=ram budget_gib=8 worker=background rank=tp0"


def test_the_store_logs_an_entry_it_would_not_take_as_declined_and_the_audit_sees_no_refusal(records):
    pool = torch.zeros((8, 64), dtype=torch.uint8)
    store = ParkStore(64, worker=False)  # a budget of one page
    outcome = store.offer("big", CopyEngine(PageLayout((Region("kv", pool),))), [0, 1])
    assert outcome.startswith("refused: ")  # the store's answer to its caller is unchanged
    lines = [r.getMessage() for r in records if r.levelno == logging.DEBUG and "kv_park" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("[dsv41] kv_park declined key=big bytes=128 why=")
    parsed = receipts.parse_line(lines[0])
    assert parsed is not None and parsed.event == "declined" and not parsed.refusal
    assert receipts.audit([INSTALLED, lines[0]], PROFILE, ranks=1) == []


def test_a_colonless_refused_event_line_is_not_a_refusal_but_the_colon_form_is():
    legacy = "[dsv41] kv_park refused key=r1 bytes=4096 why=parking_disabled rank=tp0"  # a pre-rename log
    parsed = receipts.parse_line(legacy)
    assert parsed is not None and parsed.event == "refused" and not parsed.refusal and parsed.reason == ""
    assert receipts.audit([INSTALLED, legacy], PROFILE, ranks=1) == []
    refusal = "[dsv41] kv_park refused: the pool has no host copy path: x rank=tp0"
    parsed = receipts.parse_line(refusal)
    assert parsed is not None and parsed.refusal and parsed.reason == "the pool has no host copy path: x"
    assert receipts.audit([INSTALLED, refusal], PROFILE, ranks=1) == [
        "kv_park refused on tp0: the pool has no host copy path: x"]


def test_a_colon_inside_a_per_action_line_is_not_read_as_a_reason():
    parsed = receipts.parse_line("[dsv41] kv_park disabled reason=copy_of_r1_failed:_OSError rank=tp1")
    assert parsed is not None and (parsed.event, parsed.reason, parsed.refusal) == ("disabled", "", False)
    parsed = receipts.parse_line("[dsv41] kv_park unsupported pool=X: reason=y rank=tp1")
    assert parsed is not None and parsed.event == "unsupported" and not parsed.refusal


def test_receipts_with_zero_ranks_or_an_unreadable_profile_is_a_one_line_error(tmp_path, capsys):
    from adapter.ops import cli

    log = tmp_path / "boot.log"
    log.write_text("")
    with pytest.raises(SystemExit) as exited:
        cli.main(["receipts", str(log), "--env-file", str(log), "--ranks", "0"])
    assert exited.value.code == 2 and "--ranks='0' is invalid: expected an integer >= 1" in capsys.readouterr().err
    missing = tmp_path / "no-such.env"
    assert cli.main(["receipts", str(log), "--env-file", str(missing), "--ranks", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read ") and str(missing) in err and "Traceback" not in err
