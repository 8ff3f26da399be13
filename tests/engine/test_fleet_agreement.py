"""The served fleet against the replayed one, request by request.

A real fleet (two Mellum kit servers behind smg, ``bench fleet``'s machinery) serves SGLang's
multi-turn chat client; the trace it wrote (the requests as the workers received them) goes through
``simulate``'s fleet replay (:func:`overlay_tools.simulate.gateway.replay.replay_trace`) with the
same policy and the same worker URLs. The replay's router model predicts each request's worker; its
real cache predicts the tokens each request finds cached.

Pools large enough that neither the served nor the replayed cache evicts (Full 32,768 tokens, the
SWA pool as large), so a request's cached tokens are its longest prefix on its worker in both. Where
they may differ, the comparison names why (:func:`explain`):

* ``partial block``: the trace carries one hash per 512-token block, so a prefix shared across
  conversations (the group's system prompt, about 640 tokens with the chat template) is known to
  the replay only up to its last full block: the served cache holds up to 511 tokens more.
* smg registers the workers in the background, in whichever order their registrations complete,
  and its rotation follows that order, not ``--worker-urls``'; the replay's rotation starts at
  worker 0. The replay's worker indices are relabelled once, by the first request (with two
  workers: which one the rotation starts at); every later request must then agree.
* ``dispatch order``: the trace orders requests as the workers received them; two requests sent
  within a few milliseconds of each other (two conversations' next turns after their answers ended
  in the same decode step) can reach the workers in the other order than the router dispatched
  them. Requests less than :data:`TIE_MS` apart form a group; round robin gives a group the same
  rotation slots in either order, so its workers agree as a set, and a request of a group whose
  order was swapped is not compared on cached tokens (it ran on the other worker), nor is a later
  turn of its conversation (``after a swapped turn``: its history is on the other worker).
* the client's routing key is one per group (``--gsp-send-routing-key``); the replay's key is one
  per conversation (its session), so for ``consistent_hashing`` only the worker is compared, by
  the replay's own ring (:class:`overlay_tools.simulate.gateway.router.HashRing`) over the keys the
  client sent.

The CI slice (``slow``): one fleet boot, ``round_robin`` and ``consistent_hashing``, 8 requests.
* ``answer re-tokenized``: a later turn's prompt carries the previous answer as text, which the
  chat template re-tokenizes; the served match may stop inside the answer (never before the previous
  prompt's end) where the replay, which knows the answer's length only, counts it all.

``heavy``: ``cache_aware`` at a rate that keeps loads balanced (no spill): each group's requests on
one worker in both, relabelled by the group's first request (a miss placed by expected wait, whose
ties are drawn: which index it gets may differ), and the same cached tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("smg")

TRAFFIC = {"groups": 2, "per_group": 2, "system": 512, "question": 64, "output": 8, "turns": 2, "rate": 1.0}  # Poisson: few arrivals within TIE_MS
CALM_TRAFFIC = {**TRAFFIC, "groups": 2, "per_group": 3, "rate": 0.5}
POOL = 32768
BLOCK = 512
TIE_MS = 50
REPLAY_TIME_SCALE = 100


def serve(policies: list[Any], traffic: dict[str, Any], out: Path) -> tuple[Path, list[Any]]:
    """One stock fleet boot, ``policies`` through it; the model folder and the runs."""
    import devkit.bench.fleet as fl
    from devkit.engine_kit.serving_client import ServingClient, client_env

    kit = fl.MellumFleet(max_total_tokens=POOL, swa_ratio=1.0)
    model = kit.model(out)
    with ServingClient(client_env(), out) as client:
        result = fl.run_fleet(kit, model, "stock", {}, policies, traffic, out, client, print, fl.fleet_ports(fl.WORKERS))
    assert result.error is None, result.error
    assert result.survivors == []
    return model, result.runs


def replay(run: Any, model: Path, out: Path, policy: str) -> tuple[list[dict[str, Any]], Any]:
    from overlay_tools.simulate.gateway.replay import replay_trace

    env_file = out / "geometry.env"
    env_file.write_text(f"LAUNCH_ARGS=--model-path {model} --page-size 1 --chunked-prefill-size 64 "
                        f"--max-total-tokens {POOL} --swa-prefix-tails 64\n")
    rows = [json.loads(line) for line in Path(run.trace).read_text().splitlines()]
    # Stretched so that every request's modelled service ends before the next arrival: a later turn is
    # ready when its parent has finished in the model, and the cost model's default (GPU) step times
    # would otherwise route it after a first turn the client sent later.
    fleet = replay_trace(run.trace, 2, policy, env_file=str(env_file), model=str(model), kv_tokens=POOL,
                         session_key="session", urls=run.urls, time_scale=REPLAY_TIME_SCALE)
    return rows, fleet


def explain(row: dict[str, Any], predicted: int, same_conversation_here: bool,
            parent: dict[str, Any] | None = None) -> str | None:
    """Why the replay's cached tokens differ from the served ones (None: they agree)."""
    served = row["cached_tokens"]
    if served == predicted:
        return None
    if not same_conversation_here and predicted <= served < predicted + BLOCK and predicted % BLOCK == 0:
        return "partial block"
    if (same_conversation_here and parent is not None
            and parent["input_length"] <= served < predicted <= parent["input_length"] + parent["output_length"]):
        return "answer re-tokenized"
    return f"unexplained: served {served}, replayed {predicted}"


