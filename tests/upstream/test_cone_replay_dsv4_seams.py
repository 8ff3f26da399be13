"""Cone replay's DeepSeek-V4 pieces at their CPU seams. The DSV4 forward does not run
here; what runs is the real pool and the real torch functions the forward calls:

* the copy on a real ``DeepSeekV4TokenToKVPool`` (C4/C128 latents, C4 index keys), over exactly
  the buffers its ``get_contiguous_buf_infos`` registers for PD transfer;
* the write mask through the real ``DeepseekV4AttnBackend._compressor_out_loc``;
* the window floor through the real torch ``build_causal_swa_page_indices``;
* decoder SWA bounded replay's tail rows and their window floor through the real
  ``late_layer_tail_layout``.
"""

from __future__ import annotations

import pytest
import torch

from devkit.testkit.cone_replay_parts import ConePlan, align_up, copy_full_pages, dsv4_forward_fields, dsv4_window_floor

PAGE, W = 256, 128


@pytest.fixture(scope="module")
def dsv4_pool():
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from overlay_tools.simulate import cache_kit

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PAGE))
    cache_kit._SERVER_ARGS_PAGE[:] = [PAGE]
    return DeepSeekV4TokenToKVPool(
        max_num_reqs=4, swa_size=1024, c4_size=2048, c128_size=2048, c4_state_pool_size=64,
        c128_state_pool_size=64, page_size=PAGE, swa_page_size=PAGE, dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448,
        qk_rope_head_dim=64, indexer_head_dim=128, layer_num=4, device="cpu", enable_memory_saver=False,
        compression_ratios=[4, 128, 4, 128], sliding_window=W,
    )


def _plan(s: int, F: int) -> ConePlan:
    return ConePlan("r", F, s, 0, None, None, 0)


def test_copy_moves_every_registered_full_side_page_of_a_real_dsv4_pool(dsv4_pool):
    from devkit.testkit.cone_replay_parts import decide, facts_of_pool, full_side_buffers, swa_layer_count

    assert swa_layer_count(dsv4_pool) == 4
    # layers C4/C128/C4/C128: max(512 + 4 + 0, 512 + W, 512 + 4 + 2W, 512 + 3W) = 896 -> 1024
    assert decide(facts_of_pool(dsv4_pool, tokens=1024, window=W, page=PAGE)).bound == 1024
    bufs = full_side_buffers(dsv4_pool)
    ptrs, _, _ = dsv4_pool.get_contiguous_buf_infos()
    assert sorted(b.data_ptr() for b, _ in bufs) == sorted(ptrs)  # the PD transfer's buffers, all of them
    gen = torch.Generator().manual_seed(0)
    for buf, _ in bufs:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    before = [buf.clone() for buf, _ in bufs]
    src_pages, dst_pages = torch.tensor([3, 4, 9]), torch.tensor([20, 21, 30])
    ar = torch.arange(PAGE)
    src = (src_pages[:, None] * PAGE + ar).flatten()
    dst = (dst_pages[:, None] * PAGE + ar).flatten()
    pages, nbytes = copy_full_pages(dsv4_pool, src, dst)
    assert pages == 3
    expect = 0
    for (buf, rows), old in zip(bufs, before):
        r = torch.arange(rows)
        s_rows = (src_pages[:, None] * rows + r).flatten()
        d_rows = (dst_pages[:, None] * rows + r).flatten()
        assert torch.equal(buf[d_rows], old[s_rows])  # destination pages now hold the source pages
        untouched = torch.ones(buf.shape[0], dtype=torch.bool)
        untouched[d_rows] = False
        assert torch.equal(buf[untouched], old[untouched])  # nothing else moved
        expect += int(buf[0].nbytes) * rows * 3
    assert nbytes == expect


def test_copy_refuses_slots_that_are_not_whole_pages(dsv4_pool):
    src = torch.arange(PAGE, 2 * PAGE)
    with pytest.raises(AssertionError, match="not whole pages"):
        copy_full_pages(dsv4_pool, src, src.flip(0))


