"""End-to-end: the SWA switches and kv_park beside HiCache in SGLang 0.5.23's real HTTP server on CPU
(slow: one boot). The kit's tiny hybrid SWA model (``SWAKVPool``) with ``--enable-hierarchical-cache``
(the engine kit's host-memory and ``kvcacheio`` routes): cone replay, SWA thin and the fast tree core
log ``installed``; kv_park stays installed and logs one ``pool carved_from=hicache`` line at the first
scheduler pass (its park pool is carved out of HiCache's host pool: one host budget); requests are served."""

import re

import pytest

from devkit.engine_kit import client, launcher, model, workload

pytestmark = pytest.mark.slow
HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-write-policy", "write_back"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return model.make_model(tmp_path_factory.mktemp("kit") / "model")


def test_beside_hicache_each_switch_acts_and_kv_park_carves_its_pool_out_of_hicache_on_the_kit_server(
        tiny_model, tmp_path):
    profile = {"DSV41_SWA_THIN": "1", "DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": "64",
               "DSV41_KV_PARK": "ram"}
    args = launcher.server_args(tiny_model, launcher.free_port(), max_total_tokens=2048, extra=HICACHE)
    ids = workload.Workload()
    with launcher.Server(args, tmp_path / "hicache.log", profile) as server:
        prompt = ids.ids("hicache-a", 300)
        first = client.generate(server.base_url, prompt, 8)
        again = client.generate(server.base_url, prompt + list(first["output_ids"]) + ids.ids("hicache-b", 40), 8)
        assert len(first["output_ids"]) == 8 and len(again["output_ids"]) == 8
    lines = server.log_lines()
    text = "\n".join(lines)
    for name in ("cone_replay", "swa_thin", "fast_tree_core", "kv_park"):
        assert re.search(rf"\[dsv41\] {name} installed", text), name
    carved = [line for line in lines if "[dsv41] kv_park pool carved_from=hicache" in line]
    assert len(carved) == 1, text[-4000:]
    assert not [line for line in lines if "kv_park refused" in line or "kv_park disabled" in line]
