"""A tiny DeepSeek-V4 checkpoint made here from a seed (devkit only: tests, the CPU engine kit, references).

``make_checkpoint(out)`` writes a Hugging Face folder that both SGLang 0.5.23's
``DeepseekV4ForCausalLM.load_weights`` and transformers 5.19's ``DeepseekV4ForCausalLM`` load with
no missing and no unexpected tensor:

* ``config.json``: SGLang's flat V4 schema (the one DeepSeek ships; SGLang reads it through its
  ``_DeepseekV4ConfigAlias`` of ``DeepseekV3Config``). :func:`transformers_config` turns it into the
  ``DeepseekV4Config`` transformers wants (``compress_ratios`` -> ``layer_types``,
  ``num_hash_layers`` -> ``mlp_layer_types``, ``rope_scaling`` -> ``rope_parameters["compress"]``).
* ``model.safetensors``: the DeepSeek checkpoint names (``layers.1.attn.compressor.wkv.weight``,
  ``layers.0.ffn.gate.tid2eid``, ``hc_head_fn`` ...), the names SGLang's
  ``remap_weight_name_to_dpsk_hf_format`` maps and transformers' ``conversion_mapping["deepseek_v4"]``
  renames. No ``quantization_config``: every matrix is bf16, so ``wo_a`` stays bf16 and no fp8
  GEMM runs.
* the engine kit's byte-level BPE tokenizer (:func:`devkit.engine_kit.model._tokenizer`, same seed).

Invariants (checked by ``tests/upstream/test_dsv4_checkpoint.py``):

* same arguments, same bytes: each tensor is drawn from its own generator seeded by
  ``(seed, crc32(name))``, so neither the order nor the number of tensors changes another's values;
* the weights are scaled so the model is a usable oracle (see :data:`SCALES`): the greedy token is
  separated from the runner-up by a clear logit margin for most positions, and the SwiGLU
  pre-activations of the experts cross DeepSeek-V4's clamp (``swiglu_limit`` = 10) for some tokens,
  so a path that drops the clamp (SGLang's ``moe_forward_native``) shows in the logits.

``model_type="deepseek_v41"`` writes the V4.1 text flavour: SGLang's ``DeepseekV41Config`` then sets
``hc_pre_from_prev_sublayer=True`` and ``q_head_norm=False`` (a different forward), and the model has
no ``hc_head_*`` tensors. transformers 5.19 has no V4.1, so the reference forward covers V4 only.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MODEL_TYPES = ("deepseek_v4", "deepseek_v41")
STAMP = "dsv41_checkpoint_spec.json"
WEIGHTS = "model.safetensors"

# Standard deviations of the seeded weights, as a multiple of 1/sqrt(fan_in) for matrices
# ("gain") or absolute for vectors. Chosen (see /work/notes/15-checkpoint.md) so that
#  * the lm head gives logits with a standard deviation of ~8: top-1 vs top-2 margins mostly > 0.5;
#  * expert gate/up pre-activations have a std of ~5, so |x| > 10 (the clamp) for a few per cent;
#  * attention scores and compressor gates are O(1): softmaxes are neither flat nor one-hot.
SCALES: dict[str, float] = {
    "head": 8.0,  # gain of lm head
    "embed": 1.0,  # absolute std of the embedding
    "expert_in": 3.5,  # gain of w1 / w3 (routed and shared)
    "expert_out": 0.3,  # gain of w2
    "attn": 1.0,  # gain of wq_a, wq_b, wkv, wo_a, wo_b, indexer wq_b, weights_proj
    "compressor": 1.0,  # gain of the compressor / indexer-compressor wkv and wgate
    "ape": 0.5,  # absolute std of the compressor position bias
    "router": 6.0,  # gain of the gate weight
    "hc_fn": 1.0,  # gain of the hyper-connection projections
    "hc_base": 0.5,  # absolute std of their bias
    "sink": 1.0,  # absolute std of the attention sinks
    "norm": 0.1,  # norm weights are 1 + N(0, norm)
}


def tiny_config(*, model_type: str = "deepseek_v4", num_layers: int = 3,
                compress_ratios: Sequence[int] = (0, 4, 128), num_hash_layers: int = 1,
                vocab: int = 1024, special_ids: Mapping[str, int] | None = None,
                overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """SGLang's config.json for the smallest DeepSeek-V4 that builds.

    ``compress_ratios`` is the pattern of the first layers and repeats for deeper models
    (``num_layers=6`` with ``(0, 4, 128)`` gives ``[0, 4, 128, 0, 4, 128]``).
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is invalid: expected one of {MODEL_TYPES}")
    if num_layers < 1 or not compress_ratios or any(r not in (0, 4, 128) for r in compress_ratios):
        raise ValueError(f"num_layers={num_layers}, compress_ratios={tuple(compress_ratios)} are invalid: "
                         "expected num_layers >= 1 and ratios from {0, 4, 128}")
    if not 0 <= num_hash_layers <= num_layers:
        raise ValueError(f"num_hash_layers={num_hash_layers} is invalid: expected 0..{num_layers}")
    ratios = [compress_ratios[i % len(compress_ratios)] for i in range(num_layers)]
    config: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": 256,
        "num_hidden_layers": num_layers,
        "compress_ratios": ratios,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 512,  # 448 nope + 64 rope: the V4 cache layout asserts 584 B/token
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 448,
        "v_head_dim": 512,
        "q_lora_rank": 128,
        "o_lora_rank": 128,
        "o_groups": 2,
        "index_n_heads": 4,
        "index_head_dim": 128,
        "index_topk": 512,  # SGLang's backend asserts 512 or 1024
        "window_size": 128,
        "sliding_window": 128,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "intermediate_size": 256,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "swiglu_limit": 10.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "num_hash_layers": num_hash_layers,
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 16384,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1},
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "num_nextn_predict_layers": 0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    config.update(dict(special_ids or {}))
    config.update(dict(overrides or {}))
    return config


