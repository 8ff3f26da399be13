"""The gate's latency leg judges recorded figures (devkit/gate/latency.py): no server, no clock."""

from __future__ import annotations

from devkit.bench.chat_latency import longest_window_ms
from devkit.gate.latency import ITL_TOLERANCE, judge

# Stock boots as first recorded on this traffic (Mellum kit, bench_serving multi-turn chat, quiet machine):
# mean / p99 TTFT and mean / p99 ITL in ms.
A1 = {"mean_ttft_ms": 101.0, "p99_ttft_ms": 281.0, "mean_itl_ms": 30.0, "p99_itl_ms": 310.0}
A2 = {"mean_ttft_ms": 133.0, "p99_ttft_ms": 484.0, "mean_itl_ms": 53.0, "p99_itl_ms": 575.0}


def test_the_profile_recorded_before_the_bound_fails_on_its_ttft():
    """yield + thin + cone before the bound: 834 ms mean TTFT against 117 stock, where pct 33 allows 1.49x."""
    profile = {"mean_ttft_ms": 834.0, "p99_ttft_ms": 1462.0, "mean_itl_ms": 34.0, "p99_itl_ms": 110.0}
    result = judge(A1, A2, profile, 33, window_ms=12.0)
    assert result["verdict"] == "FAIL"
    assert [f.split()[0] for f in result["fails"]] == ["mean_ttft_ms", "p99_ttft_ms"]
    assert result["limits"]["mean_ttft_ms"] == round(117.0 / 0.67 + 12.0, 1)


def test_a_profile_within_the_bound_plus_one_window_with_no_worse_itl_passes():
    limit = 117.0 / 0.67 + 12.0
    profile = {"mean_ttft_ms": limit - 0.5, "p99_ttft_ms": 500.0, "mean_itl_ms": 30.0, "p99_itl_ms": 100.0}
    assert judge(A1, A2, profile, 33, window_ms=12.0)["verdict"] == "PASS"
    # the same TTFT a little past the window's slack fails
    late = {**profile, "mean_ttft_ms": limit + 1.0}
    assert judge(A1, A2, late, 33, window_ms=12.0)["verdict"] == "FAIL"


def test_an_itl_worse_than_stock_fails_even_within_the_ttft_bound():
    itl = 41.5 * (1 + ITL_TOLERANCE) + 1
    profile = {"mean_ttft_ms": 120.0, "p99_ttft_ms": 400.0, "mean_itl_ms": itl, "p99_itl_ms": 300.0}
    result = judge(A1, A2, profile, 33)
    assert result["verdict"] == "FAIL" and result["fails"][0].startswith("mean_itl_ms")


def test_controls_that_disagree_make_the_leg_invalid_not_a_pass():
    noisy = {**A2, "mean_ttft_ms": 101.0 * 2.5}
    profile = {"mean_ttft_ms": 120.0, "p99_ttft_ms": 400.0, "mean_itl_ms": 30.0, "p99_itl_ms": 100.0}
    result = judge(A1, noisy, profile, 33)
    assert result["verdict"] == "INVALID" and result["controls_disagree"] == ["mean_ttft_ms"]


def test_a_profile_boot_with_no_figures_fails():
    assert judge(A1, A2, {}, 33)["verdict"] == "FAIL"


def test_the_slack_is_the_longest_window_the_profile_boot_logged():
    lines = [
        "[dsv41] decode_yield window mode=measured target=50 chunk=64 prefix=0 rows=2 n=2 floor=0 given=2 "
        "ended=served source=measured step_us=5000.0 overhead_us=7000.0 rank=tp0",
        "[dsv41] decode_yield window mode=measured target=50 chunk=64 prefix=64 rows=2 n=3 floor=0 given=3 "
        "ended=served source=measured step_us=6000.0 overhead_us=7000.0 rank=tp0",
        "[dsv41] decode_yield burst share=50 lag_ms=20.0 waiting=1 planned=2 allowed=0 rank=tp0",
    ]
    assert longest_window_ms(lines) == 18.0
    assert longest_window_ms([]) == 0.0


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
