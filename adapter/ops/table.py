"""The one plain-text table every command prints (``check``, ``pins``, the benchmarks): a header, a
rule under it, columns two spaces apart, cells right-aligned (numbers line up) or left-aligned."""

from __future__ import annotations

from collections.abc import Sequence

ALIGNS = ("right", "left")


def render(header: Sequence[object], rows: Sequence[Sequence[object]], align: str = "right") -> str:
    """The table as one string (no trailing newline); each cell is ``str()`` of its value."""
    if align not in ALIGNS:
        raise ValueError(f"align={align!r} is invalid: expected one of {', '.join(ALIGNS)}")
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    pad = str.rjust if align == "right" else str.ljust
    lines = ["  ".join(pad(c, w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
