"""The DeepSeek-V4 kit's routes: which SGLang functions the kit server replaces or wraps, pinned.

Applied by the one route finder of the ``sgl_kernel`` stand-in (``stub/sgl_kernel/_route.py``)
when ``SGL_STUB_DSV4=1``: each SGLang module in :data:`ROUTES` is patched right after it executes
(or at once if it is already imported). Tests and the DSV4 kit only, never production.

Every target is pinned in :data:`devkit.engine_kit.dsv4.pins.PINS`
(``module:qualname -> sha256(inspect.getsource(inspect.unwrap(fn)))``, hashed by
``adapter.core.pins``); a route whose target's installed source drifted raises
:class:`RouteRefused` naming the function, so the server fails to boot instead of running a
stand-in against code it was not written for. Patching is idempotent; every replacement carries
``__wrapped__`` = the upstream original, and modules that already hold the original by name
(``from X import f`` done before the patch) are rebound too. Each patched module prints one line
``[dsv4_kit] routed <module>: <names>`` to stderr (the server log).

What is routed, in boot order (the CPU engine map's blocker table):

1. rope factory: ``get_rope_wrapper`` on CPU builds the generic rope object for the SWA-only
   layers (unscaled rope; CPU accepts only ``deepseek_yarn``); the DSV4 forward uses ``freqs_cis``.
2. KV configurator: the CPU fp8-KV guard (Intel AMX, MHA only) is skipped; the DSV4 pool stores
   uint8 and packs fp8 itself.
3. compressed-attention metadata (Triton): torch twins (not the interpreter: its e4m3 cast is wrong).
4. backend: ``_flash_mla_with_kvcache`` is bound (upstream binds it under ``is_cuda()`` only); the
   ``flash_mla`` package itself is the stand-in in ``stub/flash_mla``.
5. compressor: plans, C4 / C128 pooling, norm + rope + fp8 store (:mod:`.kernels`).
6. main / indexer norm, rope, Hadamard, e4m3 kernels and the fused store; the sparse-prefill
   index kernels (Triton) and its dequant.
0. chat encoding: the kit's tokenizer renders chats with its own template, not DeepSeek's recipe
   encoder (the ``deepseek-recipe`` package, built for DeepSeek's tokenizer).
6b. hyper-connections: ``hc_split_sinkhorn`` (TileLang) and ``mhc_combine`` (Triton); the MHC env
   switches select the torch mixes and post; ``fused_hc_head`` (Triton) by SGLang's ``hc_head_torch``.
7. SwiGLU clamp (JIT) and the MoE CPU path: ``moe_forward_native`` applies DSV4's
   ``swiglu_limit`` as the GPU runners do (upstream's native path ignores it).
8. DeepSeek-V4.1's ratio-1/2 KV-source layers (:mod:`devkit.engine_kit.dsv41`): the fp4 index-K
   quantization, the paged index-K store and the decode index logits (Triton) by
   :mod:`.fp4_index`; the torch prefill top-k (``FullTopKIndexer._torch_prefill``) takes ties at
   the lowest column (:func:`.fp4_index.topk_lowest_index_ties`: upstream's ``topk(sorted=False)``
   chose among ties by the forward's width, so a row's KV depended on its chunk's length). A V4
   model never calls them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

from devkit.engine_kit.dsv4 import fp4_index, kernels
from devkit.engine_kit.dsv4.pins import PINS


class RouteRefused(RuntimeError):
    """A route's target drifted from its pin (or is missing): the kit refuses to patch it."""


@dataclass(frozen=True)
class Patch:
    qualname: str  # inside the module: "name" or "Class.name"
    build: Callable[[object, object], object]  # (module, upstream original) -> replacement
    static: bool = False  # a staticmethod on a class


# ----------------------------------------------------------------------------- replacements


