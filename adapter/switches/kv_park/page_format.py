"""The byte format of a parked entry: a pool's regions, a page's bytes, and page ids checked.

The only format this package writes or reads
---------------------------------------------
A pool is described by an ordered tuple of *regions*. A region is one device tensor viewed as
``[num_pages, row_bytes]`` raw bytes: row ``p`` holds every byte that page ``p`` owns in that
tensor (for a token-major ``[tokens, heads, dim]`` buffer, the ``page_size`` token rows of the
page; for a DSV4 ``[pages, padded_page_bytes]`` buffer, the padded page itself). The order of the
regions is the order the pool adapter lists them (see :mod:`adapter.switches.kv_park.regions`).

An entry of ``n`` pages is a contiguous ``uint8`` host tensor of shape ``[n, page_bytes]`` with
``page_bytes = sum(row_bytes)``. Row ``i`` is the ``i``-th page id the caller passed, and inside
a row the regions follow each other in order, without padding::

    entry[i] = region_0[page_ids[i]] || region_1[page_ids[i]] || ... || region_{R-1}[page_ids[i]]

The format does not depend on the chunk size or on whether staging was used: a restore may use
other chunking than the save, and into other page ids (restore writes ``entry[i]`` to
``dst_ids[i]``). Dtypes do not matter (bf16, fp8, int8 state: all are moved as bytes).

The copy engine's index ops (:mod:`adapter.switches.kv_park.engine`) work on the widest integer
view (:attr:`PageLayout.word`: 8, 4, 2 or 1 bytes) that divides every row, so the same bytes move
with fewer elements (CPU ``index_copy_`` on ``uint8`` rows is an element-wise path about 10x
slower than on ``int64`` rows; on CUDA it is neutral).

Page ids given on the host are validated there before any index op: on CUDA an out-of-range index
is a device-side assert that poisons the context, so it must never reach a kernel. Page ids already
on the pool's device are the allocator's own (a request's ``req_to_token`` row, slots it just handed
out) and are used as they are: reading them back to check them would synchronize the caller's stream.

:func:`per_view_save` / :func:`per_view_restore` are the stock pattern (one copy per page and
region): the byte-format oracle of the tests and the benchmark's baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@dataclass(frozen=True)
class Region:
    """One pool tensor as ``[num_pages, row_bytes]`` bytes (a view: no copy, shares storage)."""

    name: str
    rows: torch.Tensor  # uint8, shape [num_pages, row_bytes], rows contiguous

    @property
    def row_bytes(self) -> int:
        return int(self.rows.shape[1])


def page_rows(name: str, buffer: torch.Tensor, page_size: int) -> Region:
    """View a contiguous token-major (or page-major) buffer as ``[pages, bytes]`` rows.

    ``page_size`` is the number of first-dimension entries per page (tokens for a token-major
    buffer, 1 for a buffer whose first dimension is already pages).
    """
    if not buffer.is_contiguous():
        raise ValueError(f"region {name}: buffer is not contiguous (strides {tuple(buffer.stride())})")
    if buffer.shape[0] % page_size:
        raise ValueError(f"region {name}: {buffer.shape[0]} rows are not a whole number of {page_size}-row pages")
    raw = buffer.reshape(-1).view(torch.uint8)
    return Region(name, raw.view(buffer.shape[0] // page_size, -1))


@dataclass(frozen=True)
class PageLayout:
    """The regions of one pool, in byte-format order."""

    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        if not self.regions:
            raise ValueError("a page layout needs at least one region")
        pages = {r.rows.shape[0] for r in self.regions}
        if len(pages) != 1:
            detail = ", ".join(f"{r.name}={r.rows.shape[0]}" for r in self.regions)
            raise ValueError(f"regions disagree on the number of pages: {detail}")
        devices = {r.rows.device for r in self.regions}
        if len(devices) != 1:
            raise ValueError(f"regions live on several devices: {sorted(map(str, devices))}")
        for r in self.regions:
            if r.rows.dtype != torch.uint8 or r.rows.dim() != 2 or r.rows.stride(1) != 1:
                raise ValueError(f"region {r.name}: rows must be a [pages, bytes] uint8 view with contiguous rows")

    @property
    def num_pages(self) -> int:
        return int(self.regions[0].rows.shape[0])

    @property
    def page_bytes(self) -> int:
        return sum(r.row_bytes for r in self.regions)

    @property
    def device(self) -> torch.device:
        return self.regions[0].rows.device

    @property
    def word(self) -> int:
        """Widest element width that divides every row and every region's start address."""
        for width, _ in _WORDS:
            if all(r.row_bytes % width == 0 and r.rows.data_ptr() % width == 0 for r in self.regions):
                return width
        return 1

    def columns(self) -> list[tuple[Region, int]]:
        """Each region with its byte offset inside a page row of the entry."""
        out, col = [], 0
        for r in self.regions:
            out.append((r, col))
            col += r.row_bytes
        return out


def on_a_device(page_ids: object) -> bool:
    """Whether ``page_ids`` is a tensor on a device (the allocator's own ids: never read back)."""
    return isinstance(page_ids, torch.Tensor) and page_ids.device.type != "cpu"


def check_page_ids(page_ids: torch.Tensor | Sequence[int], num_pages: int) -> torch.Tensor:
    """Page ids as a CPU int64 tensor; ``IndexError`` naming the first bad id and the pool size.

    Runs on the host before any index op touches a device tensor.
    """
    ids = torch.as_tensor(page_ids, dtype=torch.int64)
    if ids.device.type != "cpu":
        ids = ids.cpu()
    ids = ids.reshape(-1)
    if ids.numel():
        bad = ((ids < 0) | (ids >= num_pages)).nonzero()
        if bad.numel():
            first = int(ids[int(bad[0, 0])])
            raise IndexError(
                f"page id {first} is out of range for a pool of {num_pages} pages "
                f"(valid ids 0..{num_pages - 1}; {bad.numel()} bad id(s))"
            )
    return ids


def word_dtype(width: int) -> torch.dtype:
    """The integer dtype of a word ``width`` bytes wide (8, 4, 2 or 1)."""
    return dict(_WORDS)[width]


def per_view_save(layout: PageLayout, page_ids: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """The stock pattern, for the benchmark and as the byte-format oracle: one copy per (page, region)."""
    flat = out.view(-1)
    off = 0
    for p in page_ids:
        for r in layout.regions:
            flat[off : off + r.row_bytes].copy_(r.rows[p])
            off += r.row_bytes
    return out


def per_view_restore(layout: PageLayout, entry: torch.Tensor, page_ids: Sequence[int]) -> None:
    flat = entry.view(-1)
    off = 0
    for p in page_ids:
        for r in layout.regions:
            r.rows[p].copy_(flat[off : off + r.row_bytes])
            off += r.row_bytes
