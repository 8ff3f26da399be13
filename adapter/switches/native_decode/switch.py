"""Native SWA decode (``DSV41_SWA_NATIVE_DECODE=1``): DSV4 decode attention reads 256-token SWA pages in place.

What it changes: on SM120 / SM121, SGLang 0.5.23's DeepSeek-V4 decode
(``sglang.kernels.ops.attention.flash_mla_sm120._flash_mla_flashinfer``) copies every SWA page a
step touches from the 256-token pool into four 64-token pages (``_split_kv_pages_to_64``, a mark
kernel, a memset and a split launch per layer) because its docstring says FlashInfer's
``decode_dsv4`` needs 64-token pages. FlashInfer 0.7.2 takes the page size at run time (a fastdiv
divisor; no template parameter), and its planner picks the same plan for both addressings. With
this switch, the calls it can serve go to a decode-only module built from the installed FlashInfer
sources at image build time (``runtime/build_native_decode.sh``) with SGLang's own 4-D pool view:
the same kernel instance, the same tactic, no copies. Every other call keeps the stock copy path
and is logged once per distinct reason.

Served: up to FlashInfer's decode row limit (64) of bf16 ``[B, 1, H, 512]`` queries, a head count
in FlashInfer's DSV4 decode envelope, a ``KVLayout.V4`` pool view ``[pages, 256, 1, 584]`` with
packed 584-byte rows and a 16-byte-aligned page pitch of at least ``256 x 584`` bytes, int32
indices, and an optional FP8 extra (C4A / C128A) cache passed through as the stock path passes it.
That includes DeepSeek-V4.1 checkpoints: on SM120/SM121 SGLang 0.5.23's
``select_dsv4_kv_layout()`` gives every DeepSeek-V4-family checkpoint the 584-byte ``KVLayout.V4``
pool (its V4.1 layouts, 528-byte FP8 and 288-byte FP4 rows, assert an SM100/SM103 GPU), so V4.1
decode is served here like V4's.
Not served (stock copy path, logged once per reason): FlashInfer autotune passes (calibration runs
through stock), any other page size or pitch, anything the module's own guard refuses at call time,
and decode-form calls of more than 64 rows (``--max-running-requests`` above 64, or speculative
verify blocks past 64 rows): SGLang sends those to ``_flash_mla_sm120_prefill``, which also copies
the touched pages; the switch wraps it only to log ``fallback reason=rows-over-64`` once (the
prefill kernel is not in the module).
Refused loudly (``refused:`` line, then an error, never the stock path): a pool of 528- or 288-byte
rows (or any row width but 584). The stock split hard-codes the 584-byte geometry, so on such a pool
the stock path would read the wrong bytes and compute garbage without an error.

Why: the copies cost tens of launches per decode step (reference fleet: +1.4 / +1.9 % greedy c1
with identical output bits; not measured here). The upstream docstring's "requires
page_block_size=64" is stale for the FlashInfer version SGLang pins.

Install refuses (one line, the engine stays stock) when: the SM120 decode backend is not FlashInfer,
there is no CUDA device, the device is not sm_120a / sm_121a, FlashInfer's DSV4 page size is not a
runtime argument, or the module fails any check of ``adapter.switches.native_decode.loader`` (missing file,
sha256 mismatch, tampered manifest, other FlashInfer).

Receipts: ``swa_native_decode installed arch=sm_120a page=256 so_sha256=<16 hex> max_rows=64``
at install; ``swa_native_decode serving arch=.. rows=.. heads=.. page=256`` on the first served
call; ``swa_native_decode fallback reason=<reason> [detail=<guard message>]`` once per distinct
reason; ``swa_native_decode refused: <reason>`` when it cannot install, or at the first call on a
pool whose rows are not 584 bytes (that call then raises :class:`UnsupportedKVLayout`).

Test-only stand-in (``DSV41_NATIVE_DECODE_STANDIN``, never in a profile): on the CPU engine the
named stand-in replaces the device check and the module load; it routes the DSV4 backend's decode to
SGLang's SM120 entry and returns a module stand-in (served) or None (the switch then does not
install: the stock copy path). The switch imports it by the key's value only.

Rollback: unset ``DSV41_SWA_NATIVE_DECODE``.
"""

