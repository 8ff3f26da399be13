"""The pure-torch DSV4 sparse decode over a raw byte pool: the in-place 256-token page view and the
stock 64-token page split address the same bytes and give the same outputs (CPU)."""

from __future__ import annotations

import pytest
import torch

from devkit.reference import dsv4_decode as ref


@pytest.fixture(scope="module")
def cases():
    return {seed: ref.decode_case(batch, heads=16, pages_per_request=4, seed=seed)
            for seed, batch in ((0, 1), (1, 5), (2, 12))}  # fmt: skip


def test_sglang_pool_pitch_is_the_padded_page_the_kernel_reads():
    assert ref.page_pitch(256) == 149760
    assert ref.page_pitch(64) == 37440
    view = ref.kernel_view(torch.zeros(3, ref.page_pitch(256), dtype=torch.uint8), 256)
    assert view.shape == (3, 256, 1, 584) and view.stride() == (149760, 584, 584, 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_in_place_view_and_64_token_split_gather_identical_bytes_and_outputs(cases, seed):
    """Random page tables, -1 padding, trimmed top-k lengths, attention sink and the C4A extra cache."""
    case = cases[seed]
    assert (case.indices < 0).any(), "the case must exercise -1 padding"
    result = ref.compare_addressings(case)
    assert result["bytes_identical"]
    assert result["outputs_identical"]
    assert result["max_abs_diff"] == 0.0
    assert result["touched_pages"] >= case.q.shape[0]


def test_split_sub_page_holds_the_tokens_of_its_quarter_of_the_page():
    pool = ref.make_pool(3, 256, seed=5)
    split = ref.split_pages(pool, 256)
    token = 2 * 256 + 3 * 64 + 17  # page 2, quarter 3, row 17
    idx = torch.tensor([[token]], dtype=torch.int32)
    valid = idx >= 0
    d256, s256 = ref.gather_bytes(ref.kernel_view(pool, 256), idx, valid)
    d64, s64 = ref.gather_bytes(ref.kernel_view(split, 64), idx, valid)
    assert torch.equal(d256, d64) and torch.equal(s256, s64)
    assert torch.equal(split[2 * 4 + 3, 17 * 576 : 18 * 576], pool[2, token % 256 * 576 : token % 256 * 576 + 576])


def test_a_view_with_a_wrong_page_stride_reads_other_bytes_and_fails_the_check(cases):
    """The check can fail: a canonical pitch (256 x 584, what SGLang does not use) misaddresses pages > 0."""
    case = cases[2]
    good = ref.kernel_view(case.pool, 256)
    wrong = torch.as_strided(case.pool, (case.pool.shape[0] - 1, 256, 1, 584), (256 * 584, 584, 584, 1))
    idx = case.indices.clamp_max(wrong.shape[0] * 256 - 1)
    valid = idx >= 0
    assert (idx[valid] >= 256).any()
    d_good, _ = ref.gather_bytes(good, idx, valid)
    d_wrong, _ = ref.gather_bytes(wrong, idx, valid)
    assert not torch.equal(d_good, d_wrong)
    out_good, _ = ref.sparse_decode(case.q, good, idx, case.sm_scale)
    out_wrong, _ = ref.sparse_decode(case.q, wrong, idx, case.sm_scale)
    assert not torch.equal(out_good, out_wrong)


def test_masked_and_trimmed_slots_contribute_nothing_even_over_garbage_bytes():
    pool = ref.make_pool(2, 256, seed=7)
    q = (torch.randn(2, 8, 512) / 4).to(torch.bfloat16)
    idx = torch.tensor([[5, 300, -1, -1], [7, 9, 11, 13]], dtype=torch.int32)
    lengths = torch.tensor([2, 3], dtype=torch.int32)
    base, base_lse = ref.sparse_decode(q, ref.kernel_view(pool, 256), idx, 0.05, topk_length=lengths)
    poisoned = pool.clone()
    poisoned[0, 13 * 576 : 14 * 576] = 0x7F  # token 13: trimmed by topk_length on row 1
    out, lse = ref.sparse_decode(q, ref.kernel_view(poisoned, 256), idx, 0.05, topk_length=lengths)
    assert torch.equal(out, base) and torch.equal(lse, base_lse)


def test_an_empty_row_gives_zero_output_and_the_sinks_lse():
    pool = ref.make_pool(1, 256, seed=8)
    q = torch.ones(1, 4, 512, dtype=torch.bfloat16)
    idx = torch.full((1, 8), -1, dtype=torch.int32)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, lse = ref.sparse_decode(q, ref.kernel_view(pool, 256), idx, 0.1, attn_sink=sink)
    assert torch.count_nonzero(out) == 0
    torch.testing.assert_close(lse, sink.unsqueeze(0) * ref.LOG2E)
    _, lse_no_sink = ref.sparse_decode(q, ref.kernel_view(pool, 256), idx, 0.1)
    assert torch.isneginf(lse_no_sink).all()


def test_reference_agrees_with_sglangs_own_torch_decode_on_the_same_pool(cases):
    """SGLang 0.5.23's ``_sm120_sparse_decode_fwd`` (its pure-PyTorch SM120 decode) on the 256-token view."""
    from sglang.kernels.ops.attention.flash_mla_sm120 import _sm120_sparse_decode_fwd

    case = cases[1]
    extra = case.extra()
    out, _ = ref.sparse_decode(case.q, ref.kernel_view(case.pool, 256), case.indices, case.sm_scale,
                               topk_length=case.topk_length, attn_sink=case.attn_sink, extra=extra)  # fmt: skip
    theirs, _ = _sm120_sparse_decode_fwd(
        case.q.unsqueeze(1), ref.kernel_view(case.pool, 256).view(torch.float8_e4m3fn), case.indices.unsqueeze(1),
        case.topk_length, case.attn_sink, 512, case.sm_scale, extra.view.view(torch.float8_e4m3fn),
        case.extra_indices.unsqueeze(1), case.extra_topk_length,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), theirs.squeeze(1).float(), atol=2e-3, rtol=1e-2)
