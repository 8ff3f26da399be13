"""Decode yield's bound on the prompts: no window holds a prompt beyond what the share allows it.

**What the share means with many prompts in flight.** ``pct`` is the streams' share of the wall
time *of all prefill work*: of every span in which some prompt waits (queued or chunked), not of
one prompt's chunks alone. The stock scheduler runs prefill first, so every step a window gives
the streams delays *every* prompt then waiting, the chunked one and each one queued behind it
(a window defers the whole next prefill batch). Over one backlog (from the moment a prompt is
waiting until none is) the prefill schedule therefore runs behind stock's by the **lag** ``L``:
the window time given since the backlog began, each step counted at most the streams' step alone
(the closed loop's; a typical decode step in model mode): what a step right after a chunk costs
beyond it is the alternation, which the share charges to the prompt's side. ``L`` is at most our
backlog's prefill still to run: once ours is no larger than the lag, stock's would be empty.

**Each prompt's lag.** A prompt pays the lag it *found* on arrival (``L`` then, at most the prefill
ahead of it: stock would have served what is ahead of it by then) plus every window step given
while it waits. Whose first token comes at ``T`` (from its arrival) would have had it stock at
``T - lag`` at the earliest, so its TTFT stays within ``1 / (1 - pct)`` of stock's exactly when
``lag <= pct * T``. That holds the chunked prompt to its own bound too (its lag: every window
step since it began waiting): in measured mode the closed loop's share keeps it there, and in
model mode a mis-fitted model's windows are cut once it would pass it. Each prompt is stamped
(its arrival, the lag it found, the window time given so far) on the first pass that sees it
waiting while the backlog has a lag, and otherwise at the first window armed while it waits. A
window is cut so that no waiting prompt's bound is passed::

    allowed(D) :  lag_i + D  <=  pct/100 * (w_i + D + R)   for every waiting prompt i
    =>  D  <=  min_i (pct * (w_i + R) - 100 * lag_i) / (100 - pct)

with ``w_i`` its wait so far and ``R`` the chunked prompt's own prefill still to run (its tokens
left, this chunk's included, at the measured time per chunk token), which every waiting prompt is
behind. A window is cut to ``ceil(D / step)`` steps: at most one step beyond the bound, and a
prompt that arrives during a window waits that window out (the bound's "plus at most one window").

**A prompt that arrives into a lagged backlog** finds a lag no window of its own added. While
that lag is within ``pct`` of its time (enough of the backlog still ahead of it) the cut above
keeps its bound. Where it is not (it arrives near the backlog's end, when stock would have served
it at once), nothing a later window does can undo it, and the prompt cannot be let go first: the
engine admits a waiting prompt into a pass beside the chunked prompt's chunk only whole, within
the chunk budget, and tracks one chunked prompt at a time (``PrefillAdder`` refuses a second one
that needs chunking), so a prompt a chunk long or longer cannot overtake within a pass (on
``bench_serving``'s chat traffic at a 64-token chunk every turn's new part is at least a
64-token question); giving it the whole pass would need a pass with the chunked prompt
unscheduled, which the engine's per-pass stash and merge of ``chunked_req`` does not allow. SGLang's own
``--schedule-policy shortest-prefill-first`` reserves chunk budget for waiting prompts shorter
than it; this switch does not change the policy. So such a prompt is a burst the share cannot
bound: its room is negative, so no window is given while it waits (it pays what it found and
nothing more), and when its first token comes past its bound (its lag beyond ``pct`` of its TTFT
plus ``1 - pct`` of the backlog's longest window) it is counted: an ``unbounded`` line (at most
one per :data:`BURST_LOG_S`) and ``dsv41_decode_yield_prompts_unbounded_total`` (every one).

**Which prompts the bound covers**: every prompt whose prefill is stock's (the same cache hits)
and whose found lag is within its share; every other prompt served past it by a lag is counted.
**A cache hit lost while it waits**: when a prompt is stamped, what it could resume from the cache
then is read without touching the cache (:mod:`adapter.switches.decode_yield.cache_hit`); when it
is served, the tokens of that read it did not get (its ``cached_tokens`` below it) are prefill
stock need not have run, and their time (at the measured time per chunk token) is added to its
lag, so a prompt past its bound by them is counted, its line carrying ``lost_hit_tokens``. A
window does not age a waiting prompt's prefix in the LRU: a deferred pass runs the policy over the
waiting queue as a stock pass does (switch.py). Not covered and not counted: a prefix lost
*before* the prompt is first seen waiting (an idle conversation's resume point evicted at another
moment than stock's, windows interleaving decode steps with chunks and rows finishing at other
times): nothing in the run says what stock's cache would have held then. Under pool pressure the
count can also include a prompt stock would have held as long (admission waiting for the pool in
both, or a hit the pool would have evicted in stock too): stock's backlog is taken as ours less
the lag.

``L`` only grows while a prompt waits, so a backlog that outlasts what the share allows (arrivals
faster than ``1 - pct`` of the prefill rate, a burst) cuts windows until it clears: the streams
get less than ``pct`` and the switch says so (the ``burst`` line, once per backlog, and the window
line's ``cut``; metrics ``dsv41_decode_yield_bursts_total``, ``..._steps_cut_total``). A cut window
carries no debt: the closed loop's balance is not allowed to repay it later as a longer window.

Reading the waiting queue: at each arming, and on every pass only while the backlog has a lag (to
stamp arrivals); a prompt the pass that just ran prefilled is weighed on the next pass (its first
token's time). The clock is the scheduler's pass stamps
(:func:`adapter.switches.decode_yield.controller.now`); under tensor parallelism rank 0's bound is
the one broadcast with ``N`` (:mod:`adapter.switches.decode_yield.agreement`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapter.switches.decode_yield.controller import Recent

CHUNK_SAMPLES = 5  # the median time per chunk token over this many prefill passes
BURST_LOG_S = 10  # at most one ``burst`` line this often (the metric counts every backlog)


class Bound:
    """The lag ledger of one scheduler (one rank)."""

    __slots__ = ("_decode", "_last_t", "_logged", "_prefill_tokens", "_served", "_window_ns", "_window_step",
                 "bursting", "given", "lag", "late", "longest", "pct", "per_token", "resumable", "stamps", "step")

    def __init__(self, pct: int, resumable: Callable[[Any], int] | None = None):
        self.pct = pct
        # what a waiting prompt could resume from the prefix cache now (cache_hit.py; None: not readable)
        self.resumable = resumable
        self.lag = 0  # ns of window steps since the backlog began (at most the backlog)
        self.given = 0  # ns of window steps since the backlog began, never capped (what a prompt pays after its stamp)
        self.longest = 0  # ns: the longest window of this backlog (the bound's "one window")
        # id(req) -> (req, when first seen waiting, the lag it found then, ``given`` then, its cache hit then)
        self.stamps: dict[int, tuple[Any, int, int, int, int | None]] = {}
        self.per_token = Recent(CHUNK_SAMPLES)  # ns per token of a prefill pass
        self.step = Recent(CHUNK_SAMPLES)  # ns of a decode pass (model mode has no step alone of its own)
        self.bursting = False  # a window of this backlog was cut (the burst line was logged)
        self.late = 0  # prompts served beyond their bound since the boot (the ``unbounded`` lines' count)
        self._last_t: int | None = None
        self._logged: dict[str, int] = {}  # when the last line of each kind (burst, unbounded) was logged
        self._window_step = False  # the pass that just ran was a step a window gave
        self._window_ns = 0  # the open window's steps so far
        self._prefill_tokens = 0  # the pass that just ran was a prefill of this many tokens
        self._decode = False  # the pass that just ran was a decode step
        # the prompts the pass that just ran prefilled: (req, stamp time, found, given, cache hit lost since)
        self._served: list[tuple[Any, int, int, int, int]] = []

    def on_pass(self, t: int, chunked: Any, waiting: Any,
                step_alone: int | None = None) -> list[tuple[int, int, int]]:
        """A pass entered at ``t`` with ``chunked`` (the chunked prompt or None) and ``waiting`` (the
        waiting queue); ``step_alone``: the streams' step alone where the closed loop measures it.
        Returns ``(lag, ttft, lost)`` (ns, ns, tokens) of each prompt whose first token the pass
        before gave beyond its bound (:meth:`unbounded`): a lag it inherited, or a cache hit lost
        while it waited."""
        if self._last_t is not None:
            took = t - self._last_t
            if self._window_step:
                # at most the streams' step alone (else a typical decode step): what a step right
                # after a chunk costs beyond it is the alternation, which the share charges to the
                # prompt's side (controller.py)
                typical = step_alone or self.step.value()
                given = min(took, typical) if typical else took
                self.lag += given
                self.given += given
                self._window_ns += given
            elif self._window_ns:
                self.longest = max(self.longest, self._window_ns)
                self._window_ns = 0
            if self._prefill_tokens:
                self.per_token.add(took // self._prefill_tokens)
            elif self._decode:
                self.step.add(took)
        self._last_t = t
        self._window_step = self._decode = False
        self._prefill_tokens = 0
        late = [found for served in self._served if (found := self.unbounded(t, served)) is not None]
        self._served = []
        self.late += len(late)
        if chunked is None and not waiting:
            if self.lag or self.stamps or self.given:
                self.lag = self.given = self.longest = self._window_ns = 0
                self.bursting = False
                self.stamps.clear()
        elif self.lag and waiting:
            # the backlog runs behind stock's: a prompt arriving now finds that lag, so it is
            # stamped on arrival (once a pass, and only while there is a lag to find)
            self._stamp_arrivals(t, chunked, waiting)
        return late

    def unbounded(self, t: int, served: tuple[Any, int, int, int, int]) -> tuple[int, int, int] | None:
        """``(lag, ttft, lost)`` when the prompt ``served`` got its first token at ``t`` beyond
        ``1 / (1 - pct)`` of its stock TTFT plus the backlog's longest window: its lag (what it found
        on arrival, what was given since, and the prefill of ``lost`` cache-hit tokens it lost while
        waiting) exceeds ``pct`` of its TTFT by more than ``1 - pct`` of that window. None: within
        its bound."""
        _, stamp, found, given, lost = served
        lag = found + self.given - given + lost * (self.per_token.value() or 0)
        ttft = t - stamp
        window = max(self.longest, self._window_ns)
        if 100 * lag > self.pct * ttft + (100 - self.pct) * window:
            return lag, ttft, lost
        return None

    def _stamp_arrivals(self, t: int, chunked: Any, waiting: Any) -> None:
        per_token = self.per_token.value() or 0
        ahead = 0  # tokens the prompt finds ahead of it: the chunked prompt's rest, the queue before it
        if chunked is not None:
            ahead = len(chunked.origin_input_ids) - (chunked.extend_end or chunked.prefix_len)
        stamps = self.stamps
        for req in waiting:
            seen = stamps.get(id(req))
            if (seen is None or seen[0] is not req) and not req.output_ids:
                stamps[id(req)] = self._stamp(req, t, ahead * per_token)
            ahead += len(req.origin_input_ids) + len(req.output_ids) - req.prefix_len

    def _stamp(self, req: Any, t: int, ahead_ns: int, queued: bool = True) -> tuple[Any, int, int, int, int | None]:
        """A prompt first seen waiting at ``t`` with ``ahead_ns`` of prefill ahead of it: the lag it
        finds is at most that (stock would have served what is ahead of it by then); and, still
        ``queued`` (not the chunked prompt, whose own chunks are in the tree), what it could resume
        from the cache then."""
        hit = self.resumable(req) if queued and self.resumable is not None else None
        return req, t, min(self.lag, ahead_ns), self.given, hit

    def log_line(self, what: str, t: int) -> bool:
        """Whether the ``what`` line (burst, unbounded) seen at ``t`` gets logged (none in the last
        :data:`BURST_LOG_S`; the metric counts each)."""
        last = self._logged.get(what)
        if last is not None and t - last < BURST_LOG_S * 10**9:
            return False
        self._logged[what] = t
        return True

    def ran(self, prefill_tokens: int, decode: bool, reqs: Any = (), chunked: Any = None) -> None:
        """What the pass that just entered runs: a prefill of that many tokens (``reqs``, of which
        all but ``chunked`` get their first token from it), or a decode step."""
        self._prefill_tokens = prefill_tokens
        self._decode = decode
        if prefill_tokens and self.stamps:
            for req in reqs:
                seen = self.stamps.get(id(req))
                if seen is not None and seen[0] is req and req is not chunked:
                    _, since, found, given, hit = self.stamps.pop(id(req))
                    # its cache hit, counted once at its first chunk's admission (before this pass)
                    lost = max(0, hit - req.cached_tokens) if hit is not None else 0
                    self._served.append((req, since, found, given, lost))

    def window_step(self) -> None:
        """The pass that just entered defers prefill: its decode step is one a window gives."""
        self._window_step = True

    def allowed(self, t: int, waiting: Any, chunked: Any, tokens_left: int, step_ns: int | None) -> int | None:
        """The most steps the window armed at ``t`` may give (None: no bound yet, nothing measured).

        ``waiting``: the scheduler's waiting queue; ``chunked``: the chunked prompt; ``tokens_left``:
        its tokens still to prefill, this chunk's included; ``step_ns``: the streams' step."""
        per_token = self.per_token.value() or 0
        rest = tokens_left * per_token
        stamps = {}
        queued = 0  # the waiting prompts' tokens, prefix hits not known yet: at most their prefill
        room = None  # the least room of a waiting prompt (its share of its time so far, less its lag)
        for req in (chunked, *waiting):
            ahead = 0
            if req is not chunked:
                ahead = tokens_left + queued
                queued += len(req.origin_input_ids) + len(req.output_ids)
                if req.output_ids:  # a retracted stream re-prefills: its first token came long ago
                    continue
            key = id(req)
            seen = self.stamps.get(key)
            stamp = seen if seen is not None and seen[0] is req else self._stamp(req, t, ahead * per_token,
                                                                                   req is not chunked)
            stamps[key] = stamp
            _, since, found, given, _ = stamp
            # its lag: what it found on arrival and every window step since; its time at least its
            # wait so far and the chunked prompt's rest, which every waiting prompt is behind
            mine = self.pct * (t - since + rest) - 100 * (found + self.given - given)
            room = mine if room is None else min(room, mine)
        self.stamps = stamps
        if per_token:
            # stock's backlog is ours less the lag; once ours is no larger than the lag, stock's
            # would be empty and ours has been catching up since: the lag a prompt arriving now
            # finds is at most our backlog
            self.lag = min(self.lag, rest + queued * per_token)
        step_ns = step_ns or self.step.value()
        if not step_ns:
            return None
        if room is None or room <= 0:
            return 0
        return -(-room // ((100 - self.pct) * step_ns))
