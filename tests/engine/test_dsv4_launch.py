"""The DeepSeek-V4 kit's launch line and environment (fast: no server is started)."""

from __future__ import annotations

import os

import pytest

from devkit.engine_kit.dsv4 import launch


def _arg(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_launch_line_is_the_dsv4_backend_on_256_token_pages_with_torch_topk_and_no_graphs():
    args = launch.server_args("/m", 30000)
    assert _arg(args, "--attention-backend") == "dsv4" and _arg(args, "--page-size") == "256"
    assert _arg(args, "--dsa-topk-backend") == "torch" and "--disable-cuda-graph" in args
    assert _arg(args, "--dtype") == "bfloat16" and _arg(args, "--chunked-prefill-size") == "256"
    # the SWA pool is sized so it cannot starve: the default 0.1 of 8192 tokens is 3 pages
    ratio = float(_arg(args, "--swa-full-tokens-ratio"))
    assert launch.check_pages(8192, ratio, 4, 256) >= launch.swa_pages_needed(4, 256)


def test_a_swa_pool_that_would_starve_a_prefix_hit_is_refused_before_boot_with_the_numbers():
    # SGLang's default ratio: the map saw a prefix-hit request wait in the queue forever, no error.
    with pytest.raises(launch.PoolTooSmall, match=r"SWA pool of 3 pages .* need 10 pages .* swa_ratio >= 0\.32"):
        launch.server_args("/m", 30000, max_total_tokens=8192, swa_ratio=0.1)


def test_the_server_env_selects_sglangs_torch_paths_and_puts_both_stand_ins_first_on_the_path():
    env = launch.child_env({}, base={"PATH": os.environ.get("PATH", ""), "DSV41_SWA_THIN": "1"})
    for key, value in launch.TORCH_PATH_ENV.items():
        assert env[key] == value
    path = env["PYTHONPATH"].split(os.pathsep)
    assert path[0] == str(launch.STUB_PATH) and path[1].endswith("engine_kit/stub")
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and "DSV41_SWA_THIN" not in env
    server = launch.server("/m", "/tmp/unused.log", port=30001)  # built, not started
    assert server.env["SGL_STUB_DSV4"] == "1" and server.env["PYTHONPATH"].startswith(str(launch.STUB_PATH))
    assert server.port == 30001 and server.proc is None
