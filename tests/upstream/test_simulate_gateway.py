"""The fleet replay (``simulate --instances N --router P``): conversations through smg 1.13.0's
policies onto N real ``UnifiedRadixCache`` instances. Page 16, window 8, chunk 128; the traces are made
here: three conversations of three turns, each turn its parent's prompt + output + a new block."""

from __future__ import annotations

import json

import pytest

from adapter.ops import cli
from devkit.testkit.simulate_fleet import PAGE, small_fleet
from overlay_tools.simulate import engine, fleet, trace
from overlay_tools.simulate.gateway import report
from overlay_tools.simulate.gateway.replay import run_fleet
from overlay_tools.simulate.gateway.router import Router, RouterConfig

CONVERSATIONS, TURNS = 3, 3


def _geometry() -> fleet.Fleet:
    return small_fleet(swa_pool=4096)


def _conversations(tmp_path) -> list[trace.Request]:
    """Conversation c, turn k at 20 k s + 10 c ms (every parent has finished by then): 1,024 + 512 k
    tokens (its own blocks), 33 out."""
    rows = []
    for k in range(TURNS):
        for c in range(CONVERSATIONS):
            rows.append({"timestamp": 20_000 * k + 10 * c, "input_length": 1024 + 512 * k, "output_length": 33,
                         "hash_ids": [100 * c + b for b in range(2 + k)]})
    path = tmp_path / "conversations.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return trace.load(str(path), PAGE)


def _run(requests, policy: str, instances: int = 2, seed: int = 0, profile: str = "stock", **cfg):
    run = run_fleet(profile, _geometry(), requests, instances, Router(policy, instances, RouterConfig(**cfg), seed,
                                                                      page=PAGE), coef=None or _coef())
    assert run.leaks == [0] * instances
    return run


def _coef():
    from adapter import cost_model

    return cost_model.DEFAULTS


def _parents(requests):
    return {r.index: r.parent for r in requests}


@pytest.mark.parametrize("profile", ["stock", "thin+cone"])
def test_cache_aware_keeps_each_turn_on_the_instance_holding_its_history(tmp_path, profile):
    """The router's tree holds the parent's prompt (1,024 tokens: a match rate of 2/3 over 0.3), so each
    continuation lands on its parent's instance and the engine serves the whole history (prompt +
    output - 1, page-floored: 1,056), more than the router predicted (it never saw the output)."""
    requests = _conversations(tmp_path)
    run = _run(requests, "cache_aware", profile=profile)
    by_index = {o.index: o for o in run.outcomes}
    for r in requests:
        o = by_index[r.index]
        if r.parent is None:
            assert o.cached_tokens == 0 and o.branch == "miss"
            continue
        parent = requests[r.parent]
        assert o.instance == by_index[r.parent].instance and o.branch == "hit"
        assert o.predicted_tokens == parent.prompt_len
        assert o.cached_tokens == parent.history_len > o.predicted_tokens
    row = report.summarize(run, engine.ideal_prefixes(requests, PAGE))
    assert row["recomputed_beyond_ideal"] == 0 and row["overpromised_requests"] == 0


def test_round_robin_moves_every_turn_and_recomputes_the_history_the_other_instance_holds(tmp_path):
    """Three conversations on two instances: the rotation sends every continuation to the other
    instance. A second turn finds nothing of its conversation there (nothing cached, nothing
    predicted); a third finds its first turn's history (1,056) where the router's tree has its first
    prompt (1,024)."""
    requests = _conversations(tmp_path)
    run = _run(requests, "round_robin")
    by_index = {o.index: o for o in run.outcomes}
    assert [by_index[i].instance for i in range(len(requests))] == [i % 2 for i in range(len(requests))]
    for r in requests:
        if r.parent is None:
            continue
        o = by_index[r.index]
        assert o.instance != by_index[r.parent].instance
        grandparent = requests[r.parent].parent
        if grandparent is None:
            assert o.cached_tokens == 0 == o.predicted_tokens
        else:
            assert (o.cached_tokens, o.predicted_tokens) == (requests[grandparent].history_len,
                                                             requests[grandparent].prompt_len)
    ideal = engine.ideal_prefixes(requests, PAGE)
    rr = report.summarize(run, ideal)
    ca = report.summarize(_run(requests, "cache_aware"), ideal)
    lost = sum(requests[r.parent].history_len - (requests[requests[r.parent].parent].history_len
                                                 if requests[r.parent].parent is not None else 0)
               for r in requests if r.parent is not None)
    assert rr["recomputed_tokens"] - ca["recomputed_tokens"] == lost > 0
    assert rr["requests_per_instance"] == [5, 4]


@pytest.mark.parametrize("policy", ["consistent_hashing", "manual", "prefix_hash"])
def test_a_routing_key_per_conversation_keeps_its_turns_together_and_their_history_cached(tmp_path, policy):
    requests = _conversations(tmp_path)
    run = _run(requests, policy, instances=3, seed=5)
    by_index = {o.index: o for o in run.outcomes}
    for r in requests:
        if r.parent is not None:
            assert by_index[r.index].instance == by_index[r.parent].instance
            assert by_index[r.index].cached_tokens == requests[r.parent].history_len


def test_the_fleet_replay_is_deterministic_for_a_seed(tmp_path):
    requests = _conversations(tmp_path)
    first = [(o.instance, o.cached_tokens, o.ttft_s) for o in _run(requests, "power_of_two", instances=3, seed=11).outcomes]
    again = [(o.instance, o.cached_tokens, o.ttft_s) for o in _run(requests, "power_of_two", instances=3, seed=11).outcomes]
    assert first == again


