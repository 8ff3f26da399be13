"""Decode yield (``DSV41_DECODE_YIELD=<pct>``): running streams keep ``pct`` % of a chunked prefill's
wall time, when prefill has room to give it (docs/switches/decode_yield.md; sglang#32549: stock gives
them no step between a prompt's chunks, or a fixed ``--prefill-decode-interval``). After each non-final
chunk, while rows decode, the next prefill is deferred ``N`` steps through the engine's own
``_should_defer_prefill`` counter: chunk boundaries, batch contents and outputs stay the engine's own.
Rollback: unset ``DSV41_DECODE_YIELD``; the open-loop model only: ``DSV41_DECODE_YIELD_MODE=model``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapter import cost_model
from adapter.core import api
from adapter.switches.decode_yield import backlog, cache_hit, clock, decision, observe

SWITCH = api.handle(__name__)
_ATTR = "_dsv41_decode_yield"  # per-Scheduler state, on the instance
MODE_KEY, GUARD_KEY, MEASURED = "DSV41_DECODE_YIELD_MODE", "DSV41_DECODE_YIELD_LOAD_GUARD", "measured"
DLLM = "dLLM: diffusion decoding does not use the chunked-prefill deferral path"
DEFAULTS_WARNING = ("decode_yield runs open-loop (DSV41_DECODE_YIELD_MODE=model) on its default cost coefficients "
                    "(no DSV41_DECODE_YIELD_* coefficient key): fit them on this machine with `python -m adapter "
                    "fit-cost-model` (docs/operating.md), or unset the mode (measured: no coefficients needed)")


@dataclass
class Open:  # an armed window: the chunked prompt it waits for and what it was armed with
    req: Any
    facts: decision.Facts
    window: decision.Window
    n: int  # agreed (rank 0's)
    chunk: int  # the chunked prompt's chunk and prefix, and the rows decoding (the window line's)
    prefix: int
    rows: int
    wall_ns: int = 0  # its steps' wall time so far, whole (the alternation included)


class Yield:  # one scheduler's switch state
    def __init__(self, scheduler: Any, pct: int, observer: observe.Observer):
        self.clock = clock.PassClock(bool(getattr(scheduler, "enable_overlap", False)))
        self.backlog = backlog.Backlog(pct, cache_hit.reader(scheduler.tree_cache))
        self.observe, self.state = observer, decision.State()
        self.open: Open | None = None


def unsupported_mode(server_args: Any) -> str | None:
    """Why the yield cannot run under these server args (None: it can)."""
    if getattr(server_args, "enable_dp_attention", False):
        return "DP attention: every rank would need the same N (ranks decide on local batches)"
    if (getattr(server_args, "pp_size", 1) or 1) > 1:
        return "pipeline parallelism: the microbatched PP loop keeps several batches in flight"
    if (mode := str(getattr(server_args, "disaggregation_mode", "null") or "null")) != "null":
        return f"PD disaggregation (mode {mode}): a prefill server has no decode rows, a decode server no chunks"
    if getattr(server_args, "dllm_algorithm", None) is not None:
        return DLLM
    return None


def predict(profile: api.Profile) -> api.Prediction:
    """What ``python -m adapter check`` predicts: the first pass's refusal, the mode, a defaults warning."""
    coefficients = [k for k in profile.environ if k.startswith("DSV41_DECODE_YIELD_") and k not in (MODE_KEY, GUARD_KEY)]
    warnings = (DEFAULTS_WARNING,) if profile.values.get(MODE_KEY) == "model" and not coefficients else ()
    if profile.status != "installed":
        return api.Prediction(warnings=warnings)
    params = {k: profile.installed[k] for k in ("share", "mode", "cost")}  # install's receipt carries them
    why = unsupported_mode(profile.server_args)  # None without a launch line
    how = ("windows from measured iteration times, closed on the measured share; rank 0 decides under TP"
           if params["mode"] == MEASURED else f"open-loop integer cost model, coefficients {params['cost']}")
    notes = (f"decode_yield: share {params['share']} % in {params['mode']} mode ({how})",)
    return api.Prediction(f"refused: {why}" if why else None, params, warnings, notes=notes)


