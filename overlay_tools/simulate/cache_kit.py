"""A real ``UnifiedRadixCache`` (FULL + SWA components) on CPU, and the request life cycle on it:
the cache ``simulate`` replays a trace on, shipped with it in the wheel. The checkout's tests and benches
import it from here; ``devkit.testkit.radix_cache`` adds the tests' probes beside it.

Everything here drives the real upstream objects through the scheduler's own entry points; only the
model forward (the KV contents) is absent.

API::

    kit = build(geometry, backend="python", session=False)
    kit.cache / kit.allocator / kit.pool          # UnifiedRadixCache, SWATokenToKVPoolAllocator, ReqToTokenPool
    kit.core                                      # the tree core (UnifiedTreeCore or RustUnifiedTreeCore)

    req = kit.admit(tokens)                       # Req + row + real match (match_kv_cache) + admission lock
    kit.prefill(req, chunk=None)                  # chunks of geometry.chunk, a checkpoint after each
    kit.prefill_to(req, end)                      # one chunk [req's position, end) + its checkpoint
    kit.finish(req, out_len)                      # decode out_len tokens, release_kv_cache(checkpoint=True)
    kit.run_turn(tokens, out_len, chunk=None)     # admit + prefill + finish -> TurnResult
    kit.node_at(tokens)                           # read-only: id of the deepest Full-resident node on tokens
    kit.evict(full=0, swa=0)                      # cache.evict(EvictParams(...))
    kit = build(..., hicache=HiCache(ratio=2.0, write_policy="write_back"))  # HiCache attached: admit
                                                  # loads host hits back (kit.loaded_from_host)
    kit.timings = {}                              # then match/checkpoint/release/evict times (ns) per call
    kit.resume_state(history)                     # read-only: is the resume point at page_floor(len) usable?
    kit.leak_check()                              # free + evictable + protected == pool size (Full and SWA)

HiCache's host tier on CPU runs over the host route (:mod:`.host_route`: host pools without
``cudaHostRegister``, the pure-torch copies of :mod:`.host_copies`), which :func:`attach_hicache`
applies in this process first.

Allocation uses the upstream kit's page-aligned trick (Full pages + SWA pages + the full->swa
mapping); when a pool runs short it evicts first, like ``alloc_for_extend``. All lengths are
multiples of the page size.
"""

from __future__ import annotations

import itertools
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

#: The process-global ServerArgs page size is set by the first build; one page size per process.
_SERVER_ARGS_PAGE: list[int] = []


@dataclass(frozen=True)
class HiCache:
    """HiCache on the kit's cache: the launch flags it stands for (``--enable-hierarchical-cache
    --hicache-ratio R --hicache-write-policy P [--hicache-storage-backend file]``). ``ratio``: host
    pool tokens per device token (each host pool sized from its device pool, as the engine does);
    ``storage_dir``: with it, the L3 ``file`` backend in that folder."""

    ratio: float = 2.0
    write_policy: str = "write_back"
    storage_dir: str | None = None

    def flags(self) -> dict[str, Any]:
        """The ``ServerArgs`` fields these launch flags set."""
        extra = {}
        if self.storage_dir is not None:
            extra = {"hicache_storage_backend": "file", "file_storage_path": self.storage_dir}
        return {"enable_hierarchical_cache": True, "hicache_ratio": self.ratio,
                "hicache_write_policy": self.write_policy, **extra}

    def server_args(self, page: int) -> Any:
        from sglang.srt.server_args import ServerArgs

        return ServerArgs(model_path="dummy", page_size=page, **self.flags())


