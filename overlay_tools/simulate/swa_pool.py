"""The SWA pool SGLang's DeepSeek-V4 configurator gives for ``--swa-prefix-tails``: the cap-mode formula
of the real ``DSV4PoolConfigurator`` at the fleet's page, window, chunk and running requests, and what
``simulate``'s one-instance replay gets of it. The checkout's benches and tests import it from here.
"""

from __future__ import annotations

from types import SimpleNamespace

from overlay_tools.simulate.cache_kit import _SERVER_ARGS_PAGE

DSV4_PAGE, DSV4_WINDOW, DSV4_CHUNK, DSV4_MAX_RUNNING = 256, 128, 8192, 64


def server_args(page: int = DSV4_PAGE, chunk: int = DSV4_CHUNK, max_running: int = DSV4_MAX_RUNNING) -> None:
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(
        model_path="dummy", page_size=page, chunked_prefill_size=chunk, max_running_requests=max_running))
    _SERVER_ARGS_PAGE[:] = [page]


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
