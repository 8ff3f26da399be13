"""Pure-torch stand-ins for the ``flash_mla`` package's DSV4 entry points (devkit only).

* :func:`flash_mla_with_kvcache`: the sparse fp8 V4 decode over the main (SWA) cache and an
  ``extra_k_cache`` (C4 / C128), attention sink, ``topk_length`` trims. It is the project's DSV4
  decode reference (:func:`devkit.reference.dsv4_decode.sparse_decode`: kernel-faithful gather from
  the 4-D ``[pages, page_size, 1, 584]`` views, dequant, one softmax over both caches, sink) with
  the FlashMLA call signature and output shapes (``out [b, s_q, h_q, d_v]``, ``lse [b, h_q, s_q]``).
* :func:`flash_mla_sparse_fwd`: the bf16 sparse prefill over a flat ``kv [s_kv, 1, d]``
  (indices ``-1`` or out of range are masked; ``topk_length`` trims), with the sink, returning
  ``(out, max_logits, lse)`` with base-2 statistics as the legacy kernel.
* :func:`get_mla_metadata`: an empty :class:`FlashMLASchedMeta` (nothing to schedule on CPU).

What this does not model: FlashMLA's split-KV combine, its LSE rounding and its tile schedule.
"""

from __future__ import annotations

import math

import torch

from devkit.reference import dsv4_decode

LOG2E = 1.0 / math.log(2.0)


class FlashMLASchedMeta:
    """FlashMLA's scheduling metadata object; on CPU it carries nothing the stand-in reads."""

    def __init__(self, tile_scheduler_metadata=None, num_splits=None, **kwargs):
        self.tile_scheduler_metadata = tile_scheduler_metadata
        self.num_splits = num_splits
        self.extra = kwargs


def get_mla_metadata(*args, **kwargs):
    return FlashMLASchedMeta(), None


def get_mla_decoding_metadata(*args, **kwargs):
    raise NotImplementedError("flash_mla stand-in: the legacy split-KV schedule is not stood in for")


def _as_view(cache: torch.Tensor) -> torch.Tensor:
    if cache.dim() != 4:
        raise ValueError(f"flash_mla stand-in: expected a [pages, page_size, 1, 584] cache view, got {tuple(cache.shape)}")
    return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)


def flash_mla_with_kvcache(q, k_cache, block_table=None, cache_seqlens=None, head_dim_v=512,
                           tile_scheduler_metadata=None, num_splits=None, softmax_scale=None, causal=False,
                           is_fp8_kvcache=False, indices=None, attn_sink=None, extra_k_cache=None,
                           extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None,
                           use_legacy=True, kv_format=None, descale_q=None, descale_k=None, **_):
    """Sparse V4 decode: q ``[b, s_q, h_q, 512]``, indices ``[b, s_q, k]`` token slots (-1 masked)."""
    if indices is None or not is_fp8_kvcache:
        raise NotImplementedError("flash_mla stand-in: only the sparse fp8 V4 decode is stood in for")
    if head_dim_v != dsv4_decode.DIM:
        raise NotImplementedError(f"flash_mla stand-in: head_dim_v={head_dim_v}, expected 512")
    b, s_q, h_q, d = q.shape
    scale = d ** -0.5 if softmax_scale is None else softmax_scale

    def per_query(lengths):
        return None if lengths is None else lengths.reshape(b, -1)[:, :1].expand(b, s_q).reshape(-1)

    extra = None
    if extra_k_cache is not None:
        extra = dsv4_decode.Extra(_as_view(extra_k_cache), extra_indices_in_kvcache.reshape(b * s_q, -1),
                                  per_query(extra_topk_length))
    out, lse = dsv4_decode.sparse_decode(q.reshape(b * s_q, h_q, d), _as_view(k_cache), indices.reshape(b * s_q, -1),
                                         scale, topk_length=per_query(topk_length), attn_sink=attn_sink, extra=extra)
    return out.reshape(b, s_q, h_q, d), lse.reshape(b, s_q, h_q).transpose(1, 2).contiguous()


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, *, use_legacy=True,
                         return_log2_lse=None):
    """Sparse prefill: q ``[s_q, h_q, d]``, kv ``[s_kv, 1, d]`` bf16, indices ``[s_q, 1, k]``."""
    s_q = q.shape[0]
    idx = indices.reshape(s_q, -1).long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    if topk_length is not None:
        valid = valid & (torch.arange(idx.shape[1]).unsqueeze(0) < topk_length.long().reshape(-1, 1))
    keys = kv.reshape(kv.shape[0], -1).float()[idx.clamp(0, kv.shape[0] - 1)]  # [s_q, k, d]
    scores = torch.einsum("qhd,qkd->qhk", q.float(), keys) * sm_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    max_logits = scores.amax(-1)
    lse = torch.logsumexp(scores, -1)
    empty = torch.isneginf(lse)
    weights = torch.exp(scores - torch.where(empty, torch.zeros_like(lse), lse).unsqueeze(-1))
    out = torch.einsum("qhk,qkd->qhd", weights, keys[..., :d_v])
    if attn_sink is not None:
        sink = attn_sink.float().unsqueeze(0)
        out = out * torch.sigmoid(lse - sink).unsqueeze(-1)
        lse = torch.logaddexp(lse, sink)
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out)
    if return_log2_lse or (return_log2_lse is None and use_legacy):
        lse, max_logits = lse * LOG2E, max_logits * LOG2E
    return out.to(torch.bfloat16), max_logits, lse
