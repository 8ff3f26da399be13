"""End-to-end: the native SWA decode switch's dispatch on SGLang 0.5.23's real server (DSV4 CPU engine).

Two boots of the kit's tiny DeepSeek-V4 (seeded checkpoint, real ``DeepSeekV4TokenToKVPool`` with
256-token SWA pages, real ``DeepseekV4AttnBackend``) whose decode is routed to SGLang's real SM120
entry by the switch's test-only stand-in (``devkit/engine_kit/dsv4/native_decode_route.py``):

* stock: ``DSV41_NATIVE_DECODE_STANDIN=...:stock``: the switch stays off; every decode copies the
  touched pages to 64-token pages (torch twin of the Triton split) and runs the reference on them;
* served: ``...:served``: the switch serves <= 64-row calls in place (the reference on the 256-token
  pool view, where the real module launches FlashInfer's kernel) and logs the > 64-row calls, which
  keep the stock prefill copy, as ``fallback reason=rows-over-64``.

In both boots every routed call is also run through the stock copy path and compared bit for bit
(``DSV4_NATIVE_DECODE_CHECK``). The workload has a 2-request phase (<= 64 rows) and a 66-request
phase (> 64 rows). Slow: two boots on a shared 2-core machine, one server at a time, always stopped.
What this cannot show: FlashInfer's kernel on SM120/SM121 (the reference stands in for it).
"""

from __future__ import annotations

import concurrent.futures
import json
import random

import pytest

from devkit.engine_kit import client, launcher
from devkit.engine_kit.dsv4 import checkpoint, launch

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

ROUTE = "devkit.engine_kit.dsv4.native_decode_route"
CROWD = 66  # > SM120_DECODE_MAX_TOKENS (64) decode rows once all are running
GEOMETRY = {"max_total_tokens": 38400, "max_running": 70, "chunk": 1024, "swa_ratio": 1.0}
DECODE = 24
CROWD_DECODE = 4  # 3 decode steps of 66 rows: the reference decode of a 66-row C4 layer takes seconds on CPU


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 1024) for _ in range(n)]  # ids below 6 are the tokenizer's specials


def _workload(url: str) -> dict:
    pair = [_ids(1, 300), _ids(2, 40)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        small = [r["output_ids"] for r in pool.map(lambda ids: client.generate(url, ids, DECODE), pair)]
    client.flush_cache(url)
    prompts = [_ids(100 + i, 8 + i % 5) for i in range(CROWD)]
    with concurrent.futures.ThreadPoolExecutor(CROWD) as pool:
        crowd = [r["output_ids"] for r in pool.map(lambda ids: client.generate(url, ids, CROWD_DECODE, timeout_s=900),
                                                   prompts)]  # fmt: skip
    return {"small": small, "crowd": crowd}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return checkpoint.make_checkpoint(tmp_path_factory.mktemp("dsv4") / "ckpt")


def _boot(model, folder, mode: str) -> dict:
    check = folder / f"{mode}.json"
    profile = {"DSV41_SWA_NATIVE_DECODE": "1", "DSV41_NATIVE_DECODE_STANDIN": f"{ROUTE}:{mode}"}
    server = launch.server(model, folder / f"{mode}.log", profile, ready_timeout_s=400, **GEOMETRY)
    server.env["DSV4_NATIVE_DECODE_CHECK"] = str(check)
    results = launcher.serve(server, lambda served: _workload(served.base_url))
    results["check"] = json.loads(check.read_text()) if check.is_file() else {}
    print(f"\n[native decode] {mode}: boot {server.startup_s:.1f} s, check {results['check']}")
    return results


@pytest.fixture(scope="module")
def boots(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("native_decode")
    return {mode: _boot(model, folder, mode) for mode in ("stock", "served")}


def _lines(log: list[str], text: str) -> list[str]:
    return [line for line in log if text in line]


def test_the_served_boot_installs_the_switch_and_the_stock_boot_keeps_it_off(boots):
    served, stock = boots["served"]["log"], boots["stock"]["log"]
    assert _lines(served, "swa_native_decode installed arch=standin page=256")
    assert _lines(stock, "swa_native_decode refused:") and not _lines(stock, "swa_native_decode installed")
    assert _lines(served, "Initialize DeepSeekV4TokenToKVPool") and _lines(served, "DeepseekV4AttnBackend")


def test_up_to_64_decode_rows_are_served_in_place_with_outputs_identical_to_the_stock_copy(boots):
    served = boots["served"]["check"]["rows<=64"]
    assert served["calls"] > 0 and served["served"] == served["calls"]
    assert served["identical"] == served["calls"]
    stock = boots["stock"]["check"]["rows<=64"]
    assert stock["served"] == 0 and stock["identical"] == stock["calls"] > 0
    assert len(_lines(boots["served"]["log"], "swa_native_decode serving arch=standin")) == 1


def test_more_than_64_decode_rows_keep_the_stock_prefill_copy_and_log_it_once(boots):
    served = boots["served"]["check"]["rows>64"]
    assert served["calls"] > 0 and served["max_rows"] > 64 and served["served"] == 0
    assert served["identical"] == served["calls"]
    assert len(_lines(boots["served"]["log"], "swa_native_decode fallback reason=rows-over-64")) == 1


def test_greedy_outputs_are_identical_with_and_without_the_switch_for_both_row_ranges(boots):
    for phase in ("small", "crowd"):
        assert boots["served"][phase] == boots["stock"][phase], phase
    assert all(len(ids) == CROWD_DECODE for ids in boots["served"]["crowd"])
    assert all(len(ids) == DECODE for ids in boots["served"]["small"])


def test_no_server_process_survives_its_boot(boots):
    assert boots["served"]["survivors"] == [] and boots["stock"]["survivors"] == []
