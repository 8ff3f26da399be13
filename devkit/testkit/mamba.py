"""A real scheduler on a hybrid-mamba cache (CPU): ``HybridReqToTokenPool`` + ``HybridLinearKVPool``
and a ``UnifiedRadixCache`` with the FULL and MAMBA components, ``extra_buffer`` strategy.

Built on :func:`devkit.testkit.scheduler.build_scheduler` (page 1), then the pools, the cache, the
schedule policy and the result processor are swapped for the hybrid ones. Prefill, chunking, the
stash (``checkpoint_into_tree``) and release run upstream code on CPU; hybrid-mamba *decode* needs
CUDA here, so keep ``max_new_tokens=1`` (the prefill pass emits it and the request finishes).

API::

    h = build_mamba_scheduler(chunk=128, grid=64)
    req = h.add_request(168, max_new_tokens=1)
    h.run_until(req.finished)
    device_prefix_len(h, list(req.origin_input_ids) + list(req.output_ids))
"""

from __future__ import annotations

import dataclasses
import types
from array import array
from typing import Any

from devkit.testkit.scheduler import SchedulerHarness, build_scheduler


def build_mamba_scheduler(*, chunk: int, grid: int = 64, pool_tokens: int = 8192, max_reqs: int = 8) -> SchedulerHarness:
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    h = build_scheduler(page_size=1, pool_tokens=pool_tokens, max_reqs=max_reqs, chunked_prefill_size=chunk)
    server_args = ServerArgs(
        model_path="dummy", page_size=1, chunked_prefill_size=chunk, mamba_radix_cache_strategy="extra_buffer",
        pp_max_micro_batch_size=max_reqs, max_running_requests=max_reqs,
    )
    server_args._mamba_cache_chunk_size = grid  # the model config would set it (mamba_chunk_size)
    set_global_server_args_for_scheduler(server_args)

    full_layers, mamba_layers = [3], [0, 1, 2]
    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(
            tp_world_size=1, intermediate_size=64, n_groups=1, num_heads=2, head_dim=16, state_size=16, conv_kernel=4
        )
        cache_params = Mamba2CacheParams(shape=shape, layers=mamba_layers)
    r2t = HybridReqToTokenPool(
        size=max_reqs, mamba_size=2 * max_reqs, mamba_spec_state_size=max_reqs, max_context_len=pool_tokens,
        device="cpu", enable_memory_saver=False, cache_params=cache_params, mamba_layer_ids=mamba_layers,
        enable_mamba_extra_buffer=True, speculative_num_draft_tokens=3,
    )
    kv = HybridLinearKVPool(
        size=pool_tokens, dtype=torch.bfloat16, page_size=1, head_num=1, head_dim=8,
        full_attention_layer_ids=full_layers, device="cpu", enable_memory_saver=False, mamba_pool=r2t.mamba_pool,
    )
    allocator = TokenToKVPoolAllocator(size=pool_tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)
    cache = UnifiedRadixCache(
        params=CacheInitParams(
            req_to_token_pool=r2t, token_to_kv_pool_allocator=allocator, page_size=1, disable=False,
            tree_components=(ComponentType.FULL, ComponentType.MAMBA), enable_mamba_extra_buffer=True,
        )
    )
    s = h.scheduler
    s.server_args = server_args
    s.tree_cache, s.token_to_kv_pool_allocator, s.req_to_token_pool = cache, allocator, r2t
    s.model_config.hf_text_config = types.SimpleNamespace(mamba_chunk_size=grid)
    s.init_schedule_policy()  # the policy holds the tree cache
    s.batch_result_processor = dataclasses.replace(
        s.batch_result_processor, tree_cache=cache, token_to_kv_pool_allocator=allocator, req_to_token_pool=r2t
    )
    return h


def device_prefix_len(h: SchedulerHarness, token_ids: list[int]) -> int:
    """What the tree can serve a later request for ``token_ids`` (KV and mamba state usable)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    match: Any = h.scheduler.tree_cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", token_ids))))
    return int(match.device_prefix_len)
