"""Multi-turn chat traffic on the real SGLang scheduler with scripted wall times: every prompt's
TTFT and every stream's inter-token latency, with and without decode yield, on the same arrivals.

The shape of ``bench_serving``'s generated-shared-prefix traffic (:mod:`devkit.bench.chat_latency`):
conversations in groups that share a system prompt, Poisson arrivals, several turns each (a turn
is sent when the previous answer is complete, so later turns hit the prefix cache), short answers.
The scheduler is the real one (:mod:`devkit.testkit.scheduler`: real admission, chunking, radix
cache, result processing); only the forward is simulated, and its wall time is scripted
(:class:`Costs`, shaped like the Mellum kit on CPU: a 64-token chunk about 7 ms, a decode step of a
few rows about 5 ms), so a ratio read here is the scheduler's policy alone, free of the machine's
noise that a server boot on a shared CPU carries.

The full run adds the DSV4 kit's shape (:data:`DSV4_SHAPE`, :data:`DSV4_COSTS`: 3 running rows, a
256-token chunk), with every answer 16 tokens and with answers of 4-32 tokens (``Traffic.answers``).

``python -m adapter bench chat-latency-scripted [--quick]`` prints stock against yield at a few
shares: mean / p99 TTFT, the worst prompt's TTFT over its stock TTFT against the bound
``1 / (1 - pct)``, mean / p99 ITL, and the switch's window counts.
"""

from __future__ import annotations

import heapq
import random
import statistics
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Traffic:
    groups: int = 4
    per_group: int = 6
    system: int = 512
    question: int = 64
    output: int = 16
    turns: int = 3
    rate: float = 4.0  # conversations per second (Poisson)
    seed: int = 1
    # None: a turn is sent when the previous answer is complete (bench_serving's way; arrivals then
    # depend on the policy). A number: turn k arrives k times this many seconds after the first,
    # whatever the policy does, so two runs see the same arrivals and each prompt's TTFT compares.
    turn_gap_s: float | None = None
    # None: every answer is ``output`` tokens (bench_serving's generated-shared-prefix default). A
    # pair: each request's answer length drawn from [lo, hi], fixed by its id (the same in every run)
    answers: tuple[int, int] | None = None

    @property
    def conversations(self) -> int:
        return self.groups * self.per_group

    def answer_len(self, rid: str) -> int:
        if self.answers is None:
            return self.output
        lo, hi = self.answers
        return lo + zlib.crc32(rid.encode()) % (hi - lo + 1)


@dataclass(frozen=True)
class Costs:
    """Scripted wall time of one pass in ns: a prefill forward and a decode step."""

    prefill_us: int = 3000
    token_us: int = 60
    step_us: int = 4000
    row_us: int = 400

    def __call__(self, step: Any) -> int:
        if step.kind == "prefill":
            return (self.prefill_us + self.token_us * sum(step.extend_lens)) * 1000
        if step.kind == "decode":
            return (self.step_us + self.row_us * step.decode_rows) * 1000
        return 0


@dataclass
class Result:
    ttft_ms: dict[str, float] = field(default_factory=dict)  # per request (conversation/turn)
    cached: dict[str, int] = field(default_factory=dict)  # per request: its prefix-cache hit (tokens)
    itl_ms: list[float] = field(default_factory=list)
    wall_ms: float = 0.0
    passes: int = 0
    longest_window_ms: float = 0.0  # the most decode time between two chunks of a chunked prompt
    unbounded: set[str] = field(default_factory=set)  # prompts decode yield's ledger counted past their bound

    def figures(self) -> dict[str, Any]:
        ttfts = sorted(self.ttft_ms.values())
        itls = sorted(self.itl_ms)
        return {"requests": len(ttfts), "mean_ttft_ms": round(statistics.fmean(ttfts), 2),
                "p99_ttft_ms": round(_pct(ttfts, 99), 2), "max_ttft_ms": round(ttfts[-1], 2),
                "mean_itl_ms": round(statistics.fmean(itls), 2) if itls else None,
                "p99_itl_ms": round(_pct(itls, 99), 2) if itls else None, "wall_ms": round(self.wall_ms, 1),
                "req_per_s": round(len(ttfts) / self.wall_ms * 1000, 2) if self.wall_ms else None}


