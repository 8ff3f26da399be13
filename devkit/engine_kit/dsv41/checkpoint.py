"""A tiny seeded DeepSeek-V4.1 checkpoint with ratio-1/2 KV-source layers (devkit only).

Built on :mod:`devkit.engine_kit.dsv4.checkpoint` (same seeding rule: one generator per tensor,
seeded by ``(seed, crc32(name))``; same :data:`SCALES`; same tokenizer). Layers of ratio 0/4/128
get exactly the DSV4 kit's tensors. Ratio-1/2 layers get what SGLang 0.5.23's V4.1 modules own
(``srt/layers/attention/dsv4/dsv41_sparse.py``):

* a kv_source layer: ``attn.compressor.wkv.weight`` ``[head_dim, hidden]``, for ratio 2 also
  ``attn.compressor.wgate.weight`` (no ``ape``), ``attn.compressor.norm.weight`` ``[head_dim]``;
* an index-source layer: ``attn.indexer.wq_b.weight``, ``attn.indexer.weights_proj.weight``, and when
  it is also a kv_source ``attn.indexer.wk.weight`` ``[index_head_dim, head_dim]`` +
  ``attn.indexer.k_norm.weight``;
* a ratio-1/2 layer that is neither: only the common attention tensors (it reads its source).

``make_checkpoint(out, ratios=...)`` writes config.json (the V4.1 flat schema of
:func:`devkit.engine_kit.dsv41.launch.tiny_v41_config`), model.safetensors and the tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from devkit.engine_kit.dsv4 import checkpoint as base


def tensor_specs(config: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str, str, float]]:
    ratios = list(config["compress_ratios"])
    plain = dict(config, compress_ratios=[r if r in (0, 4, 128) else 0 for r in ratios])
    specs = base.tensor_specs(plain)
    D, hd = config["hidden_size"], config["head_dim"]
    ql, ih, ihd = config["q_lora_rank"], config["index_n_heads"], config["index_head_dim"]
    s = base.SCALES

    def mat(rows: int, cols: int, gain: float):
        return (rows, cols), "bfloat16", "normal", gain / cols ** 0.5

    def norm(n: int):
        return (n,), "bfloat16", "norm", s["norm"]

    kv_sources = set(config.get("kv_source_layer_ids") or ())
    index_sources = set(config.get("index_source_layer_ids") or ())
    for i, ratio in enumerate(ratios):
        if ratio not in (1, 2):
            continue
        a = f"layers.{i}.attn."
        if i in kv_sources:
            specs[f"{a}compressor.wkv.weight"] = mat(hd, D, s["compressor"])
            if ratio == 2:
                specs[f"{a}compressor.wgate.weight"] = mat(hd, D, s["compressor"])
            specs[f"{a}compressor.norm.weight"] = norm(hd)
        if i in index_sources:
            specs[f"{a}indexer.wq_b.weight"] = mat(ih * ihd, ql, s["attn"])
            specs[f"{a}indexer.weights_proj.weight"] = mat(ih, D, s["attn"])
            if i in kv_sources:
                specs[f"{a}indexer.wk.weight"] = mat(ihd, hd, s["compressor"])
                specs[f"{a}indexer.k_norm.weight"] = norm(ihd)
    return specs


def make_weights(config: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    return {name: base._draw(name, spec, seed, config["n_routed_experts"])
            for name, spec in tensor_specs(config).items()}


def make_checkpoint(out_dir: str | Path, *, seed: int = 0, **config_kwargs: Any) -> Path:
    """Write (or reuse, when the stamp matches) a V4.1 checkpoint folder; ``config_kwargs`` go to
    :func:`devkit.engine_kit.dsv41.launch.tiny_v41_config` (``ratios``, ``kv_sources`` ...)."""
    from devkit.engine_kit.dsv41.launch import tiny_v41_config

    spec = {"model_type": "deepseek_v41", "seed": seed, **config_kwargs}
    return base.write_folder(out_dir, spec, lambda ids: tiny_v41_config(special_ids=ids, **config_kwargs),
                             lambda config: make_weights(config, seed), seed=seed)
