"""Boot SGLang 0.5.23's real server on CPU with a tiny DeepSeek-V4.1 model that has ratio-1/2
KV-source layers, with ``--enable-decoder-swa-bounded-replay`` set explicitly (devkit only).

The DSV4 kit's launch line (:func:`devkit.engine_kit.dsv4.launch.server_args`) and environment
(torch-path switches, the ``flash_mla`` and ``sgl_kernel`` stand-ins and its routes, which include
the fp4 index-K kernels of the ratio-1/2 layers) plus the replay flag. SGLang resolves decoder
replay on by itself only on CUDA / HIP; set explicitly, its validator passes on CPU too
(``srt/arg_groups/deepseek_v4_hook.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from devkit.engine_kit.dsv4 import launch as dsv4_launch

REPLAY_FLAG = "--enable-decoder-swa-bounded-replay"

# Layer 0: SWA-only + hash routing; layer 1: ratio 1, the (last) kv_source, index source;
# layer 2: SWA-only, a late layer of the replay tail.
DEFAULT_RATIOS = (0, 1, 0)


def tiny_v41_config(ratios: Sequence[int] = DEFAULT_RATIOS, kv_sources: Sequence[int] | None = None,
                    index_sources: Sequence[int] | None = None, candidate_source: int = -1,
                    num_hash_layers: int = 1, special_ids: Mapping[str, int] | None = None,
                    overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    from devkit.engine_kit.dsv4.checkpoint import tiny_config

    ratios = list(ratios)
    if kv_sources is None:
        # first layer of each run of ratio-1/2 layers owns the latents
        kv_sources = [i for i, r in enumerate(ratios) if r in (1, 2) and (i == 0 or ratios[i - 1] != r)]
    if index_sources is None:
        index_sources = list(kv_sources)
    config = tiny_config(model_type="deepseek_v41", num_layers=len(ratios), num_hash_layers=num_hash_layers,
                         special_ids=special_ids)
    config.update(compress_ratios=ratios, kv_source_layer_ids=list(kv_sources),
                  index_source_layer_ids=list(index_sources), candidate_source_layer_id=candidate_source,
                  candidate_topk_blocks=0, candidate_block_size=0)
    config.update(dict(overrides or {}))
    return config


def server(model: str | Path, log_path: str | Path, profile: Mapping[str, str] | None = None, *,
           port: int | None = None, ready_timeout_s: float = 600.0, replay: bool = True,
           extra: Sequence[str] = (), **kwargs):
    """A :class:`devkit.engine_kit.launcher.Server` (not started)."""
    from devkit.engine_kit import launcher

    flags = [REPLAY_FLAG] if replay else []
    args = dsv4_launch.server_args(model, launcher.free_port() if port is None else port,
                                   extra=[*flags, *extra], **kwargs)
    return launcher.Server(args, log_path, profile, ready_timeout_s=ready_timeout_s, env=dsv4_launch.child_env(profile))