def _replace_with(fn):
    """The stand-in ``fn`` behind a fresh delegating function (so marks land on the route, not on ``fn``)."""

    def build(module, original):
        @functools.wraps(fn)
        def stand_in(*args, **kwargs):
            return fn(*args, **kwargs)

        return stand_in

    return build


def _rope_wrapper(module, original):
    @functools.wraps(original)
    def get_rope_wrapper(head_size, rotary_dim, max_position, base, is_neox_style=True, rope_scaling=None,
                         dtype=None, partial_rotary_factor=1.0, device=None):
        scaling = (rope_scaling or {}).get("rope_type")
        if device == "cpu" and scaling != "deepseek_yarn":
            # get_rope_cpu takes only deepseek_yarn; the DSV4 forward rotates with freqs_cis anyway.
            return module.get_rope(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype,
                                   partial_rotary_factor)
        return original(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype,
                        partial_rotary_factor, device)

    return get_rope_wrapper


class _NotCpuInFrame:
    """``current_platform`` whose ``is_cpu()`` is False only when called from one code object."""

    def __init__(self, platform, code) -> None:
        self._platform, self._code = platform, code

    def __getattr__(self, name):
        return getattr(self._platform, name)

    def is_cpu(self) -> bool:
        if sys._getframe(1).f_code is self._code:
            return False
        return self._platform.is_cpu()


def _configure(module, original):
    code = original.__code__

    @functools.wraps(original)
    def configure(self, *args, **kwargs):
        # The CPU fp8-KV guard at the top of configure() is for Intel AMX MHA pools; the DSV4 pool
        # stores uint8 and packs fp8 itself. Only configure's own frame sees "not CPU".
        platform = module.current_platform
        module.current_platform = _NotCpuInFrame(platform, code)
        try:
            return original(self, *args, **kwargs)
        finally:
            module.current_platform = platform

    return configure


def _backend_init(module, original):
    @functools.wraps(original)
    def __init__(self, model_runner, *args, **kwargs):
        original(self, model_runner, *args, **kwargs)
        if not hasattr(self, "_flash_mla_with_kvcache"):  # upstream binds these under is_cuda() only
            from sglang.kernels.ops.attention import flash_mla_interface

            self._swa_interleaved = self.token_to_kv_pool.get_swa_key_layout().is_interleaved
            self._flash_mla_with_kvcache = functools.partial(flash_mla_interface.flash_mla_with_kvcache,
                                                             use_legacy=not self._swa_interleaved)
            self._flashmla_split_kv_min_topk = flash_mla_interface.SPLIT_KV_MIN_TOPK

    return __init__


def _prefill_generate(module, original):
    plan_cls = module.CompressorPrefillPlan

    def generate(compress_ratio, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state,
                 swa_page_size, ring_size, num_q_tokens, use_cuda_graph=False, use_req_ring=False):
        plan_c, plan_w = kernels.plan_compress_prefill(
            compress_ratio, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state, swa_page_size,
            ring_size, num_q_tokens, use_cuda_graph, use_req_ring)
        return plan_cls(compress_ratio, plan_c, plan_w, None)

    return generate


def _decode_generate(module, original):
    plan_cls = module.CompressorDecodePlan

    def generate(compress_ratio, req_pool_indices, req_to_token, full_to_state, seq_lens, swa_page_size, ring_size,
                 use_req_ring=False):
        return plan_cls(compress_ratio, kernels.plan_compress_decode(
            compress_ratio, req_pool_indices, req_to_token, full_to_state, seq_lens, swa_page_size, ring_size,
            use_req_ring))

    return generate


def _clamped_silu_and_mul(x, limit: float):
    """``SiluAndMul`` with DSV4's clamp (``silu(min(g, lim)) * clamp(u, -lim, lim)``), as the GPU runners."""
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    kernels.silu_and_mul_clamp(x, out, limit)
    return out