def test_the_router_reads_in_flight_counts_from_the_modelled_clock(tmp_path):
    """Every arrival at once on a dark fleet (no loads polled): the miss path's fewest-in-flight rule
    spreads the first turns 2/1 over two instances, and the counts the router held drop to zero once
    every request has finished."""
    path = tmp_path / "burst.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 0, "input_length": 512, "output_length": 8,
                                        "hash_ids": [1000 + i]}) + "\n" for i in range(3)))
    requests = trace.load(str(path), PAGE)
    router = Router("cache_aware", 2, RouterConfig(loads=False), seed=0, page=PAGE)
    run = run_fleet("stock", _geometry(), requests, 2, router, coef=_coef())
    assert sorted(report.summarize(run, engine.ideal_prefixes(requests, PAGE))["requests_per_instance"]) == [1, 2]
    assert router.in_flight == [0, 0]


def test_the_cli_prints_profiles_by_routers_and_sizes_the_fleet_at_a_ttft_target(tmp_path, capsys):
    """The production profile's geometry (page 256); a target no run misses: the smallest N is 1 for
    every router, and the comparison of cache_aware with round_robin is made at the N both ran."""
    rows = []
    for k in range(2):
        for c in range(3):
            rows.append({"timestamp": 2000 * k + 10 * c, "input_length": 3000 + 600 * k, "output_length": 20,
                         "hash_ids": [100 * c + b for b in range(6 + 2 * k)]})
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["simulate", str(path), "--instances", "2", "--router", "cache_aware,round_robin",
                     "--policies", "stock", "--target-ttft-p90", "600000", "--max-instances", "2", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["smg_version"] == "1.13.0" and "smg 1.13.0" in out[0]
    assert set(result["rows"]) == {"stock | cache_aware", "stock | round_robin"}
    ca, rr = result["rows"]["stock | cache_aware"], result["rows"]["stock | round_robin"]
    assert ca["recomputed_tokens"] < rr["recomputed_tokens"] and ca["leak"] == rr["leak"] == 0
    assert result["sizing"]["smallest"] == {"stock | cache_aware": 1, "stock | round_robin": 1}
    assert result["sizing"]["coefficients"] == "default"
    assert any("the answer scales with" in line for line in out)
    said = " ".join(result["left_out"])
    for simplification in ("re-implemented from its Rust source", "in flight", "/v1/loads", "prompts rounded up"):
        assert simplification in said


def test_routing_keys_from_the_caller_replace_the_one_a_conversation_key(tmp_path):
    """A client that sends one key for a group (not one a conversation): every conversation of the
    group lands on one worker."""
    requests = _conversations(tmp_path)
    run = run_fleet("stock", _geometry(), requests, 3, Router("consistent_hashing", 3, page=PAGE), coef=_coef(),
                    routing_keys=["group-a"] * len(requests))
    assert len({o.instance for o in run.outcomes}) == 1


def _veto_trace(tmp_path) -> list[trace.Request]:
    """Conversation A's first turn at 0 s; two other users at 5.5 s sharing A's first block (a match
    rate over 0.3: cache_aware sends them to A's instance), each decoding 120 tokens; A's second turn
    at 10.5 s, after the 10 s load poll."""
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2], "session": "A"},
            {"timestamp": 5500, "input_length": 1000, "output_length": 120, "hash_ids": [1, 50], "session": "D1"},
            {"timestamp": 5510, "input_length": 1000, "output_length": 120, "hash_ids": [1, 60], "session": "D2"},
            {"timestamp": 10_500, "input_length": 1100, "output_length": 4, "hash_ids": [1, 3, 4], "session": "A"}]
    path = tmp_path / "veto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return trace.load(str(path), PAGE, session_key="session")


def test_a_small_swa_pool_trips_the_overload_veto_and_the_next_turn_moves_to_the_other_instance(tmp_path):
    """A 256-slot SWA pool: the two users decoding on A's instance hold over 0.8 of it at the 10 s poll
    (SGLang's token_usage is max(Full, SWA); the Full pool is nearly empty), so smg takes that instance
    out of routing and A's second turn goes to the other one, which holds nothing of it. With
    ``disable_worker_overload_protection=true`` it stays with its history; under SWA pressure its
    window is gone there, and thin + cone resume it from the cone's start (stock would find nothing
    either: the router's hit and the engine's part ways), so it recomputes less than when moved."""
    from overlay_tools.simulate.gateway.router import config_from_args

    requests = _veto_trace(tmp_path)
    ideal = engine.ideal_prefixes(requests, PAGE)
    runs = {}
    for args in ([], ["disable_worker_overload_protection=true"]):
        router = Router("cache_aware", 2, config_from_args(args), seed=0, page=PAGE)
        run = runs[bool(args)] = run_fleet("thin+cone", small_fleet(swa_pool=256), requests, 2, router, coef=_coef())
        assert run.leaks == [0, 0]
        first, d1, d2, _ = run.outcomes
        assert d1.instance == d2.instance == first.instance and d1.branch == d2.branch == "hit"
    vetoed, kept = runs[False], runs[True]
    home = vetoed.outcomes[0].instance
    assert vetoed.veto_polls[home] == 1 and vetoed.veto_polls[1 - home] == 0
    second = vetoed.outcomes[3]
    assert (second.instance, second.branch, second.cached_tokens, second.predicted_tokens) == (1 - home, "veto", 0, 0)
    assert report.summarize(vetoed, ideal)["moved_turns"] == 1
    assert kept.veto_polls == [0, 0]
    second = kept.outcomes[3]
    assert (second.instance, second.branch, second.predicted_tokens) == (home, "hit", requests[0].history_len)
    assert 0 < second.cached_tokens < requests[0].history_len
    row = report.summarize(kept, ideal)
    assert row["moved_turns"] == 0
    assert row["recomputed_tokens"] == report.summarize(vetoed, ideal)["recomputed_tokens"] - second.cached_tokens
