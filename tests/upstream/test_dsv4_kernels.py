"""The DeepSeek-V4 kit's pure-torch stand-ins (``devkit/engine_kit/dsv4``), each compared by value with a
reference that does not share its code: SGLang's own torch paths (``swiglu_limit_func``,
``_mhc_pre_torch``, ``hc_head_torch``), the dense windows of transformers 5.19's compressors, the
project's DSV4 decode reference (``devkit.reference.dsv4_decode``), the other kit engineer's page
readers (``devkit.engine_kit.dsv4.reference``) and plain dense attention.

Tolerances, and why:
* fp32 against fp32 (plans, pooling, Sinkhorn, metadata): 1e-5 absolute, summation order only;
  index tensors and plan bytes exactly.
* fp8 stores: the bytes exactly (same rounding rule: RNE e4m3 after a power-of-two UE8M0 scale);
  against the unquantised rows, the e4m3 grid: |err| <= 2^-4 |x| + 2^-9 x scale (3 mantissa bits).
* bf16 outputs (attention, SwiGLU): 1/64 relative + 1e-2 absolute, a few bf16 ulps after an fp32
  softmax; the same formula in the same dtype exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from devkit.engine_kit.dsv4 import flashmla, kernels, reference
from devkit.reference import dsv4_decode

SWA_PAGE = 256


def _freqs(max_pos: int = 2048, dim: int = 64, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    return torch.polar(torch.ones(max_pos, dim // 2), torch.outer(torch.arange(max_pos).float(), inv))


def _rope_complex(x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """DeepSeek's reference rope: interleaved pairs as complex numbers times ``freqs_cis[pos]``."""
    shape = x.shape
    xc = torch.view_as_complex(x.float().reshape(*shape[:-1], -1, 2).contiguous())
    f = freqs_cis[positions].reshape(shape[0], *([1] * (x.dim() - 2)), -1)
    return torch.view_as_real(xc * f).reshape(shape)


