"""SGLang's gateway (``smg``) choosing a worker per request, reproduced from its Rust source.

Pinned to :data:`SMG_VERSION` (the sdist ``smg-1.13.0.tar.gz`` from the package index; paths below are
inside it). A decision is a pure function of the request, the router's own state and the fleet view
(in-flight counts and the last polled loads) at the modelled instant; every draw comes from one
seeded ``random.Random``, so a run is deterministic.

* ``round_robin`` (``model_gateway/src/policies/round_robin.rs:113``): the rotation of the healthy
  set, starting at 0.
* ``power_of_two`` (``power_of_two.rs:52``): two distinct workers drawn, the lower expected wait
  (:class:`ExpectedWait`) wins; ``load_metric=requests`` first keeps the fewer in flight
  (CLI default ``expected_wait``, ``smg/router_args.py:367``).
* ``cache_aware`` over HTTP (``cache_aware.rs:3215`` ``select_worker_with_text``): the approximate
  tree (:mod:`.tree`) gives the longest match over all workers and the workers holding its deepest
  node; ``match_rate = matched / input``. Above ``cache_threshold`` those holders are the affinity
  group, else the miss path. The group is resolved by ``select_final_from_affinity``
  (``cache_aware.rs:2068``): holders over the count-pressure gate are dropped (``load > mean *
  balance_rel_threshold`` and ``load > mean + margin``, the margin ``min(balance_abs_threshold,
  max(4, ceil(2 sqrt(mean))))``, ``cache_aware.rs:1805-1831``, ``MIN_ABSOLUTE_MARGIN`` l.150);
  the expected wait picks among the rest; when every holder is over the gate the request spills to
  the workers under it. The miss path picks by expected wait over every worker. The request's text
  is inserted for the chosen worker. The tree is trimmed every ``eviction_interval_secs`` to
  ``max_tree_size`` characters, oldest leaves first across all workers
  (``cache_aware.rs:356-393``, ``crates/kv_index/src/string_tree.rs:1132``); it never hears of an
  engine eviction. 1.13.0 has no fleet-wide ``(max - min) > abs and max > rel * min`` switch to
  least-loaded: it leaves affinity fleet-wide only on backend KV usage (``is_kv_imbalanced``, both
  triggers off by default, ``policies/mod.rs:227``); the in-flight rule is the per-candidate gate above.
* The expected wait (``least_load.rs:291`` ``score``, ``:495`` the argmin): with polled loads,
  ``(queued + running * p + unaccounted * p + since-poll tokens) / throughput + w k / (1 - k)``
  (``worker/expected_wait.rs``), ``p`` = ``least_load_mean_prefill_tokens`` (the HTTP path credits
  each dispatch with ``p``, ``least_load.rs:470``), ties within 1e-6 s drawn uniformly; before the
  first poll (a dark fleet) the fewest in flight.
* ``consistent_hashing`` (``consistent_hashing.rs:118``): the routing key on a ring of 150 virtual
  nodes per worker URL, ``blake3(url#i)``'s first 8 bytes little-endian
  (``model_gateway/src/worker/hash_ring.rs:21,62,165``), the first healthy clockwise: given the real
  fleet's ``--worker-urls``, the same worker smg picks.
* ``prefix_hash`` with a routing key (``prefix_hash.rs:330``): ``xxh3_64(key)`` as 16 hex digits on
  the same ring, kept when its load is within ``max(mean * 1.25, mean + 10)`` (mean over load + 1,
  ``prefix_hash.rs:217``), else the least loaded within it. Without a key: the first
  ``prefix_token_count`` tokens.
* ``manual`` (``manual.rs:281``): a key seen first goes to a random worker (assignment mode
  ``random``, the manual policy's default, ``config/types.rs:848``), then stays there; a key whose
  workers are all out of routing gets a new one, the key keeping its last two (``manual.rs:260-267``,
  ``MAX_CANDIDATE_WORKERS`` l.76).
* The worker overload veto (``model_gateway/src/worker/overload.rs``), on by default
  (``smg/router_args.py:271-275``: ``worker_overload_waiting_requests`` 8,
  ``worker_overload_token_usage`` 0.8, ``worker_overload_protection`` True;
  ``--disable-worker-overload-protection`` switches both off, ``overload.rs:89-97``): at each load
  poll (``worker/monitor.rs:1480``, every ``load_monitor_interval``) a worker whose report has
  ``total_waiting_reqs() >= 8`` or ``effective_kv_pressure() >= 0.8`` (``overload.rs:114-126``) is
  latched out of routing until a later poll reads it under both. The waiting count is SGLang's
  ``num_waiting_reqs`` (its waiting queue, ``load_inquirer.py:141``); the KV pressure is the report's
  ``active_token_usage`` or else its ``token_usage`` (``crates/protocols/src/worker.rs:1564-1573``),
  and SGLang 0.5.23 sends no ``active_token_usage``: its ``token_usage`` is
  ``PoolStats.get_kv_token_stats``' (``pool_stats_observer.py:84-93``), on a hybrid SWA pool the
  larger of the Full and the SWA pool's non-evictable share. The same figure is the expected wait's
  ``k``. A vetoed worker is left out of every policy's candidates (``Worker::is_available``,
  ``worker/worker.rs:570``; ``policies/mod.rs:267``); ``cache_aware`` still matches over the whole
  tree, drops the vetoed holders (``cache_aware.rs:2296-2304``) and, with none left, takes the miss
  path over the eligible workers (``select_final_from_affinity`` with no group, l.2089; smg's branch
  metric calls it ``spill``, l.2817-2826), its mean load over the eligible only (l.1495-1515);
  ``round_robin`` keeps one rotation per eligible set, a new set starting at the next shared
  position (``round_robin.rs:75-110``); the hash ring walks on to the first eligible worker
  (``hash_ring.rs:192``). With every worker vetoed the request goes to the fewest in flight, ties
  drawn (``routers/common/overload.rs:115-161, 234``). smg polls on its own clock from its start;
  the replay's first poll is at the first arrival plus ``first_poll_s`` (default 0): where a trace is
  short against the 10 s interval, which instants the polls catch decides whether the veto fires.

Defaults are the CLI's (``smg/router_args.py:88-99, 247-254``): cache_threshold 0.3, balance_abs 64,
balance_rel 1.5, eviction 60 s, max_tree_size 2^26, load poll 10 s. The Rust ``CacheAwareConfig``
default differs (0.5 / 32 / 1.1 / 30 s / 10,000, ``policies/mod.rs:218``); ``smg launch`` passes
the CLI's. What the model leaves out: :func:`left_out`.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

from overlay_tools.simulate.gateway.ring_hash import blake3_digest
from overlay_tools.simulate.gateway.tree import ApproxTree

SMG_VERSION = "1.13.0"
POLICIES = ("cache_aware", "round_robin", "power_of_two", "consistent_hashing", "prefix_hash", "manual")
CHARS_PER_TOKEN = 4  # prefix_hash.rs:114; the tree's sizes are in characters over HTTP
TIE_EPSILON_S = 1e-6  # least_load.rs:31
MIN_ABSOLUTE_MARGIN = 4.0  # cache_aware.rs:150
VIRTUAL_NODES = 150  # hash_ring.rs:21
MANUAL_CANDIDATES = 2  # manual.rs:76


@dataclass(frozen=True)
class RouterConfig:
    """smg's CLI defaults (``router_args.py``); ``--router-arg k=v`` overrides one."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_secs: float = 60.0
    max_tree_size: int = 2**26  # characters (HTTP); the tree counts tokens * CHARS_PER_TOKEN
    load_monitor_interval: float = 10.0
    first_poll_s: float = 0.0  # the replay's: the first poll this long after the first arrival (smg's phase is its own)
    kv_pressure_weight: float = 0.15
    default_throughput: float = 2000.0
    mean_prefill_tokens: int = 1024
    load_metric: str = "expected_wait"  # power_of_two: expected_wait | requests
    prefix_token_count: int = 256
    prefix_hash_load_factor: float = 1.25
    prefix_hash_balance_abs_threshold: int = 10
    tokens_known: bool = False  # gRPC: dispatch credit is the prompt's tokens, not mean_prefill_tokens
    loads: bool = True  # workers answer /v1/loads (SGLang does); off: a dark fleet, fewest in flight
    worker_overload_protection: bool = True  # smg's default; --disable-worker-overload-protection: False
    worker_overload_waiting_requests: int = 8  # 0: this signal off (smg's None)
    worker_overload_token_usage: float = 0.8  # 0: this signal off (smg's None)


