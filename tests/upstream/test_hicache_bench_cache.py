"""``bench hicache --quick`` (form ``cache``): its rows on SGLang's real ``UnifiedRadixCache`` with
HiCache attached, checked against what each tier must do on the idle-session workload whose churn
presses the Full pool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.bench import hicache
from devkit.bench.hicache import cache as cache_form
from overlay_tools.simulate import cache_kit

ROOT = Path(__file__).resolve().parents[2]
HISTORY = 2 * (cache_form.IDLE_LEN + cache_form.PAGE)  # two idle sessions: prompt + one page of output each


def test_full_pool_churn_costs_stock_both_histories_and_a_large_host_tier_loads_them_back_whole():
    stock = cache_form.run_row("idle_full", False, None)
    hicache = cache_form.run_row("idle_full", False, cache_kit.HiCache(ratio=4.0, write_policy="write_through"))
    assert stock["recomputed"] == HISTORY and stock["loaded_from_host"] == 0
    assert stock["d2h_tokens"] == stock["h2d_tokens"] == {} and stock["bytes_d2h"] == stock["bytes_h2d"] == 0
    assert hicache["recomputed"] == 0 and hicache["loaded_from_host"] == HISTORY
    # the Full KV came back from host (every history token), the windows too; write-through backed up the Full pool
    assert hicache["h2d_tokens"]["kv"] == HISTORY and hicache["h2d_tokens"]["swa"] > 0
    assert hicache["d2h_tokens"]["kv"] >= HISTORY and hicache["bytes_h2d"] > 0 and hicache["bytes_d2h"] > 0
    assert stock["leak"] == hicache["leak"] == 0


def test_a_host_tier_half_the_device_pools_loses_the_idle_sessions_to_the_same_churn():
    small = cache_form.run_row("idle_full", False, cache_kit.HiCache(ratio=0.5, write_policy="write_through"))
    assert small["recomputed"] == HISTORY and small["loaded_from_host"] == 0 and small["h2d_tokens"] == {}
    assert small["d2h_tokens"]["kv"] > 0 and small["leak"] == 0


def test_beside_a_write_back_host_tier_the_cone_loads_a_branched_sessions_full_kv_and_recomputes_n_not_its_history():
    """``branch`` with write-back and a host tier 1x the device: the branched sessions' Full KV goes
    to host with the churn and their windows go nowhere. Stock + HiCache re-prefills both histories;
    thin + cone + HiCache loads the Full KV back (HiCache's own counters move) and replays N."""
    from overlay_tools.simulate.cone_turn import install

    install(cache_form.CONE_TOKENS, DSV41_SWA_THIN="1")
    wb = cache_kit.HiCache(ratio=1.0, write_policy="write_back")
    stock = cache_form.run_row("branch", False, wb)
    cone = cache_form.run_row("branch", True, wb)
    assert stock["recomputed"] == HISTORY and "cone" not in stock
    c = cone["cone"]
    assert c["loads"] >= 1 and c["fallbacks"] == {} and c["replayed"] == c["plans"]
    assert cone["recomputed"] <= (HISTORY - c["loaded_tokens"]) + c["replayed"] * (cache_form.CONE_TOKENS + cache_form.PAGE)
    assert cone["recomputed"] < stock["recomputed"] and cone["h2d_tokens"]["kv"] >= c["loaded_tokens"] > 0
    assert stock["leak"] == cone["leak"] == 0


@pytest.mark.slow
@pytest.mark.spawns
def test_the_quick_run_says_it_ran_the_cache_form_and_its_last_line_keeps_the_row_schema():
    out = subprocess.run([sys.executable, "-m", "adapter", "bench", "hicache", "--quick"], capture_output=True,
                         text=True, timeout=600, cwd=ROOT, check=True).stdout.splitlines()
    figures = json.loads(out[-1])
    assert figures["bench"] == "hicache" and figures["quick"] is True and figures["form"] == "cache"
    hicache.check_rows(figures["rows"])
    rows = {(r["workload"], r["name"]): r for r in figures["rows"]}
    assert {w for w, _ in rows} == {"idle_swa", "idle_full", "agent", "branch"}
    assert all(r["ttft_s"] is None and r["logprob_max_diff"] is None for r in rows.values())
    assert any(line.startswith("form cache (SGLang's UnifiedRadixCache + HiCache in-process") for line in out)
    assert rows["idle_full", "stock"]["recomputed"] == HISTORY and rows["idle_full", "stock_hicache"]["recomputed"] == 0
    assert rows["branch", "profile_hicache_wb"]["recomputed"] < rows["branch", "stock_hicache_wb"]["recomputed"]
    assert any(line.startswith("cone: cache branch profile_hicache_wb: plans ") for line in out)