def _rms(x: torch.Tensor, eps: float, w: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    return (y if w is None else y * w.double()).float()


# ----------------------------------------------------------------------------- compressor


class _Pools:
    """A request on a paged SWA layout: full slots ``pos + 1024``, SWA pages scattered (3, 0, 5, ...)."""

    def __init__(self, max_len: int, ratio: int) -> None:
        self.ratio = ratio
        self.ring = 8 if ratio == 4 else 128
        self.rid = 2
        self.req_to_token = torch.zeros(4, max_len, dtype=torch.int32)
        self.req_to_token[self.rid] = torch.arange(max_len, dtype=torch.int32) + 1024
        order = [3, 0, 5, 1, 4, 2, 7, 6]
        self.full_to_swa = torch.full((1024 + max_len,), -1, dtype=torch.int64)
        pos = torch.arange(max_len)
        self.full_to_swa[1024 + pos] = torch.tensor(order)[pos // SWA_PAGE] * SWA_PAGE + pos % SWA_PAGE


def _dense_windows(kv_score: torch.Tensor, ape: torch.Tensor, ratio: int, d: int) -> torch.Tensor:
    """transformers 5.19's CSA (ratio 4, Ca/Cb overlap) / HCA (ratio 128) pooling over whole windows."""
    n = kv_score.shape[0] // ratio
    kv = kv_score[: n * ratio].view(n, ratio, -1).double()
    ape = ape.double()
    if ratio == 128:
        return (kv[..., :d] * torch.softmax(kv[..., d:] + ape, dim=1)).sum(1).float()
    ca, cb, za, zb = kv[..., :d], kv[..., d:2 * d], kv[..., 2 * d:3 * d], kv[..., 3 * d:]
    new_kv = torch.zeros(n, 8, d, dtype=torch.float64)
    new_gate = torch.full((n, 8, d), float("-inf"), dtype=torch.float64)
    new_kv[:, 4:], new_gate[:, 4:] = cb, zb + ape[4:]
    new_kv[1:, :4], new_gate[1:, :4] = ca[:-1], za[:-1] + ape[:4]
    return (new_kv * torch.softmax(new_gate, dim=1)).sum(1).float()


@pytest.mark.parametrize("ratio", [4, 128])
def test_compressor_state_rings_over_chunked_prefill_and_decode_give_the_dense_windows(ratio):
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan, CompressorPrefillPlan

    d = 64
    element = (4 if ratio == 4 else 2) * d
    total = 700 if ratio == 4 else 900
    g = torch.Generator().manual_seed(ratio)
    kv_score = torch.randn(total, element, generator=g)
    ape = torch.randn(8 if ratio == 4 else 128, d, generator=g)
    want = _dense_windows(kv_score, ape, ratio, d)
    pools = _Pools(total + 8, ratio)
    ring = pools.ring
    rows = 8 * ring if ratio == 4 else 4 * ring  # C4: a ring per SWA page (8 pages); C128: per request (4)
    state = torch.full((rows // ratio, ratio, element), float("nan"))  # a slot never written reads as NaN
    rid = torch.tensor([pools.rid])
    got = {}
    pos = 0
    chunks = [256, 100, 3, 1, 156] if ratio == 4 else [256, 256, 77, 1]
    for n in chunks:  # chunked prefill
        seq = pos + n
        plan_c, plan_w = kernels.plan_compress_prefill(ratio, rid, torch.tensor([seq]), torch.tensor([n]),
                                                       pools.req_to_token, pools.full_to_swa, SWA_PAGE, ring, n)
        plan = CompressorPrefillPlan(ratio, plan_c, plan_w, None)
        out = kernels.compress_forward(state, kv_score[pos:seq], ape, plan, head_dim=d, compress_ratio=ratio)
        for row, seq_len in enumerate(plan_c.view(torch.int32)[:, 0].tolist()):
            got[seq_len // ratio - 1] = out[row]
        pos = seq
    while pos < total:  # decode, one token per step
        seq = pos + 1
        plan = CompressorDecodePlan(ratio, kernels.plan_compress_decode(
            ratio, rid, pools.req_to_token, pools.full_to_swa, torch.tensor([seq]), SWA_PAGE, ring))
        out = kernels.compress_forward(state, kv_score[pos:seq], ape, plan, head_dim=d, compress_ratio=ratio)
        if seq % ratio == 0:
            got[seq // ratio - 1] = out[0]
        pos = seq
    assert sorted(got) == list(range(total // ratio))
    torch.testing.assert_close(torch.stack([got[w] for w in sorted(got)]), want, atol=1e-5, rtol=1e-5)


def test_the_prefill_plan_writes_the_rows_the_next_batch_reads():
    pools = _Pools(600, 4)
    plan_c, plan_w = kernels.plan_compress_prefill(4, torch.tensor([pools.rid]), torch.tensor([600]),
                                                   torch.tensor([600]), pools.req_to_token, pools.full_to_swa,
                                                   SWA_PAGE, 8, 600)
    c = plan_c.view(torch.int32)
    assert c.shape[0] == 150 and c[:, 0].tolist() == list(range(4, 601, 4))
    assert ((c[:, 1] >> 16) & 0xFFFF)[:2].tolist() == [4, 0]  # buffer_len: first window's overlap half absent
    w = plan_w.view(torch.int32)
    positions = sorted(int(r) for r in w[:, 0])  # ragged ids = positions (one request from 0)
    assert positions == [252, 253, 254, 255, 508, 509, 510, 511, 596, 597, 598, 599]


# ----------------------------------------------------------------------------- stores


def test_the_compressor_store_writes_the_v4_bytes_of_the_projects_quantiser():
    from sglang.kernels.ops.attention.dsv4.compress import CompressorPrefillPlan

    g = torch.Generator().manual_seed(1)
    n, page_size = 5, 64
    kv = torch.randn(n, 512, generator=g) * 3
    weight = torch.rand(512, generator=g) + 0.5
    freqs = _freqs()
    seq = torch.tensor([4, 8, 20, 300, 404])
    plan_c = torch.stack([seq, torch.arange(n), torch.full((n,), -1), torch.zeros(n, dtype=torch.long)], 1)
    plan = CompressorPrefillPlan(4, plan_c.to(torch.int32).view(torch.uint8), torch.empty(0, 8, dtype=torch.uint8))
    out_loc = torch.tensor([70, 3, 64, 127, 0])
    cache = torch.zeros(3, kernels.v4_page_bytes(page_size), dtype=torch.uint8)
    kernels.compress_norm_rope_store(kv, plan, norm_weight=weight, norm_eps=1e-6, freq_cis=freqs, out_loc=out_loc,
                                     kvcache=cache, page_size=page_size)
    x = _rms(kv, 1e-6, weight)
    x = torch.cat([x[:, :448], _rope_complex(x[:, 448:], freqs, seq - 4)], -1).to(torch.bfloat16)
    data, scales = dsv4_decode.quantize_tokens(x)
    view = dsv4_decode.kernel_view(cache, page_size)
    got_data, got_scales = dsv4_decode.gather_bytes(view, out_loc.unsqueeze(0), torch.ones(1, n, dtype=torch.bool))
    assert torch.equal(got_data[0], data) and torch.equal(got_scales[0, :, :7], scales[:, :7])


def test_the_main_k_store_round_trips_on_the_e4m3_grid_and_keeps_the_rope_in_bf16():
    g = torch.Generator().manual_seed(2)
    n = 6
    kv = (torch.randn(n, 512, generator=g) * 2).to(torch.bfloat16)
    weight = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)
    freqs = _freqs()
    positions = torch.tensor([0, 1, 255, 256, 700, 1500])
    out_loc = torch.tensor([5, 300, -1, 511, 0, 256])  # -1: not written
    pool = torch.zeros(2, dsv4_decode.page_pitch(SWA_PAGE), dtype=torch.uint8)
    kernels.fused_k_norm_rope_flashmla(kv, weight, 1e-6, freqs, positions, out_loc, pool, SWA_PAGE)
    x = _rms(kv, 1e-6, weight)
    x = torch.cat([x[:, :448], _rope_complex(x[:, 448:], freqs, positions)], -1)
    keep = out_loc >= 0
    rows = reference.dequantize_v4_pages(pool, out_loc[keep], SWA_PAGE).float()
    want = x[keep]
    groups = want[:, :448].reshape(-1, 7, 64)
    scale = torch.pow(2.0, torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-4) / 448))).unsqueeze(-1)
    err = (rows[:, :448].reshape(-1, 7, 64) - groups).abs()
    assert bool((err <= groups.abs() / 16 + scale * 2.0 ** -9).all())
    torch.testing.assert_close(rows[:, 448:], want[:, 448:].to(torch.bfloat16).float(), atol=0, rtol=2 ** -8)
    assert int(pool[0, 2 * 576:3 * 576].sum()) == 0  # the -1 row (slot 2 unused) stays untouched


def test_the_indexer_store_and_query_rotate_by_hadamard_and_quantise_with_an_fp32_amax_scale():
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan

    g = torch.Generator().manual_seed(3)
    freqs = _freqs()
    kv = torch.randn(3, 128, generator=g)
    weight = torch.rand(128, generator=g) + 0.5
    plan_d = torch.tensor([[8, 0, 0, 0], [9, 0, 0, 0], [400, 0, 0, 0]], dtype=torch.int32).view(torch.uint8)
    out_loc = torch.tensor([10, 99, 65])
    cache = torch.zeros(2, 132 * 64, dtype=torch.uint8)
    kernels.compress_norm_rope_store(kv, CompressorDecodePlan(4, plan_d), norm_weight=weight, norm_eps=1e-6,
                                     freq_cis=freqs, out_loc=out_loc, kvcache=cache, page_size=64)
    x = _rms(kv, 1e-6, weight)
    x = torch.cat([x[:, :64], _rope_complex(x[:, 64:], freqs, torch.tensor([4, 5, 396]))], -1)
    got = reference.dequantize_indexer_pages(cache, out_loc[[0, 2]], 64)
    torch.testing.assert_close(got, reference.roundtrip_indexer(x[[0, 2]]), atol=1e-6, rtol=1e-6)
    assert int(cache[1, (99 - 64) * 128:(99 - 64) * 128 + 128].sum()) == 0  # seq 9: no window closed

    q = torch.randn(4, 3, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(4, 3, generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 7, 100, 1999])
    q_fp8, weights = kernels.fused_q_indexer_rope_hadamard_quant(q, w, 0.125, freqs, pos)
    xq = torch.cat([q[..., :64].float(), _rope_complex(q[..., 64:], freqs, pos)], -1)
    values, scale = reference.quantize_indexer(xq @ reference.hadamard())
    assert torch.equal(q_fp8.view(torch.uint8), values.view(torch.uint8))
    torch.testing.assert_close(weights.squeeze(-1), w.float() * 0.125 * scale)


def test_the_query_norm_rope_matches_the_reference_rope_after_a_weightless_rmsnorm_in_bf16():
    g = torch.Generator().manual_seed(4)
    freqs = _freqs()
    q = torch.randn(5, 8, 512, generator=g).to(torch.bfloat16)
    pos = torch.tensor([3, 0, 17, 255, 1024])
    out = torch.empty_like(q)
    kernels.fused_q_norm_rope(q, out, 1e-6, freqs, pos)
    normed = _rms(q, 1e-6).to(torch.bfloat16)
    want = torch.cat([normed[..., :448].float(), _rope_complex(normed[..., 448:], freqs, pos)], -1)
    torch.testing.assert_close(out.float(), want.to(torch.bfloat16).float(), atol=1e-2, rtol=2 ** -7)
    k = q[:, 0, -64:].clone()
    kernels.fused_rope_inplace(k, None, freqs, pos, inverse=True)
    back = _rope_complex(k.float(), freqs, pos)  # the forward rope undoes the inverse
    torch.testing.assert_close(back, q[:, 0, -64:].float(), atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------- attention


def test_the_sparse_decode_stand_in_is_dense_attention_over_both_caches_with_the_sink():
    case = dsv4_decode.decode_case(3, heads=8, window=64, topk=96, pages_per_request=2, seed=5)
    q = case.q.unsqueeze(1)  # [b, s_q = 1, h, 512]
    main = dsv4_decode.kernel_view(case.pool, SWA_PAGE)
    extra = dsv4_decode.kernel_view(case.extra_pool, 64)
    out, lse = flashmla.flash_mla_with_kvcache(
        q=q, k_cache=main, head_dim_v=512, softmax_scale=case.sm_scale, is_fp8_kvcache=True,
        indices=case.indices.unsqueeze(1), topk_length=case.topk_length, attn_sink=case.attn_sink,
        extra_k_cache=extra, extra_indices_in_kvcache=case.extra_indices.unsqueeze(1),
        extra_topk_length=case.extra_topk_length)
    assert out.shape == (3, 1, 8, 512) and lse.shape == (3, 8, 1)
    for b in range(3):  # dense: one softmax over the valid rows of both caches, the sink as a zero-value logit
        keys = []
        for pool, idx, length, page in ((case.pool, case.indices[b], case.topk_length[b], SWA_PAGE),
                                        (case.extra_pool, case.extra_indices[b], case.extra_topk_length[b], 64)):
            idx = idx[: int(length)]
            keys.append(reference.dequantize_v4_pages(pool, idx[idx >= 0], page).double())
        k = torch.cat(keys)
        s = case.q[b].double() @ k.T * case.sm_scale
        s = torch.cat([s, case.attn_sink.double().unsqueeze(1)], 1)
        p = torch.softmax(s, -1)
        want = p[:, :-1] @ k
        torch.testing.assert_close(out[b, 0].float(), want.float(), atol=1e-2, rtol=1 / 64)


def test_the_sparse_prefill_stand_in_is_dense_attention_over_the_listed_rows_with_the_sink():
    g = torch.Generator().manual_seed(6)
    s_q, h, d, s_kv = 4, 8, 512, 40
    q = torch.randn(s_q, h, d, generator=g).to(torch.bfloat16) / 4
    kv = torch.randn(s_kv, 1, d, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, 1, 16), generator=g, dtype=torch.int32)
    idx[0, 0, 10:] = -1
    idx[1, 0, 3] = s_kv + 5  # out of range: masked
    lengths = torch.tensor([16, 16, 9, 0], dtype=torch.int32)
    sink = torch.randn(h, generator=g)
    out, _, lse = flashmla.flash_mla_sparse_fwd(q, kv, idx, d ** -0.5, 512, sink, lengths)
    for t in range(s_q):
        rows = [int(i) for j, i in enumerate(idx[t, 0]) if j < lengths[t] and 0 <= i < s_kv]
        if not rows:
            assert bool((out[t] == 0).all())
            continue
        k = kv[rows, 0].double()
        s = q[t].double() @ k.T * d ** -0.5
        p = torch.softmax(torch.cat([s, sink.double().unsqueeze(1)], 1), -1)[:, :-1]
        torch.testing.assert_close(out[t].float(), (p @ k).float(), atol=1e-2, rtol=1 / 64)
        torch.testing.assert_close(lse[t].double(), torch.logaddexp(torch.logsumexp(s, -1), sink.double()) / math.log(2),
                                   atol=1e-4, rtol=1e-4)


def test_the_paged_dequant_reads_the_rows_the_v4_store_wrote():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 512, generator=g).to(torch.bfloat16)
    pool = torch.zeros(2, kernels.v4_page_bytes(64), dtype=torch.uint8)
    loc = torch.tensor([0, 63, 64, 100])
    kernels.fused_store_cache(x, pool, loc, page_size=64, type="flashmla")
    got = kernels.dequantize_k_cache_paged_dsv4(pool, torch.cat([loc, torch.tensor([-1])]), 64)
    assert got.shape == (5, 1, 512) and bool((got[4] == 0).all())
    torch.testing.assert_close(got[:4, 0], reference.dequantize_v4_pages(pool, loc, 64))


# ----------------------------------------------------------------------------- SwiGLU, hyper-connections


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_clamp_is_sglangs_torch_swiglu_limit(dtype):
    from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import swiglu_limit_func

    g = torch.Generator().manual_seed(8)
    x = (torch.randn(7, 2 * 96, generator=g) * 12).to(dtype)  # many |x| > 10
    got, want = torch.empty(7, 96, dtype=dtype), torch.empty(7, 96, dtype=dtype)
    kernels.silu_and_mul_clamp(x, got, 10.0)
    swiglu_limit_func(want, x.float(), 10.0)
    torch.testing.assert_close(got, want.to(dtype), atol=0, rtol=0)


def test_hc_split_sinkhorn_and_mhc_combine_match_sglangs_torch_mhc_pre():
    from sglang.kernels.ops.layernorm.mhc import _mhc_pre_torch

    g = torch.Generator().manual_seed(9)
    s, n, h = 5, 4, 32
    residual = torch.randn(s, n, h, generator=g).to(torch.bfloat16)
    fn = torch.randn((2 + n) * n, n * h, generator=g) / 8
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn((2 + n) * n, generator=g)
    post, comb, layer_input = _mhc_pre_torch(residual, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
    x_flat = residual.view(s, n * h).float()
    mixes = torch.nn.functional.linear(x_flat, fn) * torch.rsqrt(x_flat.square().mean(-1, keepdim=True) + 1e-6)
    pre, got_post, got_comb = kernels.hc_split_sinkhorn(mixes.unsqueeze(1), scale, base, n, 20, 1e-6)
    torch.testing.assert_close(got_post.squeeze(1), post.squeeze(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_comb.squeeze(1), comb, atol=1e-5, rtol=1e-5)
    y = kernels.mhc_combine(residual.view(s, n * h), pre.squeeze(1), n, torch.bfloat16)
    torch.testing.assert_close(y, layer_input, atol=0, rtol=0)


# ----------------------------------------------------------------------------- metadata


def test_the_compression_metadata_twin_follows_the_triton_kernels_formulas():
    seq = torch.tensor([1, 4, 130, 256, 513], dtype=torch.int32)
    pos = seq - 1
    loc = torch.tensor([10, 403, 1000, 2047, 4096])
    table = torch.tensor([[3, 1, 0], [2, 0, 0], [5, 6, 0], [7, 0, 0], [1, 2, 4]], dtype=torch.int32)
    out = kernels.init_compression_metadata(seq, pos, loc, table, SWA_PAGE)
    c4_loc, c4_pos, c4_raw, c4_c1, c128_loc, c128_pos, c128_raw, c128_c1, c128_pages = out
    for b in range(5):
        s, p, slot = int(seq[b]), int(pos[b]), int(loc[b])
        assert int(c4_loc[b]) == (slot // 4 if s % 4 == 0 else 0) and int(c4_pos[b]) == p - p % 4
        assert int(c4_raw[b]) == s // 4 and int(c4_c1[b]) == max(s // 4, 1)
        assert int(c128_loc[b]) == (slot // 128 if s % 128 == 0 else 0) and int(c128_pos[b]) == p - p % 128
        assert int(c128_raw[b]) == s // 128 and int(c128_c1[b]) == max(s // 128, 1)
        for i in range(6):
            want = int(table[b, i // 2]) * 2 + i % 2 if i < s // 128 else -1
            assert int(c128_pages[b, i]) == want


def test_the_sparse_prefill_index_twins_follow_the_triton_kernels_formulas():
    seq = torch.tensor([300, 40], dtype=torch.int32)
    ext = torch.tensor([100, 40], dtype=torch.int32)
    rpi = torch.tensor([1, 0], dtype=torch.int32)
    r2t = torch.arange(2 * 400, dtype=torch.int32).view(2, 400)
    f2s = torch.arange(800, dtype=torch.int64) * 3
    ids, first, gather, offsets = kernels.build_swa_token_ids(seq, ext, rpi, r2t, f2s, 128, 227 + 40)
    assert gather.tolist() == [227, 40] and first.tolist() == [73, 0] and offsets.tolist() == [0, 227, 267]
    assert ids[:227].tolist() == [3 * (400 + p) for p in range(73, 300)]
    assert ids[227:].tolist() == [3 * p for p in range(40)]

    n = 140
    qsl = torch.tensor([0, 100, 140], dtype=torch.int32)
    qpos = torch.cat([torch.arange(200, 300), torch.arange(0, 40)]).to(torch.int32)
    topk = torch.randint(-1, 50, (n, 512), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    cbase = torch.tensor([0, 75], dtype=torch.int32)
    sbase = torch.tensor([150, 500], dtype=torch.int32)
    combined, lens = kernels.combine_topk_swa_indices(topk, qsl, qpos, seq, gather, cbase, sbase, 128, 4, 512)
    assert combined.shape == (n, 640)
    for t in (0, 57, 99, 100, 139):
        b = 0 if t < 100 else 1
        p = int(qpos[t])
        k = min((p + 1) // 4, 512)
        w = min(p + 1, 128)
        row = [int(v) + int(cbase[b]) if v >= 0 else -1 for v in topk[t, :k]]
        start = int(sbase[b]) + p - w + 1 - (int(seq[b]) - int(gather[b]))
        row += list(range(start, start + w))
        assert combined[t].tolist() == row + [-1] * (640 - len(row)) and int(lens[t]) == k + w
