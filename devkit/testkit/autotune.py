"""Drive SGLang's real ``flashinfer_autotune_context`` on CPU.

The context runs for real (FlashInfer's real ``AutoTuner`` loads and saves the cache file); only
what needs a GPU is replaced: the cache path (it reads the device's compute capability), the
CUDA stream primitives (no device), and the TP group (a one-rank group).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from pathlib import Path

TARGET = "sglang.srt.model_executor.runner.flashinfer_autotune"


class _NoStream:
    def wait_stream(self, other: object) -> None:
        pass


@contextlib.contextmanager
def cpu_autotune_seams(cache_path: Path) -> Iterator[types.ModuleType]:
    """Yield the real autotune module with its GPU-only seams pointed at ``cache_path`` and CPU."""
    import importlib

    import torch
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
    module = importlib.import_module(TARGET)
    saved_path_fn, saved_stream = module.flashinfer_autotune_cache_path, torch.cuda.current_stream
    def cache_path_here(model_runner):  # the real one asks the CUDA device for its arch
        return cache_path

    cache_path_here.__wrapped__ = saved_path_fn  # a stand-in like a wrapper: pins look through it
    module.flashinfer_autotune_cache_path = cache_path_here
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    try:
        with runtime_context.get_parallel().override(tp_group=types.SimpleNamespace(world_size=1)):
            yield module
    finally:
        module.flashinfer_autotune_cache_path = saved_path_fn
        torch.cuda.current_stream = saved_stream


def cpu_model_runner() -> types.SimpleNamespace:
    """The attributes ``flashinfer_autotune_context`` reads from its model runner."""
    return types.SimpleNamespace(device="cpu", forward_stream=_NoStream(), is_draft_worker=False)


def run_boot(module: types.ModuleType) -> None:
    """One boot's autotune pass: enter and leave the (possibly wrapped) real context."""
    with module.flashinfer_autotune_context(cpu_model_runner(), run_lm_head=False):
        pass