from __future__ import annotations

import importlib
import logging
import math
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adapter.core import api
from adapter.core.api import NotApplicable, Refusal
from adapter.switches.native_decode import loader as native_decode_module

SWITCH = api.handle(__name__)
ENTRY = SWITCH.target("_flash_mla_flashinfer")
TARGET_MODULE = SWITCH.module_of("_flash_mla_flashinfer")
DIR_KEY = "DSV41_NATIVE_DECODE_DIR"
STANDIN_KEY = "DSV41_NATIVE_DECODE_STANDIN"
PREFILL_ENTRY = SWITCH.target("_flash_mla_sm120_prefill")

PAGE = native_decode_module.NATIVE_PAGE_SIZE  # 256
BYTES_PER_TOKEN = 584  # KVLayout.V4: 448 e4m3 nope + 64 bf16 rope + 7 UE8M0 scales + 1 pad
OTHER_LAYOUTS = {528: "KVLayout.V41 (528-byte FP8 rows)", 288: "KVLayout.V41 FP4 (288-byte rows)"}
D_QK = 512
D_V = 512
CHUNK = 64  # DSV4 decode candidates per split (FlashInfer _BI)
KV_DTYPES = (torch.uint8, torch.float8_e4m3fn)
_FI_SPARSE = "flashinfer.mla._sparse_mla_sm120"


@dataclass
class Native:
    """The loaded module and the FlashInfer policy hooks the served call uses (the test seam)."""

    module: Any  # tvm_ffi.Module with dsv4_native_page_decode
    arch: str
    sha256: str
    max_rows: int  # FlashInfer _DECODE_MAX_TOKENS
    heads_ok: Callable[[int, int], bool]  # (heads, topk) in FlashInfer's DSV4 decode envelope
    scratch_heads: Callable[[int], int]  # split-K scratch head stride for a head count
    chunks_per_block: Callable[[torch.device, int, int, int, int], int]  # FlashInfer's cpb choice
    tuning: Callable[[], bool]  # FlashInfer autotune in progress


class UnsupportedKVLayout(RuntimeError):
    """The SWA pool's rows are not KVLayout.V4's 584 bytes: neither the stock SM120 path nor the module
    can read it (the stock split would copy the wrong bytes), so the call stops here."""


_native: Native | None = None
stats: Counter[str] = Counter()  # "served", "fallback:<reason>": read by tests and the bench
_logged: set[str] = set()


def reset() -> None:
    """Forget the loaded module, counters and logged reasons (uninstall and tests)."""
    global _native
    _native = None
    stats.clear()
    _logged.clear()


