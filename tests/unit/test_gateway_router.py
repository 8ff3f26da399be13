"""smg 1.13.0's policies as the fleet replay reproduces them (``overlay_tools.simulate.gateway``):
facts in (the router's tree, in-flight counts, polled loads, a seed), the chosen worker out."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from adapter.core import env
from overlay_tools.simulate.gateway.router import Load, RequestView, Router, RouterConfig, config_from_args
from overlay_tools.simulate.gateway.tree import ApproxTree


def _request(pages: list[int], key: str = "conv-0", index: int = 0, page: int = 16) -> RequestView:
    chain, keys = 0, []
    for p in pages:
        chain = hash((chain, p))
        keys.append(chain)
    return RequestView(index, tuple(keys), len(pages) * page, key, page)


def _seeded_tree(router: Router, holder: int, pages: list[int]) -> None:
    router.tree.insert(_request(pages).page_keys, holder)


@dataclass(frozen=True)
class ThresholdRow:
    name: str
    cache_threshold: float
    matched_pages: int  # of a 4-page request, held by worker 1
    want: int
    branch: str


THRESHOLD_ROWS = [
    ThresholdRow("a deep match above the threshold goes to its holder", 0.3, 3, 1, "hit"),
    ThresholdRow("a match rate equal to the threshold is a miss (strictly above wins)", 0.5, 2, 0, "miss"),
    ThresholdRow("a shallow match below the threshold is a miss: the least loaded", 0.3, 1, 0, "miss"),
    ThresholdRow("a raised threshold turns the deep match into a miss", 0.8, 3, 0, "miss"),
]


@pytest.mark.parametrize("row", THRESHOLD_ROWS, ids=lambda r: r.name)
def test_cache_aware_routes_to_the_deepest_holder_only_above_the_cache_threshold(row):
    """Worker 1 holds the first ``matched_pages`` pages and has one request in flight, worker 0 none:
    a hit goes to the holder, a miss to the fewest in flight (no loads polled yet: a dark fleet)."""
    router = Router("cache_aware", 2, RouterConfig(cache_threshold=row.cache_threshold), seed=0)
    _seeded_tree(router, 1, [*[1, 2, 3, 4][: row.matched_pages], 99])
    router.in_flight = [0, 1]
    decision = router.route(_request([1, 2, 3, 4]), now=0.0)
    assert (decision.instance, decision.branch) == (row.want, row.branch)


@dataclass(frozen=True)
class GateRow:
    name: str
    in_flight: tuple[int, int]
    abs_threshold: int
    want: int
    branch: str


GATE_ROWS = [
    # mean 5: relative bar 7.5, margin min(64, max(ceil(2 sqrt 5) = 5, 4)) = 5, absolute bar 10
    GateRow("a holder at the absolute bar keeps its affinity", (0, 10), 64, 1, "hit"),
    # mean 5.5: relative bar 8.25, margin 5, absolute bar 10.5
    GateRow("a holder over both bars spills to the least loaded", (0, 11), 64, 0, "spill"),
    # mean 3: relative bar 4.5; the margin is capped at the configured 0
    GateRow("with balance_abs_threshold 0 the relative bar alone decides (under it)", (2, 4), 0, 1, "hit"),
    GateRow("with balance_abs_threshold 0 the relative bar alone decides (over it)", (1, 5), 0, 0, "spill"),
    # mean 20: relative bar 30, margin min(64, ceil(2 sqrt 20) = 9) = 9: absolute bar 29
    GateRow("the margin follows the swing of the mean, not the configured 64", (9, 31), 64, 0, "spill"),
]


@pytest.mark.parametrize("row", GATE_ROWS, ids=lambda r: r.name)
def test_cache_aware_spills_a_holder_over_the_count_pressure_gate(row):
    """The imbalance rule of smg 1.13.0 on in-flight counts: a holder over ``mean * balance_rel_threshold``
    AND ``mean + margin`` is dropped from the affinity group; with none left the request spills to the
    workers under the gate (the least loaded of them)."""
    router = Router("cache_aware", 2, RouterConfig(balance_abs_threshold=row.abs_threshold), seed=0)
    _seeded_tree(router, 1, [1, 2, 3, 4])
    router.in_flight = list(row.in_flight)
    decision = router.route(_request([1, 2, 3, 4, 5]), now=0.0)
    assert (decision.instance, decision.branch) == (row.want, row.branch)


def test_the_chosen_worker_gets_the_prompt_in_the_tree_and_the_prediction_is_its_match_before_that():
    router = Router("cache_aware", 2, seed=0)
    _seeded_tree(router, 1, [1, 2, 3])
    first = router.route(_request([1, 2, 3, 4, 5]), now=0.0)
    assert first.instance == 1 and first.predicted_tokens == 3 * 16
    again = router.route(_request([1, 2, 3, 4, 5, 6]), now=0.0)
    assert again.instance == 1 and again.predicted_tokens == 5 * 16
    assert router.in_flight == [0, 2]


def test_the_tree_trim_drops_the_oldest_leaves_first_across_workers_and_keeps_its_invariants():
    tree = ApproxTree()
    old, shared, new = _request([1, 2, 3]), _request([1, 2, 7]), _request([5, 6])
    tree.insert(old.page_keys, 0)
    tree.insert(shared.page_keys, 1)
    tree.insert(new.page_keys, 0)
    assert tree.size == 3 + 3 + 2
    tree.evict_to(5)
    # worker 0's [1, 2, 3] is oldest: its leaf, then its [1, 2] (now leaves of worker 0) go; worker 1 keeps all
    assert tree.depth_for(old.page_keys, 0) == 0
    assert tree.depth_for(shared.page_keys, 1) == 3 and tree.depth_for(new.page_keys, 0) == 2
    assert tree.size == 5 and tree.evicted == 3
    for node in tree.nodes.values():  # a tenant on a node is on its parent; no node without tenants
        assert node.tenants
        if node.parent is not None:
            assert set(node.tenants) <= set(tree.nodes[node.parent].tenants)
    assert tree.size == sum(len(n.tenants) for n in tree.nodes.values())


def test_a_trimmed_prefix_no_longer_wins_its_holder():
    """max_tree_size in characters (4 a token): 8 pages of 16 tokens is 512 characters."""
    router = Router("cache_aware", 2, RouterConfig(max_tree_size=4 * 16 * 8), seed=0, page=16)
    _seeded_tree(router, 1, list(range(10)))  # 10 pages: over the budget
    router.in_flight = [0, 1]
    router.trim()
    assert router.tree.size <= 8
    decision = router.route(_request([*range(10), 50]), now=0.0)
    assert decision.instance == 1 and decision.predicted_tokens == 8 * 16  # what is left still matches
    router.trim()
    router.tree.evict_to(0)
    router.in_flight = [0, 1]
    assert router.route(_request([*range(10), 51]), now=0.0).branch == "miss"


def test_power_of_two_is_deterministic_for_a_seed_and_samples_two_distinct_workers():
    def picks(seed: int) -> list[int]:
        router = Router("power_of_two", 8, seed=seed)
        out = []
        for i in range(40):
            out.append(router.route(_request([i]), now=0.0).instance)
            if i % 3 == 0:
                router.complete(out[-1])
        return out

    assert picks(7) == picks(7)
    assert picks(7) != picks(8)
    router = Router("power_of_two", 2, seed=1)
    router.in_flight = [5, 0]
    assert all(router.route(_request([i]), now=0.0).instance == 1 for i in range(3))  # the pair is both


@pytest.mark.parametrize("policy", ["consistent_hashing", "prefix_hash", "manual"])
def test_a_routing_key_keeps_a_conversation_on_one_worker_whatever_the_load(policy):
    router = Router(policy, 4, seed=3)
    homes = {}
    for turn in range(5):
        for conv in range(12):
            decision = router.route(_request([conv, turn], key=f"conv-{conv}"), now=float(turn))
            assert homes.setdefault(conv, decision.instance) == decision.instance, (conv, turn)
            if policy != "prefix_hash":
                router.in_flight[decision.instance] += 5  # load never moves a consistent hash or a pin
    assert len(set(homes.values())) > 1


def test_prefix_hash_walks_off_an_overloaded_ring_target():
    router = Router("prefix_hash", 4, seed=0)
    home = router.route(_request([1], key="hot"), now=0.0).instance
    router.in_flight[home] = 40  # mean (41 + 1) / 4: limit max(13.1, 20.5)
    moved = router.route(_request([1, 2], key="hot"), now=1.0)
    assert moved.instance != home and moved.branch == "walk"


def test_round_robin_rotates_from_the_first_worker():
    router = Router("round_robin", 3)
    assert [router.route(_request([i]), now=0.0).instance for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_the_expected_wait_reads_polled_queues_and_credits_dispatches_until_the_next_poll():
    """Equal loads polled: the first miss goes to either (a tie drawn from the seed), the second to the
    other (the credit of 1,024 tokens); a worker reporting a deep queue loses until its report drains."""
    router = Router("cache_aware", 2, seed=0)
    idle = Load(0, 0, 0, 0.0, 0.0)
    router.poll([idle, idle], now=0.0)
    first = router.route(_request([1], index=0), now=1.0).instance
    second = router.route(_request([2], index=1), now=1.0).instance
    assert {first, second} == {0, 1}
    router.poll([Load(50_000, 7, 4, 0.0, 0.2), idle], now=10.0)  # 7 waiting: under the overload veto's 8
    assert [router.route(_request([10 + i], index=2 + i), now=11.0).instance for i in range(3)] == [1, 1, 1]


@dataclass(frozen=True)
class VetoRow:
    name: str
    load: Load
    args: tuple[str, ...]
    vetoed: bool


VETO_ROWS = [
    VetoRow("KV usage at the 0.8 ceiling", Load(0, 0, 2, 0.0, 0.8), (), True),
    VetoRow("KV usage just under it", Load(0, 0, 2, 0.0, 0.7999), (), False),
    VetoRow("8 waiting requests", Load(0, 8, 2, 0.0, 0.1), (), True),
    VetoRow("7 waiting requests", Load(0, 7, 2, 0.0, 0.1), (), False),
    VetoRow("smg's flag switches both signals off", Load(0, 8, 2, 0.0, 1.0),
            ("disable_worker_overload_protection=true",), False),
    VetoRow("a signal set to 0 is off, the other still vetoes", Load(0, 8, 2, 0.0, 0.9),
            ("worker_overload_token_usage=0",), True),
    VetoRow("a raised ceiling", Load(0, 0, 2, 0.0, 0.9), ("worker_overload_token_usage=1.0",), False),
]


@pytest.mark.parametrize("row", VETO_ROWS, ids=lambda r: r.name)
def test_a_poll_at_or_over_an_overload_threshold_takes_the_holder_out_of_routing(row):
    """smg's veto (``worker/overload.rs:114``: ``>=`` either threshold) latched at a poll: the holder of
    the request's history is skipped (the miss path over the others) until a poll reads it under; the
    moved conversation's next turn then follows its deeper history on the other worker."""
    router = Router("cache_aware", 2, config_from_args(list(row.args)), seed=0)
    _seeded_tree(router, 1, [1, 2, 3, 4])
    idle = Load(0, 0, 0, 0.0, 0.0)
    router.poll([idle, row.load], now=10.0)
    decision = router.route(_request([1, 2, 3, 4, 5]), now=10.5)
    assert (decision.instance, decision.branch) == ((0, "veto") if row.vetoed else (1, "hit"))
    assert router.vetoed == [False, row.vetoed] and router.veto_polls == [0, int(row.vetoed)]
    router.poll([idle, idle], now=20.0)
    assert router.vetoed == [False, False]
    assert router.route(_request([1, 2, 3, 4, 5, 6]), now=20.5).instance == decision.instance


