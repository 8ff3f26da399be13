"""End-to-end: ``python -m adapter check --json`` on the production profile predicts, per switch,
the receipt a boot of SGLang's real server then logs (slow: one DSV4 kit boot on CPU, 60-300 s on a
shared 2-core machine; always stopped).

The boot is the DSV4 kit's (tiny DeepSeek-V4, dummy weights, the real ``DeepSeekV4TokenToKVPool``
and ``UnifiedRadixCache``) with the ``DSV41_*`` keys of ``.env.tp4.example``; check reads the same
profile and the same model folder. Install-time decisions (this machine: no CUDA device) and the
decisions taken at cache build (cone replay on the DSV4 pool) must both come out as predicted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapter.core import env
from adapter.ops import check
from devkit.engine_kit import client, launcher
from devkit.engine_kit.dsv4 import launch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / ".env.tp4.example"
DATACENTER = ROOT / ".env.h200-hicache.example"  # HiCache's host tier on its launch line


def check_json(env_file: Path, model: Path) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    environ["PYTHONPATH"] = str(ROOT)  # as on the serving image: no sgl_kernel stand-in
    out = subprocess.run([sys.executable, "-m", "adapter", "check", "--env-file", str(env_file), "--model", str(model),
                          "--json"], cwd=ROOT, env={**environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=600)
    assert out.stdout.strip(), out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def booted_receipts(log: Path, env_file: Path) -> dict[str, str]:
    """Per requested switch, the one decision the boot logged: the scheduler's (``tp0``), and every
    other process that installed it (the server's main process: ``pid<N>``) agreeing with it."""
    report = check.receipts_report([str(log)], str(env_file), ranks=1)
    decided = {}
    for name, by_rank in report["receipts"].items():
        assert len(set(by_rank.values())) <= 1, (name, by_rank)
        decided[name] = by_rank.get("tp0", next(iter(by_rank.values()), "nothing logged"))
    return decided


def test_check_predicts_the_receipts_a_dsv4_boot_of_the_production_profile_logs(tmp_path):
    model = launch.write_dummy_model(tmp_path / "dsv4")
    predicted = check_json(PROFILE, model)
    assert predicted["model"]["pool"] == "DeepSeekV4TokenToKVPool"
    profile = env.dsv41_items(env.read_env_file(str(PROFILE)))
    server = launch.server(model, tmp_path / "boot.log", profile, ready_timeout_s=400, load_format="dummy",
                           max_total_tokens=2048, max_running=3, chunk=256, swa_ratio=1.0)
    with server:
        client.generate(server.base_url, list(range(10, 300)), 4)  # the cache serves one request
    assert launcher.members(server.proc.pid) == []
    booted = booted_receipts(tmp_path / "boot.log", PROFILE)
    print("\n".join(line for line in server.log_lines() if "[dsv41]" in line))  # shown when the test fails
    assert set(booted) == set(predicted["receipts"])
    assert booted == predicted["receipts"]
    # decided at cache build (the DSV4 pool's layout, window, page and bound), predicted before the boot
    assert booted["cone_replay"] == "installed" or booted["cone_replay"].startswith("refused: ")


def _strict_boot_passes_receipts(tmp_path, model, start, profile_file: Path = PROFILE) -> list[str]:
    """Boot ``start(profile, log)`` with ``DSV41_STRICT=1`` on the profile's switches that install on
    this machine (the GPU-only ones are what ``check`` predicts refused without a CUDA device); the
    boot comes up, serves one request, and ``python -m adapter receipts --ranks 1`` passes on its
    log. Returns the cone's installed lines."""
    predicted = check_json(profile_file, model)["receipts"]
    profile = env.dsv41_items(env.read_env_file(str(profile_file)))
    installable = {name for name, decision in predicted.items() if decision == "installed"}
    assert {"decode_yield", "swa_thin", "cone_replay"} <= installable, predicted
    from adapter.core import registry

    keep = {key.name for s in registry.SWITCHES if s.name in installable for key in s.keys}
    strict = {k: v for k, v in profile.items() if k in keep} | {"DSV41_STRICT": "1"}
    env_file = tmp_path / "strict.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in sorted(strict.items())))
    server = start(strict, tmp_path / "strict.log")
    with server:
        client.generate(server.base_url, list(range(10, 300)), 4)
    assert launcher.members(server.proc.pid) == []
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    out = subprocess.run([sys.executable, "-m", "adapter", "receipts", "--env-file", str(env_file), "--ranks", "1",
                          str(tmp_path / "strict.log")], cwd=ROOT, env={**environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("receipts: ok"), out.stdout + out.stderr
    return [line for line in server.log_lines() if "[dsv41] cone_replay installed" in line]


def test_a_strict_dsv4_boot_of_the_profiles_cpu_switches_passes_receipts(tmp_path):
    """The V4 kit, cone replay decided at cache build."""
    model = launch.write_dummy_model(tmp_path / "dsv4")
    lines = _strict_boot_passes_receipts(tmp_path, model, lambda profile, log: launch.server(
        model, log, profile, ready_timeout_s=400, load_format="dummy", max_total_tokens=2048, max_running=3,
        chunk=256, swa_ratio=1.0))
    assert lines and "N=2048" in lines[0], lines


def test_a_strict_v41_boot_beside_decoder_bounded_replay_passes_receipts(tmp_path):
    """The V4.1 kit with ``--enable-decoder-swa-bounded-replay`` (as SGLang resolves it for V4.1 on
    CUDA, the fleet's configuration): cone replay installs with the tail's bound."""
    from devkit.engine_kit.dsv41 import checkpoint
    from devkit.engine_kit.dsv41 import launch as v41

    model = checkpoint.make_checkpoint(tmp_path / "v41", ratios=(0, 2, 1, 1, 0))
    lines = _strict_boot_passes_receipts(tmp_path, model, lambda profile, log: v41.server(
        model, log, profile, ready_timeout_s=400, max_total_tokens=2048, max_running=3, chunk=256, swa_ratio=1.0))
    assert lines and "N=2048 bound=768 " in lines[0] and "decoder_tail_from=2" in lines[0], lines


def test_a_strict_dsv4_boot_of_the_datacenter_profile_with_its_hicache_passes_receipts(tmp_path):
    """``.env.h200-hicache.example``: the DSV4 kit boots with the profile's HiCache arguments
    (host tier, write-through) and its switches under ``DSV41_STRICT=1``; every switch installs."""
    import shlex

    words = shlex.split(env.read_env_file(str(DATACENTER))["LAUNCH_ARGS"])
    hicache = [w for i, w in enumerate(words) if w.startswith("--hicache") or w == "--enable-hierarchical-cache"
               or (i and words[i - 1].startswith("--hicache"))]
    assert hicache[0] == "--enable-hierarchical-cache" and "--hicache-ratio" in hicache
    model = launch.write_dummy_model(tmp_path / "dsv4")
    lines = _strict_boot_passes_receipts(tmp_path, model, lambda profile, log: launch.server(
        model, log, profile, ready_timeout_s=400, load_format="dummy", max_total_tokens=2048, max_running=3,
        chunk=256, swa_ratio=1.0, extra=hicache), DATACENTER)
    assert lines and "N=2048" in lines[0], lines
