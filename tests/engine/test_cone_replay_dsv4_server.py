"""Cone replay on SGLang 0.5.23's real server serving the tiny DeepSeek-V4 (slow: one boot, ten phases).

The server runs the real ``DeepSeekV4TokenToKVPool`` (paged SWA, fp8 V4 rows, C4 + C128 latents, the
C4 indexer, compressor state rings), the real ``DeepseekV4AttnBackend`` and ``UnifiedRadixCache``
with the seeded C0/C4/C128 checkpoint, through :mod:`devkit.engine_kit.dsv4.cone_probe`, whose probe
dumps the pool's bytes after each extend forward (:mod:`devkit.testkit.dsv4_cone` runs the phases).

Exactness: every row >= F of a session whose SWA window at F was evicted by churn, replayed through
the cone at N = the bound, leaves in the pool exactly the bytes a stock prefix hit at F leaves (every
layer's SWA KV, C4 / C128 latents, C4 index keys) and gets the same input logprobs; the replay's last
two pages before F (re-published by the first checkpoint) hold turn 1's bytes. Without the write mask,
or one page below the bound, the rows >= F differ.
"""

from __future__ import annotations

import pytest

from devkit.testkit import dsv4_cone as dc

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    return dc.run(tmp_path_factory.mktemp("dsv4_cone"))


ROWS_FROM_F = range(dc.F, dc.A_LEN + dc.B_LEN, dc.PAGE)
REPUBLISHED = range(dc.F - 2 * dc.PAGE, dc.F, dc.PAGE)
ROWS_FROM_BELOW = range(dc.BELOW, dc.BELOW + dc.B_LEN, dc.PAGE)


def _from_f(phase):
    return dc.pages_at(phase["dumps"], ROWS_FROM_F)


def test_an_evicted_session_resumes_through_the_cone_at_page_floor_f_minus_n(phases):
    assert phases["hit"]["cached_tokens"] == dc.F  # the stock prefix hit at F
    assert phases["cold"]["cached_tokens"] == 0
    assert phases["stock"]["cached_tokens"] < dc.F - dc.N  # the stock recompute after churn
    assert phases["cone"]["cached_tokens"] == dc.F - dc.N  # s = page_floor(F - N): N replayed
    # history recomputed: N + the page past F the evicted leaf took along (at most N + page)
    assert dc.A_LEN - phases["cone"]["cached_tokens"] == dc.N + dc.PAGE
    log = "\n".join(phases["log"])
    assert f"cone_replay installed N={dc.N} bound={dc.N} window=128 page=256 swa_layers=3" in log
    assert "DSV41_SWA_CONE plan rid=" in log and f" F={dc.F} s={dc.F - dc.N} N={dc.N} " in log
    # rows [s, F - 2 pages) keep the copied latents: their compressor writes go to slot 0
    assert f"DSV41_SWA_CONE forward rows={dc.N} masked={dc.N - 2 * dc.PAGE} " in log


def test_every_row_from_f_leaves_the_bytes_of_a_stock_prefix_hit_in_every_layer_and_region(phases):
    diffs = dc.page_diffs(_from_f(phases["hit"]), _from_f(phases["cone"]))
    assert diffs and all(v == 0 for v in diffs.values()), diffs


def test_with_n_equal_to_the_chunk_rows_from_f_are_exact(phases):
    n = dc.GEOMETRY["chunk"]
    assert phases["exact_chunk"]["cached_tokens"] == dc.F - n
    diffs = dc.page_diffs(_from_f(phases["hit"]), _from_f(phases["exact_chunk"]))
    assert diffs and all(v == 0 for v in diffs.values()), diffs
    assert phases["exact_chunk"]["logprobs"] == phases["hit"]["logprobs"]


def test_every_row_from_f_gets_the_input_logprobs_of_a_stock_prefix_hit(phases):
    assert phases["cone"]["logprobs"] == phases["hit"]["logprobs"]
    assert phases["cone"]["top"] == phases["hit"]["top"]
    assert phases["cone"]["token"] == phases["hit"]["token"]


def test_the_replayed_pages_the_first_checkpoint_republishes_hold_turn_ones_bytes(phases):
    turn1 = dc.pages_at(phases["hit"]["turn1"], REPUBLISHED)
    replay = dc.pages_at(phases["cone"]["dumps"], REPUBLISHED)
    diffs = dc.page_diffs(turn1, replay)
    assert all(v == 0 for v in diffs.values()), diffs


def test_a_later_session_resuming_one_page_below_f_reads_exact_republished_pages(phases):
    assert phases["below"]["cached_tokens"] == phases["below_hit"]["cached_tokens"] == dc.BELOW
    a = dc.pages_at(phases["below_hit"]["dumps"], ROWS_FROM_BELOW)
    b = dc.pages_at(phases["below"]["dumps"], ROWS_FROM_BELOW)
    diffs = dc.page_diffs(a, b)
    assert all(v == 0 for v in diffs.values()), diffs
    assert phases["below"]["logprobs"] == phases["below_hit"]["logprobs"]


def test_without_the_write_mask_the_rows_from_f_differ(phases):
    diffs = dc.page_diffs(_from_f(phases["hit"]), _from_f(phases["nomask"]))
    assert sum(diffs.values()) > 0, diffs
    assert dc.logprob_distance(phases["hit"], phases["nomask"]) > 0


def test_one_page_below_the_bound_the_rows_from_f_differ(phases):
    assert phases["shallow"]["cached_tokens"] == dc.F - (dc.N - dc.PAGE)
    diffs = dc.page_diffs(_from_f(phases["hit"]), _from_f(phases["shallow"]))
    assert sum(diffs.values()) > 0, diffs


def test_a_first_chunk_that_cannot_cover_the_replay_falls_back_to_the_stock_match(phases):
    assert phases["short"]["cached_tokens"] == phases["stock"]["cached_tokens"]
    log = "\n".join(phases["log"])
    assert log.count("DSV41_SWA_CONE fallback") == log.count("reason=first_chunk_short") == 1


def test_the_cone_matches_a_full_re_prefill_within_the_gate_tolerance(phases):
    assert phases["cone"]["token"] == phases["cold"]["token"]
    assert dc.logprob_distance(phases["cone"], phases["cold"]) <= dc.LOGPROB_TOLERANCE
