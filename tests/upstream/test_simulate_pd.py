"""``simulate --pd``: a DeepSeek-V4 PD decode node's retractions priced as SGLang's rebootstrap (the prefill
peer recomputes prompt + output and resends the KV) and as a park and restore (:mod:`overlay_tools.simulate.pd`),
on the replay's real ``DeepSeekV4TokenToKVPool`` at DeepSeek-V4.1's ratios (60 C4 layers, one C128)."""

from __future__ import annotations

import importlib
import json

import pytest

from adapter import cost_model
from adapter.core import env
from overlay_tools import simulate
from overlay_tools.simulate import dsv4_pool, fleet, pd, trace

importlib.import_module("sglang.srt.managers.scheduler")

PAGE, WINDOW, CHUNK, RUNNING = 256, 128, 1024, 4
V41_RATIOS = tuple([4] * 60 + [128])


def _fleet(full_pages: int) -> fleet.Fleet:
    pool = dsv4_pool.configure(ratios=V41_RATIOS, kv_sources=(), window=WINDOW, page=PAGE, chunk=CHUNK,
                               max_running=RUNNING, tails=2, full_tokens=full_pages * PAGE)
    return fleet.Fleet(page=PAGE, window=WINDOW, chunk=CHUNK, max_running=RUNNING, tails=2, swa_pool=pool.swa,
                       full_tokens=pool.full, full_source="test", cone_tokens=2048, cone_bound=2048, model="test",
                       profile="test", hicache_ratio=2.0, dsv4=pool)


def _trace(tmp_path, rows) -> list[trace.Request]:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                                        "hash_ids": ids}) + "\n" for ts, n_in, n_out, ids in rows))
    return trace.load(str(path), PAGE)


def test_a_full_page_weighs_every_c4_and_c128_layer_of_the_model_not_the_stand_in_layers():
    """The replay's pool has one layer per ratio; the price scales each region by the layers it stands for:
    the full page of 61 layers is the C4 region x 60 plus the C128 region, never the stand-ins' sum."""
    from adapter.switches.kv_park import regions
    from overlay_tools.simulate import cache_kit as rc

    geo = _fleet(full_pages=64)
    kit = rc.build(rc.Geometry(PAGE, WINDOW, CHUNK, full_tokens=geo.full_tokens, swa_tokens=geo.swa_pool,
                               max_reqs=RUNNING + 2, max_ctx=8192), backend=None, dsv4=geo.dsv4)
    pool = kit.allocator.get_kvcache()
    layout = regions.dsv4_full_layout(pool)
    by_ratio = {4: 0, 128: 0}
    for r in layout.regions:
        by_ratio[int(r.name[1:r.name.index("_")])] += r.row_bytes
    kv = pd.kv_bytes(pool, geo.dsv4)
    assert by_ratio[4] > 0 and by_ratio[128] > 0
    assert kv.full_page == 60 * by_ratio[4] + by_ratio[128]
    # the SWA page: the stand-in C4 layer's window rows and C4 state rings x 60, the C128 layer's window x 1
    swa = {r.name: r.row_bytes for r in regions.dsv4_swa_layout(pool).regions}
    assert set(swa) >= {"swa_kv.0", "swa_kv.1"} and geo.dsv4.layers == (4, 128)
    assert kv.swa_page == sum(b * (1 if name == "swa_kv.1" else 60) for name, b in swa.items())
    # a request of 300 tokens touches 2 full pages and keeps its window's SWA pages (at most 2 here)
    assert kv.of(300) == 2 * kv.full_page + 2 * kv.swa_page and kv.of(1) == kv.full_page + kv.swa_page