# smg's CLI spelling of worker_overload_protection=False (``router_args.py:2434-2441``)
DISABLE_OVERLOAD_KEY = "disable_worker_overload_protection"


def over_gate(load: float, mean: float, cfg: RouterConfig) -> bool:
    """A holder with ``load`` in flight over the count-pressure gate at the fleet's ``mean``
    (``cache_aware.rs:1805-1831``)."""
    margin = min(float(cfg.balance_abs_threshold), max(math.ceil(2 * math.sqrt(mean)), MIN_ABSOLUTE_MARGIN))
    return load > mean * cfg.balance_rel_threshold and load > mean + margin


def config_from_args(pairs: list[str] | None) -> RouterConfig:
    """``k=v`` strings into a :class:`RouterConfig`; an unknown key or a bad value is a ``ConfigError``."""
    from adapter.core import env

    kinds = {f.name: f.type for f in fields(RouterConfig)}
    values: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if sep and key == DISABLE_OVERLOAD_KEY:  # smg's flag: disable_worker_overload_protection=true
            key, text = "worker_overload_protection", {"1": "0", "0": "1", "true": "false", "false": "true",
                                                       "on": "off", "off": "on"}.get(text.lower(), text)
        if not sep or key not in kinds:
            raise env.ConfigError("--router-arg", pair, "k=v with k one of " + ", ".join([*kinds, DISABLE_OVERLOAD_KEY]))
        kind = kinds[key]
        try:
            if kind == "bool":
                if text.lower() not in ("1", "0", "true", "false", "on", "off"):
                    raise ValueError(text)
                values[key] = text.lower() in ("1", "true", "on")
            elif kind == "int":
                values[key] = int(text)
            elif kind == "float":
                values[key] = float(text)
            else:
                values[key] = text
        except ValueError:
            raise env.ConfigError("--router-arg", pair, f"{key} as a {kind}") from None
    cfg = RouterConfig(**values)
    if cfg.load_metric not in ("expected_wait", "requests"):
        raise env.ConfigError("--router-arg", f"load_metric={cfg.load_metric}", "expected_wait or requests")
    if not 0 <= cfg.cache_threshold <= 1:
        raise env.ConfigError("--router-arg", f"cache_threshold={cfg.cache_threshold}", "a ratio in [0, 1]")
    if cfg.worker_overload_waiting_requests < 0:
        raise env.ConfigError("--router-arg", f"worker_overload_waiting_requests={cfg.worker_overload_waiting_requests}",
                              "a count >= 1 (0: that signal off)")
    if not 0 <= cfg.worker_overload_token_usage <= 1:
        raise env.ConfigError("--router-arg", f"worker_overload_token_usage={cfg.worker_overload_token_usage}",
                              "a usage in (0, 1] (0: that signal off)")
    if not 0 <= cfg.first_poll_s < cfg.load_monitor_interval:
        raise env.ConfigError("--router-arg", f"first_poll_s={cfg.first_poll_s}",
                              f"seconds in [0, load_monitor_interval={cfg.load_monitor_interval:g})")
    if cfg.eviction_interval_secs < 0 or cfg.load_monitor_interval <= 0:
        raise env.ConfigError("--router-arg", "eviction_interval_secs / load_monitor_interval",
                              "eviction interval >= 0 (0: never trimmed), poll interval > 0")
    return cfg


