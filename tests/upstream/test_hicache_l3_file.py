"""SGLang's ``file`` L3 (``HiCacheFile``) stores host pages and reads them back byte for byte on CPU,
through the host route's landing-page route (``overlay_tools.simulate.host_route``, which simulate and the
engine kit's ``sgl_kernel`` stand-in share).

An L3 read lands each page in ``host_pool.get_dummy_flat_data_page()`` before
``set_from_flat_data_page`` copies it into the pool (``hicache_storage.py`` ``_read_page``,
``cache_controller.py`` ``_generic_page_get``). Upstream allocates that page with
``pin_memory=self.pin_memory`` (True by default), which needs a CUDA driver: on the CPU kits every
L3 prefetch died there and SGLang discarded it as a miss. The route runs SGLang's own body on an
unpinned view of the pool. Checked on SGLang's real host pools (Mellum's MHA pool, DeepSeek-V4's
paged SWA pool and compressor-state pool) and SGLang's real ``HiCacheFile`` in a temp folder.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from overlay_tools.simulate import host_route


def _classes():
    from sglang.srt.mem_cache import memory_pool_host
    from sglang.srt.mem_cache.pool_host import mha

    return [mha.MHATokenToKVPoolHost, memory_pool_host.DeepSeekV4PagedHostPool,
            memory_pool_host.DeepSeekV4StateHostPool]


@pytest.fixture(scope="module")
def routed():
    """Every HiCache host route applied to SGLang's modules (each checked against its pins), undone after
    the module."""
    from sglang.srt.mem_cache import memory_pool_host
    from sglang.srt.mem_cache.pool_host import common, mha

    route = host_route
    saved_alloc = dict(common.ALLOC_MEMORY_FUNCS)
    saved_pages = {cls: vars(cls)["get_dummy_flat_data_page"] for cls in _classes()}
    bound_before = {m: set(vars(m)) for m in (mha, memory_pool_host)}
    route.check_pins(route.HOST_MEMORY)
    route.route_host_memory(common)
    for module in (mha, memory_pool_host):
        route.check_pins(module.__name__)
        route.route_host_pool_ops(module)
    yield route
    common.ALLOC_MEMORY_FUNCS.clear()
    common.ALLOC_MEMORY_FUNCS.update(saved_alloc)
    for cls, fn in saved_pages.items():
        cls.get_dummy_flat_data_page = fn
    for module, names in bound_before.items():
        for name in set(vars(module)) - names:
            delattr(module, name)


def _rand_bytes(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))


def _mha_host(layout: str):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(size=64, page_size=4, dtype=torch.float32, head_num=2, head_dim=4, layer_num=3,
                              device="cpu", enable_memory_saver=False)
    info = device.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(info, 2.0, 0, 4, layout, device_capacity_tokens=device.size, start_layer=0,
                                end_layer=3)


def _dsv4_hosts(layout: str):
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, DeepSeekV4StateHostPool

    from devkit.testkit import dsv4_pool

    kv = dsv4_pool.build_dsv4_pool()  # layers (0, 4, 128, 4): SWA on all, C4 state on 1 and 3
    swa = DeepSeekV4PagedHostPool(pool_name="swa", device_buffers=list(kv.swa_kv_pool.kv_buffer),
                                  item_bytes=kv.swa_kv_pool.bytes_per_page_padded, num_host_pages=4,
                                  slot_page_size=kv.swa_page_size, layout=layout, page_aligned_only=True)
    state = DeepSeekV4StateHostPool(pool_name="deepseek_v4_c4_state",
                                    state_pools=[kv.compress_state_pools[i] for i in (1, 3)], num_host_pages=4,
                                    swa_page_size=kv.swa_page_size, layout=layout)
    return swa, state


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA driver is present here")
def test_upstreams_l3_landing_page_needs_a_cuda_driver_that_the_cpu_engine_lacks(routed):
    host = _mha_host("page_first")
    assert host.pin_memory
    with pytest.raises(RuntimeError, match=r"NVIDIA driver|CUDA"):
        inspect.unwrap(type(host).get_dummy_flat_data_page)(host)


def test_the_route_pins_each_landing_page_it_replaces(routed):
    for cls in _classes():
        target = f"{cls.__module__}:{cls.__qualname__}.get_dummy_flat_data_page"
        assert routed.PINS[target], target
        assert cls.get_dummy_flat_data_page.__wrapped__ is not cls.get_dummy_flat_data_page


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_the_landing_page_is_sglangs_own_page_shape_and_dtype_in_unpinned_host_memory(routed, layout):
    hosts = [_mha_host(layout), *_dsv4_hosts(layout)]
    for host in hosts:
        page = host.get_dummy_flat_data_page()
        stored = host.get_data_page(0, flat=True)
        assert (page.shape, page.dtype, page.device) == (stored.shape, stored.dtype, stored.device), type(host)
        assert not page.is_pinned() and not page.any()
        assert host.pin_memory  # the pool itself is untouched


def _config(tmp_path):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="kit", extra_config={"file_storage_path": str(tmp_path)})


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_hicachefile_writes_host_pages_and_reads_them_back_into_other_rows_byte_for_byte(routed, tmp_path,
                                                                                         layout):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolName, PoolTransfer

    kv = _mha_host(layout)
    swa, state = _dsv4_hosts(layout)
    pools = {PoolName.KV: kv, PoolName.SWA: swa, PoolName.DEEPSEEK_V4_C4_STATE: state}
    store = HiCacheFile(_config(tmp_path))
    for name, pool in pools.items():
        store.register_mem_host_pool_v2(pool, name)
    keys = ["k0", "k1"]
    # The state pool has no allocator: it reuses the SWA pool's rows (a sidecar of SWA), as in SGLang.
    rows = {n: pools[n].alloc(2 * pools[n].page_size) for n in (PoolName.KV, PoolName.SWA)}
    read = {n: pools[n].alloc(2 * pools[n].page_size) for n in (PoolName.KV, PoolName.SWA)}
    rows[PoolName.DEEPSEEK_V4_C4_STATE], read[PoolName.DEEPSEEK_V4_C4_STATE] = rows[PoolName.SWA], read[PoolName.SWA]
    written = {}
    for i, (name, pool) in enumerate(pools.items()):
        pages = [int(rows[name][j * pool.page_size]) for j in range(2)]
        for j, page in enumerate(pages):
            _rand_bytes(pool.get_data_page(page, flat=False), seed=10 * i + j)
        written[name] = [pool.get_data_page(page, flat=True).clone() for page in pages]
        assert not read[name].equal(rows[name])  # other rows: the read must place the bytes
    transfers = [PoolTransfer(name=n, host_indices=rows[n], keys=keys) for n in pools]
    assert store.batch_set_v2(transfers) == {n: [True, True] for n in pools}
    trailing = [PoolTransfer(name=n, keys=["_"], hit_policy=PoolHitPolicy.TRAILING_PAGES)
                for n in (PoolName.SWA, PoolName.DEEPSEEK_V4_C4_STATE)]
    exists = store.batch_exists_v2(keys, trailing)
    assert (exists.kv_hit_pages, exists.restorable_prefix_pages) == (2, [1, 2])
    got = store.batch_get_v2([PoolTransfer(name=n, host_indices=read[n], keys=keys) for n in pools])
    assert got == {n: [True, True] for n in pools}
    for name, pool in pools.items():
        for j in range(2):
            back = pool.get_data_page(int(read[name][j * pool.page_size]), flat=True)
            assert back.view(torch.uint8).equal(written[name][j].view(torch.uint8)), (name, j)


def test_routing_twice_keeps_one_route_over_sglangs_body(routed):
    from sglang.srt.mem_cache.pool_host import mha

    routed.route_dummy_page(mha.MHATokenToKVPoolHost)  # the finder and an in-process kit can both route
    page = mha.MHATokenToKVPoolHost.get_dummy_flat_data_page
    assert page.__wrapped__.__qualname__ == "MHATokenToKVPoolHost.get_dummy_flat_data_page"
    assert inspect.getsource(page.__wrapped__).lstrip().startswith("def get_dummy_flat_data_page")
