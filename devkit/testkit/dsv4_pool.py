"""A real SGLang 0.5.23 ``DeepSeekV4TokenToKVPool`` on CPU (small, FP8 main cache, C4/C128 layers).

Used by the KV-parking tests to move every buffer of a real DeepSeek-V4 pool. Publishes a
``ServerArgs`` first (the pool reads ``get_exec()`` for its attention backend).

:func:`build_dsv4_kv` builds the pool the way SGLang's configurator sizes it (C4 = full / 4,
C128 = full / 128, C4 state = SWA pages x ring) together with its real
``SWATokenToKVPoolAllocator``; ``build_scheduler(dsv4=True)`` uses it.
"""

from __future__ import annotations

from typing import Any


def build_dsv4_pool(*, layers: tuple[int, ...] = (0, 4, 128, 4), page_size: int = 256, max_reqs: int = 4) -> Any:
    """``layers``: each layer's compression ratio (0 = SWA only, 4 = C4 + indexer, 128 = C128)."""
    import torch
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(
        ServerArgs(model_path="dummy", page_size=page_size, pp_max_micro_batch_size=max_reqs, max_running_requests=max_reqs)
    )
    return DeepSeekV4TokenToKVPool(
        max_num_reqs=max_reqs, swa_size=8 * page_size, c4_size=4 * page_size, c128_size=64,
        c4_state_pool_size=64, c128_state_pool_size=64, page_size=page_size, swa_page_size=page_size,
        dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32, c128_state_dtype=torch.float32,
        qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128, layer_num=len(layers),
        device="cpu", enable_memory_saver=False, compression_ratios=list(layers), sliding_window=128,
    )


def build_dsv4_kv(
    *, full_tokens: int, swa_tokens: int, req_slots: int, max_reqs: int, page_size: int = 256,
    layers: tuple[int, ...] = (0, 4, 128, 4), sliding_window: int = 128,
) -> tuple[Any, Any]:
    """A ``DeepSeekV4TokenToKVPool`` sized like SGLang sizes it, and its ``SWATokenToKVPoolAllocator``.

    Call after ``set_global_server_args_for_scheduler`` (the pool reads the published args).
    """
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool, get_compress_state_ring_size

    ring = get_compress_state_ring_size(4)
    pool = DeepSeekV4TokenToKVPool(
        max_num_reqs=max_reqs, num_req_slots=req_slots, swa_size=swa_tokens, c4_size=full_tokens // 4,
        c128_size=full_tokens // 128, c4_state_pool_size=swa_tokens // page_size * ring, c128_state_pool_size=0,
        page_size=page_size, swa_page_size=page_size, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128,
        layer_num=len(layers), device="cpu", enable_memory_saver=False, compression_ratios=list(layers),
        start_layer=0, end_layer=len(layers),  # the engine's layer range (end exclusive): HiCache's DSV4 stack reads it
        sliding_window=sliding_window, full_size=full_tokens,
    )
    allocator = SWATokenToKVPoolAllocator(
        size=full_tokens, size_swa=swa_tokens, page_size=page_size, dtype=torch.float8_e4m3fn, device="cpu",
        kvcache=pool, need_sort=False,
    )
    return pool, allocator
