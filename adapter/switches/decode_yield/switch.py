"""Decode yield (``DSV41_DECODE_YIELD=<pct>``): running streams keep ``pct`` % of their decode rate
while a long prompt prefills in chunks.

What it changes: after each *non-final* chunk of a chunked prompt, while decode rows are running,
the next prefill is deferred for ``N`` decode steps through the engine's own
``Scheduler._should_defer_prefill`` counter (``_prefill_decode_interval_remaining``), never shorter
than ``--prefill-decode-interval``, never longer than 128 steps. Only *when* the next chunk runs
changes: chunk boundaries, batch contents and outputs stay the engine's own. A pass a window defers
still runs the scheduling policy over the waiting queue (``SchedulePolicy.calc_priority``, which a
stock pass runs when it tries prefill while a prompt is chunked): its order, and the recency of the
waiting prompts' cached prefixes (the policy's prefix matches, or under FCFS its refresh of them every
32 such passes, ``SGLANG_ENABLE_WAITING_PREFIX_REFRESH``), stay as stock keeps them; without it a
waiting prompt's prefix ages in the LRU through the windows and, under pool pressure, is evicted and
prefilled again.

``N`` comes from one of two modes (``DSV41_DECODE_YIELD_MODE``):

* ``measured`` (the default): a closed loop on this boot's measured iteration wall times
  (:mod:`adapter.switches.decode_yield.controller`): the streams' step alone and each chunk cycle's
  overhead, measured from the scheduler's own passes, and the share the streams got in the
  prompt's earlier windows corrects the next one (rounding carried). A window of at least 4 steps
  (6 in the overlap loop) is planned again after half its steps, on its chunk's measured cost and
  its own steps. The boot's first windows, before anything is measured, use the cost model's
  ratio. Under tensor parallelism rank 0 decides and broadcasts ``N`` (and the re-planned rest) on
  ``Scheduler.tp_cpu_group`` (:mod:`adapter.switches.decode_yield.agreement`): ranks' clocks differ,
  and every rank must defer the same passes.
* ``model``: the open-loop integer cost model alone (:mod:`adapter.switches.decode_yield.cost_model`,
  ``N = ceil((pct*window_cost - carry) / ((100-pct)*step_cost))`` from the chunk's and the
  streams' shapes and the ``DSV41_DECODE_YIELD_*`` coefficients); the prompts' bound reads the
  clock in both modes, so under TP rank 0's ``N`` is broadcast in this mode too. It holds the share only where its coefficients were fitted and while
  the machine holds still: the previous behaviour, kept as the rollback of the loop.

**What the share means with many prompts in flight** (:mod:`adapter.switches.decode_yield.bound`):
``pct`` is the streams' share of the wall time of *all* prefill work, not of one prompt's chunks: a
window defers the whole next prefill batch, so it delays every prompt then waiting, the chunked one
and each one queued behind it. The bound: a window is cut so that no waiting prompt is held beyond
``1 / (1 - pct)`` of its stock TTFT (its lag, what it found on arrival and the window steps given
since, at most ``pct`` of its own time to first token), give or take one step; a prompt arriving
during a window waits that window out. Where the share cannot be given within that (prefill
arriving faster than ``1 - pct`` of the prefill rate: a burst), windows are cut, the streams get
less, a ``burst`` line says so (at most one per backlog and per 10 s) and the window line carries
``cut``; a cut window leaves the closed loop no debt to repay. A prompt that arrives into a backlog
the windows have already lengthened, near its end, finds more lag than its share (it cannot go
first: the engine schedules one chunked prompt at a time): no window is given while it waits, and
if its first token still comes past its bound it is counted (``unbounded`` line,
``dsv41_decode_yield_prompts_unbounded_total``). Which prompts the bound covers: bound.py.

Under ``--enable-mixed-chunk`` the running rows also decode one token inside the chunk
(``Scheduler`` mixes them in and sets ``batch.decoding_reqs``); the share is on the streams' token
rate, so both modes credit that token (``rode_along``) and the window is empty when the chunk alone
already gives the share.

Why: in SGLang 0.5.23 a chunked prompt is rescheduled on every pass, so running streams get no
decode step between chunks unless ``--prefill-decode-interval`` is set, and then a fixed number of
steps whatever the chunk costs (sglang#32549: a 5 min decode hole behind a long prompt;
streams fell to 8 % of their decode rate during a cold 500K-token prefill).

Invariants (tests/upstream/test_decode_yield.py checks each; the bound:
tests/upstream/test_decode_yield_bound.py; the closed loop against scripted costs:
tests/upstream/test_decode_yield_closed_loop.py; two ranks: tests/upstream/test_decode_yield_ranks.py):
* Off, or with no running decode rows (a lone prompt), the scheduler trace is the stock one.
* The final chunk arms nothing beyond the engine's own interval.
* A window ends at once when the streams are gone (finished, retracted) or the chunked prompt is
  gone (finished, aborted, retracted by a pause): no idle pass, and never shorter than the
  configured interval. The engine's ``--prefill-decode-interval-min-bs`` rule still applies.
* Arming is decided on replicated scheduler state (a non-final chunk in the batch, running rows),
  so every TP rank reaches the broadcast on the same pass; ``N`` itself is rank 0's, and so is
  a re-planned rest (reached after a count of steps from the agreed ``N``), which keeps the
  window between the configured interval and the cap.
* DP attention, pipeline parallelism, PD disaggregation and dLLM are refused (stock path stays).

Hooks: ``Scheduler.get_next_batch_to_run`` (before the call, measured mode: stamp the pass; after
it: arm the window when the batch about to run holds a non-final chunk) and
``Scheduler._should_defer_prefill`` (before the call: end the window early, or plan its rest again
by setting the engine's counter; after it: close the measured cycle).
``_arm_prefill_decode_interval`` (whose counter is the floor), ``_reqs_finishing_inflight`` (rows
the overlap loop's in-flight result finishes), ``init_model_worker`` (which sets ``tp_cpu_group``),
``SchedulePolicy.calc_priority`` (run on a deferred pass) and the read-only prefix walks the bound
reads a waiting prompt's cache hit with (:mod:`adapter.switches.decode_yield.cache_hit`) are read or
called, not wrapped; they are pinned beside the wrapped two (registry ``relies_on``), so drift
refuses the switch.

Rollback: unset ``DSV41_DECODE_YIELD`` (the ``DSV41_DECODE_YIELD_*`` keys then do nothing); to
the open-loop model only, ``DSV41_DECODE_YIELD_MODE=model``.
"""

