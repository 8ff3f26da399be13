"""Why a turn left its cache holder: smg 1.13.0's count-pressure gate read against the in-flight
counts the workers' own logs give.

The gate (``model_gateway/src/policies/cache_aware.rs:1805-1831`` in the smg 1.13.0 sdist): a
holder of the request's deepest tree match is over it when its in-flight count ``load`` exceeds
``balance_rel_threshold`` x the fleet's mean ``m`` AND ``m + margin``, the margin being
``min(balance_abs_threshold, max(4, ceil(2 sqrt(m))))``. A request whose every holder is over it
spills to the expected-wait worker among those under it (``select_final_from_affinity``, l.2068),
and its text is inserted for that worker, so the conversation's next turn follows it there.

The router's in-flight count of a worker is the requests it sent there whose responses have not
ended: the bench samples it from the router's own gauge (:func:`sampled_loads`); without samples
:func:`loads_at` counts, from the workers' request logs (arrival and end-to-end latency), the
requests in flight on each worker at a request's arrival (the request itself left out), which
undercounts what the router holds while a response is still streaming or a request waits for the
worker's HTTP server to read it. Either way a request's loads are read at its arrival in the
worker's log, which lags the router's dispatch while the worker's HTTP server is slow to read it
(a loaded machine): a ``gated, stayed`` turn is usually one read after the router had chosen.

A holder out of routing is the other way a turn leaves it: smg's worker overload veto
(:class:`devkit.bench.fleet.gateway.Veto`) takes a worker out of routing, its cache holders
included, from the poll that finds it over a threshold to the poll that finds it under (10 s
apart by default); a turn sent away meanwhile is a ``veto``. smg's own ``spill`` branch count
(``smg_cache_aware_policy_branch_total``) counts both: a tree match served by a worker that is not
among the match's tenants. The holders of a request are the workers that served the earlier requests sharing
its longest token prefix (the tree holds every request's text for the worker it went to: the
deepest match's tenants), when that prefix is over ``cache_threshold`` of the prompt.
:func:`turns` gives, per request, its holders, the loads, whether the gate was over on every holder
and where it went; :func:`summary` counts moves explained by the gate and the loads behind them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from devkit.bench.fleet.served import Served
from overlay_tools.simulate.gateway.router import RouterConfig, over_gate


@dataclass(frozen=True)
class VetoWindow:
    """Worker ``worker`` out of routing from ``set_s`` until ``cleared_s`` (None: to the end); the
    router logs whole seconds, so a window is widened by :data:`LOG_RESOLUTION_S` at its end."""

    worker: int
    set_s: float
    cleared_s: float | None

    def covers(self, worker: int, t: float) -> bool:
        end = math.inf if self.cleared_s is None else self.cleared_s + LOG_RESOLUTION_S
        return worker == self.worker and self.set_s <= t < end


LOG_RESOLUTION_S = 1.0


def loads_at(served: Sequence[Served], request: Served, workers: int) -> list[int]:
    """Per worker, the requests in flight when ``request`` arrived (``request`` itself left out)."""
    loads = [0] * workers
    for s in served:
        if s is not request and s.received_s <= request.received_s < s.received_s + (s.e2e_s or 0.0):
            loads[s.worker] += 1
    return loads


def sampled_loads(served: Sequence[Served], samples: Sequence[tuple[float, dict[str, float]]],
                  urls: Sequence[str]) -> list[list[int]] | None:
    """Per request, the router's own in-flight count per worker (``urls``) in the last sample taken
    before the request reached its worker (:class:`devkit.bench.fleet.gateway.LoadSampler`); None
    without samples."""
    if not samples:
        return None
    import bisect

    times = [t for t, _ in samples]
    out = []
    for r in served:
        i = bisect.bisect_right(times, r.received_s) - 1
        loads = samples[max(i, 0)][1]
        out.append([int(loads.get(url, 0)) for url in urls])
    return out


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class Turn:
    index: int
    worker: int
    holders: tuple[int, ...]  # empty: a miss (no prefix over cache_threshold)
    loads: tuple[int, ...]
    gated: bool  # every holder over the gate: the router must spill
    moved: bool  # served by a worker that held none of its prefix
    vetoed: bool = False  # every holder out of routing (the worker overload veto) at its arrival

    @property
    def kind(self) -> str:
        if not self.holders:
            return "miss"
        if self.vetoed and self.moved:
            return "veto"
        if self.gated:
            return "spill" if self.moved else "gated, stayed"
        return "moved, not gated" if self.moved else "hit"


def turns(served: Sequence[Served], workers: int, settings: RouterConfig | None = None,
          loads: Sequence[Sequence[int]] | None = None, vetoes: Sequence[VetoWindow] = ()) -> list[Turn]:
    """Each request (in arrival order) against the gate, with the loads at its arrival: ``loads``
    per request (the router's own, :func:`sampled_loads`) or, without them, :func:`loads_at`;
    ``vetoes``: the windows the router's overload veto left a worker out of routing."""
    settings = settings or RouterConfig()
    out = []
    for i, r in enumerate(served):
        depth = max((_common(p.input_ids, r.input_ids) for p in served[:i]), default=0)
        hit = depth > settings.cache_threshold * len(r.input_ids)
        holders = tuple(sorted({p.worker for p in served[:i] if _common(p.input_ids, r.input_ids) == depth})) if hit else ()
        now = list(loads[i]) if loads is not None else loads_at(served, r, workers)
        mean = sum(now) / workers
        gated = bool(holders) and all(over_gate(now[h], mean, settings) for h in holders)
        vetoed = bool(holders) and all(any(v.covers(h, r.received_s) for v in vetoes) for h in holders)
        out.append(Turn(i, r.worker, holders, tuple(now), gated, bool(holders) and r.worker not in holders, vetoed))
    return out


def summary(found: Sequence[Turn]) -> dict[str, Any]:
    """Counts per kind (``hit``, ``miss``, ``spill``, ``veto``, ``gated, stayed``, ``moved, not gated``) and,
    for the spills, the holder's in-flight count and the other worker's at the moment."""
    kinds: dict[str, int] = {}
    for t in found:
        kinds[t.kind] = kinds.get(t.kind, 0) + 1
    spills = [t for t in found if t.kind == "spill"]
    return {"kinds": kinds, "spill_loads": [[t.loads[h] for h in t.holders] + [t.loads[t.worker]] for t in spills],
            "max_load": [max((t.loads[w] for t in found), default=0) for w in range(len(found[0].loads))] if found else []}
