"""Boot SGLang 0.5.23's real HTTP server on CPU with a tiny DeepSeek-V4 model (devkit only).

``server_args(model, port)`` is the launch line: ``--attention-backend dsv4``, 256-token pages, the
fp8 KV the DSV4 overrides force, chunked prefill, ``--dsa-topk-backend torch``, no CUDA graph,
bf16, and an SWA pool sized so it cannot starve (see :func:`swa_ratio_for`). ``child_env(...)`` is
the server's environment: the CPU engine keys of :mod:`devkit.engine_kit.launcher`, the SGLang
switches that select torch paths SGLang already ships, ``SGL_STUB_DSV4=1`` (the ``sgl_kernel``
stand-in then applies the DSV4 routes of :mod:`.routes`), and ``PYTHONPATH`` = this kit's stub
folder (the ``flash_mla`` stand-in) + the ``sgl_kernel`` stand-in + the repo root.

``server(model, log)`` returns a :class:`devkit.engine_kit.launcher.Server` with both.

Starvation: with SGLang's default ``--swa-full-tokens-ratio 0.1`` a 8192-token pool gets 3 SWA
pages, and a request that hits the radix cache was never admitted (it sat in the queue with no
error). :func:`check_pages` refuses such a geometry before boot, naming the numbers.

``write_dummy_model(out)`` writes a config + tokenizer folder for ``--load-format dummy`` (the
checkpoint maker in :mod:`.checkpoint` writes real weights when it exists).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

PAGE = 256  # forced by the DSV4 overrides; the backend asserts it
STUB_PATH = Path(__file__).resolve().parent / "stub"

# SGLang switches that select torch paths SGLang ships (see the CPU engine map).
TORCH_PATH_ENV = {
    "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",  # indexer metadata + logits without DeepGEMM
    "SGLANG_OPT_USE_TILELANG_MHC_PRE": "0",  # hyper-connections in torch
    "SGLANG_OPT_USE_TILELANG_MHC_POST": "0",
    "SGLANG_OPT_DEEPGEMM_HC_PRENORM": "0",
    "SGLANG_OPT_FUSE_MHC_POST_PRE": "0",
    "SGLANG_OPT_USE_FUSED_HASH_TOPK": "0",  # HashTopK._forward_torch
    "SGL_STUB_DSV4": "1",  # the sgl_kernel stand-in applies the DSV4 routes
    # a failed scheduler exits at once (no py-spy, no 60 s wait for CUDA coredumps)
    "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
}

def write_dummy_model(out: str | Path, overrides: Mapping[str, object] | None = None) -> Path:
    """A model folder (config.json + the kit's tokenizer) for ``--load-format dummy``."""
    from devkit.engine_kit import model as mellum

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = mellum._tokenizer(mellum.ModelSpec())
    tokenizer.save_pretrained(out)
    from devkit.engine_kit.dsv4.checkpoint import tiny_config  # the one config of the kit's model

    ids = {name: tokenizer.convert_tokens_to_ids(tok)
           for name, tok in (("bos_token_id", "<|bos|>"), ("eos_token_id", "<|eos|>"), ("pad_token_id", "<|pad|>"))}
    config = tiny_config(special_ids=ids, overrides=overrides)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


class PoolTooSmall(ValueError):
    """The SWA pool of a geometry cannot hold what the scheduler needs; refused before boot."""


def swa_pages_needed(max_running: int, chunk: int, window: int = 128) -> int:
    """SWA pages the scheduler can hold at once: per running request the window (plus one page for
    the token in flight), plus one chunk of prefill, plus one spare page."""
    per_request = math.ceil(window / PAGE) + 1
    return max_running * per_request + math.ceil(chunk / PAGE) + 1


def swa_ratio_for(max_total_tokens: int, max_running: int, chunk: int, window: int = 128) -> float:
    """The smallest ``--swa-full-tokens-ratio`` whose SWA pool holds :func:`swa_pages_needed`."""
    need = swa_pages_needed(max_running, chunk, window) * PAGE
    return min(1.0, math.ceil(need / max_total_tokens * 100) / 100)


def check_pages(max_total_tokens: int, swa_ratio: float, max_running: int, chunk: int, window: int = 128) -> int:
    """SWA pages of the geometry; raises :class:`PoolTooSmall` naming the numbers when too few."""
    pages = int(max_total_tokens * swa_ratio) // PAGE
    need = swa_pages_needed(max_running, chunk, window)
    if pages < need:
        raise PoolTooSmall(
            f"SWA pool of {pages} pages (max_total_tokens={max_total_tokens} x swa_ratio={swa_ratio}) is too small: "
            f"{max_running} running requests x window {window} + a {chunk}-token chunk need {need} pages of {PAGE} "
            f"tokens; a request that hits the radix cache would wait in the queue forever. Use swa_ratio >= "
            f"{swa_ratio_for(max_total_tokens, max_running, chunk, window)}")
    return pages


def server_args(model: str | Path, port: int, *, max_total_tokens: int = 8192, chunk: int = 256,
                max_running: int = 4, swa_ratio: float | None = None, seed: int = 0,
                load_format: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The launch_server arguments of a DSV4 kit boot (validated; see :func:`check_pages`)."""
    for name, value, low in (("max_total_tokens", max_total_tokens, 4 * PAGE), ("chunk", chunk, 16),
                             ("max_running", max_running, 1), ("port", port, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} is invalid: expected an integer >= {low}")
    if max_total_tokens % PAGE:
        raise ValueError(f"max_total_tokens={max_total_tokens} is invalid: expected a multiple of {PAGE}")
    ratio = swa_ratio_for(max_total_tokens, max_running, chunk) if swa_ratio is None else swa_ratio
    check_pages(max_total_tokens, ratio, max_running, chunk)
    args = [
        "--model-path", str(model), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
        "--attention-backend", "dsv4", "--dtype", "bfloat16", "--page-size", str(PAGE),
        "--chunked-prefill-size", str(chunk), "--max-total-tokens", str(max_total_tokens),
        "--max-running-requests", str(max_running), "--swa-full-tokens-ratio", str(ratio),
        "--dsa-topk-backend", "torch", "--disable-cuda-graph", "--random-seed", str(seed),
        "--enable-cache-report", "--skip-server-warmup", "--log-level", "info", "--trust-remote-code",
    ]
    if load_format is not None:
        args += ["--load-format", load_format]
    return args + list(extra)


def child_env(profile: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The kit launcher's environment plus the DSV4 torch-path switches and this kit's stub folder."""
    from devkit.engine_kit import launcher

    env = launcher.child_env(dict(profile or {}), base)
    env.update(TORCH_PATH_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(STUB_PATH), env["PYTHONPATH"]])
    return env


def server(model: str | Path, log_path: str | Path, profile: Mapping[str, str] | None = None, *,
           port: int | None = None, ready_timeout_s: float = 300.0, **kwargs):
    """A :class:`devkit.engine_kit.launcher.Server` for a DSV4 kit boot (not started)."""
    from devkit.engine_kit import launcher

    args = server_args(model, launcher.free_port() if port is None else port, **kwargs)
    return launcher.Server(args, log_path, profile, ready_timeout_s=ready_timeout_s, env=child_env(profile))
