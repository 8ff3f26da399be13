"""The prefill backlog (docs/switches/decode_yield.md, "The bound"), from a prompt waiting until none
is: the lag its windows added, each waiting prompt's :class:`Stamp`, the load guard's reading. A prompt
served past its bound (lag past ``pct`` of its TTFT plus ``1 - pct`` of the longest window) is :class:`Late`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapter.switches.decode_yield.clock import SAMPLES, Tick, median
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


class Arrivals:
    """The load: prompts first seen waiting while a prompt was chunked, over the wall time one was
    chunked, times a prompt's prefill time (Poisson arrivals find a prompt chunked as often as it is:
    that is the arrival rate). A lone long prompt is no arrival behind itself: load 0."""

    def __init__(self) -> None:
        self.arrived = self.chunked_ns = 0  # prompts x1000, ns
        self._halved: int | None = None

    def passed(self, t: int, took: int, chunked: bool, arrived: int) -> None:  # ``arrived``: first seen now
        halved = t if self._halved is None else self._halved
        # on wall time: light traffic chunks a prompt a few % of the time, a burst a minute ago says nothing
        halvings = min((t - halved) // HORIZON_NS, 62)
        self._halved = halved + halvings * HORIZON_NS
        self.arrived, self.chunked_ns = self.arrived >> halvings, self.chunked_ns >> halvings
        if chunked:  # a window's steps too: prompts arrive in them (else a share s reads 1 / (1 - s) high)
            self.chunked_ns += took
            self.arrived += 1000 * arrived

    def load(self, prompt_ns: int) -> int:
        """Permille; :data:`PRIOR_NS` of arrival-free time shrinks a reading of little time."""
        return self.arrived * prompt_ns // (self.chunked_ns + PRIOR_NS)


class Backlog:
    """The backlog ledger of one scheduler (one rank)."""

    def __init__(self, pct: int, resumable: Callable[[Any], int] | None):
        self.pct, self.resumable = pct, resumable
        self.lag = self.given = self.longest = self._window_ns = 0
        self.stamps: dict[Any, Stamp] = {}  # by request (SGLang's Req hashes by identity)
        self.work = deque[int](maxlen=SAMPLES)  # a prompt's uncached tokens (the last few arrivals)
        self.queued = 0  # uncached tokens queued behind the chunked prompt, at the last arming pass
        self.arrivals = Arrivals()
        self._chunked = False  # a prompt was chunked at the pass before
        self._served: list[tuple[Stamp, int]] = []  # prompts the last pass gave a first token, with lost tokens

    def load(self, per_token: int) -> int:
        """Permille. A burst arrives before any prompt is chunked (no arrival counted) but queues seconds
        of prefill: the queue's prefill over the horizon reads as load too (a lone long prompt: 0)."""
        return max(self.arrivals.load((median(self.work) or 0) * per_token), self.queued * per_token * 1000 // HORIZON_NS)

    def on_pass(self, t: int, tick: Tick, chunked: Any, waiting: Any, per_token: int) -> list[Late]:
        """A pass entered at ``t``; returns the prompts the pass before served past their bound."""
        if tick.window:
            self.lag += tick.took
            self.given += tick.took
            self._window_ns += tick.took
        elif self._window_ns:
            self.longest, self._window_ns = max(self.longest, self._window_ns), 0
        late = []
        for stamp, lost in self._served:  # given their first token by the pass before
            lag = stamp.found + self.given - stamp.given + lost * per_token  # a lost hit's prefill is lag
            ttft = t - stamp.since
            if 100 * lag > self.pct * ttft + (100 - self.pct) * max(self.longest, self._window_ns):
                late.append(Late(stamp.req, lag, ttft, lost))
        self._served, arrived = [], 0
        if chunked is None and not waiting:  # the backlog is over: the next starts with no lag
            self.lag = self.given = self.longest = self._window_ns = 0
            self.stamps.clear()
        ahead = len(chunked.origin_input_ids) - (chunked.extend_end or chunked.prefix_len) if chunked else 0
        for req in waiting:
            if not req.output_ids and req not in self.stamps:  # retracted: no prompt; stamped: arrived before
                self.work.append(len(req.origin_input_ids) - (self._stamp(req, t, ahead * per_token, True).hit or 0))
                arrived += 1
            ahead += len(req.origin_input_ids) + len(req.output_ids) - req.prefix_len
        self.arrivals.passed(t, tick.took, self._chunked, arrived)
        self._chunked = chunked is not None
        return late

    def _stamp(self, req: Any, t: int, ahead_ns: int, queued: bool) -> Stamp:
        """``req``'s stamp, made now if none; a queued prompt's cache hit is read (the chunked one's is in the tree)."""
        if (stamp := self.stamps.get(req)) is None:
            hit = self.resumable(req) if queued and self.resumable is not None else None
            stamp = self.stamps[req] = Stamp(req, t, min(self.lag, ahead_ns), self.given, hit)
        return stamp

    def ran(self, reqs: Any, chunked: Any) -> None:
        """The pass that just entered runs a prefill of ``reqs``: all but ``chunked`` get their first token."""
        for req in reqs:
            if req is not chunked and (stamp := self.stamps.pop(req, None)) is not None:
                # its cache hit, counted once at its first chunk's admission (before this pass)
                self._served.append((stamp, max(0, stamp.hit - req.cached_tokens) if stamp.hit is not None else 0))

    def facts(self, t: int, chunked: Any, waiting: Any, tokens_left: int, per_token: int
              ) -> tuple[int, tuple[Waiting, ...]]:
        """The bound's facts at an arming pass: the chunked prompt's prefill still to run (ns) and each
        waiting prompt's wait and lag (the chunked prompt included; one not yet seen is stamped now)."""
        rest, queued, self.queued = tokens_left * per_token, 0, 0
        stamps = [self._stamp(chunked, t, 0, queued=False)]
        for req in waiting:
            hit = req.prefix_len
            if not req.output_ids:  # a retracted request is no prompt
                stamps.append(stamp := self._stamp(req, t, (tokens_left + queued) * per_token, queued=True))
                hit = max(hit, stamp.hit or 0)  # a prompt not yet matched has prefix_len 0: its hit as read
            size = len(req.origin_input_ids) + len(req.output_ids)
            queued, self.queued = queued + size, self.queued + size - hit
        if per_token:  # stock's backlog is ours less the lag: once ours is no larger, stock's is empty
            self.lag = min(self.lag, rest + queued * per_token)
        return rest, tuple(Waiting(t - s.since, s.found + self.given - s.given) for s in stamps)