def transformers_config(config: Mapping[str, Any]):
    """transformers 5.19's ``DeepseekV4Config`` for the same weights (V4 only: no V4.1 in transformers)."""
    from transformers import DeepseekV4Config

    if config["model_type"] != "deepseek_v4":
        raise ValueError(f"model_type={config['model_type']!r}: transformers 5.19 implements deepseek_v4 only")
    n = config["num_hidden_layers"]
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    scaling = dict(config.get("rope_scaling") or {})
    compress_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config["compress_rope_theta"],
                                     "partial_rotary_factor": config["qk_rope_head_dim"] / config["head_dim"]}
    if scaling:
        compress_rope.update(rope_type="yarn", factor=scaling["factor"],
                             original_max_position_embeddings=scaling["original_max_position_embeddings"],
                             beta_fast=scaling.get("beta_fast", 32), beta_slow=scaling.get("beta_slow", 1),
                             attention_factor=1.0)
    main_rope = {"rope_type": "default", "rope_theta": config["rope_theta"],
                 "partial_rotary_factor": config["qk_rope_head_dim"] / config["head_dim"]}
    return DeepseekV4Config(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        moe_intermediate_size=config["moe_intermediate_size"], num_hidden_layers=n,
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], q_lora_rank=config["q_lora_rank"],
        num_experts_per_tok=config["num_experts_per_tok"], n_routed_experts=config["n_routed_experts"],
        n_shared_experts=config["n_shared_experts"], scoring_func=config["scoring_func"],
        norm_topk_prob=config["norm_topk_prob"], routed_scaling_factor=config["routed_scaling_factor"],
        max_position_embeddings=config["max_position_embeddings"], rope_theta=config["rope_theta"],
        compress_rope_theta=config["compress_rope_theta"],
        layer_types=[kinds[r] for r in config["compress_ratios"]],
        mlp_layer_types=["hash_moe" if i < config["num_hash_layers"] else "moe" for i in range(n)],
        hc_mult=config["hc_mult"], hc_sinkhorn_iters=config["hc_sinkhorn_iters"], hc_eps=config["hc_eps"],
        swiglu_limit=config["swiglu_limit"], sliding_window=config["sliding_window"],
        o_groups=config["o_groups"], o_lora_rank=config["o_lora_rank"], index_n_heads=config["index_n_heads"],
        index_head_dim=config["index_head_dim"], index_topk=config["index_topk"],
        num_nextn_predict_layers=config["num_nextn_predict_layers"], rms_norm_eps=config["rms_norm_eps"],
        bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"),
        pad_token_id=config.get("pad_token_id"), tie_word_embeddings=False,
        rope_parameters={"main": main_rope, "compress": compress_rope},
    )


