"""N instances behind the gateway: the whole trace arrives at the router, each instance is the
single-instance replay (:class:`..engine.Replay` on its own real cache, stepped one scheduler
iteration at a time).

One modelled clock. The driver's events are the router's: a request ready (a first turn at its
arrival, a later turn when it has arrived and its parent has finished, wherever the parent ran),
the load poll (every ``load_monitor_interval``) and the tree's trim (every
``eviction_interval_secs``). Before an event at ``T`` every busy instance runs iterations until its
clock reaches ``T`` (the one furthest behind first; a decode run stops at ``T``), so the in-flight
counts the router reads at ``T`` (requests routed to an instance and not finished by ``T``) and
the polled loads come from the modelled clock. A prefill pass is indivisible: an instance may
stand a little past ``T`` when the router reads it.

Python API (what the real-fleet bench compares with): :func:`replay_trace`.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from overlay_tools.simulate.gateway.router import Load, RequestView, Router, RouterConfig

FS_PER_S = 10**15

# SGLang's KV usage as its /v1/loads reports it (``token_usage``, what smg's overload veto and expected
# wait read): the replay builds the scheduler's own observer over each instance's cache and calls it.
POOL_STATS = "sglang.srt.managers.scheduler_components.pool_stats_observer"
PINS = {
    f"{POOL_STATS}:PoolStats.get_kv_token_stats": (
        "6b2543ff2ac35734a63903e89b2a364e1feaeb18361c089fb34ef510e61a57ea"),
    f"{POOL_STATS}:SchedulerPoolStatsObserver.get_pool_stats": (
        "041443c090b285e4980c77aeda84336fd411652582a4d6642eac67c2779a32de"),
    f"{POOL_STATS}:SchedulerPoolStatsObserver._get_swa_token_info": (
        "55c7c7384307a24cf65b758df4578df29034eb7db1fda044c27e3651d9350718"),
}

LEFT_OUT = [
    "fleet: every instance is the single-instance replay above at the profile's geometry, on one shared modelled "
    "clock; the router reads an instance after its current iteration (a prefill pass is indivisible, so an "
    "instance may stand a little past the routing instant); no network or gateway latency; the KV byte buffers "
    "of each instance's pools are allocated uninitialized (no forward reads them)",
]


@dataclass
class Outcome:
    """One request under one profile and router."""

    index: int  # position in the trace (0-based)
    line: int  # the trace line (1-based)
    instance: int
    predicted_tokens: int  # the router tree's match on the chosen worker
    cached_tokens: int  # the prefix the engine ran from (device match, host load-back, cone's start)
    prompt_tokens: int  # page-rounded
    ttft_s: float | None  # modelled; None when the instance could never hold the request
    branch: str  # the router's branch (hit, miss, spill, rotation, ring, ...)
    routed_s: float  # when the router placed it (modelled)
    moved: bool = False  # a later turn placed on another instance than its parent turn


@dataclass
class FleetRun:
    profile: str
    router: str
    instances: int
    outcomes: list[Outcome]
    turns: list[list[Any]]  # per instance: its engine.Turn rows
    prefill_busy_s: list[float]
    busy_s: list[float]
    span_s: float
    branches: dict[str, int]
    tree_evicted_pages: int
    leaks: list[int] = field(default_factory=list)
    veto_polls: list[int] = field(default_factory=list)  # per instance: polls that found it over a threshold
    veto_edges: list[int] = field(default_factory=list)  # per instance: times it went out of routing


def page_keys(requests: list[Any], page: int) -> dict[int, tuple[int, ...]]:
    """Per request, hash-chain keys of its prompt's pages (``keys[k]`` names pages ``[0, k]``): the
    router's text equivalent."""
    from overlay_tools.simulate.trace import materialize

    out: dict[int, tuple[int, ...]] = {}
    for r in requests:
        tokens = materialize(r.prompt)
        key, keys = 0, []
        for p in range(len(tokens) // page):
            key = hash((key, tokens[p * page:(p + 1) * page].tobytes()))
            keys.append(key)
        out[r.index] = tuple(keys)
    return out


def routing_key(r: Any) -> str:
    """One key a conversation: the trace's session id when it has one, else its first turn."""
    return str(r.session_id) if r.session_id is not None else f"session-{r.session}"


def pool_observer(kit: Any) -> Any:
    """SGLang's ``SchedulerPoolStatsObserver`` over one instance's cache, as the scheduler builds it
    for a hybrid SWA pool (``scheduler.py:2508``; the capacities are the pools' free slots at boot)."""
    from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver

    from adapter.core.pins import drifted

    found = drifted(PINS)
    if found:
        raise RuntimeError(f"simulate's fleet replay refused: {'; '.join(found)}")
    full, swa = kit.baseline
    return SchedulerPoolStatsObserver(tree_cache=kit.cache, token_to_kv_pool_allocator=kit.allocator,
                                      req_to_token_pool=kit.pool, session_controller=None, hisparse_coordinator=None,
                                      is_hybrid_swa=True, is_hybrid_ssm=False, enable_hisparse=False,
                                      full_tokens_per_layer=full, swa_tokens_per_layer=swa, max_total_num_tokens=full)


def _load(inst: Any, observer: Any, since_decoded: int, interval_s: float) -> Load:
    """The instance's /v1/loads at this instant (what SGLang's load inquirer reports,
    ``load_inquirer.py:109-240``): the waiting queue (requests routed here and not yet admitted,
    a retracted one among them; ``num_waiting_reqs`` counts the scheduler's waiting queue), their
    uncached tokens at the instance's hit rate so far, running requests, and ``token_usage`` from
    SGLang's own pool observer rounded as it reports it: on a hybrid SWA pool the larger of the Full
    and SWA pools' non-evictable shares."""
    queued = [inst.by_index[i] for _, i in inst.ready] + [r for _, r in inst.waiting]
    turns = inst.turns.values()
    prompt = sum(t.prompt for t in turns if not t.skipped)
    hit = sum(t.prefix for t in turns if not t.skipped) / prompt if prompt else 0.0
    uncached = int(sum(r.prompt_len for r in queued) * (1 - hit))
    if inst.chunked is not None:
        uncached += inst.chunked.prompt_len - inst.chunked.ct.pos
    _, usage = observer.get_pool_stats().get_kv_token_stats()
    return Load(uncached, len(queued), len(inst.decoding) + (inst.chunked is not None),
                since_decoded / interval_s if interval_s > 0 else 0.0, round(usage, 4))


LAZY_BUFFER_BYTES = 1 << 20


@contextlib.contextmanager
def lazy_kv_buffers() -> Iterator[None]:
    """While the instances' caches are built, large ``uint8`` ``torch.zeros`` (the KV byte buffers of
    SGLang's DSV4 pools) are ``torch.empty``: the same sizes and classes, memory committed only where a
    page is written. The replay runs no forward, so no KV byte is read before it is written; index
    and mapping tensors (integer types) keep their zeros. N instances then fit where N zeroed pools
    (about 1 GiB each at DSV4's profile sizes) would not."""
    import torch

    zeros = torch.zeros

    def lazy(*size: Any, **kwargs: Any) -> Any:
        out = torch.empty(*size, **kwargs)
        if out.dtype is torch.uint8 and out.numel() >= LAZY_BUFFER_BYTES:
            return out
        return out.zero_()

    torch.zeros = lazy
    try:
        yield
    finally:
        torch.zeros = zeros


def run_fleet(policy: str, geo: Any, requests: list[Any], instances: int, router: Router, *, coef: Any,
              time_scale: float = 1.0, keys: dict[int, tuple[int, ...]] | None = None,
              routing_keys: list[str] | None = None) -> FleetRun:
    """``requests`` (prepared: sessions linked, token spans built) through ``router`` onto
    ``instances`` real caches running ``policy``. ``routing_keys``: the key each request carries, by
    trace index (default :func:`routing_key`: one a conversation)."""
    from overlay_tools.simulate import engine
    from overlay_tools.simulate.fleet import build_kits, uninstall

    keys = keys if keys is not None else page_keys(requests, geo.page)
    by_index = {r.index: r for r in requests}
    max_ctx = max(r.history_len for r in requests) + geo.page
    cfg = router.cfg
    try:
        with lazy_kv_buffers():
            kits = build_kits(policy, geo, max_ctx, instances)
        insts = [engine.Replay(kit, requests, chunk=geo.chunk, max_running=geo.max_running, coef=coef,
                               time_scale=time_scale, kv_park=geo.kv_park, max_prefill_tokens=geo.max_prefill_tokens,
                               context_len=geo.context_len) for kit in kits]
        for inst in insts:
            inst.start(external=True)
        rkeys = {r.index: routing_keys[r.index] if routing_keys is not None else routing_key(r) for r in requests}
        outcomes = _drive(insts, kits, router, requests, by_index, keys, rkeys, cfg, time_scale, geo.page)
        leaks = []
        for kit in kits:
            leak = kit.leak_check()
            kit.cache.sanity_check()
            leaks.append(leak["full"] + leak["swa"])
    finally:
        uninstall()
    return FleetRun(policy, router.policy, instances, outcomes, [[inst.turns[i] for i in sorted(inst.turns)]
                                                                  for inst in insts],
                    [inst.prefill_busy_fs / FS_PER_S for inst in insts], [inst.busy_fs / FS_PER_S for inst in insts],
                    insts[0].span_fs / FS_PER_S, dict(router.branches), router.tree.evicted, leaks,
                    list(router.veto_polls), list(router.veto_edges))


def _drive(insts: list[Any], kits: list[Any], router: Router, requests: list[Any], by_index: dict[int, Any],
           keys: dict[int, tuple[int, ...]], rkeys: dict[int, str], cfg: RouterConfig, time_scale: float,
           page: int) -> list[Outcome]:
    arrival = {r.index: int(r.arrival_ms * time_scale * 10**12) for r in requests}
    events: list[tuple[int, int]] = [(arrival[r.index], r.index) for r in requests if r.parent not in by_index]
    heapq.heapify(events)
    start = min(arrival.values())
    poll_fs, trim_fs = int(cfg.load_monitor_interval * FS_PER_S), int(cfg.eviction_interval_secs * FS_PER_S)
    next_poll = start + int(cfg.first_poll_s * FS_PER_S) if cfg.loads else None
    next_trim = start + trim_fs if trim_fs > 0 else None
    completions: list[tuple[int, int]] = []  # (finish time, instance)
    decisions: dict[int, tuple[int, Any, int]] = {}  # index -> (instance, decision, routed at)
    harvested = [0] * len(insts)
    decoded_at_poll = [0] * len(insts)
    observers = [pool_observer(kit) for kit in kits]

    def harvest(k: int) -> None:
        log = insts[k].finished_log
        for index, at in log[harvested[k]:]:
            heapq.heappush(completions, (at, k))
            for child in by_index[index].children:
                if child in by_index:
                    heapq.heappush(events, (max(at, arrival[child]), child))
        harvested[k] = len(log)

    while True:
        route_t = events[0][0] if events else None
        periodic = [t for t in (next_poll, next_trim) if t is not None and route_t is not None]
        horizon = min([route_t, *periodic]) if route_t is not None else None
        behind = [k for k, inst in enumerate(insts) if inst.busy() and (horizon is None or inst.t < horizon)]
        if behind:
            k = min(behind, key=lambda j: insts[j].t)
            insts[k].step(horizon)
            harvest(k)
            continue
        if horizon is None:
            for _, k in sorted(completions):  # the last requests finish: their load guards drop
                router.complete(k)
            break
        while completions and completions[0][0] <= horizon:
            router.complete(heapq.heappop(completions)[1])
        if next_poll is not None and next_poll == horizon:
            router.poll([_load(inst, observers[k], inst.decoded_tokens - decoded_at_poll[k], cfg.load_monitor_interval)
                         for k, inst in enumerate(insts)], horizon / FS_PER_S)
            decoded_at_poll = [inst.decoded_tokens for inst in insts]
            next_poll += poll_fs
            continue
        if next_trim is not None and next_trim == horizon:
            router.trim()
            next_trim += trim_fs
            continue
        at, index = heapq.heappop(events)
        r = by_index[index]
        view = RequestView(index, keys[index], r.prompt_len, rkeys[index], page)
        decision = router.route(view, at / FS_PER_S)
        decisions[index] = (decision.instance, decision, at)
        insts[decision.instance].submit(r, at)
    outcomes = []
    for r in requests:
        k, decision, at = decisions[r.index]
        turn = insts[k].turns[r.index]
        ttft = None if turn.skipped else (turn.first_token_fs - turn.ready_fs) / FS_PER_S
        moved = r.parent in decisions and decisions[r.parent][0] != k
        outcomes.append(Outcome(r.index, r.line, k, decision.predicted_tokens, turn.prefix, turn.prompt, ttft,
                                decision.branch, at / FS_PER_S, moved))
    return outcomes


def replay_trace(trace: str, instances: int, router: str = "cache_aware", router_args: dict[str, Any] | list[str] |
                 None = None, seed: int = 0, profile: str = "stock", *, env_file: str | None = None,
                 model: str | None = None, kv_tokens: int | None = None, session_key: str | None = None,
                 time_scale: float = 1.0, urls: list[str] | None = None,
                 routing_keys: list[str] | None = None) -> FleetRun:
    """Replay a Mooncake-format ``trace`` on ``instances`` instances behind smg's ``router`` policy.

    ``router_args``: ``{"cache_threshold": 0.5}`` or ``["cache_threshold=0.5"]`` (:class:`RouterConfig`'s
    fields); ``profile``: stock, thin, thin+cone, stock+hicache or thin+cone+hicache; ``env_file`` /
    ``model`` / ``kv_tokens``: the geometry as ``simulate`` resolves it; ``session_key``: the trace
    field naming each conversation (its value is the routing key, as ``--gsp-send-routing-key``
    sends one per conversation); ``urls``: the workers' URLs for the hash ring (a real fleet's
    ``--worker-urls``, in order); ``routing_keys``: the key each trace line's request carried (a
    client that sends one a group, not one a conversation), in trace order. Returns a :class:`FleetRun` whose ``outcomes`` are one
    :class:`Outcome` per request in trace order (instance, predicted and cached tokens, TTFT)."""
    import torch

    from overlay_tools.simulate import fleet
    from overlay_tools.simulate import trace as trace_mod
    from overlay_tools.simulate.gateway.router import config_from_args
    from overlay_tools.simulate.inputs import coefficients

    pairs = [f"{k}={v}" for k, v in router_args.items()] if isinstance(router_args, dict) else router_args
    cfg = config_from_args(pairs)
    torch.set_num_threads(1)
    geo = fleet.resolve(env_file, model, kv_tokens)
    requests = trace_mod.prepare(trace_mod.read(trace, session_key, geo.context_len), geo.page,
                                 session_key=session_key)
    return run_fleet(profile, geo, requests, instances, Router(router, instances, cfg, seed, urls, geo.page),
                     coef=coefficients(geo.profile), time_scale=time_scale, routing_keys=routing_keys)
