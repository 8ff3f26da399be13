"""The switches' Prometheus metrics (adapter/core/metrics.py) in a process whose SGLang runtime
context was published with and without ``--enable-metrics``: counters equal what the ``[dsv41]``
lines report, and with metrics off nothing is registered and prometheus_client is never imported.

Each case runs in its own Python process (SGLang publishes its configuration once per process, and
prometheus_client picks its multiprocess mode at import), like a scheduler process of the engine.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapter.core import metrics, receipts
from devkit.engine_kit import launcher, model

REPO = Path(__file__).resolve().parents[2]

# (switch, event, fields) in the order a scheduler would log them; the autotune line comes before
# the engine publishes its configuration (model load), like in a real boot.
EVENTS = [
    # the first window armed by the load guard below pct; the load gauge follows the last window
    ("decode_yield", "window", {"chunk": 64, "prefix": 0, "rows": 3, "n": 4, "floor": 1, "given": 4, "ended": "served",
                                "guard": 16, "load": 0.52}),
    ("decode_yield", "window", {"chunk": 64, "prefix": 64, "rows": 3, "n": 5, "floor": 1, "given": 2, "ended": "min_bs"}),
    ("decode_yield", "window", {"chunk": 64, "prefix": 128, "rows": 2, "n": 3, "floor": 1, "given": 3, "ended": "served",
                                "load": 0.25}),
    ("swa_thin", "demoted", {"hooked": 5, "demoting_inserts": 2, "demoted_nodes": 3}),
    ("swa_thin", "demoted", {"hooked": 9, "demoting_inserts": 4, "demoted_nodes": 7}),
    ("cone_replay", "DSV41_SWA_CONE plan", {"rid": "a", "F": 96, "s": 64, "N": 32, "P": 32}),
    ("cone_replay", "DSV41_SWA_CONE copy", {"rid": "a", "pages": 2, "bytes": 4096}),
    ("cone_replay", "DSV41_SWA_CONE forward", {"rows": 32}),
    ("cone_replay", "DSV41_SWA_CONE fallback", {"rid": "b", "reason": "full_not_resident", "F": 96, "P": 0}),
    ("kv_park", "parked", {"rid": "c", "pages": 2, "outcome": "saved", "bytes": 2048, "held": 2048}),
    ("kv_park", "parked", {"rid": "d", "pages": 1, "outcome": "refused", "bytes": 0, "held": 2048}),
    ("kv_park", "declined", {"key": "d", "bytes": 1024, "why": "parking_disabled"}),
    ("kv_park", "evicted", {"key": "c", "bytes": 2048}),
    ("kv_park", "restored", {"rid": "c", "pages": 2, "tokens": 64, "cached": 0, "held": 0}),
    ("swa_native_decode", "fallback", {"reason": "rows"}),
    ("autotune_keep", "reused", {"cache": "x.json"}),
]
SCRIPT = """
import json, sys
from adapter.core import metrics, receipts
from devkit.engine_kit import model
events, model_path, enable = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
receipts.event("autotune_keep", "dropped", reason="launch-changed", cache="y.json")  # before publish
from sglang.srt.runtime_context import SpawnRanks, publish
from sglang.srt.server_args import ServerArgs
publish(ServerArgs(model_path=model_path, device="cpu", enable_metrics=enable), role="scheduler",
        ranks=SpawnRanks(world_rank=0))
for switch, what, fields in events:
    receipts.event(switch, what, **fields)
for _ in range(3):
    metrics.tally("swa_native_decode", "fallback", reason="rows")
    metrics.tally("swa_native_decode", "served")
out = {"on": metrics.STATE.on, "decided": metrics.STATE.decided,
       "prometheus_imported": "prometheus_client" in sys.modules, "samples": []}
if enable:
    from prometheus_client import CollectorRegistry, multiprocess
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    out["samples"] = [[s.name, s.labels, s.value] for fam in registry.collect() for s in fam.samples
                      if s.name.startswith("dsv41_")]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return model.make_model(tmp_path_factory.mktemp("kit") / "model")


