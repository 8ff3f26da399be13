"""Damaged receipts logs: a log cut short, two ranks' lines interleaved (whole lines, or two
writers in one line), and bytes that are not text. ``receipts`` must never pass a boot whose log
does not show every switch installed on every rank, and must never crash on the log's content."""

from __future__ import annotations

import pytest

from adapter.core import receipts, registry
from adapter.ops import cli

PROFILE = {"DSV41_SWA_THIN": "1", "DSV41_DECODE_YIELD": "50"}
GOOD = {
    rank: [
        f"[2026-12-01 09:00:00] [dsv41] fast_tree_core installed paths=insert_walk rank={rank}\n",
        f"[2026-12-01 09:00:00] [dsv41] swa_thin installed tree_core=python rank={rank}\n",
        f"[2026-12-01 09:00:01] [dsv41] decode_yield installed share=50 rank={rank}\n",
    ]
    for rank in ("tp0", "tp1")
}


def _audit(lines, ranks=2):
    return receipts.audit(lines, registry.resolve(PROFILE), ranks)


def _cli(tmp_path, content: bytes, ranks: int = 2) -> tuple[int, str]:
    log = tmp_path / "boot.log"
    log.write_bytes(content)
    env_file = tmp_path / "profile.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in PROFILE.items()))
    return cli.main(["receipts", str(log), "--env-file", str(env_file), "--ranks", str(ranks)]), str(log)


def test_two_ranks_whole_lines_interleaved_in_one_log_pass():
    mixed = [line for pair in zip(GOOD["tp0"], GOOD["tp1"]) for line in pair]
    assert _audit(mixed) == []


def test_a_log_cut_inside_the_last_receipt_names_that_switch_on_that_rank():
    cut = GOOD["tp0"] + GOOD["tp1"][:2] + [GOOD["tp1"][2][:40]]  # "... decode_yield instal"
    gaps = _audit(cut)
    assert gaps == ["decode_yield installed on 1 of 2 ranks (tp0)"]


def test_a_log_cut_before_the_rank_field_is_not_read_as_a_receipt():
    line = GOOD["tp1"][1]
    cut = line[: line.index(" rank=") + len(" rank=")] + "\n"  # the rank itself is missing
    assert receipts.parse_line(cut) is None
    gaps = _audit(GOOD["tp0"] + [GOOD["tp1"][0], cut, GOOD["tp1"][2]])
    assert gaps == ["swa_thin installed on 1 of 2 ranks (tp0)"]


def test_two_writers_in_one_line_never_count_as_two_installs():
    """Rank 1's receipt written into the middle of rank 0's line: at most one of them is read, so
    the boot cannot pass on a line it cannot read (it fails, naming the switch and the ranks)."""
    a, b = GOOD["tp0"][1].rstrip("\n"), GOOD["tp1"][1]
    merged = a[: a.index(" rank=")] + b[b.index("[dsv41]"):]  # "... swa_thin installed tree_core=python[dsv41] ..."
    gaps = _audit([GOOD["tp0"][0], GOOD["tp1"][0], merged, GOOD["tp0"][2], GOOD["tp1"][2]])
    assert gaps and gaps[0].startswith("swa_thin installed on") and "of 2 ranks" in gaps[0]


def test_a_refusal_merged_into_an_install_line_is_still_a_refusal():
    refusal = "[dsv41] swa_thin refused: pin drifted"
    merged = refusal + " " + GOOD["tp1"][1][GOOD["tp1"][1].index("[dsv41]"):]
    gaps = _audit(GOOD["tp0"] + [GOOD["tp1"][0], merged, GOOD["tp1"][2]])
    assert any(g.startswith("swa_thin refused on tp1") for g in gaps), gaps


@pytest.mark.spawns
def test_the_receipts_command_reads_a_truncated_log_with_broken_bytes_and_fails_it(tmp_path, capsys):
    content = "".join(GOOD["tp0"] + GOOD["tp1"][:2]).encode() + b"\xff\xfe[dsv41] decode_yi"
    rc, _ = _cli(tmp_path, content)
    out = capsys.readouterr().out
    assert rc == 1
    assert "missing: decode_yield installed on 1 of 2 ranks (tp0)" in out and "receipts: FAILED" in out


@pytest.mark.spawns
def test_the_receipts_command_passes_the_same_log_whole(tmp_path, capsys):
    rc, _ = _cli(tmp_path, "".join(GOOD["tp0"] + GOOD["tp1"]).encode())
    assert rc == 0 and "receipts: ok" in capsys.readouterr().out


# A TP=2 boot's log: switches installed at import log the process id in every process that imports
# their module (the server's main process, each scheduler before SGLang publishes its rank); each
# scheduler then logs them again under its engine rank (adapter.core.boot.announce_rank).
PID_LINES = {pid: [line.replace(" rank=tp0", f" rank=pid{pid}") for line in GOOD["tp0"]] for pid in (100, 201, 202)}


def test_pid_receipts_of_the_other_processes_never_stand_in_for_a_missing_scheduler():
    """Scheduler tp1 announced nothing: the main process's and both schedulers' pid lines (three
    "ranks" by pid) must not make up for it."""
    log = PID_LINES[100] + PID_LINES[201] + PID_LINES[202] + GOOD["tp0"]
    assert _audit(log) == [f"{name} installed on 1 of 2 ranks (tp0)" for name in ("decode_yield", "fast_tree_core",
                                                                                   "swa_thin")]
    assert _audit(log + GOOD["tp1"]) == []


def test_a_one_rank_boot_fails_a_two_rank_audit_whatever_its_main_process_logged():
    assert _audit(PID_LINES[100] + PID_LINES[201] + GOOD["tp0"])[0] == "decode_yield installed on 1 of 2 ranks (tp0)"
    assert _audit(PID_LINES[100] + PID_LINES[201] + GOOD["tp0"], ranks=1) == []


def test_a_switch_seen_only_under_process_ids_is_reported_as_on_no_scheduler_rank():
    gaps = _audit(PID_LINES[100] + PID_LINES[201], ranks=1)
    assert gaps[0] == "decode_yield installed on 0 of 1 ranks (none; 2 pid receipt(s), which name no scheduler rank)"


def test_only_engine_ranks_count_as_scheduler_ranks():
    assert [receipts.is_engine_rank(r) for r in ("tp0", "tp12", "tp3pp1", "tp1dp2", "tp0pp1dp1")] == [True] * 5
    assert [receipts.is_engine_rank(r) for r in ("pid4242", "tp", "tpx", "dp0", "tp0 ", "tp1pp")] == [False] * 6