def _prefill_topk(module, original):
    @functools.wraps(original)
    def _torch_prefill(self, inputs):
        for request, chunks in module.prefill_requests(inputs=inputs, token_to_kv_pool=self.token_to_kv_pool):
            for chunk in chunks:
                module.write_prefill(inputs, request, chunk, fp4_index.topk_lowest_index_ties(chunk.scores, request.k))

    return _torch_prefill


def _moe_native(module, original):
    @functools.wraps(original)
    def moe_forward_native(layer, x, topk_output, moe_runner_config):
        limit = getattr(moe_runner_config, "swiglu_limit", None)
        if not limit or moe_runner_config.activation != "silu" or moe_runner_config.gemm1_alpha is not None:
            return original(layer, x, topk_output, moe_runner_config)
        # upstream builds ``act = SiluAndMul()`` and applies it per expert: hand it the clamped one
        upstream = module.SiluAndMul
        module.SiluAndMul = lambda: functools.partial(_clamped_silu_and_mul, limit=float(limit))
        try:
            return original(layer, x, topk_output, moe_runner_config)
        finally:
            module.SiluAndMul = upstream

    return moe_forward_native


def _chat_encoding_spec(module, original):
    @functools.wraps(original)
    def resolve_chat_encoding_spec(*, hf_config, tokenizer, tool_call_parser=None):
        spec = original(hf_config=hf_config, tokenizer=tokenizer, tool_call_parser=tool_call_parser)
        # DeepSeek's recipe encoder (the deepseek-recipe package) renders DeepSeek's tokenizer; the
        # kit's tiny model carries its own tokenizer with a chat template: use it.
        if spec in ("dsv4", "dsv41") and getattr(tokenizer, "chat_template", None):
            return None
        return spec

    return resolve_chat_encoding_spec


# ----------------------------------------------------------------------------- the table

ROUTE_TABLE: dict[str, tuple[Patch, ...]] = {
    "sglang.srt.entrypoints.openai.chat_encoding": (Patch("resolve_chat_encoding_spec", _chat_encoding_spec),),
    "sglang.srt.layers.rotary_embedding.factory": (Patch("get_rope_wrapper", _rope_wrapper),),
    "sglang.srt.mem_cache.kv_cache_configurator": (Patch("KVCacheConfigurator.configure", _configure),),
    "sglang.kernels.ops.attention.dsv4.metadata_kernel": (
        Patch("init_compression_metadata", _replace_with(kernels.init_compression_metadata)),
        Patch("fill_all_compressed_indices", _replace_with(kernels.fill_all_compressed_indices)),
    ),
    "sglang.srt.layers.attention.deepseek_v4_backend": (Patch("DeepseekV4AttnBackend.__init__", _backend_init),),
    "sglang.kernels.ops.attention.dsv4.compress": (
        Patch("CompressorPrefillPlan.generate", _prefill_generate, static=True),
        Patch("CompressorDecodePlan.generate", _decode_generate, static=True),
        Patch("compress_forward", _replace_with(kernels.compress_forward)),
        Patch("compress_norm_rope_store", _replace_with(kernels.compress_norm_rope_store)),
    ),
    "sglang.kernels.ops.attention.dsv4.norm_rope": (
        Patch("fused_rope_inplace", _replace_with(kernels.fused_rope_inplace)),
        Patch("fused_norm_rope_inplace", _replace_with(kernels.fused_norm_rope_inplace)),
        Patch("fused_q_norm_rope", _replace_with(kernels.fused_q_norm_rope)),
        Patch("fused_q_indexer_rope_hadamard_quant", _replace_with(kernels.fused_q_indexer_rope_hadamard_quant)),
        Patch("fused_k_norm_rope_flashmla", _replace_with(kernels.fused_k_norm_rope_flashmla)),
    ),
    "sglang.kernels.ops.layernorm.mhc": (
        Patch("hc_split_sinkhorn", _replace_with(kernels.hc_split_sinkhorn)),
        Patch("mhc_combine", _replace_with(kernels.mhc_combine)),
    ),
    "sglang.kernels.ops.layernorm.mhc_head": (Patch("fused_hc_head", _replace_with(kernels.fused_hc_head)),),
    "sglang.kernels.ops.attention.dsv4.attn": (Patch("fused_store_cache", _replace_with(kernels.fused_store_cache)),),
    "sglang.kernels.ops.attention.dsv4.sparse_prefill_kernels": (
        Patch("build_swa_token_ids", _replace_with(kernels.build_swa_token_ids)),
        Patch("combine_topk_swa_indices", _replace_with(kernels.combine_topk_swa_indices)),
    ),
    "sglang.kernels.ops.attention.dsv4.dequant_k_cache": (
        Patch("dequantize_k_cache_paged_dsv4", _replace_with(kernels.dequantize_k_cache_paged_dsv4)),
    ),
    "sglang.kernels.ops.activation.silu_and_mul_clamp": (
        Patch("silu_and_mul_clamp", _replace_with(kernels.silu_and_mul_clamp)),
    ),
    "sglang.srt.layers.moe.fused_moe_native": (Patch("moe_forward_native", _moe_native),),
    "sglang.kernels.ops.quantization.fp4_indexer_quant": (
        Patch("quantize_fp4_indexer_tensor", _replace_with(fp4_index.quantize_fp4_indexer_tensor)),
    ),
    "sglang.kernels.ops.kvcache.dsv4_fp4_index_k_cache": (
        Patch("store_fp4_index_k_cache", _replace_with(fp4_index.store_fp4_index_k_cache)),
    ),
    "sglang.kernels.ops.attention.dsv4.fp4_indexer": (
        Patch("fp4_index_logits_decode", _replace_with(fp4_index.fp4_index_logits_decode)),
    ),
    "sglang.srt.layers.attention.dsv4.v41_indexer.full_topk": (Patch("FullTopKIndexer._torch_prefill", _prefill_topk),),
}


