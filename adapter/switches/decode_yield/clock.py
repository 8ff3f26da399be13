"""Decode yield's one clock: the scheduler's own passes.

Every pass stamps the time it enters ``get_next_batch_to_run``; the interval to the next stamp is
one iteration of the loop (the forward of the batch the pass chose, its result, the next receive).
Every sample the switch uses comes from these intervals, each the median of the last
:data:`SAMPLES`, robust to one descheduled iteration:

* the streams' *step alone*: a decode iteration after decode iterations (2 in a row in the normal
  loop, 3 in the overlap loop, whose pass waits on the batch before); the first step after a chunk
  costs more (the alternation, charged to the prompt's side) and is left out. Fresh only while
  taken in the last :data:`FRESH_CYCLES` windows: a machine's speed moves within seconds, and
  windows of 0-1 step give none (then any recent decode step stands in, and the decision plans
  a probe that refreshes it);
* *prefill per token*: a prefill iteration's time over its tokens (the backlog's stock rate);
* *a cycle's overhead per chunk token* (a chunk and its window less the window's wall time) and
  *the alternation* (a window's wall time beyond its steps alone: the first step after a chunk
  pays it), both fed by :func:`decision.close` when a window is served.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

now = time.perf_counter_ns  # the switch's clock (ns); tests script it
SAMPLES = 3
FRESH_CYCLES = 8


class Median:
    """The median of the last :data:`SAMPLES` integers."""

    __slots__ = ("samples",)

    def __init__(self) -> None:
        self.samples: deque[int] = deque(maxlen=SAMPLES)

    def add(self, value: int) -> None:
        self.samples.append(value)

    def value(self) -> int | None:
        return sorted(self.samples)[len(self.samples) // 2] if self.samples else None


@dataclass(frozen=True)
class Tick:
    """The iteration that just ended: what its pass chose and how long it took."""

    took: int  # ns (0 on the first pass)
    decode: bool  # a decode batch
    window: bool  # ... that a window gave (its pass deferred prefill)
    alone: bool  # ... after decode iterations: a sample of the step alone
    prefill_tokens: int  # a prefill batch of this many tokens (0: none)


class PassClock:
    """The pass stamps of one scheduler (one rank) and the samples taken from them."""

    def __init__(self, overlap: bool) -> None:
        self.need_run = 3 if overlap else 2  # decode iterations in a row before one is a step alone
        self.alone, self.any_step, self.per_token = Median(), Median(), Median()
        self.cycle_per_token, self.alternation = Median(), Median()  # fed by decision.close
        self.windows = 0  # windows armed so far, and the count when the last step alone came
        self._alone_at = -FRESH_CYCLES - 1
        self._last: int | None = None
        self._run = 0  # decode iterations in a row, ending with the pass that just entered
        self._prefill = 0
        self.deferred = False  # set by the defer hook: the pass that just entered is a window's step

    def on_pass(self, t: int) -> Tick:
        took = t - self._last if self._last is not None else 0
        tick = Tick(took, self._run > 0, self.deferred, self._run >= self.need_run, self._prefill)
        if took and self._prefill:
            self.per_token.add(took // self._prefill)
        elif took and tick.decode:
            self.any_step.add(took)
            if tick.alone:
                # after a stale gap the samples before it are another speed's: a probe's sample replaces
                # them, unless slower than the recent steps (a descheduled step only joins the median)
                if not self.fresh() and took <= (self.any_step.value() or took):
                    self.alone.samples.clear()
                self.alone.add(took)
                self._alone_at = self.windows
        self._last, self.deferred = t, False
        return tick

    def ran(self, decode: bool, prefill_tokens: int) -> None:
        """What the pass that just entered chose."""
        self._run = self._run + 1 if decode else 0
        self._prefill = prefill_tokens

    def fresh(self) -> bool:
        return bool(self.alone.samples) and self.windows - self._alone_at <= FRESH_CYCLES

    def step_ns(self) -> int | None:
        """The streams' step alone, or any recent decode step when no step alone is fresh."""
        if self.fresh():
            return self.alone.value()
        return self.any_step.value() or self.alone.value()
