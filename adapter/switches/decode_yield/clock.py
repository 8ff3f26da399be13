"""Decode yield's one clock: the time each scheduler pass enters ``get_next_batch_to_run``. The
interval to the next is one iteration (the forward of the batch the pass chose, its result, the next
receive); samples are medians of the last :data:`SAMPLES` (robust to one descheduled iteration)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

now = time.perf_counter_ns  # the switch's clock (ns); tests script it
SAMPLES = 3
FRESH_CYCLES = 8  # windows a step alone stays fresh: a machine's speed moves within seconds


def median(samples: deque[int]) -> int | None:  # of a deque of the last SAMPLES (the upper of two)
    return sorted(samples)[len(samples) // 2] if samples else None


@dataclass(frozen=True)
class Tick:  # the iteration that just ended
    took: int  # ns (0 on the first pass)
    window: bool  # a decode step a window gave (its pass deferred prefill)


class PassClock:
    """One scheduler's (one rank's) pass stamps and the samples taken from them."""

    def __init__(self, overlap: bool) -> None:
        self.need_run = 3 if overlap else 2  # decode iterations in a row before one is a step alone
        self.alone, self.any_step = deque[int](maxlen=SAMPLES), deque[int](maxlen=SAMPLES)
        self._prefills: deque[tuple[int, int]] = deque(maxlen=SAMPLES)  # (ns, tokens) of the last prefill passes
        self.cycle_per_token, self.alternation = deque[int](maxlen=SAMPLES), deque[int](maxlen=SAMPLES)  # from close()
        self.windows, self._alone_at = 0, -FRESH_CYCLES - 1  # windows armed so far; their count at the last step alone
        self.entered: int | None = None  # when the current pass entered
        self._run = self._prefill = 0  # decode iterations in a row to the pass that just entered; its prefill tokens
        self.deferred = False  # set by the defer hook: the pass that just entered is a window's step

    def on_pass(self, t: int) -> Tick:
        took = t - self.entered if self.entered is not None else 0
        tick = Tick(took, self.deferred)
        if took and self._prefill:
            self._prefills.append((took, self._prefill))
        elif took and self._run > 0:
            self.any_step.append(took)
            if self._run >= self.need_run:  # a step alone (not the first after a chunk: it pays the alternation)
                # after a stale gap the samples before it are another speed's: a probe's sample replaces
                # them, unless slower than the recent steps (a descheduled step only joins the median)
                if not self.fresh() and took <= (median(self.any_step) or took):
                    self.alone.clear()
                self.alone.append(took)
                self._alone_at = self.windows
        self.entered, self.deferred = t, False
        return tick

    def ran(self, decode: bool, prefill_tokens: int) -> None:
        """What the pass that just entered chose."""
        self._run = self._run + 1 if decode else 0
        self._prefill = prefill_tokens

    def per_token_ns(self) -> int | None:
        """Prefill time per token (a ratio of sums: a one-token pass's fixed cost is no chunk token's)."""
        tokens = sum(n for _, n in self._prefills)
        return sum(t for t, _ in self._prefills) // tokens if tokens else None

    def fresh(self) -> bool:
        """A step alone taken in the last :data:`FRESH_CYCLES` windows (windows of 0-1 step take none)."""
        return bool(self.alone) and self.windows - self._alone_at <= FRESH_CYCLES

    def step_ns(self) -> int | None:
        """The streams' step alone, or any recent decode step when no step alone is fresh."""
        return median(self.alone) if self.fresh() else (median(self.any_step) or median(self.alone))
