"""The DeepSeek-V4 reference forward (devkit/engine_kit/dsv4/reference.py): transformers 5.19's model on
the tiny checkpoint, with SGLang's fp8 KV round trips emulated.

Invariants: the reference logits separate the greedy token from the runner-up; the fp8 emulation rounds
exactly what a direct quantize / dequantize of the KV rows gives (and what SGLang's own V4-layout page
writer stores), moves logits by a bounded amount away from expert-routing ties, and the seeded weights
cross the SwiGLU clamp so that dropping it (SGLang's CPU ``moe_forward_native``) shows.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.models.deepseek_v4")
torch = pytest.importorskip("torch")

from devkit.engine_kit.dsv4 import checkpoint, reference  # noqa: E402

SEQ = 272  # > 2 C128 windows, 68 C4 entries, past the 128-token SWA window
ROUTE_SAFE = 0.1  # route_margins above this: no rounding of the size tested here swaps an expert


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return reference.load_reference(checkpoint.make_checkpoint(tmp_path_factory.mktemp("dsv4") / "v4"))


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 1024, (SEQ,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def logits(model, ids) -> dict[str, torch.Tensor]:
    return {"fp8": reference.reference_logits(model, ids), "bf16": reference.reference_logits(model, ids, fp8=False)}


@pytest.fixture(scope="module")
def safe(model, ids) -> torch.Tensor:
    return reference.route_margins(model, ids) > ROUTE_SAFE


def test_reference_logits_separate_the_greedy_token_from_the_runner_up(logits):
    """Greedy tokens of random tiny weights are a weak oracle unless the top two logits are apart:
    the lm-head gain puts the logit std near 8, so the margin is mostly many bf16 steps (0.125 at
    |logit| ~ 20)."""
    lg = logits["fp8"]
    margin = reference.margins(lg)
    assert 6.0 < lg.std().item() < 11.0
    assert margin.median().item() > 1.0
    assert (margin > 0.25).float().mean().item() > 0.8
    assert lg.argmax(-1).unique().numel() > SEQ // 3  # the prediction depends on the context


def test_v4_cache_rounding_is_ue8m0_tiles_over_the_nope_part_only():
    x = (torch.randn(5, 512, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    values, exponent, rope = reference.quantize_v4_kv(x)
    assert values.dtype == torch.float8_e4m3fn and exponent.shape == (5, 7) and torch.equal(rope, x[:, 448:])
    scale = torch.exp2(exponent.float() - 127)
    amax = x[:, :448].float().reshape(5, 7, 64).abs().amax(-1)
    assert (scale * 448 >= amax).all() and (scale * 224 < amax).all()  # the smallest power of two that fits
    back = reference.roundtrip_v4_kv(x)
    assert torch.equal(back[:, 448:], x[:, 448:])
    err = (back[:, :448].float() - x[:, :448].float()).reshape(5, 7, 64).abs()
    assert (err <= scale.unsqueeze(-1) * 16).all()  # half an e4m3 step at the top binade (32 / 2)
    assert err.max() > 0


def test_v4_rows_read_back_from_sglangs_own_page_writer(model):
    """Rows written by SGLang's torch page writer (``set_k_and_s_torch``, the V4 layout its kernels
    store) read back by :func:`reference.dequantize_v4_pages` equal the emulated round trip."""
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
    from sglang.kernels.ops.kvcache.dsv4_main_kv_store import NopeFp8RopeBf16Pack
    from sglang.test.kernels.deepseek_v4.k_cache_reference import set_k_and_s_torch

    page = 64
    x = (torch.randn(10, 512, generator=torch.Generator().manual_seed(1)) * 2).to(torch.bfloat16)
    values, exponent, rope = reference.quantize_v4_kv(x)
    buf = torch.zeros(3, KVLayout.V4.page_bytes(page), dtype=torch.uint8)
    loc = torch.tensor([0, 1, 63, 64, 65, 100, 127, 128, 150, 191])
    set_k_and_s_torch(buf, loc, NopeFp8RopeBf16Pack(values.contiguous(), rope.contiguous(), exponent.contiguous()), page)
    assert torch.equal(reference.dequantize_v4_pages(buf, loc, page), reference.roundtrip_v4_kv(x))


def test_the_emulation_rounds_exactly_the_direct_quantize_of_the_kv(model, ids):
    """Layer 0 sees the same inputs with and without the emulation, so its KV under the emulation is
    bit-for-bit the direct V4-layout round trip of its bf16 KV; C4 / C128 entries likewise at the
    first compressed layer."""
    plain = reference.capture(model, ids[:140], fp8=False)
    rounded = reference.capture(model, ids[:140], fp8=True)
    assert torch.equal(rounded[0]["kv"], reference.roundtrip_v4_kv(plain[0]["kv"]))
    assert not torch.equal(rounded[0]["kv"], plain[0]["kv"])
    # the C4 layer's inputs differ by then; its entries are still exactly representable in the layout
    entries = rounded[1]["compressed"][:, :448]
    assert torch.equal(reference.roundtrip_v4_kv(rounded[1]["compressed"])[:, :448], entries)


def test_hadamard_is_the_orthonormal_sylvester_matrix():
    h = reference.hadamard(128)
    assert torch.allclose(h @ h, torch.eye(128), atol=1e-6) and torch.equal(h, h.T)
    i, j = torch.meshgrid(torch.arange(128), torch.arange(128), indexing="ij")
    parity = torch.tensor([bin(v).count("1") % 2 for v in (i & j).flatten().tolist()]).view(128, 128)
    assert torch.equal(torch.sign(h), 1 - 2 * parity.float())


def test_fp8_indexer_scores_stay_close_and_pick_mostly_the_same_entries(model, ids):
    """SGLang scores indexer keys after Hadamard + e4m3 (fp32 scale per row): against bf16 scores the
    relative error stays within a few per cent and a top-8 selection keeps most of its picks."""
    seen = reference.capture(model, ids, fp8=False)[1]
    exact = reference.indexer(model, 1, seen["attn_in"], seen["q_residual"], topk=8, fp8=False)
    fp8 = reference.indexer(model, 1, seen["attn_in"], seen["q_residual"], topk=8, fp8=True)
    assert exact["keys"].shape == (SEQ // 4, 128) and torch.equal(exact["keys"], seen["indexer_keys"])
    visible = torch.isfinite(exact["scores"])
    err = (fp8["scores"] - exact["scores"])[visible].abs().max() / exact["scores"][visible].abs().max()
    assert 0 < err.item() < 0.05
    late = slice(100, SEQ)  # rows with > 8 visible entries: a real choice
    same = [len(set(a.tolist()) & set(b.tolist())) / 8 for a, b in zip(exact["topk"][late], fp8["topk"][late])]
    assert sum(same) / len(same) > 0.8


def test_fp8_emulation_changes_logits_by_a_bounded_amount(logits, safe):
    """Away from expert-routing ties the e4m3 KV moves each position's logits by at most ~3 (logit std
    ~8) and by ~0.6 typically; at a tie one swapped expert moves them by whole units, so those
    positions are excluded (they are a few per cent)."""
    diff = (logits["fp8"] - logits["bf16"]).abs().amax(-1)
    assert safe.float().mean().item() > 0.7
    assert diff[safe].max().item() < 4.0
    assert 0.05 < diff[safe].median().item() < 1.0


def test_the_reference_clamps_swiglu_and_the_weights_cross_the_clamp(model, ids, logits, safe):
    """transformers clamps gate <= 10 and |up| <= 10 for routed experts as SGLang's GPU runner does;
    the seeded weights push ~0.7 % of routed pre-activations past 10 in every layer, so a forward
    without the routed clamp (SGLang's CPU ``moe_forward_native``) moves logits well past the fp8
    tolerance above."""
    hits = reference.clamp_hits(model, ids)
    assert set(hits) == {0, 1, 2} and all(0.001 < h < 0.05 for h in hits.values())
    unclamped = reference.reference_logits(model, ids, clamp=False)
    diff = (unclamped - logits["fp8"]).abs().amax(-1)
    assert diff[safe].max().item() > 3.0
    assert (diff[safe] > 1.0).float().mean().item() > 0.1


def test_a_chunked_reference_forward_matches_one_forward(model, ids, logits, safe):
    """Prefill in chunks over one cache (the compressor buffer, C4 overlap and SWA window carried
    across chunk boundaries) gives the one-forward logits up to bf16 reassociation."""
    chunked = reference.reference_logits(model, ids, chunks=[100, 156, 16])
    diff = (chunked - logits["fp8"]).abs().amax(-1)
    assert diff[safe].max().item() < 1.0
    assert diff[safe].median().item() < 0.2
    sure = safe & (reference.margins(logits["fp8"]) > 1.0)
    assert torch.equal(chunked.argmax(-1)[sure], logits["fp8"].argmax(-1)[sure])


def test_the_compress_helper_reproduces_the_compressors_inside_the_model(model, ids):
    """:func:`reference.compress` on the captured attention inputs gives the entries the model's C4 and
    C128 layers produced, in one call and in ragged chunks (state carried by the cache)."""
    seen = reference.capture(model, ids, fp8=False)
    for layer, count in ((1, SEQ // 4), (2, SEQ // 128)):
        whole = reference.compress(model, layer, seen[layer]["attn_in"])
        assert whole.shape == (count, 512)
        assert torch.equal(whole, seen[layer]["compressed"])
        ragged = reference.compress(model, layer, seen[layer]["attn_in"], chunks=[3, 126, 1, 142])
        assert torch.allclose(ragged.float(), whole.float(), atol=0.05, rtol=0.02)


def test_the_router_and_expert_helpers_rebuild_each_moe_output(model, ids):
    """:func:`reference.route` + :func:`reference.experts` + the shared expert give the captured MoE
    output of every layer (hash layer 0 routes by ``tid2eid[token]``, layers 1-2 by top-2 of
    sqrtsoftplus + bias), and the hash picks are the table's."""
    seen = reference.capture(model, ids[:64], fp8=False)
    for layer in range(3):
        x = seen[layer]["ffn_in"]
        weights, picks = reference.route(model, layer, x, ids[:64])
        assert picks.shape == (64, 2) and torch.allclose(weights.float().sum(-1), torch.full((64,), 1.5), atol=2e-2)
        if layer == 0:
            assert torch.equal(picks, model.model.layers[0].mlp.gate.tid2eid[ids[:64]].long())
        shared = model.model.layers[layer].mlp.shared_experts(x)
        rebuilt = reference.experts(model, layer, x, picks, weights) + shared
        assert torch.allclose(rebuilt.float(), seen[layer]["moe_out"].float(), atol=1e-2, rtol=1e-2)