from __future__ import annotations

import logging
from typing import Any

from adapter.core import api
from adapter.switches.decode_yield import agreement, bound, cache_hit, controller, cost_model

SWITCH = api.handle(__name__)
_ATTR = "_dsv41_decode_yield"  # per-Scheduler state, on the instance
MODE_KEY, MEASURED, MODEL = "DSV41_DECODE_YIELD_MODE", "measured", "model"
DLLM = "dLLM: diffusion decoding does not use the chunked-prefill deferral path"


class _Window:
    """One open yield window: the chunked prompt it waits for and what it was armed with."""

    __slots__ = ("allowed", "chunk", "cut", "floor", "n", "plan", "planned", "prefix", "replan_at", "req", "rows")

    def __init__(self, req: Any, n: int, floor: int, chunk: int, prefix: int, rows: int,
                 plan: controller.Plan | None, replan_at: int | None = None, allowed: int | None = None,
                 cut: int = 0):
        self.req, self.n, self.floor = req, n, floor
        self.chunk, self.prefix, self.rows, self.plan = chunk, prefix, rows, plan
        self.planned = n  # N as armed; ``n`` is what the window gives once its rest is planned again
        self.replan_at = replan_at  # measured mode: after this many steps its rest is planned again
        self.allowed = allowed  # the most steps the bound allows this window (None: no bound yet)
        self.cut = cut  # steps the share asked for that the bound cut


class _State:
    __slots__ = ("bound", "carry", "carry_req", "ctl", "pass_t", "window")

    def __init__(self, ctl: controller.Controller | None, pct: int, tree_cache: Any) -> None:
        self.window: _Window | None = None
        self.carry = 0  # model mode: rounding surplus of the previous windows of carry_req (cost_model.yield_window)
        self.carry_req: Any = None
        self.ctl = ctl  # measured mode: the closed loop (None in model mode)
        self.pass_t = 0  # when the current pass entered get_next_batch_to_run (controller.now)
        self.bound = bound.Bound(pct, cache_hit.reader(tree_cache))  # the prompts' bound: the lag ledger (bound.py)