def targets() -> list[str]:
    """Every ``module:qualname`` the routes patch (each must be pinned)."""
    return [f"{name}:{patch.qualname}" for name, patches in ROUTE_TABLE.items() for patch in patches]


def _owner(module, qualname: str):
    owner = module
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def _rebind(original, replacement) -> None:
    """Modules that imported the original by name before the patch get the replacement."""
    for name, mod in list(sys.modules.items()):
        if not name.startswith("sglang") or mod is None:
            continue
        namespace = getattr(mod, "__dict__", None)
        if not namespace:
            continue
        for key, value in list(namespace.items()):
            if value is original:
                namespace[key] = replacement


def apply(module) -> list[str]:
    """Patch ``module`` by its routes (pin-checked); returns the qualnames patched now."""
    from adapter.core.pins import check

    done = []
    for patch in ROUTE_TABLE[module.__name__]:
        owner, attr = _owner(module, patch.qualname)
        current = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        current_fn = current.__func__ if isinstance(current, staticmethod) else current
        if getattr(current_fn, "__dsv4_kit__", False):
            continue  # idempotent
        target = f"{module.__name__}:{patch.qualname}"
        pin = check(target, PINS)
        if not pin.ok:
            raise RouteRefused(f"DSV4 kit route refused: {pin.describe()} (the stand-in was written for the pinned "
                               f"source; re-read the function and re-pin in devkit/engine_kit/dsv4/pins.py)")
        replacement = patch.build(module, current_fn)
        replacement.__wrapped__ = current_fn
        replacement.__dsv4_kit__ = True
        setattr(owner, attr, staticmethod(replacement) if patch.static else replacement)
        if not isinstance(owner, type):
            _rebind(current_fn, replacement)
        done.append(patch.qualname)
    if done:
        print(f"[dsv4_kit] routed {module.__name__}: {', '.join(done)}", file=sys.stderr, flush=True)
    return done


ROUTES: dict[str, Callable[[object], object]] = {name: apply for name in ROUTE_TABLE}
