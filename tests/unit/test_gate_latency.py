"""The gate's latency leg judges recorded figures (devkit/gate/latency.py), runs the shipped profile's
keys (devkit/gate/shipped.py) and loads the kit on a schedule of its stock capacity
(devkit/bench/chat_latency/load.py): no server, no clock."""

from __future__ import annotations

import argparse

import pytest

from devkit.gate import latency
from devkit.gate.latency import FLOOR_MIN, WINDOW_STEPS, judge

TURNS = 2
# Two stock boots on the loading traffic (figures as bench_serving reports them; first turns are every
# TURNS-th TTFT): mean TTFT 300 / 320 ms, 4.0 / 4.2 requests a second, p99 ITL 200 / 220 ms, a step of 10 ms.
A1 = {"mean_ttft_ms": 300.0, "p99_ttft_ms": 900.0, "mean_itl_ms": 14.0, "median_itl_ms": 10.0, "p99_itl_ms": 200.0,
      "request_throughput": 4.0, "burst_request_throughput": 5.0,
      "ttfts_ms": [100.0, 50.0, 200.0, 60.0, 300.0, 40.0, 400.0, 70.0]}
A2 = {"mean_ttft_ms": 320.0, "p99_ttft_ms": 950.0, "mean_itl_ms": 15.0, "median_itl_ms": 10.0, "p99_itl_ms": 220.0,
      "request_throughput": 4.2, "burst_request_throughput": 5.5,
      "ttfts_ms": [110.0, 55.0, 190.0, 65.0, 310.0, 45.0, 420.0, 75.0]}
BOUND = 100 / 67  # pct 33
SLACK = WINDOW_STEPS * 10.0
TTFT_LIMIT = BOUND * 310.0 + SLACK
GOOD = {"mean_ttft_ms": 350.0, "p99_ttft_ms": 1000.0, "mean_itl_ms": 14.0, "median_itl_ms": 10.0, "p99_itl_ms": 210.0,
        "request_throughput": 4.1, "ttfts_ms": [120.0, 50.0, 220.0, 60.0, 330.0, 40.0, 450.0, 70.0]}


def _with(base, **changes):
    return {**base, **changes}


@pytest.mark.parametrize(("a1", "a2", "b", "verdict", "why"), [
    (A1, A2, GOOD, "PASS", None),
    (A1, _with(A2, mean_ttft_ms=300.0 * 1.31), GOOD, "INVALID", "controls_disagree: mean_ttft_ms"),
    (A1, _with(A2, request_throughput=4.0 * 1.31), GOOD, "INVALID", "controls_disagree: request_throughput"),
    (A1, _with(A2, mean_ttft_ms=None), GOOD, "INVALID", "controls_disagree: mean_ttft_ms"),
    (A1, _with(A2, burst_request_throughput=5.0 * 1.31), GOOD, "INVALID", "controls_disagree: burst_request_throughput"),
    (A1, A2, _with(GOOD, mean_ttft_ms=TTFT_LIMIT + 1), "FAIL", "mean_ttft_ms"),
    (A1, A2, _with(GOOD, mean_ttft_ms=TTFT_LIMIT - 1), "PASS", None),
    (A1, A2, _with(GOOD, request_throughput=4.0 / 1.05 - 0.01), "FAIL", "request_throughput"),
    (A1, A2, _with(GOOD, p99_itl_ms=220.0 * 1.1 + 1), "FAIL", "p99_itl_ms"),
    (A1, A2, _with(GOOD, ttfts_ms=[900.0, 50.0, 220.0, 60.0, 330.0, 40.0, 450.0, 70.0]), "FAIL", "first turns"),
    (A1, A2, {}, "FAIL", "profile boot has no"),
], ids=["within-every-limit", "controls-ttft-apart", "controls-throughput-apart", "control-without-figures",
        "controls-capacity-apart",
        "ttft-over-bound-plus-window", "ttft-just-within", "throughput-below-floor", "p99-itl-over-the-worse-control",
        "a-first-turn-past-its-bound", "no-figures"])
def test_the_verdict_of_the_profile_boot_against_two_stock_controls(a1, a2, b, verdict, why):
    result = judge(a1, a2, b, 33, TURNS)
    assert result["verdict"] == verdict, result
    if why and why.startswith("controls_disagree"):
        assert result["controls_disagree"] == [why.split(": ")[1]]
    elif why:
        assert any(f.startswith(why) for f in result["fails"]), result["fails"]
    else:
        assert result["fails"] == []


