"""Two CPU routes the stand-in applies to SGLang modules once they have executed (or at once if
they are already imported). Tests and the gate only.

* ``attention_registry``: the backend name ``torch_native`` builds SGLang's ``IntelAMXAttnBackend``
  (see the package docstring: ``torch_native`` indexes the SWA pool with full-pool indices).
* ``device_timer``: ``_TimingInterval`` records wall-clock events instead of CUDA events. SGLang's
  forward-pass metrics (``--enable-forward-pass-metrics``) time each forward with
  ``torch.get_device_module().Event``, which initialises CUDA and kills the CPU scheduler; on CPU
  the forward is synchronous, so a ``perf_counter`` pair around it is its span.
* ``host_memory`` and ``host_pool_ops`` (HiCache, ``--enable-hierarchical-cache``): host pools that
  allocate without ``cudaHostRegister``, the pure-torch ``kvcacheio`` copies bound into the host pool
  modules, unpinned L3 landing pages. One copy, in the wheel: :mod:`overlay_tools.simulate.host_route`
  (``simulate`` applies it in its own process); the kit servers run with the repo on ``PYTHONPATH``,
  so this finder takes those routes and their pins from there.

What each route replaces or builds is pinned in :data:`PINS` (one finder, one pin rule with the
overlay's own): a route whose upstream source drifted raises :class:`overlay_tools.simulate.host_route.RouteRefused` naming it, so
the kit never stands in for code it was not written for.

With ``SGL_STUB_DSV4=1`` (the DeepSeek-V4 kit, ``devkit.engine_kit.dsv4.launch``) the kit's pinned
routes (``devkit.engine_kit.dsv4.routes``: pure-torch stand-ins for the DSV4 CUDA/JIT kernels) join
the same table, so one finder applies every route.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import time

from overlay_tools.simulate import host_route

REGISTRY = "sglang.srt.layers.attention.attention_registry"
DEVICE_TIMER = "sglang.srt.utils.device_timer"
ROUTED = "torch_native"


def _create_cpu_backend(runner):
    # Checked here, not when the registry module loads: that can happen while intel_amx_backend is
    # itself still importing.
    check_pins("sglang.srt.layers.attention.intel_amx_backend")
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

    create.__wrapped__ = interval.create  # pins look through the routes, as through any wrapper
    end.__wrapped__ = interval.end
    interval.create = staticmethod(create)
    interval.end = end


# What the routes replace or rely on, pinned like the overlay's own targets (the hash of
# adapter.core.pins.source_hash): a route written for another source refuses loudly, naming it.
PINS = {
    f"{REGISTRY}:create_torch_native_backend": "1727eff9e9ab1882d5bf1af72098840affb72ae2b166190d7ad9069bd7679e8f",
    "sglang.srt.layers.attention.intel_amx_backend:IntelAMXAttnBackend.__init__": (
        "78cef79fa3c1d97a60480fd474e6a16072ea4d858699d349242feb8ce79244e5"
    ),
    f"{DEVICE_TIMER}:_TimingInterval.create": "eff8f9040193b1325a49cb10892e21c1346777330c6577e3e7a0da9dbc82aaf6",
    f"{DEVICE_TIMER}:_TimingInterval.end": "80596445d38868ec68ab1aff82055317f855398c3dbbd3741ef3cf827c31857e",
    **host_route.PINS,  # host_memory and host_pool_ops
}


def check_pins(module_name: str) -> None:
    """Raise :class:`overlay_tools.simulate.host_route.RouteRefused` naming every drifted pin of ``module_name``'s route."""
    host_route.check_pins(module_name, PINS)


def _pinned(module_name: str, route):
    def checked(module) -> None:
        check_pins(module_name)
        route(module)

    return checked


ROUTES = {
    REGISTRY: _pinned(REGISTRY, route_attention),
    DEVICE_TIMER: _pinned(DEVICE_TIMER, route_timer),
    host_route.HOST_MEMORY: _pinned(host_route.HOST_MEMORY, host_route.route_host_memory),
    **{name: _pinned(name, host_route.route_host_pool_ops) for name in host_route.HOST_POOL_OPS},
}


def _chain(first, second):
    def route(module) -> None:
        first(module)
        second(module)

    return route


def _add_dsv4_routes() -> None:
    """``SGL_STUB_DSV4=1`` (set by ``devkit.engine_kit.dsv4.launch``): the DeepSeek-V4 kit's routes
    (pure-torch stand-ins for the CUDA/JIT kernels, each pinned) join this table."""
    import os

    if os.environ.get("SGL_STUB_DSV4") != "1":
        return
    from devkit.engine_kit.dsv4.routes import ROUTES as DSV4_ROUTES

    for name, route in DSV4_ROUTES.items():
        ROUTES[name] = _chain(ROUTES[name], route) if name in ROUTES else route


_add_dsv4_routes()


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
