"""Compare the DSV4.1 kit's torch stand-ins with SGLang's Triton kernels run by the Triton interpreter.

``TRITON_INTERPRET=1 python -m devkit.engine_kit.dsv41.check_kernels`` (sets it itself if unset).
These kernels do integer / fp32 / bf16 work only (no fp32 -> e4m3 cast, which the interpreter gets
wrong), so the interpreter runs the kernel source as written. Prints one line per check.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch


def _inputs(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 128, generator=g) * torch.exp2(torch.randint(-8, 8, (n, 1), generator=g).float())
    # exact e2m1 boundaries after scaling (scale 1 when the block amax is 6): exercise RNE
    edge = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    x[0, :32] = edge
    x[0, 32:64] = -edge
    x[1] = 0.0
    return x.to(torch.bfloat16)


def interpreter_bf16_dot() -> float:
    """``tl.dot`` of two all-ones bf16 16x16 tiles under the interpreter (16.0 when correct; Triton
    3.8.0's interpreter returns 16256**2 * 16: it multiplies the raw bf16 bit patterns)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _dot(a, b, o):
        r = tl.arange(0, 16)
        tile = r[:, None] * 16 + r[None, :]
        tl.store(o + tile, tl.dot(tl.load(a + tile), tl.load(b + tile)))

    ones = torch.ones(16, 16, dtype=torch.bfloat16)
    out = torch.empty(16, 16)
    _dot[(1,)](ones, ones, out)
    return out[0, 0].item()


def main() -> int:
    from sglang.kernels.ops.attention.dsv4 import fp4_indexer as up_logits
    from sglang.kernels.ops.kvcache import dsv4_fp4_index_k_cache as up_store
    from sglang.kernels.ops.quantization import fp4_indexer_quant as up_quant

    from devkit.engine_kit.dsv4 import fp4_index as mine

    bad = 0
    x = _inputs(70, 0)
    for rne in (False, True):
        p_ref, s_ref = up_quant.quantize_fp4_indexer_tensor(x, rne=rne)
        p, s = mine.quantize_fp4_indexer_tensor(x, rne=rne)
        ok = torch.equal(p_ref, p) and torch.equal(s_ref, s)
        bad += not ok
        print(f"quantize_fp4_indexer_tensor rne={rne}: {'bit-exact' if ok else 'DIFFERS'} "
              f"(payload mismatches {(p_ref != p).sum().item()}, scale mismatches {(s_ref != s).sum().item()})")

    page = 64
    cache_ref = torch.randint(0, 255, (4, page * 68), dtype=torch.uint8)
    cache = cache_ref.clone()
    loc = torch.randperm(4 * page)[:70].to(torch.int64)
    up_store.store_fp4_index_k_cache(x, cache_ref, loc, page_size=page, rne=True)
    mine.store_fp4_index_k_cache(x, cache, loc, page_size=page, rne=True)
    ok = torch.equal(cache_ref, cache)
    bad += not ok
    print(f"store_fp4_index_k_cache: {'bit-exact' if ok else 'DIFFERS'} ({(cache_ref != cache).sum().item()} bytes)")

    # the stand-in's dequant against SGLang's own torch readback (DeepSeekV4IndexerPool.get_index_k_dequant)
    from sglang.srt.layers.quantization.fp8 import DSV4_DEQUANT_FP4_TABLE

    u = cache[(loc // page)[:, None], ((loc % page) * 64)[:, None] + torch.arange(64)]
    codes = torch.stack([u & 0x0F, (u >> 4) & 0x0F], dim=-1)
    vals = DSV4_DEQUANT_FP4_TABLE[codes.long()].flatten(1)
    exps = cache[(loc // page)[:, None], (page * 64 + (loc % page) * 4)[:, None] + torch.arange(4)].to(torch.int32)
    ref_k = (vals * torch.exp2(exps.float() - 127).repeat_interleave(32, dim=-1)).to(torch.bfloat16)
    ok = torch.equal(ref_k, mine.dequant_index_k(cache, loc, page))
    bad += not ok
    print(f"dequant_index_k vs get_index_k_dequant's formula: {'bit-exact' if ok else 'DIFFERS'}")

    g = torch.Generator().manual_seed(1)
    B, H, L = 3, 4, 70
    q = torch.randn(B, H, 128, generator=g).to(torch.bfloat16)
    w = (torch.randn(B, H, generator=g) * 0.1).to(torch.bfloat16)
    slots = loc[torch.randint(0, 70, (B, L), generator=g)]
    lens = torch.tensor([70, 33, 0])
    ref = up_logits.fp4_index_logits_decode(q, w, slots, lens, cache, page)
    got = mine.fp4_index_logits_decode(q, w, slots, lens, cache, page)
    finite = torch.isfinite(ref)
    same_inf = torch.equal(finite, torch.isfinite(got))
    diff = (ref[finite] - got[finite]).abs()
    exact = same_inf and torch.equal(ref[finite], got[finite])
    ulp = (diff / ref[finite].abs().clamp_min(1e-6)).max().item() if diff.numel() else 0.0
    print(f"fp4_index_logits_decode (interpreted Triton): {'bit-exact' if exact else 'DIFFERS'} "
          f"(-inf pattern same: {same_inf}; max abs diff {diff.max().item() if diff.numel() else 0:.3g}, "
          f"max rel {ulp:.3g}; mismatching logits {(diff > 0).sum().item()}/{diff.numel()})")
    # SGLang's torch scoring (DeepseekV41Indexer.scores, used by the CPU prefill path) on the same K
    from sglang.srt.layers.attention.dsv4.dsv41_sparse import DeepseekV41Indexer

    k_rows = mine.dequant_index_k(cache, slots, page)
    ref_t = torch.stack([DeepseekV41Indexer.scores(None, q[b:b + 1], k_rows[b], w[b:b + 1])[0] for b in range(B)])
    ref_t = torch.where(torch.arange(L)[None, :] < lens[:, None], ref_t, torch.full_like(ref_t, float("-inf")))
    fin = torch.isfinite(ref_t)
    same_inf = torch.equal(fin, torch.isfinite(got))
    d = (ref_t[fin] - got[fin]).abs()
    rel = (d / ref_t[fin].abs().clamp_min(1e-3)).max().item() if d.numel() else 0.0
    bad += not (same_inf and rel < 2e-2)
    print(f"fp4_index_logits_decode vs DeepseekV41Indexer.scores (torch): -inf pattern same: {same_inf}; "
          f"bit-exact {(d == 0).sum().item()}/{d.numel()}, max rel diff {rel:.3g} (the kernel rounds at bf16 points the torch path may not hit)")
    dot = interpreter_bf16_dot()
    print(f"interpreter tl.dot(bf16 ones 16x16) = {dot:.0f} (correct: 16): the interpreted "
          "_fp4_index_logits_kernel (bf16 tl.dot) is not a usable reference")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
