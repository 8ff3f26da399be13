"""The switch's process state: the store, the copy engines per pool, pins, and the CUDA streams
whose work writes or reads KV pages (what a copy follows and what waits for it).

Importing this module imports no SGLang.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from adapter.switches.kv_park import regions
from adapter.switches.kv_park.engine import CopyEngine
from adapter.switches.kv_park.store import SWITCH, ParkStore

GIB = 1 << 30


@dataclass
class _Engines:
    full: CopyEngine  # full-attention pages, addressed by full page id (slot // page_size)
    swa: CopyEngine | None  # SWAKVPool: the SWA side, addressed by SWA page id


@dataclass
class _State:
    store: ParkStore
    engines: dict[int, tuple[Any, _Engines | None]] = field(default_factory=dict)  # id(pool) -> (pool, engines)
    said: set[str] = field(default_factory=set)  # one-time log lines already written
    # rid -> (tree, TreeLock) on the pages a restore inserted, held until the request is admitted
    # (its admission then locks them as its prefix) so running rows do not evict them meanwhile.
    pins: dict[Any, tuple[Any, Any]] = field(default_factory=dict)
    checked_hicache: bool = False  # the first scheduler pass learned the forward stream
    pool_booted: bool = False  # the park pool (or its absence) was settled: at boot, else the first pass
    # The scheduler's forward stream (learned at the first pass): under the overlap loop the forward
    # writes and reads KV pages there, not on the scheduler thread's current stream.
    forward_stream: Any = None
    beside_hicache: bool = False  # the park pool is carved out of HiCache's host pools
    # rid -> the servable tokens of a retraction the tree held in full (nothing parked): its pages
    # are pinned at the re-admission pass, as a restore's are.
    tree_held: dict[Any, array] = field(default_factory=dict)

    def once(self, what: str, **params: object) -> None:
        line = what + repr(sorted(params.items()))
        if line not in self.said:
            self.said.add(line)
            SWITCH.event(what, **params)

    def engines_for(self, pool: Any) -> _Engines | None:
        known = self.engines.get(id(pool))
        if known is not None and known[0] is pool:
            return known[1]
        engines = None
        try:
            full, swa = regions.layouts_for(pool)
            engines = _Engines(CopyEngine(full), CopyEngine(swa) if swa is not None else None)
        except regions.Unsupported as exc:
            self.once("unsupported", pool=type(pool).__name__, reason=str(exc).replace(" ", "_"))
        self.engines[id(pool)] = (pool, engines)
        return engines


def kv_streams(state: _State, device: torch.device) -> list[Any]:
    """The CUDA streams whose queued work writes or reads KV pages: the scheduler thread's current
    stream (the forward runs there without the overlap loop) and the scheduler's forward stream."""
    streams = [torch.cuda.current_stream(device)]
    forward = state.forward_stream
    if forward is not None and forward != streams[0]:
        streams.append(forward)
    return streams


def _recorded_on(streams: list[Any]) -> list[Any]:
    """One CUDA event recorded now on each stream: the point a copy must follow."""
    events = []
    for stream in streams:
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    return events
