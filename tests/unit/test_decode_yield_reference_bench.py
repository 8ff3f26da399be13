"""The null test of decode-yield-engine's client reference: spans of streams decoding alone, timed
as a prefill is, read 1.0 on a machine that holds its speed and show its error where it does not."""

from __future__ import annotations

import math

import pytest

from devkit.bench import BENCHMARKS
from devkit.bench import decode_yield_reference as bench


def linear_cost_streams(c0: float, c1: float):
    """Tokens by ``t`` for streams whose token costs ``c0 + c1·k`` seconds at ``k`` tokens decoded
    (a step that grows with the context): t(k) = c0·k + c1·k²/2, solved for k."""
    return lambda t: (-c0 + math.sqrt(c0 * c0 + 2 * c1 * t)) / c1


def test_the_benchmark_is_registered_under_its_name():
    assert BENCHMARKS["decode-yield-reference"] == "devkit.bench.decode_yield_reference:run"
    assert BENCHMARKS["decode-yield-reference-dsv4"] == "devkit.bench.decode_yield_reference:run_dsv4"


def test_streams_whose_step_grows_with_their_context_read_one_in_every_span():
    """The reference is taken at the context the streams had (linear in their tokens), so a step
    that grows from 2.5 ms to about 9 ms a token over the record is no error."""
    decoded = linear_cost_streams(0.0025, 2e-6)
    shares = bench.null_shares(decoded, 0.0, 25.0, 6.0, 2.0)
    assert len(shares) == 16  # spans of 2 + 6 + 2 s starting each second in 25 s
    assert all(s == pytest.approx(1.0, abs=2e-3) for s in shares)


def test_a_machine_slower_inside_the_span_than_around_it_reads_as_the_share_it_lost():
    """100 tokens a second, except 80 from 2 s to 8 s: the span that is exactly the slow spell reads
    0.8; a share of 0.70 measured there would read 0.56, far outside ±0.03."""
    def decoded(t: float) -> float:
        return 100 * t - 20 * min(max(t - 2.0, 0.0), 6.0)

    shares = bench.null_shares(decoded, 0.0, 10.0, 6.0, 2.0)
    assert shares == [pytest.approx(0.8, abs=1e-3)]
    summary = bench.summarize(shares)
    assert summary["max_error"] == pytest.approx(0.2, abs=1e-3)
    assert summary["within"] == {"20": 0.0, "33": 0.0, "50": 0.0, "70": 0.0}


def test_each_pct_judges_the_reference_error_at_its_own_tolerance():
    """±0.03 of pct p is ±0.03/p of the reference: 0.15 at pct 20, 0.043 at pct 70."""
    summary = bench.summarize([1.0, 1.05, 0.9, 1.12])
    assert summary["spans"] == 4
    assert summary["within"] == {"20": 1.0, "33": 0.5, "50": 0.5, "70": 0.25}
    assert summary["max_error"] == pytest.approx(0.12) and summary["range"] == [0.9, 1.12]
    assert summary["median_error"] == pytest.approx(0.075)
    assert bench.summarize([]) == {"spans": 0}


def test_a_perfect_switch_reads_within_in_every_boot_only_as_often_as_the_reference_allows():
    """Every pct held exactly: one boot per pct reads within in 1 x 0.5 x 0.5 x 0.25 of runs, three
    boots per pct in that cubed."""
    shares = [1.0, 1.05, 0.9, 1.12]
    assert bench.summarize(shares)["perfect_run"] == pytest.approx(0.0625)
    assert bench.summarize(shares, boots=3)["perfect_run"] == pytest.approx(0.0625 ** 3, abs=1e-4)
    assert bench.summarize([1.0, 1.01])["perfect_run"] == 1.0


def test_spans_too_long_for_the_record_give_none():
    assert bench.null_shares(lambda t: 100 * t, 0.0, 9.0, 6.0, 2.0) == []
    assert len(bench.null_shares(lambda t: 100 * t, 0.0, 10.0, 6.0, 2.0)) == 1
    assert bench.null_shares(lambda t: 100 * t, 0.0, 14.0, 8.0, 3.0) == [pytest.approx(1.0)]  # the DSV4 kit's 3 s


def test_each_kit_records_inside_its_own_kv_pool():
    """The streams' tokens never outgrow the pool the bench boots with (decode-yield-engine's)."""
    from devkit.engine_kit import model_kits, yield_kits

    pools = {"mellum": yield_kits.MAX_TOTAL_TOKENS, "dsv4": model_kits.DSV4_MAX_TOTAL_TOKENS}
    for engine in (yield_kits.MellumYieldKit(), yield_kits.Dsv4YieldKit()):
        w = engine.workload(0)
        assert w.streams * (w.stream_prompt_tokens + bench.GRIDS[engine.name]["max_tokens"]) < pools[engine.name]


def test_the_perfect_run_counts_the_boots_per_pct_decode_yield_engine_runs_in_full():
    """The reference's ``perfect run`` is over decode-yield-engine's boots per pct; the two benches
    import nothing of each other, so the count is stated twice and held equal here."""
    from devkit.bench import decode_yield_engine as engine_bench

    assert bench.GRIDS["mellum"]["engine_boots"] == engine_bench.MELLUM.full["boots"]
    assert bench.GRIDS["dsv4"]["engine_boots"] == engine_bench.DSV4.full["boots"]
