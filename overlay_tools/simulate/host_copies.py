"""Pure-torch host <-> device KV copies: the ops HiCache's host pools call, for ``simulate``'s CPU replay.

SGLang 0.5.23's host pools (``mem_cache/pool_host/mha.py``, ``mla.py``, ``dsa.py``,
``mem_cache/memory_pool_host.py``) import these ops from the CUDA build of ``sgl_kernel``
(``sgl_kernel.kvcacheio``) under ``is_cuda() or is_hip()``; on CPU they have neither, so the host
route (:mod:`.host_route`, ``route_host_pool_ops``) binds the names below into those modules. The
engine kit's ``sgl_kernel`` stand-in (devkit) re-exports this module as its ``kvcacheio``: one copy.

Each op keeps the CUDA kernel's contract (``sgl-kernel/csrc/kvcacheio/transfer.cu``): memory is
addressed in bytes from the tensors' ``data_ptr()`` (or from a ``uint64`` table of per-layer base
pointers), an *item* is one token's ``item_size`` bytes of one layer, ``layer_first`` (lf) puts
item ``i`` of a layer at ``base + i * item_size``, ``page_first`` (pf) puts item ``i`` of layer
``l`` at ``base + i * layout_dim + l * item_size``, and an index pair with a negative side is
skipped. The ``direct`` ops copy tensor slices as the C++ does. ``page_head`` ops are not here:
nothing here reaches them (HiCache's default layout is ``page_first``), and they raise by name.

Never imported by a serving process (a GPU server has the real kernels); no side effects on import.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = [
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
]
NOT_HERE = ("transfer_kv_per_layer_ph_lf", "transfer_kv_all_layer_lf_ph")


def __getattr__(name: str):
    if name in NOT_HERE:
        def op(*args, **kwargs):
            raise NotImplementedError(f"host copies: kvcacheio op {name!r} (page_head layout) is not implemented")

        op.__name__ = name
        return op
    raise AttributeError(f"host copies: kvcacheio op {name!r} is not implemented")


# ----------------------------------------------------------------------------- byte addressing


def _rows_at(ptr: int, rows: int, item_size: int) -> torch.Tensor:
    """``rows`` items of ``item_size`` bytes starting at address ``ptr``, as a ``uint8 [rows, item_size]`` view."""
    if rows <= 0:
        return torch.empty((0, item_size), dtype=torch.uint8)
    memory = (ctypes.c_uint8 * (rows * item_size)).from_address(ptr)
    return torch.frombuffer(memory, dtype=torch.uint8).view(rows, item_size)


def _pairs(src_indices: torch.Tensor, dst_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"src_indices has {src_indices.numel()} entries, dst_indices {dst_indices.numel()}: "
                         "expected the same length")
    src = src_indices.reshape(-1).to(device="cpu", dtype=torch.int64)
    dst = dst_indices.reshape(-1).to(device="cpu", dtype=torch.int64)
    keep = (src >= 0) & (dst >= 0)  # the kernel skips a pair with a negative side
    return src[keep], dst[keep]


def _copy_rows(src_ptr: int, src_rows: torch.Tensor, dst_ptr: int, dst_rows: torch.Tensor, item_size: int) -> None:
    """Item ``src_rows[i]`` at ``src_ptr`` -> item ``dst_rows[i]`` at ``dst_ptr`` (rows in item units)."""
    if src_rows.numel() == 0:
        return
    src = _rows_at(src_ptr, int(src_rows.max()) + 1, item_size)
    dst = _rows_at(dst_ptr, int(dst_rows.max()) + 1, item_size)
    dst[dst_rows] = src[src_rows]


def _stride_in_items(layout_dim: int, item_size: int, name: str) -> int:
    if item_size <= 0 or layout_dim <= 0 or layout_dim % item_size:
        raise ValueError(f"{name}={layout_dim} with item_size={item_size} is invalid: expected a positive "
                         "multiple of item_size (one token's bytes across the layers)")
    return layout_dim // item_size


def _table(layers: torch.Tensor, num_layers: int, name: str) -> list[int]:
    if layers.numel() != num_layers:
        raise ValueError(f"{name} holds {layers.numel()} layer pointers, num_layers={num_layers}: expected equal")
    return [int(p) & 0xFFFFFFFFFFFFFFFF for p in layers.reshape(-1).view(torch.int64).tolist()]


# ----------------------------------------------------------------------------- kernel io backend


def transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size,
                          block_quota=2, num_warps_per_block=32):
    """One layer, layer_first -> layer_first (K and V)."""
    src, dst = _pairs(src_indices, dst_indices)
    for s, d in ((src_k, dst_k), (src_v, dst_v)):
        _copy_rows(s.data_ptr(), src, d.data_ptr(), dst, item_size)


def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size, block_quota=2, num_warps_per_block=32):
    """One layer of one latent buffer, layer_first -> layer_first."""
    s_rows, d_rows = _pairs(src_indices, dst_indices)
    _copy_rows(src.data_ptr(), s_rows, dst.data_ptr(), d_rows, item_size)


def transfer_kv_per_layer_pf_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size,
                                src_layout_dim, block_quota=2, num_warps_per_block=32):
    """Layer ``layer_id`` of a page_first host buffer -> that layer's device buffer (K and V)."""
    per_token = _stride_in_items(src_layout_dim, item_size, "src_layout_dim")
    src, dst = _pairs(src_indices, dst_indices)
    for s, d in ((src_k, dst_k), (src_v, dst_v)):
        _copy_rows(s.data_ptr(), src * per_token + layer_id, d.data_ptr(), dst, item_size)


def transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim,
                                    block_quota=2, num_warps_per_block=32):
    """Layer ``layer_id`` of a page_first latent host buffer -> that layer's device buffer."""
    per_token = _stride_in_items(src_layout_dim, item_size, "src_layout_dim")
    s_rows, d_rows = _pairs(src_indices, dst_indices)
    _copy_rows(src.data_ptr(), s_rows * per_token + layer_id, dst.data_ptr(), d_rows, item_size)


def transfer_kv_all_layer(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices,
                          item_size, num_layers, block_quota=2, num_warps_per_block=32):
    """Every layer, per-layer pointer tables on both sides (K and V)."""
    src, dst = _pairs(src_indices, dst_indices)
    for s_tbl, d_tbl, name in ((src_k_layers, dst_k_layers, "src_k_layers"), (src_v_layers, dst_v_layers, "src_v_layers")):
        for s_ptr, d_ptr in zip(_table(s_tbl, num_layers, name), _table(d_tbl, num_layers, name.replace("src", "dst"))):
            _copy_rows(s_ptr, src, d_ptr, dst, item_size)


def transfer_kv_all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers,
                              block_quota=2, num_warps_per_block=32):
    """Every layer of one latent buffer, per-layer pointer tables on both sides."""
    src, dst = _pairs(src_indices, dst_indices)
    for s_ptr, d_ptr in zip(_table(src_layers, num_layers, "src_layers"), _table(dst_layers, num_layers, "dst_layers")):
        _copy_rows(s_ptr, src, d_ptr, dst, item_size)


def transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                                dst_layout_dim, num_layers, block_quota=2, num_warps_per_block=32):
    """Every layer's device buffer (pointer table) -> a page_first host buffer (K and V)."""
    per_token = _stride_in_items(dst_layout_dim, item_size, "dst_layout_dim")
    src, dst = _pairs(src_indices, dst_indices)
    for s_tbl, d, name in ((src_k_layers, dst_k, "src_k_layers"), (src_v_layers, dst_v, "src_v_layers")):
        for layer, s_ptr in enumerate(_table(s_tbl, num_layers, name)):
            _copy_rows(s_ptr, src, d.data_ptr(), dst * per_token + layer, item_size)


def transfer_kv_all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers,
                                    block_quota=2, num_warps_per_block=32):
    """Every layer's latent device buffer (pointer table) -> a page_first latent host buffer."""
    per_token = _stride_in_items(dst_layout_dim, item_size, "dst_layout_dim")
    src, d_rows = _pairs(src_indices, dst_indices)
    for layer, s_ptr in enumerate(_table(src_layers, num_layers, "src_layers")):
        _copy_rows(s_ptr, src, dst.data_ptr(), d_rows * per_token + layer, item_size)


# ----------------------------------------------------------------------------- direct io backend


def _indices(src_indices, dst_indices, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"src_indices has {src_indices.numel()} entries, dst_indices {dst_indices.numel()}: "
                         "expected the same length")
    if page_size <= 0 or src_indices.numel() % page_size:
        raise ValueError(f"page_size={page_size} with {src_indices.numel()} indices is invalid: expected a "
                         "positive page size dividing the index count")
    return (src_indices.reshape(-1).to(device="cpu", dtype=torch.int64),
            dst_indices.reshape(-1).to(device="cpu", dtype=torch.int64))


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """Row ``src_indices[i]`` of each source layer -> row ``dst_indices[i]`` of the same destination layer."""
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers, {len(dst_layers)} destination layers: expected equal")
    src, dst = _indices(src_indices, dst_indices, page_size)
    for s, d in zip(src_layers, dst_layers):
        d[dst.to(d.device)] = s[src.to(s.device)].to(d.device)


def _first_of_pages(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    return indices[::page_size]


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """page_first_direct host ``[page, layer, page_size, ...]`` -> layer_first device rows, one layer."""
    src, dst = _indices(src_indices, dst_indices, page_size)
    host_pages = _first_of_pages(src, page_size) // page_size
    device_rows = (_first_of_pages(dst, page_size)[:, None] + torch.arange(page_size)).reshape(-1)
    is_mla = len(src_ptrs) == 1
    layers = len(dst_ptrs) if is_mla else len(dst_ptrs) // 2
    for j in range(layers):
        pairs = [(src_ptrs[0], dst_ptrs[j])] if is_mla else [(src_ptrs[0], dst_ptrs[j]), (src_ptrs[1], dst_ptrs[j + layers])]
        for host, device in pairs:
            rows = host[host_pages, layer_id + j].reshape(-1, *host.shape[3:])
            device[device_rows.to(device.device)] = rows.to(device.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """layer_first device rows, every layer -> page_first_direct host ``[page, layer, page_size, ...]``."""
    src, dst = _indices(src_indices, dst_indices, page_size)
    device_rows = (_first_of_pages(src, page_size)[:, None] + torch.arange(page_size)).reshape(-1)
    host_pages = _first_of_pages(dst, page_size) // page_size
    is_mla = len(dst_ptrs) == 1
    layers = len(src_ptrs) if is_mla else len(src_ptrs) // 2
    for j in range(layers):
        pairs = [(src_ptrs[j], dst_ptrs[0])] if is_mla else [(src_ptrs[j], dst_ptrs[0]), (src_ptrs[j + layers], dst_ptrs[1])]
        for device, host in pairs:
            rows = device[device_rows.to(device.device)].to(host.device)
            host[host_pages, j] = rows.reshape(len(host_pages), page_size, *rows.shape[1:])
