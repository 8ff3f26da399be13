"""End-to-end: the same kit serves the V4.1 text flavour (``model_type="deepseek_v41"``: hyper-connection
pre from the previous sublayer, no q head norm, no ``hc_head``) on SGLang 0.5.23's real server on CPU
(slow: one boot). transformers 5.19 has no V4.1, so this checks the engine path, not the values."""

from __future__ import annotations

import random

import pytest

from devkit.engine_kit import client, launcher
from devkit.engine_kit.dsv4 import checkpoint, launch

pytestmark = pytest.mark.slow


def test_a_v41_model_decodes_a_prefix_hit_like_a_cold_prefill(tmp_path):
    model = checkpoint.make_checkpoint(tmp_path / "ckpt41", model_type="deepseek_v41")
    rng = random.Random(1)
    prompt = [rng.randrange(6, 1024) for _ in range(700)]
    server = launch.server(model, tmp_path / "server.log", ready_timeout_s=600)
    with server:
        cold = client.generate(server.base_url, prompt, 16)
        warm = client.generate(server.base_url, prompt, 16)
        group = server.proc.pid
    print(f"\n[dsv4 kit] V4.1 boot to ready: {server.startup_s:.1f} s")
    assert launcher.members(group) == []
    log = server.log_lines()
    assert any("Initialize DeepSeekV4TokenToKVPool" in line for line in log)
    assert any("#new-token: 256" in line and "#pending-token: 444" in line for line in log)
    assert cold["meta_info"]["cached_tokens"] == 0 and warm["meta_info"]["cached_tokens"] == 512
    assert len(cold["output_ids"]) == 16 and warm["output_ids"] == cold["output_ids"]
