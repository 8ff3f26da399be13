"""Served vs stock decisions of the native SWA decode switch, through SGLang's real DSV4 SM120 decode
entry (``flash_mla_with_kvcache_sm120`` -> the wrapped ``_flash_mla_flashinfer``) with CPU tensors.

The served path's launch needs an SM120 GPU, so the loaded module object is stubbed at the seam
(``swa_native_decode._load_module``; the manifest and sha256 checks before it are real). The stock
path's two GPU-only steps (the Triton page split, FlashInfer's CUDA paged attention) are stand-ins
that do the same in torch, so the real stock body runs. Both stand-ins compute the reference decode.
"""

from __future__ import annotations

import importlib
import logging
from types import SimpleNamespace

import pytest
import torch

from adapter.core import boot, receipts
from adapter.switches.native_decode import switch as snd
from devkit.engine_kit.dsv4 import native_decode_stand_ins as stand_ins
from devkit.reference import dsv4_decode as ref
from devkit.testkit import native_decode as kit

TARGET = "sglang.kernels.ops.attention.flash_mla_sm120"
FI_SPARSE = "flashinfer.mla._sparse_mla_sm120"
REAL_DEVICE_ARCH = snd._device_arch  # before any test replaces it


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def case():
    return ref.decode_case(3, heads=16, pages_per_request=4, seed=11)


@pytest.fixture
def log():
    handler = _Lines()
    logger = receipts.logger()
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.fixture
def seams(tmp_path, monkeypatch):
    """GPU stand-ins in place, the module folder written; nothing installed yet."""
    target = importlib.import_module(TARGET)
    stock = stand_ins.StockSeams()
    monkeypatch.setattr(target, "_split_kv_pages_to_64", stock.split)
    monkeypatch.setattr(importlib.import_module(FI_SPARSE), "_sparse_mla_sm120_paged_attention", stock.paged_attention)
    stub = stand_ins.StubModule()
    monkeypatch.setattr(snd, "_device_arch", lambda: "sm_120a")
    monkeypatch.setattr(snd, "_load_module", lambda path: stub)
    kit.write_module_dir(tmp_path / "mod")
    env = {"DSV41_SWA_NATIVE_DECODE": "1", "DSV41_NATIVE_DECODE_DIR": str(tmp_path / "mod")}
    return SimpleNamespace(target=target, stock=stock, stub=stub, env=env, dir=tmp_path / "mod")


@pytest.fixture
def installed(seams):
    state = boot.install(seams.env)
    outcome = state.outcomes["swa_native_decode"]
    assert outcome.status == "installed", outcome.reason
    assert outcome.params["arch"] == "sm_120a" and outcome.params["page"] == 256
    return seams


def _fallbacks(log: _Lines) -> list[str]:
    return [line for line in log.lines if "swa_native_decode fallback" in line]


def test_a_decode_sized_dsv4_call_on_256_token_pages_reads_the_pool_in_place(installed, case, log):
    kwargs = kit.sglang_kwargs(case)
    out, lse = installed.target.flash_mla_with_kvcache_sm120(**kwargs)
    installed.target.flash_mla_with_kvcache_sm120(**kwargs)
    assert installed.stock.split_calls == [] and installed.stock.attention_calls == []
    assert len(installed.stub.calls) == 2 and snd.stats["served"] == 2
    call = installed.stub.calls[0]
    kv = call["kv"]
    assert kv.data_ptr() == case.pool.data_ptr(), "the pool itself, not a copy"
    assert kv.dtype == torch.uint8 and kv.shape == (case.pool.shape[0], 256, 1, 584)
    assert kv.stride() == (149760, 584, 584, 1)
    assert call["indices"].shape == case.indices.shape and call["extra_indices"].shape == case.extra_indices.shape
    assert call["num_splits"] == 128 // 64 + 512 // 64
    # split-K scratch is sized by the loaded module's own decode_scratch_heads (FlashInfer's C++ rule in
    # the real .so; the stand-in answers heads + 5, a value no rule of the switch's would give)
    scratch = 16 + stand_ins.SCRATCH_HEADS_MARK
    assert call["mid_out"].shape == (3, scratch, 10, 512) and call["mid_lse"].shape == (3, scratch, 10)
    assert installed.stub.scratch_queries[0] == 16
    assert call["cpb"] == -1, "no FlashInfer calibration on CPU: the C++ wave heuristic, as the stock planner"
    assert call["lse_scale"] == 1.0 and call["sm_scale"] == case.sm_scale
    assert out.shape == (3, 1, 16, 512) and lse is None
    serving = [line for line in log.lines if "swa_native_decode serving" in line]
    assert len(serving) == 1 and "arch=sm_120a" in serving[0] and _fallbacks(log) == []