def tie_groups(rows: list[dict[str, Any]]) -> list[list[int]]:
    """Runs of requests each less than :data:`TIE_MS` after the one before (by index)."""
    groups: list[list[int]] = []
    for i, row in enumerate(rows):
        if groups and row["timestamp"] - rows[i - 1]["timestamp"] < TIE_MS:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def compare(rows: list[dict[str, Any]], fleet: Any, relabel: dict[int, int] | list[dict[int, int]] | None = None
            ) -> list[dict[str, Any]]:
    """Request by request; ``relabel`` maps the replay's worker indices onto the served ones (one map
    for the run, or one per request)."""
    maps = relabel if isinstance(relabel, list) else [relabel or {}] * len(rows)
    seen: dict[int, set[int]] = {}  # conversation -> workers that served one of its turns
    parent: dict[int, dict[str, Any]] = {}  # conversation -> its previous turn
    table = []
    for row, outcome, mapping in zip(rows, fleet.outcomes, maps):
        here = row["worker"] in seen.get(row["session"], set())
        table.append({"request": outcome.index, "t_ms": row["timestamp"], "session": row["session"],
                      "served_worker": row["worker"], "replayed_worker": mapping.get(outcome.instance, outcome.instance),
                      "served_cached": row["cached_tokens"], "replayed_cached": outcome.cached_tokens,
                      "why": explain(row, outcome.cached_tokens, here, parent.get(row["session"]))})
        seen.setdefault(row["session"], set()).add(row["worker"])
        parent[row["session"]] = row
    swapped: set[int] = set()  # conversations with a turn in a swapped group
    for group in tie_groups(rows):
        if any(table[i]["served_worker"] != table[i]["replayed_worker"] for i in group):
            for i in group:
                table[i]["why"] = "dispatch order"
                swapped.add(table[i]["session"])
        else:
            for i in group:
                if table[i]["why"] and table[i]["session"] in swapped:
                    table[i]["why"] = "after a swapped turn"
    for line in table:
        print(line)
    return table


def workers_agree(table: list[dict[str, Any]], rows: list[dict[str, Any]]) -> bool:
    """Each tie group's workers agree as a set (in order outside ties)."""
    return all(sorted(table[i]["served_worker"] for i in g) == sorted(table[i]["replayed_worker"] for i in g)
               for g in tie_groups(rows))


EXPLAINED = ("partial block", "answer re-tokenized", "dispatch order", "after a swapped turn")


