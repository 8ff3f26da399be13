"""SGLang's own server test kits (``sglang.test.kl_multiturn_utils``, ``sglang.test.kits``) against
the kit servers, stock and with the gate's profile (every acting switch: decode yield, SWA thin,
cone replay at the kit's N), one boot each (:mod:`devkit.engine_kit.upstream_kits` runs them).

What must hold: the KL of every flow passes on every turn on both boots, the SWA-pressure flow
included; every cache assert the profile fails, stock fails too (an assert stock fails is recorded
as cached / expected, not skipped); the radix, abort-all and streaming-session kits pass on both.

The Mellum kit runs in CI's lane (two boots: 495 s and 898 s in two runs on this shared 2-core
machine); the DSV4 kit is ``heavy`` (two boots, 1,994 s together at load 13 on 2 cores: its decode
steps take about a second, so its turns generate 4 tokens). On the DSV4 kit stock itself
exceeds the KL threshold on some runs (``multiturn`` with three turns, ``decode_hit`` with three:
1.5e-3 and 1.2e-3): there the contract is that every KL run the profile fails, stock fails too, with
both figures in the printed table; every flow runs on CPU (none is skipped).
"""

from __future__ import annotations

import pytest

from devkit.engine_kit import model_kits, upstream_kits
from devkit.gate.verdict import build_profile

pytestmark = pytest.mark.slow

MELLUM = upstream_kits.Sizes(vocab=1024, prompt=200, suffix=40, out=16, pressure_prompt=600, pressure_samples=8,
                             request_length=256, clients=8, radix_nodes=24, radix_chunk=64)
DSV4 = upstream_kits.Sizes(vocab=1024, prompt=512, suffix=256, out=4, pressure_prompt=1536, pressure_samples=3,
                           request_length=768, clients=3, radix_nodes=8, radix_chunk=256)
STREAMING = ["--enable-streaming-session"]


def _profile(kit) -> dict[str, str]:
    profile = build_profile()
    profile.update({k: v for k, v in kit.profile_overrides().items() if k in profile})
    return profile


def _boot(kit, model, log, profile, sizes, dataset) -> dict:
    """Every check on one boot; each check's result is written beside the log as it lands
    (``<log>.json``: a long DSV4 run stopped midway keeps what it measured)."""
    import json

    from transformers import AutoTokenizer

    out: dict = {}
    with kit.server(model, log, profile, STREAMING) as server:
        url, page = server.base_url, _page(server.base_url)
        checks = {"kl": lambda: upstream_kits.run_kl(url, page, sizes),
                  "cache_hit": lambda: upstream_kits.run_cache_hit(url, str(model), dataset, page, sizes),
                  "radix": lambda: upstream_kits.run_radix(url, sizes),
                  "abort_all": lambda: upstream_kits.run_abort_all(url, server.proc),
                  "streaming_session": lambda: upstream_kits.run_streaming_session(
                      url, AutoTokenizer.from_pretrained(model))}
        for name, check in checks.items():
            out[name] = check()
            log.with_suffix(".json").write_text(json.dumps(out, default=str))
    return out


def _page(url: str) -> int:
    import requests

    return int(requests.get(url + "/server_info", timeout=30).json()["page_size"])


def _run(kit, sizes, tmp_path_factory) -> dict[str, dict]:
    from devkit.engine_kit import model as mk

    root = tmp_path_factory.mktemp(kit.name)
    model = kit.build(root / "model")
    dataset = upstream_kits.write_sharegpt(root / "sharegpt.json", list(mk._WORDS))
    results = {"stock": _boot(kit, model, root / "stock.log", {}, sizes, dataset)}
    results["profile"] = _boot(kit, model, root / "profile.log", _profile(kit), sizes, dataset)
    print(f"\n{kit.name} (profile {_profile(kit)})\n" + upstream_kits.table(results))
    return results


@pytest.fixture(scope="module")
def mellum(tmp_path_factory):
    return _run(model_kits.MellumKit(), MELLUM, tmp_path_factory)


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    return _run(model_kits.Dsv4Kit(), DSV4, tmp_path_factory)


def _kl_failed_runs(results: dict, boot: str) -> set[tuple[str, int]]:
    """(flow, run) of every KL run over the threshold (or not measured) on ``boot``."""
    return {(flow, i) for flow, r in results[boot]["kl"].items() for i, k in enumerate(r["kl"])
            if k is None or k >= upstream_kits.KL_THRESHOLD}


def _kl_fails(results: dict) -> dict:
    return {(boot, flow): r["kl"] for boot, res in results.items() for flow, r in res["kl"].items()
            if any(k is None or k >= upstream_kits.KL_THRESHOLD for k in r["kl"])}


def _cache_fails_beyond_stock(results: dict) -> dict:
    """Cache asserts the profile fails where stock passes (per flow and turn label; cache_hit_kit's rounds)."""
    out = {}
    for flow, r in results["profile"]["kl"].items():
        stock = {c["label"].split("]", 1)[1]: c["passed"] for c in results["stock"]["kl"][flow]["cache"]}
        for c in r["cache"]:
            if not c["passed"] and stock.get(c["label"].split("]", 1)[1], False):
                out[(flow, c["label"])] = c
    for r, row in results["profile"]["cache_hit"]["rounds"].items():
        if row["clients_under"] > results["stock"]["cache_hit"]["rounds"][r]["clients_under"]:
            out[("cache_hit", r)] = row
    return out


def _kits_failed(results: dict) -> dict:
    return {(boot, check): res[check] for boot, res in results.items()
            for check in ("radix", "abort_all", "streaming_session") if not res[check]["passed"]}


def test_upstream_kl_passes_on_every_flow_and_turn_stock_and_profile_on_the_mellum_kit(mellum):
    assert _kl_fails(mellum) == {}


def test_upstream_cache_asserts_the_profile_fails_stock_fails_too_on_the_mellum_kit(mellum):
    assert _cache_fails_beyond_stock(mellum) == {}


def test_upstream_radix_abort_and_streaming_session_kits_pass_stock_and_profile_on_the_mellum_kit(mellum):
    assert _kits_failed(mellum) == {}


@pytest.mark.heavy
def test_upstream_kits_hold_on_the_dsv4_kit_where_stock_holds(dsv4):
    profile_only = _kl_failed_runs(dsv4, "profile") - _kl_failed_runs(dsv4, "stock")
    assert (profile_only, _cache_fails_beyond_stock(dsv4), _kits_failed(dsv4)) == (set(), {}, {})