def test_the_veto_steers_every_policy_to_the_eligible_workers_and_all_vetoed_to_the_fewest_in_flight():
    busy = Load(0, 0, 1, 0.0, 0.95)
    idle = Load(0, 0, 0, 0.0, 0.0)
    # round_robin: one rotation per eligible set, a new set starting at the next shared position
    router = Router("round_robin", 3)
    assert [router.route(_request([i]), now=0.0).instance for i in range(2)] == [0, 1]
    router.poll([idle, busy, idle], now=10.0)
    assert [router.route(_request([i]), now=10.0).instance for i in range(4)] == [2, 0, 2, 0]  # set (0, 2) starts at 1
    router.poll([idle, idle, idle], now=20.0)
    assert router.route(_request([9]), now=20.0).instance == 2  # the whole set's rotation resumes
    # consistent_hashing: the ring walks on to the next eligible worker; the key returns home after
    ring = Router("consistent_hashing", 4)
    home = ring.route(_request([1], key="conv-7"), now=0.0).instance
    ring.poll([busy if i == home else idle for i in range(4)], now=10.0)
    away = ring.route(_request([1, 2], key="conv-7"), now=10.0)
    assert away.instance != home and away.branch == "veto"
    ring.poll([idle] * 4, now=20.0)
    assert ring.route(_request([1, 2, 3], key="conv-7"), now=20.0).instance == home
    # every worker vetoed: the fewest in flight
    router = Router("cache_aware", 3, seed=0)
    router.in_flight = [3, 1, 2]
    router.poll([busy] * 3, now=10.0)
    assert (router.route(_request([5]), now=10.0).instance, router.branches) == (1, {"all vetoed": 1})


