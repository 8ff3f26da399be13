"""The native SWA decode switch on the DSV4 CPU engine: SGLang's SM120 decode entry, routed (devkit only).

On the kit server the DSV4 backend decodes through the ``flash_mla`` stand-in (the CUDA branch;
the SM120 branch needs ``get_platform().is_sm120``). This module is what the switch's test-only key
``DSV41_NATIVE_DECODE_STANDIN`` names; the switch calls :func:`served` or :func:`stock` in the
scheduler process when ``sglang.kernels.ops.attention.flash_mla_sm120`` loads (the DSV4 model module
imports it, before the backend is built). Both route the same three seams:

* ``flash_mla_interface.flash_mla_with_kvcache`` (which the kit binds into the backend at its
  ``__init__``) -> SGLang's real ``flash_mla_with_kvcache_sm120`` with the arguments the backend's
  SM120 branch passes: so ``_flash_mla_flashinfer`` (<= 64 rows) and ``_flash_mla_sm120_prefill``
  (> 64 rows), and the switch's wrappers around them, run on the real pool in the real forward;
* the stock path's two GPU-only steps, by :class:`devkit.engine_kit.dsv4.native_decode_stand_ins.StockSeams`: the
  Triton 256 -> 64 page split (torch, same bytes) and FlashInfer's CUDA paged attention (the
  project's pure-torch reference, :mod:`devkit.reference.dsv4_decode`, on the 64-token copy).

:func:`served` returns the module stand-in (:class:`~devkit.engine_kit.dsv4.native_decode_stand_ins.StubModule`:
the same reference on the 256-token pool view it is handed); :func:`stock` returns None, and the
switch stays off (the stock copy path).

With ``DSV4_NATIVE_DECODE_CHECK=<file>`` in the server's environment every routed call also runs the
stock copy path on the same arguments and the file gets, per row range (``rows<=64``,
``rows>64``), the calls, how many the switch served in place, and how many gave a bit-identical
output (``torch.equal``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
from pathlib import Path
from typing import Any

CHECK_ENV = "DSV4_NATIVE_DECODE_CHECK"
TARGET = "sglang.kernels.ops.attention.flash_mla_sm120"
INTERFACE = "sglang.kernels.ops.attention.flash_mla_interface"
FI_SPARSE = "flashinfer.mla._sparse_mla_sm120"

_state: dict[str, Any] = {}


def _record(rows: int, served: bool, identical: bool) -> None:
    path = os.environ.get(CHECK_ENV)
    if not path:
        return
    counts = _state.setdefault("counts", {})
    bucket = counts.setdefault("rows<=64" if rows <= 64 else "rows>64", {"calls": 0, "served": 0, "identical": 0,
                                                                         "max_rows": 0})  # fmt: skip
    bucket["calls"] += 1
    bucket["served"] += int(served)
    bucket["identical"] += int(identical)
    bucket["max_rows"] = max(bucket["max_rows"], rows)
    Path(path).write_text(json.dumps(counts, sort_keys=True))


def _stock_output(target: Any, call: tuple) -> Any:
    rows = call[0].shape[0]
    entry = target._flash_mla_sm120_prefill if rows > target.SM120_DECODE_MAX_TOKENS else target._flash_mla_flashinfer
    return inspect.unwrap(entry)(*call)[0]


def _sm120_decode(q, k_cache, block_table=None, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=None,
                  num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                  attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                  extra_topk_length=None, **_: Any):  # fmt: skip
    """The backend's SM120 branch: ``flash_mla_with_kvcache_sm120`` with the same keyword arguments."""
    from adapter.switches.native_decode import switch as snd

    target = importlib.import_module(TARGET)
    served_before = snd.stats["served"]
    out = target.flash_mla_with_kvcache_sm120(
        q=q, k_cache=k_cache, head_dim_v=head_dim_v, softmax_scale=softmax_scale, indices=indices,
        topk_length=topk_length, attn_sink=attn_sink, extra_k_cache=extra_k_cache,
        extra_indices_in_kvcache=extra_indices_in_kvcache, extra_topk_length=extra_topk_length,
    )[0]  # fmt: skip
    served = snd.stats["served"] > served_before
    if os.environ.get(CHECK_ENV):
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        call = (q, k_cache, indices, topk_length, attn_sink, head_dim_v, scale, extra_k_cache,
                extra_indices_in_kvcache, extra_topk_length)  # fmt: skip
        _record(q.shape[0], served, bool(torch_equal(out, _stock_output(target, call))))
    for holder in ("seams", "module"):  # the stand-ins record each call's tensors: keep none in a server
        obj = _state.get(holder)
        for name in ("split_calls", "attention_calls", "calls"):
            if hasattr(obj, name):
                getattr(obj, name).clear()
    return out, None


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a, b)


def _route() -> None:
    if _state.get("routed"):
        return
    from devkit.engine_kit.dsv4.native_decode_stand_ins import StockSeams

    seams = StockSeams()
    target = importlib.import_module(TARGET)
    target._split_kv_pages_to_64 = seams.split
    importlib.import_module(FI_SPARSE)._sparse_mla_sm120_paged_attention = seams.paged_attention
    interface = importlib.import_module(INTERFACE)
    interface.flash_mla_with_kvcache = functools.wraps(interface.flash_mla_with_kvcache)(_sm120_decode)
    _state.update(routed=True, seams=seams)


def served() -> Any:
    """Route the seams; the module stand-in: the reference decode on the pool view it is handed."""
    from devkit.engine_kit.dsv4.native_decode_stand_ins import StubModule

    _route()
    _state["module"] = StubModule()
    return _state["module"]


def stock() -> None:
    """Route the seams; no module: the switch stays off and every call takes the stock copy path."""
    _route()
    return None
