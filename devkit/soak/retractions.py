"""The soak's retraction table: what kv_park did with each retraction of the profile boot (from
:func:`adapter.switches.kv_park.outcomes.retraction_split`), as printed rows (pure: split in, rows out)."""

from __future__ import annotations

from typing import Any


def table(split: dict[str, Any], sglang_retractions: int | None) -> list[str]:
    """Rows ``what | count``: SGLang's forced retractions, then kv_park's per-row outcome at the
    retraction (parked, not parked by reason) and at re-admission (restored with the tokens not
    recomputed, resumed from the tree, dropped by reason)."""
    rows: list[tuple[str, Any]] = [
        ("SGLang retraction passes (Testing retraction)", sglang_retractions),
        ("rows retracted (kv_park lines)", split["retractions"]),
        ("  parked", split["parked"]),
        *((f"  not parked: {reason}", n) for reason, n in split["not_parked"].items()),
        ("at re-admission: restored", split["restored"]),
        ("  tokens restored, not recomputed", split.get("tokens_restored", 0)),
        ("at re-admission: resumed from the tree", split["resumed_from_tree"]),
        ("  tokens held by the tree, pinned", split.get("tokens_resumed_from_tree", 0)),
        *((f"at re-admission: dropped: {reason}", n) for reason, n in split["dropped"].items()),
    ]
    width = max(len(what) for what, _ in rows)
    return [f"  {what:<{width}}  {'-' if n is None else n:>7}" for what, n in rows]