def test_a_bad_router_arg_names_the_key_and_what_is_allowed():
    assert config_from_args(["cache_threshold=0.5", "loads=off"]) == RouterConfig(cache_threshold=0.5, loads=False)
    assert config_from_args(["disable_worker_overload_protection=true"]) == RouterConfig(worker_overload_protection=False)
    with pytest.raises(env.ConfigError, match=r"worker_overload_token_usage=1.5.*\(0, 1\]"):
        config_from_args(["worker_overload_token_usage=1.5"])
    with pytest.raises(env.ConfigError, match=r"first_poll_s=10.0.*\[0, load_monitor_interval=10\)"):
        config_from_args(["first_poll_s=10"])
    with pytest.raises(env.ConfigError, match=r"--router-arg.*cache_treshold"):
        config_from_args(["cache_treshold=0.5"])
    with pytest.raises(env.ConfigError, match=r"balance_abs_threshold as a int"):
        config_from_args(["balance_abs_threshold=lots"])


def test_the_ring_hash_is_blake3():
    """The specification's vectors (empty input; "abc"): the ring places URLs and keys where smg does."""
    from overlay_tools.simulate.gateway.ring_hash import blake3_digest

    assert blake3_digest(b"").hex() == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    assert blake3_digest(b"abc").hex() == "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
    with pytest.raises(ValueError, match="one chunk"):
        blake3_digest(bytes(1025))
