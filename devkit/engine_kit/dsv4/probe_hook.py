"""What the DSV4 kit's scheduler probes (:mod:`.cone_probe`, :mod:`.kv_park_probe`) share (devkit only).

A probe module is run as the server's main module (:func:`launch_server`). SGLang starts its
scheduler with multiprocessing ``spawn``, which re-imports that main module in the child (as
``__mp_main__``), so the probe installs itself there too; :func:`after_import` then patches the
model runner module once it has executed, whichever process imports it.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType

RUNNER = "sglang.srt.model_executor.model_runner"


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, patch: Callable[[ModuleType], None]):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def after_import(patch: Callable[[ModuleType], None], name: str = RUNNER) -> None:
    """Run ``patch(module)`` on ``name`` now if it is imported, else right after its body runs."""
    if name in sys.modules:
        patch(sys.modules[name])
    elif not any(isinstance(f, _Finder) and f.patch is patch for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(name, patch))


def launch_server() -> None:
    """``sglang.launch_server`` with the calling probe module kept as ``__main__`` (alter_sys=False), so
    the spawned scheduler re-imports the probe."""
    import runpy

    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


def after_extend_forward(module: ModuleType, marker: str, hook: Callable[..., None]) -> None:
    """Wrap ``module.ModelRunner.forward`` once (``marker`` names this probe's wrapper): after every
    extend forward, ``hook(runner, forward_batch, output)``; the output is returned unchanged."""
    cls = module.ModelRunner
    if getattr(cls.forward, marker, False):
        return
    original = cls.forward

    @functools.wraps(original)
    def forward(self, forward_batch, *args, **kwargs):
        out = original(self, forward_batch, *args, **kwargs)
        if forward_batch.forward_mode.is_extend():
            hook(self, forward_batch, out)
        return out

    setattr(forward, marker, True)
    cls.forward = forward