@pytest.mark.parametrize(("pct", "burst", "verdict", "judged"), [
    (33, {"windows": 40, "windows_guarded": 30}, "PASS", True),
    (33, {"windows": 40, "windows_guarded": 20}, "PASS", True),  # half: the least that passes
    (33, {"windows": 40, "windows_guarded": 19}, "FAIL", True),
    (33, {"windows": 40, "windows_guarded": 0}, "FAIL", True),  # the guard off: the full share at saturation
    (33, {"windows": 9, "windows_guarded": 0}, "PASS", False),  # too few windows to judge
    (33, None, "PASS", False),  # no burst counters (a failed burst)
    (None, {"windows": 40, "windows_guarded": 0}, "PASS", False),  # no decode yield in the profile
], ids=["most-guarded", "half-guarded", "under-half", "guard-off", "few-windows", "no-burst", "no-yield"])
def test_the_load_guard_must_back_off_in_the_profile_boots_burst(pct, burst, verdict, judged):
    result = judge(A1, A2, GOOD, pct, TURNS, burst=burst)
    assert result["verdict"] == verdict, result["fails"]
    assert result["burst_guard"]["judged"] is judged
    if verdict == "FAIL":
        assert result["fails"] == [f"the load guard did not back off in B's burst: {burst['windows_guarded']} of "
                                   f"{burst['windows']} windows armed below pct 33 (at least 50% expected at saturation)"]


def test_the_limits_come_from_the_configuration_and_the_controls_never_from_the_boot_under_test():
    result = judge(A1, A2, GOOD, 33, TURNS)
    assert result["slack_ms"] == SLACK and result["step_ms"] == 10.0  # one window at the controls' median ITL
    assert result["limits"]["mean_ttft_ms"] == round(TTFT_LIMIT, 1)
    assert result["limits"]["request_throughput"] == round(4.0 / 1.05, 3)  # the lower control less their spread
    assert result["limits"]["p99_itl_ms"] == round(220.0 * 1.1, 1)  # the higher control plus their spread (x1.1)
    slow = judge(A1, A2, _with(GOOD, median_itl_ms=500.0, p99_itl_ms=100.0), 33, TURNS)
    assert slow["limits"] == result["limits"]  # B's own step and ITL move no limit


def test_two_controls_closer_than_the_floor_grant_the_profile_the_floor():
    a2 = _with(A2, request_throughput=4.0, p99_itl_ms=200.0)
    result = judge(A1, a2, GOOD, 33, TURNS)
    assert result["limits"]["request_throughput"] == round(4.0 / FLOOR_MIN, 3)
    assert result["limits"]["p99_itl_ms"] == round(200.0 * FLOOR_MIN, 1)


def test_first_turns_are_judged_against_the_stock_versus_stock_floor():
    # A2 sends one first turn far past the bound x A1's: the floor is 1, so one first turn of B past it passes
    noisy = _with(A2, ttfts_ms=[900.0, 55.0, 190.0, 65.0, 310.0, 45.0, 420.0, 75.0], mean_ttft_ms=330.0)
    b = _with(GOOD, ttfts_ms=[120.0, 50.0, 990.0, 60.0, 330.0, 40.0, 450.0, 70.0])
    result = judge(A1, noisy, b, 33, TURNS)
    assert result["first_turns_past"] == {"A1": 0, "A2": 1, "B": 1, "floor": 1, "uncounted": 1}
    assert result["verdict"] == "PASS", result
    # later turns (every second TTFT here) are not judged: each follows its own answer in each boot
    later = _with(GOOD, ttfts_ms=[120.0, 900.0, 220.0, 900.0, 330.0, 40.0, 450.0, 70.0])
    assert judge(A1, A2, later, 33, TURNS)["first_turns_past"]["B"] == 0


def test_a_first_turn_past_the_floor_passes_only_when_the_switch_counted_it_itself():
    """The contract: first turns past the bound within the stock-vs-stock floor, or counted by the switch."""
    b = _with(GOOD, ttfts_ms=[120.0, 50.0, 990.0, 60.0, 330.0, 40.0, 450.0, 70.0])
    uncounted = judge(A1, A2, b, 33, TURNS)
    assert uncounted["first_turns_past"]["floor"] == 0 and uncounted["first_turns_past"]["uncounted"] == 1
    assert uncounted["verdict"] == "FAIL" and "not counted by the switch 1" in uncounted["fails"][0]
    counted = judge(A1, A2, b, 33, TURNS, counted=1)
    assert counted["first_turns_past"]["uncounted"] == 0 and counted["verdict"] == "PASS", counted


def test_without_decode_yield_the_bound_is_stock():
    result = judge(A1, A2, GOOD, None, TURNS)
    assert result["bound"] == 1.0 and result["limits"]["mean_ttft_ms"] == round(310.0 + SLACK, 1)


# -- the shipped profile and --set-key --------------------------------------------------------------------


