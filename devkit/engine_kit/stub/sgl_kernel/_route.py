"""Two CPU routes the stand-in applies to SGLang modules once they have executed (or at once if
they are already imported). Tests and the gate only.

* ``attention_registry``: the backend name ``torch_native`` builds SGLang's ``IntelAMXAttnBackend``
  (see the package docstring: ``torch_native`` indexes the SWA pool with full-pool indices).
* ``device_timer``: ``_TimingInterval`` records wall-clock events instead of CUDA events. SGLang's
  forward-pass metrics (``--enable-forward-pass-metrics``) time each forward with
  ``torch.get_device_module().Event``, which initialises CUDA and kills the CPU scheduler; on CPU
  the forward is synchronous, so a ``perf_counter`` pair around it is its span.
* ``host_memory`` (HiCache, ``--enable-hierarchical-cache``): a host pool whose transfer device is
  the CPU allocates with SGLang's own allocator but skips ``cudaHostRegister``
  (``alloc_with_host_register`` calls ``torch.cuda.cudart()``, which needs a CUDA driver; with the
  device pool in host memory there is nothing to pin for).
* ``host_pool_ops`` (HiCache): the host pool modules import their copy ops from
  ``sgl_kernel.kvcacheio`` only under ``is_cuda() or is_hip()``; the route binds the same names from
  the stand-in's pure-torch :mod:`sgl_kernel.kvcacheio`, so the pools' own ``kernel`` / ``direct``
  branches run unchanged. The same route gives the host pools the kits build
  (:data:`HOST_DUMMY_PAGES`) a ``get_dummy_flat_data_page`` that allocates unpinned: the page an L3
  read lands in before ``set_from_flat_data_page`` copies it into the pool is ``torch.zeros(...,
  pin_memory=self.pin_memory)`` (``pin_memory`` defaults to True), which needs a CUDA driver; without
  this every L3 prefetch fails in the prefetch thread and SGLang discards it as a miss.

What each route replaces or builds is pinned in :data:`PINS` (one finder, one pin rule with the
overlay's own): a route whose upstream source drifted raises :class:`RouteRefused` naming it, so
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

REGISTRY = "sglang.srt.layers.attention.attention_registry"
DEVICE_TIMER = "sglang.srt.utils.device_timer"
HOST_MEMORY = "sglang.srt.mem_cache.pool_host.common"
ROUTED = "torch_native"
# The copy ops each host pool module imports from sgl_kernel.kvcacheio under is_cuda() or is_hip(),
# as it names them (the stand-in raises by name for the page_head pair: no kit reaches that layout).
HOST_POOL_OPS = {
    "sglang.srt.mem_cache.pool_host.mha": (
        "transfer_kv_all_layer", "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_all_layer_lf_pf",
        "transfer_kv_all_layer_lf_ph", "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_direct",
        "transfer_kv_per_layer", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_per_layer_mla",
        "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf",
    ),
    "sglang.srt.mem_cache.memory_pool_host": (
        "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
        "transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_per_layer_mla",
        "transfer_kv_per_layer_mla_pf_lf",
    ),
}

# The host pool classes the kits build whose ``get_dummy_flat_data_page`` (an L3 read's landing page)
# allocates with ``pin_memory=self.pin_memory``: Mellum's MHA pools, DSV4's paged and state pools.
HOST_DUMMY_PAGES = {
    "sglang.srt.mem_cache.pool_host.mha": ("MHATokenToKVPoolHost",),
    "sglang.srt.mem_cache.memory_pool_host": ("DeepSeekV4PagedHostPool", "DeepSeekV4StateHostPool"),
}


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


def route_host_memory(module) -> None:
    original = module.alloc_with_host_register
    registered = module._CUDA_HOST_REGISTERED_RANGES_ATTR

    def alloc_unregistered(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        buffer = allocator.allocate(dims, dtype=dtype, device=device)
        setattr(buffer, registered, [])  # nothing registered, so nothing for destroy() to unregister
        return buffer

    alloc_unregistered.__wrapped__ = original
    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unregistered


class _Unpinned:
    """A host pool seen with ``pin_memory`` False: every other attribute is the pool's own."""

    pin_memory = False

    def __init__(self, pool) -> None:
        self._pool = pool

    def __getattr__(self, name):
        return getattr(self._pool, name)


def route_dummy_page(cls) -> None:
    """``cls.get_dummy_flat_data_page`` runs SGLang's own body on an unpinned view of the pool: same
    shape, dtype and device, host memory that needs no CUDA driver (nothing to pin for on CPU)."""
    original = cls.get_dummy_flat_data_page
    if getattr(original, "__wrapped__", None) is not None:  # routed already (install() runs per import)
        return

    def get_dummy_flat_data_page(self):
        return original(_Unpinned(self))

    get_dummy_flat_data_page.__wrapped__ = original
    cls.get_dummy_flat_data_page = get_dummy_flat_data_page


