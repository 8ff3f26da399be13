"""SGLang 0.5.23 captures CUDA graphs after serving starts; the capture lock is built on what it uses.

Read from the pinned SGLang's source (no import of the model runner, no GPU): if a release drops
or changes one of these paths, this test says which, and ``adapter.switches.kv_park.capture``'s
docstring (which lists them) must be revisited.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch

from adapter.switches.kv_park import capture

SRT = Path(importlib.util.find_spec("sglang").origin).parent / "srt"


def _source(rel: str) -> str:
    return (SRT / rel).read_text()


@pytest.mark.parametrize(
    ("rel", "needle"),
    [
        ("model_executor/model_runner_components/weight_updater.py", "self.recapture_cuda_graph()"),
        ("managers/scheduler_components/weight_updater.py", "recapture_cuda_graph=recv_req.recapture_cuda_graph"),
        ("disaggregation/role_switch.py", "ensure_decode_cuda_graphs("),
        ("model_executor/model_runner.py", "def _recapture_elastic_cuda_graphs"),
        ("multimodal/vit_cuda_graph_runner.py", "if graph_key not in self.block_graphs"),
    ],
    ids=["weights-update", "weights-update-request", "pd-role-switch", "elastic-ep", "vit-lazy"],
)
def test_sglang_has_each_serving_time_capture_path_the_capture_lock_is_for(rel, needle):
    assert needle in _source(rel), f"{rel}: {needle!r} is gone; revisit adapter/switches/kv_park/capture.py"


def test_the_decode_and_vit_captures_use_the_default_global_mode():
    full = _source("model_executor/runner_backend/full_cuda_graph_backend.py")
    vit = _source("multimodal/vit_cuda_graph_runner.py")
    assert "graph_ctx = self._device_module.graph" in full and "capture_error_mode" not in full
    assert "torch.cuda.graph(graph)" in vit and "capture_error_mode" not in vit


def test_the_serving_time_metadata_glue_capture_is_thread_local_and_needs_no_lock():
    glue = _source("model_executor/runner/metadata_glue_graph.py")
    assert re.search(
        r'torch\.cuda\.graph\(\s*graph, stream=self\._capture_stream, capture_error_mode="thread_local"', glue
    )
    assert "thread_local" not in capture.LOCKED_MODES


def test_torch_graph_capture_goes_through_the_capture_begin_and_capture_end_the_lock_wraps():
    enter = inspect.getsource(torch.cuda.graphs.graph.__enter__)
    leave = inspect.getsource(torch.cuda.graphs.graph.__exit__)
    assert "self.cuda_graph.capture_begin(" in enter and "capture_error_mode=self.capture_error_mode" in enter
    assert "self.cuda_graph.capture_end()" in leave
    params = inspect.signature(torch.cuda.CUDAGraph.capture_begin).parameters
    assert list(params)[:3] == ["self", "pool", "capture_error_mode"]
    assert params["capture_error_mode"].default == "global"


def test_kv_park_puts_its_capture_lock_on_torchs_capture_seam_until_uninstalled():
    from adapter.core import boot

    graphs = importlib.import_module("torch.cuda.graphs")
    stock = (vars(graphs.CUDAGraph)["capture_begin"], vars(graphs.CUDAGraph)["capture_end"])
    for module in ("sglang.srt.managers.schedule_batch", "sglang.srt.managers.scheduler",
                   "sglang.srt.mem_cache.deepseek_v4_memory_pool", "sglang.srt.mem_cache.deepseek_v4_compress_state"):
        importlib.import_module(module)
    state = boot.install({"DSV41_KV_PARK": "ram"})
    try:
        assert state.outcomes["kv_park"].status == "installed", state.outcomes["kv_park"].reason
        assert state.outcomes["kv_park"].params["capture_lock"] == "global"
        begin, end = vars(graphs.CUDAGraph)["capture_begin"], vars(graphs.CUDAGraph)["capture_end"]
        assert begin._self_wrapper is capture.locked_capture_begin and end._self_wrapper is capture.locked_capture_end
    finally:
        boot.uninstall()
    assert (vars(graphs.CUDAGraph)["capture_begin"], vars(graphs.CUDAGraph)["capture_end"]) == stock
