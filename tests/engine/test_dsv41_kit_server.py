"""End-to-end: the DeepSeek-V4.1 kit (ratio-1/2 KV-source layers, fp4 index-K pool) on SGLang 0.5.23's
real server on CPU, with decoder SWA bounded replay set explicitly (slow: two boots). transformers
5.19 has no V4.1, so this checks the engine path and its determinism, not the values."""

from __future__ import annotations

import random

import pytest

from devkit.engine_kit import client, launcher
from devkit.engine_kit.dsv41 import checkpoint, launch

pytestmark = pytest.mark.slow

# layer 0 SWA-only (hash routing), 1 ratio 2 (kv + index source), 2 ratio 1 (the last kv source: the
# replay tail starts here), 3 ratio 1 (reads layer 2's KV), 4 SWA-only (a late layer)
RATIOS = (0, 2, 1, 1, 0)


def _serve(model, log, replay):
    rng = random.Random(1)
    prompt = [rng.randrange(6, 1024) for _ in range(700)]
    shared = prompt[:680] + [rng.randrange(6, 1024) for _ in range(40)]
    server = launch.server(model, log, replay=replay, ready_timeout_s=900)
    with server:
        out = [client.generate(server.base_url, ids, 8, logprobs=True) for ids in (prompt, shared, prompt)]
        group = server.proc.pid
    assert launcher.members(group) == []
    return out, server.log_lines()


def _logprobs(out):
    return [row[0] for row in out["meta_info"]["output_token_logprobs"]]


def test_a_v41_model_with_ratio_1_and_2_kv_sources_serves_prefix_hits_exactly_under_decoder_replay(tmp_path):
    model = checkpoint.make_checkpoint(tmp_path / "ckpt", ratios=RATIOS)
    (cold, shared, warm), log = _serve(model, tmp_path / "replay.log", replay=True)
    assert any("Initialize DeepSeekV4TokenToKVPool" in line for line in log)
    # the ratio-1/2 layers' index keys go through the fp4 index-K pool (its Triton kernels, routed)
    assert any("[dsv4_kit] routed sglang.kernels.ops.kvcache.dsv4_fp4_index_k_cache" in line for line in log)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert shared["meta_info"]["cached_tokens"] == 512 and warm["meta_info"]["cached_tokens"] == 512
    # a prefix hit under the replay tail computes what the cold prefill computed, value for value
    assert warm["output_ids"] == cold["output_ids"] and _logprobs(warm) == _logprobs(cold)
    # the tail is active: without the flag the late layers see every row and the values move
    (plain, _, plain_warm), _ = _serve(model, tmp_path / "plain.log", replay=False)
    assert _logprobs(plain_warm) == _logprobs(plain)
    assert _logprobs(plain) != _logprobs(cold)