def set_server_args(page: int, hicache: HiCache | None) -> Any:
    """The process-global ServerArgs for a kit of this page size (and HiCache flags); returns them."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    key = [page] if hicache is None else [page, hicache]
    args = hicache.server_args(page) if hicache is not None else ServerArgs(model_path="dummy", page_size=page)
    if key != _SERVER_ARGS_PAGE or hicache is not None:
        set_global_server_args_for_scheduler(args)
        _SERVER_ARGS_PAGE[:] = key
    return args


class TransferCounter:
    """Stands in for the cache's ``metrics_collector`` (off in the kit) and keeps what HiCache reports
    to it: tokens per pool and bytes backed up device->host and loaded back host->device, and tokens
    dropped without a backup. Every other metric call is a no-op."""

    def __init__(self) -> None:
        self.d2h_tokens: dict[str, int] = {}
        self.h2d_tokens: dict[str, int] = {}
        self.d2h_bytes = self.h2d_bytes = self.dropped_tokens = 0

    def increment_backup_num_tokens(self, num_tokens: int, pool: Any) -> None:
        key = str(getattr(pool, "value", pool))
        self.d2h_tokens[key] = self.d2h_tokens.get(key, 0) + int(num_tokens)

    def increment_load_back_num_tokens(self, num_tokens: int, pool: Any) -> None:
        key = str(getattr(pool, "value", pool))
        self.h2d_tokens[key] = self.h2d_tokens.get(key, 0) + int(num_tokens)

    def increment_backup_num_bytes(self, num_bytes: int) -> None:
        self.d2h_bytes += int(num_bytes)

    def increment_load_back_num_bytes(self, num_bytes: int) -> None:
        self.h2d_bytes += int(num_bytes)

    def increment_dropped_tokens(self, num_tokens: int, **_: Any) -> None:
        self.dropped_tokens += int(num_tokens)

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def attach_hicache(cache: Any, params: Any, server_args: Any) -> None:
    """``init_hicache`` as ``create_unified_radix_cache`` calls it after building the cache, over the
    host route (:func:`.host_route.apply`, pinned) and within :func:`.host_route.host_budget`; the cache
    reports its transfers to a :class:`TransferCounter` (``cache.metrics_collector``)."""
    from overlay_tools.simulate import host_route

    host_route.apply()
    if cache.metrics_collector is None:
        cache.metrics_collector = TransferCounter()
    with host_route.host_budget():  # this machine's free RAM, without a serving node's 10 GiB reserve
        cache.init_hicache(server_args, params)


@dataclass(frozen=True)
class Geometry:
    page: int
    window: int
    chunk: int
    full_tokens: int
    swa_tokens: int
    max_reqs: int = 16
    max_ctx: int = 8192

    def with_pools(self, full_tokens: int | None = None, swa_tokens: int | None = None, max_ctx: int | None = None) -> Geometry:
        return Geometry(self.page, self.window, self.chunk,
                        self.full_tokens if full_tokens is None else full_tokens,
                        self.swa_tokens if swa_tokens is None else swa_tokens,
                        self.max_reqs, self.max_ctx if max_ctx is None else max_ctx)


#: Scaled-down DeepSeek-V4 shape: window < page, as 128 < 256.
SMALL = Geometry(page=16, window=8, chunk=128, full_tokens=65536, swa_tokens=1024, max_ctx=8192)
#: DeepSeek-V4 geometry: page 256, SWA window 128, chunked prefill 8192.
DSV4 = Geometry(page=256, window=128, chunk=8192, full_tokens=4 * 1024 * 1024, swa_tokens=64 * 256, max_ctx=1 << 20)


OUTPUT_TOKEN = 7  # what "decode" writes


@dataclass
class TurnResult:
    rid: str
    prefix_len: int  # device_prefix_len the match gave (the resume point used)
    swa_branching_seqlen: int | None  # set when the window was gone although Full KV was resident
    reprefilled: int  # tokens prefilled (prompt minus prefix)
    history: list[int] = field(default_factory=list)  # prompt + output: the next turn starts with it


class CacheKit:
    """One real cache with its pools; counts SWA slots handed out (the traffic volume)."""

    def __init__(self, geometry: Geometry, cache: Any, allocator: Any, pool: Any, backend: str):
        self.geometry, self.cache, self.allocator, self.pool, self.backend = geometry, cache, allocator, pool, backend
        self.core = cache.tree_core
        self.swa_alloc_tokens = 0
        self.evict_calls = 0
        self._rid = itertools.count(1)
        # Set to {} to time match / checkpoint / release / evict: CPU ns of this thread, so a shared
        # machine's preemption does not land in the figures.
        self.timings: dict[str, list[int]] | None = None
        self.loaded_from_host = self.load_backs = 0  # HiCache: Full tokens loaded back, load-backs
        # Tokens an allocation keeps free beyond itself (0: evict only the shortfall). The replay sets
        # SGLang's over-estimate: alloc_paged_token_slots_extend evicts for the batch's extend + a page
        # per request before it allocates.
        self.alloc_headroom = 0
        self.baseline = (allocator.full_available_size(), allocator.swa_available_size())

    # -- allocation -----------------------------------------------------------------------------
    def alloc_pages(self, n: int) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        page = self.geometry.page
        assert n % page == 0, f"allocations are whole pages: {n} % {page}"
        a = self.allocator
        if self.alloc_headroom:
            self.reserve(n + self.alloc_headroom)
        short_full = n - a.full_attn_allocator.available_size()
        short_swa = n - a.swa_attn_allocator.available_size()
        if short_full > 0 or short_swa > 0:
            self.evict_calls += 1
            self.cache.evict(EvictParams(num_tokens=max(0, short_full), swa_num_tokens=max(0, short_swa)))
        full = a.full_attn_allocator.alloc(n)
        swa = a.swa_attn_allocator.alloc(n)
        if full is None or swa is None:
            raise RuntimeError(
                f"out of KV: need {n}, full free {a.full_attn_allocator.available_size()}, "
                f"swa free {a.swa_attn_allocator.available_size()}"
            )
        a.full_to_swa_index_mapping[full] = swa
        self.swa_alloc_tokens += n
        return full

    def reserve(self, num_tokens: int) -> None:
        """SGLang's eviction before an allocation (``evict_from_tree_cache``: the allocator evicts
        until ``num_tokens`` Full and SWA slots are free, or nothing evictable is left)."""
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        self.evict_calls += 1
        evict_from_tree_cache(self.cache, num_tokens)

    # -- request life cycle ---------------------------------------------------------------------
    def admit(self, tokens: list[int], out_len: int = 0, rid: str | None = None, session_id: str | None = None) -> Any:
        """A Req with a row, matched by the real ``match_kv_cache`` and locked like an admission.
        ``session_id`` tags it for the session radix cache (its current generation)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(
            rid=rid or f"r{next(self._rid)}",
            origin_input_text="",
            origin_input_ids=array("q", tokens),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=out_len + 1),
        )
        if session_id is not None:
            req.session_id = session_id
            req.session_generation = self.cache.ensure_session_generation(session_id)
        self.pool.alloc([req])
        t0 = time.thread_time_ns()
        req.init_next_round_input(self.cache)  # common.match_kv_cache -> cache.match_prefix
        self._time("match", t0)
        if req.needs_host_load_back():
            self.load_back(req)
        req.lock = self.cache.lock(req.last_node)  # PrefillAdder._commit_prefill_admission
        if req.prefix_len:
            self.pool.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), self.cache.prefix_device_indices(req))
        req._kit_pos = req.prefix_len
        return req

    def load_back(self, req: Any) -> int:
        """HiCache: the admission's load-back (``PrefillAdder.add_one_req``: ``init_load_back``,
        the prefix grows by what it loaded), then the batch's ``ready_to_load_host_cache`` and the
        scheduler's ``check_hicache_events`` until the load has landed. Returns the Full tokens loaded."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        t0 = time.thread_time_ns()
        loaded, last = self.cache.init_load_back(InitLoadBackParams(
            best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
        req.host_loaded_length, req.last_node = loaded, last
        req.prefix_len += loaded
        if self.cache.load_back_is_cache_owned():
            req.kv.cache_protected_len = req.prefix_len
        self.cache.ready_to_load_host_cache()
        self.sync_hicache()
        self._time("load_back", t0)
        self.loaded_from_host += loaded
        self.load_backs += 1
        return loaded

    def sync_hicache(self) -> None:
        """Wait for every HiCache copy in flight and commit it (the scheduler polls
        ``check_hicache_events`` each pass; here the copies are waited for at once)."""
        cc = self.cache.cache_controller
        if cc is None:
            return
        self.cache.flush_pending_backups()
        for queue in (cc.ack_write_queue, cc.ack_load_queue):
            for ack in queue:
                ack.finish_event.synchronize()
        self.cache.writing_check(finish_count=len(cc.ack_write_queue))
        self.cache.loading_check(finish_count=len(cc.ack_load_queue))

    def _time(self, op: str, t0: int) -> None:
        if self.timings is not None:
            self.timings.setdefault(op, []).append(time.thread_time_ns() - t0)

    def prefill_to(self, req: Any, end: int) -> None:
        """One prefill pass [position, end) and its checkpoint (``stash_chunked_request`` or the
        post-prefill ``checkpoint_kv_cache`` of ``batch_result_processor``)."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        pos = req._kit_pos
        assert pos < end <= len(req.origin_input_ids), (pos, end)
        idx = self.alloc_pages(end - pos)
        self.pool.write((req.kv.req_pool_idx, slice(pos, end)), idx)
        req.extend_end = end
        req.kv.kv_committed_len = req.kv.kv_allocated_len = end
        t0 = time.thread_time_ns()
        checkpoint_kv_cache(req, self.cache)
        self._time("checkpoint", t0)
        self.sync_hicache()  # write-through: the backups the checkpoint queued
        req._kit_pos = end

    def prefill(self, req: Any, chunk: int | None = None) -> None:
        chunk = chunk or self.geometry.chunk
        total = len(req.origin_input_ids)
        while req._kit_pos < total:
            self.prefill_to(req, min(total, req._kit_pos + chunk))

    def finish(self, req: Any, out_len: int) -> list[int]:
        """Decode ``out_len`` tokens and release the finished request (the finished-turn insert)."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        total = len(req.origin_input_ids)
        if out_len:
            idx = self.alloc_pages(out_len)
            self.pool.write((req.kv.req_pool_idx, slice(total, total + out_len)), idx)
            req.output_ids = array("q", [OUTPUT_TOKEN] * out_len)
            req.kv.kv_committed_len = req.kv.kv_allocated_len = total + out_len
        req.finished_reason = FINISH_LENGTH(length=out_len)
        t0 = time.thread_time_ns()
        release_kv_cache(req, self.cache, checkpoint=True)
        self._time("release", t0)
        self.sync_hicache()
        return list(req.origin_input_ids) + [OUTPUT_TOKEN] * out_len

    def run_turn(self, tokens: list[int], out_len: int, chunk: int | None = None,
                 session_id: str | None = None) -> TurnResult:
        req = self.admit(tokens, out_len, session_id=session_id)
        result = TurnResult(req.rid, req.prefix_len, req.swa_branching_seqlen, len(tokens) - req.prefix_len)
        self.prefill(req, chunk)
        result.history = self.finish(req, out_len)
        return result

    def evict(self, full: int = 0, swa: int = 0) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        t0 = time.thread_time_ns()
        self.cache.evict(EvictParams(num_tokens=full, swa_num_tokens=swa))
        self._time("evict", t0)

    # -- read-only probes -----------------------------------------------------------------------
    def resume_state(self, history: list[int]) -> dict[str, Any]:
        """Is the resume point F = page_floor(len(history)) usable? Read-only on both cores: Full
        via ``match_full_device_prefix``, SWA via ``swa_tombstone_ranges`` (no LRU touch)."""
        from sglang.srt.mem_cache.radix_cache import RadixKey

        page, window = self.geometry.page, self.geometry.window
        f = len(history) // page * page
        key = RadixKey(array("q", history[:f]))
        full_len, _, _ = self.core.match_full_device_prefix(key)
        holes = self.core.swa_tombstone_ranges(key, max(0, f - window), f)
        return {"resume_at": f, "full_resident": full_len, "swa_window_holes": holes,
                "lost": full_len < f or bool(holes)}

    def node_at(self, tokens: list[int]) -> int:
        """Id of the deepest node with Full KV on the path of ``tokens`` (read-only, both cores)."""
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return self.core.match_full_device_prefix(RadixKey(array("q", tokens)))[1]

    def leak_check(self) -> dict[str, int]:
        """Slots not accounted for by the free lists plus the tree (0 and 0 when nothing leaked)."""
        a, c = self.allocator, self.cache
        full = a.full_available_size() + c.full_evictable_size() + c.full_protected_size()
        swa = a.swa_available_size() + c.swa_evictable_size() + c.swa_protected_size()
        return {"full": self.baseline[0] - full, "swa": self.baseline[1] - swa}

    def is_python_core(self) -> bool:
        from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

        return isinstance(self.core, UnifiedTreeCore)


def rows_as_written(pool: Any, max_ctx: int) -> Any:
    """``pool`` (a ``ReqToTokenPool`` built one token wide) with rows ``max_ctx`` wide whose memory is
    committed as they are written. The engine's pool is rows x context length of zeros; the replay's
    rows hold what its requests write, so one long request in a trace does not cost every row its
    length: the rows live in an anonymous mapping, whose untouched pages read as zeros and stay
    unmapped (torch.zeros' memset would commit them all, numpy's calloc asks for transparent huge
    pages: 2 MiB a touched row)."""
    import mmap

    import torch

    rows = pool.req_to_token.shape[0]
    pool.req_to_token = torch.frombuffer(mmap.mmap(-1, rows * max_ctx * 4), dtype=torch.int32).view(rows, max_ctx)
    pool.max_context_len = max_ctx
    return pool


def build(geometry: Geometry = SMALL, backend: str = "python", session: bool = False,
          eviction_policy: str = "lru", kv_dtype: Any = None, hicache: HiCache | None = None,
          dsv4: Any = None) -> CacheKit:
    """A real ``UnifiedRadixCache`` with FULL + SWA components on CPU (the construction of the
    upstream kit's ``build_fixture``, without its inspector). ``backend`` is ``"python"``,
    ``"rust"`` or ``None`` (None: the env var / default, as the engine does); ``session`` turns on
    the session radix cache (its LRU ``mid`` partition); ``kv_dtype``: the KV pools' dtype
    (bfloat16 when None); ``hicache``: HiCache attached (:class:`HiCache`); ``dsv4``: a
    :class:`.dsv4_pool.Dsv4Pool`: SGLang's ``DeepSeekV4TokenToKVPool`` at those sizes instead of a
    one-layer ``SWAKVPool`` (the geometry's pool sizes become the configured ones; with ``hicache``,
    SGLang's DeepSeek-V4 host stack)."""
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    g = geometry if dsv4 is None else geometry.with_pools(full_tokens=dsv4.full, swa_tokens=dsv4.swa)
    server_args = set_server_args(g.page, hicache)
    pool = rows_as_written(ReqToTokenPool(size=g.max_reqs, max_context_len=1, device="cpu", enable_memory_saver=False),
                           g.max_ctx)
    if dsv4 is not None:
        from overlay_tools.simulate import dsv4_pool

        _, allocator = dsv4_pool.build_kv(dsv4, pool)
    else:
        dtype = torch.bfloat16 if kv_dtype is None else kv_dtype
        kv = SWAKVPool(size=g.full_tokens, size_swa=g.swa_tokens, page_size=g.page, dtype=dtype,
                       head_num=1, head_dim=1, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
                       device="cpu")
        allocator = SWATokenToKVPoolAllocator(size=g.full_tokens, size_swa=g.swa_tokens, page_size=g.page,
                                              dtype=dtype, device="cpu", kvcache=kv, need_sort=False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, page_size=g.page,
        sliding_window_size=g.window, tree_components=(ComponentType.FULL, ComponentType.SWA),
        chunked_prefill_size=g.chunk, eviction_policy=eviction_policy,
        enable_session_radix_cache=session, tree_core_backend=backend,
    )
    cache = UnifiedRadixCache(params=params)
    if hicache is not None:
        attach_hicache(cache, params, server_args)
    return CacheKit(g, cache, allocator, pool, cache._tree_core_backend)
