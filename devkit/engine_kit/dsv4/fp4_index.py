"""Pure-torch stand-ins for the Triton kernels of the fp4 index-K pool (devkit only): the ratio-1/2
KV-source layers of a DeepSeek-V4.1 model (:mod:`devkit.engine_kit.dsv41`) quantize, store and score
their index keys through them on CPU.

Written from the Triton sources of SGLang 0.5.23 (formulas re-derived, no code copied):

* :func:`quantize_fp4_indexer_tensor` - ``kernels/ops/quantization/fp4_indexer_quant.py``
  (``_quantize_fp4_indexer_kernel`` / ``quantize_fp4_indexer_row``): per-32 block amax, scale
  ``max(amax / 6, 1e-4)`` rounded *up* to a power of two (UE8M0 exponent, clamped to [1, 254]),
  e2m1 code by thresholds (``rne``: ``>=`` plus round-half-to-even at the boundaries), two codes
  per byte (even element in the low nibble), the four exponents packed into one int32.
* :func:`store_fp4_index_k_cache` - ``kernels/ops/kvcache/dsv4_fp4_index_k_cache.py``: the index-K
  page is ``page_size * 64`` payload bytes then ``page_size * 4`` exponent bytes.
* :func:`fp4_index_logits_decode` - ``kernels/ops/attention/dsv4/fp4_indexer.py``
  (``_fp4_index_logits_kernel`` / ``_fp4_index_logits_tile``): dequant K rows to bf16, fp32 dot
  with the bf16 queries, then the kernel's rounding points (bf16 -> relu -> * weight -> bf16 ->
  sum over heads -> bf16), ``-inf`` beyond ``lens``.
"""

from __future__ import annotations

import torch

GROUP = 32
INDEX_DIM = 128
PAYLOAD = 64  # bytes of packed e2m1 per slot
SCALES = 4  # ue8m0 exponent bytes per slot
SLOT_BYTES = PAYLOAD + SCALES

# e2m1 magnitudes by code 0..7 and the decision thresholds between consecutive codes
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_THRESH = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _ceil_ue8m0_exp(x: torch.Tensor) -> torch.Tensor:
    """fp32 x > 0 -> the biased exponent of the smallest power of two >= x, clamped to [1, 254]."""
    bits = x.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return exp.clamp(1, 254)


def _e2m1_codes(v: torch.Tensor, rne: bool) -> torch.Tensor:
    ax = v.abs().clamp(max=6.0)
    idx = torch.zeros_like(ax, dtype=torch.int32)
    for t in _THRESH:
        idx += (ax >= t if rne else ax > t).to(torch.int32)
    if rne:
        boundary = torch.zeros_like(ax, dtype=torch.bool)
        for t in _THRESH:
            boundary |= ax == t
        idx = torch.where(boundary & (idx % 2 == 1), idx - 1, idx)
    sign = ((v < 0) & (idx != 0)).to(torch.int32)
    return idx | (sign << 3)


