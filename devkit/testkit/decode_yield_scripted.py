"""Decode yield's controller against scripted wall times, on the real scheduler (CPU).

:class:`Script` says what each batch costs (the long prompt's chunk ``k``, a decode step while chunk
``k`` is the last one run, the extra cost of the first step after a chunk); the harness's
``ScriptedClock`` makes that the time the switch measures. A *cycle* is one non-final chunk of the
long prompt and the decode steps before the next chunk; its share is the streams' tokens at their
rate alone (the scripted step, no alternation cost) over the cycle's wall time: what an operator
measures. Used by ``tests/upstream/test_decode_yield_closed_loop.py`` and by the ``scripted`` rows of
``python -m adapter bench decode-yield``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

SCHEDULER = "sglang.srt.managers.scheduler"
CHUNK, PROMPT_CHUNKS, STREAMS = 512, 40, 4
MS = 1_000_000
# the open-loop model's coefficients for a 10 ms chunk and a 2 ms step, whatever the rows and prefix
MODEL_10_2 = {"DSV41_DECODE_YIELD_CHUNK_US": "10000", "DSV41_DECODE_YIELD_TOKEN_NS": "0",
              "DSV41_DECODE_YIELD_PAIR_FS": "0", "DSV41_DECODE_YIELD_TOPK": "0", "DSV41_DECODE_YIELD_STEP_US": "2000",
              "DSV41_DECODE_YIELD_ROW_NS": "0", "DSV41_DECODE_YIELD_KV_PS": "0"}

Cycle = tuple[int, int, int, int]  # (chunk index, decode steps, wall ns, streams' reference ns)


class Script:
    """Scripted wall times: chunk ``k`` of the long prompt costs ``chunk(k)``, a decode step while the
    prompt's chunk ``k`` is the last one run costs ``step(k)``, plus ``switch`` when it follows a
    chunk (the alternation). Other prefills (the streams' own) cost 1 ms."""

    def __init__(self, chunk: Callable[[int], int], step: Callable[[int], int], switch: int = 0):
        self.chunk_ns, self.step_ns, self.switch = chunk, step, switch
        self.long_rid: str | None = None
        self.chunks = 0
        self.after_chunk = False

    def fresh(self) -> Script:
        return Script(self.chunk_ns, self.step_ns, self.switch)

    def __call__(self, s: Any) -> int:
        if s.kind == "prefill":
            self.after_chunk = self.long_rid in s.rids
            if not self.after_chunk:
                return MS
            self.chunks += 1
            return int(self.chunk_ns(self.chunks - 1))
        cost = int(self.step_ns(max(self.chunks - 1, 0))) + (self.switch if self.after_chunk else 0)
        self.after_chunk = False
        return cost


def install(pct: int | None, env: dict[str, str] | None = None) -> None:
    """Decode yield at ``pct`` through the real boot path (``None``: stock)."""
    from adapter.core import boot

    importlib.import_module(SCHEDULER)
    boot.uninstall()
    if pct is None:
        return
    state = boot.install({"DSV41_DECODE_YIELD": str(pct), **(env or {})})
    if state.outcomes["decode_yield"].status != "installed":
        raise RuntimeError(f"decode_yield did not install: {state.outcomes['decode_yield'].reason}")


def run(pct: int | None, script: Script, *, mode: str = "measured", interval: int = 0,
        env: dict[str, str] | None = None, on_ready: Callable[[], None] | None = None,
        on_built: Callable[[Any], None] | None = None, final: bool = False) -> list[Cycle]:
    """Streams decode, then the long prompt prefills in ``PROMPT_CHUNKS`` chunks of ``CHUNK``; its
    cycles (``final``: and its final chunk last, as a cycle of no step). ``pct`` None: stock (with
    ``interval``: ``--prefill-decode-interval``). ``on_built(h)`` runs on the harness before any
    request (a rank's process group, say); ``on_ready()`` once the streams decode, right before the
    long prompt arrives."""
    from adapter.switches.decode_yield import clock as yield_clock
    from devkit.testkit.scheduler import ScriptedClock, build_scheduler

    install(pct, {"DSV41_DECODE_YIELD_MODE": mode, **(env or {})} if pct is not None else None)
    h = build_scheduler(page_size=64, pool_tokens=1 << 18, chunked_prefill_size=CHUNK, max_reqs=16,
                        prefill_decode_interval=interval)
    clock = ScriptedClock(script)
    h.on_forward = clock.forward
    saved, yield_clock.now = yield_clock.now, clock.now
    if on_built is not None:
        on_built(h)
    try:
        for _ in range(STREAMS):
            h.add_request(1000, max_new_tokens=100_000)
        h.drain()
        h.run(4)
        long = h.add_request(CHUNK * PROMPT_CHUNKS, max_new_tokens=2)
        script.long_rid = long.rid
        if on_ready is not None:
            on_ready()
        start = len(h.trace)
        h.run_until(long.finished, max_passes=50_000)
    finally:
        yield_clock.now = saved
    return cycles(h.trace[start:], long.rid, script, final)


def cycles(steps: list[Any], rid: str, script: Script, final: bool = False) -> list[Cycle]:
    """The prompt's cycles from a trace, costed by replaying ``script``; the final chunk arms no
    window and is no cycle (``final``: it comes last all the same, its chunk alone, no step: the
    whole prefill, as a client timing the prompt's first token sees it)."""
    replay = script.fresh()
    replay.long_rid = rid
    found: list[list[int]] = []
    last_chunk = 0  # the cost of the prompt's last chunk so far
    for s in steps:
        cost = replay(s)
        if s.kind == "prefill" and rid in s.rids:
            found.append([replay.chunks - 1, 0, cost, 0])
            last_chunk = cost
        elif s.kind == "decode" and found:
            found[-1][1] += 1
            found[-1][2] += cost
            found[-1][3] += int(script.step_ns(replay.chunks - 1))
    served = [(c[0], c[1], c[2], c[3]) for c in found[:-1]]
    return [*served, (found[-1][0], 0, last_chunk, 0)] if final and found else served


def share(found: list[Cycle]) -> float:
    return sum(c[3] for c in found) / sum(c[2] for c in found)


def quarters(found: list[Cycle]) -> list[float]:
    """The share in each quarter of the cycles (the last takes what does not divide: the final chunk)."""
    q = len(found) // 4
    return [round(share(found[i * q:(i + 1) * q if i < 3 else None]), 4) for i in range(4)]


# The bench's scenarios: (name, pct, script factory, what it shows, cycles left out of the quarters).
# A step change in the step's cost lands inside a window planned on the old cost: that window gives
# more than the share (0.67 at pct 50: its rest is re-planned after two steps, its first valued at
# the old step) and the next one repays it (0.00); the two are the
# transition, left out of the per-quarter figures and kept in the share over the prompt.
SCENARIOS: tuple[tuple[str, int, Callable[[], Script], str, tuple[int, ...]], ...] = (
    ("steady", 33, lambda: Script(lambda k: 10 * MS, lambda k: 2 * MS), "chunk 10 ms, step 2 ms", ()),
    ("step change", 50, lambda: Script(lambda k: 10 * MS, lambda k: 2 * MS if k < 20 else 5 * MS),
     "step 2 ms, 5 ms from chunk 20", (20, 21)),
    ("slow chunk", 33, lambda: Script(lambda k: 40 * MS if k == 10 else 10 * MS, lambda k: 2 * MS),
     "chunk 10 costs 4x", ()),
    ("alternation", 50, lambda: Script(lambda k: 10 * MS, lambda k: 2 * MS, switch=3 * MS),
     "first step after a chunk +3 ms", ()),
    ("growing chunk", 33, lambda: Script(lambda k: int(10 * MS * (1 + k / (PROMPT_CHUNKS - 1))), lambda k: 2 * MS),
     "chunk 10 -> 20 ms over the prompt", ()),
)


def table_rows() -> list[dict[str, Any]]:
    """Each scenario with the closed loop (measured) and the open-loop model fitted to its start
    (chunk 10 ms, step 2 ms): the share over the prompt, final chunk included, and per quarter (the
    first 3 cycles left out: the boot's first window runs on the model's ratio and the next two
    repay its error)."""
    rows = []
    for name, pct, make, what, transition in SCENARIOS:
        for mode in ("measured", "model"):
            found = run(pct, make(), mode=mode, env=MODEL_10_2 if mode == "model" else None, final=True)[3:]
            steady = [c for c in found if c[0] not in transition]
            rows.append({"scenario": name, "what": what, "pct": pct, "mode": mode, "share": round(share(found), 4),
                         "quarters": quarters(steady), "left_out": list(transition),
                         "windows": [c[1] for c in found[:-1]]})
    install(None)
    return rows