def test_the_dsv4_bound_takes_the_largest_per_layer_need_and_names_a_bad_ratio_list():
    from adapter.switches.cone_replay.geometry import cone_bound_dsv4

    assert cone_bound_dsv4(W, PAGE, 3, ratios=[0, 4, 128]) == 768  # the kit's model: C128 last
    assert cone_bound_dsv4(W, PAGE, 3, ratios=[0, 128, 4]) == 1024  # a C4 layer last pools 4 rows more
    assert cone_bound_dsv4(W, PAGE, 5, ratios=[0, 2, 1, 1, 0]) == 1024  # the V4.1 kit: ratios 1/2 pool no earlier rows
    assert cone_bound_dsv4(W, PAGE, 61, ratios=[4] * 60 + [128]) == 8192  # the profile's N covers it
    assert cone_bound_dsv4(W, PAGE, 61) == 8448  # ratios unknown: every layer taken as C4
    with pytest.raises(ValueError, match=r"ratios=\[0, 4\] has 2 entries, expected layers=3"):
        cone_bound_dsv4(W, PAGE, 3, ratios=[0, 4])


def test_under_decoder_replay_the_dsv4_bound_counts_the_layers_up_to_the_last_kv_source_only():
    from adapter.switches.cone_replay.geometry import cone_bound_dsv4

    # the V4.1 kit, sources 1 and 2: layers 0..2 count, max(512, 512 + W, 512 + 2W) = 768
    assert cone_bound_dsv4(W, PAGE, 5, ratios=[0, 2, 1, 1, 0], tail_from=2) == 768
    assert cone_bound_dsv4(W, PAGE, 5, ratios=[0, 2, 1, 1, 0], tail_from=4) == 1024  # every layer: no trim
    # 61 layers whose last KV source is layer 10 (C4): 512 + 4 + 10W = 1796 -> 2048 (8192 without the tail)
    assert cone_bound_dsv4(W, PAGE, 61, ratios=[4] * 60 + [128], tail_from=10) == 2048
    assert cone_bound_dsv4(W, PAGE, 5, ratios=[0, 2, 1, 1, 0], tail_from=-1) == 512  # a stage of tail layers only


def test_decoder_replay_tail_rows_read_no_window_below_the_tail_and_a_v4_pool_names_no_tail_layer(dsv4_pool):
    from sglang.kernels.ops.attention.dsv4.attn_metadata_kernels import late_layer_tail_layout

    from devkit.testkit.cone_replay_parts import decide, facts_of_pool

    # SGLang's tail of a 1,536-row extend ending at 2,560 (one request) and of a batch of two: the
    # last W rows, each floored at seq_len - W (so the late layers of those rows read only each other)
    rows, lens, floor = late_layer_tail_layout(extend_lens_cpu=[1536], seq_lens_cpu=[2560], tail_len=W,
                                               device=torch.device("cpu"))
    assert lens == [W] and torch.equal(rows, torch.arange(1536 - W, 1536)) and (floor == 2560 - W).all()
    rows, lens, floor = late_layer_tail_layout(extend_lens_cpu=[512, 300], seq_lens_cpu=[2560, 300], tail_len=W,
                                               device=torch.device("cpu"))
    assert lens == [W, W] and torch.equal(floor, torch.tensor([2560 - W] * W + [300 - W] * W, dtype=torch.int32))
    assert dsv4_pool.kv_source_layers == []  # V4: decoder replay cannot run, the tail cannot be told
    refused = decide(facts_of_pool(dsv4_pool, tokens=8192, window=W, page=PAGE, decoder_replay=True)).refusal
    assert refused.startswith("--enable-decoder-swa-bounded-replay on a pool without KV-source layers")


