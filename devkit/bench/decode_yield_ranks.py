"""``python -m adapter bench decode-yield-ranks [--quick]``: two TP ranks that measure differently
take the same windows, and what the agreement costs per broadcast.

Two processes, each a real SGLang ``Scheduler`` on the CPU harness with decode yield in measured
mode, joined by a torch.distributed gloo group that stands where SGLang's ``Scheduler.tp_cpu_group``
stands (``tp_size`` 2): the switch broadcasts rank 0's window on it, once per window
(:func:`adapter.switches.decode_yield.switch.agree`). Each rank's forwards take scripted wall times,
and rank 1's differ (its decode steps 30 % slower, its chunks 20 % faster), as two ranks' clocks
never agree. Rows: with the agreement (the switch as it is) and without it (each rank keeps its own
window, what a clock-reading controller would do alone): the windows of each rank and whether
every scheduler decision of the two ranks is equal; the agreement's cost per broadcast (median
wall time of the switch's ``agree`` call, one int64 broadcast, on each rank, timed after an untimed
barrier: the harness's ranks run no forward collectives that would keep them in step as an
engine's all-reduces do) and of a bare
int64 broadcast on the same group (median of 2,000, after 200 warm-up).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any

PCT = 33
SLOWER_STEP, FASTER_CHUNK = 1.3, 0.8  # rank 1's clock against rank 0's


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, agree: bool, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from adapter.switches.decode_yield import switch as yield_switch
    from devkit.testkit import decode_yield_scripted as scripted

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group(ranks=[0, 1], backend="gloo")  # as SGLang builds its cpu_group
    timings: list[int] = []
    original = yield_switch.agree

    def timed(scheduler: Any, n: int) -> int:
        # the harness's ranks run no forward collectives, so one runs ahead of the other: meet first
        # (untimed), as a real engine's ranks do at every forward's all-reduce, then time the call
        dist.barrier(group=group)
        t = time.perf_counter_ns()
        value = original(scheduler, n)
        timings.append(time.perf_counter_ns() - t)
        return value

    yield_switch.agree = timed if agree else (lambda scheduler, n: n)  # type: ignore[assignment]
    harness: list[Any] = []

    def on_built(h: Any) -> None:
        h.scheduler.tp_size, h.scheduler.tp_cpu_group = 2, group
        harness.append(h)

    step_scale, chunk_scale = (SLOWER_STEP, FASTER_CHUNK) if rank == 1 else (1.0, 1.0)
    script = scripted.Script(lambda k: int(10 * scripted.MS * chunk_scale * (1 + k / 39)),
                             lambda k: int(2 * scripted.MS * step_scale))
    try:
        cycles = scripted.run(PCT, script, on_built=on_built)
    finally:
        yield_switch.agree = original  # type: ignore[assignment]
    h = harness[0]
    decisions = [(s.kind, s.rids, s.extend_lens, s.prefix_lens, s.decode_rows, s.remaining) for s in h.trace]
    bare: list[int] = []
    value = torch.tensor([rank], dtype=torch.int64)
    for i in range(2200):
        dist.barrier(group=group)
        t = time.perf_counter_ns()
        dist.broadcast(value, group=group, group_src=0)
        if i >= 200:
            bare.append(time.perf_counter_ns() - t)
    dist.destroy_process_group()
    out.put({"rank": rank, "windows": [c[1] for c in cycles], "decisions": decisions,
             "share": round(scripted.share(cycles[3:]), 4), "agree_ns": timings, "bare_ns": bare})


def two_ranks(agree: bool) -> dict[int, dict[str, Any]]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, agree, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        got = out.get(timeout=600)
        results[got["rank"]] = got
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"rank process exited with {p.exitcode}")
    return results


def _us(values: list[int]) -> float | None:
    return round(statistics.median(values) / 1000, 1) if values else None


def run(quick: bool) -> dict[str, Any]:
    rows = {}
    for agree in (True, False):
        r = two_ranks(agree)
        rows["agreed" if agree else "each its own"] = {
            "windows_rank0": r[0]["windows"], "windows_rank1": r[1]["windows"],
            "identical_windows": r[0]["windows"] == r[1]["windows"],
            "identical_decisions": r[0]["decisions"] == r[1]["decisions"],
            "share_rank0_clock": r[0]["share"], "share_rank1_clock": r[1]["share"],
            "agree_us_rank0": _us(r[0]["agree_ns"]), "agree_us_rank1": _us(r[1]["agree_ns"]),
            "windows": len(r[0]["windows"]), "broadcasts": len(r[0]["agree_ns"]),
            "bare_broadcast_us_rank0": _us(r[0]["bare_ns"]), "bare_broadcast_us_rank1": _us(r[1]["bare_ns"]),
        }
    load = os.getloadavg()
    print(f"decode-yield-ranks: 2 gloo ranks, pct {PCT}, rank 1's steps x{SLOWER_STEP} and chunks x{FASTER_CHUNK}; "
          f"load average {load[0]:.2f}")
    for name, row in rows.items():
        print(f"  {name}: windows identical {row['identical_windows']}, decisions identical "
              f"{row['identical_decisions']}; rank 0 {row['windows_rank0'][:12]}..., rank 1 "
              f"{row['windows_rank1'][:12]}...; share on rank 0's clock {row['share_rank0_clock']}, on rank 1's "
              f"{row['share_rank1_clock']}; agree per broadcast {row['agree_us_rank0']} / {row['agree_us_rank1']} µs "
              f"({row['broadcasts']} broadcasts, {row['windows']} windows), bare int64 broadcast {row['bare_broadcast_us_rank0']} / "
              f"{row['bare_broadcast_us_rank1']} µs")
    return {"rows": rows, "load_average": [round(x, 2) for x in load]}
