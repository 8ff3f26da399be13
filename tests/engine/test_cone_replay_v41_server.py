"""Cone replay on SGLang 0.5.23's real server serving the tiny DeepSeek-V4.1 (slow, heavy: one boot).

The DSV4.1 kit (:mod:`devkit.engine_kit.dsv41`): layer 0 SWA-only, 1 ratio 2 (KV + index source), 2
ratio 1 (the last KV source), 3 ratio 1 (reads layer 2's KV), 4 SWA-only; the real
``DeepSeekV4TokenToKVPool`` with its ratio-1/2 latent pools and fp4 index-K pool, the real backend
and tree, run through :mod:`devkit.engine_kit.dsv4.cone_probe` (:mod:`devkit.testkit.dsv4_cone`
runs the phases). Decoder SWA bounded replay off here (beside it: ``test_cone_replay_v41_decoder_server.py``).

Exactness: every row >= F of a session whose SWA window at F was evicted by churn, replayed through
the cone at N = the bound (1,024: five layers), leaves in the pool exactly the bytes a stock prefix
hit at F leaves (every layer's SWA KV, the ratio-1/2 latents, the fp4 index keys) and gets the same
input logprobs, and so does a later session resuming one page below F. Without the write mask the
rows >= F differ. One page below the bound (768) the same checks passed too on this kit (the bound
is sufficient, not tight here: docs/switches/cone_replay.md), so no phase asserts a difference there. The kit's precondition is checked first: a stock prefix hit at F and a cold
prefill of the same tokens give the same bytes (the kit's prefill top-k takes ties at the lowest
column; upstream's torch ``topk(sorted=False)`` chose among tied scores by the forward's width).
"""

from __future__ import annotations

import pytest

from devkit.engine_kit.dsv41 import checkpoint
from devkit.testkit import dsv4_cone as dc

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

RATIOS = (0, 2, 1, 1, 0)
BOUND = 1024  # geometry.cone_bound_dsv4(128, 256, 5, ratios=RATIOS)
PHASES = ("hit", "cold", "stock", "cone", "below", "below_hit", "nomask")
ROWS_FROM_F = range(dc.F, dc.A_LEN + dc.B_LEN, dc.PAGE)
ROWS_FROM_BELOW = range(dc.BELOW, dc.BELOW + dc.B_LEN, dc.PAGE)


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    work = tmp_path_factory.mktemp("v41_cone")
    model = checkpoint.make_checkpoint(work / "ckpt", ratios=RATIOS)
    return dc.run(work, PHASES, depths={"cone": BOUND, "nomask": BOUND},
                  tokens=BOUND, model=model)


def _diffs(a, b, rows):
    diffs = dc.page_diffs(dc.pages_at(a["dumps"], rows), dc.pages_at(b["dumps"], rows))
    assert diffs, "no pages compared"
    return diffs


def test_the_kit_prefills_a_prefix_hit_and_a_cold_prompt_to_the_same_bytes(phases):
    assert phases["hit"]["cached_tokens"] == dc.F and phases["cold"]["cached_tokens"] == 0
    assert all(v == 0 for v in _diffs(phases["hit"], phases["cold"], ROWS_FROM_F).values())
    assert phases["cold"]["logprobs"] == phases["hit"]["logprobs"]


def test_the_cone_acts_on_ratio_1_and_2_kv_source_layers_at_its_bound(phases):
    log = "\n".join(phases["log"])
    assert f"cone_replay installed N={BOUND} bound={BOUND} window=128 page=256 swa_layers=5" in log
    assert "refused" not in "\n".join(line for line in phases["log"] if "cone_replay" in line)
    assert phases["stock"]["cached_tokens"] < dc.F - BOUND  # the stock recompute after churn
    assert phases["cone"]["cached_tokens"] == dc.F - BOUND
    assert f"DSV41_SWA_CONE forward rows={BOUND} masked={BOUND - 2 * dc.PAGE} " in log


def test_every_row_from_f_leaves_the_bytes_and_logprobs_of_a_stock_prefix_hit(phases):
    diffs = _diffs(phases["hit"], phases["cone"], ROWS_FROM_F)
    assert set(diffs) >= {f"swa.{layer}" for layer in range(len(RATIOS))} and all(v == 0 for v in diffs.values()), diffs
    assert phases["cone"]["logprobs"] == phases["hit"]["logprobs"] and phases["cone"]["top"] == phases["hit"]["top"]
    assert phases["cone"]["token"] == phases["cold"]["token"]


def test_a_later_session_resuming_one_page_below_f_reads_exact_republished_pages(phases):
    assert phases["below"]["cached_tokens"] == phases["below_hit"]["cached_tokens"] == dc.BELOW
    assert all(v == 0 for v in _diffs(phases["below_hit"], phases["below"], ROWS_FROM_BELOW).values())
    assert phases["below"]["logprobs"] == phases["below_hit"]["logprobs"]


def test_without_the_write_mask_the_rows_from_f_differ(phases):
    assert sum(_diffs(phases["hit"], phases["nomask"], ROWS_FROM_F).values()) > 0
    assert dc.logprob_distance(phases["hit"], phases["nomask"]) > 0