@dataclass(frozen=True)
class RequestView:
    """What the router sees of one request: its pages' keys (the text equivalent), prompt tokens,
    the routing key (one per conversation, as ``bench_serving --gsp-send-routing-key`` sends)."""

    index: int
    page_keys: tuple[int, ...]
    prompt_tokens: int
    routing_key: str
    page: int


@dataclass(frozen=True)
class Load:
    """One worker's polled ``/v1/loads`` (the fields the expected wait and the overload veto read)."""

    waiting_uncached_tokens: int
    waiting_reqs: int
    running_reqs: int
    gen_throughput: float
    token_usage: float  # SGLang's: on a hybrid SWA pool max(Full, SWA) non-evictable share


def overloaded(load: Load, cfg: RouterConfig) -> bool:
    """smg's veto of one polled report (``worker/overload.rs:114-126``: either signal at or over its
    threshold); never while protection is off (``overload.rs:89-97``)."""
    if not cfg.worker_overload_protection:
        return False
    if cfg.worker_overload_waiting_requests and load.waiting_reqs >= cfg.worker_overload_waiting_requests:
        return True
    return bool(cfg.worker_overload_token_usage) and load.token_usage >= cfg.worker_overload_token_usage



@dataclass
class Decision:
    instance: int
    predicted_tokens: int  # the router tree's match for the chosen worker
    branch: str  # hit | miss | spill | ring | sticky | rotation | pair


