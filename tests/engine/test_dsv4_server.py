"""End-to-end: SGLang 0.5.23's real HTTP server serves a tiny DeepSeek-V4 on CPU (slow: two boots of
60-120 s each on a shared 2-core machine, one server at a time, always stopped).

The server is the real one: ``launch_server``, the overlap scheduler, ``UnifiedRadixCache`` (FULL +
SWA), the real ``DeepSeekV4TokenToKVPool`` (256-token SWA pages, fp8 V4 rows, C4 + C128 compressed
pools, the C4 indexer pool, compress-state rings) and the real ``DeepseekV4AttnBackend``
(``--attention-backend dsv4``), with the kit's pure-torch stand-ins for the CUDA/JIT kernels
(``devkit/engine_kit/dsv4``). The weights are the seeded checkpoint of
``devkit.engine_kit.dsv4.checkpoint``. The pool is small (2048 tokens = 8 pages, 3 running
requests) so the same workload also makes the scheduler retract a request.
"""

from __future__ import annotations

import random

import pytest

from devkit.engine_kit import client, launcher
from devkit.engine_kit.dsv4 import checkpoint, launch

pytestmark = pytest.mark.slow

GEOMETRY = {"max_total_tokens": 2048, "max_running": 3, "chunk": 256, "swa_ratio": 1.0}
LONG = 700  # three 256-token chunks (256, 256, 188); C4 and C128 rows in the compressed pools
DECODE = 16


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 1024) for _ in range(n)]  # ids below 6 are the tokenizer's specials


def _workload(server: launcher.Server) -> dict:
    url = server.base_url
    long = _ids(1, LONG)
    out = {"first": client.generate(url, long, DECODE)}
    out["extend"] = client.generate(url, long + _ids(2, 60), DECODE)  # prefix hit, then extend
    out["again"] = client.generate(url, long, DECODE)  # prefix hit of the first prompt
    client.flush_cache(url)
    # Three 480-token prompts decoding 64 tokens each: 2 pages each at admission, 3 each past 512
    # tokens, 9 > 8 pages: the scheduler retracts one and re-admits it later.
    # One batched call: the three arrive in one scheduler pass on every boot (client.generate_batch).
    out["crowd"] = client.generate_batch(url, [_ids(10 + i, 480) for i in range(3)], 64)
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return checkpoint.make_checkpoint(tmp_path_factory.mktemp("dsv4") / "ckpt")


def _boot(model, log_path) -> dict:
    results = launcher.serve(launch.server(model, log_path, ready_timeout_s=600, **GEOMETRY), _workload)
    print(f"\n[dsv4 kit] boot to ready: {results['startup_s']:.1f} s")
    return results


@pytest.fixture(scope="module")
def boots(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    return [_boot(model, logs / "first.log"), _boot(model, logs / "second.log")]


def _prefill_lines(log: list[str]) -> list[str]:
    return [line for line in log if "Prefill batch" in line]


def test_the_real_engine_builds_its_dsv4_pool_backend_and_radix_cache_and_routes_every_kernel(boots):
    log = boots[0]["log"]
    assert any("Initialize DeepSeekV4TokenToKVPool" in line for line in log)
    assert any("Using DeepseekV4AttnBackend" in line for line in log)
    assert any("Tree cache initialized" in line and "UnifiedRadixCache" in line and "hybrid_swa=True" in line
               for line in log)
    routed = " ".join(line for line in log if line.startswith("[dsv4_kit] routed"))
    for name in ("compress_forward", "fused_k_norm_rope_flashmla", "moe_forward_native", "DeepseekV4AttnBackend.__init__",
                 "init_compression_metadata", "silu_and_mul_clamp", "hc_split_sinkhorn"):
        assert name in routed
    assert boots[0]["survivors"] == [] and boots[1]["survivors"] == []


def test_a_long_prompt_prefills_in_256_token_chunks_and_decodes_over_the_compressed_caches(boots):
    first = boots[0]["first"]
    assert first["meta_info"]["cached_tokens"] == 0 and len(first["output_ids"]) == DECODE
    chunks = [line for line in _prefill_lines(boots[0]["log"]) if "#cached-token: 0" in line]
    assert any("#new-token: 256" in line and "#pending-token: 444" in line for line in chunks)
    assert any("#new-token: 256" in line and "#pending-token: 188" in line for line in chunks)
    assert any("Decode batch" in line for line in boots[0]["log"])


def test_a_radix_prefix_hit_extends_from_the_cached_pages_and_decodes_like_a_cold_prefill(boots):
    extend, again, first = boots[0]["extend"], boots[0]["again"], boots[0]["first"]
    # The hit stops at a page boundary (256-token pages): 512 of the 700 prompt tokens.
    assert extend["meta_info"]["cached_tokens"] == 512
    assert again["meta_info"]["cached_tokens"] == 512
    assert any("#cached-token: 512" in line for line in _prefill_lines(boots[0]["log"]))
    # Rebuilding from the cached pages (SWA window, C4 / C128 state rings, indexer keys) decodes the
    # same greedy tokens as the cold prefill of the same prompt.
    assert again["output_ids"] == first["output_ids"]


def test_a_full_pool_makes_the_scheduler_retract_a_request_that_still_finishes(boots):
    crowd = boots[0]["crowd"]
    assert all(len(r["output_ids"]) == 64 for r in crowd)
    assert sum(r["meta_info"]["num_retractions"] for r in crowd) >= 1
    assert any("KV cache pool is full. Retract requests." in line for line in boots[0]["log"])


def test_two_boots_give_identical_greedy_outputs(boots):
    for key in ("first", "extend", "again"):
        assert boots[0][key]["output_ids"] == boots[1][key]["output_ids"], key
    assert [r["output_ids"] for r in boots[0]["crowd"]] == [r["output_ids"] for r in boots[1]["crowd"]]
