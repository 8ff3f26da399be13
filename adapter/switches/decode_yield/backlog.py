"""The prefill backlog as decode yield sees it: the lag its windows added, what each waiting prompt
paid of it, and the rate prefill arrives into it (the load guard's measurement).

A **backlog** runs from the pass that first sees a prompt waiting (queued or chunked) until none
is. Its **lag** is the wall time of every window step given in it, whole (the alternation a step
right after a chunk pays included): stock's prefill schedule would run that much ahead. Stock's
backlog is ours less the lag, so the lag is capped at our backlog's prefill still to run.

Each prompt is stamped when first seen waiting: the lag it *found* (at most the prefill ahead of
it: stock would have served that by then), the windows given so far, and what it could resume from
the cache then (:mod:`.cache_hit`). Its lag is what it found plus every window since; its TTFT is
within ``1 / (1 - pct)`` of stock's while ``lag <= pct * TTFT``. A prompt served past that plus
``1 - pct`` of the backlog's longest window is :class:`Late` (counted: it inherited a lag no
window of its own added, or lost a cache hit while it waited, whose prefill is added to its lag).

**Load** (the guard's): how fast prompts arrive behind a chunked prompt, times the median prefill
time of a prompt (uncached tokens at the measured time per token, the last few arrivals), over the
time a prompt was chunked less its window steps (stock's time); counts and time halved every
:data:`HORIZON_NS` of it, the first :data:`PRIOR_NS` counted as arrival-free. Windows run only
while a prompt is chunked, and every prompt waiting then pays them. A lone long prompt (however
long) is no arrival behind itself: load 0; one huge prompt arriving behind a short one moves the
median little. Poisson arrivals come into a busy period at the same rate as at any other time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapter.switches.decode_yield.clock import Median, Tick
from adapter.switches.decode_yield.decision import Waiting

HORIZON_NS = 4 * 10**9
PRIOR_NS = 500 * 10**6


@dataclass(frozen=True)
class Stamp:
    req: Any
    since: int  # when first seen waiting
    found: int  # ns: the lag it found then
    given: int  # ns: the backlog's window time given before it
    hit: int | None  # tokens it could resume from the cache then (None: not read)


@dataclass(frozen=True)
class Late:
    req: Any
    lag_ns: int
    ttft_ns: int
    lost_tokens: int


class Backlog:
    """The backlog ledger of one scheduler (one rank)."""

    def __init__(self, pct: int, resumable: Callable[[Any], int] | None = None):
        self.pct, self.resumable = pct, resumable
        self.lag = self.given = self.longest = self._window_ns = 0
        self.stamps: dict[int, Stamp] = {}
        self.work = Median()  # a prompt's uncached tokens (the last few arrivals)
        self.arrived = self.busy = 0  # prompts arriving behind a chunked one (x1000); stock's time with one chunked
        self._open = self._chunked = False  # a backlog, a chunked prompt, at the pass before
        self._served: list[tuple[Stamp, int]] = []  # prompts the last pass gave a first token, with lost tokens

    def load(self, per_token: int | None) -> int:
        """Permille: prefill arriving behind a chunked prompt over the prefill rate."""
        return self.arrived * (self.work.value() or 0) * (per_token or 0) // (self.busy + PRIOR_NS)

    def on_pass(self, t: int, tick: Tick, chunked: Any, waiting: Any, per_token: int | None) -> list[Late]:
        """A pass entered at ``t``; returns the prompts the pass before served past their bound."""
        if tick.window:
            self.lag += tick.took
            self.given += tick.took
            self._window_ns += tick.took
        elif self._window_ns:
            self.longest, self._window_ns = max(self.longest, self._window_ns), 0
        if self._chunked:
            self.busy += 0 if tick.window else tick.took
            if self.busy > HORIZON_NS:
                self.arrived, self.busy = self.arrived // 2, self.busy // 2
        late = [x for stamp, lost in self._served if (x := self._late(t, stamp, lost, per_token or 0)) is not None]
        self._served = []
        if chunked is None and not waiting:  # the backlog is over: the next starts with no lag
            self.lag = self.given = self.longest = self._window_ns = 0
            self.stamps.clear()
        else:
            self._stamp_arrivals(t, chunked, waiting, per_token or 0)
        self._open, self._chunked = chunked is not None or bool(waiting), chunked is not None
        return late

    def _stamp_arrivals(self, t: int, chunked: Any, waiting: Any, per_token: int) -> None:
        ahead = len(chunked.origin_input_ids) - (chunked.extend_end or chunked.prefix_len) if chunked else 0
        for req in waiting:
            seen = self.stamps.get(id(req))
            if (seen is None or seen.req is not req) and not req.output_ids:  # retracted streams: not prompts
                # its cache hit, read into a backlog only (a prompt arriving to none is admitted at once)
                hit = self.resumable(req) if self._open and self.resumable is not None else None
                self.stamps[id(req)] = Stamp(req, t, min(self.lag, ahead * per_token), self.given, hit)
                self.work.add(len(req.origin_input_ids) - (hit or 0))
                self.arrived += 1000 if self._chunked else 0
            ahead += len(req.origin_input_ids) + len(req.output_ids) - req.prefix_len

    def _late(self, t: int, stamp: Stamp, lost: int, per_token: int) -> Late | None:
        lag = stamp.found + self.given - stamp.given + lost * per_token
        ttft = t - stamp.since
        window = max(self.longest, self._window_ns)
        if 100 * lag > self.pct * ttft + (100 - self.pct) * window:
            return Late(stamp.req, lag, ttft, lost)
        return None

    def ran(self, reqs: Any, chunked: Any) -> None:
        """The pass that just entered runs a prefill of ``reqs``: all but ``chunked`` get their first token."""
        for req in reqs:
            stamp = self.stamps.get(id(req))
            if stamp is not None and stamp.req is req and req is not chunked:
                del self.stamps[id(req)]
                # its cache hit, counted once at its first chunk's admission (before this pass)
                self._served.append((stamp, max(0, stamp.hit - req.cached_tokens) if stamp.hit is not None else 0))

    def facts(self, t: int, chunked: Any, waiting: Any, tokens_left: int, per_token: int | None
              ) -> tuple[int, tuple[Waiting, ...]]:
        """The bound's facts at an arming pass: the chunked prompt's prefill still to run (ns) and each
        waiting prompt's wait and lag (the chunked prompt included; one not yet seen is stamped now)."""
        per_token = per_token or 0
        rest, queued, found = tokens_left * per_token, 0, []
        for req in (chunked, *waiting):
            if req is not chunked:
                ahead = tokens_left + queued
                queued += len(req.origin_input_ids) + len(req.output_ids)
                if req.output_ids:
                    continue
            else:
                ahead = 0
            stamp = self.stamps.get(id(req))
            if stamp is None or stamp.req is not req:
                hit = self.resumable(req) if req is not chunked and self.resumable is not None else None
                stamp = self.stamps[id(req)] = Stamp(req, t, min(self.lag, ahead * per_token), self.given, hit)
            found.append(Waiting(t - stamp.since, stamp.found + self.given - stamp.given))
        if per_token:  # stock's backlog is ours less the lag: once ours is no larger, stock's is empty
            self.lag = min(self.lag, rest + queued * per_token)
        return rest, tuple(found)
