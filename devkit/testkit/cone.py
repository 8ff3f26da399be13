"""Cone replay on the real cache kit (``overlay_tools.simulate.cache_kit``): a turn whose admission,
copy and checkpoints follow the scheduler's order, and a kit over a model's own ``SWAKVPool``.

Used by ``tests/upstream/test_cone_replay*.py`` and ``devkit/bench/cone_replay.py``. The switch must be
installed before a kit is built (its ``UnifiedRadixCache.__init__`` hook checks the bound).

API::

    kit = model_kit(model, geometry, backend)     # CacheKit over TinyHybrid.make_pool(...) (fp32)
    turn = cone_turn(kit, tokens, out_len, chunk=None, forward=None)
        # match (plan) -> a real PrefillAdder admits the first chunk (the installed
        # _select_prefill_admission applies the switch's rule; _commit_prefill_admission locks)
        # -> prefix row -> per chunk: alloc + row write [+ copy on the cone pass]
        # [+ forward(req, start, end, rows)] + checkpoint -> decode + release. Returns a ConeTurn.
    # the same in steps (overlay_tools.simulate.cone_turn, simulate's engine; import them from there):
    turn = start_turn(kit, tokens, out_len, chunk, budget=B)  # match, admission, first pass; None: not admitted
    prefill_pass(kit, turn, end)                  # the next pass [turn.pos, end) + its checkpoint
    end_turn(kit, turn, out_len, history=False)   # decode + release

What is real and what is the kit's: the match, the admission (``PrefillAdder.add_one_req`` through
the switch's wrapped ``_select_prefill_admission``) and the checkpoints are SGLang's own; the row
writes and the cone's copy are the kit's (the copy is the switch's ``copy_replay_rows``, called
where the switch's ``ScheduleBatch.prepare_for_extend`` wrapper calls it). The wrapped
``prepare_for_extend`` itself runs in ``tests/upstream/test_cone_replay_scheduler.py`` (a real
``Scheduler``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from devkit.testkit import cone_replay_parts as cone_replay
from overlay_tools.simulate import cache_kit
from overlay_tools.simulate import cone_turn as turn_steps


@contextmanager
def published_replay_rows(cone: tuple[Any, Any, Any] | None) -> Iterator[None]:
    """Publish a forward's replay rows ``(rows, F's tree slots, pool)`` for the duration of the
    block, as the switch's ``ModelRunner.forward`` wrapper does for a batch that carries them
    (``FORWARD_ATTR``); the installed ``RadixAttention.forward`` reads them. None: no replay."""
    cone_replay.LIVE.active = cone
    try:
        yield
    finally:
        cone_replay.LIVE.active = None


def model_kit(model: Any, geometry: cache_kit.Geometry, backend: str = "python",
              hicache: cache_kit.HiCache | None = None) -> cache_kit.CacheKit:
    """A real ``UnifiedRadixCache`` (FULL + SWA) whose allocator owns ``model``'s ``SWAKVPool``
    (``hicache``: HiCache attached, its host pools built from that pool)."""
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    g = geometry
    server_args = cache_kit.set_server_args(g.page, hicache)
    pool = ReqToTokenPool(size=g.max_reqs, max_context_len=g.max_ctx, device="cpu", enable_memory_saver=False)
    kv = model.make_pool(size=g.full_tokens, size_swa=g.swa_tokens, page=g.page)
    allocator = SWATokenToKVPoolAllocator(size=g.full_tokens, size_swa=g.swa_tokens, page_size=g.page,
                                          dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, page_size=g.page,
        sliding_window_size=g.window, tree_components=(ComponentType.FULL, ComponentType.SWA),
        chunked_prefill_size=g.chunk, eviction_policy="lru", tree_core_backend=backend,
    )
    cache = UnifiedRadixCache(params=params)
    if hicache is not None:
        cache_kit.attach_hicache(cache, params, server_args)
    return cache_kit.CacheKit(g, cache, allocator, pool, cache._tree_core_backend)


def recorder(model: Any, kit: cache_kit.CacheKit, rows_out: dict[int, Any]) -> Callable[[Any, int, int, dict[str, Any] | None], None]:
    """A ``cone_turn`` forward running ``model`` (``TinyHybrid``) on ``kit``'s own pool: each computed
    row's hidden state goes into ``rows_out`` by position (with the cone's floor and mask on a replay)."""

    def forward(req: Any, start: int, end: int, rows: dict[str, Any] | None) -> None:
        slots = kit.pool.req_to_token[req.kv.req_pool_idx, :end]
        tokens = list(req.origin_input_ids) + [cache_kit.OUTPUT_TOKEN] * (end - len(req.origin_input_ids))
        kw = {} if rows is None else {"floor": rows["floor"], "mask": rows["mask"]}
        for r, h in zip(range(start, end), model.forward(kit.allocator.get_kvcache(), slots, tokens, start, end, **kw)):
            rows_out[r] = h

    return forward


def cone_turn(kit: cache_kit.CacheKit, tokens: list[int], out_len: int, chunk: int | None = None,
              forward: Callable[[Any, int, int, dict[str, Any] | None], None] | None = None,
              rid: str | None = None) -> turn_steps.ConeTurn:
    """One turn in the scheduler's order with the switch's plan, admission rule (through a real
    ``PrefillAdder``) and copy: :func:`start_turn`, :func:`prefill_pass` until the prompt is in,
    :func:`end_turn`."""
    turn = turn_steps.start_turn(kit, tokens, out_len, chunk, forward=forward, rid=rid)
    assert turn is not None, "cone_turn: the PrefillAdder did not admit the request (budget)"
    chunk = chunk or kit.geometry.chunk
    while turn.pos < len(tokens):
        turn_steps.prefill_pass(kit, turn, min(len(tokens), turn.pos + chunk), forward)
    turn_steps.end_turn(kit, turn, out_len, forward)
    return turn
