"""Two TP ranks whose clocks disagree take the same decode-yield windows (slow: spawns two
interpreters joined by a gloo group, each a real SGLang Scheduler on the CPU harness;
devkit.bench.decode_yield_ranks)."""

from __future__ import annotations

import pytest

from devkit.bench import decode_yield_ranks as ranks

pytestmark = pytest.mark.slow


def test_ranks_that_measure_differently_take_rank_zeros_windows_and_make_every_decision_alike():
    agreed = ranks.two_ranks(agree=True)
    assert agreed[0]["windows"] == agreed[1]["windows"] and len(agreed[0]["windows"]) == 39
    assert agreed[0]["decisions"] == agreed[1]["decisions"]
    # one broadcast per window (the long prompt's 39 and the few of the streams' own chunked
    # admission): both ranks take part in each
    assert 39 <= len(agreed[0]["agree_ns"]) == len(agreed[1]["agree_ns"]) <= 39 + 4
    assert abs(agreed[0]["share"] - ranks.PCT / 100) <= 0.03  # rank 0's clock: its loop holds the share
    # the control: each rank on its own clock decides other windows (why the broadcast is needed)
    alone = ranks.two_ranks(agree=False)
    assert alone[0]["windows"] != alone[1]["windows"] and alone[0]["decisions"] != alone[1]["decisions"]
