"""The TP ranks of one server agree on host RAM before they pin (adapter/switches/kv_park/host_ledger.py).

Every rank pins its own park pool of the same size; checked alone, each rank sees enough
``MemAvailable`` before the others have pinned. Through the ledger the first rank of the group judges
the group's whole need once, and every rank takes that verdict: they pass or refuse together.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from adapter.switches.kv_park import host_ledger
from adapter.switches.kv_park.host_pool import HostRoom, PoolError, check_host_room

GIB = 1 << 30

RANK = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from adapter.switches.kv_park import host_ledger
    from adapter.switches.kv_park.host_pool import HostRoom, PoolError
    ledger, owner, available, pinned_by_others = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    # What MemAvailable says to this rank: less whatever the other rank has pinned already.
    def room():
        taken = int(Path(pinned_by_others).read_text() or 0) if Path(pinned_by_others).exists() else 0
        return HostRoom(available - taken, "MemAvailable (test)")
    try:
        host_ledger.agree(8 << 30, ranks=2, what="DSV41_KV_PARK_GIB=8", group="server", owner=owner, ledger=ledger, room=room)
    except PoolError as exc:
        print("refused:", exc)
        sys.exit(3)
    Path(pinned_by_others).write_text(str(8 << 30))  # this rank pinned its pool
    host_ledger.report_pinned(group="server", owner=owner, ledger=ledger)
    print("pinned")
    """
)


def _rank(tmp_path, available: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", RANK, str(tmp_path / "ledger.json"), str(os.getpid()), str(available), str(tmp_path / "pinned")],
        capture_output=True, text=True, timeout=120, cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()},
    )


@pytest.mark.spawns
def test_two_rank_processes_refuse_together_when_the_host_cannot_hold_both_pools(tmp_path):
    """12 GiB available, two ranks of 8 GiB: each alone would pass its own check (the first before the
    second pinned), and together they would over-commit; through one ledger both refuse."""
    assert check_host_room(8 * GIB, "one rank", HostRoom(12 * GIB, "MemAvailable (test)"))  # what each rank saw alone
    first, second = _rank(tmp_path, 12 * GIB), _rank(tmp_path, 12 * GIB)
    assert (first.returncode, second.returncode) == (3, 3), (first.stdout + first.stderr, second.stdout + second.stderr)
    for rank in (first, second):
        assert "the park pools of the 2 TP rank(s) on this host need 16.00 GiB" in rank.stdout
        assert "every rank of this server refuses" in rank.stdout


@pytest.mark.spawns
def test_two_rank_processes_pass_together_when_the_host_holds_both_pools(tmp_path):
    first, second = _rank(tmp_path, 20 * GIB), _rank(tmp_path, 20 * GIB)
    assert (first.returncode, second.returncode) == (0, 0), (first.stdout + first.stderr, second.stdout + second.stderr)
    # The second rank took the group's verdict: it did not measure again after the first had pinned.


def _room(gib: float):
    return lambda: HostRoom(int(gib * GIB), "MemAvailable (test)")


def test_two_simulated_ranks_on_one_ledger_refuse_together_where_each_alone_would_pass(tmp_path):
    """The fast lane's twin of the two-process test: rank 0 books, pins nothing yet; rank 1, seeing
    the same 12 GiB, takes rank 0's verdict on the group's 16 GiB. Both raise the same error."""
    ledger, me = tmp_path / "ledger.json", os.getpid()
    errors = []
    for _ in range(2):
        with pytest.raises(PoolError) as info:
            host_ledger.agree(8 * GIB, ranks=2, what="DSV41_KV_PARK_GIB=8", group="g", owner=me, ledger=ledger, room=_room(12))
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "need 16.00 GiB of page-locked host RAM together (8.00 GiB each)" in errors[0]


def test_another_servers_booking_counts_until_its_ranks_have_pinned(tmp_path):
    ledger, me = tmp_path / "ledger.json", os.getpid()
    host_ledger.agree(8 * GIB, ranks=2, what="a", group="a", owner=me, ledger=ledger, room=_room(40))
    with pytest.raises(PoolError, match=r"less 16\.00 GiB other servers booked"):
        host_ledger.agree(8 * GIB, ranks=2, what="b", group="b", owner=me, ledger=ledger, room=_room(30))
    for _ in range(2):  # server a's ranks pinned: MemAvailable now shows them, the booking stops counting
        host_ledger.report_pinned(group="a", owner=me, ledger=ledger)
    facts = host_ledger.agree(8 * GIB, ranks=2, what="c", group="c", owner=me, ledger=ledger, room=_room(24))
    assert facts == {"host_group": "c", "group_ranks": 2, "group_need_gib": 16.0}


@pytest.mark.spawns
def test_a_booking_whose_launcher_is_gone_is_dropped(tmp_path):
    ledger = tmp_path / "ledger.json"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    host_ledger.agree(8 * GIB, ranks=4, what="a", group="old", owner=dead, ledger=ledger, room=_room(40))
    host_ledger.agree(8 * GIB, ranks=4, what="b", group="new", owner=os.getpid(), ledger=ledger, room=_room(40))
    assert "old" not in ledger.read_text()
