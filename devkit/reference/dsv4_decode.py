"""Pure-torch reference of the DSV4 sparse decode over a raw byte pool, with the kernel's addressing.

Used by the native SWA decode tests and the ``native-decode`` benchmark to show that reading
SGLang's 256-token SWA pages in place gathers the same bytes, and so computes the same output, as
reading the 64-token pages the stock path copies them into. It is written from the layout SGLang
0.5.23 stores (``DeepSeekV4SingleKVPool``, ``KVLayout.V4``) and the address math of FlashInfer
0.7.2's DSV4 decode kernel; it is a model for CPU checks, never a serving path.

Layout of one page of ``page_size`` tokens (``pitch`` bytes, rows of 584 bytes per token)::

    [page_size x 576 data: 448 e4m3 nope + 64 bf16 rope][page_size x 8 scale: 7 UE8M0 + 1 pad][pad]

Kernel addressing for a token index ``i`` (``-1`` = masked)::

    page = i // page_size; local = i - page * page_size
    data  at page * pitch + local * 576
    scale at page * pitch + page_size * 576 + local * 8

``page_size`` and ``pitch`` are read from the 4-D view the kernel receives
(``[pages, page_size, 1, 584]`` with strides ``(pitch, 584, 584, 1)``), so a view with a wrong
stride addresses the wrong bytes here exactly as it would in the kernel.

Math: ``s = q . k * sm_scale`` over 512 (k = dequantised nope | rope), V == K, softmax over the
valid candidates of the main (SWA) and extra (C4A / C128A) caches together; LSE in base 2 times
``lse_scale``; the attention sink scales the output by ``sigmoid(lse - sink)`` and joins the LSE.
A row with no valid candidate gives 0 and the sink's LSE (``-inf`` without a sink).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NOPE = 448
ROPE = 64
DIM = NOPE + ROPE  # 512: d_qk and d_v
GROUP = 64  # nope quantisation group
GROUPS = NOPE // GROUP  # 7 UE8M0 scales per token
DATA_BYTES = NOPE + 2 * ROPE  # 576
SCALE_BYTES = GROUPS + 1  # 8
BYTES_PER_TOKEN = DATA_BYTES + SCALE_BYTES  # 584
SWA_PAGE = 256  # SGLang's SWA page
SPLIT_PAGE = 64  # the page the stock path copies into (_PBS_DST)
LOG2E = 1.0 / math.log(2.0)


def page_pitch(page_size: int) -> int:
    """SGLang's padded page bytes: ``ceil(page_size * 584 / 576) * 576`` (149760 for 256, 37440 for 64)."""
    return -(-page_size * BYTES_PER_TOKEN // DATA_BYTES) * DATA_BYTES


def quantize_tokens(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16/fp32 ``[N, 512]`` -> (data ``[N, 576]`` uint8, scale ``[N, 8]`` uint8) in the V4 format."""
    n = kv.shape[0]
    nope = kv[:, :NOPE].float().reshape(n, GROUPS, GROUP)
    amax = nope.abs().amax(-1).clamp_min(1e-4)
    exponent = torch.ceil(torch.log2(amax / 448.0))  # power-of-two scale that fits e4m3's range
    scale = torch.pow(2.0, exponent)
    fp8 = (nope / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    data = torch.empty(n, DATA_BYTES, dtype=torch.uint8)
    data[:, :NOPE] = fp8.reshape(n, NOPE).view(torch.uint8)
    data[:, NOPE:] = kv[:, NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = torch.zeros(n, SCALE_BYTES, dtype=torch.uint8)
    scales[:, :GROUPS] = (exponent + 127).to(torch.uint8)
    return data, scales


def make_pool(num_pages: int, page_size: int, *, seed: int = 0, pitch: int | None = None) -> torch.Tensor:
    """A ``[num_pages, pitch]`` uint8 pool of random quantised tokens; page padding is 0xFF."""
    pitch = page_pitch(page_size) if pitch is None else pitch
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(num_pages * page_size, DIM, generator=g) / 8).clamp(-1, 1).to(torch.bfloat16)
    data, scales = quantize_tokens(kv)
    pool = torch.full((num_pages, pitch), 0xFF, dtype=torch.uint8)
    pool[:, : page_size * DATA_BYTES] = data.reshape(num_pages, page_size * DATA_BYTES)
    pool[:, page_size * DATA_BYTES : page_size * BYTES_PER_TOKEN] = scales.reshape(num_pages, page_size * SCALE_BYTES)
    return pool


def kernel_view(pool: torch.Tensor, page_size: int) -> torch.Tensor:
    """The 4-D view SGLang hands the decode: ``[pages, page_size, 1, 584]``, strides ``(pitch, 584, 584, 1)``."""
    return pool[:, : page_size * BYTES_PER_TOKEN].view(pool.shape[0], page_size, 1, BYTES_PER_TOKEN)


def split_pages(pool: torch.Tensor, page_size: int, pages: torch.Tensor | None = None) -> torch.Tensor:
    """What the stock path builds before each decode: every (or each listed) page as 64-token pages.

    Sub-page ``4p + s`` holds tokens ``[64s, 64s + 64)`` of page ``p``: data then scales, pitch
    37440. Pages not listed keep 0xEE (the stock buffer keeps stale bytes there; never read).
    """
    ratio = page_size // SPLIT_PAGE
    n = pool.shape[0]
    out = torch.full((n * ratio, page_pitch(SPLIT_PAGE)), 0xEE, dtype=torch.uint8)
    rows = torch.arange(n) if pages is None else pages.long()
    data = pool[rows, : page_size * DATA_BYTES].reshape(-1, SPLIT_PAGE * DATA_BYTES)
    scales = pool[rows, page_size * DATA_BYTES : page_size * BYTES_PER_TOKEN].reshape(-1, SPLIT_PAGE * SCALE_BYTES)
    sub = (rows.unsqueeze(1) * ratio + torch.arange(ratio)).reshape(-1)
    out[sub, : SPLIT_PAGE * DATA_BYTES] = data
    out[sub, SPLIT_PAGE * DATA_BYTES : SPLIT_PAGE * BYTES_PER_TOKEN] = scales
    return out


def touched_pages(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """The distinct pages a decode call reads (the ones the stock path copies)."""
    flat = indices.reshape(-1)
    return torch.unique(flat[flat >= 0].long() // page_size)


def split_copy_bytes(num_touched_pages: int, page_size: int = SWA_PAGE) -> int:
    """Bytes the stock split writes for that many touched pages: 4 sub-pages x (64 x 576 + 64 x 8)."""
    ratio = page_size // SPLIT_PAGE
    return num_touched_pages * ratio * SPLIT_PAGE * BYTES_PER_TOKEN


def _raw_bytes(view: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Flat uint8 bytes under a 4-D kernel view, its page size and its page pitch (from the strides)."""
    if view.ndim != 4 or view.shape[2] != 1 or view.shape[3] != BYTES_PER_TOKEN:
        raise ValueError(f"expected a [pages, page_size, 1, {BYTES_PER_TOKEN}] view, got {tuple(view.shape)}")
    if view.stride(3) != 1 or view.stride(1) != BYTES_PER_TOKEN:
        raise ValueError(f"rows must be packed {BYTES_PER_TOKEN}-byte rows, got strides {view.stride()}")
    pages, page_size, pitch = view.shape[0], view.shape[1], view.stride(0)
    extent = (pages - 1) * pitch + page_size * BYTES_PER_TOKEN
    flat = torch.as_strided(view.view(torch.uint8), (extent,), (1,))
    return flat, page_size, pitch


def gather_bytes(view: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel-faithful gather: (data ``[..., 576]``, scale ``[..., 8]``); masked slots are zero rows."""
    flat, page_size, pitch = _raw_bytes(view)
    idx = torch.where(valid, indices, torch.zeros_like(indices)).long()
    page = idx // page_size
    local = idx - page * page_size
    data_at = page * pitch + local * DATA_BYTES
    scale_at = page * pitch + page_size * DATA_BYTES + local * SCALE_BYTES
    data = flat[data_at.unsqueeze(-1) + torch.arange(DATA_BYTES)]
    scale = flat[scale_at.unsqueeze(-1) + torch.arange(SCALE_BYTES)]
    keep = valid.unsqueeze(-1)
    return torch.where(keep, data, torch.zeros_like(data)), torch.where(keep, scale, torch.zeros_like(scale))


def dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(data, scale) bytes -> fp32 ``[..., 512]``: ``nope * 2^(e - 127)`` per 64-group, rope as bf16."""
    shape = data.shape[:-1]
    nope = data[..., :NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(*shape, GROUPS, GROUP)
    factor = torch.pow(2.0, scale[..., :GROUPS].float() - 127.0).unsqueeze(-1)
    rope = data[..., NOPE:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(nope * factor).reshape(*shape, NOPE), rope], -1)


@dataclass(frozen=True)
class Extra:
    """The optional second cache (C4A / C128A): its kernel view, indices ``[T, K']`` and lengths."""

    view: torch.Tensor
    indices: torch.Tensor
    topk_length: torch.Tensor | None = None


def _candidates(view: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor | None):
    valid = indices >= 0
    if lengths is not None:
        valid = valid & (torch.arange(indices.shape[-1]) < lengths.unsqueeze(-1))
    data, scale = gather_bytes(view, indices, valid)
    return dequantize(data, scale), valid


def sparse_decode(
    q: torch.Tensor,
    view: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra: Extra | None = None,
    lse_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, H, 512]``; view: the main cache's kernel view; indices ``[T, K]`` int (-1 masked).

    Returns out ``[T, H, 512]`` bf16 and lse ``[T, H]`` fp32 (base 2 x ``lse_scale``, sink joined).
    """
    kv, valid = _candidates(view, indices, topk_length)
    if extra is not None:
        extra_kv, extra_valid = _candidates(extra.view, extra.indices, extra.topk_length)
        kv, valid = torch.cat([kv, extra_kv], 1), torch.cat([valid, extra_valid], 1)
    scores = torch.einsum("thd,tkd->thk", q.float(), kv) * sm_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)  # natural log
    empty = torch.isneginf(lse)
    weights = torch.exp(scores - torch.where(empty, torch.zeros_like(lse), lse).unsqueeze(-1))
    out = torch.einsum("thk,tkd->thd", weights, kv)
    lse2 = lse * LOG2E
    if attn_sink is not None:
        sink = attn_sink.float().unsqueeze(0)
        out = out * torch.sigmoid(lse - sink).unsqueeze(-1)
        lse2 = torch.logaddexp2(lse2, sink * LOG2E)
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out)
    return out.to(torch.bfloat16), lse2 * lse_scale


@dataclass(frozen=True)
class DecodeCase:
    """A DSV4-like decode call: SWA window rows through a page table, plus top-k on an extra cache."""

    q: torch.Tensor
    pool: torch.Tensor  # [pages, 149760] uint8, 256-token SWA pages
    indices: torch.Tensor  # [T, window] int32 pool token slots, -1 padded
    topk_length: torch.Tensor
    attn_sink: torch.Tensor
    extra_pool: torch.Tensor  # [pages, 37440] uint8, 64-token C4A pages
    extra_indices: torch.Tensor  # [T, topk] int32
    extra_topk_length: torch.Tensor
    sm_scale: float = DIM**-0.5

    def extra(self, view: torch.Tensor | None = None) -> Extra:
        view = kernel_view(self.extra_pool, SPLIT_PAGE) if view is None else view
        return Extra(view, self.extra_indices, self.extra_topk_length)


def decode_case(
    batch: int, *, heads: int = 64, window: int = 128, topk: int = 512, pages_per_request: int = 8, seed: int = 0
) -> DecodeCase:
    """Random requests at random positions: each owns ``pages_per_request`` scattered pool pages.

    Window rows are the last ``window`` positions (crossing page boundaries, -1 before position 0,
    some rows trimmed by ``topk_length``); extra rows are random C4A slots with a -1 tail.
    """
    g = torch.Generator().manual_seed(seed)
    num_pages = batch * pages_per_request + 3
    pool = make_pool(num_pages, SWA_PAGE, seed=seed + 1)
    owner = torch.randperm(num_pages, generator=g)[: batch * pages_per_request].reshape(batch, pages_per_request)
    lengths = torch.randint(1, pages_per_request * SWA_PAGE, (batch,), generator=g)
    lengths[0] = min(40, int(lengths[0]))  # a short request: the window starts before position 0
    positions = lengths.unsqueeze(1) - window + torch.arange(window)
    slots = owner.gather(1, positions.clamp_min(0) // SWA_PAGE) * SWA_PAGE + positions.clamp_min(0) % SWA_PAGE
    indices = torch.where(positions >= 0, slots, torch.full_like(slots, -1)).to(torch.int32)
    topk_length = torch.full((batch,), window, dtype=torch.int32)
    if batch > 1:
        topk_length[1] = window // 2 + 13
    extra_pages = max(4, batch * 4)
    extra_pool = make_pool(extra_pages, SPLIT_PAGE, seed=seed + 2)
    extra_indices = torch.randint(0, extra_pages * SPLIT_PAGE, (batch, topk), generator=g, dtype=torch.int32)
    extra_indices[:, topk - topk // 8 :] = -1
    extra_topk_length = torch.full((batch,), topk - topk // 8, dtype=torch.int32)
    q = (torch.randn(batch, heads, DIM, generator=g) / 4).to(torch.bfloat16)
    sink = torch.randn(heads, generator=g)
    return DecodeCase(q, pool, indices, topk_length, sink, extra_pool, extra_indices, extra_topk_length)


def compare_addressings(case: DecodeCase) -> dict[str, object]:
    """The in-place 256-token view against the stock 64-token split of the touched pages."""
    pages = touched_pages(case.indices, SWA_PAGE)
    split = split_pages(case.pool, SWA_PAGE, pages)
    view256, view64 = kernel_view(case.pool, SWA_PAGE), kernel_view(split, SPLIT_PAGE)
    valid = case.indices >= 0
    d256, s256 = gather_bytes(view256, case.indices, valid)
    d64, s64 = gather_bytes(view64, case.indices, valid)
    kwargs = {"topk_length": case.topk_length, "attn_sink": case.attn_sink, "extra": case.extra()}
    o256, l256 = sparse_decode(case.q, view256, case.indices, case.sm_scale, **kwargs)
    o64, l64 = sparse_decode(case.q, view64, case.indices, case.sm_scale, **kwargs)
    return {
        "bytes_identical": bool(torch.equal(d256, d64) and torch.equal(s256, s64)),
        "outputs_identical": bool(torch.equal(o256, o64) and torch.equal(l256, l64)),
        "max_abs_diff": float(max((o256.float() - o64.float()).abs().max(), (l256 - l64).abs().max())),
        "touched_pages": int(pages.numel()),
    }
