"""``check`` knows the model: it reads ``config.json`` and the launch line (SGLang's own parser) and
says what the switches decided later in a boot will do, warns about profiles that work but not as
meant, and prints one JSON object for a deploy pipeline (``--json``; ``receipts --json`` too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapter.core import registry
from adapter.ops import check
from devkit.engine_kit import model
from devkit.engine_kit.dsv4 import launch as dsv4_launch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mellum(tmp_path_factory):
    return check.read_model(model.make_model(tmp_path_factory.mktemp("kit") / "model"))


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    return check.read_model(dsv4_launch.write_dummy_model(tmp_path_factory.mktemp("dsv4") / "model"))


@pytest.fixture(scope="module")
def dsv41(tmp_path_factory):
    from devkit.engine_kit.dsv41.launch import tiny_v41_config

    out = tmp_path_factory.mktemp("dsv41") / "model"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(tiny_v41_config(ratios=(0, 2, 1, 1, 0))))
    return check.read_model(out)


def _warnings(environ: dict[str, str], argv: list[str], found: check.Model | None = None) -> list[str]:
    config = registry.resolve(environ)
    _, predicted, _notes = check.predict(environ, config, None, found, check.parse_launch(argv))
    return [*check.orphan_options(environ, config), *predicted]


def _cone(found: check.Model, launch: check.Launch, values: dict, environ: dict) -> tuple[str, dict]:
    """What check says cone replay logs at cache build (its predictor, as check calls it)."""
    from adapter.core import api
    from adapter.switches.cone_replay import predict

    said = predict.predict(api.Profile(environ, values, tuple(launch.argv), launch.namespace, found, "armed"))
    return said.receipt, dict(said.params)


def test_the_model_folder_gives_the_pool_kind_and_the_window_sglang_derives(mellum, dsv4):
    # Mellum counts the current token in its window: SGLang's model reports sliding_window - 1.
    assert (mellum.pool, mellum.window, mellum.swa_layers) == ("SWAKVPool", model.ModelSpec().window - 1, 2)
    assert (dsv4.pool, dsv4.window, dsv4.swa_layers, dsv4.compress_ratios) == ("DeepSeekV4TokenToKVPool", 128, 3, (0, 4, 128))


def test_a_missing_model_folder_is_a_clear_error_naming_the_option(tmp_path):
    with pytest.raises(check.env.ConfigError, match=r"--model=.*no-model.*config.json"):
        check.read_model(tmp_path / "no-model")


def test_cone_replay_is_predicted_installed_at_its_bound_and_refused_below_it_on_an_swa_pool(mellum):
    launch = check.parse_launch(["--model-path", mellum.path, "--page-size", "1"])
    ok, facts = _cone(mellum, launch, {"DSV41_SWA_CONE_TOKENS": 64}, {})
    assert ok == "installed" and facts["bound"] == 63  # the gate's engine: page 1, window 31, 2 SWA layers
    low, _ = _cone(mellum, launch, {"DSV41_SWA_CONE_TOKENS": 32}, {})
    assert low == ("refused: DSV41_SWA_CONE_TOKENS=32 < bound=63 (window 31, page 1, 2 sliding-window layers): "
                   "set it to at least 63")
    paged = check.parse_launch(["--model-path", mellum.path, "--page-size", "64"])
    odd, _ = _cone(mellum, paged, {"DSV41_SWA_CONE_TOKENS": 100}, {})
    assert odd == "refused: DSV41_SWA_CONE_TOKENS=100 is not a multiple of the page size 64"


def test_cone_replay_on_a_deepseek_v4_pool_is_predicted_from_its_kv_layout_and_bound(dsv4):
    launch = check.parse_launch(["--model-path", dsv4.path, "--page-size", "256"])
    values = {"DSV41_SWA_CONE_TOKENS": 8192}
    receipt, facts = _cone(dsv4, launch, values, {})  # this machine: no SM100, the V4 layout
    assert (receipt, facts["page"], facts["kv_layout"]) == ("installed", 256, "v4") and facts["bound"] <= 8192
    low, _ = _cone(dsv4, launch, {"DSV41_SWA_CONE_TOKENS": 256}, {})
    assert low.startswith(f"refused: DSV41_SWA_CONE_TOKENS=256 < bound={facts['bound']} (window 128, page 256")
    v41, _ = _cone(dsv4, launch, values, {"SGLANG_DSV4_KV_LAYOUT": "v41"})
    assert v41.startswith("refused: DeepSeek-V4 KV layout v41: cone replay's exactness is shown on the v4 layout")
    unified, _ = _cone(dsv4, launch, values, {"SGLANG_HACK_FLASHMLA_BACKEND": "unified_kv_triton"})
    assert unified.startswith("refused: DeepSeek-V4 unified KV ring")


def test_beside_decoder_replay_the_cone_is_predicted_at_the_bound_of_the_layers_before_the_tail(dsv41):
    values = {"DSV41_SWA_CONE_TOKENS": 768}
    base = ["--model-path", dsv41.path, "--page-size", "256"]
    on, facts = _cone(dsv41, check.parse_launch([*base, "--enable-decoder-swa-bounded-replay"]), values, {})
    assert (on, facts["bound"], facts["decoder_replay"]) == ("installed", 768, "on (--enable-decoder-swa-bounded-replay)")
    off, facts = _cone(dsv41, check.parse_launch([*base, "--no-enable-decoder-swa-bounded-replay"]), values, {})
    assert off.startswith("refused: DSV41_SWA_CONE_TOKENS=768 < bound=1024") and facts["bound"] == 1024
    import torch

    _, facts = _cone(dsv41, check.parse_launch(base), values, {})  # auto: on where a GPU is
    gpu = torch.cuda.is_available()
    assert facts["decoder_replay"] == ("on (auto: V4.1 on CUDA/HIP)" if gpu else "off (auto: no CUDA/HIP on this machine)")
    assert facts["bound"] == (768 if gpu else 1024)


def test_decoder_replay_on_a_model_without_kv_source_layers_is_predicted_refused_with_one_line(dsv4):
    launch = check.parse_launch(["--model-path", dsv4.path, "--page-size", "256", "--enable-decoder-swa-bounded-replay"])
    receipt, facts = _cone(dsv4, launch, {"DSV41_SWA_CONE_TOKENS": 8192}, {})
    assert receipt == ("refused: --enable-decoder-swa-bounded-replay on a pool without KV-source layers: cannot tell "
                       "which layers run on the tail only") and "bound" not in facts


def test_an_option_key_without_its_switch_key_is_warned_about():
    warnings = _warnings({"DSV41_SWA_CONE_TOKENS": "8192"}, [])
    assert warnings == ["DSV41_SWA_CONE_TOKENS set without DSV41_SWA_CONE_REPLAY: cone_replay is off and it is ignored"]
    assert _warnings({"DSV41_SWA_CONE_TOKENS": "8192", "DSV41_SWA_CONE_REPLAY": "1"}, []) == []


def test_decode_yield_open_loop_on_default_coefficients_is_warned_about_until_a_coefficient_is_set():
    model = {"DSV41_DECODE_YIELD": "33", "DSV41_DECODE_YIELD_MODE": "model"}
    assert any("default cost coefficients" in w for w in _warnings(model, []))
    coefficient = next(k for k in registry.all_keys()
                       if k.startswith("DSV41_DECODE_YIELD_") and not k.endswith(("_MODE", "_LOAD_GUARD")))
    assert not any("default cost coefficients" in w for w in _warnings({**model, coefficient: "1000"}, []))
    # the load guard's key is no coefficient
    assert any("default cost coefficients" in w for w in _warnings({**model, "DSV41_DECODE_YIELD_LOAD_GUARD": "0"}, []))
    # measured mode (the default) needs no coefficients: nothing to warn about
    assert not any("decode_yield" in w for w in _warnings({"DSV41_DECODE_YIELD": "33"}, []))


def test_native_decode_beside_more_than_64_decode_rows_per_call_is_warned_about(dsv4):
    on = {"DSV41_SWA_NATIVE_DECODE": "1"}
    assert _warnings(on, ["--max-running-requests", "64"], dsv4) == []
    [wide] = _warnings(on, ["--max-running-requests", "128"], dsv4)
    assert wide.startswith("--max-running-requests = 128 > 64: decode calls of more than 64 rows take the stock copy path")
    [default] = _warnings(on, [], dsv4)  # SGLang's DeepSeek-V4 default is 256
    assert default.startswith("SGLang's DeepSeek-V4 default max_running_requests = 256 > 64")
    [spec] = _warnings(on, ["--max-running-requests", "32", "--speculative-algorithm", "EAGLE"], dsv4)
    assert spec.startswith("--speculative-algorithm EAGLE")


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    environ["PYTHONPATH"] = str(ROOT)  # as on the serving image: no sgl_kernel stand-in
    return subprocess.run([sys.executable, "-m", "adapter", *args], cwd=ROOT, env={**environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)


@pytest.mark.spawns
def test_check_json_is_one_object_with_the_predicted_receipts_and_the_warnings(tmp_path, mellum):
    profile = tmp_path / "p.env"
    profile.write_text(f'LAUNCH_ARGS=--model-path {mellum.path} --page-size 1\n'
                       "DSV41_SWA_CONE_REPLAY=1\nDSV41_SWA_CONE_TOKENS=32\nDSV41_KV_PARK_GIB=4\n")
    out = _cli(["check", "--env-file", str(profile), "--json"])
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout + out.stderr[-2000:]
    report = json.loads(lines[0])
    assert out.returncode == 0 and report["ok"] is True
    assert report["model"]["pool"] == "SWAKVPool" and report["launch"]["page_size"] == 1
    assert report["receipts"]["cone_replay"].startswith("refused: DSV41_SWA_CONE_TOKENS=32 < bound=63")
    assert "DSV41_KV_PARK_GIB set without DSV41_KV_PARK: kv_park is off and it is ignored" in report["warnings"]


@pytest.mark.spawns
def test_receipts_json_is_one_object_with_each_switch_decision_per_rank(tmp_path):
    profile = tmp_path / "p.env"
    profile.write_text("DSV41_KV_PARK=ram\n")
    log = tmp_path / "boot.log"
    log.write_text("[dsv41] kv_park installed mode=ram rank=tp0\n"
                   "[dsv41] kv_park declined key=r1 bytes=8 why=parking_disabled rank=tp0\n"
                   "[dsv41] kv_park refused: no host copy path rank=tp1\n")
    out = _cli(["receipts", str(log), "--env-file", str(profile), "--ranks", "2", "--json"])
    report = json.loads(out.stdout)
    assert out.returncode == 1 and report["ok"] is False
    assert report["receipts"] == {"kv_park": {"tp0": "installed", "tp1": "refused: no host copy path"}}
    assert report["gaps"] == ["kv_park refused on tp1: no host copy path", "kv_park installed on 1 of 2 ranks (tp0)"]


HICACHE_ARGS = "--enable-hierarchical-cache --hicache-ratio 4 --hicache-write-policy write_back"


@pytest.mark.parametrize("flags,host_pool,take", [
    (HICACHE_ARGS + " --max-total-tokens 100000", "--hicache-ratio 4.0: that many times the device KV pool",
     "up to 2 x the device KV pool's tokens of HiCache's 4 x (200000 of its 400000 host tokens at --max-total-tokens 100000)"),
    ("--enable-hierarchical-cache --hicache-size 64 --hicache-write-policy write_through "
     "--hicache-storage-backend file", "--hicache-size 64: 64 GB per rank",
     "it takes 13.4% of HiCache's host prefix capacity (8.00 GiB of 64 GB per rank), so 13.4% of its host tokens"),
])
def test_check_reads_the_hicache_flags_and_predicts_kv_park_inside_hicaches_budget_and_the_others_installed(
        tmp_path, mellum, flags, host_pool, take):
    """Beside HiCache: kv_park installs and ``check`` says its pool is carved out of HiCache's host
    pool (one host-RAM total, HiCache's) and what it takes of HiCache's prefix capacity in tokens; cone replay is
    predicted from its bound as without HiCache (it acts beside it); SWA thin and the fast tree core
    install (their receipt is the install outcome)."""
    profile = tmp_path / "p.env"
    profile.write_text(f'LAUNCH_ARGS=--model-path {mellum.path} --page-size 1 {flags}\n'
                       "DSV41_KV_PARK=ram\nDSV41_KV_PARK_GIB=8\nDSV41_SWA_THIN=1\nDSV41_SWA_CONE_REPLAY=1\n"
                       "DSV41_SWA_CONE_TOKENS=64\n")
    report = check.evaluate(str(profile))
    hicache = report["launch"]["hicache"]
    assert hicache["write_policy"] in ("write_back", "write_through") and (hicache["ratio"] or hicache["size_gb"])
    receipts = report["receipts"]
    assert receipts["kv_park"] == "installed"
    note = next(n for n in report["notes"] if "the park pool is carved out of HiCache's host pool" in n)
    assert note.startswith(f"beside HiCache ({host_pool})") and "host-RAM total is HiCache's host pool alone" in note
    assert take in note, "check states what the carve-out takes from HiCache's prefix capacity, in tokens"
    assert receipts["cone_replay"] == "installed"
    assert receipts["swa_thin"] == receipts["fast_tree_core"] == "installed"


def test_beside_hicache_check_predicts_whether_the_cone_loads_full_kv_from_host_by_the_tree_core(mellum):
    """The cone loads F's Full KV from host on the Python tree core (SWA thin, or the core chosen by
    name) and falls back on the Rust core: check says which, with a note; without HiCache it says nothing."""
    base = ["--model-path", mellum.path, "--page-size", "1"]
    hier = check.parse_launch([*base, "--enable-hierarchical-cache", "--hicache-ratio", "2"])
    values = {"DSV41_SWA_CONE_TOKENS": 64}
    assert _cone(mellum, hier, values | {"DSV41_SWA_THIN": True}, {})[1]["host_full_kv"] == "load_back"
    named = {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
    assert _cone(mellum, hier, values, named)[1]["host_full_kv"] == "load_back"
    receipt, facts = _cone(mellum, hier, values, {})
    assert receipt == "installed" and facts["host_full_kv"] == "stock_rust_core"
    assert "host_full_kv" not in _cone(mellum, check.parse_launch(base), values | {"DSV41_SWA_THIN": True}, {})[1]


def test_check_without_hicache_predicts_kv_park_installed(tmp_path, mellum):
    profile = tmp_path / "p.env"
    profile.write_text(f'LAUNCH_ARGS=--model-path {mellum.path} --page-size 1\nDSV41_KV_PARK=ram\n')
    report = check.evaluate(str(profile))
    assert report["launch"]["hicache"] is None and report["receipts"]["kv_park"] == "installed"


def test_check_says_which_mode_decode_yield_runs_in(tmp_path):
    profile = tmp_path / "p.env"
    profile.write_text("DSV41_DECODE_YIELD=33\n")
    [note] = [n for n in check.evaluate(str(profile))["notes"] if n.startswith("decode_yield")]
    assert note.startswith("decode_yield: share 33 % in measured mode (windows from measured iteration times")
    profile.write_text("DSV41_DECODE_YIELD=50\nDSV41_DECODE_YIELD_MODE=model\nDSV41_DECODE_YIELD_STEP_US=9000\n")
    report = check.evaluate(str(profile))
    [note] = [n for n in report["notes"] if n.startswith("decode_yield")]
    assert note == "decode_yield: share 50 % in model mode (open-loop integer cost model, coefficients env:step_us)"
    [row] = [s for s in report["switches"] if s["switch"] == "decode_yield"]
    assert row["params"] == {"share": 50, "mode": "model", "cost": "env:step_us"}
