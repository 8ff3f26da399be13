"""Cone replay beside SGLang's decoder SWA bounded replay, on the real server serving the tiny
DeepSeek-V4.1 (slow, heavy: one boot).

The DSV4.1 kit (:mod:`devkit.engine_kit.dsv41`: layer 0 SWA-only, 1 ratio 2, 2 ratio 1 = the last
KV source, 3 ratio 1 reading it, 4 SWA-only) booted with ``--enable-decoder-swa-bounded-replay``
(auto-on for V4.1 on CUDA/HIP): layers 2-4 run only on each extend's last 128 rows, reading no
window below them, and layer 2 first compresses every row. The cone's bound then counts layers
0-2 only: 768 (``geometry.cone_bound_dsv4(..., tail_from=2)``), where it is 1,024 without the tail.

Turn 2 asks for the logprobs of its 4 output tokens only: a request asking for prompt logprobs
runs its whole extend through the late layers (SGLang's ``late_layer_whole_extend``), which is
not the path a serving request takes. Compared with a stock prefix hit at F under the same flags,
in the rows that hit's forward writes: every row >= F of layers 0-1's SWA KV, the ratio-1/2
latents and fp4 index keys, the last 128 rows of layers 2-4's SWA KV; the last extend's
next-token logits; the output tokens with their logprobs and top logprobs. Measured: all
bit-identical at the bound, for the resumed turn and for a later session one page below F; one
page below the bound (512) and without the write mask the rows from F differ (|dlogprob| 0.10
and 0.04, logits 0.19 both).
"""

from __future__ import annotations

import pytest
import torch

from devkit.engine_kit.dsv41 import checkpoint
from devkit.engine_kit.dsv41.launch import REPLAY_FLAG
from devkit.testkit import dsv4_cone as dc

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

RATIOS = (0, 2, 1, 1, 0)
TAIL_FROM = 2  # the last KV-source layer: the first that runs on the tail only
BOUND = 768  # geometry.cone_bound_dsv4(128, 256, 5, ratios=RATIOS, tail_from=2)
EARLY, LATE = range(TAIL_FROM), range(TAIL_FROM, len(RATIOS))
PHASES = ("hit", "cold", "stock", "cone", "below", "below_hit", "nomask", "shallow")
L = dc.A_LEN + dc.B_LEN
ROWS_FROM_F = range(dc.F, L, dc.PAGE)
ROWS_FROM_BELOW = range(dc.BELOW, dc.BELOW + dc.B_LEN, dc.PAGE)
MASKED = range(dc.F - BOUND, dc.F - 2 * dc.PAGE, dc.PAGE)  # [s, F - R): compressed rows kept as copied


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    work = tmp_path_factory.mktemp("v41_decoder_cone")
    model = checkpoint.make_checkpoint(work / "ckpt", ratios=RATIOS)
    return dc.run(work, PHASES, depths={"shallow": BOUND - dc.PAGE}, tokens=BOUND, model=model,
                  extra=(REPLAY_FLAG,), prompt_logprobs=False, new_tokens=4)


def _tail_diffs(a, b, pages, end):
    """Bytes that differ in every region the reference's forward writes: early layers' SWA and the
    Full side over whole pages, late layers' SWA over the extend's last 128 rows (``end``: its end)."""
    pa, pb = dc.pages_at(a["dumps"], pages), dc.pages_at(b["dumps"], pages)
    whole = {k: v for k, v in dc.page_diffs(pa, pb).items() if k.startswith("full.") or int(k[4:]) in EARLY}
    assert set(whole) >= {f"swa.{layer}" for layer in EARLY} and any(k.startswith("full.") for k in whole), whole
    return {**whole, **{f"tail.{k}": v for k, v in dc.swa_row_diffs(pa, pb, LATE, range(end - dc.WINDOW, end)).items()}}


def _same_output(a, b):
    assert a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"] and a["top"] == b["top"]
    assert torch.equal(a["logits"], b["logits"])


def test_under_decoder_replay_the_kit_leaves_a_prefix_hit_and_a_cold_prompt_the_same_tail(phases):
    assert phases["hit"]["cached_tokens"] == dc.F and phases["cold"]["cached_tokens"] == 0
    diffs = _tail_diffs(phases["hit"], phases["cold"], ROWS_FROM_F, L)
    assert all(v == 0 for v in diffs.values()), diffs
    _same_output(phases["hit"], phases["cold"])


def test_beside_decoder_replay_the_cone_acts_at_the_bound_of_the_layers_before_the_tail(phases):
    log = "\n".join(phases["log"])
    assert (f"cone_replay installed N={BOUND} bound={BOUND} window=128 page=256 swa_layers=5 "
            f"decoder_tail_from={TAIL_FROM}") in log
    assert "refused" not in "\n".join(line for line in phases["log"] if "cone_replay" in line)
    assert phases["stock"]["cached_tokens"] < dc.F - BOUND  # the stock recompute after churn
    assert phases["cone"]["cached_tokens"] == dc.F - BOUND
    assert f"DSV41_SWA_CONE forward rows={BOUND} masked={BOUND - 2 * dc.PAGE} " in log


def test_every_row_the_tail_path_writes_from_f_equals_a_stock_prefix_hit(phases):
    diffs = _tail_diffs(phases["hit"], phases["cone"], ROWS_FROM_F, L)
    assert all(v == 0 for v in diffs.values()), diffs
    _same_output(phases["hit"], phases["cone"])


def test_a_later_session_resuming_one_page_below_f_equals_a_stock_prefix_hit_there(phases):
    assert phases["below"]["cached_tokens"] == phases["below_hit"]["cached_tokens"] == dc.BELOW
    diffs = _tail_diffs(phases["below_hit"], phases["below"], ROWS_FROM_BELOW, dc.BELOW + dc.B_LEN)
    assert all(v == 0 for v in diffs.values()), diffs
    _same_output(phases["below_hit"], phases["below"])


def test_one_page_below_the_bound_the_rows_from_f_differ(phases):
    assert phases["shallow"]["cached_tokens"] == dc.F - BOUND + dc.PAGE
    assert sum(_tail_diffs(phases["hit"], phases["shallow"], ROWS_FROM_F, L).values()) > 0
    assert not torch.equal(phases["hit"]["logits"], phases["shallow"]["logits"])


def test_the_write_mask_keeps_the_copied_compressed_rows_and_without_it_the_rows_from_f_differ(phases):
    def full_diffs(name):
        a = dc.pages_at(phases["hit"]["turn1"], MASKED)  # the resident bytes: a stock prefill of A
        b = dc.pages_at(phases[name]["dumps"], MASKED)
        return {k: v for k, v in dc.page_diffs(a, b).items() if k.startswith("full.")}

    kept, overwritten = full_diffs("cone"), full_diffs("nomask")
    assert kept and all(v == 0 for v in kept.values()), kept
    assert sum(overwritten.values()) > 0, overwritten
    assert sum(_tail_diffs(phases["hit"], phases["nomask"], ROWS_FROM_F, L).values()) > 0
    assert not torch.equal(phases["hit"]["logits"], phases["nomask"]["logits"])
    assert dc.logprob_distance(phases["hit"], phases["nomask"]) > 0
