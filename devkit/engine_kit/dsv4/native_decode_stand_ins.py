"""Stand-ins for the native SWA decode switch's two GPU-only pieces on the DSV4 kit: the compiled module's
launch (:class:`StubModule`) and the stock path's Triton page split and FlashInfer CUDA decode
(:class:`StockSeams`).

Both compute the decode with :mod:`devkit.reference.dsv4_decode` on the cache view they are handed, so a
test (or the kit server's route, :mod:`devkit.engine_kit.dsv4.native_decode_route`) can compare what the
served path and the stock copy path return.
"""

from __future__ import annotations

from typing import Any

import torch

from adapter.switches.native_decode import loader as ndm
from devkit.reference import dsv4_decode as ref

SCRATCH_HEADS_MARK = 5  # StubModule's scratch head count is heads + 5 (see decode_scratch_heads)


def _reference_into(q, view, indices, output, out_lse, sm_scale, topk_length, attn_sink, extra_view,
                    extra_indices, extra_topk_length) -> None:  # fmt: skip
    extra = None if extra_view is None else ref.Extra(extra_view, extra_indices, extra_topk_length)
    out, lse = ref.sparse_decode(q, view, indices, sm_scale, topk_length=topk_length, attn_sink=attn_sink, extra=extra)
    output.copy_(out)
    out_lse.copy_(lse)


class StubModule:
    """Stands in for the loaded ``.so`` (its launch needs an SM120 GPU): records each call and
    computes the reference decode on exactly the cache view it was handed."""

    def __init__(self, page_size: int = ndm.NATIVE_PAGE_SIZE, refuse: str | None = None,
                 scratch_heads: int = SCRATCH_HEADS_MARK):  # fmt: skip
        self.page_size = page_size
        self.refuse = refuse  # a message: behave like the guard's TVM_FFI_ICHECK (RuntimeError)
        self.scratch_heads = scratch_heads
        self.calls: list[dict[str, Any]] = []
        self.scratch_queries: list[int] = []

    def native_page_size(self) -> int:
        return self.page_size

    def decode_scratch_heads(self, heads: int) -> int:
        """The compiled module answers with FlashInfer's C++ ``decode_scratch_heads``; the stand-in does not
        restate that rule: it answers ``heads + scratch_heads`` (a value no rule gives), so a test can
        check the switch sizes the split-K scratch by the module's answer and not by a rule of its own."""
        self.scratch_queries.append(heads)
        return heads + self.scratch_heads

    def dsv4_native_page_decode(self, q, kv, indices, mid_out, mid_lse, output, out_lse, num_splits, sm_scale,
                                topk_length, attn_sink, extra_kv, extra_indices, extra_topk_length, cpb,
                                lse_scale):  # fmt: skip
        call = dict(q=q, kv=kv, indices=indices, mid_out=mid_out, mid_lse=mid_lse, num_splits=num_splits,
                    sm_scale=sm_scale, extra_kv=extra_kv, extra_indices=extra_indices, cpb=cpb, lse_scale=lse_scale)  # fmt: skip
        self.calls.append(call)
        if self.refuse is not None:
            raise RuntimeError(self.refuse)
        _reference_into(q, kv, indices, output, out_lse, sm_scale, topk_length, attn_sink, extra_kv, extra_indices,
                        extra_topk_length)  # fmt: skip


class StockSeams:
    """Stand-ins for the stock path's two GPU-only steps, so the real stock ``_flash_mla_flashinfer``
    body runs on CPU: the Triton page split (done in torch, same bytes) and FlashInfer's CUDA paged
    attention (the reference decode on the 64-token view it receives)."""

    def __init__(self) -> None:
        self.split_calls: list[tuple[torch.Tensor, int]] = []
        self.attention_calls: list[dict[str, Any]] = []

    def split(self, kv_u8: torch.Tensor, src_pbs: int, touched_indices: torch.Tensor | None = None) -> torch.Tensor:
        self.split_calls.append((kv_u8, src_pbs))
        if kv_u8.shape[-1] != ref.BYTES_PER_TOKEN:
            return kv_u8  # a layout the reference does not model (V4.1): only the routing is checked
        pool = torch.as_strided(kv_u8, (kv_u8.shape[0], kv_u8.stride(0)), (kv_u8.stride(0), 1))
        pages = None if touched_indices is None else ref.touched_pages(touched_indices, src_pbs)
        return ref.kernel_view(ref.split_pages(pool, src_pbs, pages), ref.SPLIT_PAGE)

    def paged_attention(self, q, kv_cache, indices, output, out_lse, sm_scale, *, d_v=512, topk_length=None,
                        attn_sink=None, extra_kv_cache=None, extra_indices=None, extra_topk_length=None,
                        mid_out=None, mid_lse=None, **_: Any) -> None:  # fmt: skip
        self.attention_calls.append({"kv": kv_cache, "indices": indices, "mid_out": mid_out})
        if kv_cache.shape[-1] != ref.BYTES_PER_TOKEN or q.dtype != torch.bfloat16:
            return  # a layout the reference does not model (V4.1, fp16 q): only the routing is checked
        _reference_into(q, kv_cache, indices, output, out_lse, sm_scale, topk_length, attn_sink, extra_kv_cache,
                        extra_indices, extra_topk_length)  # fmt: skip
