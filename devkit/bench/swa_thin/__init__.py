"""``python -m adapter bench swa-thin [--quick]``: SWA thin on the real cache at DSV4 geometry.

Part 1, survival (agent sessions): page 256, window 128, chunk 8192, the SWA pool sized by the real
``DSV4PoolConfigurator._resolve_swa_cap_tokens`` for ``--swa-prefix-tails`` 128 / 256 / 384 at 64
running requests (the simulation runs one request at a time, so the 63 other running requests'
reservation, ``compute_swa_request_cap(64) - compute_swa_request_cap(1)``, is taken off the pool).
Two 300K-token sessions go idle; sub-agent turns (16K-48K, two turns each) and new 500K-token
sessions run beside them. Per policy (stock, thin): the other-traffic SWA slots each idle resume
point survives (censored at the traffic budget); then, in a second run with the same traffic cut at
2M SWA slots, each idle session's next turn: whole-session re-prefills (matched prefix below half
the history), tokens re-prefilled, SWA hit rate (matched / history tokens).

Part 2, cost: four caches side by side (stock python core, fast python core, Rust core, and the fast
python core with the thin hook) grown by identical multi-session traffic to each tree size, then
steady-state turns (2-3 chunks of new tokens), interleaved with rotating order: per-op match /
checkpoint / release / evict(1024 SWA tokens) median and p99, in CPU time of the thread
(``time.thread_time_ns``: the machine is shared, and wall-clock samples mostly measure preemption). The first three keep stock LRU order
and hold identical trees (checked: same match on every turn); the thin cache evicts other SWA
victims, so its tree drifts slightly from theirs.

Part 3, the kit rows (not with ``--quick``: four server boots; ``--model mellum`` runs them alone):
stock, thin, session (``--enable-session-radix-cache``, the client sending session ids) and
thin+session on the Mellum kit server, :mod:`devkit.bench.swa_thin.kit`.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
from array import array
from typing import Any

from adapter.ops import table
from devkit.testkit import radix_cache as rc
from devkit.testkit.swa_thin import install_thin
from overlay_tools.simulate import cache_kit
from overlay_tools.simulate.swa_pool import server_args, swa_pool_for_tails

PAGE, WINDOW, CHUNK = 256, 128, 8192
TAILS = (128, 256, 384)
DEFAULT_TAILS = 256


# -- part 1: survival ----------------------------------------------------------------------------
def _traffic_unit(kit: cache_kit.CacheKit, tok: rc.Tokens, rng: random.Random, unit: int, long_len: int) -> None:
    if unit % 6 == 0:  # a new long session: one chunked 500K-token turn
        kit.run_turn(tok.fresh(long_len), PAGE)
    else:  # a sub-agent: a 16K-48K chunked turn and a short follow-up turn
        first = kit.run_turn(tok.fresh(rng.randint(64, 192) * PAGE), rng.randint(1, 4) * PAGE)
        kit.run_turn(first.history + tok.fresh(rng.randint(2, 8) * PAGE), rng.randint(1, 4) * PAGE)


def _idle_sessions(thin: bool, swa_tokens: int, idle_len: int) -> tuple[cache_kit.CacheKit, rc.Tokens, list[list[int]]]:
    from adapter.switches import swa_thin

    geometry = cache_kit.Geometry(PAGE, WINDOW, CHUNK, full_tokens=6 * 1024 * 1024, swa_tokens=swa_tokens,
                           max_reqs=8, max_ctx=1 << 20)
    kit = cache_kit.build(geometry, backend="python")
    if not thin:
        swa_thin.keep_stock(kit.cache)
    tok = rc.Tokens()
    return kit, tok, [kit.run_turn(tok.fresh(idle_len), PAGE).history for _ in range(2)]


def _survival(thin: bool, swa_tokens: int, budget: int, idle_len: int, long_len: int, seed: int) -> dict[str, Any]:
    """Other-traffic SWA slots until each idle resume point is lost (censored at ``budget``)."""
    rng = random.Random(seed)
    kit, tok, idle = _idle_sessions(thin, swa_tokens, idle_len)
    start, unit = kit.swa_alloc_tokens, 0
    lost_at: list[int | None] = [None, None]
    while kit.swa_alloc_tokens - start < budget and None in lost_at:
        unit += 1
        _traffic_unit(kit, tok, rng, unit, long_len)
        for i, history in enumerate(idle):
            if lost_at[i] is None and kit.resume_state(history)["lost"]:
                lost_at[i] = kit.swa_alloc_tokens - start
    traffic = kit.swa_alloc_tokens - start
    kit.cache.sanity_check()
    return {"survived_slots": [t if t is not None else traffic for t in lost_at],
            "censored": [t is None for t in lost_at], "leak": kit.leak_check()}


def _resume(thin: bool, swa_tokens: int, traffic: int, idle_len: int, long_len: int, seed: int) -> dict[str, Any]:
    """The same traffic (``traffic`` SWA slots), then each idle session's next turn."""
    rng = random.Random(seed)
    kit, tok, idle = _idle_sessions(thin, swa_tokens, idle_len)
    start, unit = kit.swa_alloc_tokens, 0
    while kit.swa_alloc_tokens - start < traffic:
        unit += 1
        _traffic_unit(kit, tok, rng, unit, long_len)
    resumed = [kit.run_turn(history + tok.fresh(8 * PAGE), PAGE) for history in idle]
    kit.cache.sanity_check()
    return {
        "whole_reprefills": sum(r.prefix_len < len(h) // 2 for r, h in zip(resumed, idle)),
        "reprefilled_tokens": sum(r.reprefilled for r in resumed),
        "swa_hit_rate": sum(r.prefix_len for r in resumed) / sum(len(h) for h in idle),
        "leak": kit.leak_check(),
    }


# -- part 2: cost --------------------------------------------------------------------------------
class _Traffic:
    """Deterministic multi-session traffic: shared system prompts, multi-turn growth, chunking."""

    def __init__(self, seed: int, max_session: int):
        self.rng, self.tok = random.Random(seed), rc.Tokens()
        self.system = [self.tok.fresh(self.rng.randint(8, 24) * PAGE) for _ in range(4)]
        self.max_session = max_session
        self.sessions: list[dict[str, Any]] = []

    def new_session(self) -> dict[str, Any]:
        target = int(math.exp(self.rng.uniform(math.log(16384), math.log(self.max_session))))
        session = {"history": array("q", self.rng.choice(self.system)), "target": target}
        self.sessions.append(session)
        return session

    def turn(self, session: dict[str, Any], lo: int, hi: int) -> tuple[array, int]:
        fresh = array("q", self.tok.fresh(self.rng.randint(lo, hi) * PAGE))
        return session["history"] + fresh, self.rng.randint(1, 4) * PAGE


def _run_all(kits: list[cache_kit.CacheKit], prompt: array, out: int, order: list[int]) -> array:
    results = {}
    for i in order:
        result = results[i] = kits[i].run_turn(prompt, out)
        # Token ids live in arrays, as the engine's Req keeps them: a list of up to 300K ints is
        # traversed by every garbage collection that finds it alive, and that pause would land in
        # whichever cache's op allocates next.
        result.history = array("q", result.history)
    # The three stock-order caches hold identical trees; the thin cache (3) evicts differently.
    assert len({results[i].prefix_len for i in order if i < 3}) == 1, "the cores disagree on the match"
    return results[0].history


def _cost(sizes: list[int], events: int, seed: int) -> list[dict[str, Any]]:
    from adapter.switches import fast_tree_core, swa_thin

    rows = []
    for size in sizes:
        geometry = cache_kit.Geometry(PAGE, WINDOW, CHUNK, full_tokens=size + 1024 * 1024, swa_tokens=size // 2 + 256 * 1024,
                               max_reqs=8, max_ctx=1 << 20)
        stock = cache_kit.build(geometry, backend="python")
        fast_tree_core.keep_stock(stock.core)
        swa_thin.keep_stock(stock.cache)
        fast = cache_kit.build(geometry, backend="python")
        swa_thin.keep_stock(fast.cache)
        kits = [stock, fast, cache_kit.build(geometry, backend="rust"), cache_kit.build(geometry, backend="python")]
        names = ["python", "fast_python", "rust", "fast_python_thin"]
        traffic = _Traffic(seed, max(32768, min(300_000, size // 4)))
        active = [traffic.new_session() for _ in range(6)]
        while stock.cache.full_evictable_size() < size:  # grow the tree
            i = traffic.rng.randrange(len(active))
            prompt, out = traffic.turn(active[i], 8, 96)
            active[i]["history"] = _run_all(kits, prompt, out, [0, 1, 2])
            if len(active[i]["history"]) >= active[i]["target"]:
                active[i] = traffic.new_session()
        cached = stock.cache.full_evictable_size()
        for kit in kits:
            kit.timings = {}
        recent = active[:]
        gc.collect()
        for event in range(events):  # steady state: 2-3 chunks of new tokens per turn
            # 75%: one of the 8 most recently used sessions; sessions past their target retire.
            live = [s for s in traffic.sessions if not s.get("retired")]
            session = traffic.rng.choice(recent if traffic.rng.random() < 0.75 else live)
            if len(session["history"]) >= session["target"] + 24 * 1024:
                session["retired"] = True
                session = traffic.new_session()
            recent = ([s for s in recent if s is not session] + [session])[-8:]
            prompt, out = traffic.turn(session, 33, 96)
            order = [(event + k) % 4 for k in range(4)]
            if event % 2:
                order.reverse()
            session["history"] = _run_all(kits, prompt, out, order)
            for i in order:
                kits[i].evict(swa=1024)
            for kit in kits:
                excess = kit.cache.full_evictable_size() - size
                if excess > 0:
                    timings, kit.timings = kit.timings, None  # the Full trim is not a measured op
                    kit.evict(full=excess)
                    kit.timings = timings
        stock.cache.sanity_check()
        kits[1].cache.sanity_check()
        row: dict[str, Any] = {"size": size, "cached_tokens": cached}
        for name, kit in zip(names, kits):
            for op, samples in kit.timings.items():
                samples = sorted(samples)
                row[f"{op}_{name}_med_us"] = round(statistics.median(samples) / 1000, 1)
                row[f"{op}_{name}_p99_us"] = round(samples[min(len(samples) - 1, int(0.99 * len(samples)))] / 1000, 1)
        rows.append(row)
        del kits, stock
        gc.collect()
    return rows


def _kit_rows() -> dict[str, Any]:
    import tempfile
    from pathlib import Path

    from devkit.bench.swa_thin import kit

    with tempfile.TemporaryDirectory(prefix="swa_thin_kit_") as out:
        return kit.run(Path(out))


def run(quick: bool, model: str | None = None) -> dict[str, Any]:
    if model is not None:
        if model != "mellum":
            raise ValueError(f"--model {model!r} is invalid for swa-thin: its kit rows run on mellum only")
        if quick:
            raise ValueError("--quick with --model mellum is invalid for swa-thin: the kit rows boot four servers "
                             "(a minute or more each here); run them without --quick")
        return {"kit": _kit_rows()}
    t_start = time.process_time()
    install_thin()
    server_args()

    idle_len, long_len = (300 * 1024 // PAGE * PAGE, 500 * 1024 // PAGE * PAGE)
    budget = 3_000_000 if quick else 8_000_000  # survival: traffic until both idle resume points are lost
    resume_after = 2_000_000  # re-prefills: both policies see this much traffic, then the idle sessions resume
    pools = [swa_pool_for_tails(t) for t in TAILS]
    print("--swa-prefix-tails (real DSV4PoolConfigurator formula, 64 running requests, page 256, window 128)")
    print(table.render(["tails", "SWA pool", "request cap", "headroom", "simulated pool"],
                       [[p["tails"], p["swa_pool"], p["request_cap"], p["headroom"], p["simulated_pool"]] for p in pools],
                       align="left"))
    survival_rows, figures = [], {}
    for pool in pools if not quick else [p for p in pools if p["tails"] == DEFAULT_TAILS]:
        out = {}
        for policy in ("stock", "thin"):
            thin = policy == "thin"
            out[policy] = {**_survival(thin, pool["simulated_pool"], budget, idle_len, long_len, seed=1),
                           **{f"resume_{k}": v for k, v in
                              _resume(thin, pool["simulated_pool"], resume_after, idle_len, long_len, seed=1).items()}}
        for policy, r in out.items():
            survival_rows.append([pool["tails"], policy,
                                  " / ".join(f"{s}{'+' if c else ''}" for s, c in zip(r["survived_slots"], r["censored"])),
                                  r["resume_whole_reprefills"], r["resume_reprefilled_tokens"],
                                  f"{r['resume_swa_hit_rate']:.3f}",
                                  sum(r["leak"].values()) + sum(r["resume_leak"].values())])
        figures[pool["tails"]] = out
    print("\ntwo idle 300K-token sessions beside sub-agent turns (16K-48K) and new 500K sessions")
    print(f"survived: other-traffic SWA slots until each idle resume point is lost ('+': alive at the {budget} budget);"
          f" re-prefills / tokens / SWA hit: the idle sessions' next turns after {resume_after} slots of traffic")
    print(table.render(["tails", "policy", "survived slots (A / B)", "whole re-prefills", "tokens re-prefilled",
                        "SWA hit", "leaked slots"], survival_rows, align="left"))

    survival_s = time.process_time() - t_start
    sizes = [300_000] if quick else [500_000, 2_000_000]
    cost = _cost(sizes, events=30 if quick else 200, seed=1)
    print(f"\ncost per op, µs of thread CPU time, median / p99 (interleaved; tree sizes {sizes}"
          f"{'; --quick: one 300K tree, run without --quick for 500K and 2M' if quick else ''})")
    cost_rows = []
    for row in cost:
        for op in ("match", "checkpoint", "release", "evict"):
            cells = [f"{row[f'{op}_{n}_med_us']} / {row[f'{op}_{n}_p99_us']}"
                     for n in ("python", "fast_python", "fast_python_thin", "rust")]
            rust = row[f"{op}_rust_med_us"]
            cost_rows.append([row["size"], op, *cells, f"{row[f'{op}_python_med_us'] / rust:.2f}",
                              f"{row[f'{op}_fast_python_med_us'] / rust:.2f}"])
    print(table.render(["tree", "op", "python (stock core)", "fast python", "fast python + thin", "rust", "py/rs",
                        "fast/rs"], cost_rows, align="left"))

    print(f"\nCPU seconds: survival and re-prefill runs {survival_s:.1f}, cost {time.process_time() - t_start - survival_s:.1f}")
    if quick:
        print("kit rows (stock / thin / session / thin+session on the Mellum kit server): four boots, not with --quick;"
              " python -m adapter bench swa-thin --model mellum")
    kit = {} if quick else {"kit": _kit_rows()}
    default = figures[DEFAULT_TAILS]
    stock_survival = statistics.mean(default["stock"]["survived_slots"])
    thin_survival = statistics.mean(default["thin"]["survived_slots"])
    largest = cost[-1]
    ratio = lambda op, n, q="med": largest[f"{op}_{n}_{q}_us"] / largest[f"{op}_rust_{q}_us"]  # noqa: E731
    return {
        "survival_ratio": round(thin_survival / stock_survival, 2),
        "survival_censored_thin": any(default["thin"]["censored"]),
        "whole_reprefills_stock": default["stock"]["resume_whole_reprefills"],
        "whole_reprefills_thin": default["thin"]["resume_whole_reprefills"],
        "reprefilled_tokens_stock": default["stock"]["resume_reprefilled_tokens"],
        "reprefilled_tokens_thin": default["thin"]["resume_reprefilled_tokens"],
        "swa_hit_rate_stock": round(default["stock"]["resume_swa_hit_rate"], 3),
        "swa_hit_rate_thin": round(default["thin"]["resume_swa_hit_rate"], 3),
        "cost_tree_tokens": largest["size"],
        "python_vs_rust_cost": round(ratio("checkpoint", "python"), 2),
        "fast_python_vs_rust_cost": round(ratio("checkpoint", "fast_python"), 2),
        "fast_python_vs_rust_release": round(ratio("release", "fast_python"), 2),
        "fast_python_vs_rust_checkpoint_p99": round(ratio("checkpoint", "fast_python", "p99"), 2),
        "fast_python_vs_rust_release_p99": round(ratio("release", "fast_python", "p99"), 2),
        "fast_python_vs_rust_match": round(ratio("match", "fast_python"), 2),
        "fast_python_thin_vs_rust_cost": round(ratio("checkpoint", "fast_python_thin"), 2),
        "tails": {str(t): {p: figures[t][p]["survived_slots"] for p in figures[t]} for t in figures},
        **kit,
    }