def route_host_pool_ops(module, kvcacheio=None) -> None:
    """``kvcacheio``: the stand-in's op module when loaded by path (the in-process test kits)."""
    if kvcacheio is None:
        from sgl_kernel import kvcacheio

    for name in HOST_POOL_OPS[module.__name__]:
        if name not in vars(module):  # bound by upstream on CUDA/ROCm: leave it
            setattr(module, name, getattr(kvcacheio, name))
    for name in HOST_DUMMY_PAGES[module.__name__]:
        route_dummy_page(getattr(module, name))


# What the routes replace or rely on, pinned like the overlay's own targets (the hash of
# adapter.core.pins.source_hash): a route written for another source refuses loudly, naming it.
PINS = {
    f"{REGISTRY}:create_torch_native_backend": "1727eff9e9ab1882d5bf1af72098840affb72ae2b166190d7ad9069bd7679e8f",
    "sglang.srt.layers.attention.intel_amx_backend:IntelAMXAttnBackend.__init__": (
        "78cef79fa3c1d97a60480fd474e6a16072ea4d858699d349242feb8ce79244e5"
    ),
    f"{DEVICE_TIMER}:_TimingInterval.create": "eff8f9040193b1325a49cb10892e21c1346777330c6577e3e7a0da9dbc82aaf6",
    f"{DEVICE_TIMER}:_TimingInterval.end": "80596445d38868ec68ab1aff82055317f855398c3dbbd3741ef3cf827c31857e",
    # host_memory: what it replaces for a CPU transfer device, and the allocator it calls instead
    f"{HOST_MEMORY}:alloc_with_host_register": "2be04a4ad186063a03f395bb5202ffb8a7b4cdbfa1f2a6e1fa92f48dbe003b6e",
    f"{HOST_MEMORY}:HostTensorAllocator.allocate": "7501533b4c095cb8618d8c4e3cf07e3d165875e39cce8500426866c30061b370",
    # host_pool_ops: the transfer methods that call the bound ops, with the kernels' argument names
    "sglang.srt.mem_cache.pool_host.mha:MHATokenToKVPoolHost.load_to_device_per_layer": "1206daa053dca863b09c2276605022cac81b32c8cddcfc7c228c3e1f34943dec",
    "sglang.srt.mem_cache.pool_host.mha:MHATokenToKVPoolHost.backup_from_device_all_layer": "10804e436ba3520db2346c235f7c879340329e49d2e97d6a367a79506d5c472d",
    "sglang.srt.mem_cache.memory_pool_host:DeepSeekV4PagedHostPool.load_to_device_per_layer": "d22ca00a24cfe58228d37cb6873a864069198ff90b12adfd4c100b5ed6adb294",
    "sglang.srt.mem_cache.memory_pool_host:DeepSeekV4PagedHostPool.backup_from_device_all_layer": "4aaefd1e42a838b13557265dcb83fca8c448d9a1f908a5d77d5d7757a5c8ce96",
    "sglang.srt.mem_cache.memory_pool_host:DeepSeekV4StateHostPool.load_to_device_per_layer": "ec17e5cd18c51c57a66e5788b76f52a058ac9d0664cc649dfcc21e3b635fa70a",
    "sglang.srt.mem_cache.memory_pool_host:DeepSeekV4StateHostPool.backup_from_device_all_layer": "ea8fc49e522fd172c48811257135e47225d6cce60852771cdfa3d9b7b75863ab",
    # host_pool_ops, the L3 read's landing page of each pool in HOST_DUMMY_PAGES
    "sglang.srt.mem_cache.pool_host.mha:MHATokenToKVPoolHost.get_dummy_flat_data_page": (
        "aca7ac8f12a130dac8f01cd5d0f315f67f2963c3b23d4f4bc86af4bad21300e7"
    ),
    "sglang.srt.mem_cache.memory_pool_host:DeepSeekV4PagedHostPool.get_dummy_flat_data_page": (
        "439a339bbcb786157da688c26a46c53d493d03db05070fafe7651c2abc5bf90b"
    ),
    "sglang.srt.mem_cache.memory_pool_host:DeepSeekV4StateHostPool.get_dummy_flat_data_page": (
        "72d99971c518139956bd74049d7617a6302b1f27faa65ef59b403419f68e9827"
    ),
}


class RouteRefused(RuntimeError):
    """A route's upstream target drifted from its pin: the kit cannot stand in for it."""


def check_pins(module_name: str) -> None:
    """Raise :class:`RouteRefused` naming every drifted pin of ``module_name``'s route."""
    from adapter.core.pins import check

    drifted = [c.describe() for c in (check(t, PINS) for t in PINS if t.startswith(module_name + ":")) if not c.ok]
    if drifted:
        raise RouteRefused(f"sgl_kernel stand-in route for {module_name} refused: {'; '.join(drifted)}")


def _pinned(module_name: str, route):
    def checked(module) -> None:
        check_pins(module_name)
        route(module)

    return checked


ROUTES = {
    REGISTRY: _pinned(REGISTRY, route_attention),
    DEVICE_TIMER: _pinned(DEVICE_TIMER, route_timer),
    HOST_MEMORY: _pinned(HOST_MEMORY, route_host_memory),
    **{name: _pinned(name, route_host_pool_ops) for name in HOST_POOL_OPS},
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
