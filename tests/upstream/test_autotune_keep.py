"""Autotune keep on SGLang's real ``flashinfer_autotune`` module and FlashInfer's real AutoTuner (CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from adapter.core import boot
from adapter.switches import autotune_keep
from devkit.testkit import autotune as kit

ROOT = Path(__file__).resolve().parents[2]
ON = {"DSV41_AUTOTUNE_KEEP": "1"}


@pytest.fixture
def cache_path(tmp_path):
    return tmp_path / "rank_tp0_pp0_dp0.json"


def _boot(cache_path: Path, environ: dict[str, str], monkeypatch, capfd) -> str:
    """One process boot: install from ``environ``, run the autotune pass, return the overlay's log."""
    boot.uninstall()
    for key in [k for k in os.environ if k.startswith(("DSV41_", "SGLANG_RUN_ID"))]:
        monkeypatch.delenv(key)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    with kit.cpu_autotune_seams(cache_path) as module:
        state = boot.install(environ)
        assert state.outcomes["autotune_keep"].status == "installed"
        capfd.readouterr()
        kit.run_boot(module)
    return capfd.readouterr().err


def test_first_boot_tunes_saves_and_writes_a_sidecar(cache_path, monkeypatch, capfd):
    log = _boot(cache_path, ON, monkeypatch, capfd)
    assert "[dsv41] autotune_keep tuned and saved" in log
    assert cache_path.is_file()
    stamp = json.loads(autotune_keep.sidecar_path(cache_path).read_text())
    assert stamp["fingerprint"] == autotune_keep.launch_fingerprint()


def test_cache_is_reused_when_the_same_launch_boots_again(cache_path, monkeypatch, capfd):
    _boot(cache_path, ON, monkeypatch, capfd)
    log = _boot(cache_path, ON, monkeypatch, capfd)
    assert "[dsv41] autotune_keep reused" in log
    assert "dropped" not in log


def test_cache_is_dropped_when_a_non_volatile_key_changes(cache_path, monkeypatch, capfd):
    _boot(cache_path, ON, monkeypatch, capfd)
    log = _boot(cache_path, {**ON, "SGLANG_SOME_TUNING_KNOB": "2"}, monkeypatch, capfd)
    assert "dropped reason=launch-changed" in log
    assert "[dsv41] autotune_keep tuned and saved" in log


def test_cache_is_kept_when_only_a_volatile_key_toggles(cache_path, monkeypatch, capfd):
    _boot(cache_path, {**ON, "SGLANG_RUN_ID": "a"}, monkeypatch, capfd)
    log = _boot(cache_path, {**ON, "SGLANG_RUN_ID": "b", "DSV41_STRICT": "1"}, monkeypatch, capfd)
    assert "[dsv41] autotune_keep reused" in log


@pytest.mark.parametrize(
    ("damaged", "reason"),
    [("cache", "corrupt-cache"), ("sidecar", "corrupt-sidecar"), ("no-sidecar", "no-sidecar")],
)
def test_a_corrupt_cache_or_sidecar_is_dropped_cleanly(cache_path, monkeypatch, capfd, damaged, reason):
    _boot(cache_path, ON, monkeypatch, capfd)
    sidecar = autotune_keep.sidecar_path(cache_path)
    if damaged == "cache":
        cache_path.write_text("{not json")
    elif damaged == "sidecar":
        sidecar.write_text('{"fingerprint": ')
    else:
        sidecar.unlink()
    log = _boot(cache_path, ON, monkeypatch, capfd)
    assert f"dropped reason={reason}" in log
    assert "[dsv41] autotune_keep tuned and saved" in log
    assert json.loads(cache_path.read_text())  # a fresh, valid cache was saved
    assert json.loads(sidecar.read_text())["fingerprint"] == autotune_keep.launch_fingerprint()


def test_a_cache_edited_after_it_was_saved_is_dropped(cache_path, monkeypatch, capfd):
    _boot(cache_path, ON, monkeypatch, capfd)
    data = json.loads(cache_path.read_text())
    data["edited"] = True
    cache_path.write_text(json.dumps(data))
    log = _boot(cache_path, ON, monkeypatch, capfd)
    assert "dropped reason=cache-changed-since-saved" in log


def test_the_fingerprint_ignores_volatile_keys_but_not_argv_or_engine_keys():
    base = autotune_keep.launch_fingerprint(["serve", "--tp", "4"], {"SGLANG_X": "1"})
    assert base == autotune_keep.launch_fingerprint(
        ["serve", "--tp", "4"], {"SGLANG_X": "1", "SGLANG_RUN_ID": "r2", "DSV41_AUTOTUNE_KEEP": "1", "HOME": "/x"}
    )
    assert base != autotune_keep.launch_fingerprint(["serve", "--tp", "8"], {"SGLANG_X": "1"})
    assert base != autotune_keep.launch_fingerprint(["serve", "--tp", "4"], {"SGLANG_X": "1", "NCCL_ALGO": "Ring"})


_RANK_SCRIPT = r"""
import json, os, sys
from pathlib import Path
import torch.distributed as dist
sys.path.insert(0, {root!r})
from adapter.switches import autotune_keep
from adapter.core import boot
from sglang.srt.model_executor.runner import flashinfer_autotune as m

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
env = {{"flashinfer_version": "0.7.2"}}
result = {{}}
for mode in ("stock", "keep"):
    path = Path({tmp!r}) / mode / f"rank_tp{{rank}}.json"
    path.parent.mkdir(exist_ok=True)
    # Expert parallelism: every rank tuned its own experts, so the files differ.
    path.write_text(json.dumps({{"expert_tactic": rank}}))
    if mode == "keep":
        autotune_keep.stamp(path, autotune_keep.launch_fingerprint())
        state = boot.install({{"DSV41_AUTOTUNE_KEEP": "1"}})
        assert state.outcomes["autotune_keep"].status == "installed"
        assert autotune_keep.admit(path, autotune_keep.launch_fingerprint())
    m._drop_diverged_autotune_cache(path, dist.group.WORLD, env)
    result[mode] = path.is_file()
print("RESULT", json.dumps(result))
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.spawns
def test_same_launch_caches_of_different_experts_survive_the_real_cross_rank_check(tmp_path):
    """Two real gloo ranks run SGLang's ``_drop_diverged_autotune_cache`` on differing EP caches."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT.format(root=str(ROOT), tmp=str(tmp_path)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.split("RESULT", 1)[1]))
    assert [r["stock"] for r in results] == [False, False]  # stock drops both ranks' caches
    assert [r["keep"] for r in results] == [True, True]  # same launch: both ranks keep theirs
