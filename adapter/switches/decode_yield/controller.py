"""Decode yield's closed loop: each window's length from this boot's measured iteration wall times.

The scheduler's own passes are the clock's samples. Every pass stamps the time it enters
``get_next_batch_to_run`` (:func:`now`); the time between two entries is one iteration of the loop
(the forward of the batch the earlier pass chose, its result processing, the next receive).

* **The streams' step alone** (``step_ns``): the median of the last :data:`STEP_SAMPLES` decode
  iterations that followed decode iterations (two in a row in the normal loop, three in the overlap
  loop, whose pass waits on the batch before): the step the streams' rate alone is made of. The
  first decode step after a chunk is left out on purpose: what it costs beyond this is the
  alternation, which the prompt's side pays (below). But only while such a sample is fresh (taken
  in the last :data:`FRESH_CYCLES` cycles): a machine's speed moves within seconds (on the shared
  2-core CPU engine a step took 12 ms, then 50 ms, then 8 ms within one minute) and a stream's step
  grows with its context (the Mellum kit: 5.5 ms at 33 tokens a row, 15 ms at 900). Windows of 0 or
  1 step (a low pct, a cheap chunk) give none, so a window the loop plans at one step while the
  step alone is stale becomes a *probe* of two (three in the overlap loop): its last step is a
  fresh step alone, which replaces the stale samples, and the balance repays the extra step. Until
  then the median of the last decode iterations of any kind (the first after a chunk included)
  stands in. Not per row: a step's fixed part (weights, launch, the scheduler pass) dominates at
  serving batch sizes, and a finished row changes the median within three steps.
* **A cycle** is one non-final chunk and its window: from the pass that runs the chunk to the pass
  that runs the next one. The streams' part of it ``S`` is what their steps alone in the window
  took (each at most :data:`SPIKE` times the step alone before it: a descheduled
  step is not the streams' rate) and their other tokens (the first step after the chunk, whose
  alternation is the prompt's, and a token that rode along in a mixed chunk) at ``step_ns``: the
  window's own steps, not a median taken after them, because the machine's speed moves within a
  window (the DSV4 kit's 2-row step ran 60 ms, then 95 ms, for a second each: a window of 118
  steps valued at the median after it read 1.05 of its cycle). Its wall time ``E`` less ``S`` is
  its **overhead** ``O``: the chunk, the alternation, and whatever else the cycle paid (a competing
  process, a slow chunk). The overhead per chunk token
  (the median of the last :data:`CHUNK_SAMPLES` cycles; per token, so a short first or mixed chunk
  compares, and a chunk whose cost grows with its prefix is followed within a cycle or two)
  times the next chunk's tokens is the next cycle's estimate ``O_est``.
* **The share** of a cycle is what the bench and an operator measure: the streams' tokens at their
  rate alone over the wall time, ``S / E``.
* **The window's second half** (:meth:`Controller.replan`): a window long enough to time its own
  steps (``N`` of at least twice the run a step alone needs: 4 in the normal loop, 6 in the overlap
  loop) is planned again after half its steps, on what its cycle measured so far: the chunk's own
  overhead (the time since the chunk's pass less the streams' part) instead of the estimate, and
  the window's own steps alone instead of the step before it. An estimate's error then costs the
  streams half a window at most, not a whole window that the next one repays (the DSV4 kit's
  windows of 10-65 steps, planned once: their steps took 0.71-1.33 of the plan and their chunks
  0.70-1.16 of the estimate, first to ninth deciles over a pct 50 and a pct 70 boot, so a cycle's
  share swung up to 0.2 either side of pct, and a quarter of the prompt, about four cycles,
  carried its last cycle's swing). Short windows (most of the Mellum kit's, 1-4 steps) are planned once.
  Under tensor parallelism the second half is rank 0's too: a second broadcast for such a window.
* **The closed loop**: ``balance`` holds what the streams got beyond their share over the prompt's
  served cycles, ``sum((100-pct)*S - pct*O)`` (ns, scaled by 100). The
  next window is the smallest ``N`` that brings it back to zero after the next cycle::

      N = ceil((pct*O_est - balance - (100-pct)*rode_along*step_ns) / ((100-pct)*step_ns))

  so rounding is carried (the balance keeps the fraction of a step the last window gave beyond
  its share), a mismeasured or slow cycle is repaid by the next window, and a step change in either
  cost is followed in the estimate and corrected in the share. ``N`` is bounded by the configured
  interval (floor) and the cap; the balance is clamped to one cycle's overhead plus a probe's
  steps either way, so a floor, a cap or a spike never runs up a debt or a credit that later
  windows would pay back for minutes, while the fraction of a step a window rounds up, and a
  probe's extra steps, are carried in full (at pct 20 with a chunk of two steps a one-step window
  gives the share of four cycles). A window that did not give what it planned (streams or prompt gone, ``min_bs``)
  is not a cycle and resets the balance; the estimates live for the boot.

No window follows the prompt's final chunk (its first token does), so the windows before it also
owe the streams their share of that chunk (its tokens at the measured overhead per token): the
share holds over the whole prefill, as a client timing the prompt's TTFT measures it (a 16-chunk
prompt otherwise loses 1/32 of the share at pct 50). The windows of the prompt's last quarter
(:func:`final_span`) pay it in equal parts, so the quarter that holds the final chunk holds its
share, and no single window is planned several chunks long on a step estimate it cannot correct
(the DSV4 kit's last window at pct 50 was 55 steps planned at a 58 ms step the steps then took
84 ms in: 0.96 for that cycle, the last quarter at 0.72). A cycle's own share therefore runs
above pct in the last quarter, by the final chunk's part.

The first windows of a boot have no measurement: with no decode step measured yet the integer cost
model decides the window (:func:`adapter.switches.decode_yield.cost_model.yield_window`); with a step
but no cycle yet, the model's chunk-to-step ratio at that window times the measured step is the
overhead's estimate. The controller reads a clock, so ranks measure differently: under tensor
parallelism rank 0 decides and the others receive its ``N`` (:mod:`adapter.switches.decode_yield.agreement`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

now = time.perf_counter_ns  # the controller's clock (ns); tests script it

STEP_SAMPLES = 5  # the median of this many back-to-back decode iterations is the streams' step alone
CHUNK_SAMPLES = 3  # the median of this many cycles' overhead per chunk token is the next estimate
FRESH_CYCLES = 8  # a step-alone sample older than this many cycles gives way to any recent decode step
SPIKE = 4  # a window's step alone counts for the streams up to this many times the step alone before it


class Recent:
    """The median of the last ``size`` samples (integers): robust to one descheduled iteration."""

    __slots__ = ("samples",)

    def __init__(self, size: int):
        self.samples: deque[int] = deque(maxlen=size)

    def add(self, value: int) -> None:
        self.samples.append(value)

    def value(self) -> int | None:
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        return ordered[len(ordered) // 2]


@dataclass
class Plan:
    """One window's decision and what it was made from (the ``window`` line's fields)."""

    n: int
    source: str  # "measured", "model" (nothing measured), "model_ratio" (a step, no cycle yet)
    step_ns: int | None
    overhead_ns: int | None  # the next cycle's overhead estimate


@dataclass
class Cycle:
    """One cycle as measured when its window was served."""

    elapsed_ns: int
    streams_ns: int  # the streams' tokens at their step alone
    overhead_ns: int
    share: float  # the streams' tokens at their rate alone over the cycle's wall time
    prompt_share: float  # the same over the prompt's served cycles so far


class Controller:
    """The closed loop of one scheduler (one rank): samples, estimates, and the prompt's balance."""

    def __init__(self, pct: int, cap: int):
        self.pct, self.cap = pct, cap
        self.alone = Recent(STEP_SAMPLES)  # decode iterations after decode iterations
        self.any_step = Recent(STEP_SAMPLES)  # every decode iteration, the first after a chunk included
        self._cycles = 0  # windows planned so far, and the count when the last step-alone sample came
        self._alone_at = -FRESH_CYCLES - 1
        self.overhead_per_token = Recent(CHUNK_SAMPLES)  # ps per chunk token
        self.balance = 0
        self.prompt: object | None = None  # the chunked prompt the balance is for
        self._given_ns = 0  # this prompt's served cycles: streams' reference time and wall time
        self._elapsed_ns = 0
        self._windows: int | None = None  # the prompt's windows, counted at its first
        self._final_paid = 0  # thousandths of the final chunk's tokens its windows owed so far
        self._last_t: int | None = None
        self._decode_run = 0  # passes in a row that ran a decode batch (ending with the last one)
        # (t at the chunk's pass, chunk tokens, rode_along, the final chunk's part of its overhead estimate)
        self._cycle: tuple[int, int, int, int] | None = None
        self._need_run = 2  # decode passes in a row before an interval is a step alone (on_pass)
        self._window_steps = self._window_ns = 0  # the open window's steps alone and what they took

    # -- every pass ------------------------------------------------------------------------------
    def on_pass(self, t: int, need_run: int) -> None:
        """A pass entered at ``t``: the interval since the last one is a step alone when the passes
        before it ran ``need_run`` decode batches in a row (2 normal loop, 3 overlap loop)."""
        # any decode pass: the interval right after it (in the overlap loop on a GPU that is the
        # batch before it, possibly a chunk: only a stand-in while no step alone is fresh)
        self._need_run = need_run
        if self._last_t is not None and self._decode_run >= 1:
            self.any_step.add(t - self._last_t)
            if self._decode_run >= need_run:
                sample = t - self._last_t
                # after a stale gap the samples before it are another speed's, and a probe's sample
                # replaces them, unless it is slower than a first step after a chunk (a
                # descheduled step: then it only joins the median)
                fresh = self.fresh()
                # an open window's step counts up to SPIKE steps alone before it (only then: every
                # decode pass comes here, and most open no window)
                reference = self.alone.value() if fresh and self._cycle is not None else None
                if not fresh and sample <= (self.any_step.value() or sample):
                    self.alone.samples.clear()
                self.alone.add(sample)
                self._alone_at = self._cycles
                if self._cycle is not None:  # a step of the open window: what the streams' step took
                    self._window_steps += 1
                    self._window_ns += min(sample, SPIKE * reference) if reference else sample
        self._last_t = t

    def fresh(self) -> bool:
        """A step alone was sampled in the last :data:`FRESH_CYCLES` cycles."""
        return bool(self.alone.samples) and self._cycles - self._alone_at <= FRESH_CYCLES

    def step_ns(self) -> int | None:
        """The streams' step alone, or any recent decode step when no step alone is fresh."""
        if self.fresh():
            return self.alone.value()
        return self.any_step.value() or self.alone.value()

    def ran(self, decode: bool) -> None:
        """What the pass that just entered chose: a decode batch (True) or anything else."""
        self._decode_run = self._decode_run + 1 if decode else 0

    # -- windows ---------------------------------------------------------------------------------
    def plan(self, t: int, prompt: object, tokens: int, rode_along: int, floor: int,
             model_ratio: tuple[int, int], final_tokens: int = 0, windows_left: int = 1) -> Plan:
        """``N`` for the window after the chunk of ``tokens`` tokens this pass runs (at ``t``).
        ``model_ratio``: the integer model's (chunk+switch, step) costs at this window, for the
        first windows of a boot. ``final_tokens``: the prompt's final chunk, of that many tokens,
        comes ``windows_left`` windows from now (1: next); no window follows it (its first token
        does), so the windows of the prompt's last quarter give the streams their share of it in
        equal parts, and the share holds over the whole prefill."""
        from adapter.switches.decode_yield import cost_model

        if prompt is not self.prompt:
            self._reset(prompt)
        self._window_steps = self._window_ns = 0
        if self._windows is None:  # the prompt's first window: how many it has
            self._windows = windows_left
        extra = 0  # this window's part of the final chunk, in thousandths of a token
        if final_tokens and windows_left <= final_span(self._windows):
            extra = (final_tokens * 1000 - self._final_paid) // max(windows_left, 1)
            self._final_paid += extra
        self._cycles += 1
        step = self.step_ns()
        per_token = self.overhead_per_token.value()
        if step is None:
            self._cycle = (t, tokens, rode_along, 0)
            chunk_fs, step_fs = model_ratio
            n, _ = cost_model.yield_window(self.pct, chunk_fs, step_fs, floor, 0, self.cap, rode_along)
            return Plan(n, "model", None, None)
        if per_token is None:
            chunk_fs, step_fs = model_ratio
            overhead, source = step * chunk_fs // max(step_fs, 1), "model_ratio"
            final_part = overhead * extra // max(tokens * 1000, 1)
        else:
            overhead, source = per_token * tokens // 1000, "measured"
            final_part = per_token * extra // 1_000_000
        # the cycle owes the streams their share of its part of the final chunk too (served)
        self._cycle = (t, tokens, rode_along, final_part)
        overhead += final_part
        rest = 100 - self.pct
        owed = self.pct * overhead - self.balance - rest * rode_along * step
        need = max(0, -(-owed // (rest * step)))
        if 0 < need < self._need_run and not self.fresh():
            # a probe: windows of one step give no step alone, and the first step after a chunk
            # costs more (the alternation); a window long enough to hold one keeps the reference
            # fresh, and the balance repays the extra step over the next windows
            need = self._need_run
        return Plan(max(floor, min(self.cap, need)), source, step, overhead)

    def replan_at(self, n: int) -> int | None:
        """After how many of a window's ``n`` planned steps its rest is planned again
        (:meth:`replan`): half of it, once its steps hold a step alone of their own (the first
        ``need_run - 1`` after the chunk are not); None for a window too short to hold one."""
        half = n // 2
        return half if half >= self._need_run else None

    def replan(self, t: int, given: int) -> int | None:
        """The steps the open window still gives, planned again at ``t`` after ``given`` steps on
        what the cycle measured so far: its chunk's own overhead (the time since the chunk's pass
        less the streams' part) instead of the estimate, and the mean of the window's own steps
        alone instead of the step before it for the steps still to give. The balance of
        :meth:`served` then closes at the cycle's end if the rest of the steps run as the first
        did. None when the window timed no step."""
        if self._cycle is None or not self._window_steps:
            return None
        start, _, rode_along, final_part = self._cycle
        own = self._window_ns // self._window_steps  # what its steps take: the rest as the first
        # its untimed tokens as served() values them, so the balance it closes is served()'s
        got = self._streams_ns(given + rode_along, self.step_ns() or own)
        overhead = max(0, t - start - got)
        rest = 100 - self.pct
        owed = self.pct * (overhead + final_part) - self.balance - rest * got
        return max(0, -(-owed // (rest * own)))

    def served(self, t: int, given: int) -> Cycle | None:
        """The window of the last plan gave ``given`` steps and the next chunk runs at ``t``."""
        if self._cycle is None:
            return None
        start, tokens, rode_along, final_part = self._cycle
        self._cycle = None
        elapsed = t - start
        step = self.step_ns()
        if step is None or elapsed <= 0:  # nothing to weigh the streams' tokens by
            return None
        got = self._streams_ns(given + rode_along, step)
        overhead = max(0, elapsed - got)
        self.overhead_per_token.add(overhead * 1000 // max(tokens, 1))
        # the share is owed on the cycle's overhead and on its planned part of the final chunk
        self.balance += (100 - self.pct) * got - self.pct * (overhead + final_part)
        # one cycle's overhead, plus a probe's steps: a window rounds up by less than a step and a
        # probe gives at most its length beyond the share, and both are carried in full (at a low
        # pct a one-step window gives several cycles' share)
        bound = (self.pct * (max(overhead, self.overhead_per_token.value() * tokens // 1000) + final_part)
                 + (100 - self.pct) * step * self._need_run)
        self.balance = max(-bound, min(bound, self.balance))
        self._given_ns += got
        self._elapsed_ns += elapsed
        return Cycle(elapsed, got, overhead, round(got / elapsed, 4), round(self._given_ns / self._elapsed_ns, 4))

    def _streams_ns(self, tokens: int, step: int) -> int:
        """The streams' part of the open cycle after ``tokens`` of theirs (steps given and a token
        that rode along): the window's steps alone as they ran, its other tokens at ``step``."""
        timed = min(self._window_steps, tokens)
        return self._window_ns * timed // max(self._window_steps, 1) + (tokens - timed) * step

    def forgive(self) -> None:
        """The last window was cut by the prompts' bound (:mod:`adapter.switches.decode_yield.bound`):
        the steps it did not give are not owed, so no later window repays them."""
        self.balance = max(0, self.balance)

    def abandoned(self) -> None:
        """The window did not give what it planned: no cycle, and the prompt's balance starts over."""
        self._reset(None)

    def _reset(self, prompt: object | None) -> None:
        self.prompt, self.balance, self._cycle = prompt, 0, None
        self._given_ns = self._elapsed_ns = self._final_paid = 0
        self._windows = None


def final_span(windows: int) -> int:
    """How many of a prompt's last windows pay its final chunk's share: those of its last quarter
    (a prompt of ``windows`` + 1 chunks; 16 chunks: 3 windows and the final chunk), at least one."""
    return max(1, (windows + 1) // 4 - 1)