def tensor_specs(config: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str, str, float]]:
    """Every checkpoint tensor: ``name -> (shape, dtype, kind, std)`` under DeepSeek's names.

    ``kind``: ``normal`` (N(0, std)), ``norm`` (1 + N(0, std)), ``tid2eid`` (distinct experts per token).
    """
    D, V, H = config["hidden_size"], config["vocab_size"], config["num_attention_heads"]
    hd = config["head_dim"]
    ql, og, ol = config["q_lora_rank"], config["o_groups"], config["o_lora_rank"]
    ih, ihd = config["index_n_heads"], config["index_head_dim"]
    E, inter, k = config["n_routed_experts"], config["moe_intermediate_size"], config["num_experts_per_tok"]
    hc = config["hc_mult"]
    mix = (2 + hc) * hc
    s = SCALES

    def mat(rows: int, cols: int, gain: float) -> tuple[tuple[int, ...], str, str, float]:
        return (rows, cols), "bfloat16", "normal", gain / cols ** 0.5

    def norm(n: int) -> tuple[tuple[int, ...], str, str, float]:
        return (n,), "bfloat16", "norm", s["norm"]

    specs: dict[str, tuple[tuple[int, ...], str, str, float]] = {
        "embed.weight": ((V, D), "bfloat16", "normal", s["embed"]),
        "head.weight": mat(V, D, s["head"]),
        "norm.weight": norm(D),
    }
    if config["model_type"] == "deepseek_v4":  # V4.1 (hc_pre_from_prev_sublayer) has no hc head
        specs.update({
            "hc_head_fn": ((hc, hc * D), "float32", "normal", s["hc_fn"] / (hc * D) ** 0.5),
            "hc_head_base": ((hc,), "float32", "normal", s["hc_base"]),
            "hc_head_scale": ((1,), "float32", "norm", s["norm"]),
        })
    for i, ratio in enumerate(config["compress_ratios"]):
        p = f"layers.{i}."
        for sub in ("attn", "ffn"):
            specs[f"{p}hc_{sub}_fn"] = ((mix, hc * D), "float32", "normal", s["hc_fn"] / (hc * D) ** 0.5)
            specs[f"{p}hc_{sub}_base"] = ((mix,), "float32", "normal", s["hc_base"])
            specs[f"{p}hc_{sub}_scale"] = ((3,), "float32", "norm", s["norm"])
        specs[f"{p}attn_norm.weight"] = norm(D)
        specs[f"{p}ffn_norm.weight"] = norm(D)
        a = f"{p}attn."
        specs.update({
            f"{a}wq_a.weight": mat(ql, D, s["attn"]),
            f"{a}q_norm.weight": norm(ql),
            f"{a}wq_b.weight": mat(H * hd, ql, s["attn"]),
            f"{a}wkv.weight": mat(hd, D, s["attn"]),
            f"{a}kv_norm.weight": norm(hd),
            f"{a}wo_a.weight": mat(og * ol, H * hd // og, s["attn"]),
            f"{a}wo_b.weight": mat(D, og * ol, s["attn"]),
            f"{a}attn_sink": ((H,), "float32", "normal", s["sink"]),
        })
        if ratio:
            coff = 2 if ratio == 4 else 1  # C4 keeps two overlapping series (Ca, Cb)
            c = f"{a}compressor."
            specs.update({
                f"{c}wkv.weight": mat(coff * hd, D, s["compressor"]),
                f"{c}wgate.weight": mat(coff * hd, D, s["compressor"]),
                f"{c}ape": ((ratio, coff * hd), "float32", "normal", s["ape"]),
                f"{c}norm.weight": norm(hd),
            })
        if ratio == 4:
            x = f"{a}indexer."
            specs.update({
                f"{x}wq_b.weight": mat(ih * ihd, ql, s["attn"]),
                f"{x}weights_proj.weight": mat(ih, D, s["attn"]),
                f"{x}compressor.wkv.weight": mat(2 * ihd, D, s["compressor"]),
                f"{x}compressor.wgate.weight": mat(2 * ihd, D, s["compressor"]),
                f"{x}compressor.ape": ((ratio, 2 * ihd), "float32", "normal", s["ape"]),
                f"{x}compressor.norm.weight": norm(ihd),
            })
        f = f"{p}ffn."
        specs[f"{f}gate.weight"] = mat(E, D, s["router"])
        if i < config["num_hash_layers"]:
            specs[f"{f}gate.tid2eid"] = ((V, k), "int32", "tid2eid", 0.0)
        else:
            specs[f"{f}gate.bias"] = ((E,), "float32", "normal", 0.1)
        experts = [f"{f}experts.{e}." for e in range(E)] + [f"{f}shared_experts."]
        for ex in experts:
            specs[f"{ex}w1.weight"] = mat(inter, D, s["expert_in"])
            specs[f"{ex}w3.weight"] = mat(inter, D, s["expert_in"])
            specs[f"{ex}w2.weight"] = mat(D, inter, s["expert_out"])
    return specs


def _draw(name: str, spec: tuple[tuple[int, ...], str, str, float], seed: int, num_experts: int):
    import torch

    shape, dtype, kind, std = spec
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if kind == "tid2eid":
        rows, k = shape
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(rows)])
        return ids.to(torch.int32)
    x = torch.randn(shape, generator=g, dtype=torch.float32) * std
    if kind == "norm":
        x = x + 1.0
    return x.to(getattr(torch, dtype))


