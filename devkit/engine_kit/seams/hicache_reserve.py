"""HiCache's host-memory reserve for a kit server: SGLang 0.5.23 refuses any HiCache host pool,
however small, while the machine's available memory is under ``HICACHE_HOST_MEMORY_RESERVE_BYTES``
(10 GiB, ``mem_cache/pool_host/base.py``), so a kit boot of a few hundred KiB of host KV fails on a
busy shared machine ("Requesting 0.00 GB but only have -1.89 GB free"). This seam lowers the
reserve to ``KIT_HICACHE_RESERVE_MIB`` (default 256) in the server's processes."""

import os

import wrapt

RESERVE_MIB = int(os.environ.get("KIT_HICACHE_RESERVE_MIB", "256"))


def _lower(module):
    module.HICACHE_HOST_MEMORY_RESERVE_BYTES = RESERVE_MIB << 20


wrapt.register_post_import_hook(_lower, "sglang.srt.mem_cache.pool_host.base")
