"""What decode yield says, beside its control path: lines, throttles, counts. Every ``burst``, ``guard`` and
``unbounded`` event is counted in the metrics; a line is logged at most once per :data:`LINE_S` per kind (``ctx.tally``
counts the rest); the DEBUG ``window`` line is formatted only when read (``DSV41_DEBUG_LOG`` or metrics)."""

from __future__ import annotations

import logging
from typing import Any

from adapter.core import api
from adapter.switches.decode_yield.backlog import Late
from adapter.switches.decode_yield.decision import Served, Window

LINE_S = 10


class Observer:
    def __init__(self, ctx: Any, pct: int, mode: str):
        self.ctx, self.pct, self.mode, self.debug = ctx, pct, mode, ctx.debug
        self.unbounded = 0  # prompts served past their bound since the boot
        self.bursting = False  # a window of this backlog was cut (one burst per backlog)
        self._logged: dict[str, int] = {}

    def _say(self, what: str, t: int, **fields: Any) -> None:
        last = self._logged.get(what)
        if last is None or t - last >= LINE_S * 10**9:
            self._logged[what] = t
            self.ctx.event(what, **fields)
        else:
            self.ctx.tally(what, **fields)

    def late(self, t: int, late: list[Late], waiting: int) -> None:
        for x in late:
            self.unbounded += 1
            lost = {"lost_hit_tokens": x.lost_tokens} if x.lost_tokens else {}
            self._say("unbounded", t, share=self.pct, lag_ms=round(x.lag_ns / 1e6, 1),
                      ttft_ms=round(x.ttft_ns / 1e6, 1), waiting=waiting, **lost)

    def armed(self, t: int, window: Window, n: int, lag_ns: int, load: int | None, waiting: int) -> None:
        if window.share < self.pct:
            self._say("guard", t, share=self.pct, given=window.share, load=round((load or 0) / 1000, 3),
                      waiting=waiting)
        if window.cut and not self.bursting:
            self.bursting = True
            self._say("burst", t, share=self.pct, lag_ms=round(lag_ns / 1e6, 1), waiting=waiting,
                      planned=n + window.cut, allowed=n)

    def ended(self, opened: Any, given: int, ended: str, served: Served | None) -> None:
        """The DEBUG ``window`` line of an armed window (``opened``, the switch's ``Open``) that ended."""
        if not (self.debug or api.metrics_on()):
            return
        window, load = opened.window, opened.facts.load
        fields: dict[str, Any] = dict(
            mode=self.mode, target=self.pct, chunk=opened.chunk, prefix=opened.prefix, rows=opened.rows, n=opened.n,
            floor=opened.facts.floor, given=given, ended=ended, cut=window.cut or None,
            guard=window.share if window.share < self.pct else None,
            load=None if load is None else round(load / 1000, 3))
        if self.mode == "measured":
            fields.update(source=window.source, step_us=_us(opened.facts.step_ns), overhead_us=_us(window.overhead_ns))
        if served is not None:
            fields.update(share=served.share, prompt_share=served.prompt_share, cycle_us=_us(served.elapsed_ns),
                          streams_us=_us(served.window_ns))
        self.ctx.event("window", level=logging.DEBUG, **{k: v for k, v in fields.items() if v is not None})


def _us(ns: int | None) -> float | None:
    return None if ns is None else round(ns / 1000, 1)