# -- the decision ---------------------------------------------------------------------------------------


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def unserved_reason(
    native: Native,
    q: Any,
    k_cache: Any,
    indices: Any,
    topk_length: Any,
    attn_sink: Any,
    head_dim_v: Any,
    extra_k_cache: Any,
    extra_indices: Any,
    extra_topk_length: Any,
) -> str | None:
    """None when the module serves this call; else a short reason (the receipt's ``reason=``)."""
    if native.tuning():
        return "autotune"
    if not isinstance(q, torch.Tensor) or q.ndim != 4 or q.shape[1] != 1:
        return "q-shape"
    if q.dtype != torch.bfloat16:
        return "q-dtype"
    rows, _, heads, width = q.shape
    if width != D_QK:
        return f"q-width-{width}"
    if head_dim_v != D_V:
        return f"head-dim-v-{head_dim_v}"
    if not 1 <= rows <= native.max_rows:
        return f"rows-{rows}"
    if not isinstance(k_cache, torch.Tensor) or k_cache.ndim != 4 or k_cache.shape[2] != 1:
        return "kv-shape"
    if k_cache.dtype not in KV_DTYPES:
        return "kv-dtype"
    if k_cache.shape[3] != BYTES_PER_TOKEN:  # the wrappers refuse these loudly before asking
        return f"kv-layout-{k_cache.shape[3]}"
    if k_cache.stride(3) != 1 or k_cache.stride(1) != BYTES_PER_TOKEN:
        return "kv-row-stride"
    if k_cache.shape[1] != PAGE:
        return f"page-size-{k_cache.shape[1]}"
    pitch = k_cache.stride(0)
    if pitch % 16 or pitch < PAGE * BYTES_PER_TOKEN:
        return f"page-stride-{pitch}"
    if not _aligned(k_cache):
        return "kv-misaligned"
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32:
        return "indices-dtype"
    if not (indices.ndim == 2 or (indices.ndim == 3 and indices.shape[1] == 1)) or indices.shape[0] != rows:
        return "indices-shape"
    if indices.stride(-1) != 1:
        return "indices-stride"
    topk = indices.shape[-1]
    if not native.heads_ok(heads, topk):
        return f"heads-{heads}"
    if topk_length is not None and (topk_length.dtype != torch.int32 or topk_length.shape != (rows,)):
        return "topk-length"
    if attn_sink is not None and (attn_sink.dtype != torch.float32 or attn_sink.shape != (heads,)):
        return "attn-sink"
    if (extra_k_cache is None) != (extra_indices is None) or (extra_k_cache is None and extra_topk_length is not None):
        return "extra-pairing"
    if extra_k_cache is not None:
        if extra_k_cache.ndim != 4 or extra_k_cache.dtype not in KV_DTYPES or extra_k_cache.shape[3] != BYTES_PER_TOKEN:
            return "extra-layout"
        if extra_indices.dtype != torch.int32 or extra_indices.shape[0] != rows:
            return "extra-indices"
    tensors = [t for t in (k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length)
               if t is not None]  # fmt: skip
    if any(t.device != q.device for t in tensors):
        return "device-mismatch"
    return None


# -- the served call ------------------------------------------------------------------------------------


def _as_bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.dtype == torch.uint8 else t.view(torch.uint8)


