"""Pins of the upstream functions the test builders reproduce instead of calling: data and one check.

``build_scheduler`` makes a real ``Scheduler`` with ``object.__new__`` and sets only the attributes
its scheduling path reads, i.e. it stands in for ``Scheduler.__init__``. When that source drifts, the
builder may leave out something the new scheduler reads: it refuses, naming the function, instead
of building a scheduler that tests something else (hash: ``adapter.core.pins.source_hash``).
"""

from __future__ import annotations

PINS: dict[str, str] = {
    "sglang.srt.managers.scheduler:Scheduler.__init__": (
        "a4a5297acc175a1e447ef64d90243a352db0a1eb5334e58b25e173d1f86ff202"
    ),
}


class BuilderDrifted(RuntimeError):
    """An upstream function a test builder reproduces has drifted from its pin."""


def check_builder_pins() -> None:
    from adapter.core.pins import drifted

    found = drifted(PINS)
    if found:
        raise BuilderDrifted("devkit test builder refused: " + "; ".join(found)
                             + " (re-read it, update devkit/testkit/scheduler.py, then re-pin here)")