def test_write_mask_sends_masked_replay_rows_to_slot_zero_through_compressor_out_loc():
    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    s, F, L = 2 * PAGE, 6 * PAGE, 6 * PAGE + 100
    other = (1000, 50, None)  # a plain extend in the same batch
    rows = [other, (s, L - s, _plan(s, F))]
    keep, floor = dsv4_forward_fields(rows, W, PAGE), dsv4_window_floor(rows)
    n = 50 + (L - s)
    fb = object.__new__(ForwardBatch)
    fb.out_cache_loc = torch.arange(10_000, 10_000 + n, dtype=torch.int64)
    fb.encoder_swa_compress_rows = keep
    loc = DeepseekV4AttnBackend._compressor_out_loc(fb)
    pos = torch.cat([torch.arange(1000, 1050), torch.arange(s, L)])
    masked = torch.zeros(n, dtype=torch.bool)
    masked[50:] = (pos[50:] >= s) & (pos[50:] < F - align_up(W, PAGE) - PAGE)
    assert masked.sum() == F - 2 * PAGE - s
    assert (loc[masked] == 0).all()  # replay rows keep the copied latents: their writes go to the padding slot
    # the last two pages before F (re-published with their C4 state rings) and rows >= F write
    assert torch.equal(loc[~masked], fb.out_cache_loc[~masked])
    assert (floor[:50] == 0).all() and (floor[50:] == s).all()


def test_window_floor_through_build_causal_swa_page_indices_only_cuts_keys_below_s():
    from sglang.kernels.ops.attention.dsv4.attn_metadata_kernels import build_causal_swa_page_indices

    s, F, L = 2 * PAGE, 4 * PAGE, 4 * PAGE + 64
    size = 8 * PAGE
    req_to_token = torch.zeros((2, size), dtype=torch.int32)
    req_to_token[1, :L] = torch.arange(PAGE, PAGE + L, dtype=torch.int32)
    full_to_swa = torch.arange(size + PAGE + 1, dtype=torch.int64) + 5
    full_to_swa[-1] = -1  # the sentinel: -1 stays -1
    floor = dsv4_window_floor([(s, L - s, _plan(s, F))])
    q = torch.arange(s, L)
    args = dict(req_to_token=req_to_token, full_to_swa_mapping=full_to_swa,
                req_pool_indices_repeated=torch.ones(L - s, dtype=torch.int64),
                seq_lens_casual=(q + 1).to(torch.int32), swa_window=W, page_index_aligned_size=64)
    floored = build_causal_swa_page_indices(**args, swa_replay_start=floor)
    plain = build_causal_swa_page_indices(**args)
    offsets = q[:, None] - torch.arange(W)[None, :]
    below = offsets < s
    assert below.any() and (floored[below] == -1).all()  # no key below s
    assert torch.equal(floored[~below], plain[~below])  # every other key as a plain window
    assert torch.equal(floored[q >= s + W - 1], plain[q >= s + W - 1])  # rows past the first window: untouched
    assert torch.equal(floored[q >= F], plain[q >= F])  # rows >= F read what a prefix hit at F reads


def test_only_the_v4_layout_of_a_real_dsv4_paged_pool_acts(dsv4_pool):
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    from devkit.testkit.cone_replay_parts import forward_unsupported

    assert dsv4_pool.kv_layout is KVLayout.V4 and forward_unsupported(dsv4_pool) is None
    dsv4_pool.kv_layout = KVLayout.V41
    try:
        why = forward_unsupported(dsv4_pool)
        assert why.startswith("DeepSeek-V4 KV layout v41:") and "\n" not in why
        assert forward_unsupported(dsv4_pool, standin=True) is None  # the test-only key: act anyway
    finally:
        dsv4_pool.kv_layout = KVLayout.V4


def test_dsv4_layouts_the_cone_cannot_replay_are_refused_with_one_line_naming_the_feature(dsv4_pool):
    from devkit.testkit.cone_replay_parts import forward_unsupported

    cases = {"_unified_kv": "unified KV ring", "request_window": "--enable-encoder-swa-bounded-replay"}
    for attr, named in cases.items():
        old = getattr(dsv4_pool, attr)
        setattr(dsv4_pool, attr, object())
        try:
            assert named in forward_unsupported(dsv4_pool, standin=True)
        finally:
            setattr(dsv4_pool, attr, old)
    assert forward_unsupported(dsv4_pool, standin=True) is None
    assert forward_unsupported(dsv4_pool) is None  # V4 layout: it acts
