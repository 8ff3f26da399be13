"""One verdict on host RAM for all the TP ranks of a server on this machine.

Each TP rank pins its own park pool of the same size. Checked alone, every rank could see enough
``MemAvailable`` before any of them has pinned, and together they would over-commit the machine.
So the ranks book through one ledger file under an exclusive ``flock``: the first rank of a group
(the TP ranks one launcher process started: the same parent pid) measures the host's room once
(:func:`~adapter.switches.kv_park.host_pool.host_room`) and judges the whole group's need, ``ranks x
pool``, against it, less what other live groups have booked and not pinned yet; every later rank of
the group reads that verdict. So the ranks pass together or refuse together (each raises the same
:class:`~adapter.switches.kv_park.host_pool.PoolError`, naming the group's need and the room), and
two servers booting side by side do not both count the same free memory. A rank reports its pool
pinned (:func:`report_pinned`), after which MemAvailable shows it and the booking stops counting.
Groups whose launcher is gone are dropped from the ledger.

Importing this module imports no SGLang.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from adapter.switches.kv_park.host_pool import HostRoom, PoolError, _gib, host_room


def default_ledger() -> Path:
    """The machine-wide ledger file (``/dev/shm`` when it exists: shared by every process here)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / "dsv41-kv-park-host-ledger.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def _locked(path: Path):
    """The ledger's bookings, read and written back under an exclusive lock on ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            fh.seek(0)
            raw = fh.read()
            try:
                groups: dict[str, dict[str, Any]] = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError:
                groups = {}  # a torn or foreign file: start over (every live rank books again)
            yield groups
            fh.seek(0)
            fh.truncate()
            fh.write(json.dumps(groups, sort_keys=True))
            fh.flush()
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _unpinned(booking: dict[str, Any]) -> int:
    """Bytes a passing group booked and has not pinned yet (pinned pools show in MemAvailable)."""
    if not booking.get("ok"):
        return 0
    left = max(0, int(booking["ranks"]) - int(booking.get("pinned", 0)))
    return int(booking["pool"]) * left


def agree(
    pool_bytes: int,
    *,
    ranks: int,
    what: str,
    group: str | None = None,
    owner: int | None = None,
    ledger: Path | None = None,
    room: Callable[[], HostRoom] = host_room,
) -> dict[str, object]:
    """Book this rank's ``pool_bytes``; the group's verdict (the same on every rank of it).

    ``group`` (default: the parent pid) names the ranks that boot together, ``owner`` the pid whose
    death drops the booking (default: the parent). Raises :class:`PoolError` when the group's
    ``ranks x pool_bytes`` does not fit; returns the booking's facts for the boot line otherwise."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    owner = os.getppid() if owner is None else owner
    group = f"ppid{owner}" if group is None else group
    path = default_ledger() if ledger is None else ledger
    with _locked(path) as groups:
        for name in [g for g, b in groups.items() if not _alive(int(b.get("owner", 0)))]:
            del groups[name]
        booking = groups.get(group)
        if booking is None or int(booking["pool"]) != pool_bytes or int(booking["ranks"]) != ranks:
            measured = room()
            others = sum(_unpinned(b) for g, b in groups.items() if g != group)
            need = ranks * pool_bytes
            available = None if measured.available is None else measured.available - others
            booking = {
                "owner": owner, "ranks": ranks, "pool": pool_bytes, "pinned": 0,
                "ok": available is None or need <= available,
                "room": measured.describe(), "others": others,
                "available": available,
            }
            groups[group] = booking
        arrived = int(booking.get("arrived", 0)) + 1
        booking["arrived"] = arrived
    facts = {"host_group": group, "group_ranks": ranks, "group_need_gib": round(ranks * pool_bytes / (1 << 30), 2)}
    if not booking["ok"]:
        others = int(booking["others"])
        booked = f", less {_gib(others)} other servers booked and have not pinned yet" if others else ""
        raise PoolError(
            f"{what}: the park pools of the {ranks} TP rank(s) on this host need {_gib(ranks * pool_bytes)} of "
            f"page-locked host RAM together ({_gib(pool_bytes)} each), more than the host can give: "
            f"{booking['room']}{booked} (every rank of this server refuses; lower DSV41_KV_PARK_GIB or free "
            f"host memory)"
        )
    return facts


def report_pinned(*, group: str | None = None, owner: int | None = None, ledger: Path | None = None) -> None:
    """This rank's pool is pinned: MemAvailable shows it now, its booking stops counting for others."""
    owner = os.getppid() if owner is None else owner
    group = f"ppid{owner}" if group is None else group
    with _locked(default_ledger() if ledger is None else ledger) as groups:
        booking = groups.get(group)
        if booking is not None:
            booking["pinned"] = min(int(booking["ranks"]), int(booking.get("pinned", 0)) + 1)