@dataclass
class _SincePoll:
    tokens: int = 0
    requests: int = 0
    dispatches: deque = field(default_factory=deque)  # (time s, tokens)


class ExpectedWait:
    """LeastLoad's expected-wait argmin and since-poll credit (``least_load.rs``)."""

    def __init__(self, cfg: RouterConfig, n: int, rng: random.Random):
        self.cfg, self.rng = cfg, rng
        self.loads: list[Load | None] = [None] * n
        self.since = [_SincePoll() for _ in range(n)]

    def update(self, loads: list[Load], sampled_at: float) -> None:
        """A poll: each report releases the dispatches made up to its sample."""
        self.loads = list(loads)
        for s in self.since:
            while s.dispatches and s.dispatches[0][0] <= sampled_at:
                _, tokens = s.dispatches.popleft()
                s.tokens -= tokens
                s.requests -= 1

    def score(self, i: int, in_flight: list[int]) -> float:
        load = self.loads[i]
        if load is None:  # the whole fleet dark: join-shortest-queue on in-flight
            return float(in_flight[i])
        p = self.cfg.mean_prefill_tokens
        s = self.since[i]
        queued = load.waiting_uncached_tokens if load.waiting_uncached_tokens > 0 else load.waiting_reqs * p
        unaccounted = max(0, in_flight[i] - (load.running_reqs + load.waiting_reqs + s.requests))
        work = queued + load.running_reqs * p + unaccounted * p
        throughput = load.gen_throughput if load.gen_throughput > 0 else self.cfg.default_throughput
        k = min(max(load.token_usage, 0.0), 0.999)
        return (work + s.tokens) / throughput + self.cfg.kv_pressure_weight * k / (1 - k)

    def select(self, candidates: list[int], in_flight: list[int], now: float, tokens: int) -> int:
        best, best_score, tied = candidates[0], self.score(candidates[0], in_flight), 1
        for i in candidates[1:]:
            s = self.score(i, in_flight)
            if s < best_score - TIE_EPSILON_S:
                best, best_score, tied = i, s, 1
            elif abs(s - best_score) <= TIE_EPSILON_S:
                tied += 1
                best_score = min(best_score, s)
                if self.rng.randrange(tied) == 0:
                    best = i
        credit = tokens if self.cfg.tokens_known else self.cfg.mean_prefill_tokens
        s = self.since[best]
        s.tokens += credit
        s.requests += 1
        s.dispatches.append((now, credit))
        return best


