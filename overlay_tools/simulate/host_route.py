"""HiCache's host tier on CPU, in ``simulate``'s own process: two routes over SGLang's host pools.

* ``host_memory`` (``--enable-hierarchical-cache``): a host pool whose transfer device is the CPU
  allocates with SGLang's own allocator but skips ``cudaHostRegister`` (``alloc_with_host_register``
  calls ``torch.cuda.cudart()``, which needs a CUDA driver; with the device pool in host memory there
  is nothing to pin for).
* ``host_pool_ops``: the host pool modules import their copy ops from ``sgl_kernel.kvcacheio`` only
  under ``is_cuda() or is_hip()``; the route binds the same names from the pure-torch
  :mod:`.host_copies`, so the pools' own ``kernel`` / ``direct`` branches run unchanged. It also
  gives the host pools in :data:`HOST_DUMMY_PAGES` a ``get_dummy_flat_data_page`` that allocates
  unpinned: the page an L3 read lands in before ``set_from_flat_data_page`` copies it into the pool
  is ``torch.zeros(..., pin_memory=self.pin_memory)`` (``pin_memory`` defaults to True), which needs
  a CUDA driver.

What each route replaces or relies on is pinned in :data:`PINS` (the overlay's pin rule): a route
whose upstream source drifted raises :class:`RouteRefused` naming it, before anything is patched.

:func:`apply` routes this process once; only ``simulate`` (its cache kit, :func:`.cache_kit.attach_hicache`)
calls it, never a serving process. The engine kit's ``sgl_kernel`` stand-in (devkit) takes these
routes and pins from here for its CPU servers: one copy.
"""

from __future__ import annotations

from typing import Any

HOST_MEMORY = "sglang.srt.mem_cache.pool_host.common"
# The host pools' RAM check (host_memory_budget_bytes: available RAM less a 10 GiB reserve for a serving
# node, else the budget of a host_memory_budget_scope) and what the simulation's budget is read with.
HOST_BUDGET = "sglang.srt.mem_cache.pool_host.base"
HOST_AVAILABLE = "sglang.srt.mem_cache.host_memory"
# The copy ops each host pool module imports from sgl_kernel.kvcacheio under is_cuda() or is_hip(),
# as it names them (host_copies raises by name for the page_head pair: nothing here reaches that layout).
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

# The host pool classes whose ``get_dummy_flat_data_page`` (an L3 read's landing page) allocates with
# ``pin_memory=self.pin_memory``: the MHA pools, DSV4's paged and state pools.
HOST_DUMMY_PAGES = {
    "sglang.srt.mem_cache.pool_host.mha": ("MHATokenToKVPoolHost",),
    "sglang.srt.mem_cache.memory_pool_host": ("DeepSeekV4PagedHostPool", "DeepSeekV4StateHostPool"),
}

# What the routes replace or rely on, pinned like the overlay's own targets (the hash of
# adapter.core.pins.source_hash): a route written for another source refuses loudly, naming it.
PINS = {
    # host_memory: what it replaces for a CPU transfer device, and the allocator it calls instead
    f"{HOST_MEMORY}:alloc_with_host_register": "2be04a4ad186063a03f395bb5202ffb8a7b4cdbfa1f2a6e1fa92f48dbe003b6e",
    f"{HOST_MEMORY}:HostTensorAllocator.allocate": "7501533b4c095cb8618d8c4e3cf07e3d165875e39cce8500426866c30061b370",
    # host_budget: the scope the simulation's host pools are booked in, the check it feeds, the RAM it reads
    f"{HOST_BUDGET}:host_memory_budget_scope": "e09188b4fba5b1b3294b3725553b4f2862af6737b98a59434afde70d0f2456d0",
    f"{HOST_BUDGET}:host_memory_budget_bytes": "1b1c4d570cade55179250c788758daf0ff731494bf7f3700f8e8143457be2cd3",
    f"{HOST_AVAILABLE}:available_host_memory_bytes": (
        "81082bb404a43ac93109d29534e69652bc273bcc200519fcf24b6aa5607f9be5"),
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
    """A route's upstream target drifted from its pin: the route cannot stand in for it."""


def check_pins(module_name: str, pins: dict[str, str] | None = None) -> None:
    """Raise :class:`RouteRefused` naming every drifted pin of ``module_name``'s route in ``pins``
    (default :data:`PINS`)."""
    from adapter.core.pins import drifted

    found = drifted(PINS if pins is None else pins, module_name + ":")
    if found:
        raise RouteRefused(f"CPU route for {module_name} refused: {'; '.join(found)}")


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
    if getattr(original, "__wrapped__", None) is not None:  # routed already
        return

    def get_dummy_flat_data_page(self):
        return original(_Unpinned(self))

    get_dummy_flat_data_page.__wrapped__ = original
    cls.get_dummy_flat_data_page = get_dummy_flat_data_page


def route_host_pool_ops(module, kvcacheio=None) -> None:
    """Bind :data:`HOST_POOL_OPS` into ``module`` from ``kvcacheio`` (default :mod:`.host_copies`)
    where upstream did not, and unpin its :data:`HOST_DUMMY_PAGES` landing pages."""
    if kvcacheio is None:
        from overlay_tools.simulate import host_copies as kvcacheio

    for name in HOST_POOL_OPS[module.__name__]:
        if name not in vars(module):  # bound by upstream on CUDA/ROCm: leave it
            setattr(module, name, getattr(kvcacheio, name))
    for name in HOST_DUMMY_PAGES[module.__name__]:
        route_dummy_page(getattr(module, name))


def host_budget() -> Any:
    """A ``host_memory_budget_scope`` of this machine's available RAM (SGLang's own reading of it): the
    host pools ``simulate`` builds are booked against what is free, without the 10 GiB SGLang keeps
    back on a serving node (the simulation is the only thing this process runs). A pool that does not
    fit still refuses with SGLang's own error."""
    from sglang.srt.mem_cache.host_memory import available_host_memory_bytes
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    check_pins(HOST_BUDGET)
    check_pins(HOST_AVAILABLE)
    return host_memory_budget_scope(available_host_memory_bytes(allow_cgroup_fallback=True))


_APPLIED: list[bool] = []


def apply() -> None:
    """Both routes on SGLang's host pool modules in this process, once, each checked against its pins
    first (a drifted target raises :class:`RouteRefused` before anything is patched)."""
    if _APPLIED:
        return
    from sglang.srt.mem_cache import memory_pool_host
    from sglang.srt.mem_cache.pool_host import common, mha

    check_pins(HOST_MEMORY)
    for module in (mha, memory_pool_host):
        check_pins(module.__name__)
    route_host_memory(common)
    for module in (mha, memory_pool_host):
        route_host_pool_ops(module)
    _APPLIED.append(True)
