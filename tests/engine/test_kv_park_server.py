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


def _probes_and_parks(lines: list[str]) -> list[tuple[dict[str, int], int]]:
    """Each ``kv_park parked`` line's pages with the tree's holdings of that row at the same
    retraction: the ``park_probe`` seam's line for the request nearest to it in the log (the two are
    written at one retraction, next to each other; which comes first depends on which wrapper of
    ``release_req`` is outermost, and either reads the tree before the row is released)."""
    probes: list[tuple[int, str, dict[str, int]]] = []
    parks: list[tuple[int, str, int]] = []
    for i, line in enumerate(lines):
        if "[kit_seam] park_probe rid=" in line:
            fields = dict(re.findall(r" (\w+)=(\S+)", line))
            probes.append((i, fields.pop("rid"), {k: int(v) for k, v in fields.items()}))
        elif "[dsv41] kv_park parked" in line:
            parks.append((i, re.search(r" rid=(\S+)", line).group(1), int(re.search(r" pages=(\d+)", line).group(1))))
    pairs = []
    for i, rid, pages in parks:
        near = min(((abs(j - i), probe) for j, r, probe in probes if r == rid), key=lambda x: x[0], default=None)
        assert near is not None and near[0] <= 5, f"no tree probe next to the park of {rid} (line {i})"
        pairs.append((near[1], pages))
    return pairs


def test_beside_hicache_the_cpu_engine_parks_only_tails_and_resumes_with_the_tokens_of_an_unretracted_run(
    tiny_model, tmp_path, monkeypatch, expected
):
    """Nothing is held twice, decided on every run from the tree itself: at each retraction the
    ``park_probe`` seam reads, from the Python tree core's nodes before the row is released, how far
    the tree holds the row's Full KV (device or HiCache's host tier); every parked page lies past
    it. A park does take prompt pages: while a chunked prompt decodes, the tree holds it only up to
    its last chunk's boundary (the 280-token prompt: 256 with 64-token chunks), so the tail past it
    (24 pages) plus the tokens decoded so far are the row's own. A retraction after 1 decoded token
    parks 23 pages; 31 is a later retraction (8 decoded, on a loaded machine) or a tree that had lost
    a page run below 256 as well: the old bound of NEW_TOKENS pages held only for early retractions
    of a prompt held to its last chunk."""
    monkeypatch.setenv("SGLANG_TEST_RETRACT", "1")
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")  # the probe reads its nodes
    profile = {"DSV41_KV_PARK": "ram", "DSV41_DEBUG_LOG": "1"}
    args = launcher.server_args(tiny_model, launcher.free_port(), max_total_tokens=POOL_TOKENS,
                                extra=hicache_flags(2, write_policy="write_back"))
    server = launcher.Server(args, tmp_path / "hicache.log", profile)
    server.env = launcher.with_seams(server.env, "park_probe", "hicache_reserve")
    with server:
        got = _run_streams(server, _prompts(), NEW_TOKENS)
    lines = server.log_lines()
    assert len([line for line in lines if "[dsv41] kv_park pool carved_from=hicache" in line]) == 1
    assert any("Python TreeCore" in line or "Tree Core: UnifiedTreeCore" in line for line in lines)
    parks = _probes_and_parks(lines)
    restores = [line for line in lines if "[dsv41] kv_park restored" in line]
    covered = [line for line in lines if "[dsv41] kv_park dropped" in line and "reason=tree_holds_it" in line]
    dropped_by_hicache = [line for line in lines if "KV subtree dropped without backup" in line]
    assert any("Testing retraction" in line for line in lines), "the retraction test hook never fired"
    assert parks and restores, f"{len(parks)} parks, {len(restores)} restores, {len(covered)} covered"
    # Every parked page lies past what the tree held of the row when it was parked (device or host):
    # the parked pages end at the row's servable prefix (at most its committed tokens). So a parked
    # prompt page is one the tree no longer held.
    twice = [(probe, pages) for probe, pages in parks if pages > probe["committed"] - probe["full_held"]]
    prompt_pages = [max(0, probe["prompt"] - (probe["committed"] - pages)) for probe, pages in parks]
    cached = [int(m.group(1)) for m in (re.search(r" cached=(\d+)", line) for line in restores) if m]
    print(f"\n[kv_park beside HiCache] {len(parks)} parks of {[p for _, p in parks]} pages "
          f"({prompt_pages} of them prompt; tree held {[(p['full_held'], p['prompt']) for p, _ in parks]} "
          f"(held, prompt)), {len(restores)} restores (cached {cached}), {len(covered)} covered, "
          f"{len(dropped_by_hicache)} HiCache write-back drops")
    assert not twice, f"parked pages the tree held: {twice}"
    assert len(cached) == len(restores) and all(c > 0 for c in cached), restores
    assert not [line for line in lines if "kv_park disabled" in line or "kv_park unsupported" in line]
    assert got == expected
