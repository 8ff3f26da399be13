"""Cone replay's copy: the resident Full-side KV of ``[s, F)`` into the replay rows' fresh pages.

Runs after ``ScheduleBatch.prepare_for_extend`` has allocated the rows (the wrapper is in
:mod:`.switch`). The source is F's tree pages on the anchored path, kept resident by the request's
lock on F's node. Whole pages only. ``SWAKVPool``: the Full MHA/MLA pool (slot-major);
DeepSeek-V4: the C4/C128 latents and the C4 index keys (page-row buffers), exactly the buffers its
``get_contiguous_buf_infos`` registers for PD transfer. The SWA KV is never copied: the replay
recomputes it.
"""

from __future__ import annotations

from typing import Any

from adapter.core import api
from adapter.switches.cone_replay.geometry import is_dsv4_pool
from adapter.switches.cone_replay.plan import COPIED, COUNTERS, LIVE, ConePlan

SWITCH = api.handle(__name__)


def full_side_buffers(kvpool: Any) -> list[tuple[Any, int]]:
    """The Full-side buffers of a pool as (tensor, rows per FULL page): ``SWAKVPool``'s Full MHA/MLA
    pool is slot-major (``page`` rows a page); DeepSeek-V4's compressed latents and index keys are
    page-row buffers (one row, or a run of index pages, per FULL page), the buffers its
    ``get_contiguous_buf_infos`` registers for PD transfer."""
    page = int(kvpool.page_size)
    if hasattr(kvpool, "full_kv_pool"):
        full = kvpool.full_kv_pool
        bufs = []
        for name in ("k_buffer", "v_buffer", "kv_buffer", "k_scale_buffer", "v_scale_buffer"):
            for buf in getattr(full, name, None) or []:
                bufs.append((buf, page))
        return bufs
    if is_dsv4_pool(kvpool):
        if getattr(kvpool, "_unified_kv", False):  # refused at cache build (_check_cache)
            raise TypeError("cone copy: DeepSeek-V4 unified KV ring")
        bufs = []
        for ratio, kv in kvpool.kv_pools.items():
            if kv is not None:
                bufs.extend((buf, 1) for buf in kv.kv_buffer)
            index = kvpool.index_pools.get(ratio)
            if index is None:
                continue
            rows = (page // ratio) // index.page_size if ratio in (1, 2) else 1
            bufs.extend((buf, rows) for buf in index.contiguous_page_row_buffers())
        return bufs
    raise TypeError(f"cone copy: unknown pool family {type(kvpool).__name__} (refused at cache build)")


def copy_full_pages(kvpool: Any, src: Any, dst: Any) -> tuple[int, int]:
    """Copy the Full-side KV of the page-aligned slots ``src`` onto ``dst``; (pages, bytes)."""
    import torch

    page = int(kvpool.page_size)
    src, dst = src.to(torch.int64), dst.to(torch.int64)
    n = src.numel()
    assert n == dst.numel() and n % page == 0, (n, dst.numel(), page)
    src_pages, dst_pages = src[::page] // page, dst[::page] // page
    # Whole pages only: the tree's pages and the fresh ones are page-aligned runs.
    ar = torch.arange(page, dtype=torch.int64)
    assert torch.equal(src, (src_pages[:, None] * page + ar).flatten()), "cone source is not whole pages"
    assert torch.equal(dst, (dst_pages[:, None] * page + ar).flatten()), "cone destination is not whole pages"
    nbytes = 0
    for buf, rows in full_side_buffers(kvpool):
        if rows == page:  # slot-major
            s_idx, d_idx = src.to(buf.device), dst.to(buf.device)
        else:  # page rows
            r = torch.arange(rows, dtype=torch.int64)
            s_idx = (src_pages[:, None] * rows + r).flatten().to(buf.device)
            d_idx = (dst_pages[:, None] * rows + r).flatten().to(buf.device)
        buf[d_idx] = buf[s_idx]
        nbytes += int(buf[0].nbytes) * int(s_idx.numel())
    return int(src_pages.numel()), nbytes


def copy_replay_rows(cache: Any, req_to_token: Any, row: int, plan: ConePlan) -> tuple[int, int]:
    """The cone's copy: tree pages of ``[s, F)`` (on the anchored path) -> the row's fresh pages."""
    src = cache.path_device_indices(plan.anchor)[plan.s : plan.F]
    dst = req_to_token[row, plan.s : plan.F]
    pages, nbytes = copy_full_pages(cache.token_to_kv_pool_allocator.get_kvcache(), src, dst)
    plan.state, plan.source = COPIED, src
    LIVE.copied += 1
    COUNTERS.copies += 1
    COUNTERS.copied_pages += pages
    COUNTERS.copied_bytes += nbytes
    SWITCH.event("DSV41_SWA_CONE copy", rid=plan.rid, pages=pages, bytes=nbytes)
    return pages, nbytes