def test_the_leg_runs_the_shipped_profiles_switch_keys_with_the_cone_sized_to_the_kit():
    from adapter.core import env
    from devkit.gate import shipped

    file = env.read_env_file(str(shipped.PROFILE))
    mellum, dsv4 = shipped.profile("mellum"), shipped.profile("dsv4")
    assert mellum["DSV41_DECODE_YIELD"] == file["DSV41_DECODE_YIELD"] == dsv4["DSV41_DECODE_YIELD"]
    assert mellum["DSV41_SWA_THIN"] == file["DSV41_SWA_THIN"] and mellum["DSV41_SWA_CONE_REPLAY"] == "1"
    assert (mellum["DSV41_SWA_CONE_TOKENS"], dsv4["DSV41_SWA_CONE_TOKENS"]) == ("64", "768")
    # switches the gate cannot turn on on this engine stay out (they are in the file)
    assert "DSV41_AUTOTUNE_KEEP" in file and "DSV41_AUTOTUNE_KEEP" not in mellum


def test_the_shipped_profile_is_read_from_the_file_not_restated(tmp_path):
    from devkit.gate import shipped

    other = tmp_path / "profile.env"
    other.write_text("LAUNCH_ARGS=--tp-size 4\nDSV41_DECODE_YIELD=20\nDSV41_SWA_CONE_REPLAY=1\nDSV41_SWA_CONE_TOKENS=4096\n")
    assert shipped.profile("mellum", other) == {"DSV41_DECODE_YIELD": "20", "DSV41_SWA_CONE_REPLAY": "1",
                                                "DSV41_SWA_CONE_TOKENS": "64"}
    other.write_text("DSV41_SWA_THIN=1\n")
    with pytest.raises(ValueError, match="sets no DSV41_DECODE_YIELD"):
        shipped.profile("mellum", other)


@pytest.mark.parametrize(("pair", "error"), [
    ("DSV41_DECODE_YIELD", "expected KEY=VALUE"),
    ("DSV41_NOPE=1", "DSV41_NOPE is no key of the registry"),
    ("DSV41_DECODE_YIELD=abc", "DSV41_DECODE_YIELD='abc' is not valid"),
])
def test_a_bad_set_key_is_refused_with_the_pair_and_why(pair, error):
    from devkit.gate import shipped

    with pytest.raises(ValueError, match=f"--set-key '{pair}' is invalid") as info:
        shipped.with_set_keys({}, [pair])
    assert error in str(info.value)


def test_set_key_sets_a_registry_key_on_top_of_the_profile():
    from devkit.gate import shipped

    assert shipped.with_set_keys({"DSV41_DECODE_YIELD": "33"}, ["DSV41_DECODE_YIELD=50", "DSV41_DECODE_YIELD_MODE=model"]) \
        == {"DSV41_DECODE_YIELD": "50", "DSV41_DECODE_YIELD_MODE": "model"}


def test_a_bad_set_key_fails_the_gate_before_any_boot(tmp_path, capsys):
    import devkit.gate as gate

    for latency_alone in (False, True):
        args = argparse.Namespace(quick=True, out=str(tmp_path / "gate"), without=[], model="mellum", via="import-hook",
                                  hicache=False, drop_key=[], set_key=["DSV41_NOPE=0"], latency=latency_alone)
        assert gate.main(args) == 2
        assert "--set-key 'DSV41_NOPE=0' is invalid" in capsys.readouterr().err
    assert not (tmp_path / "gate").exists()  # nothing built, nothing booted


def test_set_key_reaches_the_gate_from_the_cli(monkeypatch):
    import devkit.gate as gate
    from adapter.ops import cli

    seen = {}
    monkeypatch.setattr(gate, "main", lambda args: seen.setdefault("set_key", args.set_key) and 0)
    cli.main(["gate", "--quick", "--latency", "--set-key", "DSV41_DECODE_YIELD_MODE=model"])
    assert seen["set_key"] == ["DSV41_DECODE_YIELD_MODE=model"]


# -- the load schedule --------------------------------------------------------------------------------------


def test_the_load_schedule_offers_fractions_of_the_capacity_as_conversations_a_second():
    from devkit.bench.chat_latency import load

    schedule = load.load_schedule(8.0, 4, (0.25, 0.5, 0.75, 1.0))
    assert [x["offered_req_s"] for x in schedule] == [2.0, 4.0, 6.0, 8.0]
    assert [x["rate"] for x in schedule] == [0.5, 1.0, 1.5, 2.0]  # a conversation offers 4 requests
    assert load.load_schedule(3.0, 1, [1.0]) == [{"fraction": 1.0, "offered_req_s": 3.0, "rate": 3.0}]


@pytest.mark.parametrize(("capacity", "turns", "fractions", "error"), [
    (0.0, 4, [0.5], "capacity=0.0 is invalid"),
    (4.0, 0, [0.5], "turns=0 is invalid"),
    (4.0, 4, [1.5], "are invalid"),
    (4.0, 4, [], "are invalid"),
])
def test_a_schedule_without_a_capacity_turns_or_fractions_in_range_is_refused(capacity, turns, fractions, error):
    from devkit.bench.chat_latency import load

    with pytest.raises(ValueError, match=error):
        load.load_schedule(capacity, turns, fractions)


