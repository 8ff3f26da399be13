"""End-to-end: ``DSV41_KV_PARK=ram`` in SGLang 0.5.23's real HTTP server on CPU (slow: three boots).

The kit's tiny hybrid SWA model runs on ``SWAKVPool`` (page size 1) with a small pool (640
tokens), so the tree has to give up what retracted rows leave in it. SGLang's own retraction test
hook (``SGLANG_TEST_RETRACT=1``: retract a decode row every 3 steps) drives the real
``update_running_batch -> retract_decode -> release_req`` path many times. With parking, retracted
rows come back from RAM and the greedy tokens equal those of a boot without retraction. Beside
HiCache (write-back, host tier 2x) the same, with only the tail the tree lacks parked and the rest
served by the tree (HiCache's load-back when it went to host).
"""

import re

import pytest

from devkit.engine_kit import client, launcher, model, workload
from devkit.testkit.hicache import hicache_flags

pytestmark = pytest.mark.slow
POOL_TOKENS = 640  # three prompts of 200-280 tokens plus their outputs do not fit with the tree's copies


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return model.make_model(tmp_path_factory.mktemp("kit") / "model")


def _run_streams(server: launcher.Server, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    streams = [client.Stream(server.base_url, f"park{i}", ids, new_tokens).start() for i, ids in enumerate(prompts)]
    for stream in streams:
        assert stream.join(240), f"{stream.rid} did not finish"
        assert stream.error is None, stream.error
    return [s.output_ids for s in streams]


NEW_TOKENS = 24


def _prompts() -> list[list[int]]:
    ids = workload.Workload()
    return [ids.ids(f"park{i}", 200 + 40 * i) for i in range(3)]


@pytest.fixture(scope="module")
def expected(tiny_model, tmp_path_factory):
    """The greedy tokens of a boot without retraction or parking."""
    log = tmp_path_factory.mktemp("plain") / "plain.log"
    with launcher.Server(launcher.server_args(tiny_model, launcher.free_port(), max_total_tokens=POOL_TOKENS), log, {}) as plain:
        return _run_streams(plain, _prompts(), NEW_TOKENS)


def test_the_cpu_engine_resumes_retracted_rows_from_ram_with_the_tokens_of_an_unretracted_run(
    tiny_model, tmp_path, monkeypatch, expected
):
    prompts, new_tokens = _prompts(), NEW_TOKENS

    monkeypatch.setenv("SGLANG_TEST_RETRACT", "1")  # inherited by the server (not a DSV41_* key)
    profile = {"DSV41_KV_PARK": "ram", "DSV41_DEBUG_LOG": "1"}
    parked = launcher.Server(launcher.server_args(tiny_model, launcher.free_port(), max_total_tokens=POOL_TOKENS), tmp_path / "parked.log", profile)
    with parked:
        got = _run_streams(parked, prompts, new_tokens)
    lines = parked.log_lines()

    assert any("[dsv41] kv_park installed" in line for line in lines)
    retractions = [line for line in lines if "Testing retraction" in line]
    parks = [line for line in lines if "[dsv41] kv_park parked" in line]
    restores = [line for line in lines if "[dsv41] kv_park restored" in line]
    # Re-admissions the tree already covers (nothing parked): kv_park keeps those pages pinned until admission.
    covered = [line for line in lines if "[dsv41] kv_park resumed_from_tree" in line]
    assert retractions, "the retraction test hook never fired"
    # Measured before pinning: 34 retractions, 30 parks, 20 restores; with the pin (12:39): 23
    # retractions, 12 parks, 1 restore and 11 re-admissions covered by the pinned tree pages (each a
    # hit of all but the last token).
    served = len(restores) + len(covered)
    assert restores and served >= 5, (
        f"{len(retractions)} retractions, {len(parks)} parks, {len(restores)} restores, {len(covered)} covered")
    assert not [line for line in lines if "kv_park disabled" in line or "kv_park unsupported" in line]
    assert [len(t) for t in got] == [new_tokens] * len(prompts)
    assert got == expected


def test_beside_hicache_the_cpu_engine_parks_only_tails_and_resumes_with_the_tokens_of_an_unretracted_run(
    tiny_model, tmp_path, monkeypatch, expected
):
    monkeypatch.setenv("SGLANG_TEST_RETRACT", "1")
    profile = {"DSV41_KV_PARK": "ram", "DSV41_DEBUG_LOG": "1"}
    args = launcher.server_args(tiny_model, launcher.free_port(), max_total_tokens=POOL_TOKENS,
                                extra=hicache_flags(2, write_policy="write_back"))
    with launcher.Server(args, tmp_path / "hicache.log", profile) as server:
        got = _run_streams(server, _prompts(), NEW_TOKENS)
    lines = server.log_lines()
    assert len([line for line in lines if "[dsv41] kv_park pool carved_from=hicache" in line]) == 1
    parks = [line for line in lines if "[dsv41] kv_park parked" in line]
    restores = [line for line in lines if "[dsv41] kv_park restored" in line]
    covered = [line for line in lines if "[dsv41] kv_park dropped" in line and "reason=tree_holds_it" in line]
    assert any("Testing retraction" in line for line in lines), "the retraction test hook never fired"
    assert parks and restores, f"{len(parks)} parks, {len(restores)} restores, {len(covered)} covered"
    # A parked row's prompt (200+ tokens, in the tree since its prefill) is not parked again: only the
    # decode tail past it (page size 1: at most NEW_TOKENS pages), and every restore finds the
    # prompt in the tree (cached > 0) and writes only that tail.
    pages = [int(re.search(r" pages=(\d+)", line).group(1)) for line in parks]
    cached = [int(m.group(1)) for m in (re.search(r" cached=(\d+)", line) for line in restores) if m]
    print(f"\n[kv_park beside HiCache] {len(parks)} parks of {pages} pages, {len(restores)} restores "
          f"(cached {cached}), {len(covered)} covered")
    assert pages and max(pages) <= NEW_TOKENS, f"a parked row's prompt was parked again: {pages}"
    assert len(cached) == len(restores) and all(c > 0 for c in cached), restores
    assert not [line for line in lines if "kv_park disabled" in line or "kv_park unsupported" in line]
    assert got == expected
