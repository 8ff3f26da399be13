"""SWA thin on the cache kit (:mod:`devkit.testkit.radix_cache`), as the benches and ``simulate`` build it.

* :func:`install_thin`: SWA thin (and the fast tree core it turns on) through the real boot path;
* :func:`swa_pool_for_tails`: the cap-mode SWA pool of SGLang's real ``DSV4PoolConfigurator`` formula
  for ``--swa-prefix-tails`` at DSV4 geometry (page 256, window 128, chunk 8192, 64 running requests);
* :func:`cache_kit` / :func:`traffic_unit`: the cache kit at a scaled DSV4 shape (page 16, window 8,
  chunk 128), thin on or kept stock, HiCache attached when asked, and one unit of other traffic.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

from devkit.testkit import radix_cache as rc

DSV4_PAGE, DSV4_WINDOW, DSV4_CHUNK, DSV4_MAX_RUNNING = 256, 128, 8192, 64
PAGE, WINDOW, CHUNK = 16, 8, 128  # the scaled shape of cache_kit


def server_args(page: int = DSV4_PAGE, chunk: int = DSV4_CHUNK, max_running: int = DSV4_MAX_RUNNING) -> None:
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(
        model_path="dummy", page_size=page, chunked_prefill_size=chunk, max_running_requests=max_running))
    rc._SERVER_ARGS_PAGE[:] = [page]


def swa_pool_for_tails(tails: int, max_running: int = DSV4_MAX_RUNNING, page: int = DSV4_PAGE, window: int = DSV4_WINDOW,
                       chunk: int = DSV4_CHUNK) -> dict[str, int]:
    """The cap-mode SWA pool of the real configurator formula, and what the simulation gets (sets
    the process-global ServerArgs the formula reads: page, chunk, max running requests)."""
    from sglang.srt.model_executor.pool_configurator import DSV4PoolConfigurator, compute_swa_request_cap

    server_args(page, chunk, max_running)
    configurator = SimpleNamespace(  # the attributes _resolve_swa_cap_tokens reads
        operator_swa_ratio=None, _unified=False, requested_max_running_requests_per_worker=max_running,
        sliding_window_size=window, disaggregation_mode="null", page_size=page, attn_dp_size=1,
        swa_prefix_tails=tails)
    pool = DSV4PoolConfigurator._resolve_swa_cap_tokens(configurator)
    cap_all = compute_swa_request_cap(page_size=page, window=window, attn_dp_size=1, max_running_requests=max_running)
    cap_one = compute_swa_request_cap(page_size=page, window=window, attn_dp_size=1, max_running_requests=1)
    return {"tails": tails, "swa_pool": pool, "request_cap": cap_all, "headroom": tails * (window + page),
            "simulated_pool": (pool - cap_all + cap_one) // page * page}


def install_thin() -> None:
    """SWA thin (and the fast tree core it turns on) installed in this process, or an error naming why not."""
    import importlib
    import os

    from adapter.core import boot

    os.environ.pop("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", None)
    state = boot.install({"DSV41_SWA_THIN": "1"})
    importlib.import_module("sglang.srt.mem_cache.unified_radix_cache")
    for name in ("fast_tree_core", "swa_thin"):
        if state.outcomes[name].status != "installed":
            raise RuntimeError(f"{name} did not install: {state.outcomes[name].reason}")


def cache_kit(full_tokens: int, swa_tokens: int, thin: bool, hicache: rc.HiCache | None) -> Any:
    """The cache kit at the scaled shape's page, window and chunk (Python tree core), SWA thin's demotion
    on or kept stock, HiCache attached when ``hicache`` is given."""
    from adapter.switches import swa_thin as switch

    geometry = rc.Geometry(PAGE, WINDOW, CHUNK, full_tokens=full_tokens, swa_tokens=swa_tokens, max_reqs=8,
                           max_ctx=1 << 16)
    kit = rc.build(geometry, backend="python", hicache=hicache)
    if not thin:
        switch.keep_stock(kit.cache)
    return kit


def traffic_unit(kit: rc.CacheKit, tok: rc.Tokens, rng: random.Random, unit: int, long_len: int = 8192) -> None:
    """One unit of other traffic at the scaled shape: every sixth unit a new ``long_len``-token session, else a sub-agent
    (a 256-768-token chunked turn and a short follow-up)."""
    if unit % 6 == 0:  # a new long session: one chunked turn
        kit.run_turn(tok.fresh(long_len), PAGE)
    else:  # a sub-agent: a chunked turn and a short follow-up turn
        first = kit.run_turn(tok.fresh(rng.randint(16, 48) * PAGE), rng.randint(1, 4) * PAGE)
        kit.run_turn(first.history + tok.fresh(rng.randint(2, 8) * PAGE), rng.randint(1, 4) * PAGE)