def first_request_relabel(rows: list[dict[str, Any]], fleet: Any) -> dict[int, int]:
    """The replay's two worker indices mapped so that its first request's worker is the served one."""
    first = fleet.outcomes[0].instance
    return {first: rows[0]["worker"], 1 - first: 1 - rows[0]["worker"]}


def group_relabel(rows: list[dict[str, Any]], fleet: Any) -> list[dict[int, int]]:
    """Per request, the replay's worker indices mapped onto the served ones by its group's first
    request (the group: the system prompt's block, ``hash_ids[0]``): a group's first request is a
    miss placed by expected wait, ties drawn, in both; the run's first request maps the rest."""
    first = first_request_relabel(rows, fleet)
    by_group: dict[int, dict[int, int]] = {}
    maps = []
    for row, outcome in zip(rows, fleet.outcomes):
        group = row["hash_ids"][0]
        if group not in by_group:
            mine = outcome.instance
            by_group[group] = ({mine: row["worker"], 1 - mine: 1 - row["worker"]} if outcome.branch == "miss"
                               else first)
        maps.append(by_group[group])
    return maps


@pytest.fixture(scope="module")
def served_fleet(tmp_path_factory):
    import devkit.bench.fleet as fl

    out = tmp_path_factory.mktemp("fleet")
    policies = [p for p in fl.POLICIES if p.policy in ("round_robin", "consistent_hashing")]
    model, runs = serve(policies, TRAFFIC, out)
    return out, model, {r.policy: r for r in runs}


def test_round_robin_replay_predicts_each_requests_worker_and_its_cached_tokens(served_fleet):
    out, model, runs = served_fleet
    run = runs["round_robin"]
    assert run.error is None, run.error
    rows, fleet = replay(run, model, out, "round_robin")
    assert len(rows) == TRAFFIC["groups"] * TRAFFIC["per_group"] * TRAFFIC["turns"]
    table = compare(rows, fleet, first_request_relabel(rows, fleet))
    assert workers_agree(table, rows), [t for t in table if t["served_worker"] != t["replayed_worker"]]
    assert [t for t in table if t["why"] and t["why"] not in EXPLAINED] == []
    assert sum(t["why"] == "dispatch order" for t in table) <= len(table) // 2


def test_consistent_hashing_ring_places_each_clients_key_on_the_worker_smg_chose(served_fleet):
    from overlay_tools.simulate.gateway.router import HashRing

    runs = served_fleet[2]
    run = runs["consistent_hashing"]
    assert run.error is None, run.error
    rows = [json.loads(line) for line in Path(run.trace).read_text().splitlines()]
    assert all(r["routing_key"] for r in rows)
    ring = HashRing(run.urls)
    assert [ring.find(r["routing_key"]) for r in rows] == [r["worker"] for r in rows]
    # one key per group: every request of a group on one worker
    assert len({(r["routing_key"], r["worker"]) for r in rows}) == len({r["routing_key"] for r in rows})


@pytest.mark.heavy
def test_cache_aware_replay_agrees_on_worker_and_cache_while_loads_stay_balanced(tmp_path):
    import devkit.bench.fleet as fl

    policy = next(p for p in fl.POLICIES if p.policy == "cache_aware")
    model, runs = serve([policy], CALM_TRAFFIC, tmp_path)
    run = runs[0]
    assert run.error is None, run.error
    assert "spill" not in (run.router.get("branches") or {}), "loads did not stay balanced"
    rows, fleet = replay(run, model, tmp_path, "cache_aware")
    assert any(o.branch == "hit" for o in fleet.outcomes), "no request matched a holder"
    # a group's first request is a miss placed by expected wait (ties drawn): which worker index it
    # gets may differ, so each group's placements agree one worker for another from its first request
    table = compare(rows, fleet, group_relabel(rows, fleet))
    assert workers_agree(table, rows), [t for t in table if t["served_worker"] != t["replayed_worker"]]
    assert [t for t in table if t["why"] and t["why"] not in EXPLAINED] == []
