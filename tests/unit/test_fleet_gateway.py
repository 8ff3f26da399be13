"""The pinned gateway (smg, constraints.txt): its installed CLI defaults for cache_aware are the ones
bench fleet reports and the fleet replay models, read from the router's own start line; the router
bench fleet starts is stopped with nothing left running."""

from __future__ import annotations

import pytest

from devkit.bench.fleet import gateway
from devkit.engine_kit import launcher

smg = pytest.importorskip("smg")


def test_the_installed_smg_is_the_pinned_version():
    from importlib.metadata import version

    assert version("smg") == gateway.SMG_VERSION


@pytest.mark.spawns
def test_the_routers_start_line_states_the_pinned_cache_aware_defaults_and_the_router_stops_clean(tmp_path):
    """No worker answers on the listed port, so the router never becomes ready: start() gives up
    after its timeout and stops the router's process group; its log still carries the start line."""
    router = gateway.Gateway([f"http://127.0.0.1:{launcher.free_port()}"], "cache_aware", tmp_path / "router.log",
                             ready_timeout_s=8)
    with pytest.raises(launcher.ServerFailed):
        router.start()
    group = router.proc.pid
    settings = gateway.policy_settings(router.log_lines())
    assert settings["policy"] == "CacheAware"
    pinned = {k: type(v)(settings[k]) for k, v in gateway.CACHE_AWARE_DEFAULTS.items()}
    assert pinned == gateway.CACHE_AWARE_DEFAULTS
    assert launcher.members(group) == []


def test_router_counters_sum_the_policys_branches_by_label():
    page = (
        "# TYPE smg_cache_aware_policy_branch_total counter\n"
        'smg_cache_aware_policy_branch_total{branch="tree_match",model="m"} 5\n'
        'smg_cache_aware_policy_branch_total{branch="spill",model="m"} 2\n'
        'smg_cache_aware_policy_branch_total{branch="spill",model="n"} 1\n'
        "# TYPE smg_worker_retries_total counter\n"
        'smg_worker_retries_total{worker="w"} 3\n'
    )
    assert gateway.router_counters(page, "cache_aware") == {"branches": {"spill": 3, "tree_match": 5}, "retries": 3}
    assert gateway.router_counters(page, "round_robin") == {"branches": {}, "retries": 3}


# two lines of a real smg 1.13.0 router log (ANSI colours as it writes them), a veto set and cleared
VETO_LINES = [
    "\x1b[2m2026-12-06 05:42:30\x1b[0m \x1b[32m INFO\x1b[0m \x1b[2msmg::worker::monitor\x1b[0m\x1b[2m:\x1b[0m "
    "\x1b[2mmodel_gateway/src/worker/monitor.rs\x1b[0m\x1b[2m:\x1b[0m\x1b[2m505:\x1b[0m Worker overload veto set "
    "\x1b[3mworker_url\x1b[0m\x1b[2m=\x1b[0mhttp://127.0.0.1:33663 \x1b[3moverloaded\x1b[0m\x1b[2m=\x1b[0mtrue "
    "\x1b[3mwaiting_requests\x1b[0m\x1b[2m=\x1b[0m3 \x1b[3mkv_pressure\x1b[0m\x1b[2m=\x1b[0m0.9658 "
    "\x1b[3mwaiting_threshold\x1b[0m\x1b[2m=\x1b[0mSome(8)",
    "\x1b[2m2026-12-06 05:42:40\x1b[0m \x1b[32m INFO\x1b[0m \x1b[2msmg::worker::monitor\x1b[0m\x1b[2m:\x1b[0m "
    "\x1b[2mmodel_gateway/src/worker/monitor.rs\x1b[0m\x1b[2m:\x1b[0m\x1b[2m505:\x1b[0m Worker overload veto cleared "
    "\x1b[3mworker_url\x1b[0m\x1b[2m=\x1b[0mhttp://127.0.0.1:33663 \x1b[3moverloaded\x1b[0m\x1b[2m=\x1b[0mfalse "
    "\x1b[3mwaiting_requests\x1b[0m\x1b[2m=\x1b[0m0 \x1b[3mkv_pressure\x1b[0m\x1b[2m=\x1b[0m0.0 "
    "\x1b[3mwaiting_threshold\x1b[0m\x1b[2m=\x1b[0mSome(8)",
]


def test_an_overload_veto_is_read_from_the_poll_that_set_it_to_the_poll_that_cleared_it():
    import calendar
    import time

    found = gateway.vetoes(VETO_LINES)
    set_s = calendar.timegm(time.strptime("2026-12-06 05:42:30", "%Y-%m-%d %H:%M:%S"))
    assert found == [gateway.Veto("http://127.0.0.1:33663", set_s, set_s + 10, 3, 0.9658)]
    assert gateway.vetoes(VETO_LINES[:1])[0].cleared_s is None


def test_a_worker_counts_as_polled_only_once_the_routers_page_carries_its_engine_load():
    """The bench starts its client once every worker's load was polled: until then smg's expected
    wait scores an unpolled worker as the best reporting peer (ties at best), so early misses herd."""
    page = (
        "# TYPE smg_worker_requests_active gauge\n"
        'smg_worker_requests_active{worker="http://127.0.0.1:40001"} 0\n'
        'smg_worker_requests_active{worker="http://127.0.0.1:40002"} 0\n'
        "# TYPE smg_engine_running_requests gauge\n"
        'smg_engine_running_requests{worker="http://127.0.0.1:40001",model="/m",dp_rank="0"} 0\n'
    )
    assert gateway.polled_workers(page) == {"http://127.0.0.1:40001"}
    both = page + 'smg_engine_running_requests{worker="http://127.0.0.1:40002",model="/m",dp_rank="0"} 1\n'
    assert gateway.polled_workers(both) == {"http://127.0.0.1:40001", "http://127.0.0.1:40002"}