def _pct(ordered: list[float], p: float) -> float:
    if not ordered:
        return 0.0
    k = (len(ordered) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def run_traffic(traffic: Traffic = Traffic(), costs: Callable[[Any], int] = Costs(), *, chunk: int = 64,
                max_passes: int = 200_000, harness: Any = None, pool: dict[str, Any] | None = None) -> Result:
    """Drive the real scheduler (a fresh :func:`devkit.testkit.scheduler.build_scheduler` unless
    ``harness`` is given; ``pool``: more of its keywords, a hybrid SWA pool) through the traffic;
    the switch acts if it is installed."""
    from adapter.switches.decode_yield import clock as yield_clock
    from adapter.switches.decode_yield.observe import Observer
    from devkit.testkit.scheduler import SIM_TOKEN, ScriptedClock, build_scheduler

    h = harness or build_scheduler(**{"page_size": 1, "pool_tokens": 1 << 16, "chunked_prefill_size": chunk,
                                      "max_reqs": 64, **(pool or {})})
    clock = ScriptedClock(costs)
    h.on_forward = clock.forward
    saved_now, saved_late = yield_clock.now, Observer.late
    yield_clock.now = clock.now
    result = Result()

    def late(observer: Any, t: int, found: list[Any], waiting: int) -> None:
        result.unbounded.update(x.req.rid for x in found)  # the prompts the switch counts (its lines carry no rid)
        saved_late(observer, t, found, waiting)

    Observer.late = late  # type: ignore[method-assign]
    rng = random.Random(traffic.seed)
    vocab = h.vocab_size - 10
    base = 100

    def ids(n: int) -> list[int]:
        nonlocal base
        out = [(base + i) % vocab + 5 for i in range(n)]
        base += n + 1
        return out

    systems = [ids(traffic.system) for _ in range(traffic.groups)]
    t = 0.0
    arrivals: list[tuple[int, int, int, list[int]]] = []  # (time ns, conversation, turn, prompt ids)
    for c in range(traffic.conversations):
        t += rng.expovariate(traffic.rate)
        prompt = systems[c % traffic.groups] + ids(traffic.question)
        arrivals.append((int(t * 1e9), c, 0, prompt))
        for turn in range(1, traffic.turns if traffic.turn_gap_s is not None else 1):
            prompt = prompt + [SIM_TOKEN] * traffic.output + ids(traffic.question)
            arrivals.append((int((t + turn * traffic.turn_gap_s) * 1e9), c, turn, prompt))
    heapq.heapify(arrivals)
    active: dict[str, tuple[Any, int, list[int], int]] = {}  # rid -> (req, arrival ns, prompt, conversation)
    seen_tokens: dict[str, tuple[int, int]] = {}  # rid -> (tokens seen, time of the last one)
    s = h.scheduler
    window = 0
    try:
        while arrivals or active:
            while arrivals and arrivals[0][0] <= clock.t:
                at, c, turn, prompt = heapq.heappop(arrivals)
                rid = f"c{c}t{turn}"
                req = h.make_request(len(prompt), traffic.answer_len(rid), rid=rid, prompt_ids=prompt)
                h.add_request(req)
                active[rid] = (req, at, prompt, c)
                seen_tokens[rid] = (0, at)
            if not s.waiting_queue and s.chunked_req is None and s.running_batch.is_empty() and arrivals:
                clock.t = max(clock.t, arrivals[0][0])  # idle until the next arrival
                continue
            before, chunked = clock.t, s.chunked_req
            step = h.step()
            result.passes += 1
            if step.kind == "decode" and chunked is not None and s.chunked_req is chunked:
                window += clock.t - before  # a decode step between two chunks: a window's
            else:
                result.longest_window_ms = max(result.longest_window_ms, window / 1e6)
                window = 0
            if result.passes > max_passes:
                raise RuntimeError(f"chat traffic: not done after {max_passes} passes")
            if step.kind == "idle" and arrivals and not s.waiting_queue and s.chunked_req is None:
                clock.t = max(clock.t, arrivals[0][0])
            for rid, (req, at, prompt, c) in list(active.items()):
                n = len(req.output_ids)
                seen, last = seen_tokens[rid]
                if n > seen:
                    if seen == 0:
                        result.ttft_ms[rid] = (clock.t - at) / 1e6
                        result.cached[rid] = req.cached_tokens
                    else:
                        result.itl_ms.extend([(clock.t - last) / 1e6] + [0.0] * (n - seen - 1))
                    seen_tokens[rid] = (n, clock.t)
                if req.finished():
                    del active[rid]
                    turn = int(rid.split("t")[-1]) + 1
                    if turn < traffic.turns and traffic.turn_gap_s is None:
                        nxt = list(prompt) + list(req.output_ids) + ids(traffic.question)
                        heapq.heappush(arrivals, (clock.t, c, turn, nxt))
        result.wall_ms = clock.t / 1e6
    finally:
        yield_clock.now, Observer.late = saved_now, saved_late  # type: ignore[method-assign]
    return result


ROWS = (("stock", {}), ("yield 33", {"DSV41_DECODE_YIELD": "33"}),
        ("yield 33 mode=model", {"DSV41_DECODE_YIELD": "33", "DSV41_DECODE_YIELD_MODE": "model"}),
        ("yield 50", {"DSV41_DECODE_YIELD": "50"}))
# the gate's decode share and SWA thin on a hybrid SWA pool the traffic overflows (cone replay needs a
# model's SWA geometry, which the scripted scheduler has not)
SWA_POOL = {"hybrid_swa": True, "swa_pool_tokens": 1024, "sliding_window": 32}
SWA_ROWS = (("stock", {}), ("yield 50", {"DSV41_DECODE_YIELD": "50"}),
            ("yield 50 + SWA thin", {"DSV41_DECODE_YIELD": "50", "DSV41_SWA_THIN": "1"}))


# The DSV4 kit's shape on this CPU (its chat boots: a page a chunk, 3 running rows): a 256-token chunk
# about 455 ms, a decode step 30 ms and 3 ms a row. With every answer the same length stock admits in
# waves (three rows finish together, the next three prompts prefill with no row decoding); answers
# of different lengths, as real chat has, break the waves without any switch.
DSV4_SHAPE = {"chunked_prefill_size": 256, "max_reqs": 3}
DSV4_COSTS = Costs(prefill_us=20000, token_us=1700, step_us=30000, row_us=3000)
DSV4_ROWS = (("stock", {}), ("yield 33", {"DSV41_DECODE_YIELD": "33"}), ("yield 50", {"DSV41_DECODE_YIELD": "50"}))


def _with_switch(environ: dict[str, str], traffic: Traffic, pool: dict[str, Any] | None = None,
                 costs: Costs = Costs()) -> tuple[Result, dict[str, int]]:
    """One run with the switch installed from ``environ`` (none: stock), its window lines counted."""
    import importlib
    import logging

    from adapter.core import boot, receipts

    importlib.import_module("sglang.srt.managers.scheduler")
    boot.uninstall()
    counts = {"windows": 0, "cut": 0, "guarded": 0, "bursts": 0}

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if "decode_yield window" in text:
                counts["windows"] += 1
                counts["cut"] += " cut=" in text
                counts["guarded"] += " guard=" in text
            elif "decode_yield burst" in text:
                counts["bursts"] += 1

    logger = receipts.logger()
    handler, level = Count(), logger.level
    try:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)  # before the install: the switch reads it there (window lines)
        if environ:
            boot.install(environ)
        return run_traffic(traffic, costs, pool=pool), counts
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        boot.uninstall()


