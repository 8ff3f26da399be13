"""Two CPU routes the stand-in applies to SGLang modules once they have executed (or at once if
they are already imported). Tests and the gate only.

* ``attention_registry``: the backend name ``torch_native`` builds SGLang's ``IntelAMXAttnBackend``
  (see the package docstring: ``torch_native`` indexes the SWA pool with full-pool indices).
* ``device_timer``: ``_TimingInterval`` records wall-clock events instead of CUDA events. SGLang's
  forward-pass metrics (``--enable-forward-pass-metrics``) time each forward with
  ``torch.get_device_module().Event``, which initialises CUDA and kills the CPU scheduler; on CPU
  the forward is synchronous, so a ``perf_counter`` pair around it is its span.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import time

REGISTRY = "sglang.srt.layers.attention.attention_registry"
DEVICE_TIMER = "sglang.srt.utils.device_timer"
ROUTED = "torch_native"


def _create_cpu_backend(runner):
    from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend

    return IntelAMXAttnBackend(runner)


def route_attention(module) -> None:
    module.ATTENTION_BACKENDS[ROUTED] = _create_cpu_backend


class CpuEvent:
    """The part of ``torch.cuda.Event`` DeviceTimer uses, on the wall clock (milliseconds)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def record(self, stream=None) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return self.at is not None

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: CpuEvent) -> float:
        return (end.at - self.at) * 1000.0


def route_timer(module) -> None:
    interval = module._TimingInterval

    def create(track_stream: bool = False):
        start = CpuEvent()
        start.record()
        return interval(start_event=start, stream=None)

    def end(self, metadata):
        assert self.end_event is None
        stop = CpuEvent()
        stop.record()
        self.end_event = stop
        self.metadata = metadata

    interval.create = staticmethod(create)
    interval.end = end


ROUTES = {REGISTRY: route_attention, DEVICE_TIMER: route_timer}


class _RouteFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        route = ROUTES.get(fullname)
        if route is None:
            return None
        sys.meta_path.remove(self)  # find the real spec without finding ourselves
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            route(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    for name, route in ROUTES.items():
        if name in sys.modules:
            route(sys.modules[name])
    if not any(isinstance(f, _RouteFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _RouteFinder())
