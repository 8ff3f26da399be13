"""End-to-end: the switches that need no DSV4 forward change act on the real DSV4 kit server (slow:
six boots, two at a time, each always stopped).

The server is SGLang 0.5.23's real one serving the kit's seeded tiny ``DeepseekV4ForCausalLM``
(``devkit/engine_kit/dsv4``: real ``DeepSeekV4TokenToKVPool``, 256-token SWA pages, window 128,
``UnifiedRadixCache`` FULL + SWA, 256-token chunks). Boots (workloads in
:mod:`devkit.engine_kit.dsv4.workloads`):

* ``stock`` (8 SWA pages, ``--decode-log-interval 1``): resume after churn, the yield phase, the crowd;
* ``thin`` (``DSV41_SWA_THIN=1``, same geometry): resume after churn;
* ``yield`` (``DSV41_DECODE_YIELD=50``, same geometry and log interval): the yield phase;
* ``park`` (``DSV41_KV_PARK=ram``, 2048-token pool that forces retractions): the crowd;
* ``roomy`` (stock, 16384-token pool and SWA ratio 1.0: no retraction): the crowd;
* ``retract`` (stock, the park boot's pool and retraction hook): the crowd (the park test's control).
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from devkit.engine_kit import launcher
from devkit.engine_kit.dsv4 import checkpoint, launch, workloads
from devkit.gate.verdict import decode_steps_between_chunks

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

STEP_LOG = ("--decode-log-interval", "1")
BOOTS = {
    "stock": ({}, workloads.SWA_GEOMETRY, STEP_LOG, ("resume", "yield", "crowd")),
    "thin": ({"DSV41_SWA_THIN": "1"}, workloads.SWA_GEOMETRY, (), ("resume",)),
    "park": ({"DSV41_KV_PARK": "ram", "DSV41_DEBUG_LOG": "1"}, workloads.SMALL_POOL, (), ("crowd",)),
    "roomy": ({}, workloads.ROOMY_POOL, (), ("crowd",)),  # the crowd without retraction
    "retract": ({}, workloads.SMALL_POOL, (), ("crowd",)),  # stock, the park boot's retractions (control)
    "yield": ({"DSV41_DECODE_YIELD": "50"}, workloads.SWA_GEOMETRY, STEP_LOG, ("yield",)),
}
# Besides the full pool: SGLang's retraction test hook retracts a decode row every 3 steps, so rows
# are also retracted off a page boundary. A pool-full retraction on 256-token pages always happens
# at one (the row needs a new page), where the tree's last-token rule (match <= len - 1) leaves a
# 256-token-shorter prefix whose SWA window (128 < 256) is gone, so kv_park drops the entry (read from
# the code; a pool-full-only boot parked 1 row and restored none: /work/notes/15-switches.md).
SERVER_ENV = {"park": {"SGLANG_TEST_RETRACT": "1"}, "retract": {"SGLANG_TEST_RETRACT": "1"}}
RUN = {"resume": workloads.resume_after_churn, "yield": workloads.yield_phase, "crowd": workloads.crowd}


def _boot(name: str, model, logs) -> dict:
    profile, geometry, extra, phases = BOOTS[name]
    server = launch.server(model, logs / f"{name}.log", profile, ready_timeout_s=600, extra=extra, **geometry)
    server.env.update(SERVER_ENV.get(name, {}))  # not DSV41_* keys: set on this server only
    with server:
        t0 = time.monotonic()
        out = {}
        for phase in phases:
            start = len(server.log_lines())
            out[phase] = RUN[phase](server.base_url)
            out[f"{phase}_log"] = server.log_lines()[start:]  # this phase's scheduler lines
        out["workload_s"] = time.monotonic() - t0
        group = server.proc.pid
    out["startup_s"] = server.startup_s
    out["log"] = server.log_lines()
    out["survivors"] = launcher.members(group)
    print(f"\n[dsv4 switches] {name}: boot to ready {server.startup_s:.1f} s, workload {out['workload_s']:.1f} s")
    return out


@pytest.fixture(scope="module")
def boot(tmp_path_factory):
    """``boot(*names)``: the results of those boots (each booted once per module, two at a time)."""
    model = checkpoint.make_checkpoint(tmp_path_factory.mktemp("dsv4") / "ckpt")
    logs = tmp_path_factory.mktemp("logs")
    pool = concurrent.futures.ThreadPoolExecutor(2)  # two servers at a time on a shared machine
    futures: dict[str, concurrent.futures.Future] = {}

    def get(*names: str) -> list[dict]:
        for name in names:
            if name not in futures:
                futures[name] = pool.submit(_boot, name, model, logs)
        out = []
        for name in names:
            try:
                got = futures[name].result()
            except Exception as exc:
                pytest.fail(f"the {name} boot failed: {exc}")
            assert got["survivors"] == [], f"{name} left processes behind"
            out.append(got)
        return out

    yield get
    pool.shutdown(wait=True)


def _installed(log: list[str], switch: str) -> bool:
    return any(f"[dsv41] {switch} installed" in line for line in log)


def test_swa_thin_keeps_an_idle_sessions_resume_point_through_churn_that_evicts_it_in_stock(boot):
    stock, thin = boot("stock", "thin")
    assert _installed(thin["log"], "swa_thin") and _installed(thin["log"], "fast_tree_core")
    assert not _installed(stock["log"], "swa_thin")
    assert stock["resume"]["resume_cached_tokens"] == 0, "stock must lose the resume point in this workload"
    assert thin["resume"]["resume_cached_tokens"] == workloads.SESSION
    # Fast tree core (turned on by thin) and the reordered LRU change no token.
    assert thin["resume"]["outputs"] == stock["resume"]["outputs"]


def test_decode_yield_runs_decode_steps_between_chunks_where_stock_runs_none(boot):
    stock, yielded = boot("stock", "yield")
    assert _installed(yielded["log"], "decode_yield")
    stock_gaps = decode_steps_between_chunks(stock["yield_log"])
    gaps = decode_steps_between_chunks(yielded["yield_log"])
    print(f"\n[dsv4 switches] decode steps between chunks: stock {stock_gaps}, yield {gaps}")
    chunks = workloads.LONG // 256
    assert len(stock_gaps) == len(gaps) == chunks - 1, (stock_gaps, gaps)
    assert yielded["yield"]["streams_ran_through"] and stock["yield"]["streams_ran_through"]
    assert all(g >= 1 for g in gaps) and sum(gaps) > sum(stock_gaps), (stock_gaps, gaps)
    # Same greedy tokens: the long prompt whole, the streams on the prefix both boots generated.
    assert yielded["yield"]["long"] == stock["yield"]["long"]
    for a, b in zip(stock["yield"]["streams"], yielded["yield"]["streams"]):
        n = min(len(a), len(b))
        assert n > 0 and a[:n] == b[:n]


@pytest.mark.xfail(strict=True, reason=(
    "kv_park on the DSV4 server (measured 10:42, 10:49): 44 hook retractions, 44 parks, 1 restore "
    "(pages=1 tokens=512 cached=256), and that crowd row's greedy tokens differ from the roomy boot's; the "
    "same retractions without parking (test_stock_retractions_...) give the roomy tokens. See "
    "/work/notes/15-switches.md"))
def test_kv_park_restores_retracted_rows_with_the_tokens_of_an_unretracted_run(boot):
    park, roomy = boot("park", "roomy")
    log = park["log"]
    assert _installed(log, "kv_park")
    assert not [line for line in log if "kv_park disabled" in line or "kv_park unsupported" in line]
    assert sum(r["meta_info"]["num_retractions"] for r in roomy["crowd"]) == 0, "the roomy pool must not retract"
    retractions = sum(r["meta_info"]["num_retractions"] for r in park["crowd"])
    parks = [line for line in log if "[dsv41] kv_park parked" in line]
    restores = [line for line in log if "[dsv41] kv_park restored" in line]
    print(f"\n[dsv4 switches] kv_park: {retractions} retractions, {len(parks)} parks, {len(restores)} restores")
    for line in parks[:3] + restores[:3]:
        print(line)
    # The hook retracts before the 2048-token pool fills (without it the pool-full retraction parks
    # its row but never restores it: see SERVER_ENV and /work/notes/15-switches.md).
    assert retractions >= 1 and any("Testing retraction" in line for line in log)
    assert parks and restores, f"{retractions} retractions, {len(parks)} parks, {len(restores)} restores"
    assert [r["output_ids"] for r in park["crowd"]] == [r["output_ids"] for r in roomy["crowd"]]


def test_stock_retractions_on_the_same_pool_give_the_tokens_of_an_unretracted_run(boot):
    """The control for the kv_park test: the same retractions without parking."""
    retract, roomy = boot("retract", "roomy")
    assert sum(r["meta_info"]["num_retractions"] for r in retract["crowd"]) >= 1
    assert [r["output_ids"] for r in retract["crowd"]] == [r["output_ids"] for r in roomy["crowd"]]


def test_every_profile_boot_gives_the_stock_boots_greedy_tokens_on_the_same_prompts(boot):
    stock, thin, yielded, roomy = boot("stock", "thin", "yield", "roomy")
    assert thin["resume"]["outputs"] == stock["resume"]["outputs"]
    assert yielded["yield"]["long"] == stock["yield"]["long"]
    # The crowd: the stock boot's 8 SWA pages retract one row; recomputed, it decodes the roomy
    # pool's tokens. (The park boot's crowd: its own test, marked xfail.)
    assert [r["output_ids"] for r in stock["crowd"]] == [r["output_ids"] for r in roomy["crowd"]]
    for name, got in (("stock", stock), ("thin", thin), ("yield", yielded), ("roomy", roomy)):
        assert got["startup_s"] is not None and got["startup_s"] < 600, name
