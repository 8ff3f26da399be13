"""The reference forward of the tiny DeepSeek-V4 checkpoint: transformers 5.19's pure-torch model with
SGLang's fp8 KV round trips emulated (devkit only).

What SGLang 0.5.23 stores in fp8 on the DSV4 path, and what :func:`fp8_kv_emulation` therefore
rounds (read from ``kernels/jit/csrc/deepseek_v4/store.cuh``, ``main_norm_rope.cuh`` ~702-852 and
``srt/layers/attention/dsv4/indexer.py``; the CUDA kernels, not the HIP Triton twins):

* main SWA KV and the C4 / C128 compressed KV, V4 layout (584 B/token): dims 0..447 as e4m3 in 7
  tiles of 64, each with a UE8M0 scale ``2**ceil(log2(max(amax, 1e-4) / 448))``; dims 448..511 (the
  rotated rope part) stay bf16. Every attention read (sparse prefill via
  ``dequantize_k_cache_paged``, paged decode) sees the dequantized values, the current chunk's tokens
  included. Rope touches only the last 64 dims, so rounding the nope part at ``kv_norm``'s output is
  the same as rounding it after rope (where SGLang does it).
* C4 indexer keys and indexer queries: rope, then a 128-point Sylvester Hadamard rotation
  (``H/sqrt(128)``), then e4m3 with one fp32 scale ``max(amax, 1e-4) / 448`` per key row and per
  (token, head) query row. The query scale folds into the head weights. Scores are
  ``relu(q~ . k~)`` in the rotated basis (the rotation is orthonormal, so only the rounding differs
  from transformers' ``relu(q . k)``).
* not rounded: the main-attention query (bf16 into FlashMLA), the compressor state rings (fp32).

The SwiGLU clamp: transformers clamps the gate at ``swiglu_limit`` (max only) and the up branch to
``[-limit, limit]`` for routed and shared experts, as SGLang's GPU paths do (Triton runner and
``silu_and_mul_clamp``). SGLang's CPU ``moe_forward_native`` never reads
``MoeRunnerConfig.swiglu_limit``; :func:`routed_clamp` (off) reproduces that path for comparisons.

Two changes to the loaded transformers model (:func:`load_reference`), both toward what SGLang
runs: ``DeepseekV4RMSNorm`` weights cast to bf16 (transformers keeps them fp32 via
``_keep_in_fp32_modules_strict``, and its bf16 forward then fails on a dtype mismatch), and fp32
rope cos/sin tables (transformers casts them to bf16; SGLang's ``freqs_cis`` are fp32, and the
frequencies agree to 1e-7 with SGLang's ``precompute_freqs_cis``, yarn included).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

FP8_MAX = 448.0
SCALE_FLOOR = 1e-4  # the CUDA kernels' floor on amax (the HIP Triton twins use 1e-8)
NOPE = 448
ROPE = 64
TILE = 64
INDEX_DIM = 128


# --- fp8 formats ---------------------------------------------------------------------------------

def ue8m0_exponent(scale: torch.Tensor) -> torch.Tensor:
    """The biased UE8M0 exponent of ``2**ceil(log2(scale))`` for positive fp32 ``scale``
    (``cast_to_ue8m0`` in ``fp8_utils.cuh``: exponent bits + 1 when any mantissa bit is set)."""
    bits = scale.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def quantize_v4_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [..., 512] -> (nope e4m3 [..., 448], UE8M0 exponents uint8 [..., 7], rope bf16 [..., 64])."""
    if x.shape[-1] != NOPE + ROPE:
        raise ValueError(f"quantize_v4_kv expects a last dim of {NOPE + ROPE}, got {tuple(x.shape)}")
    nope = x[..., :NOPE].float().reshape(*x.shape[:-1], NOPE // TILE, TILE)
    exponent = ue8m0_exponent(nope.abs().amax(-1).clamp_min(SCALE_FLOOR) / FP8_MAX)
    inv_scale = torch.exp2(-(exponent - 127).float()).unsqueeze(-1)
    values = (nope * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.reshape(*x.shape[:-1], NOPE), exponent.to(torch.uint8), x[..., NOPE:].to(torch.bfloat16)


def dequantize_v4_kv(values: torch.Tensor, exponent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_v4_kv` (bf16 [..., 512], what FlashMLA and the sparse-prefill
    dequant read)."""
    scale = torch.exp2(exponent.to(torch.int32).float() - 127).unsqueeze(-1)
    nope = values.float().reshape(*values.shape[:-1], NOPE // TILE, TILE) * scale
    return torch.cat([nope.reshape(*values.shape[:-1], NOPE).to(torch.bfloat16), rope.to(torch.bfloat16)], -1)


def roundtrip_v4_kv(x: torch.Tensor) -> torch.Tensor:
    """``x`` through the V4 cache layout and back (dtype of ``x`` kept)."""
    return dequantize_v4_kv(*quantize_v4_kv(x)).to(x.dtype)


@functools.lru_cache(maxsize=4)
def hadamard(n: int = INDEX_DIM) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix ``H[i, j] = (-1)**popcount(i & j) / sqrt(n)``
    (the butterfly of ``fused_q_indexer_rope_hadamard_quant``; symmetric, so ``x @ H`` rotates rows)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def quantize_indexer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` [..., 128] (already Hadamard-rotated) -> (e4m3 values, fp32 scale [...])."""
    x = x.float()
    scale = x.abs().amax(-1).clamp_min(SCALE_FLOOR) / FP8_MAX
    return (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def roundtrip_indexer(x: torch.Tensor) -> torch.Tensor:
    """fp32 rows of ``x`` [..., 128] rotated by :func:`hadamard`, quantized and dequantized (the
    values the indexer scores, in the rotated basis)."""
    values, scale = quantize_indexer(x.float() @ hadamard(x.shape[-1]))
    return values.float() * scale.unsqueeze(-1)


def dequantize_v4_pages(buf: torch.Tensor, locs: torch.Tensor, page_size: int) -> torch.Tensor:
    """bf16 [N, 512] rows at token slots ``locs`` of an SGLang V4-layout page buffer (uint8
    ``[pages, bytes_per_page]``: per page ``page_size`` rows of 448 e4m3 + 64 bf16, then
    ``page_size`` x 8 scale bytes; the layout of ``set_k_and_s_torch`` in SGLang's kernel tests)."""
    flat = buf.view(torch.uint8).reshape(buf.shape[0], -1)
    page, slot = locs.long() // page_size, locs.long() % page_size
    row = slot.unsqueeze(1) * (NOPE + 2 * ROPE) + torch.arange(NOPE + 2 * ROPE)
    data = flat[page.unsqueeze(1), row]
    sc = flat[page.unsqueeze(1), page_size * (NOPE + 2 * ROPE) + slot.unsqueeze(1) * 8 + torch.arange(NOPE // TILE)]
    return dequantize_v4_kv(data[:, :NOPE].contiguous().view(torch.float8_e4m3fn), sc,
                            data[:, NOPE:].contiguous().view(torch.bfloat16))


def dequantize_indexer_pages(buf: torch.Tensor, locs: torch.Tensor, page_size: int = 64) -> torch.Tensor:
    """fp32 [N, 128] indexer keys (Hadamard basis) at slots ``locs`` of an SGLang indexer page buffer
    (per page ``page_size`` x 128 e4m3, then ``page_size`` fp32 scales; ``fp8_paged_mqa_logits_torch``)."""
    flat = buf.view(torch.uint8).reshape(buf.shape[0], -1)
    page, slot = locs.long() // page_size, locs.long() % page_size
    values = flat[page.unsqueeze(1), slot.unsqueeze(1) * INDEX_DIM + torch.arange(INDEX_DIM)]
    scale = flat[page.unsqueeze(1), page_size * INDEX_DIM + slot.unsqueeze(1) * 4 + torch.arange(4)]
    return values.contiguous().view(torch.float8_e4m3fn).float() * scale.contiguous().view(torch.float32)


# --- the model -----------------------------------------------------------------------------------

def _modeling():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4

    return modeling_deepseek_v4


def load_reference(path: str | Path, dtype: torch.dtype = torch.bfloat16):
    """transformers' ``DeepseekV4ForCausalLM`` on the checkpoint folder ``path`` (eval, CPU)."""
    from transformers import DeepseekV4ForCausalLM

    from .checkpoint import load_config, transformers_config

    model = DeepseekV4ForCausalLM.from_pretrained(str(path), config=transformers_config(load_config(path)),
                                                  dtype=dtype)
    for module in model.modules():
        if isinstance(module, _modeling().DeepseekV4RMSNorm):
            module.weight.data = module.weight.data.to(dtype)
        if isinstance(module, _modeling().DeepseekV4RotaryEmbedding):
            module.register_forward_pre_hook(_fp32_rope_tables, with_kwargs=True)
    return model.eval()


def _fp32_rope_tables(_module, args, kwargs):
    """``DeepseekV4RotaryEmbedding`` casts cos/sin to the dtype of its first argument (bf16 in a bf16
    model); SGLang rotates with fp32 ``freqs_cis`` tables. Handing it an fp32 view keeps the tables
    fp32 (the rotation itself already runs in fp32 in ``apply_rotary_pos_emb``)."""
    return (args[0].float(), *args[1:]), kwargs


def _scorer_fp8(self, q: torch.Tensor, compressed_kv: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """``DeepseekV4IndexerScorer.forward`` with SGLang's Hadamard + e4m3 rounding of q and k."""
    q_r = roundtrip_indexer(q)  # [B, S, H, 128]
    k_r = roundtrip_indexer(compressed_kv)  # [B, T, 128]
    scores = F.relu(torch.matmul(q_r, k_r.transpose(-1, -2).unsqueeze(1))) * self.softmax_scale
    weights = self.weights_proj(hidden_states).float() * self.weights_scaling
    return (scores * weights.unsqueeze(-1)).sum(dim=2)


@contextlib.contextmanager
def fp8_kv_emulation(model, *, main: bool = True, compressed: bool = True, indexer: bool = True) -> Iterator[None]:
    """Round what SGLang stores in fp8 (see the module docstring) while inside the block."""
    M = _modeling()
    handles = []
    scorers = []

    def hook(_module, _inputs, output):
        return roundtrip_v4_kv(output)

    for layer in model.model.layers:
        attn = layer.self_attn
        if main:
            handles.append(attn.kv_norm.register_forward_hook(hook))
        if attn.compressor is not None and compressed:
            handles.append(attn.compressor.kv_norm.register_forward_hook(hook))
        if isinstance(attn.compressor, M.DeepseekV4CSACompressor) and indexer:
            scorer = attn.compressor.indexer.scorer
            scorer.forward = _scorer_fp8.__get__(scorer)
            scorers.append(scorer)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for scorer in scorers:
            del scorer.forward


@contextlib.contextmanager
def routed_clamp(model, enabled: bool) -> Iterator[None]:
    """With ``enabled=False``, routed experts run without the SwiGLU clamp (SGLang's CPU
    ``moe_forward_native``); the shared expert keeps it (``silu_and_mul_clamp`` on every path)."""
    saved = [(layer.mlp.experts, layer.mlp.experts.limit) for layer in model.model.layers]
    try:
        if not enabled:
            for experts, _ in saved:
                experts.limit = float("inf")
        yield
    finally:
        for experts, limit in saved:
            experts.limit = limit


def new_cache(model):
    """An empty transformers cache for ``model`` (DSV4 layers get their CSA / HCA cache layers)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.no_grad()
def reference_logits(model, input_ids: Sequence[int] | torch.Tensor, *, fp8: bool = True,
                     chunks: Sequence[int] | None = None, cache=None, clamp: bool = True) -> torch.Tensor:
    """fp32 logits [len(input_ids), vocab] of one sequence.

    ``chunks``: split the forward into consecutive chunks of these sizes over one cache (chunked
    prefill / prefix hit + extend); the default is one forward. ``cache`` continues an earlier
    call's cache (its tokens are the prefix of this call's positions).
    """
    ids = torch.as_tensor(list(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids).view(1, -1)
    sizes = list(chunks) if chunks else [ids.shape[1]]
    if sum(sizes) != ids.shape[1]:
        raise ValueError(f"chunks={sizes} sum to {sum(sizes)}, not to the {ids.shape[1]} tokens")
    cache = cache if cache is not None else (new_cache(model) if len(sizes) > 1 else None)
    out = []
    with contextlib.ExitStack() as stack:
        if fp8:
            stack.enter_context(fp8_kv_emulation(model))
        stack.enter_context(routed_clamp(model, clamp))
        start = cache.get_seq_length() if cache is not None else 0
        offset = 0
        for size in sizes:
            part = ids[:, offset:offset + size]
            pos = torch.arange(start + offset, start + offset + size).view(1, -1)
            res = model(input_ids=part, position_ids=pos, past_key_values=cache, use_cache=cache is not None)
            out.append(res.logits[0].float())
            offset += size
    return torch.cat(out, 0)


def margins(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit per row."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


# --- per-module references -----------------------------------------------------------------------

def _attn(model, layer: int):
    return model.model.layers[layer].self_attn


@torch.no_grad()
def capture(model, input_ids: Sequence[int] | torch.Tensor, *, fp8: bool = True) -> dict[int, dict[str, Any]]:
    """Per layer, the tensors a stand-in is checked against, from one reference forward:
    ``attn_in`` [S, D] (the attention input, after ``input_layernorm``), ``q_residual`` [S, q_lora],
    ``kv`` [S, 512] (after ``kv_norm``, fp8-rounded when ``fp8``), ``compressed`` [T, 512]
    (compressor entries after norm + rope), ``indexer_keys`` [T, 128] (after norm + rope, not
    rotated), ``topk`` [S, k] (indexer picks, -1 = none), ``attn_out`` [S, D], ``ffn_in`` [S, D],
    ``moe_out`` [S, D], ``attn_hc`` / ``ffn_hc`` (post [S, hc], comb [S, hc, hc], collapsed [S, D]),
    ``streams_in`` [S, hc, D]."""
    M = _modeling()
    seen: dict[int, dict[str, Any]] = {i: {} for i in range(len(model.model.layers))}
    handles = []

    def keep(i: int, key: str, fn):
        def hook(_m, args, output):
            seen[i][key] = fn(args, output)
        return hook

    with contextlib.ExitStack() as stack:
        if fp8:  # entered first: its hooks run before the recording ones, so "kv" is the rounded value
            stack.enter_context(fp8_kv_emulation(model))
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            handles += [
                layer.register_forward_hook(keep(i, "streams_in", lambda a, o: a[0][0])),
                layer.input_layernorm.register_forward_hook(keep(i, "attn_in", lambda a, o: o[0])),
                attn.q_a_norm.register_forward_hook(keep(i, "q_residual", lambda a, o: o[0])),
                attn.kv_norm.register_forward_hook(keep(i, "kv", lambda a, o: o[0])),
                attn.register_forward_hook(keep(i, "attn_out", lambda a, o: o[0][0])),
                layer.attn_hc.register_forward_hook(keep(i, "attn_hc", lambda a, o: tuple(t[0] for t in o))),
                layer.ffn_hc.register_forward_hook(keep(i, "ffn_hc", lambda a, o: tuple(t[0] for t in o))),
                layer.post_attention_layernorm.register_forward_hook(keep(i, "ffn_in", lambda a, o: o[0])),
                layer.mlp.register_forward_hook(keep(i, "moe_out", lambda a, o: o[0])),
            ]
            if attn.compressor is not None:
                handles.append(attn.compressor.register_forward_hook(
                    keep(i, "compressed", lambda a, o: o[0][0, 0])))
            if isinstance(attn.compressor, M.DeepseekV4CSACompressor):
                idx = attn.compressor.indexer
                handles.append(idx.scorer.register_forward_hook(keep(i, "indexer_keys", lambda a, o: a[1][0])))
                handles.append(idx.register_forward_hook(keep(i, "topk", lambda a, o: o[0])))
        try:
            ids = torch.as_tensor(list(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids)
            model(input_ids=ids.view(1, -1), use_cache=False)
        finally:
            for h in handles:
                h.remove()
    return seen


@torch.no_grad()
def compress(model, layer: int, hidden: torch.Tensor, *, chunks: Sequence[int] | None = None,
             fp8: bool = False, fp32: bool = False) -> torch.Tensor:
    """Compressor entries [T, 512] (after norm + rope) of layer ``layer`` (C4 or C128) for one
    sequence whose attention inputs are ``hidden`` [S, D] at positions 0..S-1, fed in ``chunks``
    through the compressor's cache (the state carried across chunks: C128 buffer, C4 buffer and
    overlap). The indexer is not run. ``fp8``: entries through the V4 cache layout.

    ``fp32``: the projections as SGLang's ``linear_bf16_fp32`` (bf16 operands, fp32 out), so
    transformers' own pooling, norm and rope then run in fp32 as SGLang's compressor does (entries
    fp32). The default (bf16 projections and pooling, the model's own forward) is ISA-dependent:
    the bf16 GEMM is oneDNN's ``avx512_core_bf16`` brgemm on CPUs with AVX512-BF16 and another
    kernel elsewhere, and one bf16 ulp of a projection moves the bf16 pooling's rounding, which on a
    cancelling channel reaches ~3 bf16 ulps of the tile amax."""
    comp = _attn(model, layer).compressor
    if comp is None:
        raise ValueError(f"layer {layer} has no compressor (SWA only)")
    cache = new_cache(model)
    cache_layer = cache.layers[layer]
    sizes = list(chunks) if chunks else [hidden.shape[0]]
    start = 0
    for size in sizes:
        h = hidden[start:start + size].unsqueeze(0).to(comp.kv_proj.weight.dtype)
        if fp32:  # products of bf16 operands are exact in fp32; only the fp32 sum order varies
            kv = F.linear(h.float(), comp.kv_proj.weight.float())
            gate = F.linear(h.float(), comp.gate_proj.weight.float())
        else:
            kv, gate = comp.kv_proj(h), comp.gate_proj(h)
        _pool_into_cache(comp, cache_layer, kv, gate)
        start += size
    out = cache_layer.compressed_kv["compressor"]
    out = out[0] if out is not None else hidden.new_zeros(0, comp.head_dim)
    return roundtrip_v4_kv(out) if fp8 else out


def _pool_into_cache(comp, cache_layer, kv: torch.Tensor, gate: torch.Tensor) -> None:
    """Run ``comp``'s window pooling (transformers' own code path) on projected ``kv``/``gate``,
    appending the entries to ``cache_layer``. Calls the compressor's forward with the projections
    swapped in, so the pooling, overlap, norm and rope are transformers' and not a copy."""
    M = _modeling()
    saved = comp.kv_proj, comp.gate_proj
    indexer = getattr(comp, "indexer", None)
    try:
        comp.kv_proj = _Const(kv)
        comp.gate_proj = _Const(gate)
        if isinstance(comp, M.DeepseekV4CSACompressor):
            comp.indexer = _NoIndexer()
        holder = _OneLayerCache(cache_layer)
        seq = kv.shape[1]
        comp(kv.new_zeros(1, seq, 1), None, torch.zeros(1, seq, dtype=torch.long), holder, 0)
    finally:
        comp.kv_proj, comp.gate_proj = saved
        if indexer is not None:
            comp.indexer = indexer


class _Const(torch.nn.Module):
    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value

    def forward(self, _x):
        return self.value


class _NoIndexer(torch.nn.Module):
    def forward(self, hidden_states, *_args):
        return torch.zeros(1, hidden_states.shape[1], 0, dtype=torch.long)


class _OneLayerCache:
    def __init__(self, layer):
        self.layers = [layer]


@torch.no_grad()
def indexer(model, layer: int, hidden: torch.Tensor, q_residual: torch.Tensor, *, topk: int | None = None,
            fp8: bool = True) -> dict[str, torch.Tensor]:
    """The lightning indexer of C4 layer ``layer`` on one sequence (positions 0..S-1, one forward):
    ``keys`` [T, 128] (indexer compressor entries after norm + rope, not rotated), ``scores``
    [S, T] (future entries -inf), ``topk`` [S, k] (-1 where fewer than k entries are visible).
    ``topk`` overrides ``index_topk`` (SGLang's backend only runs 512 / 1024, so short sequences
    never exercise the selection there; a small ``topk`` exercises it here). ``fp8``: SGLang's
    Hadamard + e4m3 rounding of q and k."""
    M = _modeling()
    comp = _attn(model, layer).compressor
    if not isinstance(comp, M.DeepseekV4CSACompressor):
        raise ValueError(f"layer {layer} is not a C4 (CSA) layer")
    idx = comp.indexer
    seen: dict[str, torch.Tensor] = {}
    original = idx.scorer.forward

    def scorer(q, compressed_kv, hidden_states):
        seen["keys"] = compressed_kv[0]
        scores = (_scorer_fp8.__get__(idx.scorer) if fp8 else original)(q, compressed_kv, hidden_states)
        seen["raw"] = scores[0]
        return scores

    saved_topk = idx.index_topk
    try:
        idx.scorer.forward = scorer
        if topk is not None:
            idx.index_topk = topk
        s = hidden.shape[0]
        picks = idx(hidden.unsqueeze(0), q_residual.unsqueeze(0), torch.arange(s).view(1, -1), None, layer)
    finally:
        del idx.scorer.forward
        idx.index_topk = saved_topk
    keys = seen.get("keys", hidden.new_zeros(0, idx.head_dim))
    t = keys.shape[0]
    visible = torch.arange(t).view(1, -1) < ((torch.arange(s) + 1) // idx.compress_rate).view(-1, 1)
    scores = seen["raw"].masked_fill(~visible, float("-inf")) if t else hidden.new_zeros(s, 0).float()
    return {"keys": keys, "scores": scores, "topk": picks[0]}


@torch.no_grad()
def hyper_connection(model, layer: int, which: str, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(post [S, hc], comb [S, hc, hc], collapsed [S, D])`` of layer ``layer``'s ``"attn"`` or
    ``"ffn"`` hyper-connection on ``streams`` [S, hc, D] (Sinkhorn in fp32, ``hc_sinkhorn_iters``)."""
    hc = getattr(model.model.layers[layer], f"{which}_hc")
    post, comb, collapsed = hc(streams.unsqueeze(0))
    return post[0], comb[0], collapsed[0]


@torch.no_grad()
def hc_head(model, streams: torch.Tensor) -> torch.Tensor:
    """The final stream collapse [S, D] (before ``norm``) of ``streams`` [S, hc, D]."""
    return model.model.hc_head(streams.unsqueeze(0))[0]


@torch.no_grad()
def route(model, layer: int, hidden: torch.Tensor, input_ids: torch.Tensor | None = None):
    """``(weights [S, k], experts [S, k])`` of layer ``layer``'s router on ``hidden`` [S, D]
    (hash layers read ``input_ids``): sqrtsoftplus scores, the bias only for choosing, renormalised
    and times ``routed_scaling_factor``."""
    mlp = model.model.layers[layer].mlp
    if mlp.is_hash:
        _, weights, idx = mlp.gate(hidden, input_ids)
    else:
        _, weights, idx = mlp.gate(hidden)
    return weights, idx


@torch.no_grad()
def experts(model, layer: int, hidden: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, *,
            clamp: bool = True) -> torch.Tensor:
    """Routed-expert output [S, D] (no shared expert) of ``hidden`` [S, D] for the given picks."""
    ex = model.model.layers[layer].mlp.experts
    limit = ex.limit
    try:
        ex.limit = limit if clamp else float("inf")
        return ex(hidden, idx, weights)
    finally:
        ex.limit = limit


@torch.no_grad()
def clamp_hits(model, input_ids: Sequence[int] | torch.Tensor) -> dict[int, float]:
    """Per layer, the fraction of routed (token, pick, channel) SwiGLU pre-activations the clamp
    changes (gate > limit or |up| > limit) in one forward."""
    hits: dict[int, list[float]] = {}
    patched = []
    for i, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts

        def apply_gate(gate_up, *, _i=i, _orig=ex._apply_gate, _limit=ex.limit):
            gate, up = gate_up.chunk(2, dim=-1)
            changed = (gate > _limit) | (up.abs() > _limit)
            acc = hits.setdefault(_i, [0.0, 0.0])
            acc[0] += changed.float().sum().item()
            acc[1] += changed.numel()
            return _orig(gate_up)

        ex._apply_gate = apply_gate
        patched.append(ex)
    try:
        ids = torch.as_tensor(list(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids)
        model(input_ids=ids.view(1, -1), use_cache=False)
    finally:
        for ex in patched:
            del ex._apply_gate
    return {i: n / max(total, 1.0) for i, (n, total) in sorted(hits.items())}


@torch.no_grad()
def route_margins(model, input_ids: Sequence[int] | torch.Tensor, *, fp8: bool = True) -> torch.Tensor:
    """Per position, the smallest gap over the top-k (non-hash) layers between the k-th and the
    (k+1)-th expert's selection score (sqrtsoftplus + bias). Where it is small, a rounding anywhere
    upstream can swap an expert and move the logits by whole units: whole-model comparisons mask
    those positions instead of widening their tolerance."""
    M = _modeling()
    gaps: list[torch.Tensor] = []
    handles = []

    def hook(router, _args, output):
        logits = output[0].float()
        chosen = (router.score_fn(logits) + router.e_score_correction_bias.float()).sort(-1, descending=True).values
        gaps.append(chosen[:, router.top_k - 1] - chosen[:, router.top_k])

    for layer in model.model.layers:
        if isinstance(layer.mlp.gate, M.DeepseekV4TopKRouter):
            handles.append(layer.mlp.gate.register_forward_hook(hook))
    ids = torch.as_tensor(list(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids)
    try:
        with fp8_kv_emulation(model) if fp8 else contextlib.nullcontext():
            model(input_ids=ids.view(1, -1), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if not gaps:
        return torch.full((ids.numel(),), float("inf"))
    return torch.stack(gaps).amin(0)
