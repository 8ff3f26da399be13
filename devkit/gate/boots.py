"""The gate's boots: one server boot running the workload, and the calibration between boots.

Every server is started and stopped by :mod:`devkit.engine_kit.launcher` (through the model kit of
:mod:`devkit.engine_kit.model_kits`), one at a time.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from devkit.gate import hicache_leg
from devkit.gate.record import Boot
from devkit.gate.verdict import available


def calibrate(fpm_log: Path | None, out: Path) -> dict[str, Any]:
    """Run ``fit-cost-model`` on a forward-pass-metrics log; returns status, coefficients, output."""
    ok, reason = available("decode_yield")
    if not ok:
        return {"status": f"not available in this build: {reason}", "keys": {}}
    if fpm_log is None or not fpm_log.is_file() or fpm_log.stat().st_size == 0:
        return {"status": "failed: no forward-pass metrics were recorded on the control boot", "keys": {}}
    command = [sys.executable, "-m", "adapter", "fit-cost-model", str(fpm_log), "--topk", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("DSV41_")},
                               "OMP_NUM_THREADS": "1"})
    (out / "fit-cost-model.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"status": f"failed (exit {done.returncode}): {tail[0]}", "keys": {}, "output": done.stdout + done.stderr}
    keys = dict(re.findall(r"(DSV41_DECODE_YIELD_[A-Z_]+)=(\d+)", done.stdout))
    if not keys:
        return {"status": "failed: fit-cost-model printed no profile line", "keys": {}, "output": done.stdout}
    return {"status": "fitted on this machine", "keys": keys, "output": done.stdout}


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM stops the gate like Ctrl-C does, so the running server is stopped on the way out."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_boot(boot: Boot, model: Path, workload: Any, out: Path, *, say: Callable[[str], None],
             kit: Any = None, plugin: Any = None, launch_extra: tuple[str, ...] = ()) -> Boot:
    from devkit.engine_kit import fpm, launcher, model_kits
    from devkit.engine_kit import workload as wl

    kit = kit or model_kits.kit("mellum")
    ipc = f"ipc://{tempfile.gettempdir()}/dsv41-gate-{os.getpid()}-{boot.label}"
    server = kit.server(model, boot.log, boot.profile, [
        "--decode-log-interval", "1", "--enable-forward-pass-metrics", "--forward-pass-metrics-ipc-name", ipc,
        *launch_extra,
    ], plugin=plugin)
    if hicache_leg.ON in launch_extra and plugin is None:
        # SGLang refuses any HiCache host pool while the machine has under 10 GiB available, however
        # small the pool (the kit's are a few MiB): the kit's seam lowers that reserve (the import hook only)
        server.env = launcher.with_seams(server.env, "hicache_reserve")
    boot.launch_extra = tuple(launch_extra)
    boot.fpm_log = out / f"fpm-{boot.label}.jsonl"
    recorder = fpm.Recorder(ipc, boot.fpm_log)
    try:
        recorder.start()
    except Exception as exc:  # no pyzmq or no sglang here: the boot still runs, calibration says why
        say(f"  forward-pass metrics not recorded: {type(exc).__name__}: {exc}")
        recorder = None
    try:
        server.start()
        boot.startup_s = server.startup_s
        say(f"  {boot.label}: up in {server.startup_s:.0f} s; cache phases ...")
        boot.cache = wl.run_cache_phases(server.base_url, workload)
        say(f"  {boot.label}: resume cached {boot.cache['resume_cached_frac']:.2f}, "
            f"cone recomputed {boot.cache['cone_recomputed_tokens']}"
            f"{'; host phase ...' if workload.host_churn_requests else '; yield phase ...'}")
        boot.host = wl.run_host_phase(server.base_url, workload)
        if boot.host:
            say(f"  {boot.label}: host phase resumed {boot.host['cached_tokens']} of {boot.host['context_tokens']} "
                "cached; yield phase ...")
        boot.yield_log_from = len(server.log_lines())
        boot.yield_ = wl.run_yield_phase(server.base_url, workload, boot.label)
        say(f"  {boot.label}: decode share {boot.yield_['decode_share']}")
    finally:
        boot.leftover = server.stop()
        if recorder is not None:
            recorder.stop()
        boot.log_lines = server.log_lines()
    return boot