def _run(tiny_model, tmp_path, enable: bool) -> tuple[dict, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env.update(PYTHONPATH=os.pathsep.join([str(launcher.STUB_PATH), str(REPO)]), PROMETHEUS_MULTIPROC_DIR=str(tmp_path), SGLANG_USE_CPU_ENGINE="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(EVENTS), str(tiny_model), "1" if enable else "0"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return result, [line for line in done.stderr.splitlines() if receipts.TAG in line]


def _value(samples, name, **labels) -> float:
    found = [v for n, lab, v in samples if n == name and all(lab.get(k) == str(x) for k, x in labels.items())]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else 0.0


@pytest.mark.spawns
def test_counters_equal_what_the_switches_log_lines_report_under_sglang_labels(tiny_model, tmp_path):
    result, lines = _run(tiny_model, tmp_path, enable=True)
    assert result["on"] and result["decided"]
    samples = result["samples"]
    parsed = [r for r in map(receipts.parse_line, lines) if r is not None]

    def lines_of(switch, event):
        return [r.params for r in parsed if (r.switch, r.event) == (switch, event)]

    windows = lines_of("decode_yield", "window")
    assert len(windows) == 3
    for ended in ("served", "min_bs"):
        assert _value(samples, "dsv41_decode_yield_windows_total", ended=ended) == sum(w["ended"] == ended for w in windows)
    assert _value(samples, "dsv41_decode_yield_steps_given_total") == sum(int(w["given"]) for w in windows) == 9
    assert _value(samples, "dsv41_decode_yield_steps_planned_total") == sum(int(w["n"]) for w in windows) == 12
    assert _value(samples, "dsv41_decode_yield_load") == float(windows[-1]["load"]) == 0.25
    last = lines_of("swa_thin", "demoted")[-1]  # running totals: the counter is the last line's
    assert _value(samples, "dsv41_swa_thin_hooked_inserts_total") == int(last["hooked"]) == 9
    assert _value(samples, "dsv41_swa_thin_demoted_nodes_total") == int(last["demoted_nodes"]) == 7
    assert _value(samples, "dsv41_cone_replay_plans_total") == len(lines_of("cone_replay", "DSV41_SWA_CONE plan")) == 1
    assert _value(samples, "dsv41_cone_replay_tokens_recomputed_total") == 32
    assert _value(samples, "dsv41_cone_replay_copied_bytes_total") == 4096
    assert _value(samples, "dsv41_cone_replay_fallbacks_total", reason="full_not_resident") == 1
    assert _value(samples, "dsv41_kv_park_parks_total", outcome="saved") == 1
    assert _value(samples, "dsv41_kv_park_parks_total", outcome="refused") == 1
    assert _value(samples, "dsv41_kv_park_parked_bytes_total") == 2048
    assert _value(samples, "dsv41_kv_park_declined_total") == 1
    assert _value(samples, "dsv41_kv_park_evictions_total") == 1 and _value(samples, "dsv41_kv_park_evicted_bytes_total") == 2048
    assert _value(samples, "dsv41_kv_park_restores_total") == 1 and _value(samples, "dsv41_kv_park_restored_tokens_total") == 64
    assert _value(samples, "dsv41_kv_park_held_bytes") == 0  # the last line's held=
    # one logged line plus three tallied calls (native decode logs a reason once, counts every call)
    assert len(lines_of("swa_native_decode", "fallback")) == 1
    assert _value(samples, "dsv41_native_decode_fallbacks_total", reason="rows") == 4
    assert _value(samples, "dsv41_native_decode_served_total") == 3
    # the line logged before the engine published its configuration is counted once it did
    assert _value(samples, "dsv41_autotune_keep_dropped_total", reason="launch-changed") == 1
    assert _value(samples, "dsv41_autotune_keep_caches_total", outcome="reused") == 1
    labels = next(lab for n, lab, _ in samples if n == "dsv41_kv_park_restores_total")
    assert {"model_name": str(tiny_model), "tp_rank": "0", "pp_rank": "0"}.items() <= labels.items()
    assert {"engine_type", "moe_ep_rank"} <= labels.keys()
    assert {n.removesuffix("_total") for n, _, _ in samples} <= {n.removesuffix("_total") for n in metrics.families()}


@pytest.mark.spawns
def test_with_metrics_off_nothing_is_registered_and_prometheus_client_is_never_imported(tiny_model, tmp_path):
    result, lines = _run(tiny_model, tmp_path, enable=False)
    assert result["decided"] and not result["on"]
    assert not result["prometheus_imported"]
    assert list(tmp_path.iterdir()) == []  # no metric file was written
    assert any("decode_yield window" in line for line in lines)  # the lines are logged as before


def test_every_metric_is_documented_in_docs_metrics_md():
    text = (REPO / "docs" / "metrics.md").read_text()
    missing = [name for name in metrics.families() if f"`{name}`" not in text]
    assert missing == []


def test_every_metric_is_fed_by_a_switch_of_the_registry():
    from adapter.core import registry

    assert {m.switch for m in metrics.METRICS} <= {s.name for s in registry.SWITCHES}
