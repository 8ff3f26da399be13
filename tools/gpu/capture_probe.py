"""What a CUDA graph capture on one thread does to parking copies on another (``tools/gpu/check.sh``).

Observations, not pass/fail tests (those are in ``tests/unit/test_kv_park_cuda.py``): each scenario
runs in its own process (an unlocked conflict may leave CUDA state behind), a worker thread saves
pages in a loop with the copy engine while the main thread captures and replays a small graph:

* ``global_unlocked``: default (global) mode, no capture lock: does CUDA refuse the copy or invalidate
  the capture? (Why the lock exists; SGLang's serving-time recaptures use this mode.)
* ``global_locked``: the same with ``CUDAGraph.capture_begin/_end`` wrapped by the capture lock.
* ``thread_local_unlocked``: ``capture_error_mode="thread_local"``, no lock (why the lock skips it).

``python tools/gpu/capture_probe.py OUT.json``: one JSON object, ``{"device", "scenarios": {name:
{...}}}``; without CUDA every scenario reads ``{"status": "skipped: no CUDA device"}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

SCENARIOS = ("global_unlocked", "global_locked", "thread_local_unlocked")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _scenario(name: str) -> dict:
    import torch

    sys.path.insert(0, ROOT)
    from adapter.switches.kv_park.capture import CaptureLock, locked_capture_begin, locked_capture_end
    from adapter.switches.kv_park.engine import CopyEngine
    from adapter.switches.kv_park.page_format import PageLayout, Region, per_view_save

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    layout = PageLayout(
        tuple(
            Region(f"r{i}", torch.randint(0, 256, (64, 1 << 20), dtype=torch.uint8, device=dev, generator=g))
            for i in range(2)
        )
    )
    lock = CaptureLock(wait_s=30)
    engine = CopyEngine(layout, chunk_bytes=8 << 20, capture_lock=lock)
    ids = torch.randperm(64)[:32]
    want = per_view_save(layout, ids.tolist(), torch.empty((32, layout.page_bytes), dtype=torch.uint8))
    if name == "global_locked":
        cls = torch.cuda.CUDAGraph
        begin, end = cls.capture_begin, cls.capture_end
        cls.capture_begin = lambda self, *a, **k: locked_capture_begin(begin.__get__(self), self, a, k, lock=lock)
        cls.capture_end = lambda self, *a, **k: locked_capture_end(end.__get__(self), self, a, k, lock=lock)
    mode = "thread_local" if name.startswith("thread_local") else "global"

    stop = threading.Event()
    saves: list[tuple[float, float, bool]] = []
    copy_errors: list[str] = []

    def worker() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                ok = torch.equal(engine.save(ids), want)
            except Exception as exc:
                copy_errors.append(f"{type(exc).__name__}: {exc}"[:300])
                time.sleep(0.005)
                continue
            saves.append((t0, time.perf_counter(), bool(ok)))

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    while not saves and not copy_errors:
        time.sleep(0.001)
    capture_errors: list[str] = []
    replays: list[bool] = []
    spans: list[tuple[float, float]] = []
    for _ in range(5):
        x = torch.randn(1 << 20, device=dev)
        y = torch.empty_like(x)
        graph = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        try:
            with torch.cuda.graph(graph, capture_error_mode=mode):
                y.copy_(x * 2 + 1)
                time.sleep(0.05)
                y.mul_(3)
            spans.append((t0, time.perf_counter()))
            graph.replay()
            torch.cuda.synchronize()
            replays.append(bool(torch.allclose(y, (x * 2 + 1) * 3)))
        except Exception as exc:
            capture_errors.append(f"{type(exc).__name__}: {exc}"[:300])
            try:
                torch.cuda.synchronize()
            except Exception as exc2:
                capture_errors.append(f"after: {type(exc2).__name__}: {exc2}"[:300])
                break
    stop.set()
    t.join(30)
    overlapped = sum(1 for s0, s1, _ in saves for c0, c1 in spans if s0 < c1 and s1 > c0)
    return {
        "status": "ran",
        "capture_error_mode": mode,
        "locked": name == "global_locked",
        "captures": len(spans),
        "capture_errors": capture_errors[:5],
        "replays_ok": bool(replays) and all(replays),
        "saves": len(saves),
        "saves_identical": bool(saves) and all(ok for _, _, ok in saves),
        "copy_errors": copy_errors[:5],
        "copy_error_count": len(copy_errors),
        "saves_overlapping_a_capture": overlapped,
        "lock_waits": lock.waits,
        "lock_drains": lock.drains,
    }


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "--scenario":
        print(json.dumps(_scenario(argv[1])))
        return 0
    out = argv[0] if argv else None
    import torch

    result: dict = {"device": "cuda" if torch.cuda.is_available() else "cpu", "scenarios": {}}
    for name in SCENARIOS:
        if not torch.cuda.is_available():
            result["scenarios"][name] = {"status": "skipped: no CUDA device"}
            continue
        try:
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--scenario", name],
                capture_output=True,
                text=True,
                timeout=float(os.environ.get("PROBE_SCENARIO_TIMEOUT_S", "60")),
            )
        except subprocess.TimeoutExpired:
            result["scenarios"][name] = {"status": "timeout"}
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode == 0 and lines:
            result["scenarios"][name] = json.loads(lines[-1])
        else:
            result["scenarios"][name] = {"status": f"crashed rc={proc.returncode}", "stderr_tail": proc.stderr[-1500:]}
        sys.stderr.write(proc.stderr[-3000:])
    text = json.dumps(result, indent=1)
    if out:
        with open(out, "w") as fh:
            fh.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