def test_each_retraction_is_priced_as_a_rebootstrap_of_prompt_and_output_and_as_a_park_of_the_same_kv():
    """Two retractions (prompts 512 and 1,024; 300 and 1 tokens decoded): the rebootstrap recomputes
    ``seqlen - 1`` tokens of each (811 + 1,024) in chunks on the cost model and resends their KV; the park
    copies the same bytes out and back and recomputes nothing."""
    kv = pd.KvBytes(full_page=1000, swa_page=100, page=PAGE, window=WINDOW)
    rows = [pd.Retraction(prompt=512, decoded=300), pd.Retraction(prompt=1024, decoded=1)]
    priced = pd.price(rows, kv, cost_model.DEFAULTS, CHUNK, link_gbps=1.0, host_gbps=2.0)
    assert priced["pd_retractions"] == 2
    assert priced["pd_rebootstrap_recomputed_tokens"] == 811 + 1024 and priced["pd_park_recomputed_tokens"] == 0
    moved = kv.of(811) + kv.of(1024)
    assert moved == (4 * 1000 + 2 * 100) + (4 * 1000 + 2 * 100)
    assert priced["pd_parked_gb"] == priced["pd_rebootstrap_sent_gb"] == round(moved / 1e9, 3)
    prefill_s = sum(cost_model.chunk_cost([(min(CHUNK, n - s), s)]) for n in (811, 1024) for s in range(0, n, CHUNK))
    assert priced["pd_rebootstrap_s_modelled"] == round(prefill_s / 1e15 + moved / 1e9, 3)
    assert priced["pd_park_s_modelled"] == round(2 * moved / 2e9, 3)


def test_a_dsv4_replay_that_retracts_prices_its_retraction_both_ways_and_a_roomy_pool_prices_none(tmp_path):
    """A (512-token prompt, 2,048 out) and B (512, 1,600) in a pool of 16 pages: B is admitted beside A once
    new_token_ratio has decayed and their pages outgrow the pool: the replay retracts one, and ``--pd``
    prices that retraction as a rebootstrap of its prompt + decoded tokens and as a park of their KV.
    Twice the pool: no retraction, nothing priced."""
    requests = _trace(tmp_path, [(0, 512, 2048, [1]), (0, 512, 1600, [2])])
    _, row = simulate.run_policy("stock", _fleet(full_pages=16), requests, progress=False, pd=(50.0, 25.0))
    assert row["retractions"] >= 1 and row["pd_retractions"] == row["retractions"]
    assert row["pd_rebootstrap_recomputed_tokens"] > 512 * row["pd_retractions"]  # prompt and output, each
    assert row["pd_parked_gb"] > 0 and row["pd_park_recomputed_tokens"] == 0
    assert row["pd_rebootstrap_s_modelled"] > row["pd_park_s_modelled"] > 0
    assert "rebootstrap" in pd.table({"stock": row})
    _, roomy = simulate.run_policy("stock", _fleet(full_pages=32), requests, progress=False, pd=(50.0, 25.0))
    assert roomy["retractions"] == 0 and roomy["pd_retractions"] == 0 and roomy["pd_rebootstrap_recomputed_tokens"] == 0


def test_pd_on_a_model_that_is_not_deepseek_v4_or_with_a_bad_bandwidth_is_refused_by_name():
    """SGLang rebootstraps only a DeepSeekV4TokenToKVPool: ``--pd`` on another model is a clear error, and so
    is a bandwidth that is not finite and positive, or a bandwidth without ``--pd``."""
    import argparse

    args = argparse.Namespace(pd=True, pd_link_gbps=None, pd_host_gbps=None)
    mellum = argparse.Namespace(dsv4=None)
    with pytest.raises(env.ConfigError, match=r"--pd.*DeepSeek-V4"):
        simulate.pd_bandwidths(args, mellum)
    dsv4 = argparse.Namespace(dsv4=object())
    assert simulate.pd_bandwidths(args, dsv4) == (pd.LINK_GBPS, pd.HOST_GBPS)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(env.ConfigError, match=r"--pd-link-gbps.*finite positive"):
            simulate.pd_bandwidths(argparse.Namespace(pd=True, pd_link_gbps=bad, pd_host_gbps=None), dsv4)
    with pytest.raises(env.ConfigError, match=r"--pd-host-gbps.*with --pd only"):
        simulate.pd_bandwidths(argparse.Namespace(pd=False, pd_link_gbps=None, pd_host_gbps=3.0), dsv4)
