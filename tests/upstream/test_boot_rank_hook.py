"""The boot's rank hook on the real SGLang scheduler module: a scheduler process installs the
import-time switches before SGLang publishes its rank (``rank=pid<N>``, like every other process
that imports the module); once ``configure_scheduler_process`` has run (right after ``publish``),
each switch's receipt is logged again under the scheduler's ``tp<N>`` rank, and only those count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapter.core import boot, pins, receipts, registry
from devkit import soak

ROOT = Path(__file__).resolve().parents[2]
PROFILE = {"DSV41_SWA_THIN": "1", "DSV41_DECODE_YIELD": "50"}  # fast_tree_core comes with swa_thin
IMPORT_TIME = ("decode_yield", "fast_tree_core", "swa_thin")

# What run_scheduler_process does before it builds the Scheduler: publish the spawn rank, then
# configure the process (the real functions, in a process of its own: they set the process title,
# the logger and the parent-death signal).
SCHEDULER_START = """
import sys
import sglang.srt.managers.scheduler as scheduler
from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
from sglang.srt.server_args import ServerArgs

tp_rank = int(sys.argv[1])
args = ServerArgs(model_path="dummy", tp_size=2, device="cpu")
publish(args, role="scheduler",
        ranks=SpawnRanks(world_rank=spawn_world_rank(args, tp_rank=tp_rank, pp_rank=0), gpu_id=tp_rank))
scheduler.configure_scheduler_process(args, tp_rank)
"""


@pytest.fixture(scope="module")
def scheduler_tp1_log() -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **soak.TP2_ENV, **PROFILE)
    out = subprocess.run([sys.executable, "-c", SCHEDULER_START, "1"], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return [line for line in out.stderr.splitlines() if receipts.TAG in line]


@pytest.mark.spawns
def test_a_scheduler_logs_its_import_time_switches_once_under_its_pid_then_once_under_its_rank(scheduler_tp1_log):
    parsed = [receipts.parse_line(line) for line in scheduler_tp1_log]
    assert not [r for r in parsed if r is None or r.refusal], scheduler_tp1_log
    installs = [(r.switch, r.rank) for r in parsed if r.event == "installed"]
    pid = next(rank for _, rank in installs if rank.startswith("pid"))
    assert sorted(installs) == sorted([(n, pid) for n in IMPORT_TIME] + [(n, "tp1") for n in IMPORT_TIME])
    # The announcement restates the install's parameters.
    params = {(r.switch, r.rank): r.params for r in parsed if r.event == "installed"}
    assert all(params[(n, pid)] == params[(n, "tp1")] for n in IMPORT_TIME)


@pytest.mark.spawns
def test_one_scheduler_and_pid_lines_pass_one_rank_and_fail_two_naming_the_scheduler_seen(scheduler_tp1_log):
    config = registry.resolve(PROFILE)
    main_process = [line for line in scheduler_tp1_log if "rank=pid" in line]  # what a main process logs
    log = main_process + scheduler_tp1_log
    assert receipts.audit(log, config, ranks=1) == []
    assert receipts.audit(log, config, ranks=2) == [f"{n} installed on 1 of 2 ranks (tp1)" for n in IMPORT_TIME]


def test_a_process_with_no_published_rank_announces_nothing(capfd):
    import sglang.srt.managers.scheduler as scheduler  # noqa: F401  (the hook's module, already imported)

    state = boot.install(PROFILE)
    assert state.rank_hook == "installed"
    capfd.readouterr()
    boot.announce_rank(state)  # this test process never published a rank
    assert receipts.TAG not in capfd.readouterr().err


def test_the_rank_hook_is_off_with_one_warning_when_its_pin_drifted_and_a_boot_failure_under_strict(monkeypatch, capfd):
    import sglang.srt.managers.scheduler as scheduler

    stock = scheduler.configure_scheduler_process
    monkeypatch.setitem(pins.PINS, registry.RANK_HOOK, "0" * 64)
    state = boot.install(PROFILE)
    assert state.rank_hook.startswith(f"off: {registry.RANK_HOOK} drifted from the pin")
    assert scheduler.configure_scheduler_process is stock
    assert "rank hook off" in capfd.readouterr().err
    boot.uninstall()
    with pytest.raises(boot.BootError, match="rank hook is off under DSV41_STRICT=1"):
        boot.install({**PROFILE, "DSV41_STRICT": "1"})


def test_uninstall_takes_the_rank_hook_off():
    import sglang.srt.managers.scheduler as scheduler

    stock = scheduler.configure_scheduler_process
    boot.install(PROFILE)
    assert scheduler.configure_scheduler_process is not stock
    boot.uninstall()
    assert scheduler.configure_scheduler_process is stock