def agree(scheduler: Any, n: int) -> int:
    """Rank 0's ``n`` on every TP rank: ranks deciding alone on their own clocks would defer different
    passes and pair the wrong forwards in their collectives. Arming is decided on replicated state, so
    every rank is here on the same pass; SGLang's gloo group ``tp_cpu_group`` keeps it off the device."""
    if int(getattr(scheduler, "tp_size", 1) or 1) <= 1:
        return n
    import torch
    import torch.distributed as dist

    value = torch.tensor([n], dtype=torch.int64)
    dist.broadcast(value, group=scheduler.tp_cpu_group, group_src=0)
    return int(value.item())


def _rows(scheduler: Any, plan: Any, batch: Any, coef: cost_model.Coefficients) -> tuple[int, int]:
    """The rows that decode after this chunk: how many, and the cost model's step for them (fs)."""
    decoding = batch.decoding_reqs  # --enable-mixed-chunk: the rows rode along in this chunk
    # overlap loop: rows whose in-flight result finishes them will not decode again
    finishing = () if decoding else scheduler._reqs_finishing_inflight(plan.running_batch)
    contexts = [len(r.origin_input_ids) + len(r.output_ids) for r in decoding or plan.running_batch.reqs
                if not (r.finished() or (finishing and r in finishing))]
    topk = sum(min(c, coef.topk) for c in contexts)
    return len(contexts), cost_model.decode_cost(len(contexts), sum(contexts), topk, coef)


