"""bench fleet's reading of smg 1.13.0's count-pressure gate (cache_aware.rs:1805-1831): which
in-flight counts make a holder spill, and how each turn of a run is classed against it."""

from __future__ import annotations

import pytest

from devkit.bench.fleet import pressure
from devkit.bench.fleet.served import Served
from overlay_tools.simulate.gateway.router import RouterConfig, over_gate

DEFAULTS = RouterConfig()


@pytest.mark.parametrize(("holder", "other", "spills"), [
    (10, 0, False),  # mean 5: margin max(4, ceil(2 sqrt 5) = 5) = 5, 10 is not over 10
    (11, 0, True),  # mean 5.5: margin 5, 11 > 10.5 and > 8.25
    (13, 1, False),  # mean 7: margin 6, 13 is not over 13
    (14, 1, True),
    (12, 4, False),  # 12 is not over 1.5 x 8
    (6, 0, False),  # a handful on an idle fleet: under the floor of 4
])
def test_two_workers_spill_only_when_the_holder_carries_nearly_all_in_flight_requests(holder, other, spills):
    mean = (holder + other) / 2
    assert over_gate(holder, mean, DEFAULTS) is spills


def test_with_two_workers_a_relative_threshold_of_two_never_spills():
    no_spill = RouterConfig(balance_rel_threshold=2.0)
    assert not any(over_gate(h, (h + o) / 2, no_spill) for h in range(64) for o in range(64))


def test_the_margin_is_capped_by_the_configured_absolute_threshold():
    # rel 1.0 leaves the margin alone to decide: over once the load passes mean + margin
    rel_one = RouterConfig(balance_rel_threshold=1.0)
    assert not over_gate(120, 100.0, rel_one) and over_gate(121, 100.0, rel_one)  # margin 2 sqrt(100) = 20
    capped = RouterConfig(balance_rel_threshold=1.0, balance_abs_threshold=8)
    assert not over_gate(108, 100.0, capped) and over_gate(109, 100.0, capped)  # capped at 8
    assert not over_gate(5, 1.0, rel_one) and over_gate(6, 1.0, rel_one)  # at least 4


def _served(worker: int, t: float, ids: list[int]) -> Served:
    return Served(rid=f"r{t}", worker=worker, received_s=t, input_ids=ids, routing_key=None, prompt_tokens=len(ids),
                  cached_tokens=0, completion_tokens=4, ttft_s=0.1, e2e_s=10.0)


def test_turns_class_each_request_by_its_holder_and_the_loads_at_its_arrival():
    a1 = _served(0, 0.0, list(range(100)))
    b1 = _served(1, 1.0, list(range(500, 600)))
    a2 = _served(1, 2.0, [*range(100), 7, 7])  # a's second turn, away from its holder
    a3 = _served(1, 3.0, [*range(100), 7, 7, 8])  # follows its previous turn
    found = pressure.turns([a1, b1, a2, a3], 2, loads=[[0, 0], [1, 0], [11, 0], [0, 1]])
    assert [t.kind for t in found] == ["miss", "miss", "spill", "hit"]
    assert found[2].holders == (0,)
    found = pressure.turns([a1, b1, a2, a3], 2, loads=[[0, 0], [1, 0], [3, 0], [0, 1]])
    assert found[2].kind == "moved, not gated"
    summary = pressure.summary(pressure.turns([a1, b1, a2, a3], 2, loads=[[0, 0], [1, 0], [11, 0], [0, 1]]))
    assert summary["kinds"] == {"miss": 2, "spill": 1, "hit": 1}
    assert summary["spill_loads"] == [[11, 0]]


def test_without_router_samples_the_loads_come_from_the_workers_logs():
    a1 = _served(0, 0.0, list(range(100)))
    b1 = _served(1, 1.0, list(range(500, 600)))
    assert pressure.loads_at([a1, b1], b1, 2) == [1, 0]
    assert pressure.sampled_loads([a1, b1], [(0.5, {"u0": 3.0, "u1": 1.0})], ["u0", "u1"]) == [[3, 1], [3, 1]]


def test_a_turn_sent_away_while_its_holder_was_vetoed_is_a_veto_not_a_spill():
    a1 = _served(0, 0.0, list(range(100)))
    a2 = _served(1, 12.0, [*range(100), 7, 7])
    window = pressure.VetoWindow(worker=0, set_s=11.0, cleared_s=21.0)
    found = pressure.turns([a1, a2], 2, loads=[[0, 0], [1, 0]], vetoes=[window])
    assert [t.kind for t in found] == ["miss", "veto"]
    later = _served(1, 22.5, [*range(100), 7, 7])  # past the clearing poll (and its logged second)
    assert pressure.turns([a1, later], 2, loads=[[0, 0], [1, 0]], vetoes=[window])[1].kind == "moved, not gated"