def unsupported_mode(server_args: Any) -> str | None:
    """Why the yield cannot run under these server args (None: it can)."""
    if getattr(server_args, "enable_dp_attention", False):
        return "DP attention: every rank would need the same N (ranks decide on local batches)"
    if (getattr(server_args, "pp_size", 1) or 1) > 1:
        return "pipeline parallelism: the microbatched PP loop keeps several batches in flight"
    mode = str(getattr(server_args, "disaggregation_mode", "null") or "null")
    if mode != "null":
        return f"PD disaggregation (mode {mode}): a prefill server has no decode rows, a decode server no chunks"
    if getattr(server_args, "dllm_algorithm", None) is not None:
        return DLLM
    return None


def _published_server_args() -> Any:
    """The process's ServerArgs when the runtime context has them (engine: later, in the scheduler)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except (ImportError, ValueError, AttributeError):
        return None


def install(ctx: api.SwitchContext) -> dict[str, Any]:
    SWITCH.bind(ctx)
    pct: int = ctx.value
    mode: str = ctx.values.get(MODE_KEY) or MEASURED
    measured = mode == MEASURED
    try:
        coef = cost_model.from_config(ctx.values)
    except ValueError as exc:  # a cross-key rule the per-key parsers cannot see (a ConfigError)
        raise api.Refusal(str(exc)) from None
    debug = ctx.debug
    topk = coef.topk
    cap = cost_model.MAX_YIELD_STEPS
    published = _published_server_args()
    if published is not None and (reason := unsupported_mode(published)):
        raise api.Refusal(reason)

    def state_of(scheduler: Any) -> _State | None:
        """The instance's state; None (and a late refusal) when its mode is unsupported."""
        state = scheduler.__dict__.get(_ATTR)
        if state is None:
            reason = unsupported_mode(getattr(scheduler, "server_args", None))
            if reason is None and getattr(scheduler, "dllm_config", None) is not None:
                reason = DLLM
            if reason is not None:  # a scheduler built in an unsupported mode after install: back to stock
                ctx.refuse_late(reason, revert=True)
                return None
            state = scheduler.__dict__[_ATTR] = _State(controller.Controller(pct, cap) if measured else None, pct,
                                                       scheduler.tree_cache)
        return state

    def get_next_batch_to_run(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        # every pass is a clock sample: the streams' step alone (measured mode) and the bound's lag
        state = instance.__dict__.get(_ATTR) or state_of(instance)
        if state is None:
            return wrapped(*args, **kwargs)
        ctl = state.ctl
        state.pass_t = t = controller.now()
        step_alone = ctl.step_ns() if ctl is not None else None
        for lag, ttft, lost in state.bound.on_pass(t, instance.chunked_req, instance.waiting_queue, step_alone):
            # a prompt served beyond its bound: it found a lag no window of its own added, or lost a
            # cache hit while it waited (bound.py)
            late = {"share": pct, "lag_ms": round(lag / 1e6, 1), "ttft_ms": round(ttft / 1e6, 1),
                    "waiting": len(instance.waiting_queue), **({"lost_hit_tokens": lost} if lost else {})}
            if state.bound.log_line("unbounded", t):  # a line at most every BURST_LOG_S, each prompt counted
                ctx.event("unbounded", **late)
            else:
                ctx.tally("unbounded", **late)
        if ctl is not None:
            # the overlap loop's pass waits on the batch before the one it launched: one more in a row
            ctl.on_pass(t, 3 if getattr(instance, "enable_overlap", False) else 2)
        plan = wrapped(*args, **kwargs)
        batch = plan.batch_to_run
        extend = batch is not None and batch.forward_mode.is_extend()
        # not extend: a decode batch (DP attention's idle batches are refused)
        state.bound.ran(sum(batch.extend_lens) if extend else 0, batch is not None and not extend,
                        batch.reqs if extend else (), instance.chunked_req)
        if ctl is not None:
            ctl.ran(batch is not None and not extend)
        chunked = instance.chunked_req
        if chunked is None:  # the common pass: nothing to arm
            return plan
        if not extend:
            return plan
        # A non-final chunk is in this batch: add_chunked_req / new_chunked_req keep chunked_req
        # set only when the prompt was truncated to a chunk.
        index = next((i for i, r in enumerate(batch.reqs) if r is chunked), -1)
        if index < 0:
            return plan
        decoding = batch.decoding_reqs  # --enable-mixed-chunk: the rows rode along in this chunk
        # overlap loop: rows whose in-flight result finishes them will not decode again
        finishing = () if decoding else instance._reqs_finishing_inflight(plan.running_batch)
        rows = kv = kv_topk = 0  # one pass over the rows: this runs once per chunk, on up to 100s of rows
        for r in decoding or plan.running_batch.reqs:
            if r.finished() or (finishing and r in finishing):
                continue
            context = len(r.origin_input_ids) + len(r.output_ids)
            rows += 1
            kv += context
            kv_topk += context if context < topk else topk
        if not rows:  # a lone prompt prefills exactly as stock
            return plan
        chunk_fs = cost_model.window_cost(zip(batch.extend_lens, batch.prefix_lens), coef)
        step_fs = cost_model.decode_cost(rows, kv, kv_topk, coef)
        floor = instance._prefill_decode_interval_remaining  # what the engine's own arm wrote
        rode_along = 1 if decoding else 0
        decided = None
        if ctl is not None:
            # what is left of the prompt, in chunks like this one: the last of them is its final
            # chunk, and this window is the first of as many windows before it
            size = batch.extend_lens[index]
            left = len(chunked.origin_input_ids) - batch.prefix_lens[index] - size
            windows_left = max(1, -(-left // size))
            final = max(0, left - (windows_left - 1) * size)
            decided = ctl.plan(state.pass_t, chunked, sum(batch.extend_lens), rode_along, floor, (chunk_fs, step_fs),
                               final, windows_left)
            n = decided.n
        else:
            carry = state.carry if state.carry_req is chunked else 0
            n, state.carry = cost_model.yield_window(pct, chunk_fs, step_fs, floor, carry, cap, rode_along)
            state.carry_req = chunked
        # the bound: no window holds a waiting prompt beyond what the share allows it (bound.py)
        tokens_left = len(chunked.origin_input_ids) - batch.prefix_lens[index]
        allowed = state.bound.allowed(state.pass_t, instance.waiting_queue, chunked, tokens_left,
                                      ctl.step_ns() if ctl is not None else None)
        cut = 0
        if allowed is not None and allowed < n:
            cut = n - max(floor, allowed)
            n = max(floor, allowed)
        # rank 0 decides for every TP rank (arming is decided on replicated state: every rank is here);
        # the bound reads rank 0's clock in model mode too
        n = agreement.agree(instance, n)
        instance._prefill_decode_interval_remaining = n
        if cut and not state.bound.bursting:  # once per backlog: the share is cut to keep the bound
            state.bound.bursting = True
            burst = {"share": pct, "lag_ms": round(state.bound.lag / 1e6, 1), "waiting": len(instance.waiting_queue),
                     "planned": n + cut, "allowed": n}
            if state.bound.log_line("burst", state.pass_t):  # a line at most every BURST_LOG_S, every backlog counted
                ctx.event("burst", **burst)
            else:
                ctx.tally("burst", **burst)
        # on the agreed n (replicated), so every rank plans the rest on the same pass
        replan_at = ctl.replan_at(n) if ctl is not None else None
        state.window = _Window(chunked, n, floor, batch.extend_lens[index], batch.prefix_lens[index], rows, decided,
                               replan_at, allowed, cut)
        return plan

    def _should_defer_prefill(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        state = instance.__dict__.get(_ATTR)
        window = state.window if state is not None else None
        if window is None:
            return wrapped(*args, **kwargs)
        running_batch = args[0] if args else kwargs["running_batch"]
        ended = None
        if instance.chunked_req is not window.req:
            ended = "prompt_gone"  # finished, aborted, or retracted by a pause
        elif (
            running_batch.is_empty()
            or running_batch.is_prefill_only
            # overlap loop: every row finishes with the result still in flight, so the decode
            # this deferral asks for would be empty (an idle pass)
            or len(instance._reqs_finishing_inflight(running_batch)) == running_batch.batch_size()
        ):
            ended = "streams_gone"
        remaining = instance._prefill_decode_interval_remaining
        if ended is not None:  # end now, but never shorter than the configured interval
            given = window.n - remaining
            instance._prefill_decode_interval_remaining = min(remaining, max(0, window.floor - given))
        elif window.replan_at is not None and window.n - remaining == window.replan_at:
            remaining = _replan(instance, state.ctl, state.pass_t, window, cap)
        defer = wrapped(*args, **kwargs)
        if defer:
            state.bound.window_step()
            if instance.waiting_queue:
                # a stock pass would try prefill first, and that orders the waiting queue and keeps
                # its cached prefixes fresh (the policy's match or its waiting-prefix refresh, a
                # count of such passes): a deferred pass does the same, or under pool pressure a
                # waiting prompt's prefix ages out while the window runs and it prefills it again
                instance.policy.calc_priority(instance.waiting_queue, running_batch,
                                              processed_tokens=instance.processed_tokens_counter)
        if ended is None and not defer:
            ended = "served" if remaining == 0 else "min_bs"
        if ended is not None:
            given = window.n - remaining
            state.window = None
            cycle = None
            if state.ctl is not None and ended == "served":  # the cycle ends at this pass: the next chunk runs in it
                cycle = state.ctl.served(state.pass_t, given)
                if window.cut:  # what the bound cut is not owed: no later window repays it
                    state.ctl.forgive()
            elif state.ctl is not None:  # not a cycle: the prompt's balance starts over
                state.ctl.abandoned()
            elif ended != "served":  # the window did not give what it planned: carry nothing over
                state.carry, state.carry_req = 0, None
            if debug or api.metrics_on():  # skip formatting the line when nothing reads it
                ctx.event("window", level=logging.DEBUG, **_window_fields(mode, pct, window, given, ended, cycle))
        return defer

    ctx.wrap("Scheduler.get_next_batch_to_run", get_next_batch_to_run)
    ctx.wrap("Scheduler._should_defer_prefill", _should_defer_prefill)
    return {"share": pct, "mode": mode, "cap": cap, "cost": coef.source,
            "mode_check": "install" if published is not None else "first_pass"}


def _replan(scheduler: Any, ctl: controller.Controller, t: int, window: _Window, cap: int) -> int:
    """The window's rest planned again on what its first half measured (rank 0's, on every TP
    rank: the pass is reached alike, ``replan_at`` and the counter being replicated), bounded as
    the plan (the floor, the cap); sets the engine's counter and returns it."""
    given = window.replan_at
    left = ctl.replan(t, given)
    if left is not None and window.allowed is not None:  # the bound the window was armed with holds
        left = min(left, max(0, window.allowed - given))
    # every rank reaches this pass: each takes part in the broadcast, even when its own clock timed no step
    left = agreement.agree(scheduler, window.n - given if left is None else left)
    left = max(window.floor - given, min(cap - given, left), 0)
    window.n = given + left
    window.replan_at = None
    scheduler._prefill_decode_interval_remaining = left
    return left


def _window_fields(mode: str, pct: int, window: _Window, given: int, ended: str,
                   cycle: controller.Cycle | None) -> dict[str, Any]:
    """The ``window`` line: what was planned and given; in measured mode what it was planned from
    (``source``, the step and overhead estimates) and, for a measured cycle, the share the streams
    got in it and over the prompt so far, its wall time and the streams' part of it."""
    fields: dict[str, Any] = {"mode": mode, "target": pct, "chunk": window.chunk, "prefix": window.prefix,
                              "rows": window.rows, "n": window.n, "floor": window.floor, "given": given,
                              "ended": ended}
    if window.planned != window.n:  # its rest was planned again after its first half
        fields["planned"] = window.planned
    if window.cut:  # steps the share asked for that the bound cut
        fields["cut"] = window.cut
    plan = window.plan
    if plan is not None:
        fields["source"] = plan.source
        if plan.step_ns is not None:
            fields["step_us"] = round(plan.step_ns / 1000, 1)
        if plan.overhead_ns is not None:
            fields["overhead_us"] = round(plan.overhead_ns / 1000, 1)
    if cycle is not None:
        fields.update(share=cycle.share, prompt_share=cycle.prompt_share, cycle_us=round(cycle.elapsed_ns / 1000, 1),
                      streams_us=round(cycle.streams_ns / 1000, 1))
    return fields