def _squeeze_row(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.squeeze(1) if t is not None and t.ndim == 3 else t


def serve(native: Native, q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
          extra_k_cache, extra_indices, extra_topk_length):  # fmt: skip
    """The stock call's result, computed by the module on the 256-token pool view (no page split)."""
    rows, _, heads, _ = q.shape
    idx = _squeeze_row(indices)
    extra_idx = _squeeze_row(extra_indices)
    topk = idx.shape[-1]
    extra_topk = extra_idx.shape[-1] if extra_idx is not None else 0
    num_splits = math.ceil(topk / CHUNK) + math.ceil(extra_topk / CHUNK)
    scratch = native.scratch_heads(heads)
    dev = q.device
    output = torch.empty(rows, heads, head_dim_v, dtype=torch.bfloat16, device=dev)
    out_lse = torch.empty(rows, heads, dtype=torch.float32, device=dev)
    mid_out = torch.empty(rows, scratch, num_splits, head_dim_v, dtype=torch.bfloat16, device=dev)
    mid_lse = torch.empty(rows, scratch, num_splits, dtype=torch.float32, device=dev)
    cpb = native.chunks_per_block(dev, rows, heads, topk, extra_topk)
    native.module.dsv4_native_page_decode(
        q.squeeze(1), _as_bytes(k_cache), idx, mid_out, mid_lse, output, out_lse, num_splits,
        float(softmax_scale), topk_length, attn_sink, _as_bytes(extra_k_cache), extra_idx, extra_topk_length,
        cpb, 1.0,
    )  # fmt: skip
    return (output.unsqueeze(1), None)


def _bind(q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale, extra_k_cache, extra_indices,
          extra_topk_length):  # fmt: skip
    """The stock ``_flash_mla_flashinfer`` parameters, by name (it is called positionally upstream)."""
    return (q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale, extra_k_cache, extra_indices,
            extra_topk_length)  # fmt: skip


def _fallback(reason: str, detail: str = "") -> None:
    """Count the call; log the reason (and a guard's message) the first time it is seen."""
    stats[f"fallback:{reason}"] += 1
    detail = "_".join(detail.split())[:160]  # one word: receipts are space-separated key=value
    seen = f"{reason}:{detail}"
    if seen in _logged:
        if api.metrics_on():  # the line is logged once; the metrics count every call
            SWITCH.tally("fallback", reason=reason)
        return
    _logged.add(seen)
    fields: dict[str, object] = {"reason": reason}
    if detail:
        fields["detail"] = detail
    SWITCH.event("fallback", **fields)


def check_layout(k_cache: Any) -> None:
    """Raise :class:`UnsupportedKVLayout` (after one ``refused`` line) for a 4-D pool view whose rows are
    not 584 bytes: SGLang's SM120 split and the module both address 584-byte rows, so stock would
    silently compute on the wrong bytes."""
    if not isinstance(k_cache, torch.Tensor) or k_cache.ndim != 4 or k_cache.shape[3] == BYTES_PER_TOKEN:
        return
    width = int(k_cache.shape[3])
    layout = OTHER_LAYOUTS.get(width, f"{width}-byte rows")
    reason = (f"the DSV4 SWA pool has {layout}; SGLang 0.5.23's SM120 decode (stock page split and this module) "
              f"reads only KVLayout.V4 584-byte rows, so the stock path would compute on the wrong bytes. On "
              f"SM120/SM121 select_dsv4_kv_layout() gives every DeepSeek-V4-family checkpoint V4: this pool "
              f"comes from a changed layout selection, and unsetting DSV41_SWA_NATIVE_DECODE does not make it readable")  # fmt: skip
    key = f"layout:{width}"
    if key not in _logged:
        _logged.add(key)
        SWITCH.refuse_late(reason)
    stats[f"refused:kv-layout-{width}"] += 1
    raise UnsupportedKVLayout(f"swa_native_decode: k_cache {tuple(k_cache.shape)}: {reason}")


def _checked_call(args: tuple, kwargs: dict) -> tuple | None:
    """The stock parameters of a call, its pool's layout checked (a refusal raises); None when the
    module is not loaded or the call does not bind (both: the stock path)."""
    if _native is None:  # reverted or never loaded
        return None
    try:
        call = _bind(*args, **kwargs)
    except TypeError:
        _fallback("signature")
        return None
    check_layout(call[1])
    return call


def _prefill_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Decode-form calls of more than 64 rows: the stock prefill kernel on the 64-token copy, logged once."""
    if _checked_call(args, kwargs) is not None:
        _fallback("rows-over-64")
    return wrapped(*args, **kwargs)


def _entry_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    native = _native
    call = _checked_call(args, kwargs)
    if call is None:
        return wrapped(*args, **kwargs)
    q, k_cache, indices, topk_length, attn_sink, head_dim_v, _scale, extra_k, extra_i, extra_len = call
    reason = unserved_reason(native, q, k_cache, indices, topk_length, attn_sink, head_dim_v, extra_k, extra_i,
                             extra_len)  # fmt: skip
    if reason is None:
        try:
            result = serve(native, *call)
        except RuntimeError as exc:  # the module's guard or FlashInfer's checks refused: stock path
            _fallback("guard-refused", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        else:
            stats["served"] += 1
            if "served" not in _logged:
                _logged.add("served")
                SWITCH.event("serving", arch=native.arch, rows=q.shape[0], heads=q.shape[2], page=PAGE)
            if api.metrics_on():  # `serving` is logged once; the metrics count every call served in place
                SWITCH.tally("served")
            return result
    else:
        _fallback(reason)
    return wrapped(*args, **kwargs)


# -- install ----------------------------------------------------------------------------------------------


def _device_arch() -> str:
    """The current CUDA device's module arch; not applicable on no device or an arch the module lacks."""
    if not torch.cuda.is_available():
        raise NotApplicable("no CUDA device")
    try:
        return native_decode_module.arch_for_capability(torch.cuda.get_device_capability())
    except native_decode_module.LoadRefused as exc:
        raise NotApplicable(str(exc)) from None


def _load_module(path: Path) -> Any:
    """The loader seam (``tvm_ffi.load_module``); tests replace it to stand in for a GPU-only call."""
    import tvm_ffi

    return tvm_ffi.load_module(str(path))


def _flashinfer_policy() -> dict[str, Any]:
    """FlashInfer 0.7.2's DSV4 decode capabilities and its policy hooks, read from the installed package."""
    try:
        fi = importlib.import_module(_FI_SPARSE)
        policy = importlib.import_module(f"{_FI_SPARSE}._policy")
        envelope = policy._STATIC_DECODE_ENVELOPE[policy._MODEL_TYPE_DSV4]
        dispatch = fi._DECODE_DSV4_DISPATCH
        max_rows = int(fi._DECODE_MAX_TOKENS)
        resolve_cpb = policy._resolve_cpb
        from flashinfer.autotuner import AutoTuner
    except (ImportError, AttributeError, KeyError) as exc:
        raise Refusal(f"FlashInfer's DSV4 decode policy is not readable: {type(exc).__name__}: {exc}") from None
    if not envelope.page_block_size_is_runtime:
        raise Refusal("FlashInfer's DSV4 decode page size is not a runtime argument here")

    def chunks_per_block(device: torch.device, rows: int, heads: int, topk: int, extra_topk: int) -> int:
        # The value FlashInfer's own planner picks for the decode route (-1: the C++ wave heuristic).
        try:
            return int(resolve_cpb(device, "dsv4", rows, heads, topk, extra_topk))
        except Exception:
            return -1

    return {
        "max_rows": max_rows,
        "heads_ok": lambda heads, topk: (heads, topk) in dispatch,
        "chunks_per_block": chunks_per_block,
        "tuning": lambda: bool(AutoTuner.get().is_tuning_mode),
    }


def install(ctx: api.SwitchContext) -> dict[str, object]:
    SWITCH.bind(ctx)
    reset()
    target = sys.modules[TARGET_MODULE]
    backend = getattr(target, "_sm120_default_backend", None)
    if backend != "flashinfer":
        raise Refusal(f"SM120 decode backend is {backend!r} (SGLANG_SM120_FLASHMLA_BACKEND), not flashinfer")
    standin = ctx.option(STANDIN_KEY)
    if standin:
        return _install_standin(ctx, standin)
    arch = _device_arch()
    policy = _flashinfer_policy()
    directory = Path(ctx.option(DIR_KEY) or native_decode_module.DEFAULT_DIR)
    try:
        loaded = native_decode_module.load(directory, arch, loader=_load_module)
    except native_decode_module.LoadRefused as exc:
        raise Refusal(str(exc)) from None
    _activate(ctx, loaded.module, arch, loaded.sha256, policy)
    ctx.event("module", level=logging.DEBUG, path=loaded.path)
    return {"arch": arch, "page": PAGE, "so_sha256": loaded.sha256[:16], "max_rows": policy["max_rows"]}


def _activate(ctx: api.SwitchContext, module: Any, arch: str, sha256: str, policy: dict[str, Any]) -> None:
    global _native
    _native = Native(module=module, arch=arch, sha256=sha256,
                     scratch_heads=lambda heads: int(module.decode_scratch_heads(heads)), **policy)  # fmt: skip
    ctx.wrap(ENTRY, _entry_wrapper)
    ctx.wrap(PREFILL_ENTRY, _prefill_wrapper)


def _install_standin(ctx: api.SwitchContext, spec: str) -> dict[str, object]:
    """Tests only (the CPU engine): the stand-in named by the test-only key replaces the device check and
    the module load. It returns the module stand-in, or None for the stock copy path (not installed)."""
    module_name, _, function = spec.partition(":")
    module = getattr(importlib.import_module(module_name), function)()
    if module is None:
        raise NotApplicable(f"{STANDIN_KEY} stand-in {spec} keeps the stock copy path")
    policy = _flashinfer_policy()
    _activate(ctx, module, "standin", "", policy)
    return {"arch": "standin", "page": PAGE, "so_sha256": "none", "max_rows": policy["max_rows"]}
