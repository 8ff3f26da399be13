"""HiCache's CPU host pieces (``overlay_tools.simulate``: simulate's, and the engine kit's ``sgl_kernel`` stand-in's)
move KV bytes exactly as the CUDA ops and SGLang's own torch path do.

* :mod:`overlay_tools.simulate.host_copies` (pure torch, the stand-in's ``kvcacheio``): each copy op against a reference written from the
  kernel's contract (``item``: one token's bytes of one layer; ``page_first``: item ``i`` of layer
  ``l`` at ``i * layout_dim + l * item_size``), and the single-buffer ops against SGLang's own CPU
  copy (``UnifiedPageEnvelopeHostPool._transfer_pages`` on a CPU device buffer).
* The ``host_memory`` and ``host_pool_ops`` routes: SGLang's real ``MHATokenToKVPoolHost`` builds on
  a CPU device pool (upstream dies in ``torch.cuda.cudart()``), backs rows up and loads them back
  byte for byte, in every layout and io backend a kit can pick.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from overlay_tools.simulate import host_copies, host_route


@pytest.fixture(scope="module")
def io():
    return host_copies


def _ptrs(layers: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


SRC = torch.tensor([7, 2, 11, 3, 0])
DST = torch.tensor([1, 9, 4, 12, 6])
LAYERS, TOKENS, HEADS, DIM = 3, 16, 2, 4  # one item: HEADS * DIM float32 = 32 bytes
ITEM = HEADS * DIM * 4


def test_page_first_ops_place_item_i_of_layer_l_at_i_times_layout_dim_plus_l_items(io):
    device_k = [_rand(TOKENS, HEADS, DIM, seed=layer) for layer in range(LAYERS)]
    device_v = [_rand(TOKENS, HEADS, DIM, seed=10 + layer) for layer in range(LAYERS)]
    host_k = torch.zeros(TOKENS, LAYERS, HEADS, DIM)
    host_v = torch.zeros(TOKENS, LAYERS, HEADS, DIM)
    io.transfer_kv_all_layer_lf_pf(src_k_layers=_ptrs(device_k), dst_k=host_k, src_v_layers=_ptrs(device_v), dst_v=host_v,
                                   src_indices=SRC, dst_indices=DST, item_size=ITEM, dst_layout_dim=LAYERS * ITEM,
                                   num_layers=LAYERS)
    for layer in range(LAYERS):
        assert torch.equal(host_k[DST, layer], device_k[layer][SRC])
        assert torch.equal(host_v[DST, layer], device_v[layer][SRC])
    untouched = torch.ones(TOKENS, dtype=torch.bool)
    untouched[DST] = False
    assert not host_k[untouched].any() and not host_v[untouched].any()

    back_k = [torch.zeros(TOKENS, HEADS, DIM) for _ in range(LAYERS)]
    back_v = [torch.zeros(TOKENS, HEADS, DIM) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        io.transfer_kv_per_layer_pf_lf(src_k=host_k, dst_k=back_k[layer], src_v=host_v, dst_v=back_v[layer],
                                       src_indices=DST, dst_indices=SRC, layer_id=layer, item_size=ITEM,
                                       src_layout_dim=LAYERS * ITEM)
        assert torch.equal(back_k[layer][SRC], device_k[layer][SRC])
        assert torch.equal(back_v[layer][SRC], device_v[layer][SRC])


def test_layer_first_and_mla_ops_copy_rows_between_per_layer_buffers(io):
    src = [_rand(TOKENS, HEADS * DIM, seed=20 + layer) for layer in range(LAYERS)]
    dst = [torch.zeros(TOKENS, HEADS * DIM) for _ in range(LAYERS)]
    io.transfer_kv_all_layer_mla(src_layers=_ptrs(src), dst_layers=_ptrs(dst), src_indices=SRC, dst_indices=DST,
                                 item_size=ITEM, num_layers=LAYERS)
    assert all(torch.equal(d[DST], s[SRC]) for s, d in zip(src, dst))

    k2, v2 = torch.zeros(TOKENS, HEADS * DIM), torch.zeros(TOKENS, HEADS * DIM)
    io.transfer_kv_per_layer(src_k=src[0], dst_k=k2, src_v=src[1], dst_v=v2, src_indices=SRC, dst_indices=DST,
                             item_size=ITEM)
    assert torch.equal(k2[DST], src[0][SRC]) and torch.equal(v2[DST], src[1][SRC])

    host = torch.zeros(TOKENS, LAYERS, HEADS * DIM)
    io.transfer_kv_all_layer_mla_lf_pf(src_layers=_ptrs(src), dst=host, src_indices=SRC, dst_indices=DST,
                                       item_size=ITEM, dst_layout_dim=LAYERS * ITEM, num_layers=LAYERS)
    back = torch.zeros(TOKENS, HEADS * DIM)
    io.transfer_kv_per_layer_mla_pf_lf(src=host, dst=back, src_indices=DST, dst_indices=SRC, layer_id=2,
                                       item_size=ITEM, src_layout_dim=LAYERS * ITEM)
    assert torch.equal(back[SRC], src[2][SRC])


def test_single_buffer_ops_equal_sglangs_own_cpu_copy_of_a_page_envelope(io):
    from sglang.srt.mem_cache.pool_host.unified import UnifiedPageEnvelopeHostPool

    src = _rand(TOKENS, 24, seed=3).to(torch.bfloat16)
    sglang_dst, ours_kernel, ours_direct = (torch.zeros(TOKENS, 24, dtype=torch.bfloat16) for _ in range(3))
    # SGLang's CPU branch: a device page buffer on the CPU copies with index_copy_.
    cpu_pool = SimpleNamespace(_device_page_buffer=src)
    UnifiedPageEnvelopeHostPool._transfer_pages(cpu_pool, src, sglang_dst, SRC, DST, "kernel")
    io.transfer_kv_per_layer_mla(src=src, dst=ours_kernel, src_indices=SRC, dst_indices=DST, item_size=24 * 2)
    io.transfer_kv_direct(src_layers=[src], dst_layers=[ours_direct], src_indices=SRC, dst_indices=DST, page_size=1)
    assert sglang_dst.view(torch.uint8).equal(ours_kernel.view(torch.uint8))
    assert sglang_dst.view(torch.uint8).equal(ours_direct.view(torch.uint8))


def test_direct_page_first_ops_move_whole_pages_between_layer_first_rows_and_the_host_page(io):
    page, pages = 4, 4
    device = [_rand(pages * page, HEADS, DIM, seed=40 + i) for i in range(2 * LAYERS)]  # K layers, then V layers
    host_k = torch.zeros(pages, LAYERS, page, HEADS, DIM)
    host_v = torch.zeros(pages, LAYERS, page, HEADS, DIM)
    device_rows = torch.cat([torch.arange(8, 12), torch.arange(0, 4)])  # device pages 2, 0
    host_rows = torch.cat([torch.arange(4, 8), torch.arange(12, 16)])  # host pages 1, 3
    io.transfer_kv_all_layer_direct_lf_pf(src_ptrs=device, dst_ptrs=[host_k, host_v], src_indices=device_rows,
                                          dst_indices=host_rows, page_size=page)
    for layer in range(LAYERS):
        assert torch.equal(host_k[1, layer], device[layer][8:12]) and torch.equal(host_k[3, layer], device[layer][0:4])
        assert torch.equal(host_v[3, layer], device[LAYERS + layer][0:4])
    back = [torch.zeros_like(t) for t in device]
    io.transfer_kv_per_layer_direct_pf_lf(src_ptrs=[host_k, host_v], dst_ptrs=[back[1], back[LAYERS + 1]],
                                          src_indices=host_rows, dst_indices=device_rows, layer_id=1, page_size=page)
    assert torch.equal(back[1][device_rows], device[1][device_rows])
    assert torch.equal(back[LAYERS + 1][device_rows], device[LAYERS + 1][device_rows])


def test_a_pair_with_a_negative_index_is_skipped_as_the_kernel_skips_it(io):
    src = _rand(TOKENS, 8, seed=5)
    dst = torch.zeros(TOKENS, 8)
    io.transfer_kv_per_layer_mla(src=src, dst=dst, src_indices=torch.tensor([1, -1, 3]),
                                 dst_indices=torch.tensor([2, 5, -1]), item_size=32)
    assert torch.equal(dst[2], src[1]) and not dst[5].any() and int((dst != 0).any(dim=1).sum()) == 1


def test_bad_geometry_and_page_head_ops_fail_by_name(io):
    with pytest.raises(ValueError, match="src_layout_dim=40 with item_size=32"):
        io.transfer_kv_per_layer_mla_pf_lf(src=torch.zeros(4, 10), dst=torch.zeros(4, 8), src_indices=SRC[:1],
                                           dst_indices=DST[:1], layer_id=0, item_size=32, src_layout_dim=40)
    with pytest.raises(NotImplementedError, match="transfer_kv_per_layer_ph_lf"):
        io.transfer_kv_per_layer_ph_lf()
    with pytest.raises(AttributeError, match="transfer_kv_magic"):
        io.transfer_kv_magic  # noqa: B018


# ----------------------------------------------------------------------------- SGLang's real host pool


@pytest.fixture()
def routed(monkeypatch):
    """The two HiCache routes applied to the upstream modules, undone after the test."""
    route = host_route
    from sglang.srt.mem_cache.pool_host import common, mha

    saved_alloc = dict(common.ALLOC_MEMORY_FUNCS)
    bound_before = set(vars(mha))
    route.check_pins(route.HOST_MEMORY)
    route.route_host_memory(common)
    route.check_pins(mha.__name__)
    route.route_host_pool_ops(mha)
    yield route
    common.ALLOC_MEMORY_FUNCS.clear()
    common.ALLOC_MEMORY_FUNCS.update(saved_alloc)
    for name in set(vars(mha)) - bound_before:
        delattr(mha, name)


def _device_pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(size=TOKENS * 2, page_size=1, dtype=torch.float32, head_num=HEADS, head_dim=DIM,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    for i, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer)):
        k.copy_(_rand(*k.shape, seed=100 + i))
        v.copy_(_rand(*v.shape, seed=200 + i))
    return pool


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA driver is present here")
def test_upstream_host_memory_needs_a_cuda_driver_that_the_cpu_engine_lacks():
    from sglang.srt.mem_cache.pool_host import common

    with pytest.raises(RuntimeError, match=r"NVIDIA driver|CUDA"):
        common.alloc_with_host_register((4,), torch.float32, "cpu", True, common.HostTensorAllocator())


def test_the_host_memory_route_allocates_with_sglangs_allocator_and_registers_nothing(routed):
    from sglang.srt.mem_cache.pool_host import common

    alloc = common.ALLOC_MEMORY_FUNCS["cpu"]
    assert alloc.__wrapped__ is common.alloc_with_host_register
    buffer = alloc((2, 5, 3), dtype=torch.bfloat16, device="cpu", pin_memory=True, allocator=common.HostTensorAllocator())
    reference = common.HostTensorAllocator().allocate((2, 5, 3), dtype=torch.bfloat16, device="cpu")
    assert (buffer.shape, buffer.dtype, buffer.device, buffer.is_contiguous()) == (
        reference.shape, reference.dtype, reference.device, reference.is_contiguous())
    assert getattr(buffer, common._CUDA_HOST_REGISTERED_RANGES_ATTR) == []
    data = _rand(2, 5, 3, seed=9).to(torch.bfloat16)
    buffer.copy_(data)
    assert buffer.view(torch.uint8).equal(data.view(torch.uint8))


@pytest.mark.parametrize(("layout", "io_backend"), [("page_first", "kernel"), ("layer_first", "kernel"),
                                                    ("layer_first", "direct"), ("page_first_direct", "direct")])
def test_sglangs_mha_host_pool_backs_up_and_loads_back_every_byte(routed, layout, io_backend):
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = _device_pool()
    info = device.get_device_pool_infos()[0].buffer_info
    host = MHATokenToKVPoolHost(info, 2.0, 0, 1, layout, device_capacity_tokens=device.size, start_layer=0,
                                end_layer=LAYERS)
    assert host.pin_memory  # upstream's default: the route, not a flag, keeps CUDA out
    device_rows = torch.tensor([5, 6, 7, 20, 3])
    host_rows = host.alloc(len(device_rows))
    before = [(k.clone(), v.clone()) for k, v in zip(device.k_buffer, device.v_buffer)]
    host.backup_from_device_all_layer(device, host_rows, device_rows, io_backend)
    for k, v in zip(device.k_buffer, device.v_buffer):
        k.zero_()
        v.zero_()
    for layer in range(LAYERS):
        host.load_to_device_per_layer(device, host_rows, device_rows, layer, io_backend)
    for (k0, v0), k, v in zip(before, device.k_buffer, device.v_buffer):
        assert k[device_rows].view(torch.uint8).equal(k0[device_rows].view(torch.uint8))
        assert v[device_rows].view(torch.uint8).equal(v0[device_rows].view(torch.uint8))
        others = torch.ones(k.shape[0], dtype=torch.bool)
        others[device_rows] = False
        assert not k[others].any() and not v[others].any()
    host.destroy()