def compare(traffic: Traffic, rows: tuple[tuple[str, dict[str, str]], ...] = ROWS,
            pool: dict[str, Any] | None = None, costs: Costs = Costs()) -> list[dict[str, Any]]:
    """Each row on the same traffic; per prompt, its TTFT over stock's and its excess over the bound
    ``1 / (1 - pct)`` x stock; ``over``: prompts past it by more than the run's longest window,
    ``unbounded``: those the switch counted (``dsv41_decode_yield_prompts_unbounded_total``), and
    ``lost_hit``: those over and not counted whose prefix-cache hit was smaller than stock's (a prefill
    that is not stock's, which the switch's ledger does not cover: bound.py)."""
    results = [(label, env, *_with_switch(env, traffic, pool, costs)) for label, env in rows]
    stock, stock_cached = results[0][2].ttft_ms, results[0][2].cached
    table = []
    for label, env, result, counts in results:
        pct = int(env.get("DSV41_DECODE_YIELD", 0))
        bound = 100 / (100 - pct)
        excess = sorted(result.ttft_ms[k] - stock[k] * bound for k in stock if k in result.ttft_ms)
        slack = result.longest_window_ms if pct else 0.0
        over = {k for k in stock if k in result.ttft_ms and result.ttft_ms[k] - stock[k] * bound > slack + 1e-6}
        compared = traffic.turn_gap_s is not None  # closed loop: a turn's arrival differs between the runs
        ratios = sorted(result.ttft_ms[k] / stock[k] for k in stock if k in result.ttft_ms and stock[k] > 0)
        table.append({"row": label, "bound": round(bound, 3), **result.figures(),
                      "p90_ratio": round(ratios[int(0.9 * (len(ratios) - 1))], 2),
                      "worst_excess_ms": round(excess[-1], 1), "window_ms": round(slack, 1),
                      "over": len(over) if compared else "-", "unbounded": len(result.unbounded),
                      "lost_hit": len({k for k in over - result.unbounded if result.cached[k] < stock_cached[k]})
                      if compared else "-",
                      "over_uncounted": sorted(over - result.unbounded) if compared else None,
                      "counted_within": sorted(result.unbounded - over) if compared else None,
                      **counts})
    return table