def test_served_and_stock_paths_return_identical_outputs_when_both_kernels_are_the_reference(installed, case):
    kwargs = kit.sglang_kwargs(case)
    served, _ = installed.target.flash_mla_with_kvcache_sm120(**kwargs)
    stock_entry = installed.target._flash_mla_flashinfer.__wrapped__
    stock, _ = stock_entry(kwargs["q"], kwargs["k_cache"], kwargs["indices"], case.topk_length, case.attn_sink, 512,
                           case.sm_scale, kwargs["extra_k_cache"], kwargs["extra_indices_in_kvcache"],
                           case.extra_topk_length)  # fmt: skip
    assert len(installed.stock.split_calls) == 1 and len(installed.stock.attention_calls) == 1
    assert installed.stock.attention_calls[0]["kv"].shape[1] == 64
    assert torch.equal(served, stock)
    assert torch.count_nonzero(served) > 0


def _variant(case: ref.DecodeCase, name: str) -> dict:
    kwargs = kit.sglang_kwargs(case)
    if name == "page-size-64":
        kwargs["k_cache"] = ref.kernel_view(ref.split_pages(case.pool, 256), 64)
    elif name == "page-stride-149768":
        pool = torch.zeros(case.pool.shape[0], 149768, dtype=torch.uint8)
        pool[:, :149760] = case.pool
        kwargs["k_cache"] = ref.kernel_view(pool, 256)
    elif name == "q-dtype":
        kwargs["q"] = kwargs["q"].to(torch.float16)
    elif name == "indices-dtype":
        kwargs["indices"] = kwargs["indices"].to(torch.int64)
    elif name == "heads-130":
        kwargs["q"] = torch.zeros(3, 1, 130, 512, dtype=torch.bfloat16)
        kwargs["attn_sink"] = torch.zeros(130)
    elif name == "attn-sink":
        kwargs["attn_sink"] = kwargs["attn_sink"].to(torch.bfloat16)
    else:
        raise AssertionError(name)
    return kwargs


@pytest.mark.parametrize(
    "reason",
    ["page-size-64", "page-stride-149768", "q-dtype", "indices-dtype", "heads-130", "attn-sink"],
)
def test_a_call_the_module_does_not_serve_keeps_the_stock_copy_path_and_logs_its_reason_once(installed, case, log, reason):
    kwargs = _variant(case, reason)
    for _ in range(2):
        installed.target.flash_mla_with_kvcache_sm120(**kwargs)
    assert installed.stub.calls == []
    assert len(installed.stock.attention_calls) == 2
    assert snd.stats[f"fallback:{reason}"] == 2
    lines = _fallbacks(log)
    assert len(lines) == 1 and f"reason={reason} " in lines[0]


def _v41_pool(pages: int, width: int) -> torch.Tensor:
    pool = torch.zeros(pages, 256 * width, dtype=torch.uint8)
    return pool.view(pages, 256, 1, width)


@pytest.mark.parametrize("width", [528, 288])
@pytest.mark.parametrize("rows", [3, 65])
def test_a_pool_with_v41_rows_is_refused_loudly_and_never_reaches_the_stock_copy(installed, case, log, width, rows):
    big = case if rows == 3 else ref.decode_case(65, heads=8, window=16, topk=64, pages_per_request=1, seed=3)
    kwargs = kit.sglang_kwargs(big)
    kwargs["k_cache"] = _v41_pool(big.pool.shape[0], width)
    for _ in range(2):
        with pytest.raises(snd.UnsupportedKVLayout, match=f"{width}-byte") as raised:
            installed.target.flash_mla_with_kvcache_sm120(**kwargs)
    assert "584-byte" in str(raised.value) and "select_dsv4_kv_layout" in str(raised.value)
    assert installed.stock.split_calls == [] and installed.stock.attention_calls == [] and installed.stub.calls == []
    refused = [line for line in log.lines if "swa_native_decode refused:" in line]
    assert len(refused) == 1 and f"{width}-byte" in refused[0]
    assert snd.stats[f"refused:kv-layout-{width}"] == 2 and _fallbacks(log) == []


def test_decode_form_calls_of_more_than_64_rows_keep_the_stock_prefill_copy_and_log_it_once(installed, log):
    big = ref.decode_case(65, heads=8, window=16, topk=64, pages_per_request=1, seed=3)
    kwargs = kit.sglang_kwargs(big)
    outs = [installed.target.flash_mla_with_kvcache_sm120(**kwargs)[0] for _ in range(2)]
    assert installed.stub.calls == [] and len(installed.stock.split_calls) == 2
    assert installed.stock.attention_calls[0]["kv"].shape[1] == 64, "the stock prefill reads the 64-token copy"
    assert installed.stock.attention_calls[0]["mid_out"] is None, "the prefill form: no split-K scratch"
    assert snd.stats["fallback:rows-over-64"] == 2
    lines = _fallbacks(log)
    assert len(lines) == 1 and "reason=rows-over-64" in lines[0]
    assert torch.equal(outs[0], outs[1]) and torch.count_nonzero(outs[0]) > 0


def test_more_rows_than_the_decode_kernel_takes_fall_back(installed):
    big = ref.decode_case(65, heads=8, window=16, topk=64, pages_per_request=1, seed=3)
    kwargs = kit.sglang_kwargs(big)
    installed.target._flash_mla_flashinfer(kwargs["q"], kwargs["k_cache"], kwargs["indices"], big.topk_length,
                                           big.attn_sink, 512, big.sm_scale, kwargs["extra_k_cache"],
                                           kwargs["extra_indices_in_kvcache"], big.extra_topk_length)  # fmt: skip
    assert installed.stub.calls == [] and snd.stats["fallback:rows-65"] == 1