def install(ctx: api.SwitchContext) -> dict[str, Any]:
    SWITCH.bind(ctx)
    mode: str = ctx.values[MODE_KEY]  # defaults filled in
    cfg = decision.Config(ctx.value, measured=mode == MEASURED, guard=ctx.values[GUARD_KEY])
    try:
        coef = cost_model.from_config(ctx.values)
    except ValueError as exc:  # a cross-key rule the per-key parsers cannot see (a ConfigError)
        raise api.Refusal(str(exc)) from None
    try:  # the engine publishes them later, in the scheduler process
        from sglang.srt.runtime_context import get_server_args

        published = get_server_args()
    except (ImportError, ValueError, AttributeError):
        published = None
    if reason := unsupported_mode(published):
        raise api.Refusal(reason)

    def state_of(scheduler: Any) -> Yield | None:
        """The instance's state; None (and a late refusal, back to stock) in an unsupported mode."""
        reason = unsupported_mode(getattr(scheduler, "server_args", None))
        if reason is None and getattr(scheduler, "dllm_config", None) is None:
            return scheduler.__dict__.setdefault(_ATTR, Yield(scheduler, cfg.pct, observe.Observer(ctx, cfg.pct, mode)))
        ctx.refuse_late(reason or DLLM, revert=True)
        return None

    def get_next_batch_to_run(wrapped: Any, s: Any, args: Any, kwargs: Any) -> Any:
        y = s.__dict__.get(_ATTR) or state_of(s)
        if y is None:
            return wrapped(*args, **kwargs)
        tick = y.clock.on_pass(t := clock.now())
        if y.open is not None and tick.window:
            y.open.wall_ns += tick.took
        per_token = y.clock.per_token_ns() or 0
        if late := y.backlog.on_pass(t, tick, s.chunked_req, s.waiting_queue, per_token):
            y.observe.late(t, late, len(s.waiting_queue))
        if s.chunked_req is None and not s.waiting_queue:  # the backlog is over: the next may burst
            y.observe.bursting = False
        batch = (plan := wrapped(*args, **kwargs)).batch_to_run
        extend = batch is not None and batch.forward_mode.is_extend()
        y.clock.ran(batch is not None and not extend, sum(batch.extend_lens) if extend else 0)
        chunked = s.chunked_req
        if not extend:
            return plan
        y.backlog.ran(batch.reqs, chunked)
        # a non-final chunk: add_chunked_req / new_chunked_req keep chunked_req set only when truncated
        index = next((i for i, r in enumerate(batch.reqs) if r is chunked), -1) if chunked is not None else -1
        if index < 0:
            return plan
        rows, step_fs = _rows(s, plan, batch, coef)
        if not rows:  # a lone prompt prefills exactly as stock
            return plan
        size, prefix = batch.extend_lens[index], batch.prefix_lens[index]
        left = len(chunked.origin_input_ids) - prefix - size
        windows_left = max(1, -(-left // size))
        rest_ns, waiting = y.backlog.facts(t, chunked, s.waiting_queue, left + size, per_token)
        y.clock.windows += 1
        facts = decision.Facts(
            t, chunked.rid, sum(batch.extend_lens), s._prefill_decode_interval_remaining,
            (cost_model.window_cost(zip(batch.extend_lens, batch.prefix_lens), coef), step_fs),
            rode_along=1 if batch.decoding_reqs else 0, final_tokens=max(0, left - (windows_left - 1) * size),
            windows_left=windows_left, step_ns=y.clock.step_ns(), fresh=y.clock.fresh(), need_run=y.clock.need_run,
            per_token_ps=clock.median(y.clock.cycle_per_token), alternation_ns=clock.median(y.clock.alternation) or 0,
            rest_ns=rest_ns, waiting=waiting, load=y.backlog.load(per_token))
        window, y.state = decision.decide(cfg, facts, y.state)
        n = s._prefill_decode_interval_remaining = agree(s, window.n)
        y.open = Open(chunked, facts, window, n, size, prefix, rows)
        y.observe.armed(t, window, n, y.backlog.lag, facts.load, len(s.waiting_queue))
        return plan

    def _should_defer_prefill(wrapped: Any, s: Any, args: Any, kwargs: Any) -> Any:
        y = s.__dict__.get(_ATTR)
        if y is None or (opened := y.open) is None:
            return wrapped(*args, **kwargs)
        running_batch = args[0] if args else kwargs["running_batch"]
        ended = None
        if s.chunked_req is not opened.req:
            ended = "prompt_gone"  # finished, aborted, or retracted by a pause
        elif (running_batch.is_empty() or running_batch.is_prefill_only
              # overlap loop: every row finishes with its result in flight: the decode would be empty
              or len(s._reqs_finishing_inflight(running_batch)) == running_batch.batch_size()):
            ended = "streams_gone"
        remaining = s._prefill_decode_interval_remaining
        if ended is not None:  # end now, but never shorter than the configured interval
            s._prefill_decode_interval_remaining = min(remaining, max(0, opened.facts.floor - (opened.n - remaining)))
        defer = wrapped(*args, **kwargs)
        if defer:
            y.clock.deferred = True
            if s.waiting_queue:
                # a stock pass would try prefill, which orders the waiting queue and keeps its cached
                # prefixes fresh in the LRU: a deferred pass does the same, or under pool pressure a
                # waiting prompt's prefix ages out while the window runs and is prefilled again
                s.policy.calc_priority(s.waiting_queue, running_batch, processed_tokens=s.processed_tokens_counter)
        if ended is None and defer:
            return defer
        ended = ended or ("served" if remaining == 0 else "min_bs")
        given, y.open, served = opened.n - remaining, None, None
        if ended == "served" and cfg.measured:  # the cycle ends at this pass: the next chunk runs in it
            served, y.state = decision.close(y.state, y.clock.entered, given, opened.wall_ns, y.clock.step_ns(),
                                             clock.median(y.clock.cycle_per_token), y.clock.need_run)
            if served is not None:  # the clock's samples of the cycle
                y.clock.cycle_per_token.append(served.per_token_ps)
                if served.alternation_ns is not None:
                    y.clock.alternation.append(served.alternation_ns)
        elif ended != "served":
            y.state = decision.abandoned(y.state)
        y.observe.ended(opened, given, ended, served)
        return defer

    ctx.wrap("Scheduler.get_next_batch_to_run", get_next_batch_to_run)
    ctx.wrap("Scheduler._should_defer_prefill", _should_defer_prefill)
    return {"share": cfg.pct, "mode": mode, "cap": cfg.cap, "cost": coef.source, "load_guard": int(cfg.guard),
            "mode_check": "install" if published is not None else "first_pass"}
