"""What ``python -m adapter check`` predicts cone replay will log once the cache is built.

The facts a built cache would give :func:`.decision.decide` are predicted from the model's
``config.json`` and the launch line, including what SGLang resolves on its own (the DeepSeek-V4 KV
layout, decoder SWA bounded replay); the decision itself is the switch's (:mod:`.decision`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapter.core import api
from adapter.switches.cone_replay import decision, geometry

DSV4_PAGE = 256  # SGLang's DeepSeek-V4 overrides force it (arg_groups/model_overrides/deepseek_v4.py)


def dsv4_kv_layout(environ: Mapping[str, str], server_args: Any) -> tuple[str, bool]:
    """(main-cache layout, uniform fp8) a DeepSeek-V4 pool gets on this machine, as SGLang's
    ``select_dsv4_kv_layout`` picks it: ``SGLANG_DSV4_KV_LAYOUT`` (auto: V4.1 only on SM100/SM103),
    the trtllm backend's uniform fp8 pool (``--dsv4-attn-backend trtllm``)."""
    backend = getattr(server_args, "dsv4_attn_backend", None)
    if backend == "trtllm":
        return "v4", True
    mode = environ.get("SGLANG_DSV4_KV_LAYOUT", "auto").lower()
    if backend == "flashmla_mega" and mode != "v41_new":
        mode = "v41"
    if mode in ("v4", "v41", "v41_new"):
        return mode, False
    try:
        import torch

        sm100 = torch.cuda.is_available() and torch.version.cuda is not None and torch.cuda.get_device_capability()[0] == 10
    except Exception:  # no torch CUDA here: the CPU / non-SM100 answer
        sm100 = False
    return ("v41" if sm100 else "v4"), False


def decoder_replay(model: api.ModelFacts, argv: tuple[str, ...]) -> tuple[bool, str]:
    """Whether SGLang's decoder SWA bounded replay will run, as ``validate_deepseek_v41_features``
    resolves it: the flag when set, else on for DeepSeek-V4.1 on CUDA / HIP unless every hidden
    state is returned (the CP, DP-attention and prefill-graph exclusions are not predicted here)."""
    flags = set(argv)
    if "--enable-decoder-swa-bounded-replay" in flags:
        return True, "on (--enable-decoder-swa-bounded-replay)"
    if "--no-enable-decoder-swa-bounded-replay" in flags:
        return False, "off (--no-enable-decoder-swa-bounded-replay)"
    if model.model_type != "deepseek_v41":
        return False, f"off (model_type {model.model_type or '?'}: V4.1 only)"
    if "--enable-return-hidden-states" in flags:
        return False, "off (auto: --enable-return-hidden-states)"
    try:
        import torch

        gpu = torch.cuda.is_available()
    except Exception:  # no torch here: no GPU to resolve it on
        gpu = False
    return (True, "on (auto: V4.1 on CUDA/HIP)") if gpu else (False, "off (auto: no CUDA/HIP on this machine)")


def predict(profile: api.Profile) -> api.Prediction:
    """The line the switch logs at cache build (the switch's own :func:`.decision.decide`)."""
    if profile.status != "armed":
        return api.Prediction()
    model = profile.model
    if model is None:
        return api.Prediction("not decided (no model config.json to predict the cache from)")
    if model.pool == "none":
        return api.Prediction("not decided (the model has no sliding-window layers: no SWA cache is built, the "
                              "switch never acts)")
    tokens = int(profile.values[decision.TOKENS_KEY])
    dsv4 = model.pool == geometry.DSV4_POOL
    page = DSV4_PAGE if dsv4 else int(getattr(profile.server_args, "page_size", None) or 1)
    flags = set(profile.argv)
    facts: dict[str, Any] = {"pool": model.pool, "window": int(model.window or 0), "page": page,
                             "swa_layers": int(model.swa_layers or 0), "N": tokens}
    layout, uniform_fp8, decoder = "", False, False
    if dsv4:
        layout, uniform_fp8 = dsv4_kv_layout(profile.environ, profile.server_args)
        decoder, facts["decoder_replay"] = decoder_replay(model, profile.argv)
        facts["kv_layout"] = "uniform_fp8" if uniform_fp8 else layout
    encoder_replay = dsv4 and "--enable-encoder-swa-bounded-replay" in flags  # the tree keeps no SWA component
    kv_dtype = str(getattr(profile.server_args, "kv_cache_dtype", "auto") or "auto")
    decided = decision.decide(decision.CacheFacts(
        tokens=tokens,
        pool=model.pool,
        radix_disabled="--disable-radix-cache" in flags,
        swa_tree=not encoder_replay,
        request_window=encoder_replay,
        window=int(model.window or 0),
        page=page,
        swa_layers=model.swa_layers,
        unified_kv=profile.environ.get("SGLANG_HACK_FLASHMLA_BACKEND") == "unified_kv_triton",
        kv_layout="uniform_fp8" if uniform_fp8 else layout,
        decoder_replay=decoder,
        kv_sources=model.kv_sources,
        compress_ratios=model.compress_ratios,
        full_kv_unsupported=None if dsv4 or kv_dtype == "auto" else
        f"the Full KV cache is quantized ({kv_dtype}); the replay rows' K/V cannot be read back exactly",
        standin=bool(profile.values.get(decision.STANDIN_KEY)),
    ))
    if decided.bound:
        facts["bound"] = decided.bound
    notes: tuple[str, ...] = ()
    if decided.refusal is None and "--enable-hierarchical-cache" in flags:
        facts["host_full_kv"] = host = host_full_kv(profile)
        notes = (("beside HiCache, a resume point whose Full KV sits on host while its window is gone is "
                  "loaded back (Full KV only) and replayed from page_floor(F - N)") if host == "load_back" else
                 ("beside HiCache on the Rust tree core, a resume point whose Full KV sits on host runs stock "
                  "(fallback load_back_rust_core); DSV41_SWA_THIN=1 selects the Python tree core"),)
    return api.Prediction(decided.receipt, facts, notes=notes)


def host_full_kv(profile: api.Profile) -> str:
    """The installed line's ``host_full_kv`` beside HiCache: ``load_back`` on the Python tree core
    (chosen by ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``, by SWA thin, or by the session radix
    cache), else ``stock_rust_core`` (the engine's default core; its platform fallbacks are not predicted)."""
    core = profile.environ.get("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "").strip().lower()
    python = core == "python" or (not core and (bool(profile.values.get("DSV41_SWA_THIN"))
                                                or "--enable-session-radix-cache" in profile.argv))
    return "load_back" if python else "stock_rust_core"