def test_the_capacity_is_a_bursts_request_throughput_and_a_burst_sends_every_conversation_at_once():
    from devkit.bench.chat_latency import load

    assert load.capacity({"request_throughput": 5.2}) == 5.2
    with pytest.raises(ValueError, match="request_throughput=None"):
        load.capacity({})
    assert load.burst({"rate": 1.0, "turns": 4})["rate"] == "inf"


def test_the_loading_traffic_has_drawn_lengths_several_turns_and_doubles_when_not_quick():
    from devkit.bench.chat_latency import client_args, load

    quick, full = load.load_traffic("mellum", True), load.load_traffic("mellum", False)
    assert quick["turns"] >= 3 and quick["range_ratio"] < 1 and quick["output"] >= 32
    assert full["per_group"] == 2 * quick["per_group"]
    argv = client_args("http://h:1", "tok", "o.json", {**quick, "rate": 0.5})
    assert argv[argv.index("--gsp-range-ratio") + 1] == str(quick["range_ratio"])
    assert argv[argv.index("--request-rate") + 1] == "0.5"
    with pytest.raises(ValueError, match="--model 'nope' is invalid"):
        load.load_traffic("nope", True)


def test_the_sweep_runs_stock_first_then_yield_alone_and_the_shipped_profile():
    from devkit.bench.chat_latency import sweep
    from devkit.gate import shipped

    full, quick = sweep.rows("mellum", False), sweep.rows("mellum", True)
    pct = shipped.profile("mellum")["DSV41_DECODE_YIELD"]
    assert [label for label, _ in full] == ["stock", f"yield {pct}", "profile"]
    assert full[0][1] == {} and full[1][1] == {"DSV41_DECODE_YIELD": pct} and full[2][1] == shipped.profile("mellum")
    assert [label for label, _ in quick] == ["stock", "profile"]
    assert sweep.FRACTIONS[0] == 0.25 and sweep.FRACTIONS[-1] == 1.0


# -- kept from the first leg -------------------------------------------------------------------------------


def test_the_gate_verdict_is_the_worse_of_the_switch_legs_and_the_latency_leg():
    from devkit.gate import with_latency

    assert with_latency("PASS", "", "PASS") == ("PASS", "")
    assert with_latency("PASS", "", "FAIL") == ("FAIL", "latency leg FAIL")
    assert with_latency("PASS", "", "INVALID") == ("INVALID", "latency leg INVALID")
    # a failed switch row stays the verdict, and both reasons are kept
    assert with_latency("FAIL", "rows failed: swa_thin", "INVALID") == ("FAIL", "rows failed: swa_thin; latency leg INVALID")
    assert with_latency("INVALID", "the stock controls disagree", "FAIL") == ("FAIL", "latency leg FAIL")
    assert with_latency("FAIL", "receipts", "PASS") == ("FAIL", "receipts")


def test_the_latency_leg_runs_only_for_the_whole_profile_through_the_import_hook():
    from devkit.gate import latency_skipped

    assert latency_skipped(True, "import-hook", False, (), ()) is None
    assert latency_skipped(False, "import-hook", False, (), ()) == "--no-latency"
    assert latency_skipped(True, "plugin", False, (), ()).startswith("--via plugin")
    assert latency_skipped(True, "import-hook", True, (), ()).startswith("--hicache")
    assert latency_skipped(True, "import-hook", False, ("swa_thin",), ()).startswith("--without")
    assert latency_skipped(True, "import-hook", False, (), ("DSV41_SWA_THIN",)).startswith("--without")


def test_the_longest_window_is_read_from_the_profile_boots_window_lines():
    from devkit.bench.chat_latency import longest_window_ms

    lines = [
        "[dsv41] decode_yield window mode=measured target=50 chunk=64 prefix=0 rows=2 n=2 floor=0 given=2 "
        "ended=served source=measured step_us=5000.0 overhead_us=7000.0 rank=tp0",
        "[dsv41] decode_yield window mode=measured target=50 chunk=64 prefix=64 rows=2 n=3 floor=0 given=3 "
        "ended=served source=measured step_us=6000.0 overhead_us=7000.0 rank=tp0",
        "[dsv41] decode_yield burst share=50 lag_ms=20.0 waiting=1 planned=2 allowed=0 rank=tp0",
    ]
    assert longest_window_ms(lines) == 18.0
    assert longest_window_ms([]) == 0.0


def test_first_turns_are_each_conversations_first_ttft():
    assert latency.first_turns({"ttfts_ms": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]}, 3) == [1.0, 4.0]
    assert latency.first_turns({}, 3) == []