def make_weights(config: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """The seeded tensors of :func:`tensor_specs` (name -> torch tensor)."""
    return {name: _draw(name, spec, seed, config["n_routed_experts"])
            for name, spec in tensor_specs(config).items()}


def _digest(spec: Mapping[str, Any]) -> str:
    blob = json.dumps({"spec": spec, "scales": SCALES}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def make_checkpoint(out_dir: str | Path, *, model_type: str = "deepseek_v4", num_layers: int = 3,
                    compress_ratios: Sequence[int] = (0, 4, 128), seed: int = 0, num_hash_layers: int = 1,
                    overrides: Mapping[str, Any] | None = None) -> Path:
    """Write (or reuse, when its stamp matches) the checkpoint folder ``out_dir``; returns its path."""
    spec = {"model_type": model_type, "num_layers": num_layers, "compress_ratios": list(compress_ratios),
            "seed": seed, "num_hash_layers": num_hash_layers, "overrides": dict(overrides or {})}
    vocab = int((overrides or {}).get("vocab_size", 1024))

    def config_for(ids: Mapping[str, int]) -> dict[str, Any]:
        return tiny_config(model_type=model_type, num_layers=num_layers, compress_ratios=compress_ratios,
                           num_hash_layers=num_hash_layers, vocab=vocab, special_ids=ids, overrides=overrides)

    return write_folder(out_dir, spec, config_for, lambda config: make_weights(config, seed), seed=seed, vocab=vocab)


def write_folder(out_dir: str | Path, spec: Mapping[str, Any], config_for: Any, weights_for: Any, *,
                 seed: int = 0, vocab: int = 1024) -> Path:
    """Write (or reuse, when its stamp's digest of ``spec`` matches) a kit checkpoint folder: the kit's
    tokenizer, ``config_for(special_ids)`` as config.json, ``weights_for(config)`` as the safetensors,
    then the stamp. Shared by this kit and :mod:`devkit.engine_kit.dsv41.checkpoint`."""
    from safetensors.torch import save_file

    from devkit.engine_kit import model as kit_model

    out = Path(out_dir)
    stamp = out / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("digest") == _digest(spec):
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = kit_model._tokenizer(kit_model.ModelSpec(seed=seed, vocab=vocab))
    tokenizer.save_pretrained(out)
    ids = {key: tokenizer.convert_tokens_to_ids(tok)
           for key, tok in (("bos_token_id", "<|bos|>"), ("eos_token_id", "<|eos|>"), ("pad_token_id", "<|pad|>"))}
    config = config_for(ids)
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    save_file(weights_for(config), str(out / WEIGHTS), metadata={"format": "pt"})
    stamp.write_text(json.dumps({"digest": _digest(spec), "spec": spec}, indent=1) + "\n")
    return out


def load_config(path: str | Path) -> dict[str, Any]:
    """The config.json of a checkpoint folder."""
    return json.loads((Path(path) / "config.json").read_text())


def sglang_unloaded_parameters(path: str | Path, port: int = 29611) -> dict[str, Any]:
    """Build SGLang's ``DeepseekV4ForCausalLM`` for ``path`` on CPU in this process, fill every
    parameter with NaN (-1 for integers), run ``load_weights`` on the safetensors, and report
    ``{"model_type", "parameters", "unfilled": [...], "unexpected": [...]}`` (unexpected = checkpoint
    names the loader warned it could not place).

    Publishes SGLang's process-wide config and a gloo group of one: run it in a fresh process
    (``python -c``), never inside a test session. The rope wrapper is replaced with a placeholder
    (``get_rope_cpu`` refuses the unscaled rope of SWA layers; the rope object holds no parameter).
    """
    import logging
    import os

    import torch
    from safetensors.torch import load_file

    os.environ.setdefault("SGLANG_OPT_USE_TILELANG_MHC_PRE", "0")  # no MHC prewarm at load
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = ServerArgs(model_path=str(path), device="cpu", attention_backend="dsv4", dtype="bfloat16",
                      page_size=256, disable_cuda_graph=True, dsa_topk_backend="torch")
    set_global_server_args_for_scheduler(args)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(backend="gloo")
    from sglang.srt.models import deepseek_v4

    deepseek_v4.get_rope_wrapper = lambda **_kw: torch.nn.Identity()
    hf_config = ModelConfig.from_server_args(args).hf_config
    torch.set_default_dtype(torch.bfloat16)
    model = deepseek_v4.DeepseekV4ForCausalLM(hf_config, quant_config=None)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan") if param.is_floating_point() else -1)
    warned: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "not found in params_dict" in record.getMessage():
                warned.append(record.getMessage().split(" not found")[0])

    logging.getLogger(deepseek_v4.__name__).addHandler(Keep())
    weights = load_file(str(Path(path) / WEIGHTS))
    model.load_weights(iter(sorted(weights.items())))
    unfilled = sorted(name for name, p in model.named_parameters()
                      if (p.isnan().any() if p.is_floating_point() else (p < 0).any()).item())
    return {"model_type": hf_config.model_type, "parameters": sum(1 for _ in model.parameters()),
            "unfilled": unfilled, "unexpected": warned}
