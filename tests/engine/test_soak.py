"""The soak's short form on the real CPU engine (slow: two boots, about 5 minutes on a quiet
machine): the gate's profile with KV parking on, under forced retractions, serves seeded agent
traffic with no failed request, no leak or sanity report, no error in the log, its probes' greedy
outputs equal before, after and to stock's, and every server stopped."""

import json

import pytest

from devkit import soak

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def test_the_short_soak_loses_nothing_and_its_probes_equal_stock(tmp_path, capsys):
    figures = soak.run(minutes=1.5, stock_minutes=0.25, seed=3, out=tmp_path, bisect=False)
    print(json.dumps(figures))
    assert figures["served"] > 0 and figures["failed"] == 0, figures["request_errors"]
    assert figures["leak_reports"] == 0, figures["leak_lines"]
    assert figures["log_errors"] == 0, figures["log_error_lines"]
    assert figures["probe_outputs_equal"] is True
    assert figures["refused_switches"] == []
    assert figures["receipt_gaps"] == []  # every switch installed on the scheduler (its tp0 receipts)
    assert figures["retractions"] > 0 and figures["kv_park"]["parked"] > 0
    assert figures["parked_budget"]["respected"] is True
    assert figures["leftover_processes"] == 0
    for latency in (figures["latency"], figures["stock"]["latency"]):  # TTFT and ITL per boot, as bench_serving
        assert latency["requests_timed"] > 0 and latency["mean_ttft_ms"] > 0 and latency["p99_itl_ms"] > 0, latency
    # Growth over 90 s of a small model is noise-bound: the 5 % target is the long soak's.
    assert figures["rss_growth_pct"] is not None and figures["rss_growth_pct"] < 10