def quantize_fp4_indexer_tensor(x: torch.Tensor, rne: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., 128]`` -> (packed e2m1 int8 ``[n, 64]``, packed ue8m0 int32 ``[n]``)."""
    assert x.shape[-1] == INDEX_DIM
    rows = x.contiguous().view(-1, INDEX_DIM).float()
    n = rows.shape[0]
    blocks = rows.view(n, 4, GROUP)
    amax = blocks.abs().amax(dim=-1)  # [n, 4]
    exp = _ceil_ue8m0_exp(torch.clamp(amax / 6.0, min=1.0e-4))  # [n, 4] int32
    scale = (exp << 23).view(torch.float32)  # 2 ** (exp - 127)
    codes = _e2m1_codes(blocks / scale[..., None], rne).view(n, PAYLOAD, 2)
    packed = ((codes[..., 0] & 0x0F) | ((codes[..., 1] & 0x0F) << 4)).to(torch.uint8).view(torch.int8)
    e = exp.to(torch.int64)
    sf = e[:, 0] | (e[:, 1] << 8) | (e[:, 2] << 16) | (e[:, 3] << 24)
    sf = torch.where(sf >= 2**31, sf - 2**32, sf).to(torch.int32)  # the int32 bit pattern
    return packed.contiguous(), sf.contiguous()


def store_fp4_index_k_cache(input: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor, *, page_size: int,
                            rne: bool = False) -> None:
    """Quantize ``input`` rows and write them at pool slots ``loc`` of the paged index-K ``cache``."""
    assert input.shape[-1] == INDEX_DIM
    payload, sf = quantize_fp4_indexer_tensor(input.contiguous(), rne=rne)
    n = payload.shape[0]
    assert cache.shape[1] == page_size * SLOT_BYTES
    if n == 0:
        return
    loc = loc.reshape(-1).to(torch.int64)[:n]
    page, off = loc // page_size, loc % page_size
    cols = (off * PAYLOAD)[:, None] + torch.arange(PAYLOAD, device=cache.device)
    cache[page[:, None], cols] = payload.view(torch.uint8)
    sf_bytes = torch.stack([(sf.to(torch.int64) >> (8 * i)) & 0xFF for i in range(SCALES)], dim=-1).to(torch.uint8)
    scols = (page_size * PAYLOAD + off * SCALES)[:, None] + torch.arange(SCALES, device=cache.device)
    cache[page[:, None], scols] = sf_bytes


def _e2m1_table(device) -> torch.Tensor:
    mags = torch.tensor(_E2M1, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])  # code bit 3 is the sign


def dequant_index_k(table: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """bf16 ``[*slots.shape, 128]`` index K read from the paged fp4 ``table`` at ``slots``."""
    flat = slots.reshape(-1).to(torch.int64)
    page, off = flat // page_size, flat % page_size
    cols = (off * PAYLOAD)[:, None] + torch.arange(PAYLOAD, device=table.device)
    u = table[page[:, None], cols].to(torch.int64)  # [n, 64]
    lut = _e2m1_table(table.device)
    vals = torch.stack([lut[u & 0x0F], lut[(u >> 4) & 0x0F]], dim=-1).flatten(1)  # [n, 128]
    scols = (page_size * PAYLOAD + off * SCALES)[:, None] + torch.arange(SCALES, device=table.device)
    exps = table[page[:, None], scols].to(torch.float32)  # [n, 4]
    scale = torch.exp2(exps - 127.0).repeat_interleave(GROUP, dim=-1)
    return (vals * scale).to(torch.bfloat16).view(*slots.shape, INDEX_DIM)


def fp4_index_logits_decode(q: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                            table: torch.Tensor, page_size: int) -> torch.Tensor:
    """q ``[B, H, 128]`` bf16, weights ``[B, H]``, slots ``[B, L]``, lens ``[B]`` -> fp32 ``[B, L]``."""
    assert q.dtype == torch.bfloat16 and q.shape[-1] == INDEX_DIM
    assert table.dtype == torch.uint8 and table.dim() == 2
    B = q.shape[0]
    L = slots.shape[1]
    out = torch.empty((B, L), dtype=torch.float32, device=q.device)
    if L == 0:
        return out
    k = dequant_index_k(table, slots, page_size).float()  # [B, L, 128]
    acc = torch.einsum("bhd,bld->bhl", q.float(), k)  # fp32 dot
    s = acc.to(torch.bfloat16).float().clamp_min(0.0)
    w = weights.to(torch.bfloat16).float()
    s = (s * w[:, :, None]).to(torch.bfloat16).float()
    logit = s.sum(dim=1).to(torch.bfloat16).float()  # [B, L]
    valid = torch.arange(L, device=q.device)[None, :] < lens.to(torch.int64).clamp(max=L)[:, None]
    return torch.where(valid, logit, torch.full_like(logit, float("-inf")))


def topk_lowest_index_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The columns of each row's ``k`` highest scores, ties taken at the lowest column.

    SGLang's torch prefill selection (``FullTopKIndexer._torch_prefill``) takes
    ``topk(k, sorted=False)``, whose choice among equal scores depends on the row's width (the
    request's widest visible length in the forward); bf16-rounded index scores tie often, so a
    row's top-k set moved with how long its prompt's chunk was. A stable descending sort picks the
    same set whatever the width."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]

