"""End-to-end: SGLang's real HTTP server on CPU (the Mellum kit) with ``--enable-metrics`` and the
gate's profile: after the gate's workload, ``/metrics`` carries each acting switch's ``dsv41_*``
series, equal to what its ``[dsv41]`` log lines report; and ``check`` on the same profile and
launch line predicted the receipts that boot logged (slow: one boot, 60-200 s; always stopped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from adapter.core import metrics, receipts
from devkit import gate
from devkit.engine_kit import client, launcher, model, workload

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def expected_from_lines(lines: list[str]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What the metrics table makes of the log lines: (series, its own labels) -> value."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in lines:
        r = receipts.parse_line(line)
        if r is None:
            continue
        for m in metrics.METRICS:
            if (m.switch, m.event) != (r.switch, r.event):
                continue
            implied = {"reused": "reused", "tuned and saved": "tuned"}
            labels = tuple((k, implied[r.event] if k == "outcome" and r.switch == "autotune_keep" else r.params.get(k, ""))
                           for k in m.labels)
            amount = m.amount(r.params)
            key = (m.name, labels)
            if m.kind == "counter":
                out[key] = out.get(key, 0.0) + amount
            else:  # cumulative and gauge: the last line's value
                out[key] = amount
    return out


def scraped(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    own = {m.name: m.labels for m in metrics.METRICS}
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in own:
                assert sample.labels["tp_rank"] == "0" and "model_name" in sample.labels
                out[(sample.name, tuple((k, sample.labels[k]) for k in own[sample.name]))] = sample.value
    return out


def test_metrics_equal_the_log_lines_and_check_predicted_the_receipts(tmp_path):
    tiny = model.make_model(ROOT / "build" / f"engine_kit_model_{model.ModelSpec().digest()}")
    profile = {**gate.build_profile(), "DSV41_DEBUG_LOG": "1"}
    args = launcher.server_args(tiny, launcher.free_port(), swa_ratio=0.1, extra=["--enable-metrics"])
    env_file = tmp_path / "profile.env"
    env_file.write_text(f"LAUNCH_ARGS={' '.join(args)}\n"
                        + "".join(f"{k}={v}\n" for k, v in profile.items()))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    environ["PYTHONPATH"] = str(ROOT)  # as on the serving image: no sgl_kernel stand-in
    done = subprocess.run([sys.executable, "-m", "adapter", "check", "--env-file", str(env_file), "--json"], cwd=ROOT,
                          env={**environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    predicted = json.loads(done.stdout.strip().splitlines()[-1])

    server = launcher.Server(args, tmp_path / "server.log", profile)
    w = workload.Workload.quick()
    with server:
        workload.run_cache_phases(server.base_url, w)
        workload.run_yield_phase(server.base_url, w, "metrics")
        series = scraped(server.base_url)
    lines = server.log_lines()
    expected = expected_from_lines(lines)
    assert series == expected
    moved = {name for (name, _), value in series.items() if value > 0}
    assert {"dsv41_decode_yield_windows_total", "dsv41_decode_yield_steps_given_total",
            "dsv41_swa_thin_hooked_inserts_total", "dsv41_cone_replay_plans_total",
            "dsv41_cone_replay_tokens_recomputed_total"} <= moved

    from adapter.ops import check

    report = check.receipts_report([str(tmp_path / "server.log")], str(env_file), ranks=1)
    print("\n".join(line for line in lines if "[dsv41]" in line))  # shown when the test fails
    assert all(len(set(by_rank.values())) <= 1 for by_rank in report["receipts"].values()), report["receipts"]
    booted = {name: by_rank.get("tp0", next(iter(by_rank.values()), "nothing logged"))
              for name, by_rank in report["receipts"].items()}
    assert booted == predicted["receipts"]
    assert booted["cone_replay"] == "installed"  # decided at cache build, predicted before the boot


def test_kv_park_series_equal_its_park_and_restore_lines_under_retraction(tmp_path, monkeypatch):
    """The KV park half (the gate's workload retracts nothing): SGLang's retraction test hook
    retracts a decode row every 3 steps on a small pool, as in tests/engine/test_kv_park_server.py."""
    tiny = model.make_model(ROOT / "build" / f"engine_kit_model_{model.ModelSpec().digest()}")
    monkeypatch.setenv("SGLANG_TEST_RETRACT", "1")  # inherited by the server (not a DSV41_* key)
    profile = {"DSV41_KV_PARK": "ram", "DSV41_DEBUG_LOG": "1"}
    args = launcher.server_args(tiny, launcher.free_port(), max_total_tokens=640, extra=["--enable-metrics"])
    server = launcher.Server(args, tmp_path / "server.log", profile)
    ids = workload.Workload()
    with server:
        streams = [client.Stream(server.base_url, f"park{i}", ids.ids(f"park{i}", 200 + 40 * i), 24).start()
                   for i in range(3)]
        for stream in streams:
            assert stream.join(240) and stream.error is None, stream.error
        series = scraped(server.base_url)
    expected = expected_from_lines(server.log_lines())
    assert series == expected
    moved = {name for (name, _), value in series.items() if value > 0}
    assert {"dsv41_kv_park_parks_total", "dsv41_kv_park_parked_bytes_total", "dsv41_kv_park_restores_total",
            "dsv41_kv_park_restored_tokens_total"} <= moved
