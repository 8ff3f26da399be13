"""What kv_park did with each retraction, read back from its DEBUG log lines (``DSV41_DEBUG_LOG=1``).

At the retraction, every release of a running row logs one line: ``parked`` (``outcome=queued|saved``;
``outcome=refused``: the store would not take it) or ``not_parked reason=..``. At the re-admission
pass a parked row logs ``restored`` or ``dropped reason=..``, and a row the tree held in full logs
``resumed_from_tree`` (its pages pinned until the admission) or ``dropped
reason=prefix_gone_from_the_tree``. :func:`retraction_split` counts them, so a soak or a test can
print where the retractions went.

Importing this module imports no SGLang.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

_LINE = re.compile(r"\[dsv41\] kv_park (parked|not_parked|restored|resumed_from_tree|dropped)\b(.*)")
_FIELD = re.compile(r"\b(reason|outcome|tokens|cached)=(\S+)")


def retraction_split(lines: Iterable[str]) -> dict[str, object]:
    """``{"retractions", "parked", "not_parked": {reason: n}, "restored", "resumed_from_tree",
    "dropped": {reason: n}, "tokens_restored", "tokens_resumed_from_tree"}`` from a server log's lines
    (``retractions`` = parked + not parked; ``tokens_restored``: the tokens the restores wrote back
    past what the tree still held, ``tokens=`` less ``cached=``, which the request did not recompute;
    ``tokens_resumed_from_tree``: the tokens of the rows the tree held, pinned until admission)."""
    parked = restored = resumed = tokens_restored = tokens_resumed = 0
    not_parked: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    for line in lines:
        m = _LINE.search(line)
        if m is None:
            continue
        what, rest = m.group(1), m.group(2)
        fields = dict(_FIELD.findall(rest))
        if what == "parked":
            if fields.get("outcome") == "refused":
                not_parked["refused_by_the_store"] += 1
            else:
                parked += 1
        elif what == "not_parked":
            not_parked[fields.get("reason", "?")] += 1
        elif what == "restored":
            restored += 1
            tokens_restored += int(fields.get("tokens", 0)) - int(fields.get("cached", 0))
        elif what == "resumed_from_tree":
            resumed += 1
            tokens_resumed += int(fields.get("tokens", 0))
        else:
            dropped[fields.get("reason", "?")] += 1
    return {
        "retractions": parked + sum(not_parked.values()),
        "parked": parked,
        "not_parked": dict(not_parked.most_common()),
        "restored": restored,
        "resumed_from_tree": resumed,
        "dropped": dict(dropped.most_common()),
        "tokens_restored": tokens_restored,
        "tokens_resumed_from_tree": tokens_resumed,
    }


def describe(split: dict[str, object]) -> str:
    """One line for a report: ``219 retractions: 16 parked, 203 not parked (window_below_..: 190, ..);
    at re-admission 12 restored (4096 tokens not recomputed), 3 resumed from the tree (768 tokens), 1
    dropped (..)``."""

    def reasons(counts: object) -> str:
        items = dict(counts).items()  # type: ignore[call-overload]
        return f" ({', '.join(f'{k}: {v}' for k, v in items)})" if items else ""

    not_parked = sum(dict(split["not_parked"]).values())  # type: ignore[call-overload]
    dropped = sum(dict(split["dropped"]).values())  # type: ignore[call-overload]
    return (f"{split['retractions']} retractions: {split['parked']} parked, {not_parked} not parked"
            f"{reasons(split['not_parked'])}; at re-admission {split['restored']} restored "
            f"({split.get('tokens_restored', 0)} tokens not recomputed), {split['resumed_from_tree']} resumed from "
            f"the tree ({split.get('tokens_resumed_from_tree', 0)} tokens), {dropped} dropped{reasons(split['dropped'])}")
