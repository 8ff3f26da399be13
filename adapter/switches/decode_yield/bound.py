"""Decode yield's bound on the prompts: no window holds a prompt beyond what the share allows it.

**What the share means with many prompts in flight.** ``pct`` is the streams' share of the wall
time *of all prefill work*: of every span in which some prompt waits (queued or chunked), not of
one prompt's chunks alone. The stock scheduler runs prefill first, so every step a window gives
the streams delays *every* prompt then waiting, the chunked one and each one queued behind it
(a window defers the whole next prefill batch). Over one backlog (from the moment a prompt is
waiting until none is) the prefill schedule therefore runs behind stock's by the **lag** ``L``:
the window time given since the backlog began, and a prompt whose first token comes at ``T``
(from its arrival) would have had it stock at ``T - L`` at the earliest. Its TTFT stays within
``1 / (1 - pct)`` of stock's exactly when ``L <= pct * T``. The bound is enforced for the prompt
that binds it, the one that has waited least (``L`` is common to all, ``T`` smallest), as::

    allowed(D) :  L + D  <=  pct/100 * (w + D + R)           D: the next window's time
    =>  D  <=  (pct * (w + R) - 100 * L) / (100 - pct)

with ``w`` that prompt's wait so far and ``R`` the chunked prompt's own prefill still to run (its
tokens left, this chunk's included, at the measured time per chunk token), which every waiting
prompt is behind. A window is cut to ``ceil(D / step)`` steps: at most one step beyond the bound,
and a prompt that arrives during a window waits that window out (the bound's "plus at most one
window"). ``L`` is reset when no prompt waits; it only grows while one does, so a backlog that
outlasts what the share allows (arrivals faster than ``1 - pct`` of the prefill rate, a burst)
cuts windows until it clears: the streams get less than ``pct`` and the switch says so (the
``burst`` line, once per backlog, and the window line's ``cut``; metrics
``dsv41_decode_yield_bursts_total``, ``..._steps_cut_total``). A cut window carries no debt: the
closed loop's balance is not allowed to repay it later as a longer window.

Which prompt arrived when: each prompt is stamped when a window is first armed while it waits (the
waiting queue is read once per arming, never per pass), so a prompt that arrived mid-window is
stamped after it: its wait is understated, which only cuts more. The clock is the scheduler's
pass stamps (:func:`adapter.switches.decode_yield.controller.now`); under tensor parallelism rank
0's bound is the one broadcast with ``N`` (:mod:`adapter.switches.decode_yield.agreement`).
"""

from __future__ import annotations

from typing import Any

from adapter.switches.decode_yield.controller import Recent

CHUNK_SAMPLES = 5  # the median time per chunk token over this many prefill passes
BURST_LOG_S = 10  # at most one ``burst`` line this often (the metric counts every backlog)


class Bound:
    """The lag ledger of one scheduler (one rank)."""

    __slots__ = ("_burst_logged", "_decode", "_last_t", "_prefill_tokens", "_window_step", "bursting", "lag", "pct",
                 "per_token", "stamps", "step")

    def __init__(self, pct: int):
        self.pct = pct
        self.lag = 0  # ns of window steps since the backlog began
        self.stamps: dict[int, tuple[Any, int]] = {}  # id(req) -> (req, first seen waiting at an arming)
        self.per_token = Recent(CHUNK_SAMPLES)  # ns per token of a prefill pass
        self.step = Recent(CHUNK_SAMPLES)  # ns of a decode pass (model mode has no step alone of its own)
        self.bursting = False  # a window of this backlog was cut (the burst line was logged)
        self._last_t: int | None = None
        self._burst_logged: int | None = None  # when the last burst line was logged
        self._window_step = False  # the pass that just ran was a step a window gave
        self._prefill_tokens = 0  # the pass that just ran was a prefill of this many tokens
        self._decode = False  # the pass that just ran was a decode step

    def on_pass(self, t: int, backlog: bool) -> None:
        """A pass entered at ``t``; ``backlog``: a prompt waits (queued or chunked)."""
        if self._last_t is not None:
            took = t - self._last_t
            if self._window_step:
                # at most a typical decode step: what a step right after a chunk costs beyond it is
                # the alternation, which the share charges to the prompt's side (controller.py)
                typical = self.step.value()
                self.lag += min(took, typical) if typical else took
            if self._prefill_tokens:
                self.per_token.add(took // self._prefill_tokens)
            elif self._decode:
                self.step.add(took)
        self._last_t = t
        self._window_step = self._decode = False
        self._prefill_tokens = 0
        if not backlog and (self.lag or self.stamps):
            self.lag, self.bursting = 0, False
            self.stamps.clear()

    def log_burst(self, t: int) -> bool:
        """Whether the burst seen at ``t`` gets a line (none in the last :data:`BURST_LOG_S`)."""
        if self._burst_logged is not None and t - self._burst_logged < BURST_LOG_S * 10**9:
            return False
        self._burst_logged = t
        return True

    def ran(self, prefill_tokens: int, decode: bool) -> None:
        """What the pass that just entered runs: a prefill of that many tokens, or a decode step."""
        self._prefill_tokens = prefill_tokens
        self._decode = decode

    def window_step(self) -> None:
        """The pass that just entered defers prefill: its decode step is one a window gives."""
        self._window_step = True

    def allowed(self, t: int, waiting: Any, chunked: Any, tokens_left: int, step_ns: int | None) -> int | None:
        """The most steps the window armed at ``t`` may give (None: no bound yet, nothing measured).

        ``waiting``: the scheduler's waiting queue; ``chunked``: the chunked prompt; ``tokens_left``:
        its tokens still to prefill, this chunk's included; ``step_ns``: the streams' step."""
        stamps = {}
        first = None
        queued = 0  # the waiting prompts' tokens, prefix hits not known yet: at most their prefill
        for req in (chunked, *waiting):
            if req is not chunked:
                queued += len(req.origin_input_ids) + len(req.output_ids)
                if req.output_ids:  # a retracted stream re-prefills: its first token came long ago
                    continue
            key = id(req)
            seen = self.stamps.get(key)
            stamp = seen[1] if seen is not None and seen[0] is req else t
            stamps[key] = (req, stamp)
            first = stamp if first is None else max(first, stamp)
        self.stamps = stamps
        per_token = self.per_token.value() or 0
        rest = tokens_left * per_token
        if per_token:
            # stock's backlog is ours less the lag; once ours is no larger than the lag, stock's
            # would be empty and ours has been catching up since: the lag is at most our backlog
            self.lag = min(self.lag, rest + queued * per_token)
        step_ns = step_ns or self.step.value()
        if not step_ns:
            return None
        wait = t - (first if first is not None else t)
        room = self.pct * (wait + rest) - 100 * self.lag
        if room <= 0:
            return 0
        return -(-room // ((100 - self.pct) * step_ns))