# The load guard: open-loop chat at rising offered load, 48 conversations of 3 turns, turns 1 s apart.
LOAD_RATES = (4.0, 8.0, 16.0, 24.0)  # conversations per second
LOAD_ROWS = (("stock", {}), ("yield 33", {"DSV41_DECODE_YIELD": "33"}),
             ("yield 33, guard off", {"DSV41_DECODE_YIELD": "33", "DSV41_DECODE_YIELD_LOAD_GUARD": "0"}))


def load_sweep(rates: tuple[float, ...] = LOAD_RATES) -> list[dict[str, Any]]:
    """Each rate: stock, yield 33 and yield 33 with the guard off on the same arrivals; per row the
    mean TTFT over stock's (the contract: at most 1 / (1 - pct) plus one window), requests a second
    over stock's, p99 ITL, and the windows the guard shrank."""
    found = []
    for rate in rates:
        table = compare(Traffic(groups=8, per_group=6, rate=rate, turn_gap_s=1.0), LOAD_ROWS)
        stock = table[0]
        for r in table:
            found.append({"rate": rate, **r, "ttft_x": round(r["mean_ttft_ms"] / stock["mean_ttft_ms"], 3),
                          "throughput_x": round(r["req_per_s"] / stock["req_per_s"], 3)})
    return found


def run(quick: bool = False) -> dict[str, Any]:
    """``python -m adapter bench chat-latency-scripted``: open-loop turns (each prompt's TTFT compares
    with stock's), and with ``--quick`` nothing else; the full run adds bench_serving's closed loop."""
    from adapter.ops.table import render

    open_loop = Traffic(rate=8.0, turn_gap_s=1.0)
    mellum = Costs()
    legs = [("open_loop", "open loop, 8 conversations/s, turns 1 s apart", open_loop, ROWS, None, mellum),
            ("swa_pool", "the same on a hybrid SWA pool of 1024 tokens (window 32)", open_loop, SWA_ROWS, SWA_POOL,
             mellum)]
    if not quick:
        closed = Traffic(rate=4.0)
        legs += [("closed_loop", "closed loop (bench_serving's), 4 conversations/s", closed, ROWS, None, mellum),
                 ("dsv4_equal", "DSV4-shaped (a 256-token chunk 455 ms, a step 30 ms + 3 ms a row, 3 running rows), "
                  "closed loop, every answer 16 tokens", closed, DSV4_ROWS, DSV4_SHAPE, DSV4_COSTS),
                 ("dsv4_varied", "the same with answers of 4-32 tokens", Traffic(rate=4.0, answers=(4, 32)), DSV4_ROWS,
                  DSV4_SHAPE, DSV4_COSTS)]
    cols = ["row", "mean_ttft_ms", "p99_ttft_ms", "p90_ratio", "worst_excess_ms", "window_ms", "over", "unbounded",
            "lost_hit",
            "mean_itl_ms", "p99_itl_ms", "windows", "cut", "guarded", "bursts"]
    figures: dict[str, Any] = {}
    for key, title, traffic, rows, pool, costs in legs:
        table = compare(traffic, rows, pool, costs)
        print(title)
        print(render(cols, [[r[c] for c in cols] for r in table]))
        figures[key] = table
    sweep = load_sweep(LOAD_RATES[1::2] if quick else LOAD_RATES)
    load_cols = ["rate", "row", "mean_ttft_ms", "ttft_x", "p99_ttft_ms", "req_per_s", "throughput_x", "mean_itl_ms",
                 "p99_itl_ms", "windows", "guarded", "cut", "unbounded"]
    print("the load guard: open loop, 48 conversations of 3 turns 1 s apart, at rising conversations/s")
    print(render(load_cols, [[r[c] for c in load_cols] for r in sweep]))
    figures["load_sweep"] = sweep
    return figures