def _ring_position(text: str) -> int:
    """``HashRing::hash_position``: BLAKE3's first 8 bytes, little-endian (:mod:`.ring_hash`)."""
    return int.from_bytes(blake3_digest(text.encode())[:8], "little")


def _xxh3_hex(data: bytes) -> str:
    try:
        import xxhash

        return f"{xxhash.xxh3_64_intdigest(data):016x}"
    except ModuleNotFoundError:
        return f"{int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), 'little'):016x}"


class HashRing:
    """``hash_ring.rs``: VIRTUAL_NODES positions per worker URL, the first clockwise from the key."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.entries = sorted((_ring_position(f"{url}#{v}"), i) for i, url in enumerate(urls)
                              for v in range(VIRTUAL_NODES))
        self.positions = [p for p, _ in self.entries]

    def find(self, key: str, eligible: list[int] | None = None) -> int:
        """The first worker clockwise from ``key`` (among ``eligible``: ``find_healthy_url``, l.192)."""
        import bisect

        start = bisect.bisect_left(self.positions, _ring_position(key))
        for step in range(len(self.entries)):
            i = self.entries[(start + step) % len(self.entries)][1]
            if eligible is None or i in eligible:
                return i
        raise ValueError("no eligible worker on the ring")


def worker_urls(n: int) -> list[str]:
    """The workers' URLs the ring hashes (a real fleet's ``--worker-urls`` place it differently)."""
    return [f"http://worker-{i}:30000" for i in range(n)]


class Router:
    """One smg policy over ``n`` workers. :meth:`route` is the decision; :meth:`poll`,
    :meth:`trim` and :meth:`complete` are the gateway's periodic tasks and the load guard."""

    def __init__(self, policy: str, n: int, cfg: RouterConfig | None = None, seed: int = 0,
                 urls: list[str] | None = None, page: int = 1):
        if policy not in POLICIES:
            from adapter.core import env

            raise env.ConfigError("--router", policy, "one of " + ", ".join(POLICIES))
        if n < 1:
            raise ValueError(f"instances={n}: expected at least 1")
        self.policy, self.n, self.cfg, self.page = policy, n, cfg or RouterConfig(), page
        self.rng = random.Random(seed)
        self.in_flight = [0] * n
        self.tree = ApproxTree()  # cache_aware's tree; for the other policies a shadow of the same kind
        self.wait = ExpectedWait(self.cfg, n, self.rng)
        self.urls = urls or worker_urls(n)
        self.ring = HashRing(self.urls) if policy in ("consistent_hashing", "prefix_hash") else None
        self.pinned: dict[str, list[int]] = {}  # manual: a key's workers, the last two
        self.rotations: dict[tuple[int, ...], int] = {}  # round_robin: one rotation per eligible set
        self.next_start = 0
        self.branches: dict[str, int] = {}
        self.vetoed = [False] * n  # the overload veto's latch, written at each poll
        self.veto_polls = [0] * n  # polls that found each worker over a threshold
        self.veto_edges = [0] * n  # times each worker went out of routing (smg's "veto set" lines)

    # -- the gateway's periodic tasks and load guard ----------------------------------------------
    def poll(self, loads: list[Load], now: float) -> None:
        """The load monitor's poll: the expected wait's reports, and the overload veto latched per
        worker (``monitor.rs:1480``, once per report)."""
        if not self.cfg.loads:
            return
        self.wait.update(loads, now)
        for i, load in enumerate(loads):
            verdict = overloaded(load, self.cfg)
            self.veto_polls[i] += verdict
            self.veto_edges[i] += verdict and not self.vetoed[i]
            self.vetoed[i] = verdict

    def trim(self) -> None:
        self.tree.evict_to(self.cfg.max_tree_size // CHARS_PER_TOKEN // self.page)

    def complete(self, instance: int) -> None:
        self.in_flight[instance] -= 1

    # -- the decision ---------------------------------------------------------------------------
    def route(self, req: RequestView, now: float) -> Decision:
        eligible = [i for i in range(self.n) if not self.vetoed[i]]
        if eligible:
            instance, branch = getattr(self, "_" + self.policy)(req, now, eligible)
        else:  # every worker vetoed: the fewest in flight, ties drawn (overload.rs:115-161, 234)
            fewest = min(self.in_flight)
            instance, branch = self.rng.choice([i for i in range(self.n) if self.in_flight[i] == fewest]), "all vetoed"
        cap = (req.prompt_tokens - 1) // req.page * req.page  # one token always runs (as the engine's match)
        predicted = min(cap, self.tree.depth_for(req.page_keys, instance) * req.page)  # before its own insert
        self.tree.insert(req.page_keys, instance)
        self.in_flight[instance] += 1
        self.branches[branch] = self.branches.get(branch, 0) + 1
        return Decision(instance, predicted, branch)

    def _expected_wait(self, candidates: list[int], req: RequestView, now: float) -> int:
        return self.wait.select(candidates, self.in_flight, now, req.prompt_tokens)

    def _gated(self, i: int, mean: float) -> bool:
        return over_gate(self.in_flight[i], mean, self.cfg)

    def _cache_aware(self, req: RequestView, now: float, eligible: list[int]) -> tuple[int, str]:
        mean = sum(self.in_flight[i] for i in eligible) / len(eligible)  # the eligible workers' (l.1495-1515)
        matched, holders = self.tree.match(req.page_keys)  # the whole tree, vetoed holders included
        rate = matched * req.page / req.prompt_tokens if req.prompt_tokens else 0.0
        if rate <= self.cfg.cache_threshold or not holders:
            return self._expected_wait(eligible, req, now), "miss"
        group = [i for i in sorted(holders) if not self.vetoed[i]]
        if not group:  # every holder out of routing: the miss path over the eligible (smg's metric: spill)
            return self._expected_wait(eligible, req, now), "veto"
        safe = [i for i in group if not self._gated(i, mean)]
        if safe:
            return self._expected_wait(safe, req, now), "hit"
        spill = [i for i in eligible if not self._gated(i, mean)] or eligible
        return self._expected_wait(spill, req, now), "spill"

    def _round_robin(self, req: RequestView, now: float, eligible: list[int]) -> tuple[int, str]:
        key = tuple(eligible)
        if key not in self.rotations:  # a set seen first starts at the shared position (round_robin.rs:75-110)
            self.rotations[key] = self.next_start
            self.next_start += 1
        count = self.rotations[key]
        self.rotations[key] += 1
        return eligible[count % len(eligible)], "rotation"

    def _power_of_two(self, req: RequestView, now: float, eligible: list[int]) -> tuple[int, str]:
        if len(eligible) == 1:
            return eligible[0], "single"
        m = len(eligible)
        a = self.rng.randrange(m)
        b = (a + 1 + self.rng.randrange(m - 1)) % m
        pair = [eligible[a], eligible[b]]
        if self.cfg.load_metric == "requests":
            fewest = min(self.in_flight[i] for i in pair)
            pair = [i for i in pair if self.in_flight[i] == fewest]
        return self._expected_wait(pair, req, now), "pair"

    def _consistent_hashing(self, req: RequestView, now: float, eligible: list[int]) -> tuple[int, str]:
        assert self.ring is not None
        i = self.ring.find(req.routing_key, eligible)
        return i, "ring" if i == self.ring.find(req.routing_key) else "veto"

    def _prefix_hash(self, req: RequestView, now: float, eligible: list[int]) -> tuple[int, str]:
        assert self.ring is not None
        key = req.routing_key.encode() if req.routing_key else repr(req.page_keys[:max(1, self.cfg.prefix_token_count // req.page)]).encode()
        i = self.ring.find(_xxh3_hex(key), eligible)
        total = sum(self.in_flight[j] for j in eligible)

        def load_ok(j: int) -> bool:
            if total == 0:
                return True
            mean = (total + 1) / len(eligible)
            limit = max(mean * self.cfg.prefix_hash_load_factor, mean + self.cfg.prefix_hash_balance_abs_threshold)
            return self.in_flight[j] <= limit

        if load_ok(i):
            return i, "ring"
        ok = [j for j in eligible if load_ok(j)]
        if ok:
            return min(ok, key=lambda j: self.in_flight[j]), "walk"
        return i, "walk"

    def _manual(self, req: RequestView, now: float, eligible: list[int]) -> tuple[int, str]:
        held = self.pinned.get(req.routing_key)
        if held is not None:
            for i in held:
                if i in eligible:
                    return i, "sticky"
        i = eligible[self.rng.randrange(len(eligible))]
        if held is None:
            self.pinned[req.routing_key] = [i]
            return i, "new key"
        self.pinned[req.routing_key] = [*held, i][-MANUAL_CANDIDATES:]
        return i, "veto"


def left_out(cfg: RouterConfig) -> list[str]:
    """What the router model simplifies, said in the output."""
    items = [
        f"router: smg {SMG_VERSION}'s policies re-implemented from its Rust source (gateway/router.py cites the "
        "lines), not run; every worker healthy, no circuit breaker, retries, liveness veto or warm-up slice",
        "cache_aware tree: over the request's pages of token ids (the trace's hash_ids blocks, page-sized), "
        f"not its characters; sizes count {CHARS_PER_TOKEN} characters a token (smg's prefix_hash estimate); "
        "a match ends at a page boundary; trimmed oldest-leaf-first by insert time (smg refreshes a match's "
        "timestamps 1 in 8 times, not modelled); matched holders: every worker at the deepest page (smg caps "
        "the list and iterates a concurrent map)",
        "loads: the /v1/loads poll is the instance's modelled state every load_monitor_interval s (waiting "
        "requests and their uncached tokens at the instance's recent hit rate, running requests, output "
        "tokens/s over the interval, token usage = non-evictable Full KV share); the poll's sample instant is "
        "the poll's" + ("" if cfg.loads else " (off here: loads=0, a dark fleet scored by in-flight counts)"),
        "in flight: a request counts on its worker from its routing to its last output token",
        ("overload veto: " + (f"smg's, on (waiting >= {cfg.worker_overload_waiting_requests or 'off'}, KV usage >= "
                              f"{cfg.worker_overload_token_usage or 'off'}), read at each modelled poll from the instance's "
                              "waiting queue and SGLang's own pool usage (max(Full, SWA) non-evictable share); no "
                              "--worker-overload-shed, no per-worker thresholds, no pushed load records"
                              if cfg.worker_overload_protection and cfg.loads else
                              "off here (--disable-worker-overload-protection)" if cfg.loads else
                              "never (a dark fleet sends no loads: the veto clears)")),
        "cache_aware: no KV-usage imbalance trigger (off by default), overlap_decay 0 and selection "
        "temperature 0 (smg's defaults), no cache namespaces, no mesh sync",
        "predicted hit: the router tree's match for the chosen worker (for policies without a tree, a shadow "
        "tree of the same kind), capped at the engine's longest allowed match",
    ]
    try:
        import xxhash  # noqa: F401
    except ModuleNotFoundError:
        items.append("prefix_hash: blake2b stands in for its xxh3_64 of the key (xxhash is not installed): the same "
                     "stickiness, other ring positions than a real smg's (consistent_hashing's ring is smg's own: "
                     "BLAKE3 of the same URLs and keys)")
    return items