def test_flashinfer_autotune_passes_take_the_stock_path(installed, case, log):
    from flashinfer.autotuner import autotune

    with autotune(True):
        installed.target.flash_mla_with_kvcache_sm120(**kit.sglang_kwargs(case))
    installed.target.flash_mla_with_kvcache_sm120(**kit.sglang_kwargs(case))
    assert snd.stats["fallback:autotune"] == 1 and snd.stats["served"] == 1
    assert len(installed.stock.attention_calls) == 1


def test_distinct_reasons_are_each_logged_once(installed, case, log):
    for name in ("page-size-64", "q-dtype", "page-size-64", "q-dtype", "page-size-64"):
        installed.target.flash_mla_with_kvcache_sm120(**_variant(case, name))
    lines = _fallbacks(log)
    assert len(lines) == 2
    assert snd.stats["fallback:page-size-64"] == 3 and snd.stats["fallback:q-dtype"] == 2
    for line in lines:
        parsed = receipts.parse_line(line)
        assert parsed is not None and parsed.switch == "swa_native_decode" and parsed.event == "fallback"


def test_a_call_the_module_guard_refuses_runs_the_stock_path_and_logs_the_guard_message_once(installed, case, log):
    installed.stub.refuse = "Check failed: dsv41 native decode is built for page_block_size=256, got 128"
    for _ in range(2):
        out, _ = installed.target.flash_mla_with_kvcache_sm120(**kit.sglang_kwargs(case))
    assert len(installed.stub.calls) == 2 and len(installed.stock.attention_calls) == 2
    lines = _fallbacks(log)
    assert len(lines) == 1 and "reason=guard-refused" in lines[0]
    assert "detail=Check_failed:_dsv41_native_decode_is_built_for_page_block_size=256,_got_128" in lines[0]
    assert torch.count_nonzero(out) > 0


def test_uninstall_restores_the_stock_entry(installed, case):
    boot.uninstall()
    assert not hasattr(installed.target._flash_mla_flashinfer, "__wrapped__")
    assert not hasattr(installed.target._flash_mla_sm120_prefill, "__wrapped__")
    installed.target.flash_mla_with_kvcache_sm120(**kit.sglang_kwargs(case))
    assert installed.stub.calls == [] and len(installed.stock.attention_calls) == 1


def test_install_refuses_when_the_sm120_decode_backend_is_not_flashinfer(seams, monkeypatch):
    monkeypatch.setattr(seams.target, "_sm120_default_backend", "triton")
    state = boot.install(seams.env)
    outcome = state.outcomes["swa_native_decode"]
    assert outcome.status == "refused" and "backend is 'triton'" in outcome.reason
    assert not hasattr(seams.target._flash_mla_flashinfer, "__wrapped__")


def test_install_refuses_on_a_device_arch_the_module_is_not_built_for(seams, monkeypatch):
    monkeypatch.setattr(snd, "_device_arch", REAL_DEVICE_ARCH)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    state = boot.install(seams.env)
    outcome = state.outcomes["swa_native_decode"]
    assert outcome.status == "n/a"
    assert outcome.reason == "not applicable here: unknown arch sm_90: the module is built for sm_120a, sm_121a"


def test_install_refuses_a_module_whose_sha256_does_not_match_and_never_loads_it(seams, monkeypatch):
    loads = []
    monkeypatch.setattr(snd, "_load_module", lambda path: loads.append(path) or seams.stub)
    (seams.dir / "dsv4_native_p256_sm120a.so").write_bytes(b"tampered")
    state = boot.install(seams.env)
    outcome = state.outcomes["swa_native_decode"]
    assert outcome.status == "refused" and outcome.reason.startswith("sha256 mismatch for dsv4_native_p256_sm120a.so")
    assert loads == [] and not hasattr(seams.target._flash_mla_flashinfer, "__wrapped__")



@pytest.fixture
def sm120(monkeypatch):
    """SGLang's DSV4 pool-layout choice as it runs on an SM120 device (its only device probe, faked)."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=256))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (12, 0))
    monkeypatch.delenv("SGLANG_DSV4_KV_LAYOUT", raising=False)
    return importlib.import_module("sglang.srt.mem_cache.deepseek_v4_memory_pool")


def test_on_sm120_every_dsv4_family_pool_is_the_584_byte_v4_layout_the_switch_serves(sm120, monkeypatch):
    KVLayout = sm120.KVLayout
    layout, option = sm120.select_dsv4_kv_layout()  # no checkpoint input: V4 and V4.1 alike
    assert layout is KVLayout.V4 and option is None
    assert sm120.DeepSeekV4SingleKVPool.kv_layout is KVLayout.V4
    for mode in ("v41", "v41_new"):  # the 528/288-byte layouts need an SM100/SM103 GPU
        monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", mode)
        with pytest.raises(AssertionError, match="SM100 / SM103"):
            sm120.select_dsv4_kv_layout()
